//! Store conformance (`docs/runtime.md` §8, first bullet).

use wirespan_control::{
    runtime::{
        Event, Filter, Kind, LabelTerm, Phase, Pointer, StateError, Store, StoreOptions,
        WatchOptions,
    },
    testing::{int, IntResource},
};

const NS: &str = "default";

fn ptr(id: &str) -> Pointer {
    Pointer::new(NS, "IntResources.test.wirespan.dev", id)
}

fn kind() -> Kind {
    Kind::new(NS, "IntResources.test.wirespan.dev")
}

#[test]
fn create_get_list_sorted_and_duplicate() {
    let s = Store::default();
    for id in ["b", "c", "a"] {
        let md = s.create(int(NS, id, 1), "").unwrap();
        assert_eq!(md.version, 1);
    }
    let got = s.get::<IntResource>(NS, "a").unwrap();
    assert_eq!(got.spec.value, 1);
    assert_eq!(got.metadata.phase, Phase::Running);
    let ids: Vec<String> = s
        .list::<IntResource>(NS, &Filter::all())
        .iter()
        .map(|r| r.metadata.id.clone())
        .collect();
    assert_eq!(ids, ["a", "b", "c"]);
    let err = s.create(int(NS, "a", 2), "").unwrap_err();
    assert!(matches!(err, StateError::AlreadyExists { .. }) && err.is_conflict());
    // Create ignores the caller's version.
    let mut r = int(NS, "d", 1);
    r.metadata.version = 42;
    assert_eq!(s.create(r, "").unwrap().version, 1);
    assert!(s.get::<IntResource>(NS, "zz").unwrap_err().is_not_found());
}

#[test]
fn update_versions_and_conflicts() {
    let s = Store::default();
    s.create(int(NS, "a", 1), "").unwrap();
    let mut r = (*s.get::<IntResource>(NS, "a").unwrap()).clone();
    let created = r.metadata.created;
    r.spec.value = 2;
    let md = s.update(r.clone(), "", Some(Phase::Running)).unwrap();
    assert_eq!(md.version, 2);
    assert_eq!(md.created, created);
    // Stale version.
    let err = s.update(r.clone(), "", Some(Phase::Running)).unwrap_err();
    assert_eq!(
        err,
        StateError::VersionConflict {
            pointer: ptr("a"),
            expected: 1,
            actual: 2
        }
    );
    // Future version.
    r.metadata.version = 9;
    assert!(matches!(
        s.update(r, "", Some(Phase::Running)),
        Err(StateError::VersionConflict { .. })
    ));
    // Identical content still bumps on plain Update.
    let cur = (*s.get::<IntResource>(NS, "a").unwrap()).clone();
    assert_eq!(s.update(cur, "", Some(Phase::Running)).unwrap().version, 3);
    // Missing.
    assert!(s
        .update(int(NS, "zz", 0), "", None)
        .unwrap_err()
        .is_not_found());
}

#[test]
fn owner_rules_and_finalizers_bypass_ownership() {
    let s = Store::default();
    s.create(int(NS, "a", 1), "ctrl").unwrap();
    let cur = (*s.get::<IntResource>(NS, "a").unwrap()).clone();
    assert_eq!(cur.metadata.owner, "ctrl");
    for wrong in ["", "other"] {
        let e = s.update(cur.clone(), wrong, None).unwrap_err();
        assert_eq!(
            e,
            StateError::OwnerConflict {
                pointer: ptr("a"),
                owner: "ctrl".into()
            }
        );
        assert!(matches!(
            s.destroy(&ptr("a"), wrong),
            Err(StateError::OwnerConflict { .. })
        ));
    }
    let md = s.add_finalizer(&ptr("a"), &["f1", "f2"]).unwrap();
    assert_eq!(md.version, 2);
    // Adding a present finalizer is a no-op.
    assert_eq!(s.add_finalizer(&ptr("a"), &["f1"]).unwrap().version, 2);
    let e = s.destroy(&ptr("a"), "ctrl").unwrap_err();
    assert!(
        matches!(e, StateError::PendingFinalizers { ref finalizers, .. } if finalizers == &["f1", "f2"])
    );
    s.remove_finalizer(&ptr("a"), &["f1", "f2"]).unwrap();
    assert_eq!(s.remove_finalizer(&ptr("a"), &["f1"]).unwrap().version, 3);
    s.destroy(&ptr("a"), "ctrl").unwrap();
    assert!(s.destroy(&ptr("a"), "ctrl").unwrap_err().is_not_found());
}

#[test]
fn teardown_ready_idempotent_and_phase_rules() {
    let s = Store::default();
    s.create(int(NS, "a", 1), "o").unwrap();
    s.add_finalizer(&ptr("a"), &["f"]).unwrap();
    assert!(!s.teardown(&ptr("a"), "o").unwrap());
    // Second call skips the owner check.
    assert!(!s.teardown(&ptr("a"), "someone-else").unwrap());
    let cur = (*s.get::<IntResource>(NS, "a").unwrap()).clone();
    assert_eq!(cur.metadata.phase, Phase::TearingDown);
    // Tearing down: not updatable unless any phase is allowed.
    assert!(s
        .update(cur, "o", Some(Phase::Running))
        .unwrap_err()
        .is_phase_conflict());
    let e = s
        .modify::<IntResource>(NS, "a", "o", |r| r.spec.value = 5)
        .unwrap_err();
    assert!(e.is_phase_conflict());
    // PhaseConflict even when the callback changes nothing.
    assert!(s
        .modify::<IntResource>(NS, "a", "o", |_| {})
        .unwrap_err()
        .is_phase_conflict());
    s.try_modify::<IntResource, StateError>(NS, "a", "o", None, |r| {
        r.spec.value = 5;
        Ok(())
    })
    .unwrap();
    s.remove_finalizer(&ptr("a"), &["f"]).unwrap();
    assert!(s.teardown(&ptr("a"), "o").unwrap());
    // Destroy does not require tearing down.
    s.create(int(NS, "b", 1), "").unwrap();
    s.destroy(&ptr("b"), "").unwrap();
}

#[test]
fn modify_create_noop_and_error_propagation() {
    let s = Store::default();
    let mut w = s.watch_kind(&kind(), WatchOptions::default());
    let r = s
        .modify::<IntResource>(NS, "a", "o", |r| r.spec.value = 7)
        .unwrap();
    assert_eq!(
        (r.metadata.version, r.spec.value, r.metadata.owner.as_str()),
        (1, 7, "o")
    );
    // Unchanged: no write, no version bump, no event.
    let r = s
        .modify::<IntResource>(NS, "a", "o", |r| r.spec.value = 7)
        .unwrap();
    assert_eq!(r.metadata.version, 1);
    let r = s
        .modify::<IntResource>(NS, "a", "o", |r| r.spec.value = 8)
        .unwrap();
    assert_eq!(r.metadata.version, 2);
    let mut events = Vec::new();
    futures::executor::block_on(w.recv_batch(&mut events));
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(matches!(events[0], Event::Created(_)));
    assert!(matches!(events[1], Event::Updated { .. }));
    // f sees the current stored spec.
    s.modify::<IntResource>(NS, "a", "o", |r| assert_eq!(r.spec.value, 8))
        .unwrap();
    // Errors from f propagate and nothing is written.
    #[derive(Debug)]
    struct Boom;
    impl From<StateError> for Boom {
        fn from(_: StateError) -> Self {
            Self
        }
    }
    assert!(s
        .try_modify::<IntResource, Boom>(NS, "a", "o", Some(Phase::Running), |_| Err(Boom))
        .is_err());
    assert!(s
        .try_modify::<IntResource, Boom>(NS, "new", "o", Some(Phase::Running), |_| Err(Boom))
        .is_err());
    assert!(s.get::<IntResource>(NS, "new").is_err());
    assert_eq!(s.get::<IntResource>(NS, "a").unwrap().metadata.version, 2);
    // Modify of someone else's resource.
    assert!(matches!(
        s.modify::<IntResource>(NS, "a", "x", |r| r.spec.value = 1),
        Err(StateError::OwnerConflict { .. })
    ));
}

#[tokio::test]
async fn watch_initial_event_then_changes() {
    let s = Store::default();
    let mut w = s.watch(&ptr("a"));
    match w.recv().await.unwrap() {
        Event::Destroyed(t) => assert_eq!(t.metadata().id, "a"),
        e => panic!("{e:?}"),
    }
    s.create(int(NS, "other", 1), "").unwrap();
    s.create(int(NS, "a", 1), "").unwrap();
    assert!(matches!(w.recv().await.unwrap(), Event::Created(r) if r.metadata().id == "a"));
    s.modify::<IntResource>(NS, "a", "", |r| r.spec.value = 2)
        .unwrap();
    match w.recv().await.unwrap() {
        Event::Updated { new, old } => {
            assert_eq!(new.metadata().version, 2);
            assert_eq!(old.metadata().version, 1);
        }
        e => panic!("{e:?}"),
    }
    let mut w2 = s.watch(&ptr("a"));
    assert!(matches!(w2.recv().await.unwrap(), Event::Created(r) if r.metadata().version == 2));
}

#[tokio::test]
async fn kind_watch_bootstrap_in_id_order() {
    let s = Store::default();
    for id in ["c", "a", "b"] {
        s.create(int(NS, id, 1), "").unwrap();
    }
    let mut w = s.watch_kind(&kind(), WatchOptions::bootstrapped());
    let mut ids = Vec::new();
    loop {
        match w.recv().await.unwrap() {
            Event::Created(r) => ids.push(r.metadata().id.clone()),
            Event::Bootstrapped => break,
            e => panic!("{e:?}"),
        }
    }
    assert_eq!(ids, ["a", "b", "c"]);
    s.destroy(&ptr("b"), "").unwrap();
    assert!(matches!(w.recv().await.unwrap(), Event::Destroyed(r) if r.metadata().id == "b"));
}

#[tokio::test]
async fn label_filter_transforms_updates() {
    let s = Store::default();
    let mut r = int(NS, "a", 1);
    r.metadata.labels.insert("sel".into(), "no".into());
    s.create(r, "").unwrap();
    let opts = WatchOptions {
        bootstrap: true,
        filter: Filter::labels(vec![LabelTerm::equal("sel", "yes")]),
    };
    let mut w = s.watch_kind(&kind(), opts);
    assert!(matches!(w.recv().await.unwrap(), Event::Bootstrapped));
    let set = |v: &'static str| {
        s.update_metadata(&ptr("a"), None, None, |m| {
            m.labels.insert("sel".into(), v.into());
        })
        .unwrap();
    };
    set("yes"); // not matched -> matched: Created
    s.modify::<IntResource>(NS, "a", "", |r| r.spec.value = 2)
        .unwrap(); // both: Updated
    set("no"); // matched -> not matched: Destroyed
    s.modify::<IntResource>(NS, "a", "", |r| r.spec.value = 3)
        .unwrap(); // neither: dropped
    set("yes");
    let mut got = Vec::new();
    for _ in 0..4 {
        got.push(match w.recv().await.unwrap() {
            Event::Created(_) => "created",
            Event::Updated { .. } => "updated",
            Event::Destroyed(_) => "destroyed",
            e => panic!("{e:?}"),
        });
    }
    assert_eq!(got, ["created", "updated", "destroyed", "created"]);
}

#[tokio::test]
async fn overrun_errors_once_and_ends_the_watch() {
    let s = Store::new(StoreOptions {
        history_capacity: 10,
    });
    let mut w = s.watch_kind(&kind(), WatchOptions::default());
    for i in 0..11 {
        s.create(int(NS, &format!("r{i}"), i), "").unwrap();
    }
    match w.recv().await.unwrap() {
        Event::Errored(e @ StateError::Overrun { .. }) => {
            assert!(e.to_string().contains("buffer overrun"));
        }
        e => panic!("{e:?}"),
    }
    assert!(w.recv().await.is_none());
}

#[tokio::test]
async fn concurrent_finalizers_are_all_kept() {
    let s = Store::default();
    s.create(int(NS, "a", 1), "o").unwrap();
    let mut tasks = Vec::new();
    for t in 0..8 {
        let s = s.clone();
        tasks.push(tokio::task::spawn_blocking(move || {
            for i in 0..25 {
                s.add_finalizer(&ptr("a"), &[&format!("f{t}-{i}")]).unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let r = s.get::<IntResource>(NS, "a").unwrap();
    assert_eq!(r.metadata.finalizers.iter().count(), 200);
    assert_eq!(r.metadata.version, 201);
}

#[tokio::test]
async fn teardown_and_destroy_waits_for_finalizers() {
    let s = Store::default();
    s.create(int(NS, "a", 1), "o").unwrap();
    s.add_finalizer(&ptr("a"), &["f"]).unwrap();
    let s2 = s.clone();
    let task = tokio::spawn(async move { s2.teardown_and_destroy(&ptr("a"), "o").await });
    s.watch_for(
        &ptr("a"),
        |e| matches!(e, Event::Updated { new, .. } if new.metadata().phase == Phase::TearingDown),
    )
    .await
    .unwrap();
    let token = s.context_with_teardown(&ptr("a"));
    token.cancelled().await;
    assert!(!task.is_finished());
    s.remove_finalizer(&ptr("a"), &["f"]).unwrap();
    task.await.unwrap().unwrap();
    assert!(s.get::<IntResource>(NS, "a").unwrap_err().is_not_found());
}
