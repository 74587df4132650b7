//! The hand-written nf_tables netlink reply parsers (`dataplane::nfnl`): message
//! splitting, the GETGEN answer and batch acknowledgements, on arbitrary datagrams.
//! Input: a little-endian u32 sequence number (the GETGEN request's, and the first of
//! three pending batch acknowledgements), then the datagram.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wirespan_dataplane::nfnl;

fuzz_target!(|data: &[u8]| {
    let Some((seq, buf)) = data.split_first_chunk::<4>() else {
        return;
    };
    let seq = u32::from_le_bytes(*seq);
    for (_, _, body) in nfnl::messages(buf) {
        assert!(body.len() <= buf.len());
    }
    let _ = nfnl::generation_reply(buf, seq);
    let mut pending = vec![seq, seq.wrapping_add(1), seq.wrapping_add(2)];
    let mut refused = None;
    nfnl::take_acks(buf, &mut pending, &mut refused);
    assert!(pending.len() <= 3);
    if refused.is_some() {
        assert!(pending.is_empty());
    }
});
