//! What a remote caller may do ([`authorize`]) and where its request goes: served
//! here, or forwarded to another node of the cluster ([`Proxy`]).
//!
//! A request names its target node in the `x-wirespan-node` header (absent: this
//! node). For another node, this node (the endpoint) forwards it to the target's API at
//! the target's mesh address, so it travels inside WireGuard, presenting its own node
//! certificate and the caller's role in `x-wirespan-role`, with `x-wirespan-hops: 1`.
//! The target trusts `x-wirespan-role` only from a node certificate connecting from a
//! mesh address, checks the role again, and never forwards a request that was already
//! forwarded (a loop). A target that is not a member of the cluster is refused.

use std::{
    convert::Infallible,
    future::Future,
    net::IpAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use http::{HeaderValue, Request, Response};
use tonic::{body::Body, Status};

use super::{
    pki::Role,
    remote::{self, Caller, SharedMaterial},
};
use crate::{
    resources::cluster::Affiliate,
    runtime::{Filter, ResourceKind as _, Store},
};

/// The target node of a request (hostname, node name or address).
pub const NODE_HEADER: &str = "x-wirespan-node";
/// The original caller's role on a forwarded request.
pub const ROLE_HEADER: &str = "x-wirespan-role";
/// How many times a request was forwarded.
pub const HOPS_HEADER: &str = "x-wirespan-hops";

/// Whether `role` may call the method at `path` (a reader may call neither the
/// [`super::MUTATING_METHODS`] nor the [`super::SECRET_METHODS`]).
///
/// # Errors
/// `PermissionDenied` for a reader calling a mutating method.
pub fn authorize(path: &str, role: Role) -> Result<(), Status> {
    if role == Role::Reader && super::needs_admin(path) {
        return Err(Status::permission_denied(format!(
            "role reader may not call {path}: an admin certificate is required"
        )));
    }
    Ok(())
}

/// The role a request acts with: the certificate's, or for a node certificate the
/// forwarded caller's (only over the mesh).
///
/// # Errors
/// `PermissionDenied` for a node certificate without a forwarded role, or from outside
/// the mesh.
pub fn effective_role(
    caller: &Caller,
    forwarded: Option<&str>,
    mesh: Option<ipnet::IpNet>,
) -> Result<Role, Status> {
    if caller.role != Role::Node {
        return Ok(caller.role);
    }
    let over_mesh = mesh.is_some_and(|m| m.trunc().contains(&caller.remote.ip()));
    if !over_mesh {
        return Err(Status::permission_denied(
            "a node certificate is accepted only for requests forwarded over the mesh",
        ));
    }
    match forwarded.and_then(Role::parse) {
        Some(r @ (Role::Admin | Role::Reader)) => Ok(r),
        _ => Err(Status::permission_denied(
            "a forwarded request must carry the caller's role (admin or reader)",
        )),
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Served by this node.
    Local,
    /// Forwarded to a member at its mesh address; `name` is checked against its
    /// certificate.
    Forward {
        /// The target's mesh address.
        address: IpAddr,
        /// The target's hostname.
        name: String,
    },
}

/// A cluster member as a proxy target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Hostname (FQDN).
    pub hostname: String,
    /// Node name.
    pub nodename: String,
    /// Advertised addresses.
    pub addresses: Vec<IpAddr>,
    /// Mesh address, if the node runs the mesh.
    pub mesh: Option<IpAddr>,
}

impl Member {
    fn matches(&self, target: &str) -> bool {
        let short = self.hostname.split('.').next().unwrap_or_default();
        let ip: Option<IpAddr> = target.parse().ok();
        target == self.hostname
            || target == self.nodename
            || target == short
            || ip.is_some_and(|ip| self.addresses.contains(&ip) || self.mesh == Some(ip))
    }
}

/// Decides where a request for `target` goes (pure: the node's own names and the
/// members are passed in).
///
/// # Errors
/// `FailedPrecondition` for a loop (a forwarded request for another node),
/// `PermissionDenied` for a target that is not a member (or has no mesh address).
pub fn route(
    target: Option<&str>,
    hops: u32,
    own_names: &[String],
    members: &[Member],
) -> Result<Route, Status> {
    let Some(target) = target.filter(|t| !t.is_empty()) else {
        return Ok(Route::Local);
    };
    if own_names.iter().any(|n| n == target) {
        return Ok(Route::Local);
    }
    if hops > 0 {
        return Err(Status::failed_precondition(format!(
            "proxy loop: a request already forwarded {hops} time(s) names another node ({target})"
        )));
    }
    let member = members.iter().find(|m| m.matches(target));
    match member.and_then(|m| m.mesh.map(|a| (a, m))) {
        Some((address, m)) => Ok(Route::Forward {
            address,
            name: m.hostname.clone(),
        }),
        None => Err(Status::permission_denied(format!(
            "node {target:?} is not a member of this cluster with a mesh address: not forwarded"
        ))),
    }
}

/// Forwards requests to other nodes.
#[derive(Debug)]
pub struct Proxy {
    store: Store,
    port: u16,
    material: SharedMaterial,
}

impl Proxy {
    /// A proxy reading members from `store` and dialling other nodes' API on `port`
    /// (every node listens on the same port) with this node's certificate.
    #[must_use]
    pub fn new(store: Store, port: u16, material: SharedMaterial) -> Self {
        Self {
            store,
            port,
            material,
        }
    }

    fn own_names(&self) -> Vec<String> {
        let host = remote::hostname();
        let short = host.split('.').next().unwrap_or_default().to_owned();
        let mut names = vec![host, short, "localhost".to_owned()];
        names.extend(remote::local_addresses().iter().map(ToString::to_string));
        names
    }

    fn members(&self) -> Vec<Member> {
        self.store
            .list::<Affiliate>(Affiliate::DEFAULT_NAMESPACE, &Filter::all())
            .iter()
            .map(|a| Member {
                hostname: a.spec.hostname.clone(),
                nodename: a.spec.nodename.clone(),
                addresses: a.spec.addresses.clone(),
                mesh: a.spec.kubespan.as_ref().and_then(|k| k.address),
            })
            .collect()
    }

    fn decide(&self, req: &Request<Body>) -> Result<Route, Status> {
        let caller = req
            .extensions()
            .get::<Caller>()
            .ok_or_else(|| Status::unauthenticated("no verified client certificate"))?;
        let header = |name| req.headers().get(name).and_then(|v| v.to_str().ok());
        let path = req.uri().path();
        let role = effective_role(
            caller,
            header(ROLE_HEADER),
            remote::mesh_prefix(&self.store),
        )
        .and_then(|role| authorize(path, role).map(|()| role))
        .inspect_err(|s| {
            tracing::warn!(remote = %caller.remote, name = %caller.name, role = caller.role.as_str(), method = path, reason = s.message(), "API request refused");
        })?;
        let hops = header(HOPS_HEADER)
            .and_then(|h| h.parse().ok())
            .unwrap_or(0);
        route(header(NODE_HEADER), hops, &self.own_names(), &self.members())
            .inspect(|r| {
                if let Route::Forward { address, .. } = r {
                    tracing::debug!(role = role.as_str(), method = path, to = %address, "forwarding API request");
                }
            })
            .inspect_err(|s| {
                tracing::warn!(remote = %caller.remote, method = path, reason = s.message(), "API request not forwarded");
            })
    }

    async fn forward(
        &self,
        mut req: Request<Body>,
        address: IpAddr,
        name: String,
    ) -> Result<Response<Body>, Status> {
        let role = req
            .extensions()
            .get::<Caller>()
            .map(|c| c.role)
            .and_then(|r| match r {
                Role::Node => None,
                r => Some(r),
            })
            .ok_or_else(|| {
                Status::permission_denied("a forwarded request is not forwarded again")
            })?;
        let m = self
            .material
            .read()
            .ok()
            .and_then(|m| m.clone())
            .ok_or_else(|| Status::unavailable("this node has no API certificate"))?;
        let tls = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&m.ca_cert_pem))
            .identity(tonic::transport::Identity::from_pem(
                &m.issued.cert_pem,
                m.issued.key_pem.expose(),
            ))
            .domain_name(name.clone());
        let unavailable = |e: &dyn std::fmt::Display| {
            Status::unavailable(format!("forwarding to {name} ({address}): {e}"))
        };
        let uri = format!("https://{}", std::net::SocketAddr::new(address, self.port));
        let channel = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|e| unavailable(&e))?
            .tls_config(tls)
            .map_err(|e| unavailable(&e))?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| unavailable(&e))?;
        let headers = req.headers_mut();
        headers.insert(ROLE_HEADER, HeaderValue::from_static(role.as_str()));
        headers.insert(HOPS_HEADER, HeaderValue::from_static("1"));
        let mut channel = channel;
        let resp = tower::ServiceExt::ready(&mut channel)
            .await
            .map_err(|e| unavailable(&e))?;
        tower::Service::call(resp, req)
            .await
            .map_err(|e| unavailable(&e))
    }
}

/// The tower layer putting [`Gate`] in front of the service.
#[derive(Debug, Clone)]
pub struct GateLayer {
    proxy: Arc<Proxy>,
}

impl GateLayer {
    /// A gate using `proxy`.
    #[must_use]
    pub fn new(proxy: Arc<Proxy>) -> Self {
        Self { proxy }
    }
}

impl<S> tower::Layer<S> for GateLayer {
    type Service = Gate<S>;
    fn layer(&self, inner: S) -> Gate<S> {
        Gate {
            inner,
            proxy: Arc::clone(&self.proxy),
        }
    }
}

/// Checks each request's role, then serves it here or forwards it.
#[derive(Debug, Clone)]
pub struct Gate<S> {
    inner: S,
    proxy: Arc<Proxy>,
}

type GateFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S> tower::Service<Request<Body>> for Gate<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = GateFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> GateFuture {
        match self.proxy.decide(&req) {
            Ok(Route::Local) => Box::pin(self.inner.call(req)),
            Ok(Route::Forward { address, name }) => {
                let proxy = Arc::clone(&self.proxy);
                Box::pin(async move {
                    Ok(proxy
                        .forward(req, address, name)
                        .await
                        .unwrap_or_else(Status::into_http))
                })
            }
            Err(status) => Box::pin(async move { Ok(status.into_http()) }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const APPLY: &str = "/wirespan.resource.v1.ResourceService/ApplyConfig";
    const LIST: &str = "/wirespan.resource.v1.ResourceService/List";

    fn caller(role: Role, ip: &str) -> Caller {
        Caller {
            role,
            name: "c".into(),
            remote: std::net::SocketAddr::new(ip.parse().unwrap(), 1234),
        }
    }

    #[test]
    fn readers_may_not_mutate() {
        assert!(authorize(LIST, Role::Reader).is_ok());
        assert!(authorize(APPLY, Role::Admin).is_ok());
        let e = authorize(APPLY, Role::Reader).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        for method in ["ConfirmConfig", "GetConfig"] {
            let path = format!("/wirespan.resource.v1.ResourceService/{method}");
            let e = authorize(&path, Role::Reader).unwrap_err();
            assert_eq!(e.code(), tonic::Code::PermissionDenied, "{method}");
            assert!(authorize(&path, Role::Admin).is_ok(), "{method}");
        }
    }

    #[test]
    fn a_forwarded_role_counts_only_from_a_node_over_the_mesh() {
        let mesh = Some("fd7a::1/64".parse().unwrap());
        let admin = caller(Role::Admin, "10.0.0.1");
        assert_eq!(
            effective_role(&admin, Some("reader"), mesh).unwrap(),
            Role::Admin
        );
        let reader = caller(Role::Reader, "10.0.0.1");
        assert_eq!(
            effective_role(&reader, Some("admin"), mesh).unwrap(),
            Role::Reader,
            "a client cannot raise its own role"
        );
        let node = caller(Role::Node, "fd7a::2");
        assert_eq!(
            effective_role(&node, Some("reader"), mesh).unwrap(),
            Role::Reader
        );
        assert!(effective_role(&node, None, mesh).is_err());
        assert!(effective_role(&node, Some("node"), mesh).is_err());
        let outside = caller(Role::Node, "10.0.0.2");
        assert!(effective_role(&outside, Some("admin"), mesh).is_err());
    }

    #[test]
    fn routes_refuse_strangers_and_loops() {
        let own = vec!["node1".to_owned()];
        let members = vec![Member {
            hostname: "node2.lab".into(),
            nodename: "node2".into(),
            addresses: vec!["10.0.0.2".parse().unwrap()],
            mesh: Some("fd7a::2".parse().unwrap()),
        }];
        assert_eq!(route(None, 0, &own, &members).unwrap(), Route::Local);
        assert_eq!(
            route(Some("node1"), 1, &own, &members).unwrap(),
            Route::Local
        );
        let fwd = Route::Forward {
            address: "fd7a::2".parse().unwrap(),
            name: "node2.lab".into(),
        };
        for t in ["node2", "node2.lab", "10.0.0.2", "fd7a::2"] {
            assert_eq!(route(Some(t), 0, &own, &members).unwrap(), fwd, "{t}");
        }
        let e = route(Some("node9"), 0, &own, &members).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        let e = route(Some("node2"), 1, &own, &members).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
    }
}
