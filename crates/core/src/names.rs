//! Kubernetes object names as validated types: [`DnsLabel`] (namespaces)
//! and [`DnsSubdomain`] (service accounts, pods, nodes).
//!
//! The same DNS-1123 rules were written out in configuration, in the AWS
//! session-name derivation and elsewhere, each slightly differently. One
//! type per rule means a name is checked once, where it enters, and code
//! that holds a `DnsLabel` need not ask again. Deserializing validates, so
//! a configuration or wire value cannot bypass the check.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest DNS-1123 label (a namespace).
pub const MAX_LABEL: usize = 63;
/// Longest DNS-1123 subdomain (most other object names).
pub const MAX_SUBDOMAIN: usize = 253;

/// A value that is not the name it should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Not a DNS-1123 label; carries the value.
    #[error("{0:?} is not a DNS-1123 label (1-63 lowercase letters, digits and '-', starting and ending with a letter or digit)")]
    DnsLabel(String),
    /// Not a DNS-1123 subdomain; carries the value.
    #[error(
        "{0:?} is not a DNS-1123 subdomain (at most 253 characters: DNS-1123 labels joined by '.')"
    )]
    DnsSubdomain(String),
}

/// Whether `s` is a DNS-1123 label: 1–63 of `[a-z0-9-]`, not starting or
/// ending with `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_LABEL
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Whether `s` is a DNS-1123 subdomain: at most 253 characters of
/// DNS-1123 labels joined by `.`.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_SUBDOMAIN && s.split('.').all(is_dns_label)
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $check:path, $error:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Checks `value`, keeping it as is when it is valid.
            pub fn parse(value: impl Into<String>) -> Result<Self, NameError> {
                let value = value.into();
                if $check(&value) {
                    Ok($name(value))
                } else {
                    Err($error(value))
                }
            }

            /// The name as given.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = NameError;
            fn from_str(s: &str) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = NameError;
            fn try_from(s: String) -> Result<Self, NameError> {
                Self::parse(s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> String {
                n.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

name_type!(
    /// A DNS-1123 label, such as a namespace name.
    DnsLabel,
    is_dns_label,
    NameError::DnsLabel
);

name_type!(
    /// A DNS-1123 subdomain, such as a service account, pod or node name.
    DnsSubdomain,
    is_dns_subdomain,
    NameError::DnsSubdomain
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        for ok in [
            "a",
            "default",
            "ray-workers",
            "0abc",
            "a1-2b",
            &"x".repeat(63),
        ] {
            assert_eq!(DnsLabel::parse(ok).unwrap().as_str(), ok, "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "é",
            "a b",
            &"x".repeat(64),
        ] {
            assert_eq!(
                DnsLabel::parse(bad),
                Err(NameError::DnsLabel(bad.to_string())),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn subdomains() {
        let long = [
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61),
        ]
        .join(".");
        assert_eq!(long.len(), 253);
        for ok in ["ray-worker", "a.b.c", "node-1.example.com", long.as_str()] {
            assert!(DnsSubdomain::parse(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a..b",
            "a.-b",
            "A.b",
            "a/b",
            &format!("{long}e"),
        ] {
            assert!(
                matches!(DnsSubdomain::parse(bad), Err(NameError::DnsSubdomain(ref v)) if v == bad),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn parse_display_and_serde_round_trip() {
        let ns: DnsLabel = "ml".parse().unwrap();
        assert_eq!(ns.to_string(), "ml");
        assert_eq!(serde_json::to_string(&ns).unwrap(), "\"ml\"");
        let back: DnsLabel = serde_json::from_str("\"ml\"").unwrap();
        assert_eq!(back, ns);
        assert_eq!(String::from(back), "ml");
        let sa = DnsSubdomain::try_from("ray.worker".to_string()).unwrap();
        assert_eq!(sa.as_ref(), "ray.worker");
    }

    #[test]
    fn deserializing_validates() {
        let e = serde_json::from_str::<DnsLabel>("\"Bad_NS\"").unwrap_err();
        assert!(e.to_string().contains("DNS-1123 label"), "{e}");
        assert!(serde_json::from_str::<DnsSubdomain>("\"a..b\"").is_err());
        assert!(serde_json::from_str::<DnsLabel>("12").is_err());
    }

    #[test]
    fn errors_quote_the_value() {
        let e = DnsLabel::parse("Bad").unwrap_err();
        assert!(
            e.to_string().starts_with("\"Bad\" is not a DNS-1123 label"),
            "{e}"
        );
    }
}
