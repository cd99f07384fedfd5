//! AWS STS answers to `AssumeRoleWithWebIdentity`: the success document
//! ([`parse_success`]) and the `ErrorResponse` of a refusal
//! ([`classify`]), from the body bytes as STS sends them.
//!
//! An optional first line `HTTP/1.1 NNN` sets the status a refusal is
//! classified with (400 without one); the rest is the body, which goes
//! through both parsers, as a success and as a refusal.
//!
//! Beside "never panics": the subject token the request carried never
//! reaches a refusal's message, even when the endpoint echoes it there.

use std::time::Duration;

use lanyard::cloud::aws::{classify, parse_success};
use lanyard::cloud::CloudError;

/// The subject token the exchange sent (the shape of a projected token).
const TOKEN: &str = "eyJhbGciOiJSUzI1NiIsImtpZCI6ImZ1enoifQ.eyJzdWIiOiJmdXp6In0.c2lnbmF0dXJl";

/// Runs one input.
pub fn run(data: &[u8]) {
    let (status, body) = status_line(data).unwrap_or((400, data));
    let _ = parse_success(body);
    for retry in [None, Some(Duration::from_secs(7))] {
        let err = classify(status, retry, body, TOKEN);
        if let CloudError::Rejected { message, .. } = &err {
            assert!(
                !message.contains(TOKEN),
                "the subject token reached a refusal's message"
            );
        }
        let _ = (err.to_string(), err.is_retryable(), err.code());
    }
}

/// `HTTP/1.1 NNN …\n` at the start: the status and the rest.
fn status_line(data: &[u8]) -> Option<(u16, &[u8])> {
    let rest = data.strip_prefix(b"HTTP/1.1 ")?;
    let end = rest.iter().position(|b| *b == b'\n')?;
    let status = std::str::from_utf8(rest.get(..3)?).ok()?.parse().ok()?;
    Some((status, &rest[end + 1..]))
}
