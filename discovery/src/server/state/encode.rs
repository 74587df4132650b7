//! Hand-written encoding of Watch messages: each affiliate's entry is encoded once and
//! the same bytes go to every watcher, gRPC-framed, as prost would encode them.

use bytes::{BufMut, Bytes, BytesMut};
use prost::encoding::{encode_varint, encoded_len_varint};

use super::Affiliate;

/// Largest body frame a watch stream hands to the transport. A message longer than
/// this (a snapshot, a catch-up batch) is copied out in pieces as the transport
/// takes them, so a watcher that stops reading pins at most one piece in the
/// transport's buffers; the rest stays in its queue, where an abort can free it.
pub const FRAME: usize = 16 * 1024;

/// Length of the gRPC message prefix (compression flag, big-endian length). Every
/// message is encoded with it in front, so an event that fits one body frame goes to
/// each watcher's transport as the very bytes every other watcher gets.
pub(crate) const PREFIX: usize = 5;

/// Starts a gRPC-framed message: room for the prefix, filled in by [`seal`].
pub(crate) fn framed(capacity: usize) -> BytesMut {
    let mut buf = BytesMut::with_capacity(PREFIX + capacity);
    buf.put_bytes(0, PREFIX);
    buf
}

/// Fills in the prefix of a message begun with [`framed`] (uncompressed, its length).
pub(crate) fn seal(buf: &mut BytesMut) {
    // Messages are far below 4 GiB (a maximal cluster encodes to ~4.5 MiB).
    let len = u32::try_from(buf.len() - PREFIX).unwrap_or(u32::MAX);
    buf[1..PREFIX].copy_from_slice(&len.to_be_bytes());
}

/// Encoded length of `Affiliate{id, data, endpoints}`.
fn affiliate_len(id: &str, a: &Affiliate) -> usize {
    let field = |n: usize| 1 + encoded_len_varint(n as u64) + n;
    let mut len = 0;
    if !id.is_empty() {
        len += field(id.len());
    }
    if !a.data().is_empty() {
        len += field(a.data().len());
    }
    len + a.endpoints().map(|e| field(e.data.len())).sum::<usize>()
}

fn put_field(buf: &mut BytesMut, tag: u8, bytes: &[u8]) {
    buf.put_u8(tag);
    encode_varint(bytes.len() as u64, buf);
    buf.put_slice(bytes);
}

/// Appends one `affiliates` entry (field 1 of `WatchResponse`/`ListResponse`) with
/// the affiliate's ID, data and endpoints, as prost would encode it.
pub(crate) fn put_affiliate(buf: &mut BytesMut, id: &str, a: &Affiliate) {
    buf.put_u8(0x0a);
    encode_varint(affiliate_len(id, a) as u64, buf);
    if !id.is_empty() {
        put_field(buf, 0x0a, id.as_bytes());
    }
    if !a.data().is_empty() {
        put_field(buf, 0x12, a.data());
    }
    for e in a.endpoints() {
        put_field(buf, 0x1a, e.data);
    }
}

/// One affiliate's upsert event: a framed `WatchResponse` with its entry alone.
pub(crate) fn encode_event(id: &str, a: &Affiliate) -> Bytes {
    let mut buf = framed(affiliate_entry_len(id, a));
    put_affiliate(&mut buf, id, a);
    seal(&mut buf);
    buf.freeze()
}

/// Bytes [`put_affiliate`] appends.
pub(crate) fn affiliate_entry_len(id: &str, a: &Affiliate) -> usize {
    let len = affiliate_len(id, a);
    1 + encoded_len_varint(len as u64) + len
}

/// Appends a deleted affiliate's entry (ID only).
pub(crate) fn put_deleted(buf: &mut BytesMut, id: &str) {
    let inner = if id.is_empty() {
        0
    } else {
        1 + encoded_len_varint(id.len() as u64) + id.len()
    };
    buf.put_u8(0x0a);
    encode_varint(inner as u64, buf);
    if !id.is_empty() {
        put_field(buf, 0x0a, id.as_bytes());
    }
}

/// Ends a `WatchResponse` whose affiliates were all deleted (field 2 = true).
pub(crate) fn put_deleted_flag(buf: &mut BytesMut) {
    buf.put_slice(&[0x10, 0x01]);
}
