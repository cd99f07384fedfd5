//! Shared plumbing of every role (agent, sidecar, webhook, `lanyard dev`):
//! serving is the `lanyard-http` crate's, re-exported here; the outbound
//! clients every exchanger, JWKS fetch and Kubernetes watch use are this
//! module's own. It lives here rather than in any one role so that each
//! role can be built without the others (`lanyard dev` is the optional
//! `dev` feature).

pub use lanyard_http::*;

use std::time::Duration;

/// The longest a single Kubernetes API request on a pod's credential path
/// (a direct read, a TokenReview) may take. The client's own read timeout
/// is long (watches hold a request for minutes); SDKs give up in seconds.
pub const KUBE_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The Kubernetes API client, configured as `kube::Client::try_default`
/// does (in-cluster, or `KUBECONFIG`), without kube's default retry layer:
/// that retries 429, 503 and 504 up to 15 times with exponential backoff,
/// minutes in all, and a pod's credential request (a ServiceAccount read
/// directly, the issuer's keys, a TokenReview) must not wait minutes on an
/// API server outage. Callers handle the error; the watchers back off on
/// their own.
pub async fn kube_client() -> Result<kube::Client, kube::Error> {
    let mut config = kube::Config::infer()
        .await
        .map_err(kube::Error::InferConfig)?;
    config.default_retry = false;
    kube::Client::try_from(config)
}

/// Builds the outbound HTTP client: rustls, bounded timeouts, no redirects
/// (token endpoints never redirect; following one could leak a subject
/// token to another host).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(15))
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("lanyard/", env!("CARGO_PKG_VERSION")))
        .build()
        // Building fails only if the TLS backend cannot initialise, which is
        // a broken installation rather than a runtime condition.
        .expect("failed to initialise the HTTP client (TLS backend)")
}
