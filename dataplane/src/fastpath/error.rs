//! [`FastPathError`], and the helpers that tell a kernel without BPF or tc support
//! ([`FastPathError::Unsupported`]: fall back to nftables) from a real failure.

use std::{error::Error as StdError, io};

use aya::{maps::MapError, programs::ProgramError};

use crate::error::Invalid;

/// Errors of the fast path.
#[derive(Debug, thiserror::Error)]
pub enum FastPathError {
    /// The desired state is invalid; nothing was written.
    #[error("invalid marking spec: {0}")]
    Invalid(#[from] Invalid),
    /// The kernel cannot run the fast path (no bpf syscall, BPF not permitted, program
    /// or map type unknown, verifier refused, no tc/tcx hook). Mark with nftables
    /// instead.
    #[error("the kernel cannot run the eBPF fast path: {what}: {source}")]
    Unsupported {
        /// What failed.
        what: String,
        /// Why.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// More prefixes than a map holds; nothing was written.
    #[error("{map}: {needed} entries needed, capacity {capacity} (raise max_prefixes)")]
    Capacity {
        /// The map.
        map: &'static str,
        /// Entries the spec needs.
        needed: usize,
        /// Its capacity.
        capacity: u32,
    },
    /// Attaching to an interface failed for a reason other than missing support.
    #[error("attaching the classifier to {interface}: {source}")]
    Attach {
        /// The interface.
        interface: String,
        /// Why.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// A map operation failed; the next apply retries from the last good state.
    #[error("map {map}: {source}")]
    Map {
        /// The map.
        map: &'static str,
        /// Why.
        #[source]
        source: MapError,
    },
    /// The object lacks something the loader expects (a build mismatch).
    #[error("BPF object: {0}")]
    Object(String),
    /// `BPF_PROG_TEST_RUN` refused a run (for example an IP frame shorter than its
    /// header: the kernel checks that before running the program).
    #[error("BPF_PROG_TEST_RUN of {program}: {source}")]
    TestRun {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The namespace could not be entered or watched.
    #[error("network namespace: {0}")]
    Netns(#[source] io::Error),
    /// A delta was given before any spec was applied.
    #[error("a routed-set delta needs a spec applied first")]
    NotApplied,
}

impl FastPathError {
    /// Whether the kernel lacks BPF or tc support (fall back to nftables marking).
    #[must_use]
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Self::Unsupported { .. })
    }
}

/// Errnos that mean "this kernel cannot do it" rather than "something went wrong".
fn unsupported_errno(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ENOSYS
                | libc::EPERM
                | libc::EOPNOTSUPP
                | libc::EINVAL
                | libc::E2BIG
                | libc::EACCES
        )
    )
}

/// The first `io::Error` in an error's source chain.
pub(super) fn find_io<'a>(e: &'a (dyn StdError + 'static)) -> Option<&'a io::Error> {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            return Some(io);
        }
        cur = err.source();
    }
    None
}

pub(super) fn load_error(
    what: impl Into<String>,
    e: impl StdError + Send + Sync + 'static,
) -> FastPathError {
    FastPathError::Unsupported {
        what: what.into(),
        source: Box::new(e),
    }
}

pub(super) fn program_load_error(name: &str, e: ProgramError) -> FastPathError {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &e
    {
        let log = verifier_log.to_string();
        let tail: Vec<&str> = log.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return FastPathError::Unsupported {
            what: format!("loading program {name}"),
            source: format!("{io_error}; verifier: {}", tail.join(" | ")).into(),
        };
    }
    load_error(format!("loading program {name}"), e)
}

pub(super) fn attach_error(
    interface: &str,
    e: impl StdError + Send + Sync + 'static,
) -> FastPathError {
    if find_io(&e).is_some_and(unsupported_errno) {
        FastPathError::Unsupported {
            what: format!("attaching the tc classifier to {interface}"),
            source: Box::new(e),
        }
    } else {
        FastPathError::Attach {
            interface: interface.to_owned(),
            source: Box::new(e),
        }
    }
}
