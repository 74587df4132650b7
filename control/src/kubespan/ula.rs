//! ULA addressing (`docs/kubespan.md` §3): the cluster's /64 from the cluster ID, the node address
//! from the MAC by EUI-64.

use std::net::{IpAddr, Ipv6Addr};

use ipnet::Ipv6Net;
use sha2::{Digest as _, Sha256};

/// ULA purpose byte of unknown addresses.
pub const PURPOSE_UNKNOWN: u8 = 0x00;
/// ULA purpose byte of bootstrap addresses.
pub const PURPOSE_BOOTSTRAP: u8 = 0x01;
/// ULA purpose byte of KubeSpan addresses.
pub const PURPOSE_KUBESPAN: u8 = 0x02;
/// ULA purpose byte of SideroLink addresses.
pub const PURPOSE_SIDEROLINK: u8 = 0x03;

/// A hardware address that cannot make an EUI-64 interface identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hardware address of {len} bytes cannot derive an EUI-64 (want 6 or 8)")]
pub struct BadMac {
    /// Length of the address given.
    pub len: usize,
}

/// The cluster's /64 for `purpose` (§3.1): `fd : sha256(id)[17..23] : purpose`.
#[must_use]
pub fn cluster_prefix(cluster_id: &str, purpose: u8) -> Ipv6Net {
    let h = Sha256::digest(cluster_id.as_bytes());
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&h[16..24]);
    p[0] = 0xfd;
    p[7] = purpose;
    Ipv6Net::new(Ipv6Addr::from(p), 64).unwrap_or_default()
}

/// EUI-64 interface identifier of `mac` (§3.2): a 6-byte MAC gets `ff:fe` inserted, an
/// 8-byte one is used as is; the universal/local bit is flipped in both.
///
/// # Errors
/// Any other length.
pub fn eui64(mac: &[u8]) -> Result<[u8; 8], BadMac> {
    let mut id = match mac.len() {
        6 => [mac[0], mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]],
        8 => {
            let mut id = [0u8; 8];
            id.copy_from_slice(mac);
            id
        }
        len => return Err(BadMac { len }),
    };
    id[0] ^= 0x02;
    Ok(id)
}

/// The node address: the prefix's first 8 bytes, then the EUI-64 of `mac`.
///
/// # Errors
/// See [`eui64`].
pub fn node_address(prefix: Ipv6Net, mac: &[u8]) -> Result<Ipv6Addr, BadMac> {
    let mut a = prefix.network().octets();
    a[8..].copy_from_slice(&eui64(mac)?);
    Ok(Ipv6Addr::from(a))
}

/// Whether `ip` is a ULA of `purpose` (any cluster): IPv6, `fd` first, `purpose` 8th.
#[must_use]
pub fn is_ula(ip: IpAddr, purpose: u8) -> bool {
    match ip {
        IpAddr::V6(v6) => {
            let o = v6.octets();
            o[0] == 0xfd && o[7] == purpose
        }
        IpAddr::V4(_) => false,
    }
}

/// Parses `aa:bb:cc:dd:ee:ff` (any number of hex bytes separated by `:`).
#[must_use]
pub fn parse_mac(text: &str) -> Option<Vec<u8>> {
    text.split(':')
        .map(|b| u8::from_str_radix(b, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_vectors() {
        let cases = [
            (
                "8XuV9TZHW08DOk3bVxQjH9ih_TBKjnh-j44tsCLSBzo=",
                "2e:1a:b6:53:81:69",
                "fd7f:175a:b97c:5602::/64",
                "fd7f:175a:b97c:5602:2c1a:b6ff:fe53:8169",
            ),
            (
                "8XuV9TZHW08DOk3bVxQjH9ih_TBKjnh-j44tsCLSBzo=",
                "ea:71:1b:b2:cc:ee",
                "fd7f:175a:b97c:5602::/64",
                "fd7f:175a:b97c:5602:e871:1bff:feb2:ccee",
            ),
            (
                "test-cluster-id",
                "00:16:3e:12:34:56",
                "fd21:4de:ec13:da02::/64",
                "fd21:4de:ec13:da02:216:3eff:fe12:3456",
            ),
            (
                "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                "02:00:00:00:00:01",
                "fded:ec9b:c9ea:b02::/64",
                "fded:ec9b:c9ea:b02:0:ff:fe00:1",
            ),
        ];
        for (id, mac, prefix, addr) in cases {
            let p = cluster_prefix(id, PURPOSE_KUBESPAN);
            assert_eq!(p.to_string(), prefix, "{id}");
            let a = node_address(p, &parse_mac(mac).unwrap()).unwrap();
            assert_eq!(a, addr.parse::<Ipv6Addr>().unwrap(), "{id} {mac}");
            assert!(is_ula(IpAddr::V6(a), PURPOSE_KUBESPAN));
            assert!(!is_ula(IpAddr::V6(a), PURPOSE_SIDEROLINK));
        }
        assert_eq!(
            cluster_prefix(
                "8XuV9TZHW08DOk3bVxQjH9ih_TBKjnh-j44tsCLSBzo=",
                PURPOSE_SIDEROLINK
            )
            .to_string(),
            "fd7f:175a:b97c:5603::/64"
        );
    }

    #[test]
    fn eight_byte_mac_is_used_as_is_and_other_lengths_fail() {
        assert_eq!(
            eui64(&[0, 1, 2, 3, 4, 5, 6, 7]).unwrap(),
            [2, 1, 2, 3, 4, 5, 6, 7]
        );
        assert_eq!(eui64(&[1, 2, 3]), Err(BadMac { len: 3 }));
        assert!(!is_ula("10.0.0.1".parse().unwrap(), PURPOSE_KUBESPAN));
    }
}
