//! The real `wirespan discovery` binary on loopback (ephemeral ports), killed on drop,
//! and a tiny HTTP/1.1 GET for its metrics listener.

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use super::{ChildGuard, BIN};

/// A running `wirespan discovery --listen … --metrics-listen …`; killed on drop.
pub struct Discovery {
    pub grpc: SocketAddr,
    pub web: SocketAddr,
    pub log: PathBuf,
    _dir: tempfile::TempDir,
    child: ChildGuard,
}

/// A loopback port free right now (the OS's pick; released for the child to bind).
pub fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

impl Discovery {
    /// Starts the server and waits until its metrics listener answers (it binds both
    /// listeners before serving either).
    pub fn start() -> Self {
        Self::start_with(&[], None)
    }

    /// Like [`Self::start`], with more arguments, and under a soft and hard
    /// `RLIMIT_NOFILE` of `nofile` if given (set by the shell before it execs the
    /// binary).
    pub fn start_with(args: &[&str], nofile: Option<u32>) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("discovery.log");
        let (grpc, web) = (free_port(), free_port());
        let mut command = match nofile {
            Some(n) => {
                let mut c = Command::new("sh");
                c.args(["-c", &format!("ulimit -n {n} && exec \"$0\" \"$@\""), BIN]);
                c
            }
            None => Command::new(BIN),
        };
        let child = command
            .args(["discovery", "--listen", &grpc.to_string()])
            .args(["--metrics-listen", &web.to_string()])
            // Many requests from one address in a burst.
            .arg("--no-rate-limit")
            .args(args)
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let mut d = Self {
            grpc,
            web,
            log,
            _dir: dir,
            child: ChildGuard(child),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(web).is_err() {
            if let Some(status) = d.child.0.try_wait().unwrap() {
                panic!("discovery exited ({status}):\n{}", d.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "discovery not listening on {web}:\n{}",
                d.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        d
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.0.id()
    }

    /// The server's resident set size, in KiB.
    pub fn rss_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmRSS in /proc/<pid>/status")
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET path` on the metrics listener: (status code, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        http_get(self.web, path)
    }
}

/// Minimal HTTP/1.1 GET with `Connection: close`; returns (status code, body).
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    parse_response(&out)
}

/// (status, body) of a raw HTTP/1.1 response without chunked encoding.
pub fn parse_response(raw: &str) -> (u16, String) {
    let status = raw
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {raw:?}"));
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "chunked response not handled:\n{head}"
    );
    (status, body.to_owned())
}
