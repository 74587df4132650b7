//! Lab topologies: which nodes sit behind which kind of NAT, which pairs cannot
//! exchange UDP at all, and from that which pairs can connect directly. Pure: parsing,
//! the built-in shorthands, the reachability rule and the routers' nftables rules.
//!
//! File format (YAML), node `nodeI` being the I-th entry of `nodes`:
//!
//! ```yaml
//! nodes:
//!   - nat: none        # on the underlay directly (the "public internet")
//!   - nat: cone        # behind a port-preserving NAT router
//!   - nat: symmetric   # behind a NAT that maps each destination to a new port
//! block:               # pairs that exchange no UDP (the discovery server still works)
//!   - [node1, node2]
//! ```

use std::net::{IpAddr, Ipv4Addr};

use serde::{Deserialize, Serialize};

/// Most nodes a lab may have (addresses are `.11` to `.74`).
pub const MAX_NODES: usize = 64;

/// The name of node `i` (from 1).
#[must_use]
pub fn node_name(i: usize) -> String {
    format!("node{i}")
}

/// Where a node sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Nat {
    /// Public: on the underlay directly.
    #[default]
    None,
    /// Behind a NAT router whose mapping keeps the source port and does not depend
    /// on the destination; it filters by destination address and port (what Linux
    /// conntrack does: a "port-restricted cone").
    Cone,
    /// Behind a NAT router that picks a random source port for every destination.
    Symmetric,
}

impl Nat {
    /// The name used in files, `lab status` and JSON.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Cone => "cone",
            Self::Symmetric => "symmetric",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "none" => Some(Self::None),
            "cone" => Some(Self::Cone),
            "symmetric" => Some(Self::Symmetric),
            _ => None,
        }
    }
}

/// Names `--topology` accepts besides a file.
pub const BUILTIN: [&str; 4] = ["flat", "cone", "symmetric", "mixed"];

/// A lab's topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// The built-in name or the file it came from.
    pub name: String,
    /// Per node (index 0 is `node1`), where it sits.
    pub nodes: Vec<Nat>,
    /// Pairs of node indices (from 0, smaller first) that exchange no UDP.
    pub blocked: Vec<(usize, usize)>,
}

/// Where node `i` (from 1) sits in the `mixed` topology: public, cone, cone,
/// symmetric, repeating.
#[must_use]
pub fn mixed_nat(i: usize) -> Nat {
    match i % 4 {
        1 => Nat::None,
        2 | 3 => Nat::Cone,
        _ => Nat::Symmetric,
    }
}

/// The built-in topology `name` with `n` nodes, as if written in a file.
#[must_use]
pub fn builtin(name: &str, n: usize) -> Option<Topology> {
    let nat = match name {
        "flat" => |_| Nat::None,
        "cone" => |_| Nat::Cone,
        "symmetric" => |_| Nat::Symmetric,
        "mixed" => mixed_nat,
        _ => return None,
    };
    Some(Topology {
        name: name.to_owned(),
        nodes: (1..=n).map(nat).collect(),
        blocked: Vec::new(),
    })
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileNode {
    nat: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    nodes: Vec<FileNode>,
    #[serde(default)]
    block: Vec<Vec<String>>,
}

/// Parses a topology file (`name`: how to call it).
///
/// # Errors
/// A message naming the field in error.
pub fn parse(name: &str, text: &str) -> Result<Topology, String> {
    let file: File = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    if file.nodes.is_empty() || file.nodes.len() > MAX_NODES {
        return Err(format!(
            "nodes: {} entries; a lab has 1 to {MAX_NODES} nodes",
            file.nodes.len()
        ));
    }
    let nodes = file
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            Nat::parse(&n.nat).ok_or_else(|| {
                format!(
                    "nodes[{i}].nat: {:?} is not a NAT kind (none, cone, symmetric)",
                    n.nat
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let index = |b: usize, k: usize, s: &str| -> Result<usize, String> {
        s.strip_prefix("node")
            .and_then(|d| d.parse::<usize>().ok())
            .filter(|i| (1..=nodes.len()).contains(i) && s == node_name(*i))
            .map(|i| i - 1)
            .ok_or_else(|| {
                format!(
                    "block[{b}][{k}]: no node {s:?} (the topology has node1 to node{})",
                    nodes.len()
                )
            })
    };
    let mut blocked = Vec::new();
    for (b, pair) in file.block.iter().enumerate() {
        let [x, y] = pair.as_slice() else {
            return Err(format!(
                "block[{b}]: a pair of two node names, not {} names",
                pair.len()
            ));
        };
        let (x, y) = (index(b, 0, x)?, index(b, 1, y)?);
        if x == y {
            return Err(format!("block[{b}]: a node cannot be blocked from itself"));
        }
        let p = (x.min(y), x.max(y));
        if !blocked.contains(&p) {
            blocked.push(p);
        }
    }
    Ok(Topology {
        name: name.to_owned(),
        nodes,
        blocked,
    })
}

/// Why a pair cannot connect without a relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeedsRelay {
    /// The topology blocks UDP between them.
    Blocked,
    /// Both behind symmetric NATs.
    SymmetricBoth,
    /// One behind a symmetric NAT, the other behind a cone NAT.
    SymmetricAndCone,
}

impl NeedsRelay {
    /// Short reason for status output.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Blocked => "UDP blocked between them",
            Self::SymmetricBoth => "symmetric NAT on both sides",
            Self::SymmetricAndCone => "symmetric NAT facing a cone NAT",
        }
    }
}

impl Topology {
    /// The direct-reachability rule for nodes `a` and `b` (indices from 0): a pair
    /// connects directly unless UDP is blocked between them or both are behind NAT
    /// and one of the NATs is symmetric. A public node receives from anyone, and
    /// WireGuard roams to whatever source a handshake comes from; two cone NATs open
    /// each other by simultaneous open (each sends to the other's observed address
    /// and fixed port; WireGuard retries). A symmetric NAT's mapping for the other
    /// node's address has a port nobody learns, and the other side filters by port,
    /// so a NAT on the far side never lets it in.
    ///
    /// # Errors
    /// Why the pair needs a relay.
    pub fn direct(&self, a: usize, b: usize) -> Result<(), NeedsRelay> {
        if self.blocked.contains(&(a.min(b), a.max(b))) {
            return Err(NeedsRelay::Blocked);
        }
        match (self.nodes[a], self.nodes[b]) {
            (Nat::Symmetric, Nat::Symmetric) => Err(NeedsRelay::SymmetricBoth),
            (Nat::Symmetric, Nat::Cone) | (Nat::Cone, Nat::Symmetric) => {
                Err(NeedsRelay::SymmetricAndCone)
            }
            _ => Ok(()),
        }
    }

    /// The nodes that reach both `a` and `b` directly: the pair's possible peer relays.
    #[must_use]
    pub fn relays(&self, a: usize, b: usize) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&c| c != a && c != b && self.direct(a, c).is_ok() && self.direct(b, c).is_ok())
            .collect()
    }

    /// Every unordered pair that needs a relay, with the reason.
    #[must_use]
    pub fn unreachable(&self) -> Vec<(usize, usize, NeedsRelay)> {
        let n = self.nodes.len();
        (0..n)
            .flat_map(|a| (a + 1..n).map(move |b| (a, b)))
            .filter_map(|(a, b)| self.direct(a, b).err().map(|r| (a, b, r)))
            .collect()
    }
}

/// The NAT router's WAN link (on the underlay bridge).
pub const ROUTER_WAN_LINK: &str = "eth0";
/// The NAT router's LAN link (to its node).
pub const ROUTER_LAN_LINK: &str = "lan0";

/// The router of node `i` (from 1): its namespace role.
#[must_use]
pub fn router_role(i: usize) -> String {
    format!("router{i}")
}

/// The LAN behind node `i`'s router: the router's address and the node's, in a /24
/// of their own (each LAN distinct, so a LAN address published by one node is
/// never another node's).
#[must_use]
pub fn lan_addresses(i: usize) -> (Ipv4Addr, Ipv4Addr) {
    let net = u8::try_from(i).expect("at most MAX_NODES nodes");
    (
        Ipv4Addr::new(192, 168, net, 1),
        Ipv4Addr::new(192, 168, net, 2),
    )
}

/// The nftables ruleset of a NAT router: source NAT on the WAN link, a stateful
/// firewall in front of the router and its LAN. Unsolicited packets are dropped in
/// the input hook, before conntrack confirms an entry for them, so an early packet
/// from a peer leaves no entry that would later clash with the node's own mapping
/// and force a new port.
#[must_use]
pub fn router_nft(nat: Nat) -> String {
    let masquerade = match nat {
        // Linux keeps the source port when it is free: endpoint-independent mapping.
        Nat::None | Nat::Cone => "masquerade",
        // A random port per connection, i.e. per destination.
        Nat::Symmetric => "masquerade fully-random",
    };
    format!(
        "table ip wirespan_lab_nat {{\n\
         \tchain postrouting {{\n\
         \t\ttype nat hook postrouting priority srcnat; policy accept;\n\
         \t\toifname \"{ROUTER_WAN_LINK}\" {masquerade}\n\
         \t}}\n\
         \tchain input {{\n\
         \t\ttype filter hook input priority filter; policy drop;\n\
         \t\tiif \"lo\" accept\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"{ROUTER_LAN_LINK}\" accept\n\
         \t}}\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy drop;\n\
         \t\tct state established,related accept\n\
         \t\tiifname \"{ROUTER_LAN_LINK}\" oifname \"{ROUTER_WAN_LINK}\" accept\n\
         \t}}\n\
         }}\n"
    )
}

/// The underlay's ruleset for blocked pairs, given each pair's public addresses:
/// UDP between them is dropped on the bridge (TCP, the discovery server's, passes).
/// `None` when nothing is blocked.
#[must_use]
pub fn block_nft(pairs: &[(Vec<IpAddr>, Vec<IpAddr>)]) -> Option<String> {
    if pairs.is_empty() {
        return None;
    }
    let mut rules = String::new();
    for (a, b) in pairs {
        for (x, y) in [(a, b), (b, a)] {
            for s in x {
                for d in y.iter().filter(|d| d.is_ipv4() == s.is_ipv4()) {
                    let fam = if s.is_ipv4() { "ip" } else { "ip6" };
                    rules.push_str(&format!(
                        "\t\t{fam} saddr {s} {fam} daddr {d} meta l4proto udp counter drop\n"
                    ));
                }
            }
        }
    }
    Some(format!(
        "table bridge wirespan_lab_block {{\n\
         \tchain forward {{\n\
         \t\ttype filter hook forward priority filter; policy accept;\n\
         {rules}\t}}\n\
         }}\n"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_shorthands_for_files() {
        let file = "nodes:\n  - nat: none\n  - nat: cone\n  - nat: cone\n  - nat: symmetric\n  - nat: none\n";
        let mut parsed = parse("mixed", file).unwrap();
        assert_eq!(builtin("mixed", 5).unwrap(), parsed);
        parsed.nodes = vec![Nat::None; 2];
        assert_eq!(builtin("flat", 2).unwrap().nodes, parsed.nodes);
        assert_eq!(builtin("cone", 3).unwrap().nodes, [Nat::Cone; 3]);
        assert_eq!(builtin("symmetric", 2).unwrap().nodes, [Nat::Symmetric; 2]);
        assert!(builtin("star", 3).is_none());
        assert!(builtin("./flat.yaml", 3).is_none());
    }

    #[test]
    fn parse_errors_name_the_field() {
        let cases = [
            ("nodes: []", "nodes: 0 entries"),
            (
                "nodes:\n  - nat: full\n",
                "nodes[0].nat: \"full\" is not a NAT kind",
            ),
            ("nodes:\n  - nat: cone\n    port: 1\n", "port"),
            ("nodez: []\n", "nodez"),
            ("nodes:\n  - {}\n", "nat"),
            (
                "nodes:\n  - nat: cone\n  - nat: none\nblock:\n  - [node1, node3]\n",
                "block[0][1]: no node \"node3\"",
            ),
            (
                "nodes:\n  - nat: cone\nblock:\n  - [node01, node1]\n",
                "block[0][0]: no node \"node01\"",
            ),
            (
                "nodes:\n  - nat: cone\n  - nat: none\nblock:\n  - [node1]\n",
                "block[0]: a pair of two node names, not 1",
            ),
            (
                "nodes:\n  - nat: cone\n  - nat: none\nblock:\n  - [node2, node2]\n",
                "block[0]: a node cannot be blocked from itself",
            ),
        ];
        for (text, want) in cases {
            let err = parse("t", text).unwrap_err();
            assert!(err.contains(want), "{text:?}: {err:?} lacks {want:?}");
        }
    }

    #[test]
    fn the_direct_rule_needs_relays_only_for_blocked_and_symmetric_pairs_behind_nat() {
        let t = parse(
            "t",
            "nodes:\n  - nat: none\n  - nat: cone\n  - nat: cone\n  - nat: symmetric\n  - nat: symmetric\n  - nat: none\n\
             block:\n  - [node6, node1]\n  - [node1, node6]\n",
        )
        .unwrap();
        assert_eq!(t.blocked, [(0, 5)]);
        // Public with anyone, cone with cone: direct.
        for (a, b) in [(0, 1), (0, 3), (1, 2), (3, 0), (5, 4)] {
            assert_eq!(t.direct(a, b), Ok(()), "{a} {b}");
        }
        assert_eq!(t.direct(5, 0), Err(NeedsRelay::Blocked));
        assert_eq!(t.direct(3, 4), Err(NeedsRelay::SymmetricBoth));
        assert_eq!(t.direct(2, 3), Err(NeedsRelay::SymmetricAndCone));
        assert_eq!(t.direct(4, 1), Err(NeedsRelay::SymmetricAndCone));
        assert_eq!(
            t.unreachable(),
            [
                (0, 5, NeedsRelay::Blocked),
                (1, 3, NeedsRelay::SymmetricAndCone),
                (1, 4, NeedsRelay::SymmetricAndCone),
                (2, 3, NeedsRelay::SymmetricAndCone),
                (2, 4, NeedsRelay::SymmetricAndCone),
                (3, 4, NeedsRelay::SymmetricBoth),
            ]
        );
        assert!(builtin("flat", 5).unwrap().unreachable().is_empty());
        assert!(builtin("cone", 5).unwrap().unreachable().is_empty());
    }

    #[test]
    fn routers_masquerade_by_kind_and_blocks_cover_both_directions() {
        assert!(router_nft(Nat::Cone).contains("oifname \"eth0\" masquerade\n"));
        assert!(router_nft(Nat::Symmetric).contains("masquerade fully-random"));
        assert!(router_nft(Nat::Cone).contains("policy drop"));
        assert_eq!(block_nft(&[]), None);
        let a: Vec<IpAddr> = vec![
            "10.99.1.11".parse().unwrap(),
            "fd99:1ab::b".parse().unwrap(),
        ];
        let b: Vec<IpAddr> = vec!["10.99.1.12".parse().unwrap()];
        let rules = block_nft(&[(a, b)]).unwrap();
        assert!(rules.contains("ip saddr 10.99.1.11 ip daddr 10.99.1.12 meta l4proto udp"));
        assert!(rules.contains("ip saddr 10.99.1.12 ip daddr 10.99.1.11 meta l4proto udp"));
        // No rule mixes families.
        assert!(!rules.contains("fd99"));
    }
}
