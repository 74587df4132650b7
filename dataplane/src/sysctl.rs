//! Kernel parameters (`/proc/sys`) the mesh needs on its link, behind [`Sysctl`].
//!
//! Only reverse-path filtering for now. The mesh link carries no IPv4 address (only
//! the KubeSpan ULA), and WireGuard hands the kernel decrypted packets from peers'
//! IPv4 node and pod addresses, which the main table routes through other links (the
//! mesh routes only marked traffic). For such a packet the kernel's check fails in
//! both modes: strict (`1`) because the source is routed elsewhere, loose (`2`)
//! because an interface without an IPv4 address accepts only sources routed through
//! itself. So filtering must be off (`0`) on the mesh link: [`MeshRpFilter`] sets
//! it while the mesh runs (systemd hosts give every new link `2` through
//! `net.ipv4.conf.default.rp_filter`) and restores the value it replaced. The kernel
//! applies the larger of `net.ipv4.conf.all.rp_filter` and the link's own value
//! ([`effective_rp_filter`]): a non-zero `all` is host-wide policy the daemon does not
//! change; it refuses, naming that sysctl.
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
    /// Reverse-path filtering could not be turned off on the mesh link.
    #[error(
        "cannot set {key}=0: reverse-path filtering must be off on the mesh link (it has no \
         IPv4 address, so the kernel would drop what peers send over IPv4); set it by hand \
         or let the daemon write /proc/sys ({source})"
    )]
    RpFilter {
        /// The sysctl, dotted.
        key: String,
        /// Cause.
        #[source]
        source: Box<SysctlError>,
    },
    /// Host-wide reverse-path filtering is on, which the mesh link cannot override.
    #[error(
        "net.ipv4.conf.all.rp_filter is {value}: the kernel filters the mesh link with the \
         larger of that and the link's own value, and with the link carrying no IPv4 \
         address any filtering drops what peers send over IPv4; set \
         net.ipv4.conf.all.rp_filter=0 (the daemon turns it off on the mesh link itself)"
    )]
    RpFilterAll {
        /// The value found.
        value: String,
    },
    /// A path component that would leave the parameter's directory (`..`, `.`, empty,
    /// or holding a `/`): never a parameter or an interface name.
    #[error("invalid sysctl path {key}: component {component:?} is not a name")]
    InvalidPath {
        /// The path, dotted.
        key: String,
        /// The offending component.
        component: String,
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

/// Refuses a path whose components are not plain names: `["net", "ipv4", "conf",
/// "..", ...]` would otherwise reach another parameter, and an interface name can be
/// none of these (the kernel refuses them as link names).
///
/// # Errors
/// [`SysctlError::InvalidPath`] naming the first bad component.
pub fn check_path(path: &[&str]) -> Result<(), SysctlError> {
    let bad = |c: &&&str| c.is_empty() || **c == "." || **c == ".." || c.contains('/');
    match path.iter().find(bad) {
        Some(c) => Err(SysctlError::InvalidPath {
            key: dotted(path),
            component: (*c).to_owned(),
        }),
        None if path.is_empty() => Err(SysctlError::InvalidPath {
            key: String::new(),
            component: String::new(),
        }),
        None => Ok(()),
    }
}

fn proc_path(path: &[&str]) -> Result<PathBuf, SysctlError> {
    check_path(path)?;
    let mut p = PathBuf::from("/proc/sys");
    p.extend(path);
    Ok(p)
}

impl Sysctl for ProcSysctl {
    fn read(&self, path: &[&str]) -> Result<String, SysctlError> {
        let file = proc_path(path)?;
        self.in_netns(move || std::fs::read_to_string(file))
            .map(|s| s.trim().to_owned())
            .map_err(|source| SysctlError::Io {
                op: "read",
                key: dotted(path),
                source,
            })
    }

    fn write(&self, path: &[&str], value: &str) -> Result<(), SysctlError> {
        let (file, value) = (proc_path(path)?, value.to_owned());
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

/// Reverse-path filtering off on the mesh link (see the module doc), and the value it
/// replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshRpFilter {
    link: String,
    /// The link's value before, when this changed it.
    previous: Option<String>,
}

impl MeshRpFilter {
    /// Turns filtering off on `link`, remembering the value it replaces.
    ///
    /// # Errors
    /// [`SysctlError::RpFilterAll`] when `net.ipv4.conf.all.rp_filter` is not 0;
    /// [`SysctlError::RpFilter`], naming the link's sysctl, when it cannot be read or
    /// set.
    pub fn apply(sysctl: &dyn Sysctl, link: &str) -> Result<Self, SysctlError> {
        let mut me = Self {
            link: link.to_owned(),
            previous: None,
        };
        me.ensure(sysctl)?;
        Ok(me)
    }

    /// Checks again (drift): `all` still 0, the link's value still 0 (set again if
    /// not; the value first replaced stays the one restored). Returns whether it
    /// wrote.
    ///
    /// # Errors
    /// As [`MeshRpFilter::apply`].
    pub fn ensure(&mut self, sysctl: &dyn Sysctl) -> Result<bool, SysctlError> {
        let all = sysctl.read(&rp_filter_path("all"))?;
        if all != RP_FILTER_OFF.to_string() {
            return Err(SysctlError::RpFilterAll { value: all });
        }
        let path = rp_filter_path(&self.link);
        let wrap = |source| SysctlError::RpFilter {
            key: dotted(&path),
            source: Box::new(source),
        };
        let now = sysctl.read(&path).map_err(wrap)?;
        if now == RP_FILTER_OFF.to_string() {
            return Ok(false);
        }
        sysctl
            .write(&path, &RP_FILTER_OFF.to_string())
            .map_err(wrap)?;
        self.previous.get_or_insert(now);
        Ok(true)
    }

    /// The value replaced, if any.
    #[must_use]
    pub fn previous(&self) -> Option<&str> {
        self.previous.as_deref()
    }

    /// Puts the replaced value back (nothing when the link already had `0`, or is
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
            self.0
                .lock()
                .unwrap()
                .insert(dotted(path), value.to_owned());
            Ok(())
        }
    }

    #[test]
    fn the_kernel_applies_the_larger_of_all_and_the_interface() {
        assert_eq!(
            effective_rp_filter(RP_FILTER_STRICT, RP_FILTER_OFF),
            RP_FILTER_STRICT
        );
        assert_eq!(
            effective_rp_filter(RP_FILTER_OFF, RP_FILTER_LOOSE),
            RP_FILTER_LOOSE
        );
        assert_eq!(
            effective_rp_filter(RP_FILTER_OFF, RP_FILTER_OFF),
            RP_FILTER_OFF
        );
    }

    fn host(all: &str, link: &str) -> Map {
        let m = Map::default();
        m.0.lock()
            .unwrap()
            .insert("net.ipv4.conf.all.rp_filter".into(), all.into());
        m.0.lock()
            .unwrap()
            .insert("net.ipv4.conf.ks.0.rp_filter".into(), link.into());
        m
    }

    #[test]
    fn off_on_the_link_while_applied_and_the_previous_value_back_after() {
        let key = "net.ipv4.conf.ks.0.rp_filter";
        // systemd's default for new links: loose.
        let m = host("0", "2");
        let mut rp = MeshRpFilter::apply(&m, "ks.0").unwrap();
        assert_eq!(m.0.lock().unwrap()[key], "0");
        assert_eq!(rp.previous(), Some("2"));
        // Drift: set from outside, repaired; the first value is still the one restored.
        m.0.lock().unwrap().insert(key.into(), "1".into());
        assert!(rp.ensure(&m).unwrap());
        assert!(!rp.ensure(&m).unwrap());
        rp.restore(&m).unwrap();
        assert_eq!(m.0.lock().unwrap()[key], "2");
        // Already off: nothing written, nothing restored.
        let rp = MeshRpFilter::apply(&host("0", "0"), "ks.0").unwrap();
        assert_eq!(rp.previous(), None);
    }

    #[test]
    fn host_wide_filtering_is_refused_naming_the_sysctl_and_left_alone() {
        for all in ["1", "2"] {
            let m = host(all, "2");
            let e = MeshRpFilter::apply(&m, "ks.0").unwrap_err().to_string();
            assert!(
                e.contains(&format!("net.ipv4.conf.all.rp_filter is {all}")),
                "{e}"
            );
            assert_eq!(m.0.lock().unwrap()["net.ipv4.conf.all.rp_filter"], all);
            assert_eq!(m.0.lock().unwrap()["net.ipv4.conf.ks.0.rp_filter"], "2");
        }
    }

    #[test]
    fn a_refused_write_names_the_sysctl() {
        let m = host("0", "1");
        m.0.lock()
            .unwrap()
            .insert("net.ipv4.conf.kubespan.rp_filter".into(), "1".into());
        let m = Map(Mutex::new(m.0.into_inner().unwrap()), true);
        let e = MeshRpFilter::apply(&m, "kubespan").unwrap_err().to_string();
        assert!(e.contains("net.ipv4.conf.kubespan.rp_filter=0"), "{e}");
        assert!(e.contains("permission denied"), "{e}");
    }
}
