//! The benchmarks' SVG charts: grouped horizontal bars with min..max whiskers.

use std::fmt::Write as _;

/// One bar: (label, median, min, max).
pub(crate) type Bar = (String, f64, f64, f64);
/// A titled group of bars.
pub(crate) type BarGroup = (String, Vec<Bar>);

/// A grouped horizontal bar chart titled `title`; bars whose label starts with
/// "eBPF" are green, the others brown.
pub(crate) fn svg(title: &str, groups: &[BarGroup]) -> String {
    let max = groups
        .iter()
        .flat_map(|(_, g)| g.iter().map(|(_, m, _, hi)| m.max(*hi)))
        .fold(1.0f64, f64::max);
    let (left, width, row_h) = (230.0, 460.0, 22.0);
    let rows: usize = groups.iter().map(|(_, g)| g.len() + 1).sum();
    let height = 50.0 + rows as f64 * row_h + 20.0;
    let x = |v: f64| left + (v.max(0.0) / max) * width;
    let mut s = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="10" y="20" font-size="14" font-weight="bold">{title}</text>
"##
    );
    let mut y = 40.0;
    for (group, g) in groups {
        let _ = writeln!(
            s,
            r#"<text x="10" y="{}" font-weight="bold">{group}</text>"#,
            y + 14.0
        );
        y += row_h;
        for (name, med, lo, hi) in g {
            let color = if name.starts_with("eBPF") {
                "#2b7a3d"
            } else {
                "#b5651d"
            };
            let _ = writeln!(
                s,
                r#"<text x="20" y="{ty}">{name}</text><rect x="{left}" y="{ry}" width="{w:.1}" height="14" fill="{color}"/><line x1="{x1:.1}" x2="{x2:.1}" y1="{ly}" y2="{ly}" stroke="black"/><text x="{tx:.1}" y="{ty}">{med:.0}</text>"#,
                ty = y + 12.0,
                ry = y + 1.0,
                w = x(*med) - left,
                x1 = x(*lo),
                x2 = x(*hi),
                ly = y + 8.0,
                tx = x(med.max(*hi)) + 6.0,
            );
            y += row_h;
        }
    }
    s.push_str("</svg>\n");
    s
}
