//! The runner: one scenario, two sides, compared after every step.

use std::fmt::{Debug, Write as _};

use ipnet::IpNet;
use wirespan_dataplane::Invalid;

/// One step of a scenario: a name for the failure message and the calls it makes on
/// a side, returning what the calls returned (as text, errors normalised).
pub(crate) struct Step<S: ?Sized> {
    name: &'static str,
    run: Box<StepFn<S>>,
}

type StepFn<S> = dyn Fn(&mut S) -> Vec<String>;

pub(crate) fn step<S: ?Sized>(
    name: &'static str,
    run: impl Fn(&mut S) -> Vec<String> + 'static,
) -> Step<S> {
    Step {
        name,
        run: Box::new(run),
    }
}

/// What a step returned and what the side reports afterwards.
#[derive(Debug, PartialEq)]
struct Outcome<V> {
    returned: Vec<String>,
    reported: V,
}

/// Runs `steps` on both sides in turn and fails at the first step after which they
/// differ. `report` reads a side (through the adapter and behind its back).
pub(crate) fn run_parity<S: ?Sized, V: Debug + PartialEq>(
    steps: &[Step<S>],
    fake: &mut S,
    real: &mut S,
    report: impl Fn(&mut S) -> V,
) {
    for (i, s) in steps.iter().enumerate() {
        let fake_out = Outcome {
            returned: (s.run)(fake),
            reported: report(fake),
        };
        let real_out = Outcome {
            returned: (s.run)(real),
            reported: report(real),
        };
        assert!(
            fake_out == real_out,
            "step {} `{}`: the fake and the real adapter differ (- fake, + real):\n{}",
            i + 1,
            s.name,
            line_diff(&format!("{fake_out:#?}"), &format!("{real_out:#?}"))
        );
    }
}

/// A line diff (longest common subsequence) of two pretty-printed values, with a few
/// lines of context around each change.
fn line_diff(a: &str, b: &str) -> String {
    let (a, b): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let mut lcs = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i][j] = if a[i] == b[j] {
                lcs[i + 1][j + 1] + 1
            } else {
                lcs[i + 1][j].max(lcs[i][j + 1])
            };
        }
    }
    let mut lines: Vec<(char, &str)> = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            lines.push((' ', a[i]));
            i += 1;
            j += 1;
        } else if j < b.len() && (i == a.len() || lcs[i][j + 1] >= lcs[i + 1][j]) {
            lines.push(('+', b[j]));
            j += 1;
        } else {
            lines.push(('-', a[i]));
            i += 1;
        }
    }
    const CONTEXT: usize = 4;
    let near = |k: usize| {
        lines[k.saturating_sub(CONTEXT)..(k + CONTEXT + 1).min(lines.len())]
            .iter()
            .any(|(c, _)| *c != ' ')
    };
    let mut out = String::new();
    let mut skipped = false;
    for (k, (c, l)) in lines.iter().enumerate() {
        if near(k) {
            let _ = writeln!(out, "{c} {l}");
            skipped = false;
        } else if !skipped {
            out.push_str("  ...\n");
            skipped = true;
        }
    }
    out
}

/// A call's result as text. Errors become their kind and, for invalid input, the
/// field: the prose of the problem is free to differ.
pub(crate) fn ret<T: Debug, E>(r: Result<T, E>, err: impl Fn(&E) -> String) -> String {
    match r {
        Ok(v) => format!("Ok({v:?})"),
        Err(e) => format!("Err({})", err(&e)),
    }
}

pub(crate) fn invalid(e: &Invalid) -> String {
    format!("Invalid({})", e.field)
}

pub(crate) fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

pub(crate) fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}
