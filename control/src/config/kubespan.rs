//! `KubeSpanConfig` and `KubeSpanEndpointsConfig` documents (spec
//! `docs/kubespan.md` §1), and the endpoint filter of §4.2.
//!
//! ```yaml
//! apiVersion: v1alpha1
//! kind: KubeSpanConfigDocument
//! enabled: true
//! advertisedNetworks: [10.244.1.0/24]
//! filters:
//!   endpoints: ["0.0.0.0/0", "!192.168.0.0/16"]
//!   excludeAdvertisedNetworks: [10.244.1.128/25]
//!   peerEndpoints: ["0.0.0.0/0", "!172.16.0.0/12"]
//! fastPath: ebpf
//! peerDownInterval: 275s
//! peerReceiveTimeout: 30s
//! ```

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use ipnet::IpNet;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{check_link_name, ConfigDocument, FieldError};

/// How cluster-bound packets are marked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum FastPath {
    /// nftables sets in prerouting and output (upstream's way).
    #[default]
    Nftables,
    /// A tc eBPF classifier marks forwarded traffic; nftables keeps the output chain.
    /// Falls back to nftables, saying so, when the kernel cannot load it.
    Ebpf,
}

/// Filters of the `KubeSpanConfig` document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubeSpanFilters {
    /// `[!]CIDR-or-IP` entries filtering this node's advertised endpoints, in order: a
    /// plain entry adds the addresses it matches, a `!` entry removes them; addresses
    /// no plain entry matches are dropped. Unset: no filtering; an empty list drops
    /// every address-derived endpoint (`extraAnnouncedEndpoints` stay).
    ///
    /// Valid: each entry an IP or CIDR, optionally prefixed by `!`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoints: Option<Vec<String>>,
    /// Networks peers should not route to this node: removed from the advertised
    /// addresses and networks before publishing.
    #[serde(default)]
    #[schemars(with = "Vec<super::schema::Cidr>")]
    pub exclude_advertised_networks: Vec<IpNet>,
    /// `[!]CIDR-or-IP` entries filtering the endpoints received from peers before this
    /// node tries them (Talos 1.15). Same syntax and semantics as `endpoints`, but
    /// local: `endpoints` shapes what every peer tries to reach this node, this one
    /// only what this node tries. Unset = no filtering; an empty list drops every
    /// peer endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_endpoints: Option<Vec<String>>,
}

/// The mesh (KubeSpan) settings. Without this document, or with `enabled: false`, the
/// mesh is off and its kernel objects are removed. Every field is optional; the
/// defaults are Talos KubeSpan's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct KubeSpanConfigDocument {
    /// Run the mesh.
    pub enabled: bool,
    /// Advertise `advertisedNetworks` to peers, which then route them to this node.
    pub advertise_kubernetes_networks: bool,
    /// This node's pod CIDRs, given statically (there is no Kubernetes API here).
    #[schemars(with = "Vec<super::schema::Cidr>")]
    pub advertised_networks: Vec<IpNet>,
    /// Send traffic only to peers that are up through the mesh; traffic to the others
    /// leaves unencrypted by normal routing. Off: traffic to a down peer is dropped.
    pub allow_down_peer_bypass: bool,
    /// Publish, for each peer that is up, the endpoint WireGuard actually uses (NAT,
    /// roaming) to the discovery services. Costs N·(N−1) updates per cluster refresh.
    pub harvest_extra_endpoints: bool,
    /// MTU of the mesh link and its routes; TCP MSS is clamped to fit.
    ///
    /// Valid: 1280–65535.
    pub mtu: u32,
    /// Endpoint and advertised-network filters.
    pub filters: KubeSpanFilters,
    /// Name of the WireGuard link.
    ///
    /// Valid: an interface name: 1–15 bytes, not `.` or `..`, no `/`, `:`, spaces or
    /// control characters.
    pub link_name: String,
    /// WireGuard UDP port, also the port of advertised endpoints. Peers must be able
    /// to reach it.
    ///
    /// Valid: 1–65535.
    pub listen_port: u16,
    /// Firewall mark WireGuard puts on its own UDP packets, so they are not marked
    /// into the mesh again. Integers may be written in hex (`0x20`).
    ///
    /// Valid: non-zero, inside `markMask`, different from `routeMark`.
    #[schemars(extend("x-hex" = true))]
    pub device_mark: u32,
    /// Firewall mark that sends a packet into the mesh (matched by the mesh's rule).
    ///
    /// Valid: non-zero, inside `markMask`, different from `deviceMark`.
    #[schemars(extend("x-hex" = true))]
    pub route_mark: u32,
    /// Mark bits the mesh owns; other bits of a packet's mark are left alone.
    ///
    /// Valid: non-zero.
    #[schemars(extend("x-hex" = true))]
    pub mark_mask: u32,
    /// Routing table of the mesh's default routes. Reserved for the mesh: no
    /// `RouteConfig` or `RoutingRuleConfig` may use it.
    ///
    /// Valid: not 0, 253, 254 or 255.
    pub routing_table: u32,
    /// Priority of the mesh's fwmark rules (IPv4 and IPv6). Reserved for the mesh: no
    /// `RoutingRuleConfig` may use it.
    ///
    /// Valid: not 0, 32766 or 32767.
    pub rule_priority: u32,
    /// Marking implementation for forwarded traffic.
    pub fast_path: FastPath,
    /// Link whose MAC address derives this node's KubeSpan IPv6 address. Unset: the
    /// first physical Ethernet link by name, else the first link by name with a MAC
    /// (not `lo`, not the mesh link).
    ///
    /// Valid: an interface name, as for `linkName`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_link: Option<String>,
    /// Time without a WireGuard handshake after which a peer is down and its next
    /// endpoint is tried (Talos: 275 s). WireGuard re-handshakes an idle tunnel only
    /// about every 2–2.5 min, so a shorter interval would make healthy peers flap.
    ///
    /// Valid: 150s–1h.
    #[serde(with = "super::duration")]
    #[schemars(with = "super::schema::DurationText", extend("default" = "275s"))]
    pub peer_down_interval: Duration,
    /// Time a wirespan peer (one that advertises wirespan's extension; Talos peers
    /// are judged by `peerDownInterval` alone) may send nothing before it is down,
    /// however recent its handshake. This node sets its keepalive towards wirespan
    /// peers to a third of it, and probes a peer silent for half of it.
    ///
    /// Valid: 6s–5m. A peer whose kernel answers the probe (an ICMPv6 port
    /// unreachable) is down within it of its last packet; one whose firewall drops the
    /// probe is given 12 s to answer it, so below 24 s it is down later than that.
    #[serde(with = "super::duration")]
    #[schemars(with = "super::schema::DurationText")]
    pub peer_receive_timeout: Duration,
    /// Peer relays between wirespan nodes: traffic to a wirespan peer that cannot be
    /// reached directly goes through another wirespan node that reaches both, and this
    /// node forwards for such pairs while its IPv4 and IPv6 forwarding are on. The
    /// relay decrypts and re-encrypts what it forwards. Talos peers never take part.
    pub peer_relay: bool,
}

/// Default time without a handshake after which an established peer is down
/// (180 + 5 + 90); the `peerDownInterval` setting replaces it.
pub const PEER_DOWN_INTERVAL: Duration = Duration::from_secs(275);
/// Default of `peerReceiveTimeout`.
pub const PEER_RECEIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Bounds of `peerDownInterval`.
const PEER_DOWN_INTERVAL_RANGE: (Duration, Duration) =
    (Duration::from_secs(150), Duration::from_secs(3600));
/// Bounds of `peerReceiveTimeout`.
const PEER_RECEIVE_TIMEOUT_RANGE: (Duration, Duration) =
    (Duration::from_secs(6), Duration::from_secs(300));

impl Default for KubeSpanConfigDocument {
    fn default() -> Self {
        Self {
            enabled: false,
            advertise_kubernetes_networks: false,
            advertised_networks: Vec::new(),
            allow_down_peer_bypass: false,
            harvest_extra_endpoints: false,
            mtu: 1420,
            filters: KubeSpanFilters::default(),
            link_name: "kubespan".to_owned(),
            listen_port: 51820,
            device_mark: 0x20,
            route_mark: 0x40,
            mark_mask: 0x60,
            routing_table: 180,
            rule_priority: 32500,
            fast_path: FastPath::Nftables,
            identity_link: None,
            peer_down_interval: PEER_DOWN_INTERVAL,
            peer_receive_timeout: PEER_RECEIVE_TIMEOUT,
            peer_relay: true,
        }
    }
}

impl ConfigDocument for KubeSpanConfigDocument {
    const KIND: &'static str = "KubeSpanConfig";
    const SINGLETON: bool = true;

    fn validate(&self) -> Vec<FieldError> {
        let mut errs = Vec::new();
        if !(1280..=65535).contains(&self.mtu) {
            errs.push(FieldError::new(
                "mtu",
                format!("{} is out of range (1280–65535)", self.mtu),
            ));
        }
        check_link_name("linkName", &self.link_name, &mut errs);
        if let Some(l) = &self.identity_link {
            check_link_name("identityLink", l, &mut errs);
        }
        if self.listen_port == 0 {
            errs.push(FieldError::new("listenPort", "must not be 0"));
        }
        if self.mark_mask == 0 {
            errs.push(FieldError::new("markMask", "must not be 0"));
        }
        for (field, mark) in [
            ("deviceMark", self.device_mark),
            ("routeMark", self.route_mark),
        ] {
            if mark == 0 || mark & !self.mark_mask != 0 {
                errs.push(FieldError::new(
                    field,
                    format!(
                        "{mark:#x} must be non-zero and inside markMask {:#x}",
                        self.mark_mask
                    ),
                ));
            }
        }
        if self.device_mark == self.route_mark {
            errs.push(FieldError::new(
                "routeMark",
                format!("{:#x} must differ from deviceMark", self.route_mark),
            ));
        }
        if matches!(self.routing_table, 0 | 253..=255) {
            errs.push(FieldError::new(
                "routingTable",
                format!(
                    "{} is reserved (unspec, default, main, local)",
                    self.routing_table
                ),
            ));
        }
        if matches!(self.rule_priority, 0 | 32766 | 32767) {
            errs.push(FieldError::new(
                "rulePriority",
                format!(
                    "{} is reserved by the kernel (0, 32766, 32767)",
                    self.rule_priority
                ),
            ));
        }
        for (field, value, (min, max)) in [
            (
                "peerDownInterval",
                self.peer_down_interval,
                PEER_DOWN_INTERVAL_RANGE,
            ),
            (
                "peerReceiveTimeout",
                self.peer_receive_timeout,
                PEER_RECEIVE_TIMEOUT_RANGE,
            ),
        ] {
            if !(min..=max).contains(&value) {
                let text = |d: Duration| humantime::format_duration(d).to_string();
                errs.push(FieldError::new(
                    field,
                    format!(
                        "{} is out of range ({}–{})",
                        text(value),
                        text(min),
                        text(max)
                    ),
                ));
            }
        }
        for (name, list) in [
            ("endpoints", &self.filters.endpoints),
            ("peerEndpoints", &self.filters.peer_endpoints),
        ] {
            for (i, f) in list.iter().flatten().enumerate() {
                if let Err(e) = EndpointFilter::parse(f) {
                    errs.push(FieldError::new(format!("filters.{name}[{i}]"), e));
                }
            }
        }
        errs
    }
}

impl KubeSpanConfigDocument {
    /// The parsed endpoint filters; `None` when unset (no filtering).
    ///
    /// Valid documents always parse (validation checked every entry).
    #[must_use]
    pub fn endpoint_filters(&self) -> Option<Vec<EndpointFilter>> {
        parse_filters(self.filters.endpoints.as_deref())
    }

    /// The parsed peer endpoint filters; `None` when unset (no filtering).
    #[must_use]
    pub fn peer_endpoint_filters(&self) -> Option<Vec<EndpointFilter>> {
        parse_filters(self.filters.peer_endpoints.as_deref())
    }
}

fn parse_filters(list: Option<&[String]>) -> Option<Vec<EndpointFilter>> {
    list.map(|list| {
        list.iter()
            .filter_map(|f| EndpointFilter::parse(f).ok())
            .collect()
    })
}

/// Extra endpoints to advertise, e.g. NAT port forwards to this node's `listenPort`.
/// The endpoints of all documents of this kind are used.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase", default)]
pub struct KubeSpanEndpointsConfig {
    /// Endpoints appended to the advertised list (after the address-derived ones,
    /// duplicates skipped; `filters.endpoints` does not apply to them).
    ///
    /// Valid: each a specified address (not `0.0.0.0` or `::`) with a non-zero port.
    #[schemars(with = "Vec<super::schema::IpPort>")]
    pub extra_announced_endpoints: Vec<SocketAddr>,
}

impl ConfigDocument for KubeSpanEndpointsConfig {
    const KIND: &'static str = "KubeSpanEndpointsConfig";
    const SINGLETON: bool = false;

    fn validate(&self) -> Vec<FieldError> {
        self.extra_announced_endpoints
            .iter()
            .enumerate()
            .filter(|(_, e)| e.port() == 0 || e.ip().is_unspecified())
            .map(|(i, e)| {
                FieldError::new(
                    format!("extraAnnouncedEndpoints[{i}]"),
                    format!("{e} needs a port and a specified address"),
                )
            })
            .collect()
    }
}

/// One `[!]CIDR-or-IP` entry of `filters.endpoints`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointFilter {
    /// A `!` entry removes what it matches.
    pub negate: bool,
    /// What it matches (a bare IP is a /32 or /128).
    pub net: IpNet,
}

impl EndpointFilter {
    /// Parses one entry.
    ///
    /// # Errors
    /// A message naming the text.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (negate, rest) = match text.trim().strip_prefix('!') {
            Some(r) => (true, r.trim()),
            None => (false, text.trim()),
        };
        let net = rest
            .parse::<IpNet>()
            .or_else(|_| rest.parse::<IpAddr>().map(IpNet::from))
            .map_err(|_| format!("{text:?} is not an IP, CIDR, !IP or !CIDR"))?;
        Ok(Self { negate, net })
    }
}

/// Applies endpoint filters (upstream `FilterIPs`, `docs/kubespan.md` §4.2): for each filter in
/// order, each input IP it matches is appended (positive, if not yet present) or
/// removed (negative). IPs matched by no positive entry are dropped.
#[must_use]
pub fn filter_ips(ips: &[IpAddr], filters: &[EndpointFilter]) -> Vec<IpAddr> {
    filter_by_ip(ips, |ip| *ip, filters)
}

/// [`filter_ips`] over peer endpoints (`filters.peerEndpoints`): an endpoint is kept
/// or dropped by its IP, its port kept; `None` filters nothing.
#[must_use]
pub fn filter_endpoints(
    endpoints: &[SocketAddr],
    filters: Option<&[EndpointFilter]>,
) -> Vec<SocketAddr> {
    match filters {
        Some(filters) => filter_by_ip(endpoints, SocketAddr::ip, filters),
        None => endpoints.to_vec(),
    }
}

fn filter_by_ip<T: Copy + PartialEq>(
    items: &[T],
    ip: impl Fn(&T) -> IpAddr,
    filters: &[EndpointFilter],
) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for f in filters {
        for item in items.iter().filter(|i| f.net.contains(&ip(i))) {
            if f.negate {
                out.retain(|o| o != item);
            } else if !out.contains(item) {
                out.push(*item);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    #[test]
    fn defaults_are_upstream_and_hex_marks_parse() {
        let cfg = parse("apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: true\ndeviceMark: 0x20\nfastPath: ebpf\n")
            .unwrap();
        let k = cfg.singleton::<KubeSpanConfigDocument>().unwrap();
        assert_eq!(
            *k,
            KubeSpanConfigDocument {
                enabled: true,
                fast_path: FastPath::Ebpf,
                ..KubeSpanConfigDocument::default()
            }
        );
        assert_eq!((k.mtu, k.listen_port, k.routing_table), (1420, 51820, 180));
        assert_eq!(k.peer_down_interval, Duration::from_secs(275));
        assert_eq!(k.peer_receive_timeout, Duration::from_secs(20));
    }

    #[test]
    fn detection_timings_parse_and_bad_ones_are_named() {
        let cfg = parse("apiVersion: v1alpha1\nkind: KubeSpanConfig\npeerDownInterval: 3m\npeerReceiveTimeout: 6s\n")
            .unwrap();
        let k = cfg.singleton::<KubeSpanConfigDocument>().unwrap();
        assert_eq!(k.peer_down_interval, Duration::from_secs(180));
        assert_eq!(k.peer_receive_timeout, Duration::from_secs(6));
        for (text, field) in [
            ("peerDownInterval: 2m", "peerDownInterval"),
            ("peerDownInterval: 2h", "peerDownInterval"),
            ("peerDownInterval: soon", "peerDownInterval"),
            ("peerReceiveTimeout: 5s", "peerReceiveTimeout"),
            ("peerReceiveTimeout: -5s", "peerReceiveTimeout"),
        ] {
            let err = parse(&format!(
                "apiVersion: v1alpha1\nkind: KubeSpanConfig\n{text}\n"
            ))
            .unwrap_err();
            assert_eq!(err.documents[0].errors[0].field, field, "{text}: {err}");
        }
    }

    #[test]
    fn invalid_fields_are_named() {
        let k = KubeSpanConfigDocument {
            mtu: 0,
            listen_port: 0,
            route_mark: 0x80,
            rule_priority: 32766,
            routing_table: 254,
            peer_down_interval: Duration::from_secs(60),
            peer_receive_timeout: Duration::from_secs(5),
            filters: KubeSpanFilters {
                endpoints: Some(vec!["10.0.0.0/8".into(), "!nope".into()]),
                peer_endpoints: Some(vec!["::/0".into(), "!10.0.0.0/33".into()]),
                ..KubeSpanFilters::default()
            },
            ..KubeSpanConfigDocument::default()
        };
        let fields: Vec<_> = k.validate().into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            [
                "mtu",
                "listenPort",
                "routeMark",
                "routingTable",
                "rulePriority",
                "peerDownInterval",
                "peerReceiveTimeout",
                "filters.endpoints[1]",
                "filters.peerEndpoints[1]"
            ]
        );
        let err = parse("apiVersion: v1alpha1\nkind: KubeSpanConfig\nfastPath: xdp\n").unwrap_err();
        assert_eq!(err.documents[0].errors[0].field, "fastPath", "{err}");
        let err = parse(
            "apiVersion: v1alpha1\nkind: KubeSpanConfig\nfilters:\n  excludeAdvertisedNetworks: [10.0.0.0/8, nope]\n",
        )
        .unwrap_err();
        assert_eq!(
            err.documents[0].errors[0].field, "filters.excludeAdvertisedNetworks[1]",
            "{err}"
        );
    }

    #[test]
    fn filter_follows_the_spec_example() {
        let ips: Vec<IpAddr> = [
            "10.5.0.1",
            "192.168.1.10",
            "172.20.0.2",
            "2001:123:4567::1",
            "fd00::5",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let filters: Vec<_> = ["0.0.0.0/0", "!192.168.0.0/16", "2001::/16"]
            .iter()
            .map(|f| EndpointFilter::parse(f).unwrap())
            .collect();
        let want: Vec<IpAddr> = ["10.5.0.1", "172.20.0.2", "2001:123:4567::1"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(filter_ips(&ips, &filters), want);
        // A later positive entry re-adds a removed IP; an empty filter list drops all.
        let readd: Vec<_> = ["0.0.0.0/0", "!192.168.0.0/16", "192.168.1.10"]
            .iter()
            .map(|f| EndpointFilter::parse(f).unwrap())
            .collect();
        assert!(filter_ips(&ips, &readd).contains(&ips[1]));
        assert!(filter_ips(&ips, &[]).is_empty());
    }

    #[test]
    fn peer_endpoint_filter_keeps_ports_and_follows_filter_order() {
        let eps: Vec<SocketAddr> = [
            "192.168.1.10:51820",
            "10.5.0.1:51820",
            "10.5.0.1:52000",
            "[2001:db8::1]:51820",
            "203.0.113.7:51820",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let doc = parse(
            "apiVersion: v1alpha1\nkind: KubeSpanConfig\nfilters:\n  peerEndpoints: [\"::/0\", \"0.0.0.0/0\", \"!192.168.0.0/16\"]\n",
        )
        .unwrap();
        let filters = doc
            .singleton::<KubeSpanConfigDocument>()
            .unwrap()
            .peer_endpoint_filters();
        let want: Vec<SocketAddr> = [
            "[2001:db8::1]:51820",
            "10.5.0.1:51820",
            "10.5.0.1:52000",
            "203.0.113.7:51820",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        assert_eq!(filter_endpoints(&eps, filters.as_deref()), want);
        // Unset: untouched; empty: nothing left to try.
        assert_eq!(filter_endpoints(&eps, None), eps);
        assert!(filter_endpoints(&eps, Some(&[])).is_empty());
        assert_eq!(
            KubeSpanConfigDocument::default().peer_endpoint_filters(),
            None
        );
    }

    #[test]
    fn extra_endpoints_need_a_port() {
        let e = KubeSpanEndpointsConfig {
            extra_announced_endpoints: vec!["1.2.3.4:0".parse().unwrap()],
        };
        assert_eq!(e.validate()[0].field, "extraAnnouncedEndpoints[0]");
    }
}
