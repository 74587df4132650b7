//! wirespan-dataplane: kernel adapters for the mesh.
//!
//! Each adapter takes a complete desired state, reads what the kernel has, and applies
//! the smallest diff: WireGuard (kernel or userspace backend), the nftables marking
//! table, policy routing, and a netlink watcher. The crate knows nothing of resources
//! or discovery: plain desired-state structs in, observed state out.
