//! Snapshot file in the upstream format: a `sidero.discovery.storage.StateSnapshot`
//! written and read as a stream of `0x0A varint(len) ClusterSnapshot` records, one
//! cluster at a time, so neither side holds the whole file in memory.

use std::{
    fs,
    io::{BufReader, BufWriter, Read, Write},
    path::{Path, PathBuf},
    sync::Mutex,
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use prost::Message;

use super::{
    error::SnapshotError,
    state::{self, signed_secs, Affiliate, Affiliates, Cluster, Endpoint, State},
};
use crate::proto::storage as pb;

/// Largest record accepted: the encoded size of the protocol's "maximal" cluster
/// (256-byte ID, 1024 affiliates with 256-byte IDs, 2048-byte data and 64 endpoints of
/// 2048 bytes, all TTLs at the largest Duration).
pub const MAX_RECORD_LEN: u64 = 137_912_579;

/// Tag of `StateSnapshot.clusters` (field 1, wire type 2).
const RECORD_TAG: u8 = 0x0A;

fn ttl(expiration: Instant, now: Instant) -> Option<prost_types::Duration> {
    // Loading turns a TTL into nanoseconds saturated to `i64`; beyond that range (an
    // expiration ~292 years away, e.g. the zero time a failed new affiliate starts
    // from, seen a second later) the file would not load back to itself.
    const MAX_SECS: i64 = i64::MAX / 1_000_000_000;
    Some(prost_types::Duration {
        seconds: signed_secs(expiration, now).clamp(-MAX_SECS, MAX_SECS),
        nanos: 0,
    })
}

/// One cluster as a snapshot record (tag, length, message). Affiliates sorted by ID
/// so equal states give equal files.
#[must_use]
pub(crate) fn encode_record(id: &str, cluster: &Cluster, now: Instant) -> Vec<u8> {
    let mut sorted: Vec<&Affiliate> = cluster.affiliates.iter().collect();
    sorted.sort_unstable_by_key(|a| a.id());
    let msg = pb::ClusterSnapshot {
        id: id.to_owned(),
        affiliates: sorted
            .into_iter()
            .map(|a| pb::AffiliateSnapshot {
                id: a.id().to_owned(),
                expiration: None,
                data: a.data().to_vec(),
                endpoints: a
                    .endpoints()
                    .map(|e| pb::EndpointSnapshot {
                        expiration: None,
                        data: e.data.to_vec(),
                        ttl: ttl(e.expiration, now),
                    })
                    .collect(),
                ttl: ttl(a.expiration(), now),
            })
            .collect(),
    };
    let len = msg.encoded_len();
    let mut out = Vec::with_capacity(len + 11);
    out.push(RECORD_TAG);
    prost::encoding::encode_varint(len as u64, &mut out);
    msg.encode(&mut out)
        .expect("a Vec grows to fit the message");
    out
}

/// Encodes the whole state (tests and small states; the server streams instead).
#[must_use]
pub fn encode_state(state: &State, now: Instant) -> Vec<u8> {
    let mut ids: Vec<&String> = state.clusters.keys().collect();
    ids.sort();
    ids.into_iter()
        .flat_map(|id| encode_record(id, &state.clusters[id], now))
        .collect()
}

/// What a save wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SaveStats {
    /// Clusters written.
    pub clusters: usize,
    /// Bytes written.
    pub bytes: u64,
}

fn io_err<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> SnapshotError + 'a {
    move |source| SnapshotError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// Writes the state to `path` atomically: a new temp file beside it, fsync, rename,
/// fsync of the directory, so a crash at any point leaves the old file or the new one.
/// The temp file has an unpredictable name and is created exclusively, without
/// following symlinks, mode 0600 (see [`create_temp`]): in a directory others can
/// write to, nobody can plant a link the save would write through. The state lock
/// is taken once per cluster, never across file I/O of the whole state.
///
/// # Errors
/// Any filesystem failure; the temp file is removed then.
pub fn save(path: &Path, state: &Mutex<State>) -> Result<SaveStats, SnapshotError> {
    let lock = || {
        state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        create_dir(parent).map_err(io_err("creating directory", parent))?;
    }
    remove_stale_temps(path);
    let (file, tmp) = create_temp(path).map_err(io_err("creating a temp file for", path))?;
    let result = (|| {
        let mut out = BufWriter::new(file);
        let mut stats = SaveStats::default();
        let ids: Vec<String> = lock().clusters.keys().cloned().collect();
        for id in ids {
            let record = {
                let guard = lock();
                let Some(cluster) = guard.clusters.get(&id) else {
                    continue;
                };
                encode_record(&id, cluster, Instant::now())
            };
            out.write_all(&record).map_err(io_err("writing", &tmp))?;
            stats.clusters += 1;
            stats.bytes += record.len() as u64;
        }
        let file = out
            .into_inner()
            .map_err(|e| io_err("writing", &tmp)(e.into_error()))?;
        file.sync_all().map_err(io_err("syncing", &tmp))?;
        drop(file);
        fs::rename(&tmp, path).map_err(io_err("renaming over", path))?;
        // Make the rename itself durable (a bare file name lives in the working directory).
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if let Ok(dir) = fs::File::open(parent) {
            let _ = dir.sync_all();
        }
        Ok(stats)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn create_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(dir)
}

/// Whether `file` is a temp file name [`create_temp`] makes for `name`.
fn is_temp_name(file: &str, name: &str) -> bool {
    file.strip_prefix('.')
        .and_then(|f| f.strip_prefix(name))
        .and_then(|f| f.strip_prefix('.'))
        .and_then(|f| f.strip_suffix(".tmp"))
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Removes temp files an earlier save left when it was killed (saves are serialised,
/// so none is in use), so they never accumulate. Only regular files: a link is left
/// alone, and removing one would not touch its target anyway.
fn remove_stale_temps(path: &Path) {
    let (Some(name), dir) = (path.file_name().and_then(|n| n.to_str()), path.parent()) else {
        return;
    };
    let dir = dir
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .file_name()
            .to_str()
            .is_some_and(|f| is_temp_name(f, name))
            && entry.file_type().is_ok_and(|t| t.is_file());
        if stale {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Creates `.<name>.<16 random hex>.tmp` in `path`'s directory with
/// `O_CREAT|O_EXCL|O_NOFOLLOW`, mode 0600; tries again on the (unlikely) clash.
fn create_temp(path: &Path) -> std::io::Result<(fs::File, PathBuf)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let dir = path.parent().unwrap_or(Path::new(""));
    let mut last = None;
    for _ in 0..8 {
        let tmp = dir.join(format!(".{name}.{:016x}.tmp", rand::random::<u64>()));
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)
        {
            Ok(file) => return Ok((file, tmp)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("no temp file name free")))
}

/// Limits a loaded snapshot is held to: those every live request passes. What
/// breaks one is dropped (and counted in [`State`]'s `snapshot_dropped`), not the
/// whole file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadLimits {
    /// Most affiliates in one cluster.
    pub max_affiliates: usize,
    /// Most clusters.
    pub max_clusters: usize,
    /// Bytes of stored state (see [`State::stored_bytes`]).
    pub state_budget: usize,
}

impl Default for LoadLimits {
    fn default() -> Self {
        Self {
            max_affiliates: state::MAX_AFFILIATES,
            max_clusters: state::MAX_CLUSTERS,
            state_budget: state::STATE_BUDGET,
        }
    }
}

/// [`read_with`] under the default [`LoadLimits`].
///
/// # Errors
/// As [`read_with`].
pub fn read(input: impl Read, now: Instant, wall: SystemTime) -> Result<State, SnapshotError> {
    read_with(input, now, wall, LoadLimits::default())
}

/// Reads a record stream into a fresh [`State`]. `now`/`wall` are the monotonic and
/// wall clocks at load time: remaining TTLs count from `now`; legacy absolute
/// expirations are converted through `wall`. Every cluster, affiliate and endpoint is
/// checked as a live request would be (see [`import_cluster`]); what fails is dropped.
///
/// # Errors
/// [`SnapshotError::Corrupt`] for a bad tag, an oversized or truncated record, an
/// undecodable message or a duplicate cluster ID; I/O errors as such.
pub fn read_with(
    mut input: impl Read,
    now: Instant,
    wall: SystemTime,
    limits: LoadLimits,
) -> Result<State, SnapshotError> {
    let mut state = State::new();
    let mut offset = 0u64;
    let corrupt = |offset: u64, reason: String| SnapshotError::Corrupt { offset, reason };
    loop {
        let mut tag = [0u8; 1];
        match input.read(&mut tag) {
            Ok(0) => {
                state.recount_bytes();
                return Ok(state);
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(corrupt(offset, format!("read error: {e}"))),
        }
        if tag[0] != RECORD_TAG {
            return Err(corrupt(
                offset,
                format!("unexpected tag byte {:#04x}", tag[0]),
            ));
        }
        let (len, varint_len) =
            read_varint(&mut input).map_err(|e| corrupt(offset, format!("record length: {e}")))?;
        if len > MAX_RECORD_LEN {
            return Err(corrupt(
                offset,
                format!("record of {len} bytes is too long"),
            ));
        }
        let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
        input
            .read_exact(&mut buf)
            .map_err(|e| corrupt(offset, format!("truncated record: {e}")))?;
        let msg = RawCluster::decode(buf.as_slice())
            .map_err(|e| corrupt(offset, format!("invalid cluster record: {e}")))?;
        if let Ok(id) = std::str::from_utf8(&msg.id) {
            if state.clusters.contains_key(id) {
                return Err(corrupt(
                    offset,
                    format!("duplicate cluster {}", crate::redact::cluster_tag(id)),
                ));
            }
        }
        let mut import = Import {
            state: &mut state,
            limits,
            now,
            wall,
            offset,
        };
        import.cluster(msg);
        offset += 1 + varint_len + len;
    }
}

fn read_varint(input: &mut impl Read) -> std::io::Result<(u64, u64)> {
    let mut value = 0u64;
    for i in 0..10 {
        let mut b = [0u8; 1];
        input.read_exact(&mut b)?;
        value |= u64::from(b[0] & 0x7f) << (7 * i);
        if b[0] & 0x80 == 0 {
            return Ok((value, i + 1));
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "varint longer than 10 bytes",
    ))
}

fn expiration(
    ttl: Option<&prost_types::Duration>,
    absolute: Option<&prost_types::Timestamp>,
    now: Instant,
    wall: SystemTime,
) -> Instant {
    if ttl.is_some() {
        return state::offset(now, state::ttl_nanos(ttl));
    }
    let Some(ts) = absolute else {
        // Neither: the zero time, collected at the first GC.
        return state::offset(now, i64::MIN);
    };
    let wall_nanos = match wall.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    };
    let ts_nanos = i128::from(ts.seconds) * 1_000_000_000 + i128::from(ts.nanos);
    let delta = ts_nanos - wall_nanos;
    let delta = i64::try_from(delta).unwrap_or(if delta < 0 { i64::MIN } else { i64::MAX });
    state::offset(now, delta)
}

/// `ClusterSnapshot` as read: IDs as bytes (the same wire type as `string`), so an
/// ID that is not UTF-8 drops its cluster or affiliate instead of the whole file.
#[derive(Clone, PartialEq, prost::Message)]
struct RawCluster {
    #[prost(bytes = "vec", tag = "1")]
    id: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    affiliates: Vec<RawAffiliate>,
}

/// `AffiliateSnapshot` as read (see [`RawCluster`]).
#[derive(Clone, PartialEq, prost::Message)]
struct RawAffiliate {
    #[prost(bytes = "vec", tag = "1")]
    id: Vec<u8>,
    #[prost(message, optional, tag = "2")]
    expiration: Option<prost_types::Timestamp>,
    #[prost(bytes = "vec", tag = "3")]
    data: Vec<u8>,
    #[prost(message, repeated, tag = "4")]
    endpoints: Vec<pb::EndpointSnapshot>,
    #[prost(message, optional, tag = "5")]
    ttl: Option<prost_types::Duration>,
}

/// One record's import into the state, checking each part against the limits.
struct Import<'a> {
    state: &'a mut State,
    limits: LoadLimits,
    now: Instant,
    wall: SystemTime,
    offset: u64,
}

impl Import<'_> {
    /// Adds the cluster if its ID is valid and it fits the cluster cap and the
    /// budget; its affiliates as [`Self::affiliate`] allows.
    fn cluster(&mut self, msg: RawCluster) {
        let dropped = 1 + msg.affiliates.len() as u64;
        let had_affiliates = !msg.affiliates.is_empty();
        let Some(id) = valid_id(&msg.id, state::validate_cluster_id) else {
            return self.drop_part("cluster", "invalid cluster ID", None, dropped);
        };
        let tag = crate::redact::cluster_tag(id);
        if self.state.clusters.len() >= self.limits.max_clusters {
            return self.drop_part("cluster", "over --max-clusters", Some(&tag), dropped);
        }
        let mut affiliates =
            Affiliates::with_capacity(msg.affiliates.len().min(self.limits.max_affiliates));
        let mut bytes = state::cluster_overhead(id);
        for a in msg.affiliates {
            if affiliates.len() >= self.limits.max_affiliates {
                self.drop_part("affiliate", "over --max-affiliates", Some(&tag), 1);
                continue;
            }
            let Some(affiliate) = self.affiliate(&a, &tag) else {
                continue;
            };
            let size = affiliate.stored_bytes();
            if self.state.stored_bytes() + bytes + size > self.limits.state_budget {
                self.drop_part("affiliate", "over --state-budget-mib", Some(&tag), 1);
                continue;
            }
            bytes += size;
            affiliates.insert(affiliate);
        }
        if affiliates.is_empty() && had_affiliates {
            // Emptied by the checks: nothing left to serve, not worth a slot. (An
            // empty cluster in the file loads as such, so files round-trip.)
            return;
        }
        if self.state.stored_bytes() + bytes > self.limits.state_budget {
            return self.drop_part("cluster", "over --state-budget-mib", Some(&tag), 1);
        }
        self.state
            .add_loaded_cluster(id.to_owned(), Cluster::with_affiliates(affiliates), bytes);
    }

    /// The affiliate if its ID and data pass the request limits; endpoints that do
    /// not are dropped, and TTLs are clamped to the longest a client may ask for.
    fn affiliate(&mut self, a: &RawAffiliate, tag: &str) -> Option<Affiliate> {
        let Some(id) = valid_id(&a.id, state::validate_affiliate_id) else {
            self.drop_part("affiliate", "invalid affiliate ID", Some(tag), 1);
            return None;
        };
        if a.data.len() > state::MAX_DATA_LEN {
            self.drop_part("affiliate", "data too big", Some(tag), 1);
            return None;
        }
        let latest = self.now + state::MAX_TTL;
        let mut endpoints = Vec::with_capacity(a.endpoints.len().min(state::MAX_ENDPOINTS));
        for e in &a.endpoints {
            if e.data.len() > state::MAX_ENDPOINT_LEN || endpoints.len() >= state::MAX_ENDPOINTS {
                self.drop_part("endpoint", "endpoint too big or too many", Some(tag), 1);
                continue;
            }
            let exp = expiration(e.ttl.as_ref(), e.expiration.as_ref(), self.now, self.wall);
            endpoints.push(Endpoint {
                expiration: exp.min(latest),
                data: &e.data,
            });
        }
        let exp = expiration(a.ttl.as_ref(), a.expiration.as_ref(), self.now, self.wall);
        Some(Affiliate::new(id, exp.min(latest), &a.data, endpoints))
    }

    /// Counts and logs a dropped part (by the cluster's tag, never its ID).
    fn drop_part(
        &mut self,
        part: &'static str,
        reason: &'static str,
        cluster: Option<&str>,
        count: u64,
    ) {
        self.state.snapshot_dropped += count;
        tracing::warn!(
            part,
            reason,
            cluster,
            offset = self.offset,
            "snapshot entry dropped at load"
        );
    }
}

/// `raw` as a string if it is UTF-8 and passes `validate`.
fn valid_id(raw: &[u8], validate: fn(&str) -> Result<(), super::RequestError>) -> Option<&str> {
    std::str::from_utf8(raw)
        .ok()
        .filter(|id| validate(id).is_ok())
}

/// Outcome of loading the snapshot at start.
#[derive(Debug)]
pub enum LoadOutcome {
    /// No file: start empty.
    Missing,
    /// Loaded.
    Loaded(State),
    /// The file was unreadable or corrupt; it was renamed to `moved_to` (if the rename
    /// worked) and the server starts empty.
    Corrupt {
        /// What was wrong.
        error: SnapshotError,
        /// Where the bad file now is.
        moved_to: Option<PathBuf>,
    },
}

/// Loads `path` under `limits`; never fails the start: a structurally bad file is
/// moved aside to `<path>.corrupt-<unix seconds>`.
#[must_use]
pub fn load(path: &Path, now: Instant, wall: SystemTime, limits: LoadLimits) -> LoadOutcome {
    let file = match fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return LoadOutcome::Missing,
        Err(e) => {
            return LoadOutcome::Corrupt {
                error: io_err("opening", path)(e),
                moved_to: None,
            }
        }
    };
    match read_with(BufReader::with_capacity(1 << 20, file), now, wall, limits) {
        Ok(state) => LoadOutcome::Loaded(state),
        Err(error) => {
            let stamp = wall.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
            let mut aside = path.as_os_str().to_owned();
            aside.push(format!(".corrupt-{stamp}"));
            let aside = PathBuf::from(aside);
            let moved_to = fs::rename(path, &aside).ok().map(|()| aside);
            LoadOutcome::Corrupt { error, moved_to }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::proto::server as spb;

    fn update(
        state: &mut State,
        now: Instant,
        aff: &str,
        data: &[u8],
        endpoints: &[&[u8]],
        ttl_secs: i64,
    ) {
        state
            .update(
                now,
                &spb::AffiliateUpdateRequest {
                    cluster_id: "c1".into(),
                    affiliate_id: aff.into(),
                    affiliate_data: Some(data.to_vec()),
                    affiliate_endpoints: endpoints.iter().map(|e| e.to_vec()).collect(),
                    ttl: Some(prost_types::Duration {
                        seconds: ttl_secs,
                        nanos: 0,
                    }),
                },
            )
            .unwrap();
    }

    /// Found by the `discovery_rpc` fuzz target (a run slowed down by other load): an
    /// affiliate at the zero time (a negative TTL) saved a second or more later was
    /// written with a TTL below what loading can represent, so the loaded state saved
    /// a different file.
    #[test]
    fn an_affiliate_at_the_zero_time_round_trips_seconds_later() {
        let t0 = Instant::now();
        let mut state = State::new();
        update(
            &mut state,
            t0,
            "a1",
            b"d",
            &[b"e1"],
            -9_000_000_000_000_000_000,
        );
        for later in [0, 1, 2, 3600] {
            let now = t0 + Duration::from_secs(later);
            let file = encode_state(&state, now);
            let loaded = read(file.as_slice(), now, SystemTime::now()).unwrap();
            assert_eq!(encode_state(&loaded, now), file, "{later} s later");
        }
    }

    #[test]
    fn vector_e_bytes() {
        let now = Instant::now();
        let mut state = State::new();
        // Endpoint first with a 600 s TTL, then data with 1800 s: the data's
        // expiration is the later one, the endpoint keeps its own.
        state
            .update(
                now,
                &spb::AffiliateUpdateRequest {
                    cluster_id: "c1".into(),
                    affiliate_id: "a1".into(),
                    affiliate_data: None,
                    affiliate_endpoints: vec![vec![0xaa]],
                    ttl: Some(prost_types::Duration {
                        seconds: 600,
                        nanos: 0,
                    }),
                },
            )
            .unwrap();
        update(&mut state, now, "a1", &[1, 2], &[], 1800);
        let bytes = encode_state(&state, now);
        let expected = [
            0x0a, 0x1d, 0x0a, 0x02, 0x63, 0x31, 0x12, 0x17, 0x0a, 0x02, 0x61, 0x31, 0x1a, 0x02,
            0x01, 0x02, 0x22, 0x08, 0x12, 0x01, 0xaa, 0x1a, 0x03, 0x08, 0xd8, 0x04, 0x2a, 0x03,
            0x08, 0x88, 0x0e,
        ];
        assert_eq!(bytes, expected);

        // And back: remaining TTLs count from the load time.
        let later = now + Duration::from_secs(3600);
        let loaded = read(&bytes[..], later, SystemTime::now()).unwrap();
        let info = loaded.inspect("c1", later).unwrap();
        assert_eq!(info.len(), 1);
        assert_eq!(info[0].id, "a1");
        assert_eq!(info[0].expires_in_secs, 1800);
        assert_eq!(encode_state(&loaded, later), expected);
    }

    #[test]
    fn round_trip_many_clusters() {
        let now = Instant::now();
        let mut state = State::new();
        for c in 0..5 {
            for a in 0..20 {
                state
                    .update(
                        now,
                        &spb::AffiliateUpdateRequest {
                            cluster_id: format!("cluster-{c}"),
                            affiliate_id: format!("aff-{a}"),
                            affiliate_data: Some(vec![a as u8; 100]),
                            affiliate_endpoints: vec![vec![1; 16], vec![2; 32]],
                            ttl: Some(prost_types::Duration {
                                seconds: 100 + a,
                                nanos: 0,
                            }),
                        },
                    )
                    .unwrap();
            }
        }
        let bytes = encode_state(&state, now);
        let loaded = read(&bytes[..], now, SystemTime::now()).unwrap();
        assert_eq!(loaded.counts(), state.counts());
        assert_eq!(encode_state(&loaded, now), bytes);
    }

    #[test]
    fn legacy_absolute_expiration_imports_as_ttl() {
        let wall = SystemTime::now();
        let exp = wall + Duration::from_secs(300);
        let secs = exp.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
        let msg = pb::ClusterSnapshot {
            id: "c".into(),
            affiliates: vec![pb::AffiliateSnapshot {
                id: "a".into(),
                expiration: Some(prost_types::Timestamp {
                    seconds: secs,
                    nanos: 0,
                }),
                data: vec![1],
                endpoints: vec![],
                ttl: None,
            }],
        };
        let mut bytes = vec![RECORD_TAG];
        prost::encoding::encode_varint(msg.encoded_len() as u64, &mut bytes);
        msg.encode(&mut bytes).unwrap();
        let now = Instant::now();
        let state = read(&bytes[..], now, wall).unwrap();
        let secs = state.inspect("c", now).unwrap()[0].expires_in_secs;
        assert!((299..=300).contains(&secs), "{secs}");
    }

    #[test]
    fn corrupt_inputs_are_errors() {
        let now = Instant::now();
        let mut state = State::new();
        update(&mut state, now, "a1", &[1, 2], &[], 1800);
        let good = encode_state(&state, now);
        let wall = SystemTime::now();
        // Truncated.
        assert!(matches!(
            read(&good[..good.len() - 1], now, wall),
            Err(SnapshotError::Corrupt { .. })
        ));
        // Wrong tag.
        let mut bad = good.clone();
        bad[0] = 0x12;
        assert!(read(&bad[..], now, wall).is_err());
        // Duplicate cluster.
        let dup: Vec<u8> = good.iter().chain(good.iter()).copied().collect();
        let err = read(&dup[..], now, wall).unwrap_err();
        assert!(err.to_string().contains("duplicate"), "{err}");
        // Oversized length (checked before allocating).
        let mut huge = vec![RECORD_TAG];
        prost::encoding::encode_varint(MAX_RECORD_LEN + 1, &mut huge);
        let err = read(&huge[..], now, wall).unwrap_err();
        assert!(err.to_string().contains("too long"), "{err}");
        // Garbage inside a well-framed record.
        let garbage = [RECORD_TAG, 3, 0xff, 0xff, 0xff];
        assert!(read(&garbage[..], now, wall).is_err());
        // Empty file is an empty state.
        assert_eq!(read(&[][..], now, wall).unwrap().counts().clusters, 0);
    }

    /// The protocol's "maximal" cluster encodes to exactly [`MAX_RECORD_LEN`] bytes
    /// and reads (what breaks a request limit in it is dropped: its 2 KiB endpoints,
    /// and its TTLs are clamped); one more affiliate makes the record too long.
    #[test]
    fn maximal_cluster_is_the_record_limit() {
        let max_ttl = prost_types::Duration {
            seconds: 9_223_372_036,
            nanos: 854_775_807,
        };
        let endpoint = pb::EndpointSnapshot {
            expiration: None,
            data: vec![0xee; 2048],
            ttl: Some(max_ttl),
        };
        let affiliate = |i: usize| pb::AffiliateSnapshot {
            id: format!("{i:0>256}"),
            expiration: None,
            data: vec![0xdd; 2048],
            endpoints: vec![endpoint.clone(); 64],
            ttl: Some(max_ttl),
        };
        let mut msg = pb::ClusterSnapshot {
            id: "c".repeat(256),
            affiliates: (0..1024).map(affiliate).collect(),
        };
        assert_eq!(msg.encoded_len() as u64, MAX_RECORD_LEN);
        let mut bytes = vec![RECORD_TAG];
        prost::encoding::encode_varint(MAX_RECORD_LEN, &mut bytes);
        msg.encode(&mut bytes).unwrap();
        let now = Instant::now();
        let state = read(&bytes[..], now, SystemTime::now()).unwrap();
        let counts = state.counts();
        assert_eq!((counts.affiliates, counts.endpoints), (1024, 0));
        assert_eq!(counts.snapshot_dropped, 1024 * 64);
        let max_ttl = state::MAX_TTL.as_secs() as i64;
        assert_eq!(
            state.inspect(&msg.id, now).unwrap()[0].expires_in_secs,
            max_ttl
        );
        drop(state);

        msg.affiliates.push(affiliate(1024));
        let mut header = vec![RECORD_TAG];
        prost::encoding::encode_varint(msg.encoded_len() as u64, &mut header);
        let err = read(&header[..], now, SystemTime::now()).unwrap_err();
        assert!(err.to_string().contains("too long"), "{err}");
    }
}
