//! Paths as real clients spell them, shared by the surfaces' own path
//! matching (each surface's `classify`), and the answers for a path or
//! method no surface serves.
//!
//! Each surface places the paths it owns: the documented ones, and what
//! real clients send beside them. msal-node (and so Node.js
//! `@azure/identity`) lower-cases the IMDS URL and appends a `/`
//! (`/metadata/identity/oauth2/token/`); aad-pod-identity's NMI, the server
//! `AZURE_POD_IDENTITY_AUTHORITY_HOST` was made for, matches `metadata`
//! case-insensitively. A plain-text 404 on such a path makes an SDK retry
//! for many seconds and then report a network error, so every not-found
//! answers in the surface's own error shape and says what is served.

use axum::http::header::ALLOW;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// The methods every token path answers.
pub(crate) const READ: &str = "GET,HEAD";

/// The paths of a surface with one token path and others under a prefix
/// (Azure IMDS, App Service).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenPath {
    /// The token path, as documented or spelled another way.
    Token,
    /// Anything else under the prefix.
    Other,
}

impl TokenPath {
    /// Which of `token` and the rest of `prefix` `path` is, ASCII case and
    /// one trailing `/` aside; `None` outside `prefix`.
    pub(crate) fn of(path: &str, token: &str, prefix: &str) -> Option<TokenPath> {
        if trimmed(path).eq_ignore_ascii_case(token) {
            Some(TokenPath::Token)
        } else if starts_with_ignore_case(path, prefix) {
            Some(TokenPath::Other)
        } else {
            None
        }
    }

    /// The methods the path answers.
    #[cfg(test)]
    pub(crate) fn allowed(self) -> Option<&'static str> {
        (self == TokenPath::Token).then_some(READ)
    }
}

/// `path` without one trailing `/` (but `/` itself stays).
pub(crate) fn trimmed(path: &str) -> &str {
    match path.strip_suffix('/') {
        Some("") | None => path,
        Some(t) => t,
    }
}

/// Whether `path` starts with `prefix`, ASCII case aside.
pub(crate) fn starts_with_ignore_case(path: &str, prefix: &str) -> bool {
    path.len() >= prefix.len()
        && path.is_char_boundary(prefix.len())
        && path[..prefix.len()].eq_ignore_ascii_case(prefix)
}

/// A caller's path as an error message shows it: at most 128 bytes.
pub(crate) fn shown(path: &str) -> String {
    const MAX: usize = 128;
    if path.len() <= MAX {
        return path.to_string();
    }
    format!("{}…", &path[..path.floor_char_boundary(MAX)])
}

/// The message of a 405 on a path that answers `allowed`.
pub(crate) fn wrong_method(allowed: &str) -> String {
    format!("Only {allowed} is allowed on this path")
}

/// `response` (a 405) with the `Allow` header naming `allowed`.
pub(crate) fn with_allow(mut response: Response, allowed: &'static str) -> Response {
    response
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allowed));
    response
}

/// A bare 405 (what EC2's metadata service answers a wrong method with,
/// which the SDKs read as "no IMDSv2 here").
pub(crate) fn bare_method_not_allowed(allowed: &'static str) -> Response {
    with_allow(StatusCode::METHOD_NOT_ALLOWED.into_response(), allowed)
}

/// A bare 404 (what EC2's metadata service answers unknown paths with).
pub(crate) fn bare_not_found() -> Response {
    (StatusCode::NOT_FOUND, "Not Found").into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_paths_are_bounded() {
        let long = format!("/{}", "é".repeat(500));
        let s = shown(&long);
        assert!(s.len() <= 128 + '…'.len_utf8(), "{}", s.len());
        assert!(s.ends_with('…'));
        assert_eq!(shown("/x"), "/x");
    }

    #[test]
    fn trailing_slashes_and_case() {
        assert_eq!(trimmed("/a/"), "/a");
        assert_eq!(trimmed("/"), "/");
        assert!(starts_with_ignore_case("/METADATA/x", "/metadata/"));
        assert!(!starts_with_ignore_case("/é", "/e"));
    }
}
