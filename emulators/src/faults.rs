//! Faults an emulated cloud can be told to inject, so tests can show what
//! Lanyard does when a real token service misbehaves: slow answers, 5xx,
//! throttling with `Retry-After`, connections dropped mid-answer, answers
//! that never come, truncated bodies.
//!
//! Each emulator holds a [`Faults`] and wraps its router with
//! [`Faults::layer`], giving its own renderer so an error status comes back
//! in that service's real error format (an OAuth error for Entra, Google's
//! API error, an STS `ErrorResponse`). A fault applies to the next `count`
//! requests (or until cleared); latency adds to whatever else happens.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use serde::Deserialize;

/// One misbehaviour.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fault {
    /// Answer normally, this many milliseconds late.
    Latency {
        /// The delay.
        ms: u64,
    },
    /// Answer `status` in the service's own error format, with
    /// `Retry-After` when given. 429 means the service's throttling answer
    /// (for STS: 400 `Throttling`, as AWS answers).
    Status {
        /// The HTTP status.
        status: u16,
        /// Seconds for `Retry-After`, if any.
        #[serde(default)]
        retry_after: Option<u64>,
    },
    /// Send the status line and headers, then drop the connection before
    /// the body (the client sees the connection reset mid-answer).
    Drop,
    /// Never answer: only the client's own timeout ends the request.
    Hang,
    /// Answer 200 with a truncated body.
    Truncated,
}

/// How an emulator renders an error status in its service's format.
pub type Render = fn(StatusCode, Option<u64>) -> Response;

/// Faults scheduled for an emulator.
#[derive(Default)]
pub struct Faults {
    queue: Mutex<VecDeque<(Fault, Option<u32>)>>,
}

impl Faults {
    /// Applies `fault` to the next `count` requests (`None`: until
    /// [`Faults::clear`]), after any fault already scheduled.
    pub fn push(&self, fault: Fault, count: Option<u32>) {
        if count == Some(0) {
            return;
        }
        self.lock().push_back((fault, count));
    }

    /// Removes every scheduled fault.
    pub fn clear(&self) {
        self.lock().clear();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Fault, Option<u32>)>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The fault for this request: every scheduled latency ahead of the
    /// first other fault adds up, and that fault fires; each one met is
    /// counted down.
    fn next(&self) -> (Duration, Option<Fault>) {
        let mut queue = self.lock();
        let mut delay = Duration::ZERO;
        let mut i = 0;
        while let Some((fault, count)) = queue.get_mut(i) {
            let fault = fault.clone();
            let used_up = match count {
                Some(n) => {
                    *n = n.saturating_sub(1);
                    *n == 0
                }
                None => false,
            };
            if used_up {
                queue.remove(i);
            } else {
                i += 1;
            }
            match fault {
                Fault::Latency { ms } => delay += Duration::from_millis(ms),
                other => return (delay, Some(other)),
            }
        }
        (delay, None)
    }

    /// Wraps `router` so every request first meets the scheduled faults.
    pub fn layer(self: &Arc<Self>, router: Router, render: Render) -> Router {
        let faults = self.clone();
        router.layer(axum::middleware::from_fn(
            move |req: Request, next: Next| {
                let faults = faults.clone();
                async move { faults.apply(req, next, render).await }
            },
        ))
    }

    async fn apply(&self, req: Request, next: Next, render: Render) -> Response {
        let (delay, fault) = self.next();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        match fault {
            None | Some(Fault::Latency { .. }) => next.run(req).await,
            Some(Fault::Status {
                status,
                retry_after,
            }) => {
                let status =
                    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                let mut resp = render(status, retry_after);
                if let Some(after) = retry_after {
                    resp.headers_mut().insert(
                        header::RETRY_AFTER,
                        after.to_string().parse().expect("digits"),
                    );
                }
                resp
            }
            Some(Fault::Drop) => {
                let body = futures::stream::once(async {
                    Err::<axum::body::Bytes, _>(std::io::Error::new(
                        std::io::ErrorKind::ConnectionReset,
                        "fault: connection dropped",
                    ))
                });
                Response::builder()
                    .status(StatusCode::OK)
                    .header(header::CONTENT_TYPE, "application/json")
                    .header(header::CONTENT_LENGTH, "512")
                    .body(Body::from_stream(body))
                    .unwrap_or_default()
            }
            Some(Fault::Hang) => {
                std::future::pending::<()>().await;
                Response::default()
            }
            Some(Fault::Truncated) => {
                let full = next.run(req).await;
                let (parts, body) = full.into_parts();
                let bytes = axum::body::to_bytes(body, 1 << 20)
                    .await
                    .unwrap_or_default();
                let cut = bytes.slice(..bytes.len() / 2);
                let mut resp = Response::from_parts(parts, Body::from(cut.clone()));
                resp.headers_mut()
                    .insert(header::CONTENT_LENGTH, cut.len().into());
                resp
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counted_faults_are_consumed_in_order_and_standing_ones_stay() {
        let faults = Faults::default();
        faults.push(Fault::Hang, Some(1));
        faults.push(Fault::Drop, Some(2));
        assert_eq!(faults.next(), (Duration::ZERO, Some(Fault::Hang)));
        assert_eq!(faults.next(), (Duration::ZERO, Some(Fault::Drop)));
        assert_eq!(faults.next(), (Duration::ZERO, Some(Fault::Drop)));
        assert_eq!(faults.next(), (Duration::ZERO, None));
        faults.push(Fault::Latency { ms: 50 }, None);
        faults.push(Fault::Truncated, Some(1));
        let (delay, fault) = faults.next();
        assert_eq!(delay, Duration::from_millis(50));
        assert_eq!(fault, Some(Fault::Truncated));
        assert_eq!(faults.next(), (Duration::from_millis(50), None));
        faults.clear();
        assert_eq!(faults.next(), (Duration::ZERO, None));
    }

    #[test]
    fn a_counted_latency_is_consumed_and_the_next_fault_fires_with_it() {
        let faults = Faults::default();
        faults.push(Fault::Latency { ms: 10 }, Some(1));
        faults.push(Fault::Drop, Some(1));
        assert_eq!(
            faults.next(),
            (Duration::from_millis(10), Some(Fault::Drop))
        );
        assert_eq!(faults.next(), (Duration::ZERO, None));
    }
}
