//! Controllers and the controller runtime (`docs/runtime.md` §3).
//!
//! Layout: this module defines [`Controller`]; `io` what it declares ([`Input`],
//! [`Output`]); `error` the errors; `registry` the state shared by the runtime and the
//! controller handles (registered controllers, dependencies, input watches fanned out
//! into wake-ups); `handle` the per-controller [`ControllerRuntime`] (checked store
//! access, output tracking) and [`Waker`]; `run` the [`Runtime`] (registration, run
//! loop, restarts with the policy of [`super::backoff`]). Dependencies go one way:
//! `io`, `error` → `registry` → `handle` → `run`.

use futures::future::BoxFuture;

mod error;
mod handle;
mod io;
mod registry;
mod run;

pub use error::{AccessError, ControllerError, RegistrationError, RuntimeError};
pub use handle::{ControllerRuntime, Waker};
pub use io::{Input, InputKind, Output, OutputKind};
pub use registry::{GraphSource, RestartHook};
pub use run::Runtime;

/// Result of a controller's `run`.
pub type ControllerResult = Result<(), ControllerError>;

/// A controller (`docs/runtime.md` §3.1). `run` returning `Ok` finishes it; an error or panic
/// restarts it with backoff, on the same object.
pub trait Controller: Send + 'static {
    /// Unique name; also the owner of what it writes.
    fn name(&self) -> &str;
    /// Initial inputs (more can be added with [`ControllerRuntime::update_inputs`]).
    fn inputs(&self) -> Vec<Input>;
    /// Outputs (static).
    fn outputs(&self) -> Vec<Output>;
    /// The long-running body.
    fn run<'a>(&'a mut self, rt: &'a mut ControllerRuntime) -> BoxFuture<'a, ControllerResult>;
}
