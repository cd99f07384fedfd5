//! The pod sidecar: every SDK surface on loopback inside the pod, backed by
//! the node agent. It reads the pod's projected tokens from a directory
//! the kubelet keeps fresh (one file per cloud audience: `azure`, `gcp`,
//! `aws`, plus `app`, the app-facing token that authorizes the AWS
//! container endpoint).
//!
//! A crate of its own because it runs in every opted-in pod: Cargo keeps
//! it from linking the agent's code (no Cedar, no Kubernetes client, no
//! exchanger; `tests/crate_layers.rs` checks it), so the process maps far
//! less code, which is most of its resident memory. It depends on the SDK
//! surfaces, the agent API's client, the serving crate and start-up only.
//! The full `lanyard` binary runs the same code as `lanyard sidecar`, and
//! adds standalone mode (exchanging with the clouds from the pod), which
//! needs what this crate leaves out.

pub mod args;
pub mod config;
mod probe;
mod serving;
mod token_files;
pub mod transparent;

pub use probe::probe_ready;
pub use serving::{run, Sidecar};
pub use token_files::{token_file, FileTokens};
