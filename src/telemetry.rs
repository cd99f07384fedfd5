//! Logging setup and the decision record.
//!
//! Logs go to stderr (stdout is reserved for `lanyard dev`'s exports), as
//! text for people or JSON for collectors. Every broker decision emits one
//! record on the `lanyard::audit` target carrying a token fingerprint,
//! never a token.

pub mod metrics;
mod readiness;

pub use readiness::{Condition, Readiness, ReadinessBuilder};

use std::time::Duration;

use tracing_subscriber::{fmt, EnvFilter};

use crate::broker::BrokerError;
use crate::cloud::Cloud;
use crate::secret::{fingerprint, ExposeSecret, SecretString};
use crate::token::Caller;

/// Log line format.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides `level`.
pub fn init(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Emits the decision record for one token request.
pub fn audit_decision(
    cloud: Cloud,
    caller: Option<&Caller>,
    subject: &SecretString,
    resource: &str,
    outcome: Result<&str, &BrokerError>,
    latency: Duration,
) {
    let token_fp = caller
        .map(|c| c.token_fingerprint.clone())
        .unwrap_or_else(|| fingerprint(subject.expose_secret()));
    let namespace = caller.map(|c| c.namespace.as_str()).unwrap_or("");
    let service_account = caller.map(|c| c.service_account.as_str()).unwrap_or("");
    let pod = caller
        .and_then(|c| c.pod.as_ref())
        .map(|p| p.name.as_str())
        .unwrap_or("");
    let latency_ms = latency.as_secs_f64() * 1000.0;
    match outcome {
        Ok(identity) => tracing::info!(
            target: "lanyard::audit",
            decision = "allow",
            %cloud, namespace, service_account, pod, identity, resource,
            token_fingerprint = %token_fp, latency_ms,
            "credential issued"
        ),
        Err(err) => tracing::warn!(
            target: "lanyard::audit",
            decision = "deny",
            %cloud, namespace, service_account, pod, resource,
            reason = err.reason(), error = %err,
            token_fingerprint = %token_fp, latency_ms,
            "credential refused"
        ),
    }
}

/// The admin endpoints: `/metrics` (Prometheus text), `/healthz` (the
/// process serves) and `/readyz` (it is ready to serve credentials: 200
/// `ready`, or 503 naming each condition still awaited).
pub fn admin_router(
    metrics: std::sync::Arc<metrics::Metrics>,
    readiness: Readiness,
) -> axum::Router {
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let answer = readyz(&readiness);
                async move { answer }
            }),
        )
}

/// The `/readyz` answer for `readiness`.
fn readyz(readiness: &Readiness) -> (axum::http::StatusCode, String) {
    use axum::http::StatusCode;
    // One read of the conditions, so the status and the list agree.
    let unmet = readiness.unmet();
    if unmet.is_empty() {
        (StatusCode::OK, "ready".to_string())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}", unmet.join(", ")),
        )
    }
}
