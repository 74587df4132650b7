//! Host name, resolvers and time servers through the real controllers (config →
//! merge → host spec controller → files and UTS name → status), each test in a new
//! UTS namespace of its own thread and against a temp root: the machine's own host
//! name and `/etc` are never touched.

use std::{
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use wirespan_control::{
    config,
    controllers::network::{
        config::NetworkConfigController,
        host::{self, files::RealFiles, HostDeps, HostPaths, HostSystem, RealSystem, Service},
    },
    resources::{
        config::{MachineConfig, MachineConfigSpec, ACTIVE},
        network::{
            HostnameSpec, HostnameStatus, ResolverSpec, ResolverStatus, TimeServerSpec,
            TimeServerStatus, HOSTNAME, NS, RESOLVERS, TIME_SERVERS,
        },
    },
    runtime::{Pointer, ResourceKind, Runtime, Store, StoreOptions},
    testing::{assert_no_resource, assert_resource, Harness},
};

/// The real host name edge of the test thread's UTS namespace; service reloads are
/// recorded instead of run.
#[derive(Default)]
struct RecordingSystem {
    reloads: Mutex<Vec<Service>>,
}

impl HostSystem for RecordingSystem {
    fn names(&self) -> io::Result<(String, String)> {
        RealSystem.names()
    }
    fn set_hostname(&self, name: &str) -> io::Result<()> {
        RealSystem.set_hostname(name)
    }
    fn set_domainname(&self, name: &str) -> io::Result<()> {
        RealSystem.set_domainname(name)
    }
    fn reload(&self, service: Service) -> io::Result<()> {
        self.reloads.lock().unwrap().push(service);
        Ok(())
    }
}

/// Runs `f` on a thread of its own in a new UTS namespace, on a single-threaded
/// runtime (so every controller round runs in that namespace). The namespace goes
/// with the thread.
fn in_new_uts<F>(f: impl FnOnce() -> F + Send + 'static)
where
    F: std::future::Future<Output = ()>,
{
    std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWUTS).expect("unshare UTS");
        RealSystem.set_hostname("before-test").unwrap();
        RealSystem.set_domainname("").unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f());
    })
    .join()
    .unwrap_or_else(|p| std::panic::resume_unwind(p));
}

fn set_config(store: &Store, text: &str) {
    let cfg = config::parse(text).unwrap();
    store
        .modify::<MachineConfig>("config", ACTIVE, "", |r| {
            r.spec = MachineConfigSpec {
                source: "test".into(),
                document_count: cfg.documents.len(),
                config: cfg.clone(),
            };
        })
        .unwrap();
}

fn write(root: &Path, path: &str, content: &[u8]) -> PathBuf {
    let p = root.join(path);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, content).unwrap();
    p
}

fn start(root: &Path) -> (Store, Harness, Arc<RecordingSystem>) {
    let system = Arc::new(RecordingSystem::default());
    let deps = HostDeps {
        paths: HostPaths::under(root),
        files: Arc::new(RealFiles),
        system: system.clone(),
    };
    let store = Store::new(StoreOptions::default());
    let mut rt = Runtime::new(store.clone());
    rt.register(NetworkConfigController).unwrap();
    host::register(&mut rt, &deps).unwrap();
    (store, Harness::start(rt), system)
}

const DOCS: &str = "apiVersion: v1alpha1\nkind: HostnameConfig\nhostname: node-a.example.test\nwriteEtcHostname: true\n---\n\
apiVersion: v1alpha1\nkind: ResolverConfig\nnameservers: [10.0.0.2, 'fd00::53']\nsearchDomains: [example.test]\n---\n\
apiVersion: v1alpha1\nkind: TimeServerConfig\nservers: [ntp1.example.test, 10.0.0.123]\n";

/// Polls `cond` every 50 ms until it holds, at most ten seconds (two refreshes).
async fn poll_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Something the status must eventually say.
fn check(ok: bool, what: impl Into<String>) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what.into())
    }
}

#[test]
fn documents_apply_read_back_and_removal_restores_the_originals() {
    in_new_uts(|| async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        let hostname_orig = b"machine-name\n# kept as is \xff\n";
        let resolv_orig = b"# from the DHCP client\nnameserver 192.0.2.1\nsearch lan\n";
        let timesyncd_main = b"[Time]\n#NTP=\nNTP=pool.example\n";
        let etc_hostname = write(root, "etc/hostname", hostname_orig);
        let resolv = write(root, "etc/resolv.conf", resolv_orig);
        write(root, "etc/systemd/timesyncd.conf", timesyncd_main);
        let (store, h, system) = start(root);

        // No document: observe only, nothing written.
        assert_resource::<ResolverStatus>(&store, NS, RESOLVERS, |r| {
            check(
                r.spec.dns_servers == ["192.0.2.1".parse::<std::net::IpAddr>().unwrap()],
                format!("{:?}", r.spec),
            )
        })
        .await;
        assert_resource::<TimeServerStatus>(&store, NS, TIME_SERVERS, |r| {
            check(
                r.spec.ntp_servers == ["pool.example"],
                format!("{:?}", r.spec),
            )
        })
        .await;

        set_config(&store, DOCS);
        // The specs list what the documents asked for.
        assert_resource::<HostnameSpec>(&store, NS, HOSTNAME, |r| {
            check(
                r.spec.hostname == "node-a" && r.spec.domainname == "example.test",
                format!("{:?}", r.spec),
            )
        })
        .await;
        assert_resource::<ResolverSpec>(&store, NS, RESOLVERS, |r| {
            check(r.spec.dns_servers.len() == 2, format!("{:?}", r.spec))
        })
        .await;
        assert_resource::<TimeServerSpec>(&store, NS, TIME_SERVERS, |r| {
            check(
                r.spec.ntp_servers == ["ntp1.example.test", "10.0.0.123"],
                format!("{:?}", r.spec),
            )
        })
        .await;
        // The statuses read it back from the UTS namespace and the files.
        assert_resource::<HostnameStatus>(&store, NS, HOSTNAME, |r| {
            check(
                r.spec.fqdn() == "node-a.example.test",
                format!("{:?}", r.spec),
            )
        })
        .await;
        assert_resource::<ResolverStatus>(&store, NS, RESOLVERS, |r| {
            check(
                r.spec.dns_servers.len() == 2 && r.spec.search_domains == ["example.test"],
                format!("{:?}", r.spec),
            )
        })
        .await;
        assert_resource::<TimeServerStatus>(&store, NS, TIME_SERVERS, |r| {
            check(
                r.spec.ntp_servers == ["ntp1.example.test", "10.0.0.123"]
                    && r.spec.service == "systemd-timesyncd",
                format!("{:?}", r.spec),
            )
        })
        .await;
        assert_eq!(
            RealSystem.names().unwrap(),
            ("node-a".into(), "example.test".into())
        );
        assert!(std::fs::read_to_string(&etc_hostname)
            .unwrap()
            .ends_with("\nnode-a\n"));
        assert_eq!(
            std::fs::read(root.join("etc/hostname.wirespan-orig")).unwrap(),
            hostname_orig
        );
        assert_eq!(
            std::fs::read(root.join("etc/resolv.conf.wirespan-orig")).unwrap(),
            resolv_orig
        );
        assert_eq!(*system.reloads.lock().unwrap(), [Service::Timesyncd]);

        // The documents go: everything is back, byte for byte.
        set_config(&store, "");
        for ptr in [
            Pointer::new(NS, HostnameSpec::TYPE, HOSTNAME),
            Pointer::new(NS, ResolverSpec::TYPE, RESOLVERS),
            Pointer::new(NS, TimeServerSpec::TYPE, TIME_SERVERS),
        ] {
            assert_no_resource(&store, &ptr).await;
        }
        assert_eq!(std::fs::read(&etc_hostname).unwrap(), hostname_orig);
        assert_eq!(std::fs::read(&resolv).unwrap(), resolv_orig);
        assert!(!root
            .join("etc/systemd/timesyncd.conf.d/wirespan.conf")
            .exists());
        assert!(!root.join("etc/hostname.wirespan-orig").exists());
        assert!(!root.join("etc/resolv.conf.wirespan-orig").exists());
        assert_eq!(
            RealSystem.names().unwrap(),
            ("before-test".into(), String::new())
        );
        assert_eq!(
            *system.reloads.lock().unwrap(),
            [Service::Timesyncd, Service::Timesyncd]
        );
        h.stop().await.unwrap();
    });
}

#[test]
fn resolved_and_chrony_get_drop_ins_and_a_replaced_file_is_not_clobbered() {
    in_new_uts(|| async {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        // systemd-resolved runs (its socket, its upstream list); chrony is installed.
        write(root, "run/systemd/resolve/io.systemd.Resolve", b"");
        write(
            root,
            "run/systemd/resolve/resolv.conf",
            b"nameserver 192.0.2.53\n",
        );
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::os::unix::fs::symlink(
            "../run/systemd/resolve/stub-resolv.conf",
            root.join("etc/resolv.conf"),
        )
        .unwrap();
        write(
            root,
            "etc/chrony/chrony.conf",
            b"pool 2.debian.pool.ntp.org iburst\nsourcedir /etc/chrony/sources.d\n",
        );
        let chrony_orig = b"server old.example iburst\n";
        write(root, "etc/chrony/sources.d/wirespan.sources", chrony_orig);
        let (store, h, system) = start(root);
        set_config(&store, DOCS);

        assert_resource::<TimeServerStatus>(&store, NS, TIME_SERVERS, |r| {
            check(
                r.spec.service == "chrony"
                    && r.spec.ntp_servers
                        == ["2.debian.pool.ntp.org", "ntp1.example.test", "10.0.0.123"],
                format!("{:?}", r.spec),
            )
        })
        .await;
        let dropin = root.join("etc/systemd/resolved.conf.d/wirespan.conf");
        poll_until("the resolved drop-in", || dropin.exists()).await;
        assert!(std::fs::read_to_string(&dropin)
            .unwrap()
            .contains("DNS=10.0.0.2 fd00::53\n"));
        // resolv.conf stays resolved's symlink.
        assert!(std::fs::symlink_metadata(root.join("etc/resolv.conf"))
            .unwrap()
            .is_symlink());
        {
            let reloads = system.reloads.lock().unwrap();
            assert!(
                reloads.contains(&Service::Resolved) && reloads.contains(&Service::Chrony),
                "{reloads:?}"
            );
        }

        // Someone replaces the drop-in wirespan created: theirs is kept as the
        // original (and comes back on removal), ours goes in again.
        let theirs = b"[Resolve]\nDNS=192.0.2.99\n";
        std::fs::write(&dropin, theirs).unwrap();
        let kept = root.join("etc/systemd/resolved.conf.d/wirespan.conf.wirespan-orig");
        // Files have no events: poll until the next refresh has run.
        poll_until("their drop-in kept as the original", || kept.exists()).await;
        assert_eq!(std::fs::read(&kept).unwrap(), theirs);

        // The chrony file had an original (kept at the first write); replaced again
        // now, it is not overwritten, and the spec says why.
        let sources = root.join("etc/chrony/sources.d/wirespan.sources");
        let again = b"server replaced.example iburst\n";
        std::fs::write(&sources, again).unwrap();
        assert_resource::<TimeServerSpec>(&store, NS, TIME_SERVERS, |r| {
            let e = r
                .metadata
                .annotations
                .get("error")
                .cloned()
                .unwrap_or_default();
            check(
                e.contains("replaced by someone else"),
                format!("annotation {e:?}"),
            )
        })
        .await;
        assert_eq!(std::fs::read(&sources).unwrap(), again);

        set_config(&store, "");
        for ptr in [
            Pointer::new(NS, ResolverSpec::TYPE, RESOLVERS),
            Pointer::new(NS, TimeServerSpec::TYPE, TIME_SERVERS),
        ] {
            assert_no_resource(&store, &ptr).await;
        }
        assert_eq!(
            std::fs::read(&dropin).unwrap(),
            theirs,
            "their drop-in is back"
        );
        assert!(!kept.exists());
        // Someone else's file now: left as it is, with the original still kept.
        assert_eq!(std::fs::read(&sources).unwrap(), again);
        assert_eq!(
            std::fs::read(root.join("etc/chrony/sources.d/wirespan.sources.wirespan-orig"))
                .unwrap(),
            chrony_orig
        );
        h.stop().await.unwrap();
    });
}
