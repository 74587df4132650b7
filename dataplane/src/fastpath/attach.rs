//! Attaching the classifier to interfaces at tc ingress (tcx, else a clsact qdisc)
//! and detaching it, for the state [`FastPath`](super::FastPath) shares with its
//! watcher thread.

use std::{
    collections::BTreeMap,
    io,
    sync::{Mutex, MutexGuard, PoisonError},
};

use aya::programs::{
    tc::{SchedClassifierLinkId, TcAttachOptions},
    LinkOrder, TcAttachType,
};
use serde::Deserialize;

use super::{
    error::{attach_error, find_io},
    FastPathConfig, FastPathError, Lookup, Programs,
};
use crate::netns::Netns;

/// How the classifier is attached to one interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttachMode {
    /// tcx link (kernel ≥ 6.6).
    Tcx,
    /// Filter on a clsact qdisc (older kernels).
    Clsact,
}

/// One interface carrying the classifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachedInterface {
    /// Interface name when attached.
    pub name: String,
    /// ifindex.
    pub index: u32,
    /// The program variant (Ethernet or layer 3).
    pub program: &'static str,
    /// tcx or clsact.
    pub mode: AttachMode,
}

/// An attached interface and what detaching it takes.
pub(super) struct Attachment {
    pub(super) info: AttachedInterface,
    link: SchedClassifierLinkId,
    added_clsact: bool,
}

/// What [`FastPath`](super::FastPath) and its watcher thread share.
pub(super) struct Shared {
    pub(super) programs: Programs,
    pub(super) config: FastPathConfig,
    pub(super) attached: BTreeMap<u32, Attachment>,
    /// Interfaces the classifier could not be attached to: (name, error).
    pub(super) failed: Vec<(String, String)>,
}

/// `ip -j link` entry.
#[derive(Debug, Deserialize)]
pub(super) struct IpLink {
    ifindex: u32,
    pub(super) ifname: String,
    #[serde(default)]
    link_type: String,
}

pub(super) fn list_links(netns: &Netns, dev: Option<&str>) -> io::Result<Vec<IpLink>> {
    let mut args = vec!["-j", "link", "show"];
    if let Some(d) = dev {
        args.extend(["dev", d]);
    }
    let out = netns.run_stdout("ip", &args)?;
    serde_json::from_str(&out).map_err(io::Error::other)
}

/// Says once per process that this kernel has no tcx and the clsact path is used (a
/// warning per interface would repeat it for every link).
fn log_tcx_fallback_once(error: &dyn std::fmt::Display) {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    LOGGED.call_once(|| {
        tracing::warn!(%error, "tcx is not available on this kernel (it needs Linux 6.6): the fast-path classifier is attached as a cls_bpf filter on a clsact qdisc");
    });
}

/// Whether any tc filter is left on `dev`'s ingress or egress hook (`tc filter show`
/// prints nothing when there is none). On a failed read, assume there is one: keeping
/// an empty qdisc is harmless, deleting someone's filter is not.
fn has_tc_filters(netns: &Netns, dev: &str) -> bool {
    ["ingress", "egress"].iter().any(|hook| {
        netns
            .run_stdout("tc", &["filter", "show", "dev", dev, hook])
            .map_or(true, |out| !out.trim().is_empty())
    })
}

pub(super) fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    pub(super) fn programs_for(&self) -> (&'static str, &'static str) {
        match self.config.lookup {
            Lookup::PrefixHash => (wirespan_ebpf::PROG_PHASH, wirespan_ebpf::PROG_PHASH_L3),
            Lookup::Lpm => (wirespan_ebpf::PROG_LPM, wirespan_ebpf::PROG_LPM_L3),
        }
    }

    /// Attaches to `link` if it is selected and not yet attached. Runs on a thread
    /// inside the namespace.
    pub(super) fn consider(&mut self, netns: &Netns, link: &IpLink) -> Result<(), FastPathError> {
        if self.attached.contains_key(&link.ifindex)
            || !self.config.interfaces.selects(&link.ifname)
        {
            return Ok(());
        }
        let (eth, l3) = self.programs_for();
        let program = if link.link_type == "ether" { eth } else { l3 };
        let prog = self.programs.classifier_mut(program)?;
        let tcx = prog.attach_with_options(
            &link.ifname,
            TcAttachType::Ingress,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        );
        let (link_id, mode, added_clsact) = match tcx {
            Ok(id) => (id, AttachMode::Tcx, false),
            Err(tcx_err) => {
                log_tcx_fallback_once(&tcx_err);
                tracing::debug!(interface = %link.ifname, error = %tcx_err, "tcx attach failed, trying a clsact qdisc");
                let added = match aya::programs::tc::qdisc_add_clsact(&link.ifname) {
                    Ok(()) => true,
                    Err(e)
                        if find_io(&e).and_then(io::Error::raw_os_error) == Some(libc::EEXIST) =>
                    {
                        false
                    }
                    Err(e) => return Err(attach_error(&link.ifname, e)),
                };
                match prog.attach_with_options(
                    &link.ifname,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(aya::programs::tc::NlOptions::default()),
                ) {
                    Ok(id) => (id, AttachMode::Clsact, added),
                    Err(e) => {
                        if added {
                            let _ =
                                netns.run("tc", &["qdisc", "del", "dev", &link.ifname, "clsact"]);
                        }
                        return Err(attach_error(&link.ifname, e));
                    }
                }
            }
        };
        tracing::info!(interface = %link.ifname, ifindex = link.ifindex, program, mode = ?mode, "fast-path classifier attached");
        self.attached.insert(
            link.ifindex,
            Attachment {
                info: AttachedInterface {
                    name: link.ifname.clone(),
                    index: link.ifindex,
                    program,
                    mode,
                },
                link: link_id,
                added_clsact,
            },
        );
        Ok(())
    }

    pub(super) fn detach(
        &mut self,
        netns: &Netns,
        index: u32,
        gone: bool,
    ) -> Result<(), FastPathError> {
        let Some(a) = self.attached.remove(&index) else {
            return Ok(());
        };
        let prog = self.programs.classifier_mut(a.info.program)?;
        let r = prog.detach(a.link);
        if gone {
            return Ok(());
        }
        r.map_err(|e| attach_error(&a.info.name, e))?;
        // The clsact qdisc is shared: other software may have added filters to it
        // since we added it, and deleting the qdisc would delete theirs.
        if a.added_clsact {
            if has_tc_filters(netns, &a.info.name) {
                tracing::info!(interface = %a.info.name, "clsact qdisc kept: other filters use it");
            } else {
                netns
                    .run("tc", &["qdisc", "del", "dev", &a.info.name, "clsact"])
                    .map_err(|e| attach_error(&a.info.name, e))?;
            }
        }
        tracing::info!(interface = %a.info.name, "fast-path classifier detached");
        Ok(())
    }

    pub(super) fn detach_all(&mut self, netns: &Netns) -> Result<(), FastPathError> {
        let mut first = Ok(());
        let present: Vec<u32> = list_links(netns, None)
            .map(|l| l.into_iter().map(|l| l.ifindex).collect())
            .unwrap_or_default();
        for index in self.attached.keys().copied().collect::<Vec<_>>() {
            let r = self.detach(netns, index, !present.contains(&index));
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}
