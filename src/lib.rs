//! Lanyard: a node-local credential broker.
//!
//! A pod's projected Kubernetes service-account token goes in; short-lived
//! cloud credentials come out on the metadata-style endpoints each cloud's
//! SDKs already speak. See `docs/architecture.md` for the module map.
//!
//! The default-on `dev` feature adds `lanyard dev` ([`dev`]), which wires
//! the product to the `lanyard-emulators` crate (the built-in issuer and
//! the cloud emulators). Without the feature that crate is not a
//! dependency at all (`--no-default-features`); with it, only `dev` may
//! name it (`scripts/module-cycles` fails otherwise); and it does not
//! depend on this crate.

pub use lanyard_core::{error_text, names, secret};
pub use lanyard_sidecar::transparent;
/// The SDK surfaces (the crate `lanyard-surfaces`).
pub use lanyard_surfaces as serve;

pub mod agent;
pub mod audit;
pub mod broker;
pub mod cache;
pub mod cli;
pub mod cloud;
pub mod config;
#[cfg(feature = "dev")]
pub mod dev;
pub mod directory;
pub mod doctor;
pub mod http;
pub mod pod_events;
pub mod policy;
pub mod sidecar;
pub mod telemetry;
pub mod token;
pub mod webhook;
