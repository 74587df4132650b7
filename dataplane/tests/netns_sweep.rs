//! A guard's namespace outlives a test process killed before its guards dropped; the
//! next test process's first guard removes it (with what runs inside), and leaves the
//! namespaces of live processes alone. One test in its own binary: the sweep runs once
//! per process.

use wirespan_dataplane::netns::{Netns, NetnsGuard};

fn namespaces() -> Vec<String> {
    Netns::current()
        .run_stdout("ip", &["netns", "list"])
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

/// Deletes the namespace even if the test fails before the sweep does.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = Netns::current().run("ip", &["netns", "del", &self.0]);
    }
}

#[test]
fn first_guard_sweeps_namespaces_of_dead_test_processes() {
    // A pid that is certainly dead: a child that ran and was reaped.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = format!("wssweep-{dead}-0");
    let live = format!("wssweep-{}-999", std::process::id());
    let _c = (Cleanup(stale.clone()), Cleanup(live.clone()));
    for n in [&stale, &live] {
        Netns::current().run("ip", &["netns", "add", n]).unwrap();
    }
    // Something running inside the stale one, as a wireguard-go would be.
    let stale_ns = Netns::named(stale.clone());
    let mut sleeper = stale_ns.command("sleep").arg("60").spawn().unwrap();
    // Spawned is not yet inside: wait until the namespace lists it.
    let pid = sleeper.id().to_string();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !Netns::current()
        .run_stdout("ip", &["netns", "pids", &stale])
        .unwrap_or_default()
        .split_whitespace()
        .any(|p| p == pid)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "sleep never entered {stale}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }

    let _guard = NetnsGuard::new("wssweep").unwrap();
    let after = namespaces();
    assert!(!after.contains(&stale), "stale namespace left: {after:?}");
    assert!(
        after.contains(&live),
        "a live process's namespace was removed"
    );
    // The process inside was killed, not left running without its namespace.
    let status = sleeper.wait().unwrap();
    assert!(!status.success(), "{status:?}");
}
