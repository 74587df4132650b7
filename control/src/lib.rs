//! wirespan-control: the node's control plane.
//!
//! A COSI-style resource runtime (resources, an in-memory watchable store, controllers
//! with declared inputs and outputs), the resources and controllers of the mesh, the
//! configuration model and the resource API served to the CLI.

pub mod api;
pub mod resources;
pub mod runtime;
pub mod testing;
