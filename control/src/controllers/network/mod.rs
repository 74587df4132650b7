//! Network controllers (`docs/runtime.md` §4–§6): merge raw specs, apply the
//! merged ones to the kernel through the data plane adapter, publish what the kernel
//! has, and derive the node's addresses and hostname.
//!
//! ```text
//! config controller ─┐ network-config/XSpec <layer>/<key>   (Shared)
//! mesh manager ──────┘
//!   XMergeController ─▶ network/XSpec <key>
//!   XSpecController (Strong, finalizer) ─▶ kernel (NetworkConfig adapter)
//!   kernel ─(netlink)─▶ NetworkStatusController ─▶ Link/Address/Route/RoutingRuleStatus
//!   NodeAddressController ─▶ NodeAddress default/current/routed/accumulative[-<filter>]
//!   Hostname/Resolver/TimeServer: merge ─▶ HostSpecController ─▶ host files, UTS name
//!   HostStatusController ─▶ HostnameStatus, ResolverStatus, TimeServerStatus
//!   NetworkReadinessController ─▶ NetworkStatus status (address, connectivity, hostname, mesh)
//! ```

pub mod config;
pub mod host;
pub mod merge;
pub mod node_address;
pub mod readiness;
pub mod spec;
pub mod status;
pub mod sweep;

use std::sync::{Arc, Mutex};

use futures::{stream::BoxStream, StreamExt as _};
use wirespan_dataplane::{
    netns::Netns,
    routing::{scope, NetworkConfig, RouteKind},
};

use crate::{
    resources::network::{AddressSpec, LinkSpec, RouteSpec, RouteType, RoutingRuleSpec, Scope},
    runtime::{RegistrationError, Runtime},
};

/// The network adapter, shared by the spec and status controllers.
pub type SharedNetwork = Arc<Mutex<dyn NetworkConfig>>;

/// A source of "something changed in the kernel" notifications (netlink events).
pub trait KernelEvents: Send + Sync + 'static {
    /// A new subscription.
    ///
    /// # Errors
    /// The watch socket could not be opened.
    fn subscribe(&self) -> std::io::Result<BoxStream<'static, ()>>;
}

/// Netlink link, address, route and rule events of one namespace.
#[derive(Debug, Clone)]
pub struct NetlinkFeed(pub Netns);

impl KernelEvents for NetlinkFeed {
    fn subscribe(&self) -> std::io::Result<BoxStream<'static, ()>> {
        let w = wirespan_dataplane::watch::Watcher::start(&self.0, false)?;
        Ok(w.map(|_| ()).boxed())
    }
}

#[cfg(any(test, feature = "testing"))]
impl KernelEvents for wirespan_dataplane::fake::FakeNetwork {
    fn subscribe(&self) -> std::io::Result<BoxStream<'static, ()>> {
        let rx = wirespan_dataplane::fake::FakeNetwork::subscribe(self);
        Ok(tokio_stream::wrappers::WatchStream::from_changes(rx)
            .map(|_| ())
            .boxed())
    }
}

/// `RT_SCOPE_*` of a scope.
#[must_use]
pub fn scope_number(s: Scope) -> u8 {
    match s {
        Scope::Global => scope::UNIVERSE,
        Scope::Site => scope::SITE,
        Scope::Link => scope::LINK,
        Scope::Host => scope::HOST,
    }
}

/// Scope of an `RT_SCOPE_*` number (unknown numbers count as host).
#[must_use]
pub fn scope_of(n: u8) -> Scope {
    match n {
        scope::UNIVERSE => Scope::Global,
        scope::SITE => Scope::Site,
        scope::LINK => Scope::Link,
        _ => Scope::Host,
    }
}

/// The kernel adapter's route type of a spec's (the one mapping, with
/// [`route_type_of`]; the adapter's is `RouteKind` because rtnetlink has a `RouteType`).
#[must_use]
pub fn route_kind(t: RouteType) -> RouteKind {
    match t {
        RouteType::Unicast => RouteKind::Unicast,
        RouteType::Blackhole => RouteKind::Blackhole,
        RouteType::Unreachable => RouteKind::Unreachable,
        RouteType::Prohibit => RouteKind::Prohibit,
    }
}

/// A spec's route type of the kernel adapter's.
#[must_use]
pub fn route_type_of(k: RouteKind) -> RouteType {
    match k {
        RouteKind::Unicast => RouteType::Unicast,
        RouteKind::Blackhole => RouteType::Blackhole,
        RouteKind::Unreachable => RouteType::Unreachable,
        RouteKind::Prohibit => RouteType::Prohibit,
    }
}

/// Reads the kernel's network state through the adapter, off the async workers (the
/// netlink dump blocks).
pub(crate) async fn read_state(
    net: &SharedNetwork,
) -> Result<wirespan_dataplane::routing::NetworkState, crate::runtime::ControllerError> {
    let net = net.clone();
    tokio::task::spawn_blocking(move || {
        net.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .state()
    })
    .await
    .map_err(crate::runtime::ControllerError::other)?
    .map_err(crate::runtime::ControllerError::other)
}

/// What the network family needs.
#[derive(Clone)]
pub struct Deps {
    /// The adapter for the namespace the daemon runs in.
    pub net: SharedNetwork,
    /// Its change events.
    pub feed: Arc<dyn KernelEvents>,
}

impl std::fmt::Debug for Deps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deps").finish_non_exhaustive()
    }
}

/// Registers every network controller: config → merge → spec → kernel, statuses,
/// node addresses, and the host family (host name, resolvers, time servers) on the
/// process's own host.
///
/// # Errors
/// Registration conflicts.
pub fn register(runtime: &mut Runtime, deps: &Deps) -> Result<(), RegistrationError> {
    register_with_resync(runtime, deps, spec::RESYNC)
}

/// [`register`] with the host family acting on `host` (its files under another root:
/// `wirespan node --host-root`).
///
/// # Errors
/// Registration conflicts.
pub fn register_on_host(
    runtime: &mut Runtime,
    deps: &Deps,
    host: &host::HostDeps,
) -> Result<(), RegistrationError> {
    register_all(runtime, deps, (spec::RESYNC, sweep::SWEEP_SETTLE), host)
}

/// [`register`] with another resync period of the spec controllers (tests).
///
/// # Errors
/// Registration conflicts.
pub fn register_with_resync(
    runtime: &mut Runtime,
    deps: &Deps,
    resync: std::time::Duration,
) -> Result<(), RegistrationError> {
    register_all(
        runtime,
        deps,
        (resync, sweep::SWEEP_SETTLE),
        &host::HostDeps::real(),
    )
}

/// [`register`] with another settle time of the spec controllers' start-up sweep
/// (tests).
///
/// # Errors
/// Registration conflicts.
pub fn register_with_sweep_settle(
    runtime: &mut Runtime,
    deps: &Deps,
    settle: std::time::Duration,
) -> Result<(), RegistrationError> {
    register_all(
        runtime,
        deps,
        (spec::RESYNC, settle),
        &host::HostDeps::real(),
    )
}

/// `timing`: the spec controllers' resync period and sweep settle time.
fn register_all(
    runtime: &mut Runtime,
    deps: &Deps,
    timing: (std::time::Duration, std::time::Duration),
    host: &host::HostDeps,
) -> Result<(), RegistrationError> {
    let (resync, settle) = timing;
    runtime.register(config::NetworkConfigController)?;
    runtime.register(merge::MergeController::<LinkSpec>::new())?;
    runtime.register(merge::MergeController::<AddressSpec>::new())?;
    runtime.register(merge::MergeController::<RouteSpec>::new())?;
    runtime.register(merge::MergeController::<RoutingRuleSpec>::new())?;
    runtime.register(spec::SpecController::<LinkSpec>::with_timing(
        deps.clone(),
        resync,
        settle,
    ))?;
    runtime.register(spec::SpecController::<AddressSpec>::with_timing(
        deps.clone(),
        resync,
        settle,
    ))?;
    runtime.register(spec::SpecController::<RouteSpec>::with_timing(
        deps.clone(),
        resync,
        settle,
    ))?;
    runtime.register(spec::SpecController::<RoutingRuleSpec>::with_timing(
        deps.clone(),
        resync,
        settle,
    ))?;
    runtime.register(status::NetworkStatusController::new(deps.clone()))?;
    runtime.register(node_address::NodeAddressController::default())?;
    host::register(runtime, host)?;
    runtime.register(readiness::NetworkReadinessController)?;
    Ok(())
}
