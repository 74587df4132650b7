//! The two nf_tables netlink operations the marking adapter does itself instead of
//! running `nft`: reading the ruleset generation, and committing a batch of set
//! element changes.
//!
//! `nft` (1.0.x) fetches every element of every set before it runs any command, so a
//! one-element change through it costs time proportional to the set size (≈ 20 ms at
//! 10,000 elements here). An element batch sent directly costs one round trip whatever
//! the set size. Encoding is pure ([`element_batch`]) and unit-tested; the kernel tests
//! check the result through `nft -j list`.

use std::{io, net::IpAddr, time::Duration};

use ipnet::IpNet;
use rtnetlink::sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 16;
const NFNL_MSG_BATCH_END: u16 = 17;
const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFTA_GEN_ID: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_DATA_VALUE: u16 = 1;
const NFT_SET_ELEM_INTERVAL_END: u32 = 1;
const NLA_F_NESTED: u16 = 0x8000;
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLM_F_CREATE: u16 = 0x400;
const NFPROTO_INET: u8 = 1;

/// Kernel entries per message: the nested element list's length is a u16.
const ENTRIES_PER_MESSAGE: usize = 1024;
/// Kernel entries per batch: the batch is one datagram, bounded by the socket's send
/// buffer (≈ 200 KiB by default); bigger diffs go through `nft`.
pub(crate) const MAX_BATCH_ENTRIES: usize = 2048;
/// How long to wait for the kernel's acknowledgements.
const ACK_TIMEOUT: Duration = Duration::from_secs(2);

/// Opens an nf_tables netlink socket in the calling thread's namespace.
pub(crate) fn open() -> io::Result<Socket> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    // Errors without the echoed request: a refused 2,000-element batch stays small.
    sock.set_cap_ack(true)?;
    nix::sys::socket::setsockopt(
        &sock,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::new(i64::try_from(ACK_TIMEOUT.as_secs()).unwrap_or(2), 0),
    )
    .map_err(io::Error::from)?;
    Ok(sock)
}

fn header(buf: &mut Vec<u8>, kind: u16, flags: u16, seq: u32, family: u8, res_id: u16) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&0u32.to_ne_bytes()); // length, patched by `finish`
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(&flags.to_ne_bytes());
    buf.extend_from_slice(&seq.to_ne_bytes());
    buf.extend_from_slice(&0u32.to_ne_bytes());
    buf.push(family);
    buf.push(0); // NFNETLINK_V0
    buf.extend_from_slice(&res_id.to_be_bytes());
    start
}

fn finish(buf: &mut [u8], start: usize) {
    let len = u32::try_from(buf.len() - start).unwrap_or(u32::MAX);
    buf[start..start + 4].copy_from_slice(&len.to_ne_bytes());
}

fn attr(buf: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
    buf.extend_from_slice(&len.to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(payload);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

fn nest_start(buf: &mut Vec<u8>, kind: u16) -> usize {
    let start = buf.len();
    buf.extend_from_slice(&0u16.to_ne_bytes());
    buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    start
}

fn nest_end(buf: &mut [u8], start: usize) {
    let len = u16::try_from(buf.len() - start).unwrap_or(u16::MAX);
    buf[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// The kernel entries of one set element, as nft writes them: an exact address is its
/// key; a prefix in an interval set is its start plus an interval-end entry at the
/// first address after it (none when it reaches the top of the address space).
pub(crate) fn kernel_entries(p: &IpNet, interval: bool) -> Vec<(Vec<u8>, u32)> {
    let bytes = |a: IpAddr| match a {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    if !interval {
        return vec![(bytes(p.addr()), 0)];
    }
    let mut out = vec![(bytes(p.network()), 0)];
    let end = match p {
        IpNet::V4(n) => u32::from(n.broadcast())
            .checked_add(1)
            .map(|e| IpAddr::V4(e.into())),
        IpNet::V6(n) => u128::from(n.broadcast())
            .checked_add(1)
            .map(|e| IpAddr::V6(e.into())),
    };
    if let Some(e) = end {
        out.push((bytes(e), NFT_SET_ELEM_INTERVAL_END));
    }
    out
}

/// Element changes of one set, ready to encode.
pub(crate) struct SetChange<'a> {
    pub set: &'a str,
    pub interval: bool,
    pub add: &'a [IpNet],
    pub delete: &'a [IpNet],
}

/// Number of kernel entries `changes` write.
pub(crate) fn entry_count(changes: &[SetChange<'_>]) -> usize {
    let per = |p: &IpNet, interval: bool| kernel_entries(p, interval).len();
    changes
        .iter()
        .map(|c| {
            c.add
                .iter()
                .chain(c.delete)
                .map(|p| per(p, c.interval))
                .sum::<usize>()
        })
        .sum()
}

/// Encodes one transaction: batch begin, every delete (first, so a prefix replaced by
/// a covering one never overlaps), every add, batch end. Every element message asks
/// for an acknowledgement; returns the datagram and the sequence numbers to expect.
pub(crate) fn element_batch(
    table: &str,
    changes: &[SetChange<'_>],
    seq: &mut u32,
) -> (Vec<u8>, Vec<u32>) {
    let mut buf = Vec::new();
    let mut acks = Vec::new();
    let mut next = || {
        *seq = seq.wrapping_add(1);
        *seq
    };
    let s = header(
        &mut buf,
        NFNL_MSG_BATCH_BEGIN,
        NLM_F_REQUEST,
        next(),
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    finish(&mut buf, s);
    let ops = [
        (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK),
        (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE),
    ];
    for (msg, flags) in ops {
        for c in changes {
            let list = if msg == NFT_MSG_DELSETELEM {
                c.delete
            } else {
                c.add
            };
            let entries: Vec<_> = list
                .iter()
                .flat_map(|p| kernel_entries(p, c.interval))
                .collect();
            for chunk in entries.chunks(ENTRIES_PER_MESSAGE) {
                let seq = next();
                acks.push(seq);
                let m = header(
                    &mut buf,
                    (NFNL_SUBSYS_NFTABLES << 8) | msg,
                    flags,
                    seq,
                    NFPROTO_INET,
                    0,
                );
                attr(&mut buf, NFTA_SET_ELEM_LIST_TABLE, &cstr(table));
                attr(&mut buf, NFTA_SET_ELEM_LIST_SET, &cstr(c.set));
                let elems = nest_start(&mut buf, NFTA_SET_ELEM_LIST_ELEMENTS);
                for (key, eflags) in chunk {
                    let e = nest_start(&mut buf, NFTA_LIST_ELEM);
                    let k = nest_start(&mut buf, NFTA_SET_ELEM_KEY);
                    attr(&mut buf, NFTA_DATA_VALUE, key);
                    nest_end(&mut buf, k);
                    if *eflags != 0 {
                        attr(&mut buf, NFTA_SET_ELEM_FLAGS, &eflags.to_be_bytes());
                    }
                    nest_end(&mut buf, e);
                }
                nest_end(&mut buf, elems);
                finish(&mut buf, m);
            }
        }
    }
    let e = header(
        &mut buf,
        NFNL_MSG_BATCH_END,
        NLM_F_REQUEST,
        next(),
        0,
        NFNL_SUBSYS_NFTABLES,
    );
    finish(&mut buf, e);
    (buf, acks)
}

/// Why an element batch did not commit.
#[derive(Debug)]
pub(crate) enum BatchError {
    /// The kernel refused a message (errno); the whole batch was aborted.
    Refused(i32),
    /// Socket trouble: the outcome is unknown, the caller must re-read the table.
    Io(io::Error),
}

/// Sends a batch from [`element_batch`] and waits for every acknowledgement.
pub(crate) fn commit(sock: &Socket, batch: &[u8], acks: &[u32]) -> Result<(), BatchError> {
    sock.send_to(batch, &SocketAddr::new(0, 0), 0)
        .map_err(BatchError::Io)?;
    let mut pending: Vec<u32> = acks.to_vec();
    let mut refused = None;
    while !pending.is_empty() {
        let (buf, _) = sock.recv_from_full().map_err(BatchError::Io)?;
        take_acks(&buf, &mut pending, &mut refused);
    }
    refused.map_or(Ok(()), |e| Err(BatchError::Refused(e)))
}

/// Takes the acknowledgements in one received datagram off `pending`, and records the
/// first refusal's errno in `refused` (after which nothing is pending any more).
/// Pure, so the fuzz target can drive it with arbitrary datagrams.
#[doc(hidden)]
pub fn take_acks(buf: &[u8], pending: &mut Vec<u32>, refused: &mut Option<i32>) {
    for (kind, seq, body) in messages(buf) {
        if kind != NLMSG_ERROR || body.len() < 4 {
            continue;
        }
        let Some(i) = pending.iter().position(|s| *s == seq) else {
            continue;
        };
        pending.swap_remove(i);
        // Wrapping: a bogus `i32::MIN` must not overflow; it is still a refusal.
        let errno = i32::from_ne_bytes(body[..4].try_into().unwrap_or_default()).wrapping_neg();
        if errno != 0 && refused.is_none() {
            *refused = Some(errno);
            // The kernel aborts the batch; acknowledgements of the other messages
            // may or may not follow, and they no longer matter.
            pending.clear();
        }
    }
}

/// (type, seq, payload) of every netlink message in a datagram.
#[doc(hidden)]
#[must_use]
pub fn messages(buf: &[u8]) -> Vec<(u16, u32, &[u8])> {
    let mut out = Vec::new();
    let mut off = 0;
    while off + 16 <= buf.len() {
        let len = u32::from_ne_bytes(buf[off..off + 4].try_into().unwrap_or_default()) as usize;
        if len < 16 || off + len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes([buf[off + 4], buf[off + 5]]);
        let seq = u32::from_ne_bytes(buf[off + 8..off + 12].try_into().unwrap_or_default());
        out.push((kind, seq, &buf[off + 16..off + len]));
        off += len.next_multiple_of(4);
    }
    out
}

/// Reads the ruleset generation (`NFT_MSG_GETGEN`).
pub(crate) fn generation(sock: &Socket, seq: u32) -> io::Result<u32> {
    let mut req = Vec::with_capacity(20);
    let s = header(
        &mut req,
        (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN,
        NLM_F_REQUEST,
        seq,
        0,
        0,
    );
    finish(&mut req, s);
    sock.send_to(&req, &SocketAddr::new(0, 0), 0)?;
    loop {
        let (buf, _) = sock.recv_from_full()?;
        if let Some(answer) = generation_reply(&buf, seq) {
            return answer;
        }
    }
}

/// The answer to `NFT_MSG_GETGEN` number `seq` in one received datagram: `None` when
/// the datagram holds no answer to it (late acknowledgements of earlier batches).
/// Pure, so the fuzz target can drive it with arbitrary datagrams.
#[doc(hidden)]
#[must_use]
pub fn generation_reply(buf: &[u8], seq: u32) -> Option<io::Result<u32>> {
    for (kind, mseq, body) in messages(buf) {
        if mseq != seq {
            // A late acknowledgement of an earlier batch.
            continue;
        }
        if kind == NLMSG_ERROR && body.len() >= 4 {
            let errno = i32::from_ne_bytes(body[..4].try_into().unwrap_or_default());
            return Some(Err(io::Error::from_raw_os_error(errno.wrapping_neg())));
        }
        if kind == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN {
            // Skip nfgenmsg (4 bytes), then walk the attributes.
            let mut a = 4;
            while a + 4 <= body.len() {
                let alen = usize::from(u16::from_ne_bytes([body[a], body[a + 1]]));
                let atype = u16::from_ne_bytes([body[a + 2], body[a + 3]]) & 0x3fff;
                if alen < 4 || a + alen > body.len() {
                    break;
                }
                if atype == NFTA_GEN_ID && alen >= 8 {
                    return Some(Ok(u32::from_be_bytes(
                        body[a + 4..a + 8].try_into().unwrap_or_default(),
                    )));
                }
                a += alen.next_multiple_of(4);
            }
            return Some(Err(io::Error::other("NEWGEN without NFTA_GEN_ID")));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn interval_entries_are_start_and_end_after_the_prefix() {
        assert_eq!(
            kernel_entries(&p("20.0.0.0/26"), true),
            vec![(vec![20, 0, 0, 0], 0), (vec![20, 0, 0, 64], 1)]
        );
        // A host address in an interval set is a one-address interval.
        assert_eq!(
            kernel_entries(&p("10.1.2.3/32"), true),
            vec![(vec![10, 1, 2, 3], 0), (vec![10, 1, 2, 4], 1)]
        );
        // Reaching the top of the space: no end entry.
        assert_eq!(
            kernel_entries(&p("255.255.255.0/24"), true),
            vec![(vec![255, 255, 255, 0], 0)]
        );
        let v6 = kernel_entries(&p("fd10::/64"), true);
        assert_eq!(v6[1].0[..8], [0xfd, 0x10, 0, 0, 0, 0, 0, 1]);
        assert_eq!(v6[1].1, 1);
        assert_eq!(
            kernel_entries(&p("1.2.3.4/32"), false),
            vec![(vec![1, 2, 3, 4], 0)]
        );
    }

    #[test]
    fn batch_is_begin_deletes_adds_end_with_acks_on_element_messages() {
        let add = [p("10.0.0.0/24")];
        let del = [p("10.1.0.0/24")];
        let changes = [SetChange {
            set: "v4_nets",
            interval: true,
            add: &add,
            delete: &del,
        }];
        let mut seq = 100;
        let (buf, acks) = element_batch("wirespan", &changes, &mut seq);
        let msgs = messages(&buf);
        let kinds: Vec<u16> = msgs.iter().map(|m| m.0).collect();
        assert_eq!(
            kinds,
            vec![
                NFNL_MSG_BATCH_BEGIN,
                (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELSETELEM,
                (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM,
                NFNL_MSG_BATCH_END
            ]
        );
        assert_eq!(acks, vec![102, 103]);
        assert_eq!(seq, 104);
        // Batch begin addresses the nftables subsystem (big-endian res_id).
        assert_eq!(msgs[0].2[..4], [0, 0, 0, 10]);
        // The add message: nfgenmsg (inet), table, set, then two nested entries.
        let body = msgs[2].2;
        assert_eq!(body[..4], [NFPROTO_INET, 0, 0, 0]);
        assert_eq!(&body[8..17], b"wirespan\0");
        let needle = [10u8, 0, 1, 0];
        assert!(body.windows(4).any(|w| w == needle), "end key 10.0.1.0");
        assert_eq!(entry_count(&changes), 4);
    }

    #[test]
    fn large_lists_are_split_into_messages_under_the_attribute_limit() {
        let add: Vec<IpNet> = (0..1500u32)
            .map(|i| IpNet::V6(ipnet::Ipv6Net::new((u128::from(i) << 64).into(), 64).unwrap()))
            .collect();
        let changes = [SetChange {
            set: "v6_nets",
            interval: true,
            add: &add,
            delete: &[],
        }];
        let (buf, acks) = element_batch("t", &changes, &mut 0);
        // 3000 entries: three messages of at most 1024.
        assert_eq!(acks.len(), 3);
        for (_, _, body) in messages(&buf) {
            assert!(body.len() < 65_000);
        }
    }

    fn nlmsg(kind: u16, seq: u32, body: &[u8]) -> Vec<u8> {
        let len = u32::try_from(16 + body.len()).unwrap();
        let mut m = Vec::new();
        m.extend(len.to_ne_bytes());
        m.extend(kind.to_ne_bytes());
        m.extend(0u16.to_ne_bytes());
        m.extend(seq.to_ne_bytes());
        m.extend(0u32.to_ne_bytes());
        m.extend(body);
        m
    }

    /// Fuzzing (`nfnl_reply`): an error message carrying `i32::MIN` overflowed the
    /// negation of the errno.
    #[test]
    fn errno_of_i32_min_does_not_overflow() {
        let buf = nlmsg(NLMSG_ERROR, 7, &i32::MIN.to_ne_bytes());
        let mut pending = vec![7, 8];
        let mut refused = None;
        take_acks(&buf, &mut pending, &mut refused);
        assert!(refused.is_some() && pending.is_empty());
        assert!(matches!(generation_reply(&buf, 7), Some(Err(_))));
    }

    #[test]
    fn generation_reply_reads_the_gen_id_and_skips_other_sequences() {
        let mut body = vec![0u8; 4];
        body.extend(8u16.to_ne_bytes());
        body.extend(NFTA_GEN_ID.to_ne_bytes());
        body.extend(42u32.to_be_bytes());
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN;
        let mut buf = nlmsg(NLMSG_ERROR, 1, &0i32.to_ne_bytes());
        buf.extend(nlmsg(kind, 2, &body));
        assert!(generation_reply(&buf, 3).is_none());
        assert_eq!(generation_reply(&buf, 2).unwrap().unwrap(), 42);
    }
}
