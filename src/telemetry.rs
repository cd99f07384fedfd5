//! Logging setup and the decision record.
//!
//! Logs go to stderr (stdout is reserved for `lanyard dev`'s exports), as
//! text for people or JSON for collectors. (Decision records are the
//! `audit` module's; its default sink writes them to this log.)

pub mod metrics;
mod readiness;

pub use readiness::{Condition, Readiness, ReadinessBuilder};

use tracing_subscriber::{fmt, EnvFilter};

/// Log line format.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines (`tracing`'s default format).
    Text,
    /// One JSON object per line, event fields flattened to the top level.
    Json,
}

/// Installs the global subscriber. `RUST_LOG` overrides `level`.
pub fn init(format: LogFormat, level: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // Colours only for a person at a terminal: log collectors and files
    // get plain text, and no time is spent on escape codes.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
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
