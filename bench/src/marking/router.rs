//! The macro benchmark's topology: sender, router and sink namespaces joined by
//! veths, an XDP program that injects live frames on the router's ingress, and one
//! on the sink that drops and counts what the router forwarded.

use std::{
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::Context;
use wirespan_dataplane::{
    fastpath::{sync::Structures, testrun, Programs},
    netns::{unique_name, NetnsGuard, NetnsThread},
};
use wirespan_ebpf::{PROG_XDP_PASS, PROG_XDP_SINK};

use super::frame_to;

/// Sender, router and sink namespaces, a thread in the router's namespace that
/// injects frames, and the sink's counting program.
pub(super) struct Router {
    pub(super) sender: NetnsGuard,
    pub(super) router: NetnsGuard,
    pub(super) sink: NetnsGuard,
    pub(super) r_in: String,
    r_in_index: u32,
    r_in_mac: [u8; 6],
    sender_mac: [u8; 6],
    thread: NetnsThread,
    source: Programs,
    sink_counter: Programs,
}

fn mac_of(ns: &NetnsGuard, dev: &str) -> anyhow::Result<([u8; 6], u32)> {
    let out = ns.run_stdout("ip", &["-j", "link", "show", "dev", dev])?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let addr = v[0]["address"].as_str().context("no MAC")?;
    let mut mac = [0u8; 6];
    for (m, part) in mac.iter_mut().zip(addr.split(':')) {
        *m = u8::from_str_radix(part, 16)?;
    }
    let index = u32::try_from(v[0]["ifindex"].as_u64().context("no ifindex")?)?;
    Ok((mac, index))
}

fn veth(a: &NetnsGuard, b: &NetnsGuard) -> anyhow::Result<(String, String)> {
    let (x, y) = (unique_name("bm"), unique_name("bn"));
    a.run(
        "ip",
        &["link", "add", &x, "type", "veth", "peer", "name", &y],
    )?;
    a.run("ip", &["link", "set", &y, "netns", b.name()])?;
    a.run("ip", &["link", "set", &x, "up"])?;
    b.run("ip", &["link", "set", &y, "up"])?;
    Ok((x, y))
}

impl Router {
    pub(super) fn new() -> anyhow::Result<Self> {
        let sender = NetnsGuard::new("wsbS")?;
        let router = NetnsGuard::new("wsbR")?;
        let sink = NetnsGuard::new("wsbK")?;
        let (s_out, r_in) = veth(&sender, &router)?;
        let (r_out, k_in) = veth(&router, &sink)?;
        sender.run("ip", &["addr", "add", "10.1.0.2/24", "dev", &s_out])?;
        router.run("ip", &["addr", "add", "10.1.0.1/24", "dev", &r_in])?;
        router.run("ip", &["addr", "add", "10.2.0.1/24", "dev", &r_out])?;
        sink.run("ip", &["addr", "add", "10.2.0.2/24", "dev", &k_in])?;
        for kv in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            router.run("sysctl", &["-q", "-w", kv])?;
        }
        // The sink gets the router ingress's MAC: live-frame pages are recycled with the
        // Ethernet header forwarding wrote, which then still addresses the router.
        let (r_in_mac0, _) = mac_of(&router, &r_in)?;
        let mac = r_in_mac0.map(|b| format!("{b:02x}")).join(":");
        sink.run("ip", &["link", "set", "dev", &k_in, "address", &mac])?;
        router.run(
            "ip",
            &[
                "neigh",
                "replace",
                "10.2.0.2",
                "lladdr",
                &mac,
                "dev",
                &r_out,
                "nud",
                "permanent",
            ],
        )?;
        router.run("ip", &["route", "add", "172.16.0.0/12", "via", "10.2.0.2"])?;
        let (r_in_mac, r_in_index) = mac_of(&router, &r_in)?;
        let (sender_mac, _) = mac_of(&sender, &s_out)?;

        let source = Programs::load(
            Structures {
                phash: false,
                lpm: false,
            },
            1,
            &[PROG_XDP_PASS],
        )?;
        let mut sink_counter = Programs::load(
            Structures {
                phash: false,
                lpm: false,
            },
            1,
            &[PROG_XDP_SINK],
        )?;
        let thread = NetnsThread::spawn(sink.netns())?;
        // Attach in the sink's namespace: aya resolves the name there.
        let k = k_in;
        let sc = std::sync::Arc::new(std::sync::Mutex::new(Some(sink_counter)));
        let sc2 = std::sync::Arc::clone(&sc);
        thread
            .run(move || {
                let mut g = sc2
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                g.as_mut().map(|p| p.attach_xdp(PROG_XDP_SINK, &k))
            })?
            .context("no sink")??;
        sink_counter = sc
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
            .context("sink")?;
        let thread = NetnsThread::spawn(router.netns())?;
        Ok(Self {
            sender,
            router,
            sink,
            r_in,
            r_in_index,
            r_in_mac,
            sender_mac,
            thread,
            source,
            sink_counter,
        })
    }

    /// Sends `per_dst` frames to each destination; returns (CPU time of the sending
    /// thread per packet in ns, fraction delivered to the sink).
    pub(super) fn blast(&self, dsts: &[IpAddr], per_dst: u32) -> anyhow::Result<(f64, f64)> {
        let frames: Vec<Vec<u8>> = dsts
            .iter()
            .map(|d| frame_to(*d, self.r_in_mac, self.sender_mac))
            .collect();
        let fd = self.source.program_fd(PROG_XDP_PASS)?;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let index = self.r_in_index;
        let before = self.sink_counter.counters()?.hit;
        let elapsed = self.thread.run(move || -> std::io::Result<Duration> {
            let fd = unsafe_borrow(raw);
            let start = thread_cpu_time();
            for f in &frames {
                testrun::run_xdp_live(fd, f, index, per_dst, 64)?;
            }
            Ok(thread_cpu_time().saturating_sub(start))
        })??;
        // Let the sink's softirq drain (it runs right after, on this CPU).
        let sent = u64::from(per_dst) * dsts.len() as u64;
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut got = 0;
        while Instant::now() < deadline {
            got = self.sink_counter.counters()?.hit - before;
            if got >= sent {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok((
            elapsed.as_nanos() as f64 / sent as f64,
            got as f64 / sent as f64,
        ))
    }
}

/// Borrows a raw fd for the duration of a closure on another thread.
#[allow(unsafe_code)]
fn unsafe_borrow(raw: std::os::fd::RawFd) -> std::os::fd::BorrowedFd<'static> {
    // SAFETY: callers pass an fd owned by a `Programs` that outlives the call
    // (`Router::blast` waits for the closure to finish before returning).
    unsafe { std::os::fd::BorrowedFd::borrow_raw(raw) }
}

/// CPU time of the calling thread (user + system, softirq work done in its context
/// included): unlike wall time, not inflated when other work preempts it.
#[allow(unsafe_code)]
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write into.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &raw mut ts) };
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}
