//! An upstream (Talos) discovery publisher written from `docs/discovery-protocol.md` alone: the
//! payload messages of §4, the blob cryptography of §5 and the transport messages of
//! §2–§3 sent with a plain gRPC client. Nothing here uses the project's discovery code.

use std::net::{IpAddr, SocketAddr};

use aes::cipher::{Array, BlockCipherEncrypt, KeyInit};
use aes_gcm::{aead::Aead, Aes256Gcm};
use tonic::codegen::http::uri::PathAndQuery;

/// `sidero.discovery.client.Affiliate` (§4).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Affiliate {
    #[prost(string, tag = "1")]
    pub node_id: String,
    #[prost(bytes = "vec", repeated, tag = "2")]
    pub addresses: Vec<Vec<u8>>,
    #[prost(string, tag = "3")]
    pub hostname: String,
    #[prost(string, tag = "4")]
    pub nodename: String,
    #[prost(string, tag = "5")]
    pub machine_type: String,
    #[prost(string, tag = "6")]
    pub operating_system: String,
    #[prost(message, optional, tag = "7")]
    pub kubespan: Option<KubeSpan>,
    #[prost(message, optional, tag = "8")]
    pub control_plane: Option<ControlPlane>,
}

/// `sidero.discovery.client.KubeSpan` as Talos with discovery-api v0.1.8 sends it (§4).
#[derive(Clone, PartialEq, prost::Message)]
pub struct KubeSpan {
    #[prost(string, tag = "1")]
    pub public_key: String,
    #[prost(bytes = "vec", tag = "2")]
    pub address: Vec<u8>,
    #[prost(message, repeated, tag = "3")]
    pub additional_addresses: Vec<IpPrefix>,
    /// The number is the documented presumption (§4), written here independently of
    /// the project's constant: a change there must be a deliberate change here too.
    #[prost(message, repeated, tag = "4")]
    pub exclude_advertised_addresses: Vec<IpPrefix>,
}

/// `sidero.discovery.client.Affiliate` as Talos before discovery-api v0.1.8 reads it:
/// its `KubeSpan` has no field 4.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LegacyAffiliate {
    #[prost(string, tag = "1")]
    pub node_id: String,
    #[prost(bytes = "vec", repeated, tag = "2")]
    pub addresses: Vec<Vec<u8>>,
    #[prost(string, tag = "4")]
    pub nodename: String,
    #[prost(message, optional, tag = "7")]
    pub kubespan: Option<LegacyKubeSpan>,
}

/// `KubeSpan` before discovery-api v0.1.8.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LegacyKubeSpan {
    #[prost(string, tag = "1")]
    pub public_key: String,
    #[prost(bytes = "vec", tag = "2")]
    pub address: Vec<u8>,
    #[prost(message, repeated, tag = "3")]
    pub additional_addresses: Vec<IpPrefix>,
}

/// `sidero.discovery.client.IPPrefix`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct IpPrefix {
    #[prost(bytes = "vec", tag = "1")]
    pub ip: Vec<u8>,
    #[prost(uint32, tag = "2")]
    pub bits: u32,
}

/// `sidero.discovery.client.Endpoint`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Endpoint {
    #[prost(bytes = "vec", tag = "1")]
    pub ip: Vec<u8>,
    #[prost(uint32, tag = "2")]
    pub port: u32,
}

/// `sidero.discovery.client.ControlPlane`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ControlPlane {
    #[prost(uint32, tag = "1")]
    pub api_server_port: u32,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Duration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `sidero.discovery.server.HelloRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub cluster_id: String,
    #[prost(string, tag = "2")]
    pub client_version: String,
}

/// `sidero.discovery.server.RedirectMessage`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RedirectMessage {
    #[prost(string, tag = "1")]
    pub endpoint: String,
}

/// `sidero.discovery.server.HelloResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloResponse {
    #[prost(message, optional, tag = "1")]
    pub redirect: Option<RedirectMessage>,
    #[prost(bytes = "vec", tag = "2")]
    pub client_ip: Vec<u8>,
}

/// `sidero.discovery.server.AffiliateUpdateRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct AffiliateUpdateRequest {
    #[prost(string, tag = "1")]
    pub cluster_id: String,
    #[prost(string, tag = "2")]
    pub affiliate_id: String,
    #[prost(bytes = "vec", optional, tag = "3")]
    pub affiliate_data: Option<Vec<u8>>,
    #[prost(bytes = "vec", repeated, tag = "4")]
    pub affiliate_endpoints: Vec<Vec<u8>>,
    #[prost(message, optional, tag = "5")]
    pub ttl: Option<Duration>,
}

/// `sidero.discovery.server.AffiliateUpdateResponse` (empty).
#[derive(Clone, PartialEq, prost::Message)]
pub struct AffiliateUpdateResponse {}

/// IP bytes as the spec wants them: 4 for IPv4, 16 for IPv6.
pub fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

/// §5.1: `nonce ‖ AES-256-GCM(protobuf) ‖ tag`, a fresh random nonce, no associated data.
pub fn seal_affiliate(key: &[u8; 32], affiliate: &Affiliate) -> Vec<u8> {
    seal_affiliate_with_nonce(key, rand::random(), affiliate)
}

/// [`seal_affiliate`] with a given nonce (for the spec's vector only).
pub fn seal_affiliate_with_nonce(
    key: &[u8; 32],
    nonce: [u8; 12],
    affiliate: &Affiliate,
) -> Vec<u8> {
    let sealed = Aes256Gcm::new(&Array::from(*key))
        .encrypt(
            &Array::from(nonce),
            prost::Message::encode_to_vec(affiliate).as_slice(),
        )
        .expect("AES-GCM encryption of a small message");
    [nonce.as_slice(), &sealed].concat()
}

/// §5.2: `len(pb) ‖ pb`, zero-padded to a multiple of 16, each block AES-256 (ECB).
pub fn seal_endpoint(key: &[u8; 32], endpoint: SocketAddr) -> Vec<u8> {
    let pb = prost::Message::encode_to_vec(&Endpoint {
        ip: ip_bytes(endpoint.ip()),
        port: u32::from(endpoint.port()),
    });
    let mut pt = vec![u8::try_from(pb.len()).expect("an endpoint is short")];
    pt.extend_from_slice(&pb);
    pt.resize(pt.len().div_ceil(16) * 16, 0);
    let aes = aes::Aes256::new(&Array::from(*key));
    pt.chunks(16)
        .flat_map(|chunk| {
            let mut block = Array::from(<[u8; 16]>::try_from(chunk).expect("16-byte chunks"));
            aes.encrypt_block(&mut block);
            block.to_vec()
        })
        .collect()
}

const SERVICE: &str = "/sidero.discovery.server.Cluster/";

/// One unary call of the discovery service at `server` (plaintext h2c).
async fn call<Req, Resp>(server: SocketAddr, method: &str, req: Req) -> Result<Resp, String>
where
    Req: prost::Message + Send + Sync + 'static,
    Resp: prost::Message + Default + Send + Sync + 'static,
{
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(std::time::Duration::from_secs(5))
        .timeout(std::time::Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| format!("connecting to {server}: {e}"))?;
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| e.to_string())?;
    let path = PathAndQuery::try_from(format!("{SERVICE}{method}")).map_err(|e| e.to_string())?;
    grpc.unary(
        tonic::Request::new(req),
        path,
        tonic_prost::ProstCodec::<Req, Resp>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
    .map_err(|s| format!("{method}: {s}"))
}

/// What a Talos node does to publish itself: Hello (the server reflects our address),
/// then one AffiliateUpdate with the sealed data and endpoints. Returns the reflected
/// client IP.
pub async fn publish(
    server: SocketAddr,
    cluster_id: &str,
    key: &[u8; 32],
    affiliate: &Affiliate,
    endpoints: &[SocketAddr],
) -> Result<Vec<u8>, String> {
    let hello: HelloResponse = call(
        server,
        "Hello",
        HelloRequest {
            cluster_id: cluster_id.to_owned(),
            client_version: "v1.12.0".to_owned(),
        },
    )
    .await?;
    if let Some(r) = hello.redirect {
        return Err(format!("unexpected redirect to {}", r.endpoint));
    }
    let _: AffiliateUpdateResponse = call(
        server,
        "AffiliateUpdate",
        AffiliateUpdateRequest {
            cluster_id: cluster_id.to_owned(),
            affiliate_id: affiliate.node_id.clone(),
            affiliate_data: Some(seal_affiliate(key, affiliate)),
            affiliate_endpoints: endpoints.iter().map(|e| seal_endpoint(key, *e)).collect(),
            ttl: Some(Duration {
                seconds: 1800,
                nanos: 0,
            }),
        },
    )
    .await?;
    Ok(hello.client_ip)
}
