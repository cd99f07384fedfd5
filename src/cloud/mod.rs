//! The exchangers, on the cloud model.
//!
//! The model every layer shares (which clouds exist, the request, the
//! credentials, the bindings each cloud reads from a ServiceAccount, the
//! typed errors of an upstream) is `lanyard_core::cloud`, which does no
//! I/O, re-exported here so that `crate::cloud::X` names it. Each cloud's
//! module here (`azure`, `gcp`, `aws`) adds its configuration section, its
//! upstream client and its [`CloudExchanger`]: how a ServiceAccount's
//! bindings name its identity, how a selector matches it, how a request
//! is keyed in the cache, and the exchange itself. Endpoints are
//! overridable (sovereign clouds, private endpoints, emulators).
//!
//! Nothing here knows about the broker's pipeline, the cache or the wire
//! formats: data flows from the surfaces through the broker to here.

pub mod aws;
pub mod azure;
mod exchanger;
pub mod gcp;
pub(crate) mod send;
pub mod trust;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::secret::SecretString;

pub use exchanger::CloudExchanger;
pub use lanyard_core::cloud::{
    now_unix, scrub_message, AccessToken, Annotations, AwsCredentials, Bindings, BodyKey,
    CallerLimit, Cloud, CloudError, Credential, Form, Identity, Invalid, Kind, PerCloud,
    RenderedBody, RequestError, SdkDefaults, Selector, Source, Surface, TokenRequest, Via,
    MAX_IDENTITIES, MAX_MESSAGE_BYTES,
};

pub(crate) fn invalid(key: &'static str, expected: &'static str, got: &str) -> Invalid {
    Invalid {
        key,
        expected,
        got: got.to_string(),
    }
}

/// An https URL, or http to a loopback host (emulators, local proxies).
pub fn check_endpoint(value: &str) -> Result<(), &'static str> {
    const EXPECTED: &str =
        "an https:// URL (http:// only for loopback hosts) without query or fragment";
    let url = url::Url::parse(value).map_err(|_| EXPECTED)?;
    let loopback = match url.host() {
        Some(url::Host::Domain(d)) => d == "localhost",
        Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
        Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
        None => false,
    };
    let scheme_ok = url.scheme() == "https" || (url.scheme() == "http" && loopback);
    if !scheme_ok || url.query().is_some() || url.fragment().is_some() || url.host().is_none() {
        return Err(EXPECTED);
    }
    Ok(())
}

/// Where [`CloudSettings::register`] puts each configured cloud's
/// exchanger (the broker).
pub trait Registry {
    /// Serves `exchanger`'s cloud with it.
    fn register<E: CloudExchanger>(&mut self, exchanger: E);
}

/// The upstream call for a cache key, given the newest subject token.
pub type FetchFuture = Pin<Box<dyn Future<Output = Result<Credential, CloudError>> + Send>>;
/// A reusable upstream call (the cache keeps it to refresh ahead).
pub type Fetcher = Arc<dyn Fn(SecretString) -> FetchFuture + Send + Sync>;

/// A [`Fetcher`] from an async exchange over shared `params`, captured once;
/// each exchange clones only the `Arc`.
pub fn fetcher<P, F, Fut>(params: P, exchange: F) -> Fetcher
where
    P: Send + Sync + 'static,
    F: Fn(Arc<P>, SecretString) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Credential, CloudError>> + Send + 'static,
{
    let params = Arc::new(params);
    Arc::new(move |subject| Box::pin(exchange(params.clone(), subject)))
}

/// One upstream call as the audit record names it: how long it took and
/// the cloud's own id for it (Entra's `x-ms-request-id`, STS's
/// `x-amzn-RequestId`), which the cloud's support asks for. Google's token
/// endpoints send none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamCall {
    /// From sending the exchange to its result (rate-limit wait excluded).
    pub latency: Duration,
    /// The upstream's request id, when it sent a usable one.
    pub request_id: Option<String>,
}

tokio::task_local! {
    /// The request id an exchanger noted for the exchange running in this
    /// task (see [`note_request_id`]).
    static REQUEST_ID: std::cell::RefCell<Option<String>>;
}

/// Longest request id kept; real ones are UUIDs or shorter.
const MAX_REQUEST_ID: usize = 128;
/// Most request ids kept for one exchange (its calls, in order).
pub const MAX_REQUEST_IDS: usize = 4;

/// Notes the upstream's request id from `headers[name]` for the exchange in
/// progress, so that its audit record names it. Each exchanger calls it on
/// every answer; the ids of a multi-step exchange (STS then IAM
/// Credentials, a web identity then a chained role) are kept in order,
/// comma-separated, at most [`MAX_REQUEST_IDS`]. An id that is long or not
/// plain printable text is dropped: it is upstream-supplied. Outside
/// [`with_request_id`] it does nothing.
pub fn note_request_id(headers: &reqwest::header::HeaderMap, name: &str) {
    let id = headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| {
            !v.is_empty()
                && v.len() <= MAX_REQUEST_ID
                && v.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
        });
    if let Some(id) = id {
        let _ = REQUEST_ID.try_with(|slot| {
            let mut slot = slot.borrow_mut();
            match slot.as_mut() {
                None => *slot = Some(id.to_string()),
                Some(ids) if ids.split(',').count() < MAX_REQUEST_IDS => {
                    ids.push(',');
                    ids.push_str(id);
                }
                Some(_) => {}
            }
        });
    }
}

/// Runs one exchange and returns its result with the request id its
/// exchanger noted.
// INVARIANT: the exchange runs inside this scope, in this task: an
// exchanger that spawned its upstream call elsewhere would note nothing.
pub async fn with_request_id<F: Future>(exchange: F) -> (F::Output, Option<String>) {
    REQUEST_ID
        .scope(std::cell::RefCell::new(None), async move {
            let output = exchange.await;
            let id = REQUEST_ID.with(|slot| slot.borrow_mut().take());
            (output, id)
        })
        .await
}

/// Parses a `Retry-After` header given in seconds (the form token services use).
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()
        .map(Duration::from_secs)
}

/// What stays readable in one URL path segment: RFC 3986's unreserved
/// characters and `@` (a `pchar`, and what Google's clients leave in
/// service-account emails). Everything else, `/`, `?`, `#`, `:`, `%` and
/// non-ASCII included, is percent-encoded.
const PATH_SEGMENT: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~')
    .remove(b'@');

/// Percent-encodes a caller- or configuration-derived value (a tenant, a
/// service-account email) for one path segment, so that nothing in it can
/// change the path, add a query or pick another method after a `:`.
pub(crate) fn encode_path_segment(segment: &str) -> String {
    percent_encoding::utf8_percent_encode(segment, PATH_SEGMENT).to_string()
}

/// Parses an RFC 3339 timestamp (what Google's `expireTime` and STS's
/// `Expiration` are) with the `time` crate's parser. The date and time
/// must be separated by `T`, `t` or a space, as RFC 3339 allows: `time`
/// alone would take any byte there.
pub(crate) fn parse_rfc3339(text: &str) -> Option<time::OffsetDateTime> {
    use time::format_description::well_known::Rfc3339;
    if !matches!(text.as_bytes().get(10), Some(b'T' | b't' | b' ')) {
        return None;
    }
    time::OffsetDateTime::parse(text, &Rfc3339).ok()
}

/// Unix seconds of a time, `None` before 1970.
pub(crate) fn unix_seconds(at: time::OffsetDateTime) -> Option<u64> {
    u64::try_from(at.unix_timestamp()).ok()
}

/// What `cloud`'s refusal (an upstream error message, as Lanyard records
/// it) means and what to do, in one line; `None` when not recognised.
pub fn explain_refusal(cloud: Cloud, message: &str) -> Option<&'static str> {
    match cloud {
        Cloud::Azure => azure::trust::explain(message),
        Cloud::Gcp => gcp::trust::explain(message),
        Cloud::Aws => aws::trust::explain(message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> reqwest::header::HeaderMap {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert("x-ms-request-id", value.parse().unwrap());
        h
    }

    #[tokio::test]
    async fn an_exchange_names_the_request_id_it_noted_and_only_a_plain_one() {
        let (out, id) = with_request_id(async {
            note_request_id(&headers("first"), "x-ms-request-id");
            tokio::task::yield_now().await;
            note_request_id(
                &headers(" 0b6e2e0a-8f1c-4c1e-9a0e-1f2d3c4b5a69 "),
                "x-ms-request-id",
            );
            7
        })
        .await;
        assert_eq!(out, 7);
        // Every call's id, in order, trimmed.
        assert_eq!(
            id.as_deref(),
            Some("first,0b6e2e0a-8f1c-4c1e-9a0e-1f2d3c4b5a69")
        );
        // At most MAX_REQUEST_IDS of them.
        let ((), id) = with_request_id(async {
            for i in 0..10 {
                note_request_id(&headers(&format!("id{i}")), "x-ms-request-id");
            }
        })
        .await;
        assert_eq!(id.as_deref(), Some("id0,id1,id2,id3"));
        for bad in ["a b", "x;y", &"a".repeat(129), "<script>"] {
            let ((), id) = with_request_id(async {
                note_request_id(&headers(bad), "x-ms-request-id");
            })
            .await;
            assert_eq!(id, None, "{bad}");
        }
        // Another header, or none: nothing.
        let ((), id) = with_request_id(async {
            note_request_id(&headers("abc"), "x-amzn-requestid");
        })
        .await;
        assert_eq!(id, None);
        // Outside an exchange: no effect, no panic.
        note_request_id(&headers("abc"), "x-ms-request-id");
    }

    #[test]
    fn path_segments_cannot_escape() {
        assert_eq!(
            encode_path_segment("sa@p.iam.gserviceaccount.com"),
            "sa@p.iam.gserviceaccount.com"
        );
        assert_eq!(encode_path_segment("../x?y"), "..%2Fx%3Fy");
        assert_eq!(
            encode_path_segment("a/../b:signJwt?x#f%2F é"),
            "a%2F..%2Fb%3AsignJwt%3Fx%23f%252F%20%C3%A9"
        );
        assert_eq!(encode_path_segment("A-z_0.9~"), "A-z_0.9~");
    }
}
