//! The bodies of this crate's cargo-fuzz targets (`fuzz/fuzz_targets/`), one function
//! per target, each taking the fuzzer's raw input and panicking on a broken property.
//! The targets only call these, and the stable suite's `tests/fuzz_replay.rs` (root
//! package) runs every committed corpus and regression input of each target through
//! the same function. Structured inputs are decoded from the bytes with `arbitrary`
//! exactly as libFuzzer's `fuzz_target!` does. Compiled only with the `fuzzing`
//! feature.

use std::{
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use arbitrary::{Arbitrary, Unstructured};
use futures::{FutureExt, StreamExt};
use prost::Message;
use rand::{rngs::StdRng, SeedableRng};
use tokio_util::sync::CancellationToken;
use tonic::Request;

use crate::{
    client::{
        crypto::{Cipher, ClusterSecret},
        model::{decode_endpoint, encode_endpoint, AffiliateInfo},
    },
    proto::server::{self as pb, cluster_server::Cluster},
    server::{
        service::ClusterService,
        shared::Shared,
        snapshot,
        state::{Counts, State},
        ServerConfig,
    },
};

/// `data` as a `T`, as `fuzz_target!` builds a typed input (`None`: too short, which
/// the fuzzer skips too).
fn structured<'a, T: Arbitrary<'a>>(data: &'a [u8]) -> Option<T> {
    T::arbitrary_take_rest(Unstructured::new(data)).ok()
}

// ---- discovery_rpc ----

/// IDs mostly from a small set so that requests meet the same cluster and affiliate.
#[derive(Arbitrary, Debug)]
enum Id {
    Small(u8),
    Any(String),
}

impl Id {
    fn get(&self) -> String {
        match self {
            Id::Small(n) => format!("id{}", n % 4),
            Id::Any(s) => s.clone(),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Op {
    Hello {
        cluster: Id,
        version: String,
        real_ip: Option<String>,
        forwarded_for: Option<String>,
    },
    Update {
        cluster: Id,
        affiliate: Id,
        data: Option<Vec<u8>>,
        endpoints: Vec<Vec<u8>>,
        ttl: Option<(i64, i32)>,
    },
    Delete {
        cluster: Id,
        affiliate: Id,
    },
    List {
        cluster: Id,
    },
    /// Opens a Watch and takes its first message; the stream stays open.
    Watch {
        cluster: Id,
    },
    /// Takes every ready message of one open Watch stream.
    Drain {
        which: u8,
    },
    /// Closes one open Watch stream (client went away).
    Close {
        which: u8,
    },
    /// A request of method `method % 5` decoded from raw protobuf bytes.
    Raw {
        method: u8,
        bytes: Vec<u8>,
    },
    /// A GC pass `secs` seconds in the future.
    Gc {
        secs: u32,
    },
}

/// An open Watch, fused: a stream that ended (the server closed it) answers `None`
/// from then on instead of being polled past its end, which the `Stream` contract
/// forbids and tonic never does.
type Stream = futures::stream::Fuse<<ClusterService as Cluster>::WatchStream>;

fn drain(stream: &mut Stream) {
    while let Some(Some(item)) = stream.next().now_or_never() {
        if item.is_err() {
            break;
        }
    }
}

async fn watch(svc: &ClusterService, req: pb::WatchRequest, open: &mut Vec<Stream>) {
    if let Ok(resp) = svc.watch(Request::new(req)).await {
        let mut stream = resp.into_inner().fuse();
        // The first message (snapshot or error) is always ready at once.
        let first = stream.next().now_or_never();
        assert!(first.is_some(), "first Watch message not ready");
        if open.len() < 8 {
            open.push(stream);
        }
    }
}

async fn run_rpc(ops: Vec<Op>) {
    let config = ServerConfig {
        // Rate limiting sleeps; it has its own unit tests.
        rate_limit: false,
        redirect_endpoint: Some("discovery.example:443".into()),
        watch_queue: 4,
        ..ServerConfig::default()
    };
    let svc = ClusterService {
        shared: Arc::new(Shared::new(config, State::new(), CancellationToken::new())),
    };
    let mut open: Vec<Stream> = Vec::new();
    for op in ops {
        match op {
            Op::Hello {
                cluster,
                version,
                real_ip,
                forwarded_for,
            } => {
                let mut req = Request::new(pb::HelloRequest {
                    cluster_id: cluster.get(),
                    client_version: version,
                });
                for (name, value) in [("x-real-ip", real_ip), ("x-forwarded-for", forwarded_for)] {
                    if let Some(v) = value.and_then(|v| v.parse().ok()) {
                        req.metadata_mut().insert(name, v);
                    }
                }
                let _ = svc.hello(req).await;
            }
            Op::Update {
                cluster,
                affiliate,
                data,
                endpoints,
                ttl,
            } => {
                let req = pb::AffiliateUpdateRequest {
                    cluster_id: cluster.get(),
                    affiliate_id: affiliate.get(),
                    affiliate_data: data,
                    affiliate_endpoints: endpoints,
                    ttl: ttl.map(|(seconds, nanos)| prost_types::Duration { seconds, nanos }),
                };
                let _ = svc.affiliate_update(Request::new(req)).await;
            }
            Op::Delete { cluster, affiliate } => {
                let req = pb::AffiliateDeleteRequest {
                    cluster_id: cluster.get(),
                    affiliate_id: affiliate.get(),
                };
                let _ = svc.affiliate_delete(Request::new(req)).await;
            }
            Op::List { cluster } => {
                let req = pb::ListRequest {
                    cluster_id: cluster.get(),
                };
                let _ = svc.list(Request::new(req)).await;
            }
            Op::Watch { cluster } => {
                let req = pb::WatchRequest {
                    cluster_id: cluster.get(),
                };
                watch(&svc, req, &mut open).await;
            }
            Op::Drain { which } => {
                if !open.is_empty() {
                    let i = usize::from(which) % open.len();
                    drain(&mut open[i]);
                }
            }
            Op::Close { which } => {
                if !open.is_empty() {
                    let i = usize::from(which) % open.len();
                    drop(open.swap_remove(i));
                }
            }
            Op::Raw { method, bytes } => {
                let b = bytes.as_slice();
                match method % 5 {
                    0 => {
                        if let Ok(r) = pb::HelloRequest::decode(b) {
                            let _ = svc.hello(Request::new(r)).await;
                        }
                    }
                    1 => {
                        if let Ok(r) = pb::AffiliateUpdateRequest::decode(b) {
                            let _ = svc.affiliate_update(Request::new(r)).await;
                        }
                    }
                    2 => {
                        if let Ok(r) = pb::AffiliateDeleteRequest::decode(b) {
                            let _ = svc.affiliate_delete(Request::new(r)).await;
                        }
                    }
                    3 => {
                        if let Ok(r) = pb::ListRequest::decode(b) {
                            let _ = svc.list(Request::new(r)).await;
                        }
                    }
                    _ => {
                        if let Ok(r) = pb::WatchRequest::decode(b) {
                            watch(&svc, r, &mut open).await;
                        }
                    }
                }
            }
            Op::Gc { secs } => {
                let now = Instant::now() + Duration::from_secs(u64::from(secs));
                let _ = svc.shared.state().gc(now);
            }
        }
    }
    for stream in &mut open {
        drain(stream);
    }
    drop(open);

    // Whatever the requests did, the state must be savable and load back the same.
    let now = Instant::now();
    let state = svc.shared.state();
    let file = snapshot::encode_state(&state, now);
    let loaded = snapshot::read(file.as_slice(), now, SystemTime::now())
        .expect("a snapshot the server wrote must load");
    let (a, b) = (state.counts(), loaded.counts());
    assert_eq!(
        (a.clusters, a.affiliates, a.endpoints),
        (b.clusters, b.affiliates, b.endpoints)
    );
    assert_eq!(snapshot::encode_state(&loaded, now), file);
}

/// `discovery_rpc`: drives the discovery server's RPC handlers (the tonic service,
/// through the same validation and state code a network call reaches) with a
/// sequence of requests against one fresh server state: structured requests and raw
/// bytes decoded by prost. Watch streams stay open across later requests, so events,
/// slow-watcher aborts and unsubscribes are exercised too. At the end the state must
/// survive a snapshot round trip.
pub fn discovery_rpc(data: &[u8]) {
    let Some(ops) = structured::<Vec<Op>>(data) else {
        return;
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(run_rpc(ops));
}

// ---- discovery_crypto ----

#[derive(Arbitrary, Debug)]
struct CryptoInput {
    key: [u8; 32],
    /// Seed of the RNG that picks the seal nonce.
    seed: [u8; 32],
    /// Opened as an affiliate blob, an endpoint blob, and decoded as plaintext.
    blob: Vec<u8>,
}

fn check_affiliate(plain: &[u8]) {
    if let Ok(info) = AffiliateInfo::decode(plain) {
        let once = info.encode();
        let again = AffiliateInfo::decode(&once).expect("our own encoding decodes");
        assert_eq!(again.encode(), once, "affiliate encoding not stable");
    }
}

fn check_endpoint(plain: &[u8]) {
    if let Ok(ep) = decode_endpoint(plain) {
        let once = encode_endpoint(&ep);
        let again = decode_endpoint(&once).expect("our own encoding decodes");
        assert_eq!(
            encode_endpoint(&again),
            once,
            "endpoint encoding not stable"
        );
    }
}

/// `discovery_crypto`: affiliate and endpoint blobs: decrypt and decode with
/// arbitrary bytes and keys, and decode of arbitrary plaintext (random ciphertext
/// almost never authenticates, so the decoders get their own share of the input).
/// What we seal opens to the same bytes; what we decode re-encodes to a stable form.
/// Input: 32 key bytes, 32 RNG seed bytes, then the blob.
pub fn discovery_crypto(data: &[u8]) {
    let Some(input) = structured::<CryptoInput>(data) else {
        return;
    };
    let cipher = Cipher::new(&ClusterSecret::from_bytes(input.key));
    let blob = input.blob.as_slice();

    if let Ok(plain) = cipher.open_affiliate(blob) {
        check_affiliate(&plain);
    }
    if let Ok(plain) = cipher.open_endpoint(blob) {
        check_endpoint(&plain);
    }
    check_affiliate(blob);
    check_endpoint(blob);

    // Sealing then opening gives the plaintext back.
    let mut rng = StdRng::from_seed(input.seed);
    let sealed = cipher.seal_affiliate(blob, &mut rng);
    assert_eq!(cipher.open_affiliate(&sealed).expect("opens"), blob);
    match cipher.seal_endpoint(blob) {
        Ok(sealed) => assert_eq!(cipher.open_endpoint(&sealed).expect("opens"), blob),
        Err(_) => assert!(blob.len() > 255),
    }
}

// ---- snapshot_read ----

/// The state's counts without the load's own tally of dropped entries.
fn snapshot_counts(state: &State) -> Counts {
    Counts {
        snapshot_dropped: 0,
        ..state.counts()
    }
}

/// `snapshot_read`: snapshot loading (`server::snapshot::read`) of arbitrary bytes.
/// What loads must save and load again to the same file.
pub fn snapshot_read(data: &[u8]) {
    let now = Instant::now();
    // A fixed wall clock keeps legacy absolute expirations reproducible.
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let Ok(state) = snapshot::read(data, now, wall) else {
        return;
    };
    let file = snapshot::encode_state(&state, now);
    let again = snapshot::read(file.as_slice(), now, wall).expect("our own snapshot loads");
    // What the first load dropped for breaking a limit is not in the file any more.
    let first = snapshot_counts(&state);
    assert_eq!(first, snapshot_counts(&again));
    assert_eq!(snapshot::encode_state(&again, now), file);
}
