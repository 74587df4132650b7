//! Controllers and the controller runtime (`docs/runtime.md` §3).
//!
//! Layout: this module defines [`Controller`]; `io` what it declares ([`Input`],
//! [`Output`]); `error` the errors; `registry` the state shared by the runtime and the
//! controller handles (registered controllers, dependencies, input watches fanned out
//! into wake-ups); `handle` the per-controller [`ControllerRuntime`] (checked store
//! access, output tracking) and [`Waker`]; `action` what a controller says about
//! waiting ([`Triggers`], [`Action`]); `drive` one controller's loop (waiting, rounds
//! in its span, restarts with the policy of [`super::backoff`]); `run` the [`Runtime`]
//! (registration, starting every driver). Dependencies go one way: `io`, `error`,
//! `action` → `registry` → `handle` → `drive` → `run`.

use futures::future::BoxFuture;

mod action;
mod drive;
mod error;
mod handle;
mod io;
mod registry;
mod run;

pub use action::{Action, Triggers};
pub use error::{AccessError, ControllerError, RegistrationError, RuntimeError};
pub use handle::{ControllerRuntime, Waker};
pub use io::{Input, InputKind, Output, OutputKind};
pub use registry::{GraphSource, RestartHook};
pub use run::Runtime;

/// Result of one round: what to wait for next, or why it failed.
pub type ControllerResult<E = ()> = Result<Action<E>, ControllerError>;

/// A controller (`docs/runtime.md` §3.1): a name, declared inputs and outputs, and a
/// body that does one round. The runtime owns the loop: it waits for the triggers,
/// runs the rounds inside the controller's `tracing` span, restarts a failed or
/// panicking controller (on the same object) after its backoff, and stops it on
/// shutdown.
pub trait Controller: Send + 'static {
    /// What its event stream ([`Triggers::with_events`]) and [`Action::requeue_when`]
    /// hand to a round; `()` when it has none.
    type Event: Send + 'static;

    /// Unique name; also the owner of what it writes and its span's `controller` field.
    fn name(&self) -> &str;
    /// Initial inputs (more can be added with [`ControllerRuntime::update_inputs`]).
    fn inputs(&self) -> Vec<Input>;
    /// Outputs (static).
    fn outputs(&self) -> Vec<Output>;

    /// Runs before the first round and again before the first round after every
    /// restart: resets what a restart must forget and says what else wakes it.
    ///
    /// # Errors
    /// Fails the start, which is retried after the backoff.
    fn start(
        &mut self,
        _rt: &mut ControllerRuntime,
    ) -> Result<Triggers<Self::Event>, ControllerError> {
        Ok(Triggers::inputs_only())
    }

    /// One round: read the inputs, write the outputs, say when to run again. `events`
    /// are the stream's items (or the requeue future's output) since the last round,
    /// empty when something else woke it.
    fn reconcile<'a>(
        &'a mut self,
        rt: &'a mut ControllerRuntime,
        events: Vec<Self::Event>,
    ) -> BoxFuture<'a, ControllerResult<Self::Event>>;

    /// Runs once when the runtime shuts down (not after a failure).
    fn stop<'a>(&'a mut self, _rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}
