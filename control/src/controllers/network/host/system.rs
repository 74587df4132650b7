//! The host edges besides files: where the files are ([`HostPaths`], all under one
//! root so tests use a temp dir), and the kernel's host name and the services that
//! must re-read their config ([`HostSystem`]).

use std::{
    io,
    path::{Path, PathBuf},
    process::Command,
};

/// Every host path the host controllers read or write, under `root` (`/` on a node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPaths {
    /// The root the paths are under.
    pub root: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        Self {
            root: PathBuf::from("/"),
        }
    }
}

impl HostPaths {
    /// Paths under `root`.
    #[must_use]
    pub fn under(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// `path` (absolute, as on the host) under the root.
    #[must_use]
    pub fn at(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    /// `/etc/hostname`.
    #[must_use]
    pub fn etc_hostname(&self) -> PathBuf {
        self.at("/etc/hostname")
    }

    /// Where the kernel host name from before the first change is kept: under `/run`,
    /// which lives exactly as long as the kernel's host name (until reboot).
    #[must_use]
    pub fn original_kernel_hostname(&self) -> PathBuf {
        self.at("/run/wirespan/kernel-hostname.wirespan-orig")
    }

    /// `/etc/resolv.conf`.
    #[must_use]
    pub fn resolv_conf(&self) -> PathBuf {
        self.at("/etc/resolv.conf")
    }

    /// systemd-resolved's varlink socket: present while resolved runs.
    #[must_use]
    pub fn resolved_socket(&self) -> PathBuf {
        self.at("/run/systemd/resolve/io.systemd.Resolve")
    }

    /// The upstream servers systemd-resolved uses, as a resolv.conf.
    #[must_use]
    pub fn resolved_upstream(&self) -> PathBuf {
        self.at("/run/systemd/resolve/resolv.conf")
    }

    /// systemd-resolved's main config.
    #[must_use]
    pub fn resolved_conf(&self) -> PathBuf {
        self.at("/etc/systemd/resolved.conf")
    }

    /// wirespan's systemd-resolved drop-in.
    #[must_use]
    pub fn resolved_dropin(&self) -> PathBuf {
        self.at("/etc/systemd/resolved.conf.d/wirespan.conf")
    }

    /// systemd-timesyncd's main config (present when timesyncd is installed).
    #[must_use]
    pub fn timesyncd_conf(&self) -> PathBuf {
        self.at("/etc/systemd/timesyncd.conf")
    }

    /// systemd-timesyncd's drop-in dir.
    #[must_use]
    pub fn timesyncd_dropins(&self) -> PathBuf {
        self.at("/etc/systemd/timesyncd.conf.d")
    }

    /// wirespan's systemd-timesyncd drop-in.
    #[must_use]
    pub fn timesyncd_dropin(&self) -> PathBuf {
        self.timesyncd_dropins().join("wirespan.conf")
    }

    /// chrony's config dir (present when chrony is installed, Debian layout).
    #[must_use]
    pub fn chrony_dir(&self) -> PathBuf {
        self.at("/etc/chrony")
    }

    /// chrony's main config.
    #[must_use]
    pub fn chrony_conf(&self) -> PathBuf {
        self.at("/etc/chrony/chrony.conf")
    }

    /// wirespan's chrony sources file (read through `sourcedir /etc/chrony/sources.d`).
    #[must_use]
    pub fn chrony_sources(&self) -> PathBuf {
        self.at("/etc/chrony/sources.d/wirespan.sources")
    }

    /// A path from inside a config file (absolute on the host) under the root.
    #[must_use]
    pub fn host_path(&self, p: &Path) -> PathBuf {
        self.at(&p.to_string_lossy())
    }
}

/// A service that must re-read its config after wirespan changed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// systemd-resolved (`systemctl try-reload-or-restart systemd-resolved`).
    Resolved,
    /// systemd-timesyncd (`systemctl try-restart systemd-timesyncd`).
    Timesyncd,
    /// chrony (`chronyc reload sources`).
    Chrony,
}

/// The kernel's host name and the services.
pub trait HostSystem: Send + Sync {
    /// The host and domain name of the caller's UTS namespace (`uname`; a domain of
    /// `(none)` is empty).
    ///
    /// # Errors
    /// `uname` failed.
    fn names(&self) -> io::Result<(String, String)>;
    /// `sethostname`.
    ///
    /// # Errors
    /// The syscall failed.
    fn set_hostname(&self, name: &str) -> io::Result<()>;
    /// `setdomainname`.
    ///
    /// # Errors
    /// The syscall failed.
    fn set_domainname(&self, name: &str) -> io::Result<()>;
    /// Makes `service` re-read its config.
    ///
    /// # Errors
    /// The command could not run or failed.
    fn reload(&self, service: Service) -> io::Result<()>;
}

/// [`HostSystem`] of the process: the host name of its UTS namespace, `systemctl` and
/// `chronyc`.
///
/// The names are read and written through `/proc/sys/kernel/{hostname,domainname}`,
/// which are the `uname`/`sethostname`/`setdomainname` values of the UTS namespace of
/// the thread that opens them (the same kernel strings, without unsafe code).
#[derive(Debug, Default, Clone, Copy)]
pub struct RealSystem;

const PROC_HOSTNAME: &str = "/proc/sys/kernel/hostname";
const PROC_DOMAINNAME: &str = "/proc/sys/kernel/domainname";

fn read_name(path: &str) -> io::Result<String> {
    let s = std::fs::read_to_string(path)?;
    let s = s.trim();
    Ok(if s == "(none)" {
        String::new()
    } else {
        s.to_owned()
    })
}

impl HostSystem for RealSystem {
    fn names(&self) -> io::Result<(String, String)> {
        Ok((read_name(PROC_HOSTNAME)?, read_name(PROC_DOMAINNAME)?))
    }

    fn set_hostname(&self, name: &str) -> io::Result<()> {
        std::fs::write(PROC_HOSTNAME, name)
    }

    fn set_domainname(&self, name: &str) -> io::Result<()> {
        // No domain is the kernel's initial value, the string "(none)".
        let v = if name.is_empty() { "(none)" } else { name };
        std::fs::write(PROC_DOMAINNAME, v)
    }

    fn reload(&self, service: Service) -> io::Result<()> {
        let (prog, args): (&str, &[&str]) = match service {
            Service::Resolved => (
                "systemctl",
                &["try-reload-or-restart", "systemd-resolved.service"],
            ),
            Service::Timesyncd => ("systemctl", &["try-restart", "systemd-timesyncd.service"]),
            Service::Chrony => ("chronyc", &["reload", "sources"]),
        };
        let out = Command::new(prog).args(args).output()?;
        if out.status.success() {
            Ok(())
        } else {
            Err(io::Error::other(format!(
                "{prog} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            )))
        }
    }
}
