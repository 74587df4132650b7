//! What a test ran: the WireGuard backend, the fast-path attach mode. Appended as
//! `KIND VALUE KERNEL-RELEASE` lines to the file named by `WIRESPAN_TEST_RECORD`
//! (set by `scripts/test.sh`, which ends the suite with one line naming what ran, on
//! the host and in the VM). Without the variable nothing is written.

use std::io::Write as _;

/// Records that this test ran `value` of `kind` (`wireguard kernel`, `attach clsact`).
pub fn record(kind: &str, value: &str) {
    let Some(path) = std::env::var_os("WIRESPAN_TEST_RECORD") else {
        return;
    };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let line = format!("{kind} {value} {}\n", release.trim());
    // One write of a short line to a file opened for append: lines of tests running
    // at once do not interleave.
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()))
        .unwrap_or_else(|e| panic!("recording to {}: {e}", path.to_string_lossy()));
}
