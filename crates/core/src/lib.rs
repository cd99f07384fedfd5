//! Lanyard's core: the types every other crate shares, with no I/O, as
//! kube-core is to kube-rs. For now the Kubernetes names Lanyard checks
//! ([`names`]), its secrets ([`secret`]) and an error's text with its
//! causes ([`error_text`]); the request and identity
//! model, the cloud table and the credentials follow, layer by layer
//! (docs/architecture.md, "Crates").
//!
//! INVARIANT: no dependency here does I/O (no tokio, hyper, reqwest, kube):
//! `tests/crate_layers.rs` fails when one appears.

pub mod error_text;
pub mod names;
pub mod secret;
