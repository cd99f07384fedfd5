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

pub(crate) fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
