//! Snapshot loading (`discovery::server::snapshot::read`) of arbitrary bytes. What
//! loads must save and load again to the same file.
#![no_main]

use std::time::{Duration, Instant, SystemTime};

use libfuzzer_sys::fuzz_target;
use wirespan_discovery::server::snapshot;

/// The state's counts without the load's own tally of dropped entries.
fn snapshot_counts(
    state: &wirespan_discovery::server::state::State,
) -> wirespan_discovery::server::state::Counts {
    wirespan_discovery::server::state::Counts {
        snapshot_dropped: 0,
        ..state.counts()
    }
}

fuzz_target!(|data: &[u8]| {
    let now = Instant::now();
    // A fixed wall clock keeps legacy absolute expirations reproducible.
    let wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let Ok(state) = snapshot::read(data, now, wall) else {
        return;
    };
    let file = snapshot::encode_state(&state, now);
    let again = snapshot::read(file.as_slice(), now, wall).expect("our own snapshot loads");
    // What the first load dropped for breaking a limit is not in the file any more.
    let first = snapshot_counts(&state);
    assert_eq!(first, snapshot_counts(&again));
    assert_eq!(snapshot::encode_state(&again, now), file);
});
