//! `HostnameStatus hostname` from the kernel (the UTS namespace the daemon runs in)
//! and `ResolverStatus resolvers` from `/etc/resolv.conf`, re-read every few seconds.

use std::{net::IpAddr, path::PathBuf, time::Duration};

use futures::future::BoxFuture;

use crate::{
    resources::network::{
        HostnameStatus, HostnameStatusSpec, ResolverStatus, ResolverStatusSpec, HOSTNAME, NS,
        RESOLVERS,
    },
    runtime::{
        Action, Controller, ControllerError, ControllerResult, ControllerRuntime, Input, Kind,
        Output, ResourceKind, Triggers,
    },
};

/// Re-read period.
const REFRESH: Duration = Duration::from_secs(5);

/// Parses `resolv.conf` text: `nameserver` and `search`/`domain` lines.
#[must_use]
pub fn parse_resolv_conf(text: &str) -> ResolverStatusSpec {
    let mut out = ResolverStatusSpec::default();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("nameserver") => {
                if let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) {
                    out.dns_servers.push(ip);
                }
            }
            Some("search" | "domain") => {
                out.search_domains = words.map(str::to_owned).collect();
            }
            _ => {}
        }
    }
    out
}

fn read_trimmed(path: &str) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let s = s.trim();
    if s == "(none)" {
        String::new()
    } else {
        s.to_owned()
    }
}

/// Publishes the hostname and resolvers.
#[derive(Debug)]
pub struct HostnameStatusController {
    /// Path of resolv.conf.
    pub resolv_conf: PathBuf,
}

impl Default for HostnameStatusController {
    fn default() -> Self {
        Self {
            resolv_conf: PathBuf::from("/etc/resolv.conf"),
        }
    }
}

impl Controller for HostnameStatusController {
    type Event = ();

    fn name(&self) -> &str {
        "HostnameStatusController"
    }

    fn inputs(&self) -> Vec<Input> {
        Vec::new()
    }

    fn outputs(&self) -> Vec<Output> {
        vec![
            Output::exclusive::<HostnameStatus>(),
            Output::exclusive::<ResolverStatus>(),
        ]
    }

    fn start(&mut self, _rt: &mut ControllerRuntime) -> Result<Triggers<()>, ControllerError> {
        // Neither file has change events: they are re-read on a period.
        Ok(Triggers::inputs_only().with_resync(REFRESH))
    }

    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        _events: Vec<()>,
    ) -> BoxFuture<'a, ControllerResult> {
        Box::pin(async move {
            // /proc/sys/kernel/{hostname,domainname} answer for the reader's UTS
            // namespace, like uname(2).
            let spec = HostnameStatusSpec {
                hostname: read_trimmed("/proc/sys/kernel/hostname"),
                domainname: read_trimmed("/proc/sys/kernel/domainname"),
            };
            let resolvers =
                parse_resolv_conf(&std::fs::read_to_string(&self.resolv_conf).unwrap_or_default());
            rt.start_tracking_outputs()?;
            if !spec.hostname.is_empty() {
                rt.modify::<HostnameStatus>(NS, HOSTNAME, |r| r.spec = spec.clone())?;
            }
            if !resolvers.dns_servers.is_empty() {
                rt.modify::<ResolverStatus>(NS, RESOLVERS, |r| r.spec = resolvers.clone())?;
            }
            rt.cleanup_outputs(&[
                Kind::new(NS, HostnameStatus::TYPE),
                Kind::new(NS, ResolverStatus::TYPE),
            ])?;
            Ok(Action::await_change())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_parses_servers_and_search() {
        let r = parse_resolv_conf(
            "# comment\nnameserver 10.0.0.2\nnameserver fd00::53\nnameserver bogus\nsearch a.example b.example\noptions ndots:5\n",
        );
        assert_eq!(
            r.dns_servers,
            vec![
                "10.0.0.2".parse::<IpAddr>().unwrap(),
                "fd00::53".parse().unwrap()
            ]
        );
        assert_eq!(r.search_domains, vec!["a.example", "b.example"]);
    }
}
