//! Logging setup and the decision record.
//!
//! Logs go to stderr (stdout is reserved for `lanyard dev`'s exports), as
//! text for people or JSON for collectors. (Decision records are the
//! `audit` module's; its default sink writes them to this log.)

pub mod metrics;

use tracing_subscriber::{fmt, EnvFilter};

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

/// The admin endpoints: `/metrics` (Prometheus text), `/healthz` (the
/// process serves) and `/readyz` (it is ready to serve credentials).
pub fn admin_router(
    metrics: std::sync::Arc<metrics::Metrics>,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> axum::Router {
    use axum::http::StatusCode;
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
                let ready = ready.load(std::sync::atomic::Ordering::Acquire);
                async move {
                    if ready {
                        (StatusCode::OK, "ready")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                    }
                }
            }),
        )
}
