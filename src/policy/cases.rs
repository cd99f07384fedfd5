//! `lanyard policy check` and `lanyard policy test`: policies validated,
//! and evaluated against example requests with expected decisions, exactly
//! as the agent evaluates them, so operators can test their policies in
//! their own CI.
//!
//! A CASES file (YAML) lists requests and what must be decided:
//!
//! ```yaml
//! cluster: aks-westeurope-1   # optional: context.cluster
//! cases:
//!   - name: team-a worker gets storage
//!     principal: { namespace: team-a, service_account: ray-worker }
//!     namespace_labels: { team: a }
//!     pod: { name: ray-worker-0, labels: { ray.io/node-type: worker } }
//!     action: access_token
//!     identity: { cloud: azure, id: 11111111-2222-3333-4444-555555555555, account: contoso.onmicrosoft.com }
//!     context: { scopes: ["https://storage.azure.com/"] }
//!     expect: allow
//!     policies: [team-a-storage]   # optional: exactly these decided
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Deserialize;

use super::cedar::CedarPolicy;
use super::{Decision, Policy, PolicyInput};
use crate::cloud::{Cloud, Identity, Kind, Surface, TokenRequest};
use crate::directory::Attributes;
use crate::token::{Caller, ObjectRef};

/// A CASES file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cases {
    /// The cluster the cases are decided in (`context.cluster`); `""`
    /// when not given, as on an agent without `audit.cluster`.
    #[serde(default)]
    pub cluster: String,
    /// The cases, run in order.
    pub cases: Vec<Case>,
}

/// One example request and the decision it must get.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Case {
    /// Printed when the case fails.
    pub name: String,
    /// The calling ServiceAccount.
    pub principal: Principal,
    /// Labels of its namespace.
    #[serde(default)]
    pub namespace_labels: BTreeMap<String, String>,
    /// The calling pod.
    #[serde(default)]
    pub pod: PodCase,
    /// `access_token`, `id_token` or `aws_credentials`.
    pub action: Kind,
    /// The identity asked for.
    pub identity: IdentityCase,
    /// The rest of the request.
    #[serde(default)]
    pub context: ContextCase,
    /// `allow` or `deny`.
    pub expect: Expect,
    /// When given, exactly these policies must have decided.
    #[serde(default)]
    pub policies: Option<Vec<String>>,
}

/// A case's ServiceAccount.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Principal {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub service_account: String,
    /// Its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its annotations.
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// A case's pod.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodCase {
    /// Its name.
    #[serde(default = "default_pod")]
    pub name: String,
    /// Its uid.
    #[serde(default)]
    pub uid: String,
    /// Its labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Its node.
    #[serde(default)]
    pub node: Option<String>,
}

impl Default for PodCase {
    fn default() -> Self {
        PodCase {
            name: default_pod(),
            uid: String::new(),
            labels: BTreeMap::new(),
            node: None,
        }
    }
}

fn default_pod() -> String {
    "pod".into()
}

/// A case's cloud identity.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityCase {
    /// `azure`, `gcp` or `aws`.
    pub cloud: Cloud,
    /// Client id, service account email, or role ARN.
    pub id: String,
    /// Tenant, project or account.
    #[serde(default)]
    pub account: String,
    /// Google's project number.
    #[serde(default)]
    pub account_number: Option<String>,
    /// A chained identity's first hop (an AWS target role's source role).
    #[serde(default)]
    pub via: Option<ViaCase>,
    /// Where the first credential comes from (`resource.source`):
    /// `federation` (the default) or `node`.
    #[serde(default)]
    pub source: crate::cloud::Source,
}

/// A case's chained hop (`resource.via`).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ViaCase {
    /// The first hop's identity (the source role's ARN).
    pub id: String,
    /// Its account.
    #[serde(default)]
    pub account: String,
    /// Whether the second hop carries session tags (EKS's default: yes).
    #[serde(default = "yes")]
    pub session_tags: bool,
    /// Whether the second hop carries an inline session policy.
    #[serde(default)]
    pub session_policy: bool,
}

fn yes() -> bool {
    true
}

/// A case's request details.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextCase {
    /// Scopes or resource.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// ID-token audience.
    #[serde(default)]
    pub audience: Option<String>,
    /// Seconds the credential would be asked for.
    #[serde(default)]
    pub lifetime: Option<u64>,
    /// The SDK surface; the cloud's usual one when absent.
    #[serde(default)]
    pub surface: Option<Surface>,
    /// Unix seconds; now when absent.
    #[serde(default)]
    pub time: Option<u64>,
}

/// An expected decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Expect {
    /// Permitted.
    Allow,
    /// Denied.
    Deny,
}

/// Why a CASES file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum CasesError {
    /// It cannot be read.
    #[error("{file}: {reason}")]
    Read {
        /// The file.
        file: String,
        /// Why.
        reason: String,
    },
    /// It is not a CASES file (YAML error, unknown field, wrong type), with
    /// the line when known.
    #[error("{file}: {reason}")]
    Format {
        /// The file.
        file: String,
        /// What is wrong, and where.
        reason: String,
    },
    /// A case asks for something that is never decided.
    #[error("{file}: case {case:?}: {reason}")]
    Case {
        /// The file.
        file: String,
        /// The case.
        case: String,
        /// Why.
        reason: String,
    },
}

/// Reads a CASES file.
pub fn read(path: &Path) -> Result<Cases, CasesError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| CasesError::Read {
        file: file.clone(),
        reason: e.to_string(),
    })?;
    serde_norway::from_str(&text).map_err(|e| CasesError::Format {
        file,
        reason: e.to_string(),
    })
}

/// How one case went.
#[derive(Debug)]
pub struct Outcome {
    /// The case's name.
    pub name: String,
    /// What was expected.
    pub expected: Expect,
    /// The policies expected to decide it, when the case names them.
    pub expected_policies: Option<Vec<String>>,
    /// What was decided.
    pub decision: Decision,
    /// Whether it matched (decision and, when given, policies).
    pub passed: bool,
}

/// Evaluates every case with `policy`.
pub fn run(policy: &CedarPolicy, cases: &Cases, file: &str) -> Result<Vec<Outcome>, CasesError> {
    let mut outcomes = Vec::with_capacity(cases.cases.len());
    for case in &cases.cases {
        if case.action == Kind::Identity {
            return Err(CasesError::Case {
                file: file.to_string(),
                case: case.name.clone(),
                reason: "action must be access_token, id_token or aws_credentials".into(),
            });
        }
        let decision = decide(policy, case);
        let (kind_ok, decided) = match &decision {
            Decision::Allow { policies } => (case.expect == Expect::Allow, policies),
            Decision::Deny { policies, .. } => (case.expect == Expect::Deny, policies),
        };
        let policies_ok = case.policies.as_ref().is_none_or(|want| {
            let mut want = want.clone();
            let mut got = decided.clone();
            want.sort();
            got.sort();
            want == got
        });
        outcomes.push(Outcome {
            name: case.name.clone(),
            expected: case.expect,
            expected_policies: case.policies.clone(),
            passed: kind_ok && policies_ok,
            decision,
        });
    }
    Ok(outcomes)
}

/// The case as the broker would present it to the policy.
fn decide(policy: &CedarPolicy, case: &Case) -> Decision {
    let p = &case.principal;
    let caller = Caller {
        namespace: p.namespace.clone(),
        service_account: p.service_account.clone(),
        service_account_uid: String::new(),
        pod: Some(ObjectRef {
            name: case.pod.name.clone(),
            uid: case.pod.uid.clone(),
        }),
        node: case.pod.node.as_ref().map(|name| ObjectRef {
            name: name.clone(),
            uid: String::new(),
        }),
        token_expires_at: 0,
        token_fingerprint: String::new(),
    };
    let identity = Identity {
        cloud: case.identity.cloud,
        id: case.identity.id.clone(),
        account: case.identity.account.clone(),
        account_number: case.identity.account_number.clone(),
        source: case.identity.source,
        via: case.identity.via.as_ref().map(|v| crate::cloud::Via {
            id: v.id.clone(),
            account: v.account.clone(),
            session_tags: v.session_tags,
            session_policy: v.session_policy,
        }),
    };
    let surface = case
        .context
        .surface
        .unwrap_or_else(|| case.identity.cloud.surface());
    let mut request = TokenRequest::new(case.identity.cloud, case.action, surface)
        .with_scopes(case.context.scopes.clone());
    request.audience = case.context.audience.clone();
    let lifetime = case.context.lifetime.map(Duration::from_secs);
    request.lifetime = lifetime;
    let attributes = Attributes {
        service_account_labels: p.labels.clone().into(),
        service_account_annotations: p.annotations.clone().into(),
        namespace_labels: case.namespace_labels.clone().into(),
        pod_labels: case.pod.labels.clone().into(),
    };
    let time = case
        .context
        .time
        .map_or_else(SystemTime::now, |t| UNIX_EPOCH + Duration::from_secs(t));
    policy.decide(&PolicyInput {
        caller: &caller,
        identity: &identity,
        request: &request,
        attributes: &attributes,
        lifetime,
        time,
    })
}

/// `lanyard policy check DIR`: exit 0 when the set is valid, 1 otherwise.
pub fn check_command(dir: &Path) -> std::process::ExitCode {
    match CedarPolicy::load(dir) {
        Ok(policy) => {
            println!(
                "{} policies in {} are valid",
                policy.policies(),
                dir.display()
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::ExitCode::from(1)
        }
    }
}

/// `lanyard policy test DIR CASES`: exit 0 when every case passes, 1 when
/// one fails or the set is invalid, 2 when the CASES file is unusable.
pub fn test_command(dir: &Path, cases: &Path) -> std::process::ExitCode {
    let policy = match CedarPolicy::load(dir) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(1);
        }
    };
    let file = cases.display().to_string();
    let outcomes = match read(cases).and_then(|c| {
        let policy = policy.with_cluster(c.cluster.clone());
        run(&policy, &c, &file)
    }) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}");
            return std::process::ExitCode::from(2);
        }
    };
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.passed).collect();
    for o in &failed {
        let (got, policies, reason) = match &o.decision {
            Decision::Allow { policies } => ("allow", policies, None),
            Decision::Deny { policies, reason } => ("deny", policies, Some(reason)),
        };
        let expected = match o.expected {
            Expect::Allow => "allow",
            Expect::Deny => "deny",
        };
        let by = |policies: &[String]| match policies.is_empty() {
            true => "no policy".to_string(),
            false => policies.join(", "),
        };
        let expected_by = o
            .expected_policies
            .as_deref()
            .map(|p| format!(" (decided by: {})", by(p)))
            .unwrap_or_default();
        eprintln!(
            "FAIL {:?}: expected {expected}{expected_by}, got {got} (decided by: {}){}",
            o.name,
            by(policies),
            reason.map(|r| format!(": {r}")).unwrap_or_default()
        );
    }
    println!(
        "{} of {} cases passed",
        outcomes.len() - failed.len(),
        outcomes.len()
    );
    match failed.is_empty() {
        true => std::process::ExitCode::SUCCESS,
        false => std::process::ExitCode::from(1),
    }
}
