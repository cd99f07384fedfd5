//! The cloud side of a ServiceAccount's trust: what each cloud must hold
//! for it to accept this ServiceAccount's tokens as one of its
//! identities, written out as the cloud's own CLI commands, for
//! `lanyard doctor` to print beside what it found.
//!
//! Why here: the commonest failure in workload identity is a trust that
//! does not match (an issuer with another trailing slash, a subject with
//! another case or namespace, the wrong audience), and the cloud says so
//! only when a pod asks, long after it started. Each cloud's module knows
//! its own trust (`azure::trust`, `gcp::trust`, `aws::trust`); this
//! module holds what they share: the workload they describe and the shape
//! of the answer.

use serde::Serialize;

use super::Cloud;

/// A ServiceAccount of a cluster, as the clouds see its tokens.
pub struct Workload<'a> {
    /// The cluster's issuer exactly as its discovery document names it
    /// (the `iss` of every token; a trailing `/` is part of it).
    pub issuer: &'a str,
    /// The ServiceAccount's namespace.
    pub namespace: &'a str,
    /// The ServiceAccount's name.
    pub service_account: &'a str,
    /// How many ServiceAccounts of the cluster are bound to the identity
    /// `id` of the cloud (this one included), where that is known.
    pub sharing: &'a dyn Fn(Cloud, &str) -> Option<usize>,
}

impl Workload<'_> {
    /// The tokens' subject, `system:serviceaccount:NAMESPACE:NAME`.
    pub fn subject(&self) -> String {
        format!(
            "system:serviceaccount:{}:{}",
            self.namespace, self.service_account
        )
    }
}

/// What one cloud identity must trust for the workload to reach it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Trust {
    /// The cloud's name (`azure`, `gcp`, `aws`).
    pub cloud: &'static str,
    /// The identity: a client id, a Google service account or principal,
    /// a role ARN.
    pub identity: String,
    /// How the identity trusts the workload, in a few words (a federated
    /// credential, a role's trust policy, an IAM binding...).
    pub kind: &'static str,
    /// The issuer the cloud must name.
    pub issuer: String,
    /// What the cloud must match the tokens against: the subject, or the
    /// member that stands for it.
    pub subject: String,
    /// The audience the tokens carry for this cloud.
    pub audience: String,
    /// Ready-to-run commands that set up (or show) the trust.
    pub commands: Vec<String>,
    /// A policy document the commands refer to, when the cloud takes one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document: Option<serde_json::Value>,
    /// What to compare with the cloud's side, and mistakes found on ours.
    pub notes: Vec<String>,
    /// Problems certain from this side alone (each also a failed check).
    pub problems: Vec<String>,
}

impl Trust {
    /// A trust of `cloud` for `identity`, with no commands yet.
    pub fn new(cloud: Cloud, identity: impl Into<String>, kind: &'static str) -> Trust {
        Trust {
            cloud: cloud.name(),
            identity: identity.into(),
            kind,
            issuer: String::new(),
            subject: String::new(),
            audience: String::new(),
            commands: Vec::new(),
            document: None,
            notes: Vec::new(),
            problems: Vec::new(),
        }
    }
}

/// One word of a POSIX shell command: as is when it holds only characters
/// no shell treats specially, else in single quotes (a `'` inside closes,
/// escapes and reopens them).
pub fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word.bytes().all(|b| {
            b.is_ascii_alphanumeric()
                || matches!(
                    b,
                    b'_' | b'-' | b'.' | b'/' | b':' | b'=' | b'@' | b',' | b'+' | b'%'
                )
        });
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// A command line from its words, each quoted as [`shell_word`] needs.
pub fn command(words: &[&str]) -> String {
    words
        .iter()
        .map(|w| shell_word(w))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The note every cloud's trust carries about the issuer.
pub fn issuer_note(issuer: &str) -> String {
    if issuer.ends_with('/') {
        format!("the issuer ends with '/': the cloud must name it exactly so, {issuer} (without the slash it is another issuer)")
    } else {
        format!("the issuer has no trailing '/': the cloud must name it exactly so, {issuer} (with a slash it is another issuer)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_only_when_a_shell_would_read_them_otherwise() {
        assert_eq!(
            shell_word("system:serviceaccount:ns:sa"),
            "system:serviceaccount:ns:sa"
        );
        assert_eq!(
            shell_word("https://example.com/a/"),
            "https://example.com/a/"
        );
        assert_eq!(
            shell_word("serviceAccount:p.svc.id.goog[ns/sa]"),
            "'serviceAccount:p.svc.id.goog[ns/sa]'"
        );
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
        assert_eq!(command(&["echo", "a b", "c"]), "echo 'a b' c");
    }

    #[test]
    fn the_subject_is_kubernetes_own() {
        let sharing = |_: Cloud, _: &str| None;
        let w = Workload {
            issuer: "https://issuer.example/",
            namespace: "ray",
            service_account: "worker",
            sharing: &sharing,
        };
        assert_eq!(w.subject(), "system:serviceaccount:ray:worker");
        assert!(issuer_note(w.issuer).contains("ends with '/'"));
        assert!(issuer_note("https://x").contains("no trailing"));
    }
}
