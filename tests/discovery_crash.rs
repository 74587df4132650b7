//! The real `wirespan discovery` binary under crashes and over TLS (issue 16 items 4
//! and 11): killed with SIGKILL while it saves snapshots, over and over, every restart
//! restores the last complete snapshot (or nothing), never a torn one; `--tls-cert`/
//! `--tls-key` serve trusting TLS clients and refuse plaintext ones.

mod common;

use std::{
    collections::BTreeSet,
    net::{SocketAddr, TcpStream},
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
    time::{Duration, Instant, SystemTime},
};

use common::{discovery::free_port, ChildGuard, BIN};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use wirespan_discovery::{
    proto::server::{
        cluster_client::ClusterClient, AffiliateUpdateRequest, HelloRequest, ListRequest,
    },
    server::{snapshot, state::MAX_DATA_LEN},
};

const CLUSTER: &str = "crash-test";
/// Upper bound of affiliates ever published: the publisher's loop is bounded. At
/// ≈ 2.4 kB each the snapshot reaches ≈ 7 MB, so a save takes long enough for kills
/// to land inside it.
const MAX_PUBLISHED: usize = 3000;
const ITERATIONS: usize = 24;
const ENDPOINTS: usize = 8;

fn affiliate_id(i: usize) -> String {
    format!("aff-{i:06}")
}

/// Deterministic content of affiliate `i`, so a restored one can be checked byte for byte.
fn affiliate_data(i: usize) -> Vec<u8> {
    let mut d: Vec<u8> = (0..MAX_DATA_LEN)
        .map(|j| ((i * 131 + j * 7) % 251) as u8)
        .collect();
    d[..8].copy_from_slice(&(i as u64).to_le_bytes());
    d
}

fn affiliate_endpoints(i: usize) -> BTreeSet<Vec<u8>> {
    (0..ENDPOINTS)
        .map(|k| {
            let mut e = vec![k as u8; 32];
            e[..8].copy_from_slice(&(i as u64).to_le_bytes());
            e
        })
        .collect()
}

fn update(i: usize) -> AffiliateUpdateRequest {
    AffiliateUpdateRequest {
        cluster_id: CLUSTER.into(),
        affiliate_id: affiliate_id(i),
        affiliate_data: Some(affiliate_data(i)),
        affiliate_endpoints: affiliate_endpoints(i).into_iter().collect(),
        // The protocol's longest TTL: nothing expires during the test.
        ttl: Some(prost_types::Duration {
            seconds: 30 * 60,
            nanos: 0,
        }),
    }
}

/// Tiny seeded generator (xorshift64*): the kill points replay from the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

struct Server {
    child: ChildGuard,
    grpc: SocketAddr,
    log: PathBuf,
}

impl Server {
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// Starts `wirespan discovery` with `extra` arguments; returns once it accepts TCP.
fn start(log: PathBuf, extra: &[&std::ffi::OsStr]) -> Server {
    let grpc = free_port();
    let child = Command::new(BIN)
        .args([
            "discovery",
            "--listen",
            &grpc.to_string(),
            "--no-rate-limit",
        ])
        .args(extra)
        .env_remove("NOTIFY_SOCKET")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut server = Server {
        child: ChildGuard(child),
        grpc,
        log,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(grpc).is_err() {
        if let Some(status) = server.child.0.try_wait().unwrap() {
            panic!("discovery exited ({status}):\n{}", server.log_text());
        }
        assert!(
            Instant::now() < deadline,
            "discovery not listening on {grpc}:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    server
}

async fn plain_client(addr: SocketAddr) -> ClusterClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(30))
        .connect()
        .await
        .unwrap();
    // A List of the whole cluster is ≈ 7 MB, above tonic's 4 MiB default.
    ClusterClient::new(channel).max_decoding_message_size(64 << 20)
}

/// Publishes affiliates `from..MAX_PUBLISHED` in order, one at a time, until the
/// server dies. `sent` is the highest index + 1 ever sent (applied or not).
async fn publish(addr: SocketAddr, from: usize, sent: Arc<AtomicUsize>) {
    let Ok(channel) = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
    else {
        return;
    };
    let mut c = ClusterClient::new(channel);
    for i in from..MAX_PUBLISHED {
        sent.fetch_max(i + 1, Ordering::SeqCst);
        if c.affiliate_update(update(i)).await.is_err() {
            return;
        }
    }
}

/// What the restarted server serves: must be exactly affiliates `0..k` with their
/// published content (a prefix of the publishing order: one cluster is saved under
/// one lock). Returns `k`.
async fn restored_prefix(addr: SocketAddr) -> usize {
    let list = plain_client(addr)
        .await
        .list(ListRequest {
            cluster_id: CLUSTER.into(),
        })
        .await
        .unwrap()
        .into_inner();
    let mut affiliates = list.affiliates;
    affiliates.sort_by(|a, b| a.id.cmp(&b.id));
    for (i, a) in affiliates.iter().enumerate() {
        assert_eq!(
            a.id,
            affiliate_id(i),
            "restored affiliates are not a prefix"
        );
        assert!(a.data == affiliate_data(i), "{}: data differs", a.id);
        let endpoints: BTreeSet<Vec<u8>> = a.endpoints.iter().cloned().collect();
        assert_eq!(
            endpoints,
            affiliate_endpoints(i),
            "{}: endpoints differ",
            a.id
        );
    }
    affiliates.len()
}

/// Snapshot file's (inode, length, mtime), to notice a new save.
fn stamp(path: &Path) -> Option<(u64, u64, SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.len(), m.modified().ok()?))
}

/// Whether `name` is a temp file of a save of `state.binpb` (`.state.binpb.<16 hex>.tmp`).
fn is_temp(name: &str) -> bool {
    name.strip_prefix(".state.binpb.")
        .and_then(|n| n.strip_suffix(".tmp"))
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The save's temp file in `dir`, if one exists now (its name is random).
fn temp_file(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(Result::ok)
        .find(|e| is_temp(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
}

/// [`stamp`] of the save's temp file, if one exists now.
fn temp_stamp(dir: &Path) -> Option<(u64, u64, SystemTime)> {
    stamp(&temp_file(dir)?)
}

/// Polls `changed` every 200 µs for at most 20 s.
fn wait_until(what: &str, server: &Server, mut changed: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !changed() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}:\n{}",
            server.log_text()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

#[test]
fn sigkill_during_snapshot_saves_never_restores_a_torn_snapshot() {
    let state_dir = tempfile::tempdir().unwrap();
    let logs = tempfile::tempdir().unwrap();
    let snap = state_dir.path().join("state.binpb");
    let dir = state_dir.path();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sent = Arc::new(AtomicUsize::new(0));
    let mut rng = Rng(0x5eed_0016_0004_0001);
    let (mut previous, mut kills_mid_save, mut kills_after_rename) = (0usize, 0usize, 0usize);

    for iteration in 0..ITERATIONS {
        let log = logs.path().join(format!("discovery-{iteration}.log"));
        let server = start(
            log,
            &[
                "--snapshot-path".as_ref(),
                snap.as_os_str(),
                // Saves back to back: most of the server's life is spent inside one.
                "--snapshot-interval".as_ref(),
                "20ms".as_ref(),
                "--max-affiliates".as_ref(),
                "100000".as_ref(),
            ],
        );

        // What is on disk now is what the server must have restored.
        let on_disk = match std::fs::File::open(&snap) {
            Ok(f) => {
                snapshot::read_with(
                    std::io::BufReader::new(f),
                    Instant::now(),
                    SystemTime::now(),
                    snapshot::LoadLimits {
                        max_affiliates: 100_000,
                        ..snapshot::LoadLimits::default()
                    },
                )
                .unwrap_or_else(|e| panic!("iteration {iteration}: torn snapshot on disk: {e}"))
                .counts()
                .affiliates
            }
            Err(_) => 0,
        };
        let restored = rt.block_on(restored_prefix(server.grpc));
        let log_text = server.log_text();
        assert!(
            !log_text.contains("unreadable") && !log_text.contains("corrupt"),
            "iteration {iteration}: the server found a bad snapshot:\n{log_text}"
        );
        assert_eq!(restored, on_disk, "iteration {iteration}: restored ≠ file");
        assert!(
            restored >= previous,
            "iteration {iteration}: restored {restored} < {previous} restored before: a complete snapshot was lost"
        );
        let published = sent.load(Ordering::SeqCst);
        assert!(
            restored <= published,
            "iteration {iteration}: restored {restored} > {published} ever sent"
        );
        previous = restored;

        // Re-publish what was lost with the previous instance, then keep going.
        let publisher = rt.spawn(publish(server.grpc, restored, Arc::clone(&sent)));
        // Let the state grow before arming the kill, so later saves are megabytes.
        let target = (restored + 120).min(MAX_PUBLISHED);
        wait_until("the publisher to progress", &server, || {
            sent.load(Ordering::SeqCst) >= target || publisher.is_finished()
        });
        let (snap_before, tmp_before) = (stamp(&snap), temp_stamp(dir));
        match iteration % 3 {
            // Inside a save: the temp file was (re)created since the start.
            0 => wait_until("a save to start", &server, || {
                let now = temp_stamp(dir);
                now.is_some() && now != tmp_before
            }),
            // As soon as the snapshot file changes (right after a rename, when saves
            // are atomic).
            1 => wait_until("the snapshot to change", &server, || {
                stamp(&snap) != snap_before
            }),
            // Anywhere, at a seeded delay.
            _ => std::thread::sleep(Duration::from_millis(rng.below(300))),
        }
        let mut server = server;
        server.child.0.kill().unwrap();
        server.child.0.wait().unwrap();
        rt.block_on(publisher).unwrap();
        match iteration % 3 {
            0 if temp_file(dir).is_some() => kills_mid_save += 1,
            1 => kills_after_rename += 1,
            _ => {}
        }

        // Nothing accumulates: the snapshot and at most the one temp file (the next
        // save removes it).
        let names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.iter().all(|n| n == "state.binpb" || is_temp(n))
                && names.iter().filter(|n| is_temp(n)).count() <= 1,
            "iteration {iteration}: unexpected files {names:?}"
        );
    }

    // The test did what it claims: kills landed inside saves and the state grew.
    assert!(
        kills_mid_save > 0,
        "no kill landed while a temp file existed"
    );
    assert!(kills_after_rename > 0);
    assert!(previous > 0, "no snapshot was ever restored");
    eprintln!(
        "{ITERATIONS} kills ({kills_mid_save} inside a save), last restore {previous} of {} sent",
        sent.load(Ordering::SeqCst)
    );
}

/// `--tls-cert`/`--tls-key` through the real binary: a client trusting the
/// certificate is served, a plaintext (h2c) client is not.
#[test]
fn tls_serves_trusting_clients_and_refuses_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let out = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=localhost"])
        .args(["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"])
        // A leaf, not a CA: rustls refuses a CA certificate as the server's own.
        .args(["-addext", "basicConstraints=critical,CA:FALSE"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("openssl (scripts/setup.sh installs it)");
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let server = start(
        dir.path().join("discovery.log"),
        &[
            "--tls-cert".as_ref(),
            cert.as_os_str(),
            "--tls-key".as_ref(),
            key.as_os_str(),
        ],
    );
    let hello = HelloRequest {
        cluster_id: "tls".into(),
        client_version: "test".into(),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let pem = std::fs::read(&cert).unwrap();
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(pem))
            .domain_name("localhost");
        let channel = Endpoint::from_shared(format!("https://{}", server.grpc))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .timeout(Duration::from_secs(10))
            .connect()
            .await
            .unwrap_or_else(|e| panic!("TLS connect: {e:?}\n{}", server.log_text()));
        let reply = ClusterClient::new(channel)
            .hello(hello.clone())
            .await
            .unwrap_or_else(|e| panic!("Hello over TLS: {e:?}\n{}", server.log_text()))
            .into_inner();
        assert_eq!(reply.client_ip, [127, 0, 0, 1], "client address over TLS");

        // h2c to a TLS listener: either the connection or the call fails.
        let plain = Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .timeout(Duration::from_secs(10))
            .connect()
            .await;
        if let Ok(channel) = plain {
            let r = ClusterClient::new(channel).hello(hello).await;
            assert!(r.is_err(), "a plaintext client was served: {r:?}");
        }
    });
}
