//! The remote API (`wirespan node --api-listen`) against what an attacker would try,
//! through the real binary in a throwaway network namespace: no client certificate,
//! a certificate from another CA, an expired one, a reader calling apply, a proxy
//! request for a node outside the cluster, a proxy loop, an oversized request, and
//! 1,000 connections that never finish the handshake. No private key is ever printed
//! or logged.

mod common;

use std::{
    path::{Path, PathBuf},
    process::{Output, Stdio},
    time::{Duration, Instant, SystemTime},
};

use common::{bin_in, ChildGuard, BIN};
use wirespan_control::{
    api::{
        client::{connect_remote, for_node, Credentials},
        gate::HOPS_HEADER,
        pki::{self, Role},
        proto,
    },
    config::cluster::ClusterConfig,
    secret::SecretString,
};
use wirespan_dataplane::netns::NetnsGuard;

const ENDPOINT: &str = "127.0.0.1:50100";

/// A node with the remote API in its own namespace, and the client configs made for it.
struct Fixture {
    ns: NetnsGuard,
    dir: tempfile::TempDir,
    node: ChildGuard,
    /// Every CLI output of the test, checked for keys at the end.
    outputs: Vec<String>,
}

fn gen(args: &[&str]) {
    let o = std::process::Command::new(BIN).args(args).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

impl Fixture {
    fn start() -> Self {
        let ns = NetnsGuard::new("wsapi").unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = |f: &str| dir.path().join(f).to_str().unwrap().to_owned();
        gen(&["gen", "cluster", "--out", &p("cluster.yaml")]);
        gen(&["gen", "cluster", "--out", &p("other.yaml")]);
        for (cluster, role, out) in [
            ("cluster.yaml", "admin", "admin.yaml"),
            ("cluster.yaml", "reader", "reader.yaml"),
            ("other.yaml", "admin", "other-admin.yaml"),
        ] {
            gen(&[
                "gen",
                "client",
                "--cluster",
                &p(cluster),
                "--role",
                role,
                "--out",
                &p(out),
                "--endpoint",
                ENDPOINT,
            ]);
        }
        let log = std::fs::File::create(dir.path().join("node.log")).unwrap();
        let child = bin_in(&ns)
            .arg("--socket")
            .arg(dir.path().join("node.sock"))
            .args([
                "node",
                "--state-dir",
                &p("state"),
                "--config",
                &p("cluster.yaml"),
            ])
            .args(["--api-listen", ENDPOINT])
            .env_remove("WIRESPAN_SOCKET")
            .env("WIRESPAN_LOG", "info,wirespan_control::api=debug")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut f = Self {
            ns,
            dir,
            node: ChildGuard(child),
            outputs: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f
            .cli("admin.yaml", &["get", "nodeidentity"])
            .status
            .success()
        {
            assert!(
                Instant::now() < deadline,
                "remote API never answered: {}",
                f.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        f
    }

    fn path(&self, f: &str) -> PathBuf {
        self.dir.path().join(f)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("node.log")).unwrap_or_default()
    }

    /// The CLI inside the namespace with the client config `config`.
    fn cli(&mut self, config: &str, args: &[&str]) -> Output {
        let o = bin_in(&self.ns)
            .env_remove("WIRESPAN_SOCKET")
            .env("WIRESPANCONFIG", self.path(config))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        self.outputs
            .push(String::from_utf8_lossy(&o.stdout).into_owned());
        self.outputs
            .push(String::from_utf8_lossy(&o.stderr).into_owned());
        o
    }

    /// A client config with the real CA but `crt`/`key` of another certificate.
    fn forged(&self, name: &str, cert_pem: &str, key_pem: &SecretString) -> String {
        let admin = std::fs::read_to_string(self.path("admin.yaml")).unwrap();
        let mut v: serde_yaml_ng::Value = serde_yaml_ng::from_str(&admin).unwrap();
        let ctx = &mut v["contexts"]["admin"];
        ctx["crt"] = cert_pem.into();
        ctx["key"] = key_pem.expose().into();
        std::fs::write(self.path(name), serde_yaml_ng::to_string(&v).unwrap()).unwrap();
        name.to_owned()
    }

    fn context(&self, config: &str) -> (String, String, SecretString) {
        let v: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(&std::fs::read_to_string(self.path(config)).unwrap()).unwrap();
        let ctx = &v["contexts"][v["context"].as_str().unwrap()];
        let s = |k: &str| ctx[k].as_str().unwrap().to_owned();
        (s("ca"), s("crt"), SecretString::new(s("key")))
    }
}

fn cluster_ca(path: &Path) -> (String, SecretString) {
    let docs = wirespan_control::config::parse(&std::fs::read_to_string(path).unwrap()).unwrap();
    let cc = docs.singleton::<ClusterConfig>().unwrap();
    (
        cc.api_ca_cert.clone().unwrap(),
        cc.api_ca_key.clone().unwrap(),
    )
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

#[test]
fn the_remote_api_refuses_strangers_readers_loops_and_floods_and_prints_no_key() {
    let mut f = Fixture::start();
    let (ca_cert, ca_key) = cluster_ca(&f.path("cluster.yaml"));

    // A certificate from another CA (the client trusts the real server).
    let (_, other_crt, other_key) = f.context("other-admin.yaml");
    let other = f.forged("forged-other.yaml", &other_crt, &other_key);
    let o = f.cli(&other, &["get", "nodeidentity"]);
    assert!(!o.status.success(), "another CA's certificate was accepted");
    // An expired certificate from the right CA.
    let year_ago = SystemTime::now() - Duration::from_secs(400 * 24 * 3600);
    let old = pki::issue(
        &ca_key,
        Role::Admin,
        "old",
        &[],
        year_ago,
        Duration::from_secs(86_400),
    )
    .unwrap();
    let expired = f.forged("forged-expired.yaml", &old.cert_pem, &old.key_pem);
    let o = f.cli(&expired, &["get", "nodeidentity"]);
    assert!(!o.status.success(), "an expired certificate was accepted");

    // A reader may read, not apply: PermissionDenied, and the config stays.
    let before = std::fs::read(f.path("cluster.yaml")).unwrap();
    assert!(f
        .cli("reader.yaml", &["get", "nodeidentity"])
        .status
        .success());
    let cluster = f.path("cluster.yaml").to_str().unwrap().to_owned();
    let o = f.cli("reader.yaml", &["apply", &cluster]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("PermissionDenied"), "{}", stderr(&o));
    assert_eq!(std::fs::read(f.path("cluster.yaml")).unwrap(), before);
    // Nor confirm a trial, nor read the config in force (it holds the secrets): a
    // reader's `patch` stops at reading it.
    for args in [
        &["apply", "--confirm"][..],
        &["patch", "--patch", "kind: KubeSpanConfig"],
    ] {
        let o = f.cli("reader.yaml", args);
        assert!(!o.status.success(), "{args:?}");
        assert!(
            stderr(&o).contains("role reader may not call"),
            "{args:?}: {}",
            stderr(&o)
        );
    }

    // A proxy target outside the cluster; one bad node does not hide the others.
    let o = f.cli(
        "admin.yaml",
        &["-n", "node9,127.0.0.1", "get", "nodeidentity"],
    );
    assert!(!o.status.success(), "a failed node must fail the command");
    assert!(
        stderr(&o).contains("node9: node \"node9\" is not a member"),
        "{}",
        stderr(&o)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("NODE") && out.contains("\n127.0.0.1 "),
        "{out}"
    );

    // In-process clients in the namespace: no certificate, a loop, an oversized request,
    // and a flood of connections that never finish the handshake.
    let admin = f.context("admin.yaml");
    let pid = f.node.0.id();
    let report =
        f.ns.netns()
            .block_on(move || attacks(admin, ca_cert, pid))
            .unwrap();
    assert!(
        report.no_cert_refused,
        "a client without a certificate got an answer"
    );
    assert_eq!(
        report.loop_code,
        Some(tonic::Code::FailedPrecondition),
        "proxy loop"
    );
    assert!(
        matches!(
            report.oversized_code,
            Some(tonic::Code::OutOfRange | tonic::Code::ResourceExhausted)
        ),
        "oversized request: {:?}",
        report.oversized_code
    );
    assert!(
        report.flood_opened >= 1000,
        "opened {}",
        report.flood_opened
    );
    assert!(
        report.call_during_flood < Duration::from_secs(3),
        "an authenticated call took {:?} during the flood",
        report.call_during_flood
    );
    assert!(
        report.node_fds_during_flood < 400,
        "the node held {} descriptors with 1,000 unfinished handshakes (cap: 256 pending)",
        report.node_fds_during_flood
    );
    // The unix socket kept answering too.
    let o = common::cli(&f.path("node.sock"), &["get", "nodeidentity"]);
    assert!(o.status.success(), "{}", stderr(&o));

    let log = f.log();
    for needle in [
        "peer sent no certificates",
        "invalid peer certificate: UnknownIssuer",
        "invalid peer certificate: certificate expired",
        "API request refused",
        "is not a member of this cluster",
        "proxy loop",
    ] {
        assert!(
            log.contains(needle),
            "no {needle:?} in the node log:\n{log}"
        );
    }
    // No private key anywhere: not in the log, not in any output.
    let key_line = ca_key.expose().lines().nth(1).unwrap().to_owned();
    for text in f.outputs.iter().chain(std::iter::once(&log)) {
        assert!(
            !text.contains("PRIVATE KEY") && !text.contains(&key_line),
            "a key leaked: {text}"
        );
    }
}

#[derive(Debug)]
struct Report {
    no_cert_refused: bool,
    loop_code: Option<tonic::Code>,
    oversized_code: Option<tonic::Code>,
    flood_opened: usize,
    call_during_flood: Duration,
    node_fds_during_flood: usize,
}

fn list_nodeidentity() -> proto::ListRequest {
    proto::ListRequest {
        r#type: "nodeidentity".into(),
        ..Default::default()
    }
}

async fn attacks(admin: (String, String, SecretString), ca_cert: String, pid: u32) -> Report {
    let creds = Credentials {
        ca_pem: admin.0,
        cert_pem: admin.1,
        key_pem: admin.2,
    };
    // No client certificate: TLS 1.3 refuses it at the server's end of the handshake,
    // so the first request fails.
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&ca_cert))
        .domain_name("127.0.0.1");
    let no_cert_refused =
        match tonic::transport::Endpoint::from_shared(format!("https://{ENDPOINT}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect()
            .await
        {
            Err(_) => true,
            Ok(ch) => for_node(ch, None)
                .unwrap()
                .list(list_nodeidentity())
                .await
                .is_err(),
        };

    let channel = connect_remote(ENDPOINT, &creds).await.unwrap();
    // A request that says it was forwarded once already, for another node: a loop.
    let mut req = tonic::Request::new(list_nodeidentity());
    req.metadata_mut().insert(HOPS_HEADER, "1".parse().unwrap());
    let loop_code = for_node(channel.clone(), Some("node2"))
        .unwrap()
        .list(req)
        .await
        .err()
        .map(|s| s.code());
    // Over the message limit (a client without its own limit, so the node decides).
    let oversized_code =
        proto::resource_service_client::ResourceServiceClient::new(channel.clone())
            .apply_config(proto::ApplyConfigRequest {
                config: "#".repeat(wirespan_control::api::MAX_MESSAGE_BYTES + 1024),
                dry_run: true,
                ..Default::default()
            })
            .await
            .err()
            .map(|s| s.code());

    // 1,000 connections that send nothing, held open while a real client calls.
    let mut flood = Vec::new();
    for _ in 0..1000 {
        if let Ok(s) = tokio::net::TcpStream::connect(ENDPOINT).await {
            flood.push(s);
        }
    }
    let started = Instant::now();
    // A new connection (not the warm channel): it must get through the flood.
    let fresh = connect_remote(ENDPOINT, &creds).await.unwrap();
    for_node(fresh, None)
        .unwrap()
        .list(list_nodeidentity())
        .await
        .unwrap();
    let call_during_flood = started.elapsed();
    let node_fds_during_flood = open_fds(pid);
    Report {
        no_cert_refused,
        loop_code,
        oversized_code,
        flood_opened: flood.len(),
        call_during_flood,
        node_fds_during_flood,
    }
}

#[test]
fn watch_merges_the_nodes_streams_and_status_fans_out() {
    let mut f = Fixture::start();
    // Two names of the one node: two streams, one printout, each row with its node.
    let mut child = bin_in(&f.ns)
        .env_remove("WIRESPAN_SOCKET")
        .env("WIRESPANCONFIG", f.path("admin.yaml"))
        .args(["-n", "127.0.0.1,localhost", "watch", "nodeidentity"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = child.stdout.take().unwrap();
    let _watch = ChildGuard(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let header = common::expect_line(&rx, "the header", |l| l.starts_with("NODE"));
    assert!(header.contains("NAMESPACE"), "{header}");
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 2 {
        let l = common::expect_line(&rx, "a row of each node", |l| l.contains("NodeIdentity"));
        seen.insert(l.split_whitespace().next().unwrap().to_owned());
    }
    assert_eq!(
        seen.into_iter().collect::<Vec<_>>(),
        ["127.0.0.1", "localhost"]
    );

    let o = f.cli("admin.yaml", &["-n", "127.0.0.1,localhost", "status"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(out.matches("NODE  ").count(), 2, "{out}");
}
