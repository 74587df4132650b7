//! From affiliates to peers (`docs/kubespan.md` §5.2–§5.3), the routed set (§7) and harvest (§9).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use ipnet::IpNet;

use super::{
    prefixset::PrefixSet,
    ula::{is_ula, PURPOSE_KUBESPAN},
};
use crate::resources::cluster::AffiliateSpec;

/// The prefixes one affiliate claims before overlap resolution (§5.3 up to the ULA):
/// its pod CIDRs (masked) and addresses (as hosts), minus its own exclusions, plus its
/// KubeSpan address as a host. Depends on that affiliate alone, so it can be cached
/// per affiliate version.
#[must_use]
pub fn claimed_set(affiliate: &AffiliateSpec) -> PrefixSet {
    let mut set = PrefixSet::new();
    let Some(ks) = &affiliate.kubespan else {
        return set;
    };
    for p in &ks.additional_addresses {
        set.insert(&p.trunc());
    }
    for a in &affiliate.addresses {
        set.insert(&IpNet::from(*a));
    }
    for x in &ks.exclude_advertised_networks {
        set.remove(x);
    }
    if let Some(ula) = ks.address {
        set.insert(&IpNet::from(ula));
    }
    set
}

/// A peer chosen from an affiliate (§5.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selected<'a> {
    /// The peer's public key (peer ID).
    pub public_key: &'a str,
    /// The affiliate (node) ID.
    pub node_id: &'a str,
    /// The affiliate.
    pub affiliate: &'a AffiliateSpec,
}

/// Two affiliates with one public key: the first by node ID keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyConflict {
    /// The public key.
    pub public_key: String,
    /// The node that keeps it.
    pub kept: String,
    /// The node dropped.
    pub dropped: String,
}

/// Peer selection (§5.2): affiliates in node-ID order, without the local node and
/// those without a KubeSpan public key; the first node ID keeps a duplicate key.
pub fn select<'a>(
    local_node_id: &str,
    local_public_key: &str,
    affiliates: impl IntoIterator<Item = (&'a str, &'a AffiliateSpec)>,
) -> (Vec<Selected<'a>>, Vec<KeyConflict>) {
    let mut sorted: Vec<(&str, &AffiliateSpec)> = affiliates.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(b.0));
    let mut out = Vec::with_capacity(sorted.len());
    let mut by_key: BTreeMap<&str, &str> = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (node_id, aff) in sorted {
        if node_id == local_node_id {
            continue;
        }
        let Some(ks) = &aff.kubespan else { continue };
        let key = ks.public_key.as_str();
        if key.is_empty() || (!local_public_key.is_empty() && key == local_public_key) {
            continue;
        }
        if let Some(kept) = by_key.get(key) {
            conflicts.push(KeyConflict {
                public_key: key.to_owned(),
                kept: (*kept).to_owned(),
                dropped: node_id.to_owned(),
            });
            continue;
        }
        by_key.insert(key, node_id);
        out.push(Selected {
            public_key: key,
            node_id,
            affiliate: aff,
        });
    }
    (out, conflicts)
}

/// AllowedIPs of one peer after overlap resolution.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Minimal CIDR cover of what the peer keeps.
    pub allowed_ips: Vec<IpNet>,
    /// What earlier peers (node-ID order) already claimed.
    pub removed: Vec<IpNet>,
}

/// Overlap resolution (§5.3) over claimed sets in node-ID order: each peer loses what
/// earlier peers kept. Subtracting the union of earlier peers equals subtracting each
/// overlapping one, and costs O(log n) per range.
#[must_use]
pub fn resolve_overlaps<'a>(claimed: impl IntoIterator<Item = &'a PrefixSet>) -> Vec<Resolved> {
    resolve_overlaps_after(&PrefixSet::new(), claimed)
}

/// [`resolve_overlaps`] with `reserved` claimed before every peer (this node's own
/// KubeSpan address: a peer with the same one, a cloned MAC, must not take it).
#[must_use]
pub fn resolve_overlaps_after<'a>(
    reserved: &PrefixSet,
    claimed: impl IntoIterator<Item = &'a PrefixSet>,
) -> Vec<Resolved> {
    let mut earlier = reserved.clone();
    let mut out = Vec::new();
    for set in claimed {
        if earlier.overlaps(set) {
            let mut kept = set.clone();
            kept.subtract(&earlier);
            let mut removed = set.clone();
            removed.subtract(&kept);
            earlier.union(&kept);
            out.push(Resolved {
                allowed_ips: kept.to_prefixes(),
                removed: removed.to_prefixes(),
            });
        } else {
            earlier.union(set);
            out.push(Resolved {
                allowed_ips: set.to_prefixes(),
                removed: Vec::new(),
            });
        }
    }
    out
}

/// One peer's part of the routed set (§7): its AllowedIPs if it is up or
/// `force_routing`, without prefixes whose address is a KubeSpan ULA.
#[must_use]
pub fn routed_prefixes(force_routing: bool, allowed: &[IpNet], up: bool) -> Vec<IpNet> {
    if !(force_routing || up) {
        return Vec::new();
    }
    allowed
        .iter()
        .filter(|p| !(matches!(p, IpNet::V6(_)) && is_ula(p.addr(), PURPOSE_KUBESPAN)))
        .copied()
        .collect()
}

/// The routed set (§7) split by family, in peer order (stable, so one peer's change
/// moves few positions): the union of each peer's part ([`routed_prefixes`]).
pub fn routed_set<'a>(parts: impl IntoIterator<Item = &'a [IpNet]>) -> (Vec<IpNet>, Vec<IpNet>) {
    let (mut v4, mut v6) = (Vec::new(), Vec::new());
    for p in parts.into_iter().flatten() {
        match p {
            IpNet::V4(_) => v4.push(*p),
            IpNet::V6(_) => v6.push(*p),
        }
    }
    (v4, v6)
}

/// A harvested endpoint (§9): record ID = public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Harvested {
    /// Peer public key.
    pub public_key: String,
    /// Its node ID.
    pub node_id: String,
    /// The endpoint WireGuard uses.
    pub endpoint: SocketAddr,
}

/// Endpoints to publish for peers that are up with a known endpoint and node.
pub fn harvest<'a>(
    peers: impl IntoIterator<Item = (&'a str, &'a str, bool, Option<SocketAddr>)>,
) -> Vec<Harvested> {
    peers
        .into_iter()
        .filter_map(|(key, node, up, ep)| match (up, ep) {
            (true, Some(endpoint)) if !node.is_empty() => Some(Harvested {
                public_key: key.to_owned(),
                node_id: node.to_owned(),
                endpoint,
            }),
            _ => None,
        })
        .collect()
}

/// Whether `ip` is a KubeSpan ULA (for duplicate-address checks).
#[must_use]
pub fn is_kubespan_ula(ip: IpAddr) -> bool {
    is_ula(ip, PURPOSE_KUBESPAN)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::cluster::KubeSpanAffiliateSpec;

    fn aff(
        key: &str,
        additional: &[&str],
        addrs: &[&str],
        exclude: &[&str],
        ula: &str,
    ) -> AffiliateSpec {
        AffiliateSpec {
            nodename: format!("node-{key}"),
            addresses: addrs.iter().map(|a| a.parse().unwrap()).collect(),
            kubespan: Some(KubeSpanAffiliateSpec {
                public_key: key.to_owned(),
                address: Some(ula.parse().unwrap()),
                additional_addresses: additional.iter().map(|a| a.parse().unwrap()).collect(),
                exclude_advertised_networks: exclude.iter().map(|a| a.parse().unwrap()).collect(),
                endpoints: vec!["192.0.2.1:51820".parse().unwrap()],
            }),
            ..AffiliateSpec::default()
        }
    }

    fn allowed(affs: &[(&str, &AffiliateSpec)]) -> Vec<Vec<String>> {
        let (sel, _) = select("local", "", affs.iter().map(|(i, a)| (*i, *a)));
        let claimed: Vec<PrefixSet> = sel.iter().map(|s| claimed_set(s.affiliate)).collect();
        resolve_overlaps(&claimed)
            .into_iter()
            .map(|r| r.allowed_ips.iter().map(ToString::to_string).collect())
            .collect()
    }

    #[test]
    fn allowed_ips_vectors() {
        let a = aff(
            "7x1S",
            &["10.244.3.1/24", "10.244.3.0/32"],
            &["192.168.3.4"],
            &["10.244.3.128/25"],
            "fd50:8d60:4238:6302:f857:23ff:fe21:d1e0",
        );
        let c = aff(
            "xCnF",
            &["10.244.4.1/24"],
            &["192.168.3.6"],
            &[],
            "fdc8:8aee:4e2d:1202:f073:9cff:fe6c:4d67",
        );
        assert_eq!(
            allowed(&[("7x1S", &a), ("xCnF", &c)]),
            [
                vec![
                    "10.244.3.0/25",
                    "192.168.3.4/32",
                    "fd50:8d60:4238:6302:f857:23ff:fe21:d1e0/128"
                ],
                vec![
                    "10.244.4.0/24",
                    "192.168.3.6/32",
                    "fdc8:8aee:4e2d:1202:f073:9cff:fe6c:4d67/128"
                ],
            ]
        );
    }

    #[test]
    fn overlap_vectors_first_by_node_id_wins() {
        let a = aff(
            "7x1S",
            &["10.244.3.1/24", "10.244.3.0/32"],
            &[],
            &[],
            "fd50:8d60:4238:6302:f857:23ff:fe21:d1e0",
        );
        let b = aff(
            "9dwH",
            &["10.244.2.0/23", "192.168.3.0/24"],
            &[],
            &[],
            "fd50:8d60:4238:6302:f857:23ff:fe21:d1e1",
        );
        // Given in reverse: order is by node ID, not input order.
        let got = allowed(&[("9dwH", &b), ("7x1S", &a)]);
        assert_eq!(
            got,
            [
                vec![
                    "10.244.3.0/24",
                    "fd50:8d60:4238:6302:f857:23ff:fe21:d1e0/128"
                ],
                vec![
                    "10.244.2.0/24",
                    "192.168.3.0/24",
                    "fd50:8d60:4238:6302:f857:23ff:fe21:d1e1/128"
                ],
            ]
        );
        let (sel, _) = select("local", "", [("7x1S", &a), ("9dwH", &b)]);
        let claimed: Vec<PrefixSet> = sel.iter().map(|s| claimed_set(s.affiliate)).collect();
        let r = resolve_overlaps(&claimed);
        assert_eq!(
            r[1].removed,
            vec!["10.244.3.0/24".parse::<IpNet>().unwrap()]
        );
    }

    #[test]
    fn selection_skips_local_keyless_and_duplicate_keys() {
        let a = aff("k1", &[], &["10.0.0.1"], &[], "fd00::1");
        let dup = aff("k1", &[], &["10.0.0.2"], &[], "fd00::2");
        let own = aff("mine", &[], &["10.0.0.3"], &[], "fd00::3");
        let bare = AffiliateSpec::default();
        let (sel, conflicts) = select(
            "local",
            "mine",
            [
                ("b", &dup),
                ("a", &a),
                ("local", &a),
                ("c", &bare),
                ("d", &own),
            ],
        );
        assert_eq!(sel.len(), 1);
        assert_eq!(sel[0].node_id, "a");
        assert_eq!(sel[0].affiliate.nodename, "node-k1");
        assert_eq!(
            conflicts,
            vec![KeyConflict {
                public_key: "k1".into(),
                kept: "a".into(),
                dropped: "b".into()
            }]
        );
    }

    #[test]
    fn routed_set_honours_bypass_and_drops_ulas() {
        let p1: Vec<IpNet> = vec![
            "10.0.0.1/32".parse().unwrap(),
            "fd7f:175a:b97c:5602::1/128".parse().unwrap(),
            "2001:db8::/64".parse().unwrap(),
        ];
        let p2: Vec<IpNet> = vec!["10.0.0.2/32".parse().unwrap()];
        let set = |force| {
            let parts = [
                routed_prefixes(force, &p1, true),
                routed_prefixes(force, &p2, false),
            ];
            routed_set(parts.iter().map(Vec::as_slice))
        };
        let (v4, v6) = set(true);
        assert_eq!(v4.len(), 2);
        assert_eq!(v6, vec!["2001:db8::/64".parse::<IpNet>().unwrap()]);
        let (v4, _) = set(false);
        assert_eq!(v4, vec!["10.0.0.1/32".parse::<IpNet>().unwrap()]);
    }

    #[test]
    fn harvest_takes_up_peers_with_endpoint_and_node() {
        let ep: SocketAddr = "192.0.2.9:51820".parse().unwrap();
        let h = harvest([
            ("k1", "n1", true, Some(ep)),
            ("k2", "n2", false, Some(ep)),
            ("k3", "n3", true, None),
            ("k4", "", true, Some(ep)),
        ]);
        assert_eq!(h.len(), 1);
        assert_eq!(h[0].node_id, "n1");
    }
}
