//! Macro: forwarded packets through the router namespace under each marking
//! configuration, alternating configurations over rounds; overhead is taken against
//! the same round's no-marking figure.

use std::net::{IpAddr, Ipv4Addr};

use anyhow::Context;
use wirespan_dataplane::{
    fastpath::{FastPath, FastPathConfig, Interfaces, Lookup},
    marking::{Marking, MarkingSpec, NftMarking, PreroutingMarking, SetLayout},
};

use super::{probe_dst, routed_set, router::Router, Args, Probe};
use crate::{bar, sanity::Sanity};

/// Routed-set sizes of the macro benchmark (IPv4 prefixes).
pub(super) const MACRO_SIZES: [usize; 2] = [100, 10_000];

/// A marking configuration of the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Config {
    None,
    NftInterval,
    NftSplit,
    NftPerLength,
    Ebpf,
    EbpfLpm,
}

const CONFIGS: [Config; 6] = [
    Config::None,
    Config::NftInterval,
    Config::NftSplit,
    Config::NftPerLength,
    Config::Ebpf,
    Config::EbpfLpm,
];

impl Config {
    pub(super) fn name(self) -> &'static str {
        match self {
            Config::None => "no marking",
            Config::NftInterval => "nft interval set (upstream)",
            Config::NftSplit => "nft hash + interval",
            Config::NftPerLength => "nft hash per prefix length (ours)",
            Config::Ebpf => "eBPF tcx prefix hash",
            Config::EbpfLpm => "eBPF tcx hash + LPM",
        }
    }
}

/// The configuration's kernel state, removed on drop.
enum Applied {
    None,
    Nft(NftMarking),
    Ebpf(NftMarking, FastPath),
}

fn apply_config(r: &Router, config: Config, set: &MarkingSpec) -> anyhow::Result<Applied> {
    Ok(match config {
        Config::None => Applied::None,
        Config::NftInterval | Config::NftSplit | Config::NftPerLength => {
            let mut m = NftMarking::new(r.router.netns().clone());
            m.apply(&MarkingSpec {
                layout: match config {
                    Config::NftInterval => SetLayout::Interval,
                    Config::NftSplit => SetLayout::Split,
                    _ => SetLayout::PerLength,
                },
                ..set.clone()
            })?;
            Applied::Nft(m)
        }
        Config::Ebpf | Config::EbpfLpm => {
            let spec = MarkingSpec {
                prerouting: PreroutingMarking::FastPath,
                ..set.clone()
            };
            let mut m = NftMarking::new(r.router.netns().clone());
            m.apply(&spec)?;
            let fp = FastPath::attach(
                r.router.netns(),
                FastPathConfig {
                    interfaces: Interfaces::Only(vec![r.r_in.clone()]),
                    lookup: if config == Config::Ebpf {
                        Lookup::PrefixHash
                    } else {
                        Lookup::Lpm
                    },
                    ..FastPathConfig::default()
                },
            )?;
            fp.apply(&spec)?;
            Applied::Ebpf(m, fp)
        }
    })
}

fn remove_config(applied: Applied) -> anyhow::Result<()> {
    match applied {
        Applied::None => {}
        Applied::Nft(mut m) => m.teardown()?,
        Applied::Ebpf(mut m, fp) => {
            fp.teardown()?;
            m.teardown()?;
        }
    }
    Ok(())
}

/// Macro figures of one (size, config): ns per packet per round, delivery.
#[derive(Debug, Clone)]
pub(super) struct MacroRow {
    pub(super) size: usize,
    pub(super) config: Config,
    pub(super) per_packet: Vec<f64>,
    pub(super) delivered: f64,
}

/// Every configuration at every size, over the rounds.
pub(super) fn macro_bench(args: &Args) -> anyhow::Result<Vec<MacroRow>> {
    let rounds = args.rounds.unwrap_or(if args.quick { 2 } else { 5 }).max(1);
    let per_dst: u32 = if args.quick { 20_000 } else { 200_000 };
    let r = Router::new().context("building the router namespaces")?;
    let mut rows: Vec<MacroRow> = Vec::new();
    let pb = bar(
        rounds * MACRO_SIZES.len() * CONFIGS.len(),
        "macro (forwarding)",
    );
    // Warm-up: neighbour, route caches.
    let (_, delivered) = r.blast(&[Ipv4Addr::new(172, 16, 0, 1).into()], 2_000)?;
    anyhow::ensure!(
        delivered > 0.99,
        "the router forwarded only {:.1} % of the warm-up packets",
        delivered * 100.0
    );
    for round in 0..rounds {
        for &n in &MACRO_SIZES {
            let set = MarkingSpec {
                prefixes_v6: Vec::new(),
                ..routed_set(n)
            };
            let dsts: Vec<IpAddr> = [Probe::Host, Probe::Cidr, Probe::Miss]
                .iter()
                .filter_map(|p| probe_dst(n, false, *p))
                .collect();
            // Alternate the order each round so drift does not favour one config.
            let mut order = CONFIGS.to_vec();
            if round % 2 == 1 {
                order.reverse();
            }
            for config in order {
                let applied = apply_config(&r, config, &set)
                    .with_context(|| format!("setting up {}", config.name()))?;
                let (ns, delivered) = r.blast(&dsts, per_dst)?;
                remove_config(applied)?;
                match rows.iter_mut().find(|x| x.size == n && x.config == config) {
                    Some(row) => {
                        row.per_packet.push(ns);
                        row.delivered = row.delivered.min(delivered);
                    }
                    None => rows.push(MacroRow {
                        size: n,
                        config,
                        per_packet: vec![ns],
                        delivered,
                    }),
                }
                pb.inc(1);
            }
        }
    }
    pb.finish_and_clear();
    drop(r.sender);
    drop(r.sink);
    Ok(rows)
}

/// A configuration under which the router forwarded no packet is broken (marking
/// must never drop); fewer than all is a figure, shown in the report.
pub(super) fn judge(sanity: &mut Sanity, rows: &[MacroRow]) {
    for row in rows {
        sanity.require(row.delivered > 0.0, || {
            format!(
                "forwarding with {} marking over {} prefixes: no packet delivered",
                row.config.name(),
                row.size
            )
        });
    }
}

/// Overhead of each round against the same round's no-marking figure.
pub(super) fn overheads(rows: &[MacroRow], row: &MacroRow) -> Vec<f64> {
    let base = rows
        .iter()
        .find(|r| r.size == row.size && r.config == Config::None);
    match base {
        Some(b) => row
            .per_packet
            .iter()
            .zip(&b.per_packet)
            .map(|(x, y)| x - y)
            .collect(),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configuration_that_delivered_nothing_is_broken_a_lossy_one_is_not() {
        let row = |config, delivered| MacroRow {
            size: 1000,
            config,
            per_packet: vec![900.0],
            delivered,
        };
        let mut s = Sanity::new("marking");
        judge(&mut s, &[row(Config::None, 1.0), row(Config::Ebpf, 0.2)]);
        assert!(s.problems().is_empty());
        judge(&mut s, &[row(Config::NftSplit, 0.0)]);
        assert_eq!(s.problems().len(), 1);
        assert!(s.problems()[0].ends_with("over 1000 prefixes: no packet delivered"));
    }
}
