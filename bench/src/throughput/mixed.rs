//! Two-node labs whose two sides run different WireGuard implementations (`lab up
//! --wireguard node1=A,node2=B`): TCP and UDP through the unmarked mesh, each way.

use std::fmt::Write as _;

use super::{check_path, judge_sample, measure, spread, PathKind, Run, Sample};
use crate::{bar, lab::Lab, sanity::Sanity};

/// The `--wireguard` plans of the mixed labs: each implementation measured with the
/// next one in `backends` (kernel with `wirespan wireguard`, that with wireguard-go).
pub(super) fn pairs(backends: &[String]) -> Vec<String> {
    backends
        .windows(2)
        .filter(|w| w[0] != w[1])
        .map(|w| format!("node1={},node2={}", w[0], w[1]))
        .collect()
}

/// node1 → node2 and back, TCP then UDP.
const RUNS: [(&str, Run); 4] = [
    (
        "TCP 1 stream, node1 → node2",
        Run {
            udp: false,
            streams: 1,
            reverse: false,
        },
    ),
    (
        "TCP 1 stream, node2 → node1",
        Run {
            udp: false,
            streams: 1,
            reverse: true,
        },
    ),
    (
        "UDP, node1 → node2",
        Run {
            udp: true,
            streams: 1,
            reverse: false,
        },
    ),
    (
        "UDP, node2 → node1",
        Run {
            udp: true,
            streams: 1,
            reverse: true,
        },
    ),
];

/// Measures every plan in `pairs`; returns the report's section.
///
/// # Errors
/// A lab that does not come up, or a run whose traffic did not cross the mesh.
pub(super) fn run(
    exe: &std::path::Path,
    pairs: &[String],
    rounds: usize,
    seconds: u64,
    sanity: &mut Sanity,
) -> anyhow::Result<String> {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "\n## Mixed pairs: each side a different implementation (mesh, no marking)\n"
    );
    let _ = writeln!(
        t,
        "| node1 | node2 | run | Mbit/s received (median, min–max) | UDP loss |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|");
    for (i, plan) in pairs.iter().enumerate() {
        let name = format!("bt{}m{i}", std::process::id());
        let lab = Lab::up_pair(exe, &name, "nftables", plan)?;
        let (one, two) = (lab.backend_of("node1"), lab.backend_of("node2"));
        let (target, server_ns) = lab.target(PathKind::MeshUnmarked)?;
        let client_ns = lab.namespace("node1")?;
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); RUNS.len()];
        let pb = bar(rounds * RUNS.len(), &format!("{one} with {two}"));
        for _ in 0..rounds {
            for (k, (_, run)) in RUNS.iter().enumerate() {
                // node1 sends forward runs and receives reverse ones.
                let before = lab.mesh_bytes(run.reverse)?;
                let s = measure(&client_ns, target, &server_ns, *run, seconds)?;
                let crossed = lab.mesh_bytes(run.reverse)?.saturating_sub(before);
                let who = format!("{one} with {two}");
                if judge_sample(sanity, &who, PathKind::MeshUnmarked, run.udp, &s) {
                    check_path(PathKind::MeshUnmarked, run.udp, &s, crossed)?;
                }
                samples[k].push(s);
                pb.inc(1);
            }
        }
        pb.finish_and_clear();
        for ((label, run), s) in RUNS.iter().zip(&samples) {
            let (m, lo, hi) = spread(&s.iter().map(|x| x.mbps).collect::<Vec<_>>());
            let loss = if run.udp {
                format!(
                    "{:.1} %",
                    spread(&s.iter().map(|x| x.lost_percent).collect::<Vec<_>>()).0
                )
            } else {
                "—".to_owned()
            };
            let _ = writeln!(
                t,
                "| {} | {} | {label} | {m:.0} ({lo:.0}–{hi:.0}) | {loss} |",
                super::implementation(&one),
                super::implementation(&two)
            );
        }
    }
    t.push('\n');
    Ok(t)
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_implementation_is_paired_with_the_next() {
        let b = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            super::pairs(&b(&["kernel", "userspace", "userspace-go"])),
            [
                "node1=kernel,node2=userspace",
                "node1=userspace,node2=userspace-go"
            ]
        );
        assert!(super::pairs(&b(&["userspace"])).is_empty());
    }
}
