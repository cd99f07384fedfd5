//! The policy's decision for the pod and each of its identities, as the
//! agent decides it.
//!
//! The identities are the agent's own: each configured cloud's exchanger
//! is built (`CloudSettings::register`, into a registry of the doctor's
//! that only asks), binds the ServiceAccount's bindings for this caller
//! and names each binding's identity (`CloudExchanger::bind` and
//! `identity`: tenant, project, account, the app hop's or a target role's
//! `via`, the source). The decision is `lanyard policy test`'s evaluation
//! (`policy::cases`), which builds the Cedar request and entities the
//! agent builds: the ServiceAccount's and namespace's labels, the pod's
//! labels and node, the cluster's name (`audit.cluster`).
//!
//! One request per identity, of the cloud's first kind (an access token,
//! AWS credentials) and naming no scope: a policy that conditions on
//! scopes or lifetimes may decide another request of the same pod
//! otherwise, which the finding says (`lanyard policy test` takes the
//! scope).

use std::collections::BTreeMap;
use std::path::Path;

use super::report::{Finding, Status};
use crate::cloud::{Bindings, CloudExchanger, Identity, Kind, Registry};
use crate::config::Config;
use crate::policy::cases::{
    self, Case, Cases, ContextCase, Expect, IdentityCase, PodCase, Principal, ViaCase,
};
use crate::policy::cedar::CedarPolicy;
use crate::policy::Decision;
use crate::token::{Caller, ObjectRef};

/// Who asks, as the doctor found them.
pub struct Asker<'a> {
    /// The ServiceAccount's namespace and name.
    pub namespace: &'a str,
    /// The ServiceAccount's name.
    pub service_account: &'a str,
    /// The ServiceAccount's labels and annotations.
    pub labels: BTreeMap<String, String>,
    /// The ServiceAccount's annotations.
    pub annotations: BTreeMap<String, String>,
    /// The namespace's labels.
    pub namespace_labels: BTreeMap<String, String>,
    /// The pod, for a pod target.
    pub pod: Option<AskingPod>,
}

/// The pod that asks.
#[derive(Clone)]
pub struct AskingPod {
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its node, once scheduled.
    pub node: Option<String>,
}

/// Collects the identities each cloud's exchanger binds for a caller.
struct Identities<'a> {
    bindings: &'a Bindings,
    caller: &'a Caller,
    found: Vec<(Identity, Kind)>,
}

impl Registry for Identities<'_> {
    fn register<E: CloudExchanger>(&mut self, exchanger: E) {
        // Not bound to this cloud: nothing to decide.
        let Ok(bound) = exchanger.bind(self.bindings, self.caller) else {
            return;
        };
        let kind = exchanger
            .kinds()
            .first()
            .copied()
            .unwrap_or(Kind::AccessToken);
        for b in &bound {
            self.found.push((exchanger.identity(b), kind));
        }
    }
}

/// The policy's verdicts for `asker`'s identities.
pub fn check(
    config: &Config,
    dir: Option<&Path>,
    asker: &Asker,
    bindings: &Bindings,
    findings: &mut Vec<Finding>,
) {
    let Some(dir) = dir.or(config.policy.dir.as_deref()) else {
        findings.push(Finding::new(
            "policy",
            None,
            Status::Info,
            "no policy configured (policy.dir): the agent allows every bound request",
        ));
        return;
    };
    if !dir.is_dir() {
        findings.push(
            Finding::new(
                "policy",
                None,
                Status::Warn,
                format!("the policy directory {} is not on this machine, so the policy was not evaluated", dir.display()),
            )
            .fix("copy the policies (the chart's policy ConfigMap) into a directory and give it as --policy-dir"),
        );
        return;
    }
    let policy = match CedarPolicy::load(dir) {
        Ok(p) => p,
        Err(e) => {
            findings.push(
                Finding::new(
                    "policy",
                    None,
                    Status::Fail,
                    format!(
                        "the policy set in {} is invalid, so the agent will not start: {e}",
                        dir.display()
                    ),
                )
                .fix(format!("lanyard policy check {}", dir.display())),
            );
            return;
        }
    };
    let caller = Caller {
        namespace: asker.namespace.to_string(),
        service_account: asker.service_account.to_string(),
        service_account_uid: String::new(),
        pod: asker.pod.as_ref().map(|p| ObjectRef {
            name: p.name.clone(),
            uid: p.uid.clone(),
        }),
        node: asker
            .pod
            .as_ref()
            .and_then(|p| p.node.clone())
            .map(|name| ObjectRef {
                name,
                uid: String::new(),
            }),
        token_expires_at: 0,
        token_fingerprint: String::new(),
    };
    let mut identities = Identities {
        bindings,
        caller: &caller,
        found: Vec::new(),
    };
    if let Err(e) = config
        .clouds()
        .register(&crate::http::client(), &mut identities)
    {
        findings.push(
            Finding::new(
                "policy",
                None,
                Status::Warn,
                format!("cannot build the clouds' exchangers to name the identities: {e}"),
            )
            .fix("check the configuration's cloud sections (lanyard agent refuses the same)"),
        );
        return;
    }
    let pod = asker.pod.clone().unwrap_or_else(|| AskingPod {
        name: PodCase::default().name,
        uid: String::new(),
        labels: BTreeMap::new(),
        node: None,
    });
    let cases = Cases {
        cluster: config.audit.cluster.clone(),
        cases: identities
            .found
            .iter()
            .map(|(identity, kind)| Case {
                name: format!("{} {}", identity.cloud, identity.id),
                principal: Principal {
                    namespace: asker.namespace.to_string(),
                    service_account: asker.service_account.to_string(),
                    labels: asker.labels.clone(),
                    annotations: asker.annotations.clone(),
                },
                namespace_labels: asker.namespace_labels.clone(),
                pod: PodCase {
                    name: pod.name.clone(),
                    uid: pod.uid.clone(),
                    labels: pod.labels.clone(),
                    node: pod.node.clone(),
                },
                action: *kind,
                identity: IdentityCase {
                    cloud: identity.cloud,
                    id: identity.id.clone(),
                    account: identity.account.clone(),
                    account_number: identity.account_number.clone(),
                    via: identity.via.as_ref().map(|v| ViaCase {
                        id: v.id.clone(),
                        account: v.account.clone(),
                        session_tags: v.session_tags,
                        session_policy: v.session_policy,
                    }),
                    source: identity.source,
                },
                context: ContextCase::default(),
                expect: Expect::Allow,
                policies: None,
            })
            .collect(),
    };
    let outcomes = match cases::run(&policy, &cases, "lanyard doctor") {
        Ok(o) => o,
        Err(e) => {
            findings.push(Finding::new(
                "policy",
                None,
                Status::Warn,
                format!("cannot evaluate the policy: {e}"),
            ));
            return;
        }
    };
    for ((identity, kind), outcome) in identities.found.iter().zip(outcomes) {
        let cloud = Some(identity.cloud.name());
        let what = format!("{} for {}", kind.name().replace('_', " "), identity.id);
        match outcome.decision {
            Decision::Allow { policies } => findings.push(Finding::new(
                "policy",
                cloud,
                Status::Ok,
                format!("{what}: allowed{} (for a request naming no scope)", named(&policies)),
            )),
            Decision::Deny { reason, policies } => findings.push(
                Finding::new("policy", cloud, Status::Fail, format!("{what}: denied{}: {reason}", named(&policies)))
                    .fix("change the policy, or what the pod asks for; `lanyard policy test` evaluates a request with its scopes (docs/policy.md)"),
            ),
        }
    }
}

fn named(policies: &[String]) -> String {
    if policies.is_empty() {
        String::new()
    } else {
        format!(" by {}", policies.join(", "))
    }
}
