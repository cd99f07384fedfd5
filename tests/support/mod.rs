//! Shared test fixtures, included by test files as `mod support;`.
//!
//! [`process`] (child processes and the addresses they report) and the
//! helpers below build without the `dev` feature; [`upstreams`] (the
//! built-in issuer, the emulators and surfaces wired to them) needs it.
#![allow(dead_code)]

pub mod guard;
pub mod process;
#[cfg(feature = "dev")]
pub mod upstreams;

// Each test file uses only some of these.
#[allow(unused_imports)]
pub use process::*;
#[cfg(feature = "dev")]
#[allow(unused_imports)]
pub use upstreams::*;

use std::time::Duration;

/// The fields of an Azure IMDS token answer, each a string as IMDS
/// writes them (captured replies; `docs/emulators.md`).
pub const IMDS_TOKEN_FIELDS: [&str; 8] = [
    "access_token",
    "client_id",
    "expires_in",
    "expires_on",
    "ext_expires_in",
    "not_before",
    "resource",
    "token_type",
];

/// The code and message of a cloud's refusal; anything else fails the
/// test.
#[track_caller]
pub fn rejected<T: std::fmt::Debug>(
    result: Result<T, lanyard::cloud::CloudError>,
) -> (String, String) {
    match result {
        Err(lanyard::cloud::CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected CloudError::Rejected, got {other:?}"),
    }
}

/// An AdmissionReview from `tests/fixtures/admission`.
pub fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/tests/fixtures/admission/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Serves `router` on a fresh loopback listener until the trigger is
/// dropped or fired; returns its base URL.
pub async fn serve_router(
    router: axum::Router,
    what: &str,
) -> (String, lanyard::http::ShutdownTrigger) {
    let listener = lanyard::http::bind("127.0.0.1:0".parse().unwrap(), what)
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (trigger, shutdown) = lanyard::http::Shutdown::new();
    lanyard::http::spawn_server(listener, router, shutdown);
    (url, trigger)
}

/// A GET of `url`: status and body, or `None` while nothing listens there.
pub async fn get_status(url: &str) -> Option<(u16, String)> {
    let resp = reqwest::get(url).await.ok()?;
    let status = resp.status().as_u16();
    Some((status, resp.text().await.unwrap_or_default()))
}

/// Polls `url` (every 50 ms, for up to 10 s) until it answers `want`;
/// returns the body.
pub async fn eventually_answers(url: &str, want: u16) -> String {
    for _ in 0..200 {
        if let Some((status, body)) = get_status(url).await {
            if status == want {
                return body;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{url} never answered {want}");
}

/// Polls `url` until it answers 200.
pub async fn wait_ready(url: &str) {
    eventually_answers(url, 200).await;
}
