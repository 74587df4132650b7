//! Kernel parameters (`/proc/sys`) the mesh needs on its link, behind [`Sysctl`].
//!
//! Only reverse-path filtering for now: WireGuard hands the kernel decrypted packets
//! whose source (a peer's pod or node address) is routed through the mesh only for
//! marked traffic, so a strict filter (`rp_filter = 1`, the default of many
//! distributions) drops them. The mesh makes it loose (`2`) on its link while it
//! runs ([`LooseRpFilter`]). The kernel applies the larger of `conf.all.rp_filter`
//! and the link's own value ([`effective_rp_filter`]), so the link's `2` is enough
//! whatever `all` says, and `all` is left alone.
//!
//! `/proc/sys/net` shows the network namespace of the thread that opens the file:
//! [`ProcSysctl`] opens it from a thread inside its [`Netns`].

use std::{fmt, io, path::PathBuf};

use crate::netns::Netns;

/// A sysctl failed.
#[derive(Debug, thiserror::Error)]
pub enum SysctlError {
    /// Reading or writing the file failed.
    #[error("cannot {op} sysctl {key}: {source}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The sysctl, dotted (`net.ipv4.conf.kubespan.rp_filter`).
        key: String,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// Reverse-path filtering could not be made loose on the mesh link.
    #[error(
        "cannot set {key}=2: reverse-path filtering must be loose on the mesh link, or the \
         kernel drops what peers send through it; set it by hand or allow the daemon to \
         write /proc/sys ({source})"
    )]
    RpFilter {
        /// The sysctl, dotted.
        key: String,
        /// Cause.
        #[source]
        source: Box<SysctlError>,
    },
}

/// Reads and writes kernel parameters, named by their path under `/proc/sys`
/// (`["net", "ipv4", "conf", "kubespan", "rp_filter"]`: an interface name may hold
/// dots, so the path is not a dotted string).
pub trait Sysctl: fmt::Debug {
    /// The value, trimmed.
    ///
    /// # Errors
    /// The parameter does not exist or cannot be read.
    fn read(&self, path: &[&str]) -> Result<String, SysctlError>;
    /// Sets the value.
    ///
    /// # Errors
    /// The parameter does not exist or cannot be written (read-only `/proc/sys`,
    /// missing capability).
    fn write(&self, path: &[&str], value: &str) -> Result<(), SysctlError>;
}

/// The dotted name of a sysctl path, as `sysctl(8)` shows it.
#[must_use]
pub fn dotted(path: &[&str]) -> String {
    path.join(".")
}

/// `/proc/sys` of a network namespace.
#[derive(Debug, Clone)]
pub struct ProcSysctl {
    netns: Netns,
}

impl ProcSysctl {
    /// Parameters of `netns` (network ones are per namespace).
    #[must_use]
    pub fn new(netns: Netns) -> Self {
        Self { netns }
    }

    fn in_netns<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> io::Result<T> + Send + 'static,
    ) -> io::Result<T> {
        if self.netns.name().is_none() {
            return f();
        }
        self.netns.block_on(move || async move { f() })?
    }
}

fn proc_path(path: &[&str]) -> PathBuf {
    let mut p = PathBuf::from("/proc/sys");
    p.extend(path);
    p
}

impl Sysctl for ProcSysctl {
    fn read(&self, path: &[&str]) -> Result<String, SysctlError> {
        let file = proc_path(path);
        self.in_netns(move || std::fs::read_to_string(file))
            .map(|s| s.trim().to_owned())
            .map_err(|source| SysctlError::Io {
                op: "read",
                key: dotted(path),
                source,
            })
    }

    fn write(&self, path: &[&str], value: &str) -> Result<(), SysctlError> {
        let (file, value) = (proc_path(path), value.to_owned());
        self.in_netns(move || std::fs::write(file, value))
            .map_err(|source| SysctlError::Io {
                op: "write",
                key: dotted(path),
                source,
            })
    }
}

/// `rp_filter`: off.
pub const RP_FILTER_OFF: u8 = 0;
/// `rp_filter`: strict (the source must be routed back through the same interface).
pub const RP_FILTER_STRICT: u8 = 1;
/// `rp_filter`: loose (the source must be routable through some interface).
pub const RP_FILTER_LOOSE: u8 = 2;

/// The filtering the kernel applies on an interface: the larger of
/// `net.ipv4.conf.all.rp_filter` and the interface's own value.
#[must_use]
pub fn effective_rp_filter(all: u8, iface: u8) -> u8 {
    all.max(iface)
}

fn rp_filter_path(link: &str) -> [&str; 5] {
    ["net", "ipv4", "conf", link, "rp_filter"]
}

/// Loose reverse-path filtering on the mesh link, and the value it replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LooseRpFilter {
    link: String,
    /// The link's value before, when this changed it.
    previous: Option<String>,
}

impl LooseRpFilter {
    /// Makes filtering on `link` loose (`2`), remembering the value it replaces.
    ///
    /// # Errors
    /// [`SysctlError::RpFilter`], naming the sysctl, when it cannot be read or set.
    pub fn apply(sysctl: &dyn Sysctl, link: &str) -> Result<Self, SysctlError> {
        let mut me = Self {
            link: link.to_owned(),
            previous: None,
        };
        me.ensure(sysctl)?;
        Ok(me)
    }

    /// Sets it loose again if something changed it since (drift); the value first
    /// replaced is the one restored.
    ///
    /// # Errors
    /// As [`LooseRpFilter::apply`].
    pub fn ensure(&mut self, sysctl: &dyn Sysctl) -> Result<bool, SysctlError> {
        let path = rp_filter_path(&self.link);
        let wrap = |source| SysctlError::RpFilter {
            key: dotted(&path),
            source: Box::new(source),
        };
        let now = sysctl.read(&path).map_err(wrap)?;
        if now == RP_FILTER_LOOSE.to_string() {
            return Ok(false);
        }
        sysctl
            .write(&path, &RP_FILTER_LOOSE.to_string())
            .map_err(wrap)?;
        self.previous.get_or_insert(now);
        Ok(true)
    }

    /// The value replaced, if any.
    #[must_use]
    pub fn previous(&self) -> Option<&str> {
        self.previous.as_deref()
    }

    /// Puts the replaced value back (nothing when the link already had `2`, or is
    /// gone).
    ///
    /// # Errors
    /// The write failed.
    pub fn restore(self, sysctl: &dyn Sysctl) -> Result<(), SysctlError> {
        let Some(previous) = self.previous else {
            return Ok(());
        };
        let path = rp_filter_path(&self.link);
        if sysctl.read(&path).is_err() {
            // The link went with its settings.
            return Ok(());
        }
        sysctl.write(&path, &previous)
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeMap, sync::Mutex};

    use super::*;

    #[derive(Debug, Default)]
    struct Map(Mutex<BTreeMap<String, String>>, bool);

    impl Sysctl for Map {
        fn read(&self, path: &[&str]) -> Result<String, SysctlError> {
            self.0
                .lock()
                .unwrap()
                .get(&dotted(path))
                .cloned()
                .ok_or_else(|| SysctlError::Io {
                    op: "read",
                    key: dotted(path),
                    source: io::ErrorKind::NotFound.into(),
                })
        }

        fn write(&self, path: &[&str], value: &str) -> Result<(), SysctlError> {
            if self.1 {
                return Err(SysctlError::Io {
                    op: "write",
                    key: dotted(path),
                    source: io::ErrorKind::PermissionDenied.into(),
                });
            }
            self.0.lock().unwrap().insert(dotted(path), value.to_owned());
            Ok(())
        }
    }

    #[test]
    fn the_kernel_applies_the_larger_of_all_and_the_interface() {
        assert_eq!(effective_rp_filter(RP_FILTER_STRICT, RP_FILTER_LOOSE), RP_FILTER_LOOSE);
        assert_eq!(effective_rp_filter(RP_FILTER_OFF, RP_FILTER_STRICT), RP_FILTER_STRICT);
        assert_eq!(effective_rp_filter(RP_FILTER_LOOSE, RP_FILTER_OFF), RP_FILTER_LOOSE);
    }

    #[test]
    fn loose_while_applied_and_the_previous_value_back_after() {
        let m = Map::default();
        let key = "net.ipv4.conf.ks.0.rp_filter";
        m.0.lock().unwrap().insert(key.into(), "1".into());
        let mut rp = LooseRpFilter::apply(&m, "ks.0").unwrap();
        assert_eq!(m.read(&rp_filter_path("ks.0")).unwrap(), "2");
        assert_eq!(rp.previous(), Some("1"));
        // Drift: set strict from outside, repaired; the first value is still the one
        // restored.
        m.0.lock().unwrap().insert(key.into(), "0".into());
        assert!(rp.ensure(&m).unwrap());
        assert!(!rp.ensure(&m).unwrap());
        rp.restore(&m).unwrap();
        assert_eq!(m.0.lock().unwrap()[key], "1");
        // Already loose: nothing written, nothing restored.
        m.0.lock().unwrap().insert(key.into(), "2".into());
        let rp = LooseRpFilter::apply(&m, "ks.0").unwrap();
        assert_eq!(rp.previous(), None);
    }

    #[test]
    fn a_refused_write_names_the_sysctl() {
        let m = Map(Mutex::default(), true);
        m.0.lock()
            .unwrap()
            .insert("net.ipv4.conf.kubespan.rp_filter".into(), "1".into());
        let e = LooseRpFilter::apply(&m, "kubespan").unwrap_err().to_string();
        assert!(e.contains("net.ipv4.conf.kubespan.rp_filter=2"), "{e}");
        assert!(e.contains("loose"), "{e}");
        assert!(e.contains("permission denied"), "{e}");
    }
}
