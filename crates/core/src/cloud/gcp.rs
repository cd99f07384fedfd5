//! Google's model: the ServiceAccount annotations Google bindings are
//! read from, the audiences Google accepts a provider's token under, and
//! the default universe.

use super::{annotation, distinct, listed, Annotations};

/// The ServiceAccount annotations Google bindings are read from.
pub mod annotations {
    /// The Google service account to impersonate (GKE's annotation).
    pub const SERVICE_ACCOUNT: &str = "iam.gke.io/gcp-service-account";
    /// Lanyard's own: further service accounts the ServiceAccount may
    /// impersonate, each selected by its email (GCE's
    /// `service-accounts/EMAIL/`; comma- or space-separated; after
    /// `SERVICE_ACCOUNT`'s, or the first is the default).
    pub const SERVICE_ACCOUNTS: &str = "lanyard.dev/gcp-service-accounts";
    /// Every annotation above: what Lanyard reads of this cloud's.
    pub const ALL: &[&str] = &[SERVICE_ACCOUNT, SERVICE_ACCOUNTS];
}

/// The audiences Google accepts for a provider's token: the provider's
/// name with or without `https:`.
pub fn accepted_audiences(configured: &str) -> Vec<String> {
    let mut all = vec![configured.to_string()];
    if let Some(rest) = configured.strip_prefix("//") {
        all.push(format!("https://{rest}"));
    } else if let Some(rest) = configured.strip_prefix("https://") {
        all.push(format!("//{rest}"));
    }
    all
}

/// Google's own universe.
pub const DEFAULT_UNIVERSE_DOMAIN: &str = "googleapis.com";

/// The Google service account a ServiceAccount impersonates (its email).
pub type Binding = String;

/// The service accounts `annotations` name, the default first (none: the
/// federated principal is used directly).
pub fn bindings(annotations: &Annotations) -> Vec<Binding> {
    let first = annotation(annotations, annotations::SERVICE_ACCOUNT);
    let listed = listed(annotations, annotations::SERVICE_ACCOUNTS);
    distinct(
        first.into_iter().chain(listed),
        |a, b| a.eq_ignore_ascii_case(b),
        annotations::SERVICE_ACCOUNTS,
    )
}

/// A universe domain: DNS labels of lowercase letters, digits and `-`,
/// at least two.
pub fn is_universe_domain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').count() >= 2
        && s.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}
