//! `lanyard doctor pod NAMESPACE/NAME` and `lanyard doctor serviceaccount
//! NAMESPACE/NAME`: why a pod does (or does not) get its credentials, and
//! the exact trust each cloud needs for its ServiceAccount.
//!
//! Why: the commonest failure in workload identity is not in the broker
//! but a trust that does not match, which the cloud reports only when the
//! pod asks (`AADSTS70021`/`700213`, Google's `PERMISSION_DENIED`, STS's
//! `InvalidIdentityToken`). Lanyard sees every piece at once: the
//! cluster's issuer, the ServiceAccount's bindings read as the agent reads
//! them, what the webhook injected, and its own configuration; the doctor
//! puts them side by side and writes each cloud's trust as that cloud's
//! CLI commands.
//!
//! It only reads, with the user's kubeconfig: the cluster's OIDC
//! discovery document, the pod, its ServiceAccount, (for the limits of an
//! identity shared by many ServiceAccounts) the list of ServiceAccounts,
//! Lanyard's agent pods on the pod's node, and the Events of the pod's
//! namespace (the agent's recorded refusals); a read it is not allowed is
//! reported, and the rest still checked. Lanyard's configuration comes from the usual sources
//! (`--config` with the agent's file, `LANYARD_*`), so the trust is
//! computed with the audiences and clouds the agent uses.
//!
//! The report ([`Report`]) is a table by default and JSON with `--output
//! json` (its fields are docs/operations.md's); the exit code is 1 when a
//! check failed, 2 when the doctor could not run.

mod checks;
mod cluster;
mod policy;
mod report;

use std::path::Path;
use std::process::ExitCode;

pub use report::{Finding, Report, Status};

use crate::config::Config;

/// What the doctor examines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A pod, and through it its ServiceAccount.
    Pod {
        /// The pod's namespace.
        namespace: String,
        /// The pod's name.
        name: String,
    },
    /// A ServiceAccount alone (before any pod runs).
    ServiceAccount {
        /// The ServiceAccount's namespace.
        namespace: String,
        /// The ServiceAccount's name.
        name: String,
    },
}

/// Why a target could not be read from the command line.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "want NAMESPACE/NAME (Kubernetes names: lowercase letters, digits, '-' and '.'), got {0:?}"
)]
pub struct TargetError(String);

impl Target {
    /// `NAMESPACE/NAME` of a pod.
    pub fn pod(spec: &str) -> Result<Target, TargetError> {
        let (namespace, name) = split(spec)?;
        Ok(Target::Pod { namespace, name })
    }

    /// `NAMESPACE/NAME` of a ServiceAccount.
    pub fn service_account(spec: &str) -> Result<Target, TargetError> {
        let (namespace, name) = split(spec)?;
        Ok(Target::ServiceAccount { namespace, name })
    }
}

/// `NAMESPACE/NAME`, each part a Kubernetes name (at most 253 characters
/// of lowercase letters, digits, `-` and `.`).
fn split(spec: &str) -> Result<(String, String), TargetError> {
    let bad = || TargetError(spec.chars().take(300).collect());
    let (ns, name) = spec.split_once('/').ok_or_else(bad)?;
    let ok = |s: &str| {
        (1..=253).contains(&s.len())
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !ok(ns) || !ok(name) {
        return Err(bad());
    }
    Ok((ns.to_string(), name.to_string()))
}

/// Examines `target` in the cluster the kubeconfig (or the in-cluster
/// ServiceAccount) names.
/// The policy comes from `policy_dir`, else the configuration's
/// `policy.dir`.
pub async fn diagnose(
    config: &Config,
    client: &kube::Client,
    target: &Target,
    policy_dir: Option<&Path>,
) -> Report {
    let facts = cluster::gather(client, target).await;
    checks::evaluate_with(config, target, &facts, policy_dir)
}

/// The command: diagnose, print, and exit 0 (all checks passed), 1 (a
/// check failed) or 2 (no cluster to ask).
pub async fn command(
    config: Config,
    target: Target,
    policy_dir: Option<&Path>,
    json: bool,
) -> ExitCode {
    let client = match crate::http::kube_client().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "lanyard doctor: no Kubernetes API: {e} (set KUBECONFIG or run in a cluster)"
            );
            return ExitCode::from(2);
        }
    };
    let report = diagnose(&config, &client, &target, policy_dir).await;
    if json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_namespace_slash_name() {
        assert_eq!(
            Target::pod("ray/worker-0"),
            Ok(Target::Pod {
                namespace: "ray".into(),
                name: "worker-0".into()
            })
        );
        for bad in ["ray", "/x", "x/", "Ray/x", "a/b/c", "a/b c"] {
            assert!(Target::pod(bad).is_err(), "{bad}");
        }
        let long = format!("a/{}", "b".repeat(10_000));
        let err = Target::service_account(&long).unwrap_err().to_string();
        assert!(err.len() < 400, "the echo is bounded");
    }
}
