//! [`NftMarking`]: the nftables adapter. It renders the spec (incrementally when
//! few prefixes changed), reads our table only when some other transaction may have
//! touched it (the ruleset generation says), plans, and commits one atomic
//! transaction: small element changes over nf_tables netlink, the rest through
//! `nft -j -f -`.

use std::{borrow::Cow, collections::BTreeSet, io::Write, process::Stdio};

use nftables::schema::{NfCmd, NfObject, Nftables};

use super::{
    batch::{element_batch, full_batch, table_object},
    incremental,
    listing::{parse_table, TableState},
    plan::{apply_diffs, expected_state, plan, Plan, SetDiff},
    ruleset::Ruleset,
    Marking, MarkingError, MarkingSpec, MarkingStatus, PrefixDelta,
};
use crate::netns::Netns;

/// nftables through the `nft` binary, in a given namespace.
#[derive(Debug)]
pub struct NftMarking {
    netns: Netns,
    table: Option<String>,
    transactions: u64,
    reads: u64,
    /// Netlink socket in the namespace for the generation id.
    gen_sock: Option<rtnetlink::sys::Socket>,
    gen_seq: u32,
    /// What our table holds, valid while the ruleset generation is still `.0`.
    cache: Option<(u32, TableState)>,
    /// The last spec and its rendering (pure: independent of the kernel).
    render: Option<incremental::RenderCache>,
}

impl NftMarking {
    /// An adapter for `netns`.
    #[must_use]
    pub fn new(netns: Netns) -> Self {
        Self {
            netns,
            table: None,
            transactions: 0,
            reads: 0,
            gen_sock: None,
            gen_seq: 0,
            cache: None,
            render: None,
        }
    }

    /// Number of full table listings (`nft -j list table`) so far: a steady-state
    /// apply needs none.
    #[must_use]
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// The current ruleset generation, `None` if it cannot be read (then every apply
    /// lists the table, which is correct, only slower).
    fn generation(&mut self) -> Option<u32> {
        if self.gen_sock.is_none() {
            let thread = crate::netns::NetnsThread::spawn(&self.netns).ok()?;
            self.gen_sock = thread.run(crate::nfnl::open).ok()?.ok();
        }
        self.gen_seq = self.gen_seq.wrapping_add(1);
        match crate::nfnl::generation(self.gen_sock.as_ref()?, self.gen_seq) {
            Ok(g) => Some(g),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read nftables generation");
                self.gen_sock = None;
                None
            }
        }
    }

    fn nft(
        &self,
        args: &[&str],
        stdin: Option<&[u8]>,
        op: &'static str,
    ) -> Result<String, MarkingError> {
        let mut cmd = self.netns.command("nft");
        cmd.args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().map_err(MarkingError::Spawn)?;
        if let Some(input) = stdin {
            let mut pipe = child.stdin.take().ok_or_else(|| {
                MarkingError::Spawn(std::io::Error::other("nft stdin not captured"))
            })?;
            pipe.write_all(input).map_err(MarkingError::Spawn)?;
        }
        let out = child.wait_with_output().map_err(MarkingError::Spawn)?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(MarkingError::Nft {
                op,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }

    /// Lists our table; `Ok(None)` when it does not exist.
    fn list(&self, table: &str) -> Result<Option<String>, MarkingError> {
        match self.nft(&["-j", "list", "table", "inet", table], None, "list table") {
            Ok(s) => Ok(Some(s)),
            Err(MarkingError::Nft { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    fn commit(&mut self, batch: &Nftables<'_>, op: &'static str) -> Result<(), MarkingError> {
        let json = serde_json::to_vec(batch).map_err(|e| MarkingError::Spawn(e.into()))?;
        self.nft(&["-j", "-f", "-"], Some(&json), op)?;
        self.transactions += 1;
        Ok(())
    }
}

impl Marking for NftMarking {
    fn apply(&mut self, spec: &MarkingSpec) -> Result<bool, MarkingError> {
        // Re-render incrementally when only a few prefixes changed since last time.
        // An invalid spec changes nothing, not even what a later delta applies to.
        let mut previous = self.render.take();
        let cache = match previous.take_if(|c| c.update(spec)) {
            Some(c) => c,
            None => {
                if let Err(e) = spec.validate() {
                    self.render = previous;
                    return Err(e.into());
                }
                incremental::RenderCache::new(spec)
            }
        };
        let result = self.apply_rendered(spec, cache.ruleset());
        self.render = Some(cache);
        result
    }

    /// Updates the remembered rendering by the delta alone and, while the kernel's
    /// table is known to be as we left it (no other transaction since ours), commits
    /// just the resulting element changes: time in proportion to the delta, whatever
    /// the size of the routed set. Otherwise (a set became empty or non-empty, or the
    /// table must be read) as [`Marking::apply`] with the changed spec. After a write
    /// error the delta still counts as desired: the next apply or delta writes it.
    fn apply_delta(&mut self, delta: &PrefixDelta) -> Result<bool, MarkingError> {
        let mut cache = self.render.take().ok_or(MarkingError::NotApplied)?;
        if delta.is_empty() {
            self.render = Some(cache);
            return Ok(false);
        }
        let result = match cache.apply_delta(delta) {
            Ok(changes) => self.write_changes(&cache, &changes),
            Err(e) => Err(e.into()),
        };
        self.render = Some(cache);
        result
    }

    fn observe(&mut self) -> Result<MarkingStatus, MarkingError> {
        let Some(table) = self.table.clone() else {
            return Ok(MarkingStatus::default());
        };
        let Some(json) = self.list(&table)? else {
            return Ok(MarkingStatus::default());
        };
        let st = parse_table(&json).unwrap_or_default();
        Ok(MarkingStatus {
            present: true,
            elements: st
                .sets
                .iter()
                .map(|s| (s.0.clone(), s.3.as_ref().map_or(0, BTreeSet::len)))
                .collect(),
            counters: st.counters,
        })
    }

    fn teardown(&mut self) -> Result<(), MarkingError> {
        // Nothing is applied any more: a delta needs a full apply first.
        self.cache = None;
        self.render = None;
        if let Some(t) = self.table.take() {
            self.remove_table(&t)?;
        }
        Ok(())
    }

    fn transactions(&self) -> u64 {
        self.transactions
    }
}

impl NftMarking {
    /// Makes the kernel hold `cache`'s rendering after `changes` brought it there:
    /// just the element changes when the remembered table state is still valid and
    /// the rules stay, else the full comparison of [`NftMarking::apply_rendered`].
    fn write_changes(
        &mut self,
        cache: &incremental::RenderCache,
        changes: &incremental::SetChanges,
    ) -> Result<bool, MarkingError> {
        let spec = cache.fields();
        if !changes.rules_changed && self.table.as_deref() == Some(spec.table.as_str()) {
            let gen_before = self.generation();
            match (self.cache.take(), gen_before) {
                (Some((g, mut st)), Some(now)) if g == now => {
                    if changes.diffs.is_empty() {
                        self.cache = Some((g, st));
                        return Ok(false);
                    }
                    let diffs = &changes.diffs;
                    let (add, del) = diffs
                        .iter()
                        .fold((0, 0), |(a, d), s| (a + s.add.len(), d + s.delete.len()));
                    tracing::debug!(table = %spec.table, add, delete = del, "updating set elements by a delta");
                    apply_diffs(&mut st, diffs);
                    if !self.commit_elements_netlink(&spec.table, diffs)? {
                        self.commit(&element_batch(&spec.table, diffs), "update set elements")?;
                    }
                    self.after_commit(gen_before, st);
                    return Ok(true);
                }
                _ => {}
            }
        }
        self.apply_rendered(spec, cache.ruleset())
    }

    /// Makes the kernel hold `rs` (rendered from `spec`) with the least change.
    fn apply_rendered(&mut self, spec: &MarkingSpec, rs: &Ruleset) -> Result<bool, MarkingError> {
        // A renamed table: the old one is ours too and goes first (own transaction; if
        // the rest fails the mesh is unmarked, which a retry repairs).
        if let Some(old) = self.table.clone().filter(|t| *t != spec.table) {
            self.remove_table(&old)?;
        }
        self.table = Some(spec.table.clone());
        // Trust the cache only if no transaction at all happened since our last one.
        let gen_before = self.generation();
        let cached = match (self.cache.take(), gen_before) {
            (Some((g, st)), Some(now)) if g == now => Some(st),
            _ => None,
        };
        // The table as this process last committed it: a rebuild is then its own
        // layout change (a new prefix length), not someone else's edit.
        let ours = cached.is_some();
        let current = match cached {
            Some(st) => Some(st),
            None => {
                self.reads += 1;
                match self.list(&spec.table)?.map(|j| parse_table(&j)) {
                    None => None,
                    Some(None) => {
                        tracing::warn!(table = %spec.table, "nftables table unreadable, replacing it");
                        None
                    }
                    Some(Some(st)) => Some(st),
                }
            }
        };
        let (batch, op, next) = match plan(rs, current.as_ref()) {
            Plan::Nothing => {
                if let (Some(g), Some(st)) = (gen_before, current) {
                    self.cache = Some((g, st));
                }
                return Ok(false);
            }
            Plan::Elements(diffs) => {
                let (add, del) = diffs
                    .iter()
                    .fold((0, 0), |(a, d), s| (a + s.add.len(), d + s.delete.len()));
                tracing::debug!(table = %spec.table, add, delete = del, "updating set elements");
                // What the table holds after this transaction, without re-deriving it
                // from every element.
                let next = match current {
                    Some(mut st) => {
                        apply_diffs(&mut st, &diffs);
                        st
                    }
                    None => expected_state(rs),
                };
                if self.commit_elements_netlink(&spec.table, &diffs)? {
                    self.after_commit(gen_before, next);
                    return Ok(true);
                }
                (
                    element_batch(&spec.table, &diffs),
                    "update set elements",
                    next,
                )
            }
            Plan::Rebuild => {
                if ours {
                    tracing::debug!(table = %spec.table, "marking layout changed, replacing the table");
                } else if current.is_some() {
                    tracing::info!(table = %spec.table, "nftables table differs from desired, replacing it");
                }
                (full_batch(rs), "replace table", expected_state(rs))
            }
        };
        self.commit(&batch, op)?;
        self.after_commit(gen_before, next);
        Ok(true)
    }
}

impl NftMarking {
    /// Our transaction is exactly one generation; anything more means someone else
    /// committed too, and the next apply reads the table again.
    fn after_commit(&mut self, gen_before: Option<u32>, state: TableState) {
        if let (Some(before), Some(after)) = (gen_before, self.generation()) {
            if after == before.wrapping_add(1) {
                self.cache = Some((after, state));
            }
        }
    }

    /// Commits small element changes straight over netlink (one round trip, whatever
    /// the set sizes). `Ok(false)`: not attempted (too big, or no netlink socket), the
    /// caller goes through `nft`.
    fn commit_elements_netlink(
        &mut self,
        table: &str,
        diffs: &[SetDiff],
    ) -> Result<bool, MarkingError> {
        self.cache = None;
        let changes: Vec<crate::nfnl::SetChange<'_>> = diffs
            .iter()
            .map(|d| crate::nfnl::SetChange {
                set: d.name,
                interval: d.interval,
                add: &d.add,
                delete: &d.delete,
            })
            .collect();
        if crate::nfnl::entry_count(&changes) > crate::nfnl::MAX_BATCH_ENTRIES {
            return Ok(false);
        }
        let Some(sock) = self.gen_sock.as_ref() else {
            return Ok(false);
        };
        let (batch, acks) = crate::nfnl::element_batch(table, &changes, &mut self.gen_seq);
        let started = std::time::Instant::now();
        match crate::nfnl::commit(sock, &batch, &acks) {
            Ok(()) => {
                tracing::debug!(table, bytes = batch.len(), elapsed = ?started.elapsed(), "element batch committed over netlink");
                self.transactions += 1;
                Ok(true)
            }
            Err(crate::nfnl::BatchError::Refused(errno)) => Err(MarkingError::Nft {
                op: "update set elements",
                stderr: format!(
                    "kernel refused the element batch: {}",
                    std::io::Error::from_raw_os_error(errno)
                ),
            }),
            Err(crate::nfnl::BatchError::Io(e)) => {
                // Outcome unknown: the next apply re-reads the table and re-plans.
                self.gen_sock = None;
                Err(MarkingError::Netlink(e))
            }
        }
    }

    /// Deletes table `name` in our namespace if it exists; forgets nothing else.
    ///
    /// # Errors
    /// nft failure.
    pub fn remove_table(&mut self, name: &str) -> Result<(), MarkingError> {
        let batch = Nftables {
            objects: Cow::Owned(vec![
                NfObject::CmdObject(NfCmd::Add(table_object(name))),
                NfObject::CmdObject(NfCmd::Delete(table_object(name))),
            ]),
        };
        self.commit(&batch, "delete table")
    }

    /// Removes the table `spec` names even if this adapter did not create it in this
    /// process (cleanup after a restart).
    ///
    /// # Errors
    /// nft failure.
    pub fn teardown_table(&mut self, table: &str) -> Result<(), MarkingError> {
        self.table = None;
        self.cache = None;
        self.render = None;
        self.remove_table(table)
    }
}
