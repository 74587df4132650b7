//! Allowed IPs: the routing table from a destination address to a peer (longest
//! prefix wins) and the source check on decrypted packets.

use std::{
    collections::HashMap,
    hash::Hash,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;

/// Prefixes to peer ids, IPv4 and IPv6, longest prefix first on lookup.
#[derive(Debug, Clone)]
pub struct AllowedIps<P> {
    /// Per prefix length (index), the masked network address to its peer.
    v4: Vec<HashMap<u32, P>>,
    v6: Vec<HashMap<u128, P>>,
}

impl<P> Default for AllowedIps<P> {
    fn default() -> Self {
        Self {
            v4: (0..=32).map(|_| HashMap::new()).collect(),
            v6: (0..=128).map(|_| HashMap::new()).collect(),
        }
    }
}

fn mask4(addr: Ipv4Addr, len: u8) -> u32 {
    let bits = u32::from(addr);
    if len == 0 {
        0
    } else {
        bits & (u32::MAX << (32 - u32::from(len)))
    }
}

fn mask6(addr: Ipv6Addr, len: u8) -> u128 {
    let bits = u128::from(addr);
    if len == 0 {
        0
    } else {
        bits & (u128::MAX << (128 - u32::from(len)))
    }
}

/// Removes `key` from `table` if it maps to `peer`.
fn remove_if<K: Eq + Hash, P: PartialEq>(table: &mut HashMap<K, P>, key: &K, peer: &P) {
    if table.get(key) == Some(peer) {
        table.remove(key);
    }
}

impl<P: Copy + PartialEq> AllowedIps<P> {
    /// Routes `net` to `peer`, taking it from any peer that had it (as WireGuard does).
    pub fn insert(&mut self, net: IpNet, peer: P) {
        match net {
            IpNet::V4(n) => {
                let len = n.prefix_len();
                self.v4[usize::from(len)].insert(mask4(n.addr(), len), peer);
            }
            IpNet::V6(n) => {
                let len = n.prefix_len();
                self.v6[usize::from(len)].insert(mask6(n.addr(), len), peer);
            }
        }
    }

    /// Removes `net` if it routes to `peer` (another peer's prefix stays).
    pub fn remove(&mut self, net: IpNet, peer: P) {
        let len = net.prefix_len();
        match net {
            IpNet::V4(n) => remove_if(&mut self.v4[usize::from(len)], &mask4(n.addr(), len), &peer),
            IpNet::V6(n) => remove_if(&mut self.v6[usize::from(len)], &mask6(n.addr(), len), &peer),
        }
    }

    /// Removes every prefix of `peer`.
    pub fn remove_peer(&mut self, peer: P) {
        for table in &mut self.v4 {
            table.retain(|_, p| *p != peer);
        }
        for table in &mut self.v6 {
            table.retain(|_, p| *p != peer);
        }
    }

    /// The peer whose longest prefix contains `addr`.
    pub fn lookup(&self, addr: IpAddr) -> Option<P> {
        match addr {
            IpAddr::V4(a) => (0..=32u8)
                .rev()
                .filter(|len| !self.v4[usize::from(*len)].is_empty())
                .find_map(|len| self.v4[usize::from(len)].get(&mask4(a, len)).copied()),
            IpAddr::V6(a) => (0..=128u8)
                .rev()
                .filter(|len| !self.v6[usize::from(*len)].is_empty())
                .find_map(|len| self.v6[usize::from(len)].get(&mask6(a, len)).copied()),
        }
    }

    /// The prefixes of `peer`, IPv4 first, each family longest first.
    pub fn prefixes_of(&self, peer: P) -> Vec<IpNet> {
        let mut out = Vec::new();
        for (len, table) in self.v4.iter().enumerate().rev() {
            for (bits, p) in table {
                if *p == peer {
                    let len = u8::try_from(len).unwrap_or(32);
                    out.extend(ipnet::Ipv4Net::new(Ipv4Addr::from(*bits), len).map(IpNet::V4));
                }
            }
        }
        for (len, table) in self.v6.iter().enumerate().rev() {
            for (bits, p) in table {
                if *p == peer {
                    let len = u8::try_from(len).unwrap_or(128);
                    out.extend(ipnet::Ipv6Net::new(Ipv6Addr::from(*bits), len).map(IpNet::V6));
                }
            }
        }
        out
    }
}

/// The destination address of an IP packet, or `None` when it is not IPv4/IPv6 or too short.
pub fn packet_destination(packet: &[u8]) -> Option<IpAddr> {
    match packet.first()? >> 4 {
        4 if packet.len() >= 20 => {
            let b: [u8; 4] = packet[16..20].try_into().ok()?;
            Some(IpAddr::from(b))
        }
        6 if packet.len() >= 40 => {
            let b: [u8; 16] = packet[24..40].try_into().ok()?;
            Some(IpAddr::from(b))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn longest_prefix_wins_in_both_families() {
        let mut t = AllowedIps::default();
        t.insert(net("0.0.0.0/0"), 1);
        t.insert(net("10.0.0.0/8"), 2);
        t.insert(net("10.1.2.0/24"), 3);
        t.insert(net("fd00::/8"), 4);
        t.insert(net("fd00:1::/32"), 5);
        assert_eq!(t.lookup(ip("10.1.2.3")), Some(3));
        assert_eq!(t.lookup(ip("10.1.3.3")), Some(2));
        assert_eq!(t.lookup(ip("192.0.2.1")), Some(1));
        assert_eq!(t.lookup(ip("fd00:1::9")), Some(5));
        assert_eq!(t.lookup(ip("fd00:2::9")), Some(4));
        assert_eq!(t.lookup(ip("2001:db8::1")), None);
    }

    #[test]
    fn a_prefix_moves_to_its_last_owner_and_removal_is_per_peer() {
        let mut t = AllowedIps::default();
        t.insert(net("10.0.0.1/32"), 1);
        t.insert(net("10.0.0.1/32"), 2);
        assert_eq!(t.lookup(ip("10.0.0.1")), Some(2));
        assert!(t.prefixes_of(1).is_empty());
        t.insert(net("10.0.0.0/24"), 1);
        t.remove_peer(2);
        assert_eq!(t.lookup(ip("10.0.0.1")), Some(1));
        assert_eq!(t.prefixes_of(1), vec![net("10.0.0.0/24")]);
    }

    #[test]
    fn host_bits_are_ignored() {
        let mut t = AllowedIps::default();
        t.insert(net("10.9.8.7/16"), 7);
        assert_eq!(t.lookup(ip("10.9.0.1")), Some(7));
        assert_eq!(t.prefixes_of(7), vec![net("10.9.0.0/16")]);
    }

    #[test]
    fn destination_of_short_or_unknown_packets_is_none() {
        assert_eq!(packet_destination(&[]), None);
        assert_eq!(packet_destination(&[0x45; 19]), None);
        assert_eq!(packet_destination(&[0x15; 60]), None);
        let mut v4 = [0u8; 20];
        v4[0] = 0x45;
        v4[16..20].copy_from_slice(&[10, 0, 0, 2]);
        assert_eq!(packet_destination(&v4), Some(ip("10.0.0.2")));
    }
}
