//! `lanyard webhook`: the mutating admission webhook that gives opted-in
//! pods (KubeRay and Anyscale Ray heads and workers, batch Jobs, anything
//! with the `lanyard.dev/inject: "true"` label) their credentials without
//! changing the pods' own specs or images.
//!
//! This module is the pure part: [`review`] reads and writes
//! `admission.k8s.io/v1` AdmissionReviews, [`mod@mutate`] turns a pod and its
//! ServiceAccount's bindings into one JSON Patch (after `own` has checked
//! that whatever of Lanyard's the pod already carries is exactly
//! Lanyard's), and [`guard`] decides `POST /validate` for governed
//! namespaces. No HTTP, TLS or Kubernetes client here, so every decision is
//! testable on plain JSON; the server around `/mutate`:
//!
//! 1. reads at most [`review::MAX_BODY_BYTES`] of the `POST /mutate` body;
//! 2. [`review::parse`]s it; on error answers [`review::ReviewError::response`];
//! 3. for [`review::Action::AllowUnchanged`] answers [`review::allow`] without a patch;
//! 4. for [`review::Action::Mutate`] looks up the bindings of
//!    [`mutate::service_account_name`] in the review's namespace, calls
//!    [`mutate::mutate`], and answers [`respond`].
//!
//! What the patch adds (only what the pod lacks, so a reinvoked webhook
//! adds nothing twice): a native sidecar (`initContainers[0]`,
//! `restartPolicy: Always`) serving every SDK surface on
//! `127.0.0.1:PORT` and probes on `0.0.0.0:PROBE_PORT`; a projected volume
//! of one token per bound cloud, for the sidecar only; for AWS, an app-facing
//! token mounted at [`vocabulary::APP_TOKEN_DIR`] in the sidecar
//! (`LANYARD_APP_TOKEN_FILE`) and the apps
//! (`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`); and in every other container
//! the variables that point each SDK at the sidecar, plus `NO_PROXY` /
//! `no_proxy` extended with 127.0.0.1. Pods annotated
//! `lanyard.dev/transparent: "true"` also get transparent mode: an init
//! container before the sidecar, [`vocabulary::REDIRECT_NAME`], that redirects
//! `169.254.169.254:80` to the sidecar in the pod's network namespace
//! ([`crate::transparent`]), and a `hostAliases` entry for
//! `metadata.google.internal` and `metadata`.
//!
//! Variables a container sets in `env` are never overwritten. Variables
//! that come from `envFrom` or the image cannot be seen at admission: an
//! injected `env` entry takes precedence over them (Kubernetes gives `env`
//! priority over `envFrom`), except for `NO_PROXY`, whose injected value
//! refers back to the `envFrom` one. Users who set, say, `AWS_REGION`
//! through `envFrom` get the webhook's value; list such containers in
//! `lanyard.dev/skip-containers` to keep theirs.

mod defaults;
pub mod guard;
mod inject;
pub mod mutate;
mod own;
pub mod patch;
mod recognise;
pub mod review;
pub mod server;
pub mod vocabulary;

pub use mutate::{mutate, InjectedSummary, Mutation};
pub use review::{parse, Action, Answer, Review, ReviewError};
pub use vocabulary::{Denial, InjectionConfig, SidecarResources};

/// The review answer for a mutation outcome.
pub fn respond(uid: &str, outcome: &Result<Mutation, Denial>) -> review::Answer {
    match outcome {
        Ok(m) => review::allow(uid, Some(&m.patch), &m.warnings),
        Err(d) => review::deny(uid, d.code, &d.message),
    }
}
