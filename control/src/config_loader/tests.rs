use std::os::unix::fs::PermissionsExt as _;

use super::*;
use crate::runtime::StoreOptions;

const GOOD: &str = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n";
const BAD: &str = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n---\napiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: web\nurl: ftp://x/\nfailureThreshold: -1\n";

fn two() -> String {
    format!("{GOOD}---\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 1400\n")
}

fn new_store() -> Store {
    Store::new(StoreOptions::default())
}

fn status(store: &Store) -> ConfigStatusSpec {
    store
        .get::<ConfigStatus>("config", CURRENT)
        .unwrap()
        .spec
        .clone()
}

fn active_documents(store: &Store) -> usize {
    store
        .get::<MachineConfig>("config", ACTIVE)
        .unwrap()
        .spec
        .document_count
}

#[test]
fn version_is_a_prefix_of_the_texts_sha256() {
    // sha256("abc") = ba7816bf8f01cfea414140de5dae2223…
    assert_eq!(version_of("abc"), "ba7816bf8f01cfea");
}

#[test]
fn invalid_config_keeps_the_previous_one_and_names_document_and_field() {
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    let a = loader.accept(GOOD, "test").unwrap();
    assert_eq!((a.changed, a.documents), (true, 1));
    assert_eq!(a.version, version_of(GOOD));
    assert!(
        !loader.accept(GOOD, "test").unwrap().changed,
        "same text is a no-op"
    );
    let err = loader.accept(BAD, "test").unwrap_err().to_string();
    assert!(err.contains("HTTPProbeConfig \"web\""), "{err}");
    assert!(
        err.contains("url: HTTP probe URL scheme must be http or https, got \"ftp\""),
        "{err}"
    );
    assert!(
        err.contains("failureThreshold: probe failure threshold cannot be negative: -1"),
        "{err}"
    );
    let active = store.get::<MachineConfig>("config", ACTIVE).unwrap();
    assert_eq!(active.spec.document_count, 1);
    assert_eq!(active.metadata.version, 1);
    assert_eq!(active.metadata.owner, "");
}

#[test]
fn accepted_config_is_persisted_0600_and_a_rejected_one_is_not() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let loader = ConfigLoader::in_state_dir(new_store(), &state);
    let copy = state.join(LAST_GOOD_FILE);
    loader.accept(GOOD, "test").unwrap();
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), GOOD);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&copy), 0o600);
    assert_eq!(mode(&state), 0o700, "state dir created private");
    loader.accept(BAD, "test").unwrap_err();
    loader.accept("", "test").unwrap_err();
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), GOOD);
    loader.accept(&two(), "test").unwrap();
    assert_eq!(std::fs::read_to_string(&copy).unwrap(), two());
    // No temp files left behind.
    let names: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [LAST_GOOD_FILE]);
}

#[test]
fn a_config_that_cannot_be_persisted_is_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    // The state "dir" is a file: nothing can be written below it.
    let state = dir.path().join("state");
    std::fs::write(&state, "").unwrap();
    let store = new_store();
    let loader = ConfigLoader::in_state_dir(store.clone(), &state);
    let err = loader.accept(GOOD, "test").unwrap_err();
    assert!(matches!(err, LoadError::Persist { .. }), "{err}");
    assert!(store.get::<MachineConfig>("config", ACTIVE).is_err());
    assert!(status(&store)
        .last_error
        .contains("saving the accepted config"));
}

#[test]
fn empty_configs_are_rejected_with_the_way_to_turn_the_mesh_off() {
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    loader.accept(GOOD, "test").unwrap();
    for text in ["", "\n\n", "# nothing here\n", "---\n---\n"] {
        let err = loader.accept(text, "test").unwrap_err();
        assert!(matches!(err, LoadError::Empty), "{text:?}: {err}");
        assert_eq!(
            err.to_string(),
            "config file is empty; to turn the mesh off set enabled: false"
        );
    }
    assert_eq!(active_documents(&store), 1);
}

#[test]
fn oversized_configs_are_rejected_naming_size_and_cap() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.yaml");
    // A valid start, padded with a comment past the cap.
    let big = format!("{GOOD}#{}\n", "x".repeat(MAX_CONFIG_BYTES));
    std::fs::write(&path, &big).unwrap();
    let err = read_file(&path).unwrap_err().to_string();
    let want = format!(
        "config is {} bytes, over the 4194304-byte (4 MiB) limit",
        big.len()
    );
    assert_eq!(err, want);
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    assert_eq!(loader.accept(&big, "api").unwrap_err().to_string(), want);
    assert_eq!(loader.accept_file(&path).unwrap_err().to_string(), want);
    assert_eq!(status(&store).last_error, want);
    // At the cap exactly: fine.
    let at_cap = format!("{GOOD}#{}", "x".repeat(MAX_CONFIG_BYTES - GOOD.len() - 1));
    assert_eq!(at_cap.len(), MAX_CONFIG_BYTES);
    loader.accept(&at_cap, "api").unwrap();
}

#[test]
fn status_shows_the_version_in_force_and_every_error_of_the_last_rejection() {
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    assert_eq!(loader.status(), None);
    loader.accept(GOOD, "/etc/wirespan/config.yaml").unwrap();
    let st = status(&store);
    assert_eq!(st.accepted_version, version_of(GOOD));
    assert_eq!(st.source, "/etc/wirespan/config.yaml");
    assert_eq!(st.documents, 1);
    assert_eq!(st.last_attempt, "accepted");
    assert!(st.last_error.is_empty() && !st.accepted_time.is_empty());

    loader.accept(BAD, "api").unwrap_err();
    let st = status(&store);
    assert_eq!(st.last_attempt, "rejected");
    assert_eq!(st.accepted_version, version_of(GOOD), "the good one stays");
    assert_eq!(st.last_error_source, "api");
    assert!(!st.last_error_time.is_empty());
    for want in [
        "document 2 (HTTPProbeConfig \"web\")",
        "url: HTTP probe URL scheme must be http or https",
        "failureThreshold: probe failure threshold cannot be negative: -1",
    ] {
        assert!(
            st.last_error.contains(want),
            "{want:?} in {}",
            st.last_error
        );
    }

    // The same text again: accepted, nothing changes but the outcome.
    let a = loader.accept(GOOD, "api").unwrap();
    assert!(!a.changed);
    let st = status(&store);
    assert_eq!(st.last_attempt, "accepted");
    assert_eq!(st.source, "/etc/wirespan/config.yaml");
    assert!(st.last_error.contains("HTTPProbeConfig"), "last error kept");
    assert_eq!(
        store
            .get::<MachineConfig>("config", ACTIVE)
            .unwrap()
            .metadata
            .version,
        1
    );
}

#[test]
fn start_falls_back_to_the_last_good_copy_and_records_the_files_error() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, two()).unwrap();
    // First run: the file is good and kept.
    let first = ConfigLoader::in_state_dir(new_store(), &state);
    assert_eq!(first.start(Some(&file)).unwrap().unwrap().documents, 2);

    // The file is truncated while the node is down.
    for (bad, want) in [
        ("", "config file is empty"),
        ("apiVersion: v1alpha1\nkind: LinkCon", "document 1"),
    ] {
        std::fs::write(&file, bad).unwrap();
        let store = new_store();
        let loader = ConfigLoader::in_state_dir(store.clone(), &state);
        let a = loader.start(Some(&file)).unwrap().unwrap();
        assert_eq!((a.documents, a.version), (2, version_of(&two())));
        assert_eq!(active_documents(&store), 2);
        let st = status(&store);
        assert_eq!(st.source, state.join(LAST_GOOD_FILE).display().to_string());
        assert_eq!(st.last_attempt, "rejected");
        assert_eq!(st.last_error_source, file.display().to_string());
        assert!(
            st.last_error.contains(want),
            "{want:?} in {}",
            st.last_error
        );
    }

    // A missing file too.
    std::fs::remove_file(&file).unwrap();
    let store = new_store();
    ConfigLoader::in_state_dir(store.clone(), &state)
        .start(Some(&file))
        .unwrap();
    assert_eq!(active_documents(&store), 2);
    assert!(status(&store).last_error.contains("reading config"));

    // No file given: the last good copy (a config applied through the API survives).
    let store = new_store();
    ConfigLoader::in_state_dir(store.clone(), &state)
        .start(None)
        .unwrap()
        .unwrap();
    assert_eq!(active_documents(&store), 2);
    assert_eq!(status(&store).last_attempt, "accepted");
}

#[test]
fn start_without_a_last_good_copy_fails_on_a_bad_file_and_is_empty_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.yaml");
    std::fs::write(&file, "").unwrap();
    let loader = ConfigLoader::in_state_dir(new_store(), &dir.path().join("state"));
    let err = loader.start(Some(&file)).unwrap_err();
    assert!(matches!(err, LoadError::Empty), "{err}");
    assert_eq!(loader.start(None).unwrap(), None);
}

#[test]
fn only_complete_writes_of_the_file_trigger_a_read() {
    use notify::event::{
        AccessKind, AccessMode, CreateKind, DataChange, EventKind, Flag, ModifyKind, RenameMode,
    };
    let name = std::ffi::OsStr::new("config.yaml");
    let ev = |kind, path: &str| notify::Event::new(kind).add_path(PathBuf::from(path));
    let close = EventKind::Access(AccessKind::Close(AccessMode::Write));
    let moved_to = EventKind::Modify(ModifyKind::Name(RenameMode::To));
    assert!(completes_write(
        &ev(close, "/etc/w/config.yaml"),
        name,
        false
    ));
    assert!(completes_write(
        &ev(moved_to, "/etc/w/config.yaml"),
        name,
        false
    ));
    assert!(!completes_write(
        &ev(close, "/etc/w/other.yaml"),
        name,
        false
    ));
    assert!(!completes_write(
        &ev(moved_to, "/etc/w/.config.yaml.tmp1"),
        name,
        false
    ));
    let write = EventKind::Modify(ModifyKind::Data(DataChange::Any));
    assert!(!completes_write(
        &ev(write, "/etc/w/config.yaml"),
        name,
        false
    ));
    let create = EventKind::Create(CreateKind::File);
    assert!(!completes_write(
        &ev(create, "/etc/w/config.yaml"),
        name,
        false
    ));
    let rescan = notify::Event::new(EventKind::Other).set_flag(Flag::Rescan);
    assert!(completes_write(&rescan, name, false));
    // A symlinked file: a rename of another entry (`..data`) may have changed it; a
    // close of another file still has not.
    assert!(completes_write(&ev(moved_to, "/etc/w/..data"), name, true));
    assert!(!completes_write(
        &ev(close, "/etc/w/other.yaml"),
        name,
        true
    ));
}

async fn next(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Result<Accepted, String>>,
) -> Result<Accepted, String> {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("no reload report")
        .unwrap()
}

#[tokio::test]
async fn watched_file_is_read_after_complete_writes_only_and_bad_contents_keep_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, GOOD).unwrap();
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    loader.accept_file(&path).unwrap();
    let cancel = CancellationToken::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(loader.watch_file(path.clone(), cancel.clone(), Some(tx)));

    // A write in progress (open, half written, not closed) is not read: a poll or a
    // reaction to modify events would reject the half file, and that rejection would
    // be the first report, ahead of the one for the completed write (reports come in
    // event order). Which events complete a write is `completes_write`, tested above.
    let half = &two()[..GOOD.len() + 20];
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut f, half.as_bytes()).unwrap();
    f.sync_all().unwrap();
    std::io::Write::write_all(&mut f, &two().as_bytes()[half.len()..]).unwrap();
    drop(f);
    let a = next(&mut rx)
        .await
        .expect("the first report is the completed write, not the half one");
    assert_eq!((a.changed, a.documents), (true, 2));
    assert_eq!(active_documents(&store), 2);

    // Truncated to nothing: rejected, the config stays.
    std::fs::write(&path, "").unwrap();
    assert!(next(&mut rx)
        .await
        .unwrap_err()
        .contains("config file is empty"));
    assert_eq!(active_documents(&store), 2);
    assert_eq!(status(&store).last_attempt, "rejected");

    // An editor's atomic save (write a temp file, rename it over): seen.
    let tmp = dir.path().join(".config.yaml.swp");
    std::fs::write(&tmp, GOOD).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let a = next(&mut rx).await.unwrap();
    assert_eq!(a.documents, 1);
    assert_eq!(status(&store).last_attempt, "accepted");

    // Invalid: every error reported, the config stays.
    std::fs::write(&path, BAD).unwrap();
    assert!(next(&mut rx).await.unwrap_err().contains("HTTPProbeConfig"));
    assert_eq!(active_documents(&store), 1);
    cancel.cancel();
    task.await.unwrap();
}

/// A Kubernetes Secret or ConfigMap volume: `config.yaml -> ..data/config.yaml`,
/// `..data -> ..<timestamp>`; the kubelet updates it by writing a new timestamped
/// directory and renaming a new `..data` symlink over the old one. No event names
/// `config.yaml`, yet its content changed.
#[tokio::test]
async fn a_kubernetes_style_symlink_swap_is_seen() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir(d.join("..v1")).unwrap();
    std::fs::write(d.join("..v1/config.yaml"), GOOD).unwrap();
    symlink("..v1", d.join("..data")).unwrap();
    symlink("..data/config.yaml", d.join("config.yaml")).unwrap();
    let path = d.join("config.yaml");
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    loader.accept_file(&path).unwrap();
    let cancel = CancellationToken::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(loader.watch_file(path.clone(), cancel.clone(), Some(tx)));

    std::fs::create_dir(d.join("..v2")).unwrap();
    std::fs::write(d.join("..v2/config.yaml"), two()).unwrap();
    symlink("..v2", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    std::fs::remove_dir_all(d.join("..v1")).unwrap();
    let a = next(&mut rx).await.unwrap();
    assert_eq!((a.changed, a.documents), (true, 2));
    assert_eq!(active_documents(&store), 2);
    cancel.cancel();
    task.await.unwrap();
}

#[test]
fn thousands_of_bad_documents_make_a_short_error() {
    let store = new_store();
    let loader = ConfigLoader::new(store.clone(), None);
    let text = "apiVersion: v1alpha1\nkind: Bogus\n---\n".repeat(30_000);
    let err = loader.accept(&text, "test").unwrap_err();
    let problems = err.problems();
    assert_eq!(problems.len(), crate::config::MAX_LISTED_PROBLEMS + 1);
    assert_eq!(problems.last().unwrap(), "and 29950 more problems");
    assert!(problems[0].starts_with("document 1 (Bogus): kind: unknown kind"));
    let text = err.to_string();
    assert!(text.len() < 16 * 1024, "{} bytes", text.len());
    let recorded = status(&store).last_error;
    assert!(recorded.len() < 16 * 1024, "{} bytes", recorded.len());
    assert!(recorded.ends_with("and 29950 more problems"), "{recorded}");
}

#[test]
fn a_long_name_is_cut_in_the_error() {
    let name = "n".repeat(1 << 20);
    let text =
        format!("apiVersion: v1alpha1\nkind: HTTPProbeConfig\nname: {name}\nurl: ftp://x/\n");
    let err = validate(&text).unwrap_err().to_string();
    assert!(err.len() < 4096, "{} bytes", err.len());
    assert!(err.contains("url: HTTP probe URL scheme"), "{err}");
}

#[test]
fn deep_nesting_is_refused_before_parsing_naming_document_and_line() {
    let text = format!("{GOOD}---\nkind: X\nv: {}\n", "[".repeat(100_000));
    let err = validate(&text).unwrap_err().to_string();
    assert_eq!(
        err,
        "invalid config: document 2: line 7: nested deeper than 64 levels (the limit of a config)"
    );
}
