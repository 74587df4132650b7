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

/// Writes the state to `path` atomically: `<path>.tmp`, fsync, rename, fsync of the
/// directory, so a crash at any point leaves the old file or the new one. The state lock
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
    let tmp = tmp_path(path);
    let result = (|| {
        let file = fs::File::create(&tmp).map_err(io_err("creating", &tmp))?;
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

fn tmp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Reads a record stream into a fresh [`State`]. `now`/`wall` are the monotonic and
/// wall clocks at load time: remaining TTLs count from `now`; legacy absolute
/// expirations are converted through `wall`.
///
/// # Errors
/// [`SnapshotError::Corrupt`] for a bad tag, an oversized or truncated record, an
/// undecodable message or a duplicate cluster ID; I/O errors as such.
pub fn read(mut input: impl Read, now: Instant, wall: SystemTime) -> Result<State, SnapshotError> {
    let mut state = State::new();
    let mut offset = 0u64;
    let corrupt = |offset: u64, reason: String| SnapshotError::Corrupt { offset, reason };
    loop {
        let mut tag = [0u8; 1];
        match input.read(&mut tag) {
            Ok(0) => return Ok(state),
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
        let msg = pb::ClusterSnapshot::decode(buf.as_slice())
            .map_err(|e| corrupt(offset, format!("invalid cluster record: {e}")))?;
        if state.clusters.contains_key(&msg.id) {
            return Err(corrupt(
                offset,
                format!("duplicate cluster ID {:?}", msg.id),
            ));
        }
        let (id, cluster) = import_cluster(msg, now, wall);
        state.clusters.insert(id, cluster);
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

fn import_cluster(msg: pb::ClusterSnapshot, now: Instant, wall: SystemTime) -> (String, Cluster) {
    let mut affiliates = Affiliates::with_capacity(msg.affiliates.len());
    for a in msg.affiliates {
        let endpoints = a.endpoints.iter().map(|e| Endpoint {
            expiration: expiration(e.ttl.as_ref(), e.expiration.as_ref(), now, wall),
            data: &e.data,
        });
        let exp = expiration(a.ttl.as_ref(), a.expiration.as_ref(), now, wall);
        affiliates.insert(Affiliate::new(&a.id, exp, &a.data, endpoints));
    }
    (msg.id, Cluster::with_affiliates(affiliates))
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

/// Loads `path`; never fails the start: a bad file is moved aside to
/// `<path>.corrupt-<unix seconds>`.
#[must_use]
pub fn load(path: &Path, now: Instant, wall: SystemTime) -> LoadOutcome {
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
    match read(BufReader::with_capacity(1 << 20, file), now, wall) {
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
    /// and imports; one more affiliate is refused.
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
        assert_eq!((counts.affiliates, counts.endpoints), (1024, 1024 * 64));
        assert!(state.inspect(&msg.id, now).unwrap()[0].expires_in_secs > 9_000_000_000);
        drop(state);

        msg.affiliates.push(affiliate(1024));
        let mut header = vec![RECORD_TAG];
        prost::encoding::encode_varint(msg.encoded_len() as u64, &mut header);
        let err = read(&header[..], now, SystemTime::now()).unwrap_err();
        assert!(err.to_string().contains("too long"), "{err}");
    }
}
