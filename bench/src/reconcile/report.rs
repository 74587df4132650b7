//! The report: one row per figure with its target judged, and the growth of a
//! one-peer change from the smallest to the largest size.

use std::time::Duration;

use wirespan_control::config::kubespan::FastPath;

use super::{fast_path_name, SizeFigures};

fn median(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

fn p99(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[(v.len() * 99).div_ceil(100).saturating_sub(1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// Prints the table of `figures`, measured for `fast_paths`.
pub(super) fn print(figures: &[SizeFigures], fast_paths: &[FastPath]) {
    println!();
    println!(
        "{:<60} {:>14}   {:<9} result",
        "metric", "measured", "target"
    );
    let mut missed = 0;
    let mut row = |name: String, measured: String, target: &str, ok: Option<bool>| {
        let res = match ok {
            Some(true) => "ok",
            Some(false) => {
                missed += 1;
                "MISSED"
            }
            None => "",
        };
        println!("{name:<60} {measured:>14}   {target:<9} {res}");
    };
    for f in figures {
        let fp = fast_path_name(f.fast_path);
        let (target, ok) = match f.n {
            1_000 => ("< 2 s", Some(f.from_empty < Duration::from_secs(2))),
            10_000 => ("< 20 s", Some(f.from_empty < Duration::from_secs(20))),
            _ => ("—", None),
        };
        row(
            format!("{fp} N={}: all arrive → WG peers + marking set", f.n),
            ms(f.from_empty),
            target,
            ok,
        );
        row(
            format!("{fp} N={}: then link, address, routes, rules", f.n),
            ms(f.routing),
            "—",
            None,
        );
        let med = median(&f.change);
        row(
            format!("{fp} N={}: one-peer change, median", f.n),
            ms(med),
            "< 50 ms",
            Some(med < Duration::from_millis(50)),
        );
        // Issue 18's goal at 10,000 peers: the tail too, not only the median.
        let (target, ok) = match f.n {
            10_000 => ("< 10 ms", Some(p99(&f.change) < Duration::from_millis(10))),
            _ => ("—", None),
        };
        row(
            format!("{fp} N={}: one-peer change, p99", f.n),
            ms(p99(&f.change)),
            target,
            ok,
        );
        row(
            format!("{fp} N={}: of which WG apply / marking apply", f.n),
            format!(
                "{} / {}",
                ms(median(&f.change_wg)),
                ms(median(&f.change_nft))
            ),
            "—",
            None,
        );
    }
    for &fast_path in fast_paths {
        let of: Vec<&SizeFigures> = figures
            .iter()
            .filter(|f| f.fast_path == fast_path)
            .collect();
        let (Some(a), Some(b)) = (of.first(), of.last()) else {
            continue;
        };
        if b.n <= a.n {
            continue;
        }
        let fp = fast_path_name(fast_path);
        let ratio = median(&b.change).as_secs_f64() / median(&a.change).as_secs_f64().max(1e-9);
        // Flat commits (issue 18): both fast paths, now that the nftables sets are
        // hash sets per prefix length.
        row(
            format!("{fp}: one-peer change N={} / N={}", b.n, a.n),
            format!("{ratio:.2}×"),
            "≤ 1.5×",
            Some(ratio <= 1.5),
        );
        let without = |f: &SizeFigures| median(&f.change).saturating_sub(median(&f.change_nft));
        let ratio = without(b).as_secs_f64() / without(a).as_secs_f64().max(1e-9);
        row(
            format!("{fp}: same without the marking apply N={} / N={}", b.n, a.n),
            format!("{ratio:.2}×"),
            "≤ 2×",
            Some(ratio <= 2.0),
        );
    }
    if missed > 0 {
        println!("\n{missed} target(s) missed");
    }
}
