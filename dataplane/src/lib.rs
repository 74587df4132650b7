//! wirespan-dataplane: kernel adapters for the mesh.
//!
//! Each adapter takes a complete desired state, reads what the kernel has, and applies
//! the smallest diff: WireGuard (kernel or userspace backend), the nftables marking
//! table, policy routing, and a netlink watcher. The crate knows nothing of resources
//! or discovery: plain desired-state structs in, observed state out.
//!
//! The adapters are blocking (they run `nft`, talk to a UAPI socket, or wait for a
//! netlink thread); call them from `spawn_blocking` in async code. Every adapter works
//! in a given [`netns::Netns`].

pub mod error;
/// In-memory doubles of every adapter, for controller tests only: compiled under `cfg(test)`
/// or the `testing` feature, which dev-dependencies enable and the product never does.
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub mod fastpath;
/// The bodies of the cargo-fuzz targets of this crate's code (`fuzzing` feature).
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod kernel_marking;
pub mod marking;
pub mod markspec;
pub mod netns;
#[doc(hidden)]
pub mod nfnl;
pub mod routing;
pub mod sysctl;
pub mod userspace_wireguard;
pub mod watch;
pub mod wireguard;

pub use error::Invalid;
/// Re-exported: the prefix type of every desired-state struct.
pub use ipnet;

/// WireGuard listen port (upstream default).
pub const DEFAULT_LISTEN_PORT: u16 = 51820;
/// Mark WireGuard sets on its own encrypted UDP.
pub const DEVICE_FWMARK: u32 = 0x20;
/// Mark that sends a packet into the mesh.
pub const MESH_MARK: u32 = 0x40;
/// Mask covering both marks.
pub const MARK_MASK: u32 = 0x60;
/// Policy rule priority.
pub const RULE_PRIORITY: u32 = 32500;
/// Routing table of the mesh.
pub const ROUTE_TABLE: u32 = 180;
/// Default link MTU.
pub const DEFAULT_MTU: u32 = 1420;
/// Smallest accepted MTU (IPv6 minimum).
pub const MIN_MTU: u32 = 1280;
