//! One request to a token service, read whole: the one place that sends
//! it, turns a transport failure into [`CloudError::Unavailable`] (without
//! the URL, which may carry a caller's text), notes the service's request
//! id for the audit record and reads `Retry-After` and the body. Each
//! exchanger then reads the answer in its service's own format.

use std::time::Duration;

use super::{note_request_id, now_unix, retry_after, Cloud, CloudError};

/// A token service's answer.
pub(crate) struct Answer {
    /// Its status.
    pub status: reqwest::StatusCode,
    /// Its `Retry-After`, in seconds.
    pub retry_after: Option<Duration>,
    /// Its body, whole.
    pub body: bytes::Bytes,
    /// When the request was sent (Unix seconds): what a lifetime the
    /// answer gives in seconds counts from.
    pub sent_at: u64,
}

/// Sends `request` to `cloud`'s token service and reads the answer,
/// noting the header `request_id` (the service's request id) if it names
/// one.
pub(crate) async fn send(
    cloud: Cloud,
    request: reqwest::RequestBuilder,
    request_id: Option<&str>,
) -> Result<Answer, CloudError> {
    let unavailable = |e: reqwest::Error| CloudError::Unavailable {
        cloud,
        reason: e.without_url().to_string(),
    };
    let sent_at = now_unix();
    let resp = request.send().await.map_err(unavailable)?;
    if let Some(name) = request_id {
        note_request_id(resp.headers(), name);
    }
    let status = resp.status();
    let retry_after = retry_after(resp.headers());
    let body = resp.bytes().await.map_err(unavailable)?;
    Ok(Answer {
        status,
        retry_after,
        body,
        sent_at,
    })
}
