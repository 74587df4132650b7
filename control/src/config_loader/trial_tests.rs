//! Config trials through the loader: what is in force, what is last good, what a
//! restart finds, on a clock passed in.

use std::{
    os::unix::fs::PermissionsExt as _,
    time::{Duration, SystemTime},
};

use super::*;
use crate::runtime::StoreOptions;

const GOOD: &str = "apiVersion: v1alpha1\nkind: AddressConfig\nlink: eth0\naddress: 10.0.0.1/24\n";

fn two() -> String {
    format!("{GOOD}---\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth0\nmtu: 1400\n")
}

fn three() -> String {
    format!(
        "{}---\napiVersion: v1alpha1\nkind: LinkConfig\nname: eth1\nmtu: 1400\n",
        two()
    )
}

fn status(store: &Store) -> ConfigStatusSpec {
    store
        .get::<ConfigStatus>("config", CURRENT)
        .unwrap()
        .spec
        .clone()
}

fn documents(store: &Store) -> usize {
    store
        .get::<MachineConfig>("config", ACTIVE)
        .unwrap()
        .spec
        .document_count
}

fn for_(secs: u64) -> TrialOptions {
    TrialOptions {
        timeout: Duration::from_secs(secs),
        probe: None,
    }
}

struct Node {
    _dir: tempfile::TempDir,
    state: PathBuf,
    store: Store,
    loader: ConfigLoader,
}

impl Node {
    /// A node with GOOD in force.
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let store = Store::new(StoreOptions::default());
        let loader = ConfigLoader::in_state_dir(store.clone(), &state);
        loader.accept(GOOD, "test").unwrap();
        Self {
            _dir: dir,
            state,
            store,
            loader,
        }
    }

    fn last_good(&self) -> String {
        std::fs::read_to_string(self.state.join(LAST_GOOD_FILE)).unwrap()
    }

    fn trial_file(&self) -> PathBuf {
        self.state.join(TRIAL_FILE)
    }

    /// The same state dir, a new process.
    fn restart(&self) -> (Store, ConfigLoader) {
        let store = Store::new(StoreOptions::default());
        let loader = ConfigLoader::in_state_dir(store.clone(), &self.state);
        loader.start(None).unwrap();
        (store, loader)
    }
}

#[test]
fn a_trial_is_in_force_at_once_never_last_good_and_rolls_back_at_its_deadline() {
    let n = Node::new();
    let t0 = SystemTime::now();
    let (a, deadline) = n
        .loader
        .accept_trial(&two(), "api (trial)", for_(15), None, t0)
        .unwrap();
    assert!(a.changed);
    let (deadline, want) = (deadline.unwrap(), t0 + Duration::from_secs(15));
    assert!(deadline <= want && want < deadline + Duration::from_millis(1));
    assert_eq!(
        documents(&n.store),
        2,
        "the trial config is in force at once"
    );
    assert_eq!(n.last_good(), GOOD, "the trial config is not last good");
    let mode = std::fs::metadata(n.trial_file())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
    let st = status(&n.store);
    assert_eq!(st.trial_version, version_of(&two()));
    assert_eq!(st.trial_previous_version, version_of(GOOD));
    assert!(!st.trial_deadline.is_empty());

    let before = t0 + Duration::from_secs(14);
    assert_eq!(n.loader.check_trial(before, None).unwrap(), None);
    assert_eq!(documents(&n.store), 2);

    let at = t0 + Duration::from_secs(15);
    let why = n
        .loader
        .check_trial(at, None)
        .unwrap()
        .expect("rolled back");
    assert!(matches!(why, RollbackReason::Expired { .. }), "{why:?}");
    assert_eq!(documents(&n.store), 1, "the earlier config is back");
    assert!(!n.trial_file().exists());
    assert!(n.loader.trial().is_none());
    let st = status(&n.store);
    assert_eq!(st.accepted_version, version_of(GOOD));
    assert_eq!(st.source, ROLLBACK_SOURCE);
    assert!(st.trial_version.is_empty() && st.trial_deadline.is_empty());
    assert!(
        st.last_trial.starts_with(&format!(
            "rolled back to {}: not confirmed by its deadline",
            version_of(GOOD)
        )),
        "{}",
        st.last_trial
    );
    assert_eq!(n.last_good(), GOOD);
}

#[test]
fn confirming_makes_the_trial_config_last_good_and_ends_the_trial() {
    let n = Node::new();
    let t0 = SystemTime::now();
    n.loader
        .accept_trial(&two(), "api (trial)", for_(15), None, t0)
        .unwrap();
    let c = n.loader.confirm().unwrap();
    assert_eq!((c.version, c.config), (version_of(&two()), two()));
    assert_eq!(n.last_good(), two());
    assert!(!n.trial_file().exists());
    let later = t0 + Duration::from_secs(3600);
    assert_eq!(n.loader.check_trial(later, None).unwrap(), None);
    assert_eq!(documents(&n.store), 2);
    let st = status(&n.store);
    assert_eq!(
        st.last_trial,
        format!("confirmed version {}", version_of(&two()))
    );
    assert!(st.trial_version.is_empty());
    assert!(matches!(n.loader.confirm(), Err(LoadError::NoTrial)));
    // And a restart keeps it.
    let (store, _loader) = n.restart();
    assert_eq!(documents(&store), 2);
}

#[test]
fn a_plain_apply_ends_the_trial_and_is_last_good_even_when_it_is_the_trial_config() {
    let n = Node::new();
    let t0 = SystemTime::now();
    n.loader
        .accept_trial(&two(), "api (trial)", for_(15), None, t0)
        .unwrap();
    let a = n.loader.accept(&two(), "api").unwrap();
    assert!(!a.changed, "the same text was in force");
    assert_eq!(n.last_good(), two());
    assert!(n.loader.trial().is_none() && !n.trial_file().exists());
    let later = t0 + Duration::from_secs(3600);
    assert_eq!(n.loader.check_trial(later, None).unwrap(), None);
    assert_eq!(documents(&n.store), 2);
    assert_eq!(
        status(&n.store).last_trial,
        "ended by a plain apply from api"
    );
}

#[test]
fn a_trial_over_a_trial_rolls_back_to_the_config_before_the_first() {
    let n = Node::new();
    let t0 = SystemTime::now();
    n.loader
        .accept_trial(&two(), "api (trial)", for_(15), None, t0)
        .unwrap();
    n.loader
        .accept_trial(&three(), "api (trial)", for_(15), None, t0)
        .unwrap();
    assert_eq!(documents(&n.store), 3);
    n.loader
        .check_trial(t0 + Duration::from_secs(15), None)
        .unwrap()
        .expect("rolled back");
    assert_eq!(documents(&n.store), 1);
}

#[test]
fn a_trial_needs_an_earlier_config_a_sane_timeout_and_the_expected_base() {
    let store = Store::new(StoreOptions::default());
    let loader = ConfigLoader::new(store, None);
    let now = SystemTime::now();
    let e = loader
        .accept_trial(GOOD, "api (trial)", for_(15), None, now)
        .unwrap_err();
    assert!(matches!(e, LoadError::NothingToRollBackTo), "{e}");

    let n = Node::new();
    let e = n
        .loader
        .accept_trial(&two(), "api (trial)", for_(0), None, now)
        .unwrap_err();
    assert!(matches!(e, LoadError::TrialTimeout(_)), "{e}");
    let e = n
        .loader
        .accept_trial(&two(), "api (trial)", for_(15), Some("0123"), now)
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "the config in force is version {}, not 0123 that the change was made against; fetch it again",
            version_of(GOOD)
        )
    );
    assert!(n.loader.trial().is_none() && !n.trial_file().exists());
    // The config in force already: nothing to try.
    let (a, deadline) = n
        .loader
        .accept_trial(GOOD, "api (trial)", for_(15), None, now)
        .unwrap();
    assert!(!a.changed && deadline.is_none());
}

#[test]
fn a_restart_past_the_deadline_comes_up_on_the_earlier_config() {
    let n = Node::new();
    let started = SystemTime::now() - Duration::from_secs(20);
    n.loader
        .accept_trial(&two(), "api (trial)", for_(15), None, started)
        .unwrap();
    // The process dies here: nothing rolled back, the trial file stays.
    assert!(n.trial_file().exists());
    let (store, loader) = n.restart();
    assert_eq!(documents(&store), 1);
    assert!(loader.trial().is_none());
    assert!(!n.trial_file().exists());
    let st = status(&store);
    assert_eq!(st.accepted_version, version_of(GOOD));
    assert!(
        st.last_trial.starts_with(&format!(
            "rolled back to {} at start: not confirmed by its deadline",
            version_of(GOOD)
        )),
        "{}",
        st.last_trial
    );
}

#[test]
fn a_restart_before_the_deadline_resumes_the_trial_and_an_unreadable_one_is_dropped() {
    let n = Node::new();
    let t0 = SystemTime::now();
    n.loader
        .accept_trial(&two(), "api (trial)", for_(3600), None, t0)
        .unwrap();
    let (store, loader) = n.restart();
    assert_eq!(documents(&store), 2, "the trial config is back in force");
    let t = loader.trial().expect("the trial goes on");
    assert_eq!(t.deadline, n.loader.trial().unwrap().deadline);
    assert_eq!(status(&store).trial_version, version_of(&two()));
    assert_eq!(n.last_good(), GOOD);
    loader
        .check_trial(t0 + Duration::from_secs(3600), None)
        .unwrap()
        .expect("rolled back");
    assert_eq!(documents(&store), 1);

    std::fs::write(n.trial_file(), "{not json").unwrap();
    let (store, loader) = n.restart();
    assert_eq!(documents(&store), 1);
    assert!(loader.trial().is_none() && !n.trial_file().exists());
    assert!(status(&store)
        .last_trial
        .starts_with("rolled back at start: the trial file is unusable"));
}

#[test]
fn probe_failures_count_only_for_the_trial_they_were_seen_for() {
    let n = Node::new();
    let t0 = SystemTime::now();
    let opts = TrialOptions {
        timeout: Duration::from_secs(60),
        probe: Some(ReachabilityProbe {
            endpoint: "127.0.0.1:9".into(),
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            failure_threshold: 3,
        }),
    };
    n.loader
        .accept_trial(&two(), "api (trial)", opts, None, t0)
        .unwrap();
    let started = n.loader.trial().unwrap().started;
    let other = started - Duration::from_secs(1);
    assert_eq!(
        n.loader
            .check_trial(t0, Some((other, 5, "refused")))
            .unwrap(),
        None
    );
    assert_eq!(
        n.loader
            .check_trial(t0, Some((started, 2, "refused")))
            .unwrap(),
        None
    );
    let why = n
        .loader
        .check_trial(t0, Some((started, 3, "refused")))
        .unwrap()
        .expect("rolled back");
    assert!(matches!(why, RollbackReason::Unreachable { .. }), "{why:?}");
    assert_eq!(documents(&n.store), 1);
    assert!(status(&n.store)
        .last_trial
        .contains("127.0.0.1:9 unreachable 3"));
}

async fn wait_for(store: &Store, docs: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while documents(store) != docs {
        assert!(
            tokio::time::Instant::now() < deadline,
            "still {} documents",
            documents(store)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_enforcer_rolls_back_at_the_deadline_and_when_the_probe_fails() {
    let n = Node::new();
    let cancel = CancellationToken::new();
    let _stop = cancel.clone().drop_guard();
    tokio::spawn(n.loader.enforce_trials(cancel.clone()));
    let opts = TrialOptions {
        timeout: Duration::from_millis(300),
        probe: None,
    };
    n.loader
        .accept_trial(&two(), "api (trial)", opts, None, SystemTime::now())
        .unwrap();
    assert_eq!(documents(&n.store), 2);
    wait_for(&n.store, 1).await;

    // A port nothing listens on: connects are refused at once.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = closed.local_addr().unwrap().to_string();
    drop(closed);
    let opts = TrialOptions {
        timeout: Duration::from_secs(3600),
        probe: Some(ReachabilityProbe {
            endpoint: endpoint.clone(),
            interval: Duration::from_millis(50),
            timeout: Duration::from_secs(1),
            failure_threshold: 2,
        }),
    };
    n.loader
        .accept_trial(&two(), "api (trial)", opts, None, SystemTime::now())
        .unwrap();
    assert_eq!(documents(&n.store), 2);
    wait_for(&n.store, 1).await;
    let last = status(&n.store).last_trial;
    assert!(
        last.contains(&format!("{endpoint} unreachable 2")),
        "{last}"
    );
}
