//! Pure logic of the mesh (`docs/kubespan.md`), without I/O: ULA addressing
//! (§3), prefix-set arithmetic and AllowedIPs with overlap resolution (§5), the routed
//! set (§7), peer state, endpoint pick, the rotation step and peer relays (§8), harvest
//! (§9), the planner that turns a mesh round's inputs into a plan (§8.2), and the clock
//! the controllers take time from.

pub mod clock;
pub mod peer_status;
pub mod peers;
pub mod planner;
pub mod prefixset;
pub mod relay;
pub mod rotation;
pub mod ula;
