//! Results that show broken code rather than a slow machine: nothing delivered, a
//! storm that never converges, a no-op that wrote. Every run judges them, `--quick`
//! included, and fails naming each one; the figures themselves stay unjudged (a
//! missed target is printed, never an error).
//!
//! Each benchmark gathers its checks in a [`Sanity`] from plain functions of its
//! results (unit-tested next to them) and calls [`Sanity::into_result`] after printing
//! its report, so the figures of a broken run are still there to read.

/// What a benchmark's results showed to be broken.
#[derive(Debug, thiserror::Error)]
#[error("bench {bench}: the results show broken code, not a slow machine: {}", .problems.join("; "))]
pub struct Broken {
    /// The benchmark (`runtime`, `discovery`, …).
    pub bench: &'static str,
    /// One sentence per failed check.
    pub problems: Vec<String>,
}

/// The sanity checks of one benchmark run.
#[derive(Debug)]
pub struct Sanity {
    bench: &'static str,
    problems: Vec<String>,
}

impl Sanity {
    /// No check failed yet.
    #[must_use]
    pub fn new(bench: &'static str) -> Self {
        Self {
            bench,
            problems: Vec::new(),
        }
    }

    /// Records `problem` unless `ok`.
    pub fn require(&mut self, ok: bool, problem: impl FnOnce() -> String) {
        if !ok {
            self.problems.push(problem());
        }
    }

    /// Records a rate that is not a positive number (nothing completed in the window).
    pub fn positive_rate(&mut self, what: &str, per_sec: f64) {
        self.require(per_sec.is_finite() && per_sec > 0.0, || {
            format!("{what}: {per_sec} per second (nothing completed)")
        });
    }

    /// The problems found so far.
    #[must_use]
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    /// `Ok` when every check passed.
    ///
    /// # Errors
    /// [`Broken`] listing every failed check.
    pub fn into_result(self) -> Result<(), Broken> {
        if self.problems.is_empty() {
            Ok(())
        } else {
            Err(Broken {
                bench: self.bench,
                problems: self.problems,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failed_check_is_named_and_passing_ones_are_not() {
        let mut s = Sanity::new("runtime");
        s.require(true, || "never".into());
        s.positive_rate("updates", 12.0);
        assert!(s.problems().is_empty());
        s.positive_rate("no-op modifies", 0.0);
        s.positive_rate("chain", f64::NAN);
        s.require(false, || "a no-op wrote".into());
        let e = s.into_result().unwrap_err().to_string();
        assert!(
            e.starts_with("bench runtime: the results show broken code"),
            "{e}"
        );
        for part in [
            "no-op modifies: 0 per second",
            "chain: NaN",
            "a no-op wrote",
        ] {
            assert!(e.contains(part), "{e}");
        }
        assert!(!e.contains("never") && !e.contains("updates"), "{e}");
    }
}
