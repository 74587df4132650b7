//! The discovery server's landing and inspect pages as a browser renders them: the
//! real `wirespan discovery` binary on loopback, clusters put in through the real
//! gRPC API, and headless Chromium (Debian's `chromium`, installed by
//! `scripts/setup.sh`) dumping the rendered DOM and taking screenshots.
//!
//! Set `WIRESPAN_SCREENSHOT_DIR` to keep the screenshots (docs/img/ comes from there).

mod common;

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use common::discovery::Discovery;
use tonic::transport::{Channel, Endpoint};
use wirespan_discovery::proto::server::{
    cluster_client::ClusterClient, AffiliateUpdateRequest, HelloRequest, WatchRequest,
    WatchResponse,
};

const CHROMIUM: &str = "/usr/bin/chromium";
/// Put into every affiliate's data and endpoints: the pages must never show it.
const SECRET: &str = "TOPSECRET";

/// The test's clusters: (cluster ID, [(affiliate ID, endpoint count)]).
const CLUSTERS: &[(&str, &[(&str, usize)])] = &[
    (
        "prod-eu-7Jq2v9sXnR4tWbYcLm3K",
        &[
            ("2xD9kQm4LwZ7pT1vHc8RsN5bYf", 2),
            ("8fHs3NcV1xQ6mK9tLp2WdR7gZa", 3),
            ("Kq5Yb1Tm8Rw3Zs6Vn9Lc2Xh4Pd", 1),
        ],
    ),
    ("staging-4Hn8cT2pQw", &[("Wm3Rk8Zt1Yq6Xs9Lb4Nc7Vd2Hf", 2)]),
];

/// Chromium's whole process group, killed on drop (its renderer and GPU helpers are
/// children that would outlive a kill of the browser process alone).
struct Browser(std::process::Child);

impl Drop for Browser {
    fn drop(&mut self) {
        if let Ok(pgid) = i32::try_from(self.0.id()) {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(pgid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.0.wait();
    }
}

/// Runs headless Chromium on `url` with `extra` flags in a fresh profile; returns
/// its stdout. Fails after 90 s.
fn chromium(url: &str, extra: &[String]) -> String {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: run scripts/setup.sh (installs Debian's chromium)"
    );
    let profile = tempfile::tempdir().unwrap();
    let out_path = profile.path().join("stdout");
    let err_path = profile.path().join("stderr");
    let child = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!(
            "--user-data-dir={}",
            profile.path().join("p").display()
        ))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .unwrap();
    let mut browser = Browser(child);
    let deadline = Instant::now() + Duration::from_secs(90);
    let status = loop {
        if let Some(s) = browser.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "chromium did not finish on {url}:\n{}",
            std::fs::read_to_string(&err_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "chromium failed ({status}) on {url}:\n{}",
        std::fs::read_to_string(&err_path).unwrap_or_default()
    );
    drop(browser);
    std::fs::read_to_string(&out_path).unwrap()
}

fn dump_dom(url: &str) -> String {
    chromium(url, &["--dump-dom".to_owned()])
}

/// Takes a `w`×`h` screenshot of `url`; returns the PNG's bytes after checking the
/// signature and that the image is `w`×`h` (the IHDR chunk).
fn screenshot(url: &str, file: &Path, w: u32, h: u32) -> Vec<u8> {
    chromium(
        url,
        &[
            format!("--screenshot={}", file.display()),
            format!("--window-size={w},{h}"),
        ],
    );
    let png = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    assert!(
        png.len() > 1000,
        "screenshot of {url} is {} bytes",
        png.len()
    );
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "not a PNG");
    assert_eq!(&png[12..16], b"IHDR", "no IHDR first");
    let dim = |o: usize| u32::from_be_bytes(png[o..o + 4].try_into().unwrap());
    assert_eq!((dim(16), dim(20)), (w, h), "screenshot size");
    if let Some(dir) = std::env::var_os("WIRESPAN_SCREENSHOT_DIR") {
        let keep = PathBuf::from(dir).join(file.file_name().unwrap());
        std::fs::copy(file, keep).unwrap();
    }
    png
}

/// Fills the server through its gRPC API; the returned Watch keeps one watcher open.
async fn populate(d: &Discovery) -> tonic::Streaming<WatchResponse> {
    let channel = Endpoint::from_shared(format!("http://{}", d.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = ClusterClient::<Channel>::new(channel);
    for (cluster, affiliates) in CLUSTERS {
        c.hello(HelloRequest {
            cluster_id: (*cluster).into(),
            client_version: "v1.8.3".into(),
        })
        .await
        .unwrap();
        for (id, endpoints) in *affiliates {
            c.affiliate_update(AffiliateUpdateRequest {
                cluster_id: (*cluster).into(),
                affiliate_id: (*id).into(),
                affiliate_data: Some(format!("{SECRET}-data-of-{id}").into_bytes()),
                affiliate_endpoints: (0..*endpoints)
                    .map(|i| format!("{SECRET}-endpoint-{i}").into_bytes())
                    .collect(),
                ttl: Some(prost_types::Duration {
                    seconds: 1800,
                    nanos: 0,
                }),
            })
            .await
            .unwrap();
        }
    }
    let mut watch = c
        .watch(WatchRequest {
            cluster_id: CLUSTERS[0].0.into(),
        })
        .await
        .unwrap()
        .into_inner();
    // The first message (the snapshot) means the subscription is registered.
    tokio::time::timeout(Duration::from_secs(10), watch.message())
        .await
        .expect("watch snapshot timed out")
        .unwrap()
        .unwrap();
    watch
}

/// The text of the element with `id` in a DOM dump (`<tag id="ID">TEXT<`).
fn text_of(dom: &str, id: &str) -> String {
    let marker = format!("id=\"{id}\"");
    let at = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("no #{id} in the DOM:\n{dom}"));
    let rest = &dom[at..];
    let start = rest.find('>').unwrap() + 1;
    let end = rest[start..].find('<').unwrap();
    rest[start..start + end].to_owned()
}

fn assert_no_secret(dom: &str) {
    assert!(
        !dom.contains(SECRET),
        "the page shows blob contents:\n{dom}"
    );
    let hex: String = SECRET.bytes().map(|b| format!("{b:02x}")).collect();
    assert!(
        !dom.to_ascii_lowercase().contains(&hex),
        "hex of blob:\n{dom}"
    );
}

#[test]
fn landing_and_inspect_pages_render_the_clusters_in_chromium() {
    let server = Discovery::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Kept open (and so counted as a watcher) until the end of the test.
    let _watch = rt.block_on(populate(&server));
    let shots = tempfile::tempdir().unwrap();

    let affiliates: usize = CLUSTERS.iter().map(|(_, a)| a.len()).sum();
    let endpoints: usize = CLUSTERS
        .iter()
        .flat_map(|(_, a)| a.iter().map(|(_, e)| e))
        .sum();

    // The landing page: counts over all clusters, no cluster IDs.
    let landing = format!("http://{}/", server.web);
    let dom = dump_dom(&landing);
    assert!(
        dom.contains("<title>wirespan discovery</title>"),
        "title:\n{dom}"
    );
    assert_eq!(text_of(&dom, "clusters"), CLUSTERS.len().to_string());
    assert_eq!(text_of(&dom, "affiliates"), affiliates.to_string());
    assert_eq!(text_of(&dom, "endpoints"), endpoints.to_string());
    assert_eq!(text_of(&dom, "watchers"), "1");
    for (cluster, _) in CLUSTERS {
        assert!(!dom.contains(cluster), "the landing page lists {cluster}");
    }
    assert!(dom.contains("action=\"/inspect\""), "inspect form:\n{dom}");
    assert_no_secret(&dom);
    screenshot(
        &landing,
        &shots.path().join("discovery-landing.png"),
        900,
        520,
    );

    // The inspect page of the first cluster: every affiliate with its endpoint count.
    let (cluster, members) = CLUSTERS[0];
    let inspect = format!("http://{}/inspect?clusterID={cluster}", server.web);
    let dom = dump_dom(&inspect);
    assert_eq!(text_of(&dom, "cluster-id"), cluster);
    assert_eq!(
        text_of(&dom, "summary"),
        format!("{} affiliates", members.len())
    );
    assert_eq!(
        dom.matches("<tr class=\"affiliate\">").count(),
        members.len(),
        "{dom}"
    );
    for (id, n) in members {
        let data_len = format!("{SECRET}-data-of-{id}").len();
        let row = format!(
            "<tr class=\"affiliate\"><td><code>{id}</code></td><td>{data_len}</td><td>{n}</td>"
        );
        assert!(dom.contains(&row), "no row {row} in:\n{dom}");
    }
    // The other cluster's affiliate is not on this page.
    assert!(!dom.contains(CLUSTERS[1].1[0].0), "{dom}");
    assert_no_secret(&dom);
    screenshot(
        &inspect,
        &shots.path().join("discovery-inspect.png"),
        900,
        520,
    );

    // An unknown cluster: a page saying so (and no cluster created by looking).
    let dom = dump_dom(&format!("http://{}/inspect?clusterID=nope", server.web));
    assert!(dom.contains("No cluster <code>nope</code>"), "{dom}");
    let dom = dump_dom(&landing);
    assert_eq!(text_of(&dom, "clusters"), CLUSTERS.len().to_string());
}
