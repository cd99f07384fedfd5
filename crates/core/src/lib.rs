//! Lanyard's core: the types every other crate shares, with no I/O, as
//! kube-core is to kube-rs: the clouds, the request and identity model and
//! the credentials ([`cloud`]), what a broker yields and why it refuses
//! ([`grant`]), why a caller's token was refused ([`token`]), the
//! Kubernetes names Lanyard checks ([`names`]), its secrets ([`secret`])
//! and an error's text with its causes ([`error_text`])
//! (docs/architecture.md, "Crates").
//!
//! INVARIANT: no dependency here does I/O (no tokio, hyper, reqwest, kube):
//! `tests/crate_layers.rs` fails when one appears.

pub mod cloud;
pub mod error_text;
pub mod grant;
pub mod names;
pub mod secret;
pub mod text;
pub mod token;
