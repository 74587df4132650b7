//! Controller restart backoff (`docs/runtime.md` §3.5). Its schedule is the discovery
//! client's reconnect backoff (start at 0.5 s, ±50 % jitter, ×1.5 up to 60 s, never
//! give up), so it is that one implementation, pure, with the jitter drawn by the
//! caller.

pub use wirespan_discovery::client::backoff::{
    Backoff, INITIAL_INTERVAL, MAX_INTERVAL, MULTIPLIER,
};
