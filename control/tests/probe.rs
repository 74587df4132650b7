//! Probes against local TCP/HTTP servers and a local proxy, through the real runtime.
//! Proxy settings are injected as values ([`probe::register_with_env`]), never through
//! the process environment, so these tests do not race under a plain `cargo test`
//! (one process, tests in parallel threads).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader},
    net::TcpListener,
};
use wirespan_control::{
    config,
    controllers::probe::{self, ProbeEnv},
    resources::{
        config::{MachineConfig, MachineConfigSpec, ACTIVE},
        network::{ProbeStatus, NS},
    },
    runtime::{Pointer, ResourceKind, Runtime, Store, StoreOptions},
    testing::{assert_no_resource, assert_resource, Harness},
};

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

type Hits = Arc<Mutex<HashMap<String, usize>>>;

/// A tiny HTTP server: `/status/<code>` answers `<code>` (3xx with a Location to
/// `/target`); every request line is counted by path.
async fn http_server() -> (u16, Hits) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let hits: Hits = Arc::default();
    let h = hits.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = l.accept().await.unwrap();
            let h = h.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(s);
                let mut line = String::new();
                r.read_line(&mut line).await.unwrap();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
                *h.lock().unwrap().entry(path.clone()).or_default() += 1;
                let code: u16 = path
                    .strip_prefix("/status/")
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(200);
                let resp = format!(
                    "HTTP/1.1 {code} X\r\nLocation: /target\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
                );
                let _ = r.get_mut().write_all(resp.as_bytes()).await;
            });
        }
    });
    (port, hits)
}

fn hits(h: &Hits, path: &str) -> usize {
    h.lock().unwrap().get(path).copied().unwrap_or(0)
}

/// Proxy settings a test changes while its probes run (read on every attempt).
type Env = Arc<Mutex<ProbeEnv>>;

fn start(store: &Store) -> Harness {
    start_with_env(store, &Env::default())
}

fn start_with_env(store: &Store, env: &Env) -> Harness {
    let mut rt = Runtime::new(store.clone());
    let env = Arc::clone(env);
    probe::register_with_env(&mut rt, Arc::new(move || env.lock().unwrap().clone())).unwrap();
    Harness::start(rt)
}

fn success(
    want: bool,
) -> impl FnMut(&wirespan_control::runtime::Resource<ProbeStatus>) -> Result<(), String> {
    move |r| {
        (r.spec.success == want)
            .then_some(())
            .ok_or(format!("{:?}", r.spec))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_probes_redirect_is_success_503_fails_after_threshold_removed_probe_loses_status() {
    let (port, h) = http_server().await;
    let store = Store::new(StoreOptions::default());
    let harness = start(&store);
    let doc = |name: &str, path: &str, extra: &str| {
        format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: {name}\nurl: http://127.0.0.1:{port}{path}\ninterval: 300ms\ntimeout: 2s\n{extra}")
    };
    set_config(
        &store,
        &[
            doc("ok", "/status/200", ""),
            doc("moved", "/status/301", ""),
            doc("down", "/status/503", "failureThreshold: 3\n"),
        ]
        .join("---\n"),
    );
    let id = |p: &str| format!("http:http://127.0.0.1:{port}{p}");
    assert_resource::<ProbeStatus>(&store, NS, &id("/status/200"), success(true)).await;
    assert_resource::<ProbeStatus>(&store, NS, &id("/status/301"), success(true)).await;
    assert_eq!(hits(&h, "/target"), 0, "redirect was followed");

    // Not reported before the third failure.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while hits(&h, "/status/503") < 2 {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        store.get::<ProbeStatus>(NS, &id("/status/503")).is_err(),
        "503 reported before the threshold"
    );
    let st = assert_resource::<ProbeStatus>(&store, NS, &id("/status/503"), success(false)).await;
    assert_eq!(st.spec.last_error, "received non-success status code: 503");
    assert!(hits(&h, "/status/503") >= 3);

    // The document goes: so does its status.
    set_config(&store, &doc("ok", "/status/200", ""));
    assert_no_resource(
        &store,
        &Pointer::new(NS, ProbeStatus::TYPE, id("/status/503")),
    )
    .await;
    assert_resource::<ProbeStatus>(&store, NS, &id("/status/200"), success(true)).await;
    harness.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_probe_uses_the_proxy_set_after_start() {
    // The proxy answers every request itself and records the request line; the target
    // host does not resolve, so only the proxy path can succeed.
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = proxy.accept().await.unwrap();
            let mut r = BufReader::new(s);
            let mut line = String::new();
            r.read_line(&mut line).await.unwrap();
            s2.lock().unwrap().push(line.trim_end().to_owned());
            let _ = r
                .get_mut()
                .write_all(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
                .await;
        }
    });
    let env = Env::default();
    let store = Store::new(StoreOptions::default());
    let harness = start_with_env(&store, &env);
    let url = "http://probe-target.invalid:8080/health";
    set_config(
        &store,
        &format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: via-proxy\nurl: {url}\ninterval: 100ms\ntimeout: 2s\n"),
    );
    let id = format!("http:{url}");
    assert_resource::<ProbeStatus>(&store, NS, &id, success(false)).await;
    env.lock().unwrap().http_proxy = Some(format!("http://127.0.0.1:{proxy_port}"));
    assert_resource::<ProbeStatus>(&store, NS, &id, success(true)).await;
    assert!(
        seen.lock()
            .unwrap()
            .iter()
            .any(|l| l == &format!("GET {url} HTTP/1.1")),
        "{:?}",
        seen.lock().unwrap()
    );
    // NO_PROXY exempts the host again.
    env.lock().unwrap().no_proxy = Some(".invalid".into());
    assert_resource::<ProbeStatus>(&store, NS, &id, success(false)).await;
    harness.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_probe_open_and_closed_ports() {
    let open = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let open_port = open.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let _ = open.accept().await;
        }
    });
    let closed_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let store = Store::new(StoreOptions::default());
    let harness = start(&store);
    set_config(
        &store,
        &format!(
            "apiVersion: v1alpha1\nkind: TCPProbeConfig\nname: open\nendpoint: 127.0.0.1:{open_port}\ninterval: 100ms\n---\n\
             apiVersion: v1alpha1\nkind: TCPProbeConfig\nname: closed\nendpoint: 127.0.0.1:{closed_port}\ninterval: 100ms\ntimeout: 1s\n"
        ),
    );
    assert_resource::<ProbeStatus>(
        &store,
        NS,
        &format!("tcp:127.0.0.1:{open_port}"),
        success(true),
    )
    .await;
    let st = assert_resource::<ProbeStatus>(
        &store,
        NS,
        &format!("tcp:127.0.0.1:{closed_port}"),
        success(false),
    )
    .await;
    assert!(
        st.spec.last_error.contains("refused"),
        "{}",
        st.spec.last_error
    );
    harness.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_probe_tunnels_through_an_authenticated_connect_proxy_and_verifies_the_server_name() {
    // TLS server for probe-target.test (self-signed, trusted through SSL_CERT_FILE).
    let cert = rcgen::generate_simple_self_signed(vec!["probe-target.test".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, cert.cert.pem()).unwrap();

    let tls_cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(
        vec![cert.cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into()),
    )
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls_cfg));
    let tls = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let tls_port = tls.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (s, _) = tls.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(s) = acceptor.accept(s).await else {
                    return;
                };
                let mut r = BufReader::new(s);
                let mut line = String::new();
                let _ = r.read_line(&mut line).await;
                let _ = r
                    .get_mut()
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    .await;
                let _ = r.get_mut().shutdown().await;
            });
        }
    });
    // CONNECT proxy: tunnels every CONNECT to the TLS server, records the target and
    // its credentials; refuses a CONNECT without them.
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy_port = proxy.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = proxy.accept().await.unwrap();
            let seen = s2.clone();
            tokio::spawn(async move {
                let mut r = BufReader::new(s);
                let mut line = String::new();
                r.read_line(&mut line).await.unwrap();
                seen.lock().unwrap().push(line.trim_end().to_owned());
                let mut authorized = false;
                loop {
                    let mut h = String::new();
                    if r.read_line(&mut h).await.unwrap() == 0 || h == "\r\n" {
                        break;
                    }
                    // base64("probe:s3cret")
                    authorized |= h.trim_end() == "Proxy-Authorization: Basic cHJvYmU6czNjcmV0";
                }
                let mut client = r.into_inner();
                if !authorized {
                    let _ = client
                        .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
                        .await;
                    return;
                }
                client
                    .write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    .await
                    .unwrap();
                let mut upstream = tokio::net::TcpStream::connect(("127.0.0.1", tls_port))
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
            });
        }
    });
    let env = Env::new(Mutex::new(ProbeEnv {
        https_proxy: Some(format!("probe:s3cret@127.0.0.1:{proxy_port}")),
        ssl_cert_file: Some(ca.clone()),
        ..ProbeEnv::default()
    }));

    let store = Store::new(StoreOptions::default());
    let harness = start_with_env(&store, &env);
    let url = format!("https://probe-target.test:{tls_port}/");
    set_config(
        &store,
        &format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: tls\nurl: {url}\ninterval: 100ms\ntimeout: 3s\n"),
    );
    let id = format!("http:{url}");
    assert_resource::<ProbeStatus>(&store, NS, &id, success(true)).await;
    assert!(seen
        .lock()
        .unwrap()
        .iter()
        .any(|l| l == &format!("CONNECT probe-target.test:{tls_port} HTTP/1.1")));

    // A name the certificate does not cover fails verification.
    let bad = format!("https://other-name.test:{tls_port}/");
    set_config(
        &store,
        &format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: tls\nurl: {bad}\ninterval: 100ms\ntimeout: 3s\n"),
    );
    let st =
        assert_resource::<ProbeStatus>(&store, NS, &format!("http:{bad}"), success(false)).await;
    assert!(st.spec.last_error.contains("TLS"), "{}", st.spec.last_error);
    harness.stop().await.unwrap();
}

/// A proxy that answers 204 to requests carrying `Proxy-Authorization: Basic <want>`
/// and 407 to the others; records each request's line and headers.
async fn auth_proxy(want: &'static str) -> (u16, Arc<Mutex<Vec<String>>>) {
    let proxy = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = proxy.local_addr().unwrap().port();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let s2 = seen.clone();
    tokio::spawn(async move {
        loop {
            let (s, _) = proxy.accept().await.unwrap();
            let mut r = BufReader::new(s);
            let mut head = Vec::new();
            loop {
                let mut h = String::new();
                if r.read_line(&mut h).await.unwrap() == 0 || h == "\r\n" {
                    break;
                }
                head.push(h.trim_end().to_owned());
            }
            let ok = head
                .iter()
                .any(|h| *h == format!("Proxy-Authorization: Basic {want}"));
            s2.lock().unwrap().push(head.join("\n"));
            let resp: &[u8] = if ok {
                b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
            } else {
                b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n"
            };
            let _ = r.get_mut().write_all(resp).await;
        }
    });
    (port, seen)
}

#[tokio::test]
async fn http_probe_sends_proxy_and_target_credentials_as_basic_auth() {
    // base64("user:p@ss"), the password percent-encoded in the proxy URL.
    let (port, seen) = auth_proxy("dXNlcjpwQHNz").await;
    let spec = |url: &str| wirespan_control::resources::network::HttpProbeSpec {
        url: url.to_owned(),
        timeout: Duration::from_secs(5),
    };
    let env = |proxy: String| ProbeEnv {
        http_proxy: Some(proxy),
        ..ProbeEnv::default()
    };
    let target = spec("http://admin:hunter2@probe-target.invalid/health");
    probe::probe_http(
        &target,
        &env(format!("http://user:p%40ss@127.0.0.1:{port}")),
    )
    .await
    .unwrap();
    let head = seen.lock().unwrap().last().cloned().unwrap();
    assert!(
        head.starts_with("GET http://probe-target.invalid:80/health HTTP/1.1"),
        "{head}"
    );
    // base64("admin:hunter2") for the target itself.
    assert!(
        head.contains("Authorization: Basic YWRtaW46aHVudGVyMg=="),
        "{head}"
    );
    let err = probe::probe_http(&target, &env(format!("http://127.0.0.1:{port}")))
        .await
        .unwrap_err();
    assert_eq!(err, "received non-success status code: 407");
}

#[tokio::test]
async fn http_probe_against_a_server_that_never_answers_times_out() {
    // Accepts, reads nothing, answers nothing, keeps the connection open.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a2 = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (s, _) = l.accept().await.unwrap();
            a2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            held.push(s);
        }
    });
    let spec = wirespan_control::resources::network::HttpProbeSpec {
        url: format!("http://user:pw@127.0.0.1:{port}/slow"),
        timeout: Duration::from_millis(200),
    };
    // The guard only keeps a broken probe from hanging the test; the probe's own
    // timeout is what ends it.
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        probe::probe_http(&spec, &ProbeEnv::default()),
    )
    .await
    .expect("the probe's timeout did not fire")
    .unwrap_err();
    assert_eq!(
        err,
        format!("GET http://127.0.0.1:{port}/slow: timeout after 200ms")
    );
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "connected, then waited for the answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_specs_are_shown_without_url_credentials() {
    let (port, _) = http_server().await;
    let store = Store::new(StoreOptions::default());
    let harness = start(&store);
    set_config(
        &store,
        &format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: c\nurl: http://user:s3cret@127.0.0.1:{port}/status/200\ninterval: 100ms\n"),
    );
    let id = format!("http:http://127.0.0.1:{port}/status/200");
    // The prober used the URL (credentials and all) and succeeded.
    assert_resource::<ProbeStatus>(&store, NS, &id, success(true)).await;
    let spec = store
        .get::<wirespan_control::resources::network::ProbeSpec>(NS, &id)
        .unwrap();
    let shown = serde_yaml_ng::to_string(&spec.spec).unwrap();
    assert!(
        !shown.contains("s3cret") && !shown.contains("user"),
        "{shown}"
    );
    assert!(
        shown.contains(&format!(
            "url: http://<redacted>@127.0.0.1:{port}/status/200"
        )),
        "{shown}"
    );
    harness.stop().await.unwrap();
}
