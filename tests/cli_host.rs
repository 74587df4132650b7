//! `wirespan node` with `HostnameConfig`, `ResolverConfig` and `TimeServerConfig`, run
//! in a network namespace, a UTS namespace and a mount namespace of its own with a
//! tmpfs on `/etc`: the machine's host name and files are never touched. The test
//! reads the node's `/etc` through `/proc/<pid>/root`.

mod common;

use std::{path::Path, process::Command, time::Duration};

use common::{cli, wait_for_path, ChildGuard, BIN};
use wirespan_dataplane::netns::NetnsGuard;

const HOSTNAME_ORIG: &str = "machine-name\n";
const RESOLV_ORIG: &str = "# from DHCP\nnameserver 192.0.2.1\n";

/// Starts the node with `/etc` a fresh tmpfs holding the original files.
fn start(ns: &NetnsGuard, dir: &Path, config: &Path) -> ChildGuard {
    let script = format!(
        "mount -t tmpfs tmpfs /etc && mkdir -p /etc/systemd && \
         printf '{HOSTNAME_ORIG}' > /etc/hostname && printf '{RESOLV_ORIG}' > /etc/resolv.conf && \
         printf '[Time]\\n' > /etc/systemd/timesyncd.conf && hostname uts-before && \
         exec {BIN} node --socket {sock} --state-dir {state} --config {config}",
        sock = dir.join("run/node.sock").display(),
        state = dir.join("state").display(),
        config = config.display(),
    )
    .replace("\n'", "\\n'");
    let child = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns.name(),
            "unshare",
            "--uts",
            "--mount",
            "sh",
            "-c",
        ])
        .arg(script)
        .env_remove("WIRESPAN_SOCKET")
        .spawn()
        .unwrap();
    let guard = ChildGuard(child);
    wait_for_path(&dir.join("run/node.sock"));
    guard
}

/// Polls `get TYPE -o json` (one JSON object per resource) until `check` accepts its
/// output, for at most 15 s.
fn until_get(socket: &Path, ty: &str, check: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let o = cli(socket, &["get", ty, "-o", "json"]);
        let out = String::from_utf8_lossy(&o.stdout).into_owned();
        if o.status.success() && check(&out) {
            return out;
        }
        assert!(std::time::Instant::now() < deadline, "get {ty}: {out}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn host_documents_apply_show_in_get_and_their_removal_restores_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: node-x.example.test\nwriteEtcHostname: true\n---\n\
         apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [10.0.0.2]\nsearchDomains: [example.test]\n---\n\
         apiVersion: v1alpha1\nkind: TimeServerConfig\nservers: [ntp1.example.test]\n",
    )
    .unwrap();
    let ns = NetnsGuard::new("wshost").unwrap();
    let node = start(&ns, dir.path(), &config);
    let socket = dir.path().join("run/node.sock");
    let etc = Path::new("/proc")
        .join(node.0.id().to_string())
        .join("root/etc");

    until_get(&socket, "hostnamespecs", |o| {
        o.contains("\"hostname\": \"node-x\"")
    });
    until_get(&socket, "resolverspecs", |o| o.contains("10.0.0.2"));
    until_get(&socket, "timeserverspecs", |o| {
        o.contains("ntp1.example.test")
    });
    // Read back from the node's UTS namespace and its /etc.
    until_get(&socket, "hostname", |o| {
        o.contains("\"domainname\": \"example.test\"")
    });
    until_get(&socket, "resolvers", |o| o.contains("10.0.0.2"));
    until_get(&socket, "timeservers", |o| o.contains("ntp1.example.test"));
    assert!(std::fs::read_to_string(etc.join("hostname"))
        .unwrap()
        .ends_with("\nnode-x\n"));

    // The documents go: the files come back byte for byte, and the UTS name.
    std::fs::write(
        &config,
        "apiVersion: v1alpha1\nkind: KubeSpanConfig\nenabled: false\n",
    )
    .unwrap();
    until_get(&socket, "resolverspecs", |o| o.trim().is_empty());
    until("files restored", || {
        std::fs::read_to_string(etc.join("resolv.conf"))
            .ok()
            .as_deref()
            == Some(RESOLV_ORIG)
            && std::fs::read_to_string(etc.join("hostname"))
                .ok()
                .as_deref()
                == Some(HOSTNAME_ORIG)
            && !etc.join("systemd/timesyncd.conf.d/wirespan.conf").exists()
    });
    until_get(&socket, "hostname", |o| {
        o.contains("\"hostname\": \"uts-before\"")
    });
}
