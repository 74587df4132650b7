//! What must hold after every fault, as plain functions over what was read from the
//! kernel, the daemons and their logs (the reading is in `inject`), and the report's
//! arithmetic.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use serde_json::Value;

/// What one node's kernel must hold once the mesh has settled.
#[derive(Debug, Clone, Default)]
pub struct Expected {
    /// The node's name.
    pub node: String,
    /// Public keys of every other node: the WireGuard peers.
    pub peers: BTreeSet<String>,
    /// Underlay addresses of every other node: the marking sets' host elements.
    pub hosts: Vec<IpAddr>,
    /// Priority of the mesh routing rule.
    pub rule_priority: u64,
    /// True when the marking is nftables (the sets and chains are checked).
    pub nftables: bool,
}

/// What was read from one node's kernel.
#[derive(Debug, Clone, Default)]
pub struct Kernel {
    /// `wg show LINK dump` (without the interface line's private key: it is dropped
    /// when read).
    pub wg_peers: Vec<String>,
    /// `nft -j list tables`: names of the inet tables.
    pub inet_tables: Vec<String>,
    /// Sets of the wirespan table.
    pub sets: Sets,
    /// Rules of the wirespan table.
    pub rules: Rules,
    /// Priorities of `ip -4 rule` / `ip -6 rule`.
    pub ip_rules: [Vec<u64>; 2],
    /// Destinations of the routes in the mesh table, IPv4 and IPv6.
    pub routes: [Vec<String>; 2],
}

/// Peer public keys from `wg show LINK dump`: the first line is the interface (its
/// private key is never kept), every other line one peer.
#[must_use]
pub fn parse_wg_dump(dump: &str) -> Vec<String> {
    dump.lines()
        .skip(1)
        .filter_map(|l| l.split('\t').next())
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Names of the `inet` tables in `nft -j list tables`.
#[must_use]
pub fn parse_nft_tables(json: &Value) -> Vec<String> {
    nft_objects(json)
        .filter_map(|o| o.get("table"))
        .filter(|t| t["family"] == "inet")
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect()
}

fn nft_objects(json: &Value) -> impl Iterator<Item = &Value> {
    json["nftables"].as_array().into_iter().flatten()
}

/// An nft set element as text: an address, `addr/len` or `first-last`.
fn element_text(e: &Value) -> String {
    let e = e.get("elem").map_or(e, |inner| &inner["val"]);
    if let Some(s) = e.as_str() {
        s.to_owned()
    } else if let Some(p) = e.get("prefix") {
        format!("{}/{}", p["addr"].as_str().unwrap_or("?"), p["len"])
    } else if let Some(r) = e.get("range") {
        format!(
            "{}-{}",
            r[0].as_str().unwrap_or("?"),
            r[1].as_str().unwrap_or("?")
        )
    } else {
        e.to_string()
    }
}

/// Sets of an nft table: name and elements as text.
pub type Sets = Vec<(String, Vec<String>)>;
/// Rules of an nft table: chain and comment.
pub type Rules = Vec<(String, String)>;

/// Sets (name, elements) and rules (chain, comment) of `nft -j list table inet NAME`.
#[must_use]
pub fn parse_nft_table(json: &Value) -> (Sets, Rules) {
    let mut sets = Vec::new();
    let mut rules = Vec::new();
    for o in nft_objects(json) {
        if let Some(s) = o.get("set") {
            let elems = s["elem"]
                .as_array()
                .map(|a| a.iter().map(element_text).collect())
                .unwrap_or_default();
            sets.push((s["name"].as_str().unwrap_or("?").to_owned(), elems));
        }
        if let Some(r) = o.get("rule") {
            rules.push((
                r["chain"].as_str().unwrap_or("?").to_owned(),
                r["comment"].as_str().unwrap_or("").to_owned(),
            ));
        }
    }
    (sets, rules)
}

/// Priorities of `ip -j rule`.
#[must_use]
pub fn parse_ip_rules(json: &Value) -> Vec<u64> {
    json.as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| r["priority"].as_u64())
        .collect()
}

/// Destinations of `ip -j route show table N`.
#[must_use]
pub fn parse_routes(json: &Value) -> Vec<String> {
    json.as_array()
        .into_iter()
        .flatten()
        .map(|r| r["dst"].as_str().unwrap_or("?").to_owned())
        .collect()
}

/// Items seen more than once.
fn duplicates<T: Ord + Clone>(items: &[T]) -> Vec<T> {
    let mut seen = BTreeSet::new();
    let mut dup = BTreeSet::new();
    for i in items {
        if !seen.insert(i) {
            dup.insert(i.clone());
        }
    }
    dup.into_iter().collect()
}

/// Every way `k` differs from `exp`, one line each (empty when it holds): WireGuard
/// peers are exactly the other nodes, once each; one `inet wirespan` table whose host
/// sets hold exactly the other nodes' underlay addresses and whose net sets are empty
/// (the lab advertises no networks); no rule twice in a chain; one mesh routing rule
/// per family at the mesh priority; one route (the default) per family in the mesh
/// table.
#[must_use]
pub fn check_kernel(exp: &Expected, k: &Kernel) -> Vec<String> {
    let mut v = Vec::new();
    let n = &exp.node;
    for d in duplicates(&k.wg_peers) {
        v.push(format!("{n}: WireGuard peer {d} is on the device twice"));
    }
    let have: BTreeSet<String> = k.wg_peers.iter().cloned().collect();
    for missing in exp.peers.difference(&have) {
        v.push(format!("{n}: WireGuard peer {missing} is missing"));
    }
    for extra in have.difference(&exp.peers) {
        v.push(format!(
            "{n}: WireGuard peer {extra} is not a node of the lab"
        ));
    }
    if exp.nftables {
        let ours = k.inet_tables.iter().filter(|t| *t == "wirespan").count();
        if ours != 1 {
            v.push(format!("{n}: {ours} inet wirespan tables, expected 1"));
        }
        // The host sets hold every node address; whatever other sets the layout
        // keeps (`v4_nets`, or one per prefix length) stay empty: lab nodes
        // advertise no network.
        let mut want: BTreeMap<&str, Vec<String>> =
            BTreeMap::from([("v4_hosts", Vec::new()), ("v6_hosts", Vec::new())]);
        for (set, _) in &k.sets {
            want.entry(set.as_str()).or_default();
        }
        for a in &exp.hosts {
            let set = if a.is_ipv4() { "v4_hosts" } else { "v6_hosts" };
            want.get_mut(set).expect("listed above").push(a.to_string());
        }
        let names: Vec<&str> = k.sets.iter().map(|(s, _)| s.as_str()).collect();
        for d in duplicates(&names) {
            v.push(format!("{n}: set {d} exists twice"));
        }
        for (set, want) in &mut want {
            let Some((_, got)) = k.sets.iter().find(|(s, _)| s == set) else {
                v.push(format!("{n}: set {set} is missing"));
                continue;
            };
            for d in duplicates(got) {
                v.push(format!("{n}: set {set} holds {d} twice"));
            }
            let mut got = got.clone();
            got.sort();
            got.dedup();
            want.sort();
            if got != *want {
                v.push(format!(
                    "{n}: set {set} holds [{}], expected [{}]",
                    got.join(", "),
                    want.join(", ")
                ));
            }
        }
        for (chain, comment) in duplicates(&k.rules) {
            v.push(format!("{n}: rule {comment:?} is in chain {chain} twice"));
        }
    }
    for (i, family) in ["IPv4", "IPv6"].iter().enumerate() {
        let ours = k.ip_rules[i]
            .iter()
            .filter(|p| **p == exp.rule_priority)
            .count();
        if ours != 1 {
            v.push(format!(
                "{n}: {ours} {family} routing rules at priority {}, expected 1",
                exp.rule_priority
            ));
        }
        if k.routes[i] != ["default"] {
            v.push(format!(
                "{n}: {family} routes of the mesh table are [{}], expected [default]",
                k.routes[i].join(", ")
            ));
        }
    }
    v
}

/// One ping of the matrix.
#[derive(Debug, Clone)]
pub struct Probe {
    pub from: String,
    pub to: String,
    pub address: IpAddr,
    pub ok: bool,
}

/// A line per failed ping.
#[must_use]
pub fn ping_failures(probes: &[Probe]) -> Vec<String> {
    probes
        .iter()
        .filter(|p| !p.ok)
        .map(|p| format!("{} cannot ping {} at {}", p.from, p.to, p.address))
        .collect()
}

/// A secret to look for, in every form it could be written: as configured (base64)
/// and as hex.
#[derive(Debug, Clone)]
pub struct Secret {
    /// What it is ("the cluster secret", "node2's private key"): printed, never the
    /// value.
    pub label: String,
    forms: Vec<String>,
}

impl Secret {
    /// A secret given as base64; forms shorter than 16 characters are not searched
    /// (they would match by chance).
    #[must_use]
    pub fn new(label: &str, base64_text: &str) -> Self {
        use base64::Engine as _;
        let b64 = base64_text.trim().to_owned();
        let mut forms = vec![b64.clone()];
        if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(&b64) {
            forms.push(hex::encode(&bytes));
            forms.push(hex::encode_upper(&bytes));
        }
        forms.retain(|f| f.len() >= 16);
        Self {
            label: label.to_owned(),
            forms,
        }
    }
}

/// Labels of the secrets that appear in `text`.
#[must_use]
pub fn secrets_in<'a>(text: &str, secrets: &'a [Secret]) -> Vec<&'a str> {
    secrets
        .iter()
        .filter(|s| s.forms.iter().any(|f| text.contains(f.as_str())))
        .map(|s| s.label.as_str())
        .collect()
}

/// Resident memory in bytes from a `/proc/PID/status` text (`VmRSS: 43748 kB`).
#[must_use]
pub fn parse_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Nearest-rank percentile `p` (0–100] of sorted `v`.
#[must_use]
pub fn percentile(sorted: &[Duration], p: f64) -> Option<Duration> {
    if sorted.is_empty() {
        return None;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn expected() -> Expected {
        Expected {
            node: "node1".into(),
            peers: BTreeSet::from(["k2".to_owned(), "k3".to_owned()]),
            hosts: vec![
                ip("10.99.1.12"),
                ip("10.99.2.12"),
                ip("fd99:1ab::c"),
                ip("10.99.1.13"),
                ip("10.99.2.13"),
                ip("fd99:1ab::d"),
            ],
            rule_priority: 32500,
            nftables: true,
        }
    }

    fn healthy() -> Kernel {
        Kernel {
            wg_peers: vec!["k3".into(), "k2".into()],
            inet_tables: vec!["filter".into(), "wirespan".into()],
            sets: vec![
                (
                    "v4_hosts".into(),
                    ["10.99.1.12", "10.99.1.13", "10.99.2.12", "10.99.2.13"]
                        .map(String::from)
                        .to_vec(),
                ),
                ("v4_nets".into(), vec![]),
                (
                    "v6_hosts".into(),
                    vec!["fd99:1ab::c".into(), "fd99:1ab::d".into()],
                ),
                ("v6_nets".into(), vec![]),
            ],
            rules: vec![
                ("kubespan_prerouting".into(), "wirespan:mark:v4".into()),
                ("kubespan_outgoing".into(), "wirespan:mark:v4".into()),
            ],
            ip_rules: [vec![0, 32500, 32766, 32767], vec![0, 32500, 32766]],
            routes: [vec!["default".into()], vec!["default".into()]],
        }
    }

    #[test]
    fn a_settled_node_has_no_violation() {
        assert_eq!(check_kernel(&expected(), &healthy()), Vec::<String>::new());
    }

    #[test]
    fn a_duplicate_peer_element_rule_route_or_table_is_flagged() {
        let exp = expected();
        let one = |f: &dyn Fn(&mut Kernel)| {
            let mut k = healthy();
            f(&mut k);
            check_kernel(&exp, &k)
        };
        let v = one(&|k| k.wg_peers.push("k2".into()));
        assert_eq!(v, ["node1: WireGuard peer k2 is on the device twice"]);
        let v = one(&|k| k.sets[0].1.push("10.99.1.12".into()));
        assert_eq!(v, ["node1: set v4_hosts holds 10.99.1.12 twice"]);
        let v = one(&|k| k.rules.push(k.rules[0].clone()));
        assert_eq!(
            v,
            ["node1: rule \"wirespan:mark:v4\" is in chain kubespan_prerouting twice"]
        );
        let v = one(&|k| k.ip_rules[1].push(32500));
        assert_eq!(
            v,
            ["node1: 2 IPv6 routing rules at priority 32500, expected 1"]
        );
        let v = one(&|k| k.routes[0].push("default".into()));
        assert_eq!(
            v,
            ["node1: IPv4 routes of the mesh table are [default, default], expected [default]"]
        );
        let v = one(&|k| k.inet_tables.push("wirespan".into()));
        assert_eq!(v, ["node1: 2 inet wirespan tables, expected 1"]);
        let v = one(&|k| k.sets.push(k.sets[1].clone()));
        assert_eq!(v, ["node1: set v4_nets exists twice"]);
    }

    #[test]
    fn missing_or_foreign_objects_are_flagged() {
        let exp = expected();
        let mut k = healthy();
        k.wg_peers = vec!["k2".into(), "stranger".into()];
        k.sets[2].1.pop();
        k.sets[3].1.push("10.0.0.0/8".into());
        k.ip_rules[0].retain(|p| *p != 32500);
        k.routes[1].clear();
        let v = check_kernel(&exp, &k);
        assert_eq!(
            v,
            [
                "node1: WireGuard peer k3 is missing",
                "node1: WireGuard peer stranger is not a node of the lab",
                "node1: set v6_hosts holds [fd99:1ab::c], expected [fd99:1ab::c, fd99:1ab::d]",
                "node1: set v6_nets holds [10.0.0.0/8], expected []",
                "node1: 0 IPv4 routing rules at priority 32500, expected 1",
                "node1: IPv6 routes of the mesh table are [], expected [default]",
            ]
        );
        // Without nftables marking only the device and routing are checked.
        let mut ebpf = exp;
        ebpf.nftables = false;
        k.wg_peers = vec!["k2".into(), "k3".into()];
        k.ip_rules[0].push(32500);
        k.routes[1].push("default".into());
        assert!(check_kernel(&ebpf, &k).is_empty());
    }

    #[test]
    fn kernel_outputs_are_parsed() {
        let dump =
            "PRIV\tPUB\t51820\t0x20\nk2\tpsk\t10.99.1.12:51820\t10.99.1.12/32\t1\t2\t3\t25\n\
                    k3\tpsk\t(none)\t10.99.1.13/32\t0\t0\t0\t25\n";
        assert_eq!(parse_wg_dump(dump), ["k2", "k3"]);
        let table = json!({"nftables": [
            {"metainfo": {}},
            {"table": {"family": "inet", "name": "wirespan"}},
            {"set": {"name": "v4_hosts", "elem": ["10.99.1.12"]}},
            {"set": {"name": "v4_nets", "elem": [{"prefix": {"addr": "10.0.0.0", "len": 8}},
                                                  {"range": ["10.1.0.1", "10.1.0.9"]}]}},
            {"set": {"name": "v6_nets"}},
            {"rule": {"chain": "kubespan_outgoing", "comment": "wirespan:lo"}},
        ]});
        let (sets, rules) = parse_nft_table(&table);
        assert_eq!(
            sets,
            [
                ("v4_hosts".to_owned(), vec!["10.99.1.12".to_owned()]),
                (
                    "v4_nets".to_owned(),
                    vec!["10.0.0.0/8".to_owned(), "10.1.0.1-10.1.0.9".to_owned()]
                ),
                ("v6_nets".to_owned(), vec![]),
            ]
        );
        assert_eq!(
            rules,
            [("kubespan_outgoing".to_owned(), "wirespan:lo".to_owned())]
        );
        assert_eq!(parse_nft_tables(&table), ["wirespan"]);
        let rules = json!([{"priority": 0}, {"priority": 32500, "table": "180"}]);
        assert_eq!(parse_ip_rules(&rules), [0, 32500]);
        let routes = json!([{"dst": "default", "dev": "kubespan"}]);
        assert_eq!(parse_routes(&routes), ["default"]);
    }

    #[test]
    fn secrets_are_found_in_base64_and_hex_and_named_by_label() {
        let s = [
            Secret::new(
                "the cluster secret",
                "2aTKCk9G0WYv7HjaYFSFuMSHIbtNfrseEcQiL/qQiWU=",
            ),
            Secret::new(
                "node1's private key",
                "MLYouYyhmrz0LPmHFK3jb9rnOuKENbfMFoTy8tlX63g=",
            ),
        ];
        assert!(secrets_in("INFO peer up key=I8igv6/Zb", &s).is_empty());
        assert_eq!(
            secrets_in("psk=2aTKCk9G0WYv7HjaYFSFuMSHIbtNfrseEcQiL/qQiWU=", &s),
            ["the cluster secret"]
        );
        // The UAPI form of a key is hex.
        use base64::Engine as _;
        let raw = base64::engine::general_purpose::STANDARD
            .decode("MLYouYyhmrz0LPmHFK3jb9rnOuKENbfMFoTy8tlX63g=")
            .unwrap();
        let line = format!("set private_key={}", hex::encode(raw));
        assert_eq!(secrets_in(&line, &s), ["node1's private key"]);
    }

    #[test]
    fn rss_and_percentiles() {
        assert_eq!(
            parse_rss("Name:\twirespan\nVmHWM:\t 50000 kB\nVmRSS:\t   43748 kB\n"),
            Some(43748 * 1024)
        );
        assert_eq!(parse_rss("Name:\tzombie\n"), None);
        let ms = Duration::from_millis;
        let v: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile(&v, 50.0), Some(ms(50)));
        assert_eq!(percentile(&v, 99.0), Some(ms(99)));
        assert_eq!(percentile(&v, 100.0), Some(ms(100)));
        assert_eq!(percentile(&[ms(7)], 99.0), Some(ms(7)));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
