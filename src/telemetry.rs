//! Metrics, readiness and the admin endpoints; logging set-up is
//! `lanyard-startup`'s (the slim sidecar shares it), re-exported here.
//!
//! (Decision records are the `audit` module's; its default sink writes
//! them to this log.)

pub mod metrics;
mod readiness;

pub use lanyard_startup::logging::{
    direct_line, init, plain_text_log, text_fields, timestamp, LogFormat, LogGuard, LogWrites,
};
pub use readiness::{Condition, Readiness, ReadinessBuilder};

/// The admin endpoints: `/metrics` (Prometheus text), `/healthz` (the
/// process serves) and `/readyz` (it is ready to serve credentials: 200
/// `ready`, or 503 naming each condition still awaited).
pub fn admin_router(
    metrics: std::sync::Arc<metrics::Metrics>,
    readiness: Readiness,
) -> axum::Router {
    use axum::routing::get;
    let probe = readiness.clone();
    axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                metrics.ready.set(i64::from(readiness.is_ready()));
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
                let answer = readyz(&probe);
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
