//! What every Lanyard binary does before its role runs: the global flags,
//! configuration sources (file, `LANYARD_*` environment, flags), logging,
//! process hardening and the runtime.
//!
//! A crate of its own so that the full `lanyard` binary and the slim
//! `lanyard-sidecar` start the same way without the sidecar linking the
//! agent's code: it depends on `lanyard-core` only.

pub mod flags;
pub mod logging;
pub mod sources;
mod start;

pub use flags::{GlobalArgs, Overrides, UsageError};
pub use start::{run_with, Logging};
