//! The COSI-style resource runtime: resources, the in-memory store, watches and the
//! controller runtime (`docs/runtime.md` §1–§3).
//!
//! Store and watches are layered one way (apart from `metadata`, `query` and
//! `resource`, each module uses only those before it, never one after it):
//! `error` ([`StateError`]) → `event` ([`Event`], [`WatchOptions`]) → `channel` (a
//! kind's resources, event ring and wake-up, shared by writer and readers) → `watch`
//! ([`KindWatch`], reads a channel) → `store` ([`Store`], writes channels and opens
//! watches) → `controller` and `feed`.

pub mod backoff;
mod channel;
pub mod controller;
mod error;
mod event;
pub mod feed;
pub mod graph;
mod harness;
pub mod metadata;
pub mod query;
pub mod resource;
pub mod store;
pub mod watch;

pub use controller::{
    AccessError, Action, Controller, ControllerError, ControllerResult, ControllerRuntime,
    GraphSource, Input, InputKind, Output, OutputKind, RegistrationError, RestartHook, Runtime,
    RuntimeError, Triggers, Waker,
};
pub use feed::{ChangeFeed, Changes};
pub use harness::Harness;
pub use metadata::{Finalizers, Kind, Metadata, Phase, Pointer};
pub use query::{Filter, LabelOp, LabelQuery, LabelTerm};
pub use resource::{downcast, AnyResource, Definition, PrintColumn, Resource, ResourceKind};
pub use store::{StateError, Store, StoreOptions};
pub use watch::{Event, KindWatch, WatchOptions};
