//! Emulators that stand in for what `lanyard dev` and the tests cannot reach:
//! a Kubernetes service-account token issuer and the clouds' token services.
//! Each validates requests the way the real service does (signatures against
//! the issuer's published keys, issuer/subject/audience matching, expiry)
//! and answers in the real service's error format. An emulator that accepted
//! anything would prove nothing.

pub mod aws;
pub mod entra;
pub mod gcp;
pub mod issuer;
pub mod keys;
pub mod kube_api;

pub use issuer::{Issuer, PodIdentity};
pub use keys::SigningKey;
