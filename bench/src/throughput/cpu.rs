//! CPU time for `bench throughput`'s CPU seconds per GB, read from `/proc` (in
//! `USER_HZ` ticks, 100 a second on Linux whatever the kernel's own tick rate):
//!
//! - the device: user plus system time of the userspace WireGuard processes
//!   (`wirespan wireguard`, wireguard-go) in the lab's two nodes. Kernel WireGuard has
//!   no process (it runs in softirq and kernel workers): it reads 0 here.
//! - the machine: every CPU's non-idle time (`/proc/stat`: user, nice, system, irq,
//!   softirq, steal). It holds the kernel's share (WireGuard in the kernel, the TUN,
//!   UDP and veth paths), iperf3 itself, and anything else the machine runs meanwhile.

use std::process::Command;

use crate::lab::Lab;

/// `USER_HZ`: the unit of `/proc/stat` and `/proc/PID/stat` times.
const TICKS_PER_SECOND: f64 = 100.0;

/// A reading of both clocks, in ticks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CpuTicks {
    pub device: u64,
    pub machine: u64,
}

impl CpuTicks {
    /// Reads both clocks now for `lab`'s two nodes.
    pub(super) fn now(lab: &Lab) -> Self {
        let device = ["node1", "node2"]
            .iter()
            .filter_map(|n| lab.namespace(n).ok())
            .flat_map(|ns| device_pids(&ns))
            .filter_map(process_ticks)
            .sum();
        let machine = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| machine_busy_ticks(&s))
            .unwrap_or(0);
        Self { device, machine }
    }

    /// Seconds from `earlier` to `self` (0 where a clock went back: a restarted
    /// process).
    pub(super) fn seconds_since(self, earlier: Self) -> (f64, f64) {
        (
            self.device.saturating_sub(earlier.device) as f64 / TICKS_PER_SECOND,
            self.machine.saturating_sub(earlier.machine) as f64 / TICKS_PER_SECOND,
        )
    }
}

/// The userspace WireGuard processes in namespace `ns`.
fn device_pids(ns: &str) -> Vec<u32> {
    let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| is_device_cmdline(&c))
        })
        .collect()
}

/// Whether a `/proc/PID/cmdline` is a userspace WireGuard device: `wireguard-go ...`,
/// or `wirespan wireguard ...` (any executable whose first argument is `wireguard`).
pub(super) fn is_device_cmdline(cmdline: &[u8]) -> bool {
    let mut args = cmdline.split(|b| *b == 0);
    let program = args.next().unwrap_or_default();
    program.ends_with(b"wireguard-go") || args.next() == Some(b"wireguard".as_slice())
}

/// User plus system ticks of process `pid`.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    process_stat_ticks(&stat)
}

/// User plus system ticks from a `/proc/PID/stat` line (fields 14 and 15; the command
/// in field 2 may hold spaces, so fields are counted after its closing parenthesis).
pub(super) fn process_stat_ticks(stat: &str) -> Option<u64> {
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(utime + stime)
}

/// Non-idle ticks of every CPU from `/proc/stat`'s first line.
pub(super) fn machine_busy_ticks(proc_stat: &str) -> Option<u64> {
    let line = proc_stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal
    Some([0, 1, 2, 5, 6, 7].iter().filter_map(|i| v.get(*i)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_figures_parse() {
        let stat = "4242 (wireguard go) S 1 2 3 0 -1 4194560 100 0 0 0 150 27 0 0 20 0 9 0";
        assert_eq!(process_stat_ticks(stat), Some(177));
        let all = "cpu  10 2 30 1000 5 6 7 8 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n";
        assert_eq!(machine_busy_ticks(all), Some(10 + 2 + 30 + 6 + 7 + 8));
        assert!(is_device_cmdline(b"/usr/bin/wireguard-go\0-f\0kubespan\0"));
        assert!(is_device_cmdline(
            b"/x/wirespan\0wireguard\0--foreground\0kubespan\0"
        ));
        assert!(!is_device_cmdline(b"/x/wirespan\0node\0"));
        assert!(!is_device_cmdline(b"iperf3\0-s\0"));
    }
}
