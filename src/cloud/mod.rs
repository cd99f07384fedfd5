//! Exchangers: one module per cloud, each turning a verified projected token
//! into that cloud's short-lived credential. Endpoints are overridable
//! (sovereign clouds, private endpoints, emulators) and upstream errors are
//! mapped to [`CloudError`], which says whether retrying can help.

pub mod aws;
pub mod azure;
pub mod gcp;

use std::fmt;
use std::time::Duration;

use crate::secret::SecretString;

/// The clouds Lanyard brokers for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Cloud {
    Azure,
    Gcp,
    Aws,
}

impl fmt::Display for Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Cloud::Azure => "azure",
            Cloud::Gcp => "gcp",
            Cloud::Aws => "aws",
        })
    }
}

/// A bearer access token with its validity window.
#[derive(Debug, Clone)]
pub struct AccessToken {
    pub token: SecretString,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
}

/// Why an exchange failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CloudError {
    /// The cloud refused this request and will refuse it again until
    /// something is reconfigured (no federated credential, role not trusted).
    #[error("{cloud} rejected the exchange: {code}: {message}")]
    Rejected {
        cloud: Cloud,
        code: String,
        message: String,
    },
    /// The cloud asked us to slow down.
    #[error("{cloud} is throttling token requests ({code}); retry after {retry_after:?}")]
    Throttled {
        cloud: Cloud,
        code: String,
        retry_after: Option<Duration>,
    },
    /// The cloud could not be reached or failed on its side.
    #[error("{cloud} token service unavailable: {reason}")]
    Unavailable { cloud: Cloud, reason: String },
    /// The cloud answered something we cannot interpret.
    #[error("{cloud} token service answered unexpectedly: {reason}")]
    Protocol { cloud: Cloud, reason: String },
}

impl CloudError {
    /// Whether the same request may succeed later without reconfiguration.
    pub fn is_retryable(&self) -> bool {
        !matches!(self, CloudError::Rejected { .. })
    }

    /// The upstream error code, when the cloud gave one (AADSTS…, AWS codes).
    pub fn code(&self) -> Option<&str> {
        match self {
            CloudError::Rejected { code, .. } | CloudError::Throttled { code, .. } => Some(code),
            _ => None,
        }
    }
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

/// Longest upstream message kept, in bytes (before the `…` marking a cut).
/// Upstream text is for humans; bounding it keeps a misbehaving endpoint
/// from flooding logs, audit records and error answers.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// Secrets shorter than this are not searched for: replacing a short
/// string would mangle ordinary words, and real credentials are far longer.
const MIN_SECRET_LEN: usize = 8;

/// Makes an upstream error message safe to log and return: every
/// occurrence of `secret` (the credential the request carried, which an
/// endpoint may echo) becomes `[redacted]`, and the result is cut to
/// [`MAX_MESSAGE_BYTES`] on a character boundary, ending in `…` when cut.
/// One function for every exchanger, so the rule cannot drift apart.
pub fn scrub_message(message: &str, secret: &str) -> String {
    let mut text = if secret.len() >= MIN_SECRET_LEN && message.contains(secret) {
        message.replace(secret, "[redacted]")
    } else {
        message.to_string()
    };
    if text.len() > MAX_MESSAGE_BYTES {
        let mut cut = MAX_MESSAGE_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
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

pub(crate) fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "eyJhbGciOiJSUzI1NiJ9.c2VjcmV0.c2ln";

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

    #[test]
    fn secrets_are_redacted() {
        let m = scrub_message(&format!("bad token {SECRET}; again: {SECRET}"), SECRET);
        assert_eq!(m, "bad token [redacted]; again: [redacted]");
        // Short or empty "secrets" are not searched for.
        assert_eq!(scrub_message("a token", ""), "a token");
        assert_eq!(scrub_message("a token", "a"), "a token");
    }

    #[test]
    fn huge_messages_are_bounded() {
        let huge = format!("{}{SECRET}", "x".repeat(100 * 1024));
        let m = scrub_message(&huge, SECRET);
        assert!(m.len() <= MAX_MESSAGE_BYTES + '…'.len_utf8(), "{}", m.len());
        assert!(m.ends_with('…'));
        assert!(!m.contains(SECRET));
        let short = "x".repeat(MAX_MESSAGE_BYTES);
        assert_eq!(scrub_message(&short, ""), short, "at the bound: not cut");
    }

    #[test]
    fn multibyte_text_is_cut_on_a_boundary() {
        // 'é' is two bytes and '€' three: neither divides 1024 evenly
        // once offset by one ASCII byte.
        for text in [format!("a{}", "é".repeat(2000)), "€".repeat(1000)] {
            let m = scrub_message(&text, "");
            assert!(m.ends_with('…'));
            let body = m.trim_end_matches('…');
            assert!(body.len() <= MAX_MESSAGE_BYTES && body.len() > MAX_MESSAGE_BYTES - 4);
            assert!(text.starts_with(body));
        }
    }

    #[test]
    fn a_secret_split_by_the_cut_is_still_redacted() {
        // Redaction happens before the cut, so no prefix of the secret
        // survives at the end.
        let text = format!("{}{SECRET}", "x".repeat(MAX_MESSAGE_BYTES - 5));
        let m = scrub_message(&text, SECRET);
        assert!(!m.contains("eyJhb"), "{m}");
    }
}
