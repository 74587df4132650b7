//! The ping matrix: every node pings every other node's addresses from inside its
//! namespace, all at once.

use std::{
    fmt::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};

/// One ping's outcome: the round trip, or `None` when no reply came.
pub type Rtt = Option<Duration>;

/// The RTT of a successful `ping -c 1` from its output (`time=0.052 ms`).
#[must_use]
pub fn parse_rtt(output: &str) -> Option<Duration> {
    let rest = output.split("time=").nth(1)?;
    let number: String = rest
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    let ms: f64 = number.parse().ok()?;
    Some(Duration::from_secs_f64(ms / 1000.0))
}

/// Pings each `(netns, target)` once (1 s timeout), all in parallel.
#[must_use]
pub fn ping_all(probes: &[(String, IpAddr)]) -> Vec<Rtt> {
    let children: Vec<_> = probes
        .iter()
        .map(|(netns, target)| {
            Command::new("ip")
                .args(["netns", "exec", netns, "ping", "-n", "-c", "1", "-W", "1"])
                .arg(target.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .ok()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c?.wait_with_output().ok()?;
            if !out.status.success() {
                return None;
            }
            parse_rtt(&String::from_utf8_lossy(&out.stdout))
        })
        .collect()
}

/// Renders one matrix: rows ping from, columns ping to; `None` cells are not probed
/// (the node itself, or no address known).
#[must_use]
pub fn render(title: &str, names: &[String], cells: &[Vec<Option<Rtt>>]) -> String {
    let cell = |c: &Option<Rtt>| match c {
        None => "-".to_owned(),
        Some(None) => "FAIL".to_owned(),
        Some(Some(d)) => format!("ok {:.2}ms", d.as_secs_f64() * 1000.0),
    };
    let width = cells
        .iter()
        .flatten()
        .map(|c| cell(c).len())
        .chain(names.iter().map(String::len))
        .chain([title.len()])
        .max()
        .unwrap_or(0);
    let mut s = format!("{title:<width$}");
    for n in names {
        let _ = write!(s, "  {n:<width$}");
    }
    s = s.trim_end().to_owned();
    s.push('\n');
    for (from, row) in names.iter().zip(cells) {
        let mut line = format!("{from:<width$}");
        for c in row {
            let _ = write!(line, "  {:<width$}", cell(c));
        }
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rtt_is_read_from_ping_output() {
        let out = "PING 10.99.1.12 (10.99.1.12) 56(84) bytes of data.\n\
                   64 bytes from 10.99.1.12: icmp_seq=1 ttl=64 time=0.052 ms\n";
        assert_eq!(parse_rtt(out), Some(Duration::from_micros(52)));
        assert_eq!(parse_rtt("1 packets transmitted, 0 received"), None);
    }

    #[test]
    fn matrix_marks_self_fail_and_ok() {
        let names = vec!["node1".to_owned(), "node2".to_owned()];
        let cells = vec![
            vec![None, Some(Some(Duration::from_micros(250)))],
            vec![Some(None), None],
        ];
        let m = render("underlay", &names, &cells);
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(
            lines[0].split_whitespace().collect::<Vec<_>>(),
            ["underlay", "node1", "node2"]
        );
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            ["node1", "-", "ok", "0.25ms"]
        );
        assert_eq!(
            lines[2].split_whitespace().collect::<Vec<_>>(),
            ["node2", "FAIL", "-"]
        );
    }
}
