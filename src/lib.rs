//! Lanyard: a node-local credential broker.
//!
//! A pod's projected Kubernetes service-account token goes in; short-lived
//! cloud credentials come out on the metadata-style endpoints each cloud's
//! SDKs already speak. See `docs/architecture.md` for the module map.

pub mod agent;
pub mod audit;
pub mod broker;
pub mod cache;
pub mod cli;
pub mod cloud;
pub mod config;
pub mod dev;
pub mod directory;
pub mod emulator;
pub mod http;
pub mod secret;
pub mod serve;
pub mod sidecar;
pub mod telemetry;
pub mod token;
pub mod webhook;
