//! The agent API: the hop between a pod's sidecar and its node's agent.
//!
//! [`wire`] is the format (`POST /v1/token`, the uniform request in, a
//! grant or a classified error out), which the agent serves and the
//! sidecar speaks; [`remote`] is the sidecar's client of the agent, a
//! [`TokenBroker`](lanyard_core::grant::TokenBroker) like the pipeline
//! itself; [`reuse`] is the sidecar's short reuse of the agent's grants.
//!
//! INVARIANT: nothing here links the broker's pipeline, Cedar, kube or an
//! exchanger: the sidecar depends on this crate, and
//! `tests/crate_layers.rs` fails when one appears.

pub mod remote;
pub mod reuse;
pub mod wire;
