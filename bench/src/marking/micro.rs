//! Micro: ns per packet through `BPF_PROG_TEST_RUN`, per lookup structure, next to
//! the floor and empty programs measured in the same run.

use anyhow::Context;
use wirespan_dataplane::fastpath::{sync::Structures, Programs};
use wirespan_ebpf::{PROG_EMPTY, PROG_FLOOR, PROG_LPM, PROG_PHASH};

use super::{frame_to, median_f, probe_dst, routed_set, Args, Probe};
use crate::bar;

/// Routed-set sizes of the micro benchmark (prefixes per family).
const SIZES: [usize; 5] = [1, 100, 1_000, 10_000, 100_000];

/// One micro figure: ns per packet (median over rounds).
#[derive(Debug, Clone)]
pub(super) struct Micro {
    pub(super) size: usize,
    pub(super) v6: bool,
    pub(super) probe: Probe,
    pub(super) phash: f64,
    pub(super) lpm: f64,
    pub(super) floor: f64,
    pub(super) empty: f64,
}

/// Every size, family and probe: ns per packet of each program.
pub(super) fn micro(args: &Args) -> anyhow::Result<Vec<Micro>> {
    let (repeat, rounds) = if args.quick {
        (20_000, 3)
    } else {
        (200_000, 7)
    };
    let mut out = Vec::new();
    let pb = bar(SIZES.len(), "micro (BPF_PROG_TEST_RUN)");
    for &n in &SIZES {
        let mut p = Programs::load(
            Structures {
                phash: true,
                lpm: true,
            },
            wirespan_ebpf::DEFAULT_ENTRIES,
            &[PROG_PHASH, PROG_LPM, PROG_FLOOR, PROG_EMPTY],
        )
        .context("loading the BPF programs (root and a kernel with BPF needed)")?;
        p.apply(&routed_set(n))?;
        for v6 in [false, true] {
            for probe in [Probe::Host, Probe::Cidr, Probe::Miss] {
                let Some(dst) = probe_dst(n, v6, probe) else {
                    continue;
                };
                let pkt = frame_to(dst, [2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2]);
                // Sanity: the structures agree on the verdict.
                let want = u32::from(probe != Probe::Miss) * 0x40;
                for prog in [PROG_PHASH, PROG_LPM] {
                    let r = p.test_run(prog, &pkt, 0, 1)?;
                    anyhow::ensure!(
                        r.mark == want,
                        "{prog} {dst}: mark {:#x}, want {want:#x}",
                        r.mark
                    );
                }
                let mut samples: [Vec<f64>; 4] = Default::default();
                for _ in 0..rounds {
                    for (i, prog) in [PROG_PHASH, PROG_LPM, PROG_FLOOR, PROG_EMPTY]
                        .iter()
                        .enumerate()
                    {
                        let r = p.test_run(prog, &pkt, 0, repeat)?;
                        samples[i].push(r.per_run.as_nanos() as f64);
                    }
                }
                // The kernel reports whole ns per run; average of the medians is fine.
                let [a, b, c, d] = &mut samples;
                out.push(Micro {
                    size: n,
                    v6,
                    probe,
                    phash: median_f(a),
                    lpm: median_f(b),
                    floor: median_f(c),
                    empty: median_f(d),
                });
            }
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok(out)
}
