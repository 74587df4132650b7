//! Host name, resolvers and time servers (`docs/runtime.md` §4.8): merged
//! `network/{Hostname,Resolver,TimeServer}Spec` applied to the host the way its own
//! tools expect, and `HostnameStatus`, `ResolverStatus`, `TimeServerStatus` read back.
//!
//! Opt-in: the specs exist only when a document asks; without one nothing is written.
//! Every file goes through [`files::put`] / [`files::restore`] (never clobber a file
//! wirespan did not write), every path through [`HostPaths`], and the kernel and the
//! services through [`HostSystem`], so tests run against a temp root.

pub mod content;
pub mod files;
pub mod system;

use std::{io, marker::PhantomData, sync::Arc, time::Duration};

use futures::future::BoxFuture;
pub use system::{HostPaths, HostSystem, RealSystem, Service};

use self::files::{HostFiles, RealFiles};
use super::spec::{record_outcome, round_work, Op};
use crate::{
    resources::network::{
        HostnameSpec, HostnameSpecSpec, HostnameStatus, HostnameStatusSpec, ResolverSpec,
        ResolverSpecSpec, ResolverStatus, TimeServerSpec, TimeServerSpecSpec, TimeServerStatus,
        TimeServerStatusSpec, HOSTNAME, NS, RESOLVERS, TIME_SERVERS,
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, InputKind,
        Kind, Output, ResourceKind, Triggers,
    },
};

/// How often the statuses are re-read (no file or host name change events) and the
/// specs re-applied (repairs a file someone rewrote).
pub const REFRESH: Duration = Duration::from_secs(5);

/// What the host controllers act on.
#[derive(Clone)]
pub struct HostDeps {
    /// Where the files are.
    pub paths: HostPaths,
    /// The file edge.
    pub files: Arc<dyn HostFiles>,
    /// The host name and service edge.
    pub system: Arc<dyn HostSystem>,
}

impl std::fmt::Debug for HostDeps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDeps")
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

impl HostDeps {
    /// The process's own host: `/`, its UTS namespace, `systemctl`/`chronyc`.
    #[must_use]
    pub fn real() -> Self {
        Self::under(HostPaths::default())
    }

    /// Real files and host name, the files under `paths`.
    #[must_use]
    pub fn under(paths: HostPaths) -> Self {
        Self {
            paths,
            files: Arc::new(RealFiles),
            system: Arc::new(RealSystem),
        }
    }

    fn resolved_running(&self) -> bool {
        self.files.exists(&self.paths.resolved_socket())
    }

    /// The time service found on the host: chrony wins when both are installed (the
    /// packages conflict on Debian; chrony is the one that runs).
    fn time_service(&self) -> Option<Service> {
        if self.files.exists(&self.paths.chrony_dir()) {
            Some(Service::Chrony)
        } else if self.files.exists(&self.paths.timesyncd_conf()) {
            Some(Service::Timesyncd)
        } else {
            None
        }
    }

    fn text(&self, path: &std::path::Path) -> io::Result<Option<String>> {
        Ok(self
            .files
            .read(path)?
            .map(|b| String::from_utf8_lossy(&b).into_owned()))
    }
}

/// How one host spec type is applied and removed.
pub trait HostObject: ResourceKind {
    /// Controller name (also its finalizer).
    const CONTROLLER: &'static str;
    /// Converges the host; `Ok(false)` = nothing to do.
    ///
    /// # Errors
    /// A file or host name operation failed, or nothing on the host can take it.
    fn apply(host: &HostDeps, spec: &Self::Spec) -> io::Result<bool>;
    /// Puts back what was there before.
    ///
    /// # Errors
    /// A file or host name operation failed.
    fn remove(host: &HostDeps, spec: &Self::Spec) -> io::Result<bool>;
}

fn reload_if(host: &HostDeps, changed: bool, service: Service) -> io::Result<bool> {
    if changed {
        host.system.reload(service)?;
    }
    Ok(changed)
}

impl HostObject for HostnameSpec {
    const CONTROLLER: &'static str = "HostnameSpecController";

    fn apply(host: &HostDeps, s: &HostnameSpecSpec) -> io::Result<bool> {
        let (h, d) = host.system.names()?;
        let mut changed = false;
        if (h.as_str(), d.as_str()) != (s.hostname.as_str(), s.domainname.as_str()) {
            let kept = host.paths.original_kernel_hostname();
            if !host.files.exists(&kept) {
                host.files.write(&kept, format!("{h}\n{d}\n").as_bytes())?;
            }
            if h != s.hostname {
                host.system.set_hostname(&s.hostname)?;
            }
            if d != s.domainname {
                host.system.set_domainname(&s.domainname)?;
            }
            changed = true;
        }
        let etc = host.paths.etc_hostname();
        changed |= if s.write_etc_hostname {
            files::put(&*host.files, &etc, &content::etc_hostname(&s.hostname))?
        } else {
            // Switched off: the file goes back to what it was.
            files::restore(&*host.files, &etc)?
        };
        Ok(changed)
    }

    fn remove(host: &HostDeps, _s: &HostnameSpecSpec) -> io::Result<bool> {
        let kept = host.paths.original_kernel_hostname();
        let mut changed = false;
        if let Some(text) = host.text(&kept)? {
            let mut lines = text.lines();
            let (h, d) = (lines.next().unwrap_or(""), lines.next().unwrap_or(""));
            let (ch, cd) = host.system.names()?;
            if !h.is_empty() && ch != h {
                host.system.set_hostname(h)?;
                changed = true;
            }
            if cd != d {
                host.system.set_domainname(d)?;
                changed = true;
            }
            host.files.remove(&kept)?;
        }
        changed |= files::restore(&*host.files, &host.paths.etc_hostname())?;
        Ok(changed)
    }
}

impl HostObject for ResolverSpec {
    const CONTROLLER: &'static str = "ResolverSpecController";

    fn apply(host: &HostDeps, s: &ResolverSpecSpec) -> io::Result<bool> {
        let (p, f) = (&host.paths, &*host.files);
        if host.resolved_running() {
            let restored = files::restore(f, &p.resolv_conf())?;
            let changed = files::put(f, &p.resolved_dropin(), &content::resolved_dropin(s))?;
            Ok(reload_if(host, changed, Service::Resolved)? || restored)
        } else {
            let dropin = files::restore(f, &p.resolved_dropin())?;
            Ok(files::put(f, &p.resolv_conf(), &content::resolv_conf(s))? || dropin)
        }
    }

    fn remove(host: &HostDeps, _s: &ResolverSpecSpec) -> io::Result<bool> {
        let (p, f) = (&host.paths, &*host.files);
        let file = files::restore(f, &p.resolv_conf())?;
        let dropin = files::restore(f, &p.resolved_dropin())?;
        let reloaded = reload_if(host, dropin && host.resolved_running(), Service::Resolved)?;
        Ok(file || dropin || reloaded)
    }
}

impl HostObject for TimeServerSpec {
    const CONTROLLER: &'static str = "TimeServerSpecController";

    fn apply(host: &HostDeps, s: &TimeServerSpecSpec) -> io::Result<bool> {
        let (p, f) = (&host.paths, &*host.files);
        match host.time_service() {
            Some(Service::Chrony) => {
                let other = files::restore(f, &p.timesyncd_dropin())?;
                let changed =
                    files::put(f, &p.chrony_sources(), &content::chrony_sources(&s.ntp_servers))?;
                Ok(reload_if(host, changed, Service::Chrony)? || other)
            }
            Some(_) => {
                let other = files::restore(f, &p.chrony_sources())?;
                let changed = files::put(
                    f,
                    &p.timesyncd_dropin(),
                    &content::timesyncd_dropin(&s.ntp_servers),
                )?;
                Ok(reload_if(host, changed, Service::Timesyncd)? || other)
            }
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "no time service to configure: neither chrony ({}) nor systemd-timesyncd ({}) is installed",
                    p.chrony_dir().display(),
                    p.timesyncd_conf().display()
                ),
            )),
        }
    }

    fn remove(host: &HostDeps, _s: &TimeServerSpecSpec) -> io::Result<bool> {
        let (p, f) = (&host.paths, &*host.files);
        let chrony = files::restore(f, &p.chrony_sources())?;
        let timesyncd = files::restore(f, &p.timesyncd_dropin())?;
        let service = host.time_service();
        reload_if(
            host,
            chrony && service == Some(Service::Chrony),
            Service::Chrony,
        )?;
        reload_if(
            host,
            timesyncd && service == Some(Service::Timesyncd),
            Service::Timesyncd,
        )?;
        Ok(chrony || timesyncd)
    }
}

/// Applies `network/K` (Strong input, finalizer on each spec; no outputs). A spec
/// that cannot be applied keeps the reason in its `error` annotation and is retried
/// on the next change or refresh.
#[derive(Debug)]
pub struct HostSpecController<K> {
    host: HostDeps,
    _kind: PhantomData<fn() -> K>,
}

impl<K> HostSpecController<K> {
    /// A controller acting on `host`.
    #[must_use]
    pub fn new(host: HostDeps) -> Self {
        Self {
            host,
            _kind: PhantomData,
        }
    }
}

impl<K> Controller for HostSpecController<K>
where
    K: HostObject,
    K::Spec: Clone + Send,
{
    type Event = ();

    fn name(&self) -> &str {
        K::CONTROLLER
    }

    fn inputs(&self) -> Vec<Input> {
        vec![Input::of::<K>(NS, InputKind::Strong)]
    }

    fn outputs(&self) -> Vec<Output> {
        Vec::new()
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        Ok(Triggers::inputs_only().with_resync(REFRESH))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            self.round(rt)?;
            Ok(Action::await_change())
        })
    }
}

impl<K> HostSpecController<K>
where
    K: HostObject,
    K::Spec: Clone + Send,
{
    // Runs on the controller's own thread: the host name is that of the thread's UTS
    // namespace, so it is not handed to a blocking pool.
    fn round(&mut self, rt: &mut ControllerRuntime) -> Result<(), ControllerError> {
        let name = K::CONTROLLER;
        for (r, op) in round_work::<K>(rt, name)? {
            let res = match op {
                Op::Apply => K::apply(&self.host, &r.spec),
                Op::Remove => K::remove(&self.host, &r.spec),
            };
            record_outcome(rt, &r, name, op, "host", res.map_err(|e| e.to_string()))?;
        }
        Ok(())
    }
}

/// Statuses read back from the host: `HostnameStatus hostname` (the UTS namespace),
/// `ResolverStatus resolvers` (systemd-resolved's upstream list when it runs, else
/// `/etc/resolv.conf`), `TimeServerStatus timeservers` (chrony's or timesyncd's
/// config). Re-read every [`REFRESH`] and whenever a host spec changes.
#[derive(Debug)]
pub struct HostStatusController {
    host: HostDeps,
}

impl HostStatusController {
    /// A controller reading `host`.
    #[must_use]
    pub fn new(host: HostDeps) -> Self {
        Self { host }
    }

    /// The time servers in force and the service they are read from.
    ///
    /// # Errors
    /// A config file could not be read.
    pub fn time_servers(host: &HostDeps) -> io::Result<Option<TimeServerStatusSpec>> {
        let (p, f) = (&host.paths, &*host.files);
        let spec = match host.time_service() {
            Some(Service::Chrony) => {
                let main = host.text(&p.chrony_conf())?.unwrap_or_default();
                let (mut servers, dirs) = content::chrony_servers(&main);
                for dir in dirs {
                    for file in f.list(&p.host_path(&dir), ".sources") {
                        let text = host.text(&file)?.unwrap_or_default();
                        servers.extend(content::chrony_servers(&text).0);
                    }
                }
                TimeServerStatusSpec {
                    ntp_servers: servers,
                    service: "chrony".into(),
                }
            }
            Some(_) => {
                let mut texts = vec![host.text(&p.timesyncd_conf())?.unwrap_or_default()];
                for file in f.list(&p.timesyncd_dropins(), ".conf") {
                    texts.push(host.text(&file)?.unwrap_or_default());
                }
                TimeServerStatusSpec {
                    ntp_servers: content::systemd_list(&texts, "Time", "NTP"),
                    service: "systemd-timesyncd".into(),
                }
            }
            None => return Ok(None),
        };
        Ok(Some(spec))
    }
}

impl Controller for HostStatusController {
    type Event = ();

    fn name(&self) -> &str {
        "HostStatusController"
    }

    fn inputs(&self) -> Vec<Input> {
        vec![
            Input::of::<HostnameSpec>(NS, InputKind::Weak),
            Input::of::<ResolverSpec>(NS, InputKind::Weak),
            Input::of::<TimeServerSpec>(NS, InputKind::Weak),
        ]
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::exclusive::<HostnameStatus>(),
            Output::exclusive::<ResolverStatus>(),
            Output::exclusive::<TimeServerStatus>(),
        ]
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // Neither the files nor the host name have change events: re-read on a period.
        Ok(Triggers::inputs_only().with_resync(REFRESH))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            let host = &self.host;
            let (hostname, domainname) = host.system.names().map_err(ControllerError::other)?;
            let resolv = if host.resolved_running() {
                host.paths.resolved_upstream()
            } else {
                host.paths.resolv_conf()
            };
            let resolvers = content::parse_resolv_conf(
                &host
                    .text(&resolv)
                    .map_err(ControllerError::other)?
                    .unwrap_or_default(),
            );
            let time = Self::time_servers(host).map_err(ControllerError::other)?;
            rt.start_tracking_outputs()?;
            if !hostname.is_empty() {
                let spec = HostnameStatusSpec {
                    hostname,
                    domainname,
                };
                rt.modify::<HostnameStatus>(NS, HOSTNAME, |r| r.spec = spec.clone())?;
            }
            if !resolvers.dns_servers.is_empty() {
                rt.modify::<ResolverStatus>(NS, RESOLVERS, |r| r.spec = resolvers.clone())?;
            }
            if let Some(t) = time.filter(|t| !t.ntp_servers.is_empty()) {
                rt.modify::<TimeServerStatus>(NS, TIME_SERVERS, |r| r.spec = t.clone())?;
            }
            rt.cleanup_outputs(&[
                Kind::new(NS, HostnameStatus::TYPE),
                Kind::new(NS, ResolverStatus::TYPE),
                Kind::new(NS, TimeServerStatus::TYPE),
            ])?;
            Ok(Action::await_change())
        })
    }
}

/// Registers the host family: merge and spec controllers of the three spec types and
/// the status controller (the network config controller writes their raw specs).
///
/// # Errors
/// Registration conflicts.
pub fn register(
    runtime: &mut crate::runtime::Runtime,
    host: &HostDeps,
) -> Result<(), crate::runtime::RegistrationError> {
    use super::merge::MergeController;
    runtime.register(MergeController::<HostnameSpec>::new())?;
    runtime.register(MergeController::<ResolverSpec>::new())?;
    runtime.register(MergeController::<TimeServerSpec>::new())?;
    runtime.register(HostSpecController::<HostnameSpec>::new(host.clone()))?;
    runtime.register(HostSpecController::<ResolverSpec>::new(host.clone()))?;
    runtime.register(HostSpecController::<TimeServerSpec>::new(host.clone()))?;
    runtime.register(HostStatusController::new(host.clone()))?;
    Ok(())
}
