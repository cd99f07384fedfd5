//! The doctor's checks, on what [`super::cluster`] read: pure functions of
//! the facts and the configuration, so each verdict is testable without a
//! cluster.
//!
//! The bindings are read by the code the agent reads them with
//! (`Bindings::from_annotations`, `known_refusals`), the audiences are the
//! webhook's (`CloudSettings::audiences`, each cloud's accepted
//! spellings), and the trust is each cloud's module's
//! (`CloudSettings::trust`): the doctor cannot disagree with what the
//! agent will do.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::events::v1::Event;

use std::path::Path;

use super::cluster::Facts;
use super::policy::{self, Asker, AskingPod};
use super::report::{Examined, Finding, Report, Status, FORMAT_VERSION};
use super::Target;
use crate::cloud::trust::Workload;
use crate::cloud::{Annotations, Bindings, Cloud};
use crate::config::Config;
use crate::webhook::vocabulary::{INJECT_LABEL, SIDECAR_NAME, TOKENS_VOLUME};

/// Lanyard's annotation prefix: a ServiceAccount annotation under it that
/// no cloud reads is most likely a typo.
const LANYARD_PREFIX: &str = "lanyard.dev/";

/// Every verdict on `target`, the policy's from its configured directory.
#[cfg(test)]
pub fn evaluate(config: &Config, target: &Target, facts: &Facts) -> Report {
    evaluate_with(config, target, facts, None)
}

/// Every verdict on `target`; the policy from `policy_dir` when given.
pub fn evaluate_with(
    config: &Config,
    target: &Target,
    facts: &Facts,
    policy_dir: Option<&Path>,
) -> Report {
    let mut findings = Vec::new();
    let (kind, namespace, name) = match target {
        Target::Pod { namespace, name } => ("pod", namespace, name),
        Target::ServiceAccount { namespace, name } => ("serviceaccount", namespace, name),
    };
    let bindings = facts
        .service_account
        .as_ref()
        .ok()
        .and_then(Option::as_ref)
        .map(|sa| Bindings::from_annotations(&annotations(sa)));

    if let Some(pod) = &facts.pod {
        pod_checks(
            config,
            namespace,
            name,
            pod,
            bindings.as_ref(),
            &mut findings,
        );
    }
    if let Some(agents) = &facts.agents {
        agent_check(facts, agents, &mut findings);
    }
    if let Some(events) = &facts.events {
        refusal_checks(facts, events, &mut findings);
    }
    let sa = service_account_checks(config, facts, bindings.as_ref(), &mut findings);
    let issuer = issuer_check(config, facts, &mut findings);
    if let (Some(b), Some((ns, sa_name)), Ok(Some(account))) = (
        &bindings,
        &facts.service_account_name,
        &facts.service_account,
    ) {
        let namespace_labels = match &facts.namespace_labels {
            Ok(labels) => labels.clone(),
            Err(e) => {
                findings.push(
                    Finding::new(
                        "policy",
                        None,
                        Status::Warn,
                        format!("cannot read the namespace's labels ({e}): the policy sees none"),
                    )
                    .fix("the doctor needs get on namespaces"),
                );
                BTreeMap::new()
            }
        };
        let pod = match &facts.pod {
            Some(Ok(Some(p))) => Some(AskingPod {
                name: p.metadata.name.clone().unwrap_or_default(),
                uid: p.metadata.uid.clone().unwrap_or_default(),
                labels: p.metadata.labels.clone().unwrap_or_default(),
                node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
            }),
            _ => None,
        };
        let asker = Asker {
            namespace: ns,
            service_account: sa_name,
            labels: account.metadata.labels.clone().unwrap_or_default(),
            annotations: annotations(account),
            namespace_labels,
            pod,
        };
        policy::check(config, policy_dir, &asker, b, &mut findings);
    }

    let mut trust = Vec::new();
    if let (Some(b), Some((ns, sa_name)), Some(issuer)) =
        (&bindings, &facts.service_account_name, &issuer)
    {
        let counts = sharing(facts, &mut findings);
        let lookup = |cloud: Cloud, id: &str| {
            counts
                .as_ref()
                .map(|c| c.get(&(cloud, id.to_string())).copied().unwrap_or(0))
        };
        let workload = Workload {
            issuer,
            namespace: ns,
            service_account: sa_name,
            sharing: &lookup,
        };
        trust = config.clouds().trust(b, &workload);
        for t in &trust {
            let cloud = Cloud::from_name(t.cloud).map(Cloud::name);
            if t.problems.is_empty() {
                findings.push(Finding::new(
                    "trust",
                    cloud,
                    Status::Info,
                    format!("{} needs a {} (below)", t.identity, t.kind),
                ));
            }
            for p in &t.problems {
                let (what, fix) = p.split_once(": ").unwrap_or((p.as_str(), ""));
                let f = Finding::new("trust", cloud, Status::Fail, what);
                findings.push(if fix.is_empty() { f } else { f.fix(fix) });
            }
        }
    }
    let ok = !findings.iter().any(|f| f.status == Status::Fail);
    Report {
        version: FORMAT_VERSION,
        target: Examined {
            kind,
            namespace: namespace.clone(),
            name: name.clone(),
            service_account: sa,
        },
        issuer,
        ok,
        findings,
        trust,
    }
}

fn annotations(sa: &ServiceAccount) -> Annotations {
    sa.metadata.annotations.clone().unwrap_or_default()
}

/// The clouds whose tokens a pod of these bindings gets: those it names,
/// and Google's federated principal where Google is configured.
fn bound_clouds(config: &Config, bindings: &Bindings) -> Vec<Cloud> {
    let audiences = config.clouds().audiences();
    Cloud::ALL
        .into_iter()
        .filter(|&c| bindings.names(c) || (c.implicit_identity() && audiences[c].is_some()))
        .collect()
}

fn pod_checks(
    config: &Config,
    namespace: &str,
    name: &str,
    pod: &Result<Option<Pod>, String>,
    bindings: Option<&Bindings>,
    findings: &mut Vec<Finding>,
) {
    let pod = match pod {
        Ok(Some(p)) => p,
        Ok(None) => {
            findings.push(
                Finding::new(
                    "pod",
                    None,
                    Status::Fail,
                    format!("no pod {namespace}/{name}"),
                )
                .fix(format!(
                    "check the name: kubectl get pods --namespace {namespace}"
                )),
            );
            return;
        }
        Err(e) => {
            findings.push(
                Finding::new(
                    "pod",
                    None,
                    Status::Fail,
                    format!("cannot read the pod: {e}"),
                )
                .fix("the doctor needs get on pods in this namespace"),
            );
            return;
        }
    };
    let spec = pod.spec.clone().unwrap_or_default();
    let node = spec.node_name.as_deref().unwrap_or("(not scheduled yet)");
    findings.push(Finding::new(
        "pod",
        None,
        Status::Ok,
        format!("found, on node {node}"),
    ));

    let labels = pod.metadata.labels.clone().unwrap_or_default();
    let opted_in = labels.get(INJECT_LABEL).map(String::as_str) == Some("true");
    if opted_in {
        findings.push(Finding::new(
            "opted-in",
            None,
            Status::Ok,
            format!("labelled {INJECT_LABEL}=true"),
        ));
    } else {
        findings.push(
            Finding::new("opted-in", None, Status::Fail, format!("the pod is not labelled {INJECT_LABEL}=true, so Lanyard's webhook leaves it alone"))
                .fix(format!("add the label {INJECT_LABEL}: \"true\" to the pod template (the webhook acts when a pod is created) and recreate the pod")),
        );
    }

    let sidecar = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == SIDECAR_NAME && c.restart_policy.as_deref() == Some("Always"));
    match sidecar {
        Some(c) => {
            let image = c.image.as_deref().unwrap_or("(no image)");
            findings.push(Finding::new("sidecar", None, Status::Ok, format!("injected, image {image}")));
        }
        None if opted_in && bindings.is_some_and(|b| bound_clouds(config, b).is_empty()) => {
            findings.push(Finding::new(
                "sidecar",
                None,
                Status::Info,
                "not injected: its ServiceAccount binds no cloud, so there was nothing to inject (see binding)",
            ));
            return;
        }
        None if opted_in => findings.push(
            Finding::new("sidecar", None, Status::Fail, "opted in, but Lanyard's sidecar was not injected")
                .fix("the webhook did not see this pod's creation, or refused a binding: check `kubectl get mutatingwebhookconfiguration` and the webhook's log, then recreate the pod"),
        ),
        None => {
            findings.push(Finding::new("sidecar", None, Status::Info, "not injected (not opted in)"));
            return;
        }
    }
    let (Some(_), Some(bindings)) = (sidecar, bindings) else {
        return;
    };

    // The audience of each cloud's projected token, against the one its
    // cloud accepts under this configuration.
    let projected: BTreeMap<String, String> = spec
        .volumes
        .iter()
        .flatten()
        .filter(|v| v.name == TOKENS_VOLUME)
        .filter_map(|v| v.projected.as_ref())
        .flat_map(|p| p.sources.iter().flatten())
        .filter_map(|s| s.service_account_token.as_ref())
        .map(|t| (t.path.clone(), t.audience.clone().unwrap_or_default()))
        .collect();
    let audiences = config.clouds().audiences();
    for cloud in bound_clouds(config, bindings) {
        let Some(configured) = audiences[cloud].as_deref() else {
            continue;
        };
        let accepted = cloud.accepted_audiences(configured);
        match projected.get(cloud.name()) {
            Some(a) if accepted.iter().any(|x| x.eq_ignore_ascii_case(a)) => findings.push(
                Finding::new("token-audience", Some(cloud.name()), Status::Ok, format!("the pod's token carries {a}")),
            ),
            Some(a) => findings.push(
                Finding::new(
                    "token-audience",
                    Some(cloud.name()),
                    Status::Fail,
                    format!("the pod's token carries the audience {a}, but {cloud} is configured for {configured}"),
                )
                .fix("recreate the pod so that the webhook projects the configured audience, or make the cloud's trust and the configuration agree"),
            ),
            None => findings.push(
                Finding::new(
                    "token-audience",
                    Some(cloud.name()),
                    Status::Fail,
                    format!("the ServiceAccount is bound to {cloud}, but the pod has no {cloud} token (injected before the binding?)"),
                )
                .fix("recreate the pod: the webhook projects a token for each cloud bound when the pod is created"),
            ),
        }
    }
}

/// Whether the pod's node runs a ready agent: without one the sidecar
/// answers every SDK with a retryable error.
fn agent_check(facts: &Facts, agents: &Result<Vec<Pod>, String>, findings: &mut Vec<Finding>) {
    let node = match &facts.pod {
        Some(Ok(Some(p))) => p
            .spec
            .as_ref()
            .and_then(|s| s.node_name.clone())
            .unwrap_or_default(),
        _ => return,
    };
    let agents = match agents {
        Ok(a) => a,
        Err(e) => {
            findings.push(
                Finding::new(
                    "agent",
                    None,
                    Status::Warn,
                    format!("cannot list Lanyard's agent pods: {e}"),
                )
                .fix("the doctor needs list on pods to find the agent on the pod's node"),
            );
            return;
        }
    };
    let ready = |p: &Pod| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let names = |p: &Pod| {
        (
            p.metadata.namespace.clone().unwrap_or_default(),
            p.metadata.name.clone().unwrap_or_default(),
        )
    };
    if let Some(p) = agents.iter().find(|p| ready(p)) {
        let (ns, pod) = names(p);
        findings.push(Finding::new(
            "agent",
            None,
            Status::Ok,
            format!("{ns}/{pod} is ready on node {node}"),
        ));
        release_check(facts, p, findings);
    } else if let Some(p) = agents.first() {
        let status = p.status.clone().unwrap_or_default();
        let why = status
            .container_statuses
            .iter()
            .flatten()
            .filter_map(|c| c.state.as_ref())
            .find_map(|s| {
                s.waiting
                    .as_ref()
                    .and_then(|w| w.reason.clone())
                    .or_else(|| s.terminated.as_ref().and_then(|t| t.reason.clone()))
            })
            .or(status.phase)
            .unwrap_or_else(|| "no status".into());
        let (ns, pod) = names(p);
        findings.push(
            Finding::new("agent", None, Status::Fail, format!("the agent on node {node}, {ns}/{pod}, is not ready ({why}): the sidecar answers every SDK with a retryable error"))
                .fix(format!("kubectl logs --namespace {ns} {pod}; its /readyz names what it waits for (docs/operations.md, Health and readiness)")),
        );
    } else {
        findings.push(
            Finding::new("agent", None, Status::Fail, format!("no Lanyard agent runs on node {node} (pods labelled {})", super::cluster::AGENT_SELECTOR))
                .fix("the agent DaemonSet has no pod there: check its nodeSelector and tolerations against the node's labels and taints (kubectl get daemonset --all-namespaces -l app.kubernetes.io/name=lanyard)"),
        );
    }
}

/// Whether the pod's sidecar is of the node agent's release: the chart
/// runs both from one image, and a pod keeps the sidecar of the release
/// that created it. Another is no fault (the agent API is versioned), but
/// it is what a user asks after an upgrade.
fn release_check(facts: &Facts, agent: &Pod, findings: &mut Vec<Finding>) {
    let image_of = |containers: Option<&Vec<k8s_openapi::api::core::v1::Container>>, name: &str| {
        containers
            .into_iter()
            .flatten()
            .find(|c| c.name == name)
            .and_then(|c| c.image.clone())
    };
    let Some(Ok(Some(pod))) = &facts.pod else {
        return;
    };
    let sidecar = pod
        .spec
        .as_ref()
        .and_then(|s| image_of(s.init_containers.as_ref(), SIDECAR_NAME));
    let agent_image = agent
        .spec
        .as_ref()
        .and_then(|s| image_of(Some(&s.containers), AGENT_CONTAINER));
    let (Some(sidecar), Some(agent_image)) = (sidecar, agent_image) else {
        return;
    };
    if sidecar != agent_image {
        findings.push(Finding::new(
            "release",
            None,
            Status::Info,
            format!("the sidecar runs {sidecar}, the node's agent {agent_image}: a pod keeps the sidecar of the release that created it, until it is recreated"),
        ));
    }
}

/// The agent's container in the chart's DaemonSet.
const AGENT_CONTAINER: &str = "agent";

/// Refusals the agent recorded on the pod (Events with reason
/// `CredentialDenied`, note `CLOUD KIND for identity ID was refused:
/// MESSAGE`, `pod_events`), newest last, each explained. The API server
/// keeps Events an hour, so each is recent.
fn refusal_checks(facts: &Facts, events: &Result<Vec<Event>, String>, findings: &mut Vec<Finding>) {
    const SHOWN: usize = 5;
    let Some(Ok(Some(pod))) = &facts.pod else {
        return;
    };
    let events = match events {
        Ok(e) => e,
        Err(e) => {
            findings.push(
                Finding::new("refusal", None, Status::Warn, format!("cannot list the namespace's Events: {e}"))
                    .fix("the doctor needs list on events.k8s.io events to show the agent's refusals of this pod"),
            );
            return;
        }
    };
    let mine: Vec<&Event> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some(crate::pod_events::REASON))
        .filter(|e| {
            e.regarding.as_ref().is_some_and(|r| {
                r.kind.as_deref() == Some("Pod")
                    && r.name == pod.metadata.name
                    && (r.uid.is_none() || r.uid == pod.metadata.uid)
            })
        })
        .collect();
    for e in mine.iter().skip(mine.len().saturating_sub(SHOWN)) {
        let note = e.note.as_deref().unwrap_or_default();
        let cloud = note.split(' ').next().and_then(Cloud::from_name);
        let count = e.series.as_ref().map(|s| s.count).unwrap_or(1);
        let fix = if note.contains("Lanyard policy") {
            "a Cedar policy forbids it (the policies it names): change the policy or what the pod asks; `lanyard policy test` evaluates a case (docs/policy.md)".to_string()
        } else if note.contains("(none bound)") {
            "the ServiceAccount names no identity of this cloud: annotate it (docs/setup-*.md)"
                .to_string()
        } else {
            cloud
                .and_then(|c| crate::cloud::explain_refusal(c, note))
                .unwrap_or("see docs/operations.md, Errors and fixes")
                .to_string()
        };
        let times = if count > 1 {
            format!(" ({count} times)")
        } else {
            String::new()
        };
        findings.push(
            Finding::new(
                "refusal",
                cloud.map(Cloud::name),
                Status::Fail,
                format!("{}{times}", bounded(note)),
            )
            .fix(fix),
        );
    }
}

/// The ServiceAccount's checks; its `NAMESPACE/NAME` when known.
fn service_account_checks(
    config: &Config,
    facts: &Facts,
    bindings: Option<&Bindings>,
    findings: &mut Vec<Finding>,
) -> Option<String> {
    let (ns, name) = facts.service_account_name.as_ref()?;
    let sa = match &facts.service_account {
        Ok(Some(sa)) => sa,
        Ok(None) => {
            findings.push(
                Finding::new("serviceaccount", None, Status::Fail, format!("no ServiceAccount {ns}/{name}"))
                    .fix(format!("create it (kubectl create serviceaccount {name} --namespace {ns}) and annotate it with its cloud identities")),
            );
            return Some(format!("{ns}/{name}"));
        }
        Err(e) => {
            findings.push(
                Finding::new(
                    "serviceaccount",
                    None,
                    Status::Fail,
                    format!("cannot read the ServiceAccount {ns}/{name}: {e}"),
                )
                .fix("the doctor needs get on serviceaccounts in this namespace"),
            );
            return Some(format!("{ns}/{name}"));
        }
    };
    findings.push(Finding::new(
        "serviceaccount",
        None,
        Status::Ok,
        format!("{ns}/{name}"),
    ));
    let Some(bindings) = bindings else {
        return Some(format!("{ns}/{name}"));
    };
    let annotations = annotations(sa);
    let node_identities = config.clouds().node_identities();
    let audiences = config.clouds().audiences();
    for cloud in Cloud::ALL {
        let ids = bindings.identity_ids(cloud);
        if !ids.is_empty() {
            findings.push(Finding::new(
                "binding",
                Some(cloud.name()),
                Status::Ok,
                ids.join(", "),
            ));
        } else if let Some(value) = annotations.get(cloud.binding_annotation()) {
            findings.push(
                Finding::new(
                    "binding",
                    Some(cloud.name()),
                    Status::Fail,
                    format!(
                        "{}={:?} names no valid identity, so {cloud} is not bound",
                        cloud.binding_annotation(),
                        bounded(value)
                    ),
                )
                .fix("correct the annotation's value (docs/setup-*.md says its form)"),
            );
        } else if cloud.implicit_identity() && audiences[cloud].is_some() {
            findings.push(Finding::new(
                "binding",
                Some(cloud.name()),
                Status::Info,
                "no service account named: the pod acts as its federated principal",
            ));
        }
        if audiences[cloud].is_none() && !ids.is_empty() {
            findings.push(
                Finding::new("binding", Some(cloud.name()), Status::Fail, format!("bound to {cloud}, which this configuration does not set up"))
                    .fix(format!("configure the {cloud} section (docs/configuration.md) or remove the annotation")),
            );
        }
        for refusal in bindings.known_refusals(cloud, &node_identities) {
            findings.push(Finding::new(
                "binding",
                Some(cloud.name()),
                Status::Fail,
                refusal,
            ));
        }
    }
    if bound_clouds(config, bindings).is_empty() {
        findings.push(
            Finding::new(
                "binding",
                None,
                Status::Fail,
                "the ServiceAccount names no cloud identity",
            )
            .fix(format!(
                "annotate it with {}",
                Cloud::binding_annotations("=…")
            )),
        );
    }
    let known: BTreeSet<&str> = Bindings::annotation_keys().collect();
    for key in annotations.keys() {
        if key.starts_with(LANYARD_PREFIX) && !known.contains(key.as_str()) {
            findings.push(
                Finding::new(
                    "annotation",
                    None,
                    Status::Warn,
                    format!(
                        "{} is not an annotation Lanyard reads on ServiceAccounts: ignored",
                        bounded(key)
                    ),
                )
                .fix("check its spelling against docs/reference.md"),
            );
        }
    }
    Some(format!("{ns}/{name}"))
}

/// The issuer the trust must name: the cluster's, checked against the
/// configured one.
fn issuer_check(config: &Config, facts: &Facts, findings: &mut Vec<Finding>) -> Option<String> {
    let configured = config.cluster.issuer.as_deref();
    match (&facts.issuer, configured) {
        (Ok(found), Some(c)) if found == c => {
            findings.push(Finding::new("issuer", None, Status::Ok, found.clone()));
            Some(found.clone())
        }
        (Ok(found), Some(c)) => {
            let slash = found.trim_end_matches('/') == c.trim_end_matches('/');
            let message = if slash {
                format!("cluster.issuer is {c}, but the cluster's tokens say {found}: only the trailing '/' differs, and it counts")
            } else {
                format!("cluster.issuer is {c}, but the cluster's tokens say {found}")
            };
            findings.push(
                Finding::new("issuer", None, Status::Fail, message).fix(format!(
                    "set cluster.issuer to exactly {found}, or leave it unset to discover it"
                )),
            );
            Some(found.clone())
        }
        (Ok(found), None) => {
            findings.push(Finding::new(
                "issuer",
                None,
                Status::Ok,
                format!("{found} (from the cluster's discovery document)"),
            ));
            Some(found.clone())
        }
        (Err(e), c) => {
            findings.push(
                Finding::new("issuer", None, Status::Warn, format!("cannot read the cluster's discovery document: {e}"))
                    .fix("the doctor needs the API server's /.well-known/openid-configuration (the system:service-account-issuer-discovery role)"),
            );
            c.map(str::to_string)
        }
    }
}

/// How many ServiceAccounts of the cluster name each identity, by cloud
/// and id; `None` (with a warning) when they cannot be listed.
fn sharing(facts: &Facts, findings: &mut Vec<Finding>) -> Option<BTreeMap<(Cloud, String), usize>> {
    match &facts.all_service_accounts {
        Ok(accounts) => {
            let mut counts = BTreeMap::new();
            for sa in accounts {
                let b = Bindings::from_annotations(&annotations(sa));
                for cloud in Cloud::ALL {
                    let ids: BTreeSet<&str> = b.identity_ids(cloud).into_iter().collect();
                    for id in ids {
                        *counts.entry((cloud, id.to_string())).or_insert(0) += 1;
                    }
                }
            }
            Some(counts)
        }
        Err(e) => {
            findings.push(
                Finding::new("fleet", None, Status::Warn, format!("cannot list ServiceAccounts ({e}): identities shared by many are not counted"))
                    .fix("grant list on serviceaccounts to check the limits of an identity shared by many ServiceAccounts"),
            );
            None
        }
    }
}

/// Caller-supplied text in a message, bounded.
fn bounded(s: &str) -> String {
    const MAX: usize = 200;
    if s.chars().count() <= MAX {
        s.to_string()
    } else {
        format!("{}…", s.chars().take(MAX).collect::<String>())
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{
        Container, PodSpec, ProjectedVolumeSource, ServiceAccountTokenProjection, Volume,
        VolumeProjection,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    const ISSUER: &str = "https://oidc.prod-aks.azure.com/t/u/";
    const CLIENT: &str = "11111111-2222-3333-4444-555555555555";

    fn sa(annotations: &[(&str, &str)]) -> ServiceAccount {
        ServiceAccount {
            metadata: ObjectMeta {
                namespace: Some("ray".into()),
                name: Some("worker".into()),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    fn pod(labelled: bool, audience: Option<&str>) -> Pod {
        let token = |aud: &str| VolumeProjection {
            service_account_token: Some(ServiceAccountTokenProjection {
                audience: Some(aud.into()),
                path: "azure".into(),
                expiration_seconds: Some(3600),
            }),
            ..Default::default()
        };
        Pod {
            metadata: ObjectMeta {
                name: Some("worker-0".into()),
                uid: Some("uid-worker-0".into()),
                labels: labelled.then(|| [(INJECT_LABEL.to_string(), "true".to_string())].into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                service_account_name: Some("worker".into()),
                init_containers: audience.map(|_| {
                    vec![Container {
                        name: SIDECAR_NAME.into(),
                        image: Some("registry.example/lanyard:0.1.0".into()),
                        restart_policy: Some("Always".into()),
                        ..Default::default()
                    }]
                }),
                volumes: audience.map(|a| {
                    vec![Volume {
                        name: TOKENS_VOLUME.into(),
                        projected: Some(ProjectedVolumeSource {
                            sources: Some(vec![token(a)]),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }]
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The report's first finding of `check`.
    fn finding<'r>(report: &'r Report, check: &str) -> &'r Finding {
        report
            .findings
            .iter()
            .find(|f| f.check == check)
            .unwrap_or_else(|| panic!("no {check} finding in {report:?}"))
    }

    /// An injected pod of a ServiceAccount bound to Azure, on a node with
    /// a ready agent.
    fn healthy() -> Facts {
        facts(
            Some(pod(true, Some("api://AzureADTokenExchange"))),
            Some(sa(&[("azure.workload.identity/client-id", CLIENT)])),
            ISSUER,
        )
    }

    fn facts(pod: Option<Pod>, account: Option<ServiceAccount>, issuer: &str) -> Facts {
        Facts {
            issuer: Ok(issuer.into()),
            pod: Some(Ok(pod)),
            service_account_name: Some(("ray".into(), "worker".into())),
            all_service_accounts: Ok(account.iter().cloned().collect()),
            service_account: Ok(account),
            agents: Some(Ok(vec![agent(true)])),
            events: Some(Ok(Vec::new())),
            namespace_labels: Ok(BTreeMap::new()),
        }
    }

    fn agent(ready: bool) -> Pod {
        use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
        Pod {
            metadata: ObjectMeta {
                namespace: Some("lanyard-system".into()),
                name: Some("lanyard-agent-x1".into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                phase: Some("Running".into()),
                conditions: Some(vec![PodCondition {
                    type_: "Ready".into(),
                    status: if ready { "True" } else { "False" }.into(),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_agent_on_the_node_must_be_ready() {
        let config = Config::default();
        let mut f = healthy();
        for (agents, want) in [
            (vec![agent(false)], "is not ready (Running)"),
            (vec![], "no Lanyard agent runs on node node-a"),
        ] {
            f.agents = Some(Ok(agents));
            let report = evaluate(&config, &target(), &f);
            let found = finding(&report, "agent");
            assert_eq!(found.status, Status::Fail);
            assert!(found.message.contains(want), "{}", found.message);
            assert!(found.fix.is_some());
        }
    }

    #[test]
    fn a_sidecar_of_another_release_is_named() {
        use k8s_openapi::api::core::v1::{Container, PodSpec};
        let config = Config::default();
        let mut f = healthy();
        let with_image = |image: &str| {
            let mut a = agent(true);
            a.spec = Some(PodSpec {
                containers: vec![Container {
                    name: AGENT_CONTAINER.into(),
                    image: Some(image.into()),
                    ..Default::default()
                }],
                ..Default::default()
            });
            a
        };
        let sidecar = finding(&evaluate(&config, &target(), &f), "sidecar")
            .message
            .clone();
        let image = sidecar
            .strip_prefix("injected, image ")
            .unwrap()
            .to_string();

        f.agents = Some(Ok(vec![with_image(&image)]));
        let report = evaluate(&config, &target(), &f);
        assert!(!report.findings.iter().any(|x| x.check == "release"));

        f.agents = Some(Ok(vec![with_image("registry.example/lanyard:9.9.9")]));
        let report = evaluate(&config, &target(), &f);
        let found = finding(&report, "release");
        assert_eq!(found.status, Status::Info);
        assert!(found.message.contains("lanyard:9.9.9"), "{}", found.message);
        assert!(report.ok, "another release is no failure");
    }

    #[test]
    fn the_agents_refusals_of_the_pod_are_explained() {
        use k8s_openapi::api::core::v1::ObjectReference;
        use k8s_openapi::api::events::v1::EventSeries;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        let event = |pod: &str, note: &str, count: Option<i32>| Event {
            reason: Some(crate::pod_events::REASON.into()),
            note: Some(note.into()),
            regarding: Some(ObjectReference {
                kind: Some("Pod".into()),
                name: Some(pod.into()),
                namespace: Some("ray".into()),
                ..Default::default()
            }),
            series: count.map(|count| EventSeries {
                count,
                last_observed_time: MicroTime(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
            }),
            ..Default::default()
        };
        let config = Config::default();
        let mut f = healthy();
        f.events = Some(Ok(vec![
            event("worker-0", &format!("azure access token for identity {CLIENT} was refused: AADSTS700213: No matching federated identity record found for presented assertion subject 'system:serviceaccount:ray:worker'"), Some(3)),
            event("other-pod", "aws credentials for identity x was refused: InvalidIdentityToken", None),
            event("worker-0", "aws credentials for identity arn:aws:iam::1:role/r was refused: Denied by Lanyard policy: forbidden by policy (policies: no-aws)", None),
        ]));
        let report = evaluate(&config, &target(), &f);
        let refusals: Vec<&Finding> = report
            .findings
            .iter()
            .filter(|x| x.check == "refusal")
            .collect();
        assert_eq!(refusals.len(), 2, "the other pod's is not this pod's");
        assert_eq!(refusals[0].cloud, Some("azure"));
        assert_eq!(refusals[0].status, Status::Fail);
        assert!(refusals[0].message.ends_with("(3 times)"));
        assert!(refusals[0].fix.as_deref().unwrap().contains("subject"));
        assert!(refusals[1].fix.as_deref().unwrap().contains("Cedar policy"));
        assert!(!report.ok);
    }

    fn target() -> Target {
        Target::pod("ray/worker-0").unwrap()
    }

    fn failed(report: &Report) -> Vec<(&'static str, Option<&'static str>)> {
        report
            .findings
            .iter()
            .filter(|f| f.status == Status::Fail)
            .map(|f| (f.check, f.cloud))
            .collect()
    }

    #[test]
    fn a_healthy_pod_passes_and_gets_its_trust() {
        let config = Config::default();
        let report = evaluate(&config, &target(), &healthy());
        assert!(report.ok, "{}", report.to_table());
        assert_eq!(report.issuer.as_deref(), Some(ISSUER));
        assert_eq!(report.trust.len(), 1);
        assert_eq!(report.trust[0].subject, "system:serviceaccount:ray:worker");
        assert_eq!(report.target.service_account.as_deref(), Some("ray/worker"));
    }

    #[test]
    fn each_broken_case_names_its_check() {
        let config = Config::default();
        let bound = sa(&[("azure.workload.identity/client-id", CLIENT)]);
        type Failed = Vec<(&'static str, Option<&'static str>)>;
        let cases: Vec<(Facts, Failed)> = vec![
            (
                facts(Some(pod(false, None)), Some(bound.clone()), ISSUER),
                vec![("opted-in", None)],
            ),
            (
                facts(Some(pod(true, None)), Some(bound.clone()), ISSUER),
                vec![("sidecar", None)],
            ),
            (
                facts(
                    Some(pod(true, Some("sts.amazonaws.com"))),
                    Some(bound.clone()),
                    ISSUER,
                ),
                vec![("token-audience", Some("azure"))],
            ),
            (
                facts(
                    Some(pod(true, Some("api://AzureADTokenExchange"))),
                    Some(sa(&[])),
                    ISSUER,
                ),
                vec![("binding", None)],
            ),
            (
                facts(
                    Some(pod(true, Some("api://AzureADTokenExchange"))),
                    None,
                    ISSUER,
                ),
                vec![("serviceaccount", None)],
            ),
            (
                facts(None, Some(bound.clone()), ISSUER),
                vec![("pod", None)],
            ),
            (
                facts(
                    Some(pod(true, Some("api://AzureADTokenExchange"))),
                    Some(sa(&[("azure.workload.identity/client-id", "  ")])),
                    ISSUER,
                ),
                vec![("binding", Some("azure")), ("binding", None)],
            ),
        ];
        for (i, (facts, want)) in cases.into_iter().enumerate() {
            let report = evaluate(&config, &target(), &facts);
            assert!(!report.ok, "case {i}");
            let got = failed(&report);
            for w in &want {
                assert!(got.contains(w), "case {i}: want {w:?} in {got:?}");
            }
            for f in report.findings.iter().filter(|f| f.status == Status::Fail) {
                assert!(
                    f.fix.is_some() || f.check == "binding",
                    "case {i}: {f:?} has no fix"
                );
            }
        }
    }

    #[test]
    fn an_issuer_that_differs_by_its_trailing_slash_is_named_so() {
        let mut config = Config::default();
        config.cluster.issuer = Some(ISSUER.trim_end_matches('/').into());
        let report = evaluate(&config, &target(), &healthy());
        let f = finding(&report, "issuer");
        assert_eq!(f.status, Status::Fail);
        assert!(f.message.contains("trailing '/'"), "{}", f.message);
        assert!(f.fix.as_deref().unwrap().contains(ISSUER));
        // The trust names the cluster's issuer, as the tokens carry it.
        assert_eq!(report.trust[0].issuer, ISSUER);
    }

    #[test]
    fn an_unknown_lanyard_annotation_is_reported_and_bounded() {
        let config = Config::default();
        let long = format!("lanyard.dev/{}", "x".repeat(1000));
        let account = sa(&[
            ("azure.workload.identity/client-id", CLIENT),
            ("lanyard.dev/azure-client-idz", "x"),
            (&long, "y"),
        ]);
        let report = evaluate(
            &config,
            &Target::service_account("ray/worker").unwrap(),
            &Facts {
                pod: None,
                ..facts(None, Some(account), ISSUER)
            },
        );
        let warned: Vec<&Finding> = report
            .findings
            .iter()
            .filter(|f| f.check == "annotation")
            .collect();
        assert_eq!(warned.len(), 2);
        assert!(warned.iter().all(|f| f.message.len() < 300));
        assert!(report.ok, "warnings do not fail");
    }

    #[test]
    fn more_than_twenty_service_accounts_on_one_azure_identity_fail() {
        let config = Config::default();
        let bound = sa(&[("azure.workload.identity/client-id", CLIENT)]);
        let mut f = facts(
            Some(pod(true, Some("api://AzureADTokenExchange"))),
            Some(bound.clone()),
            ISSUER,
        );
        f.all_service_accounts = Ok((0..21)
            .map(|i| {
                let mut s = bound.clone();
                s.metadata.name = Some(format!("sa-{i}"));
                s
            })
            .collect());
        let report = evaluate(&config, &target(), &f);
        assert_eq!(failed(&report), vec![("trust", Some("azure"))]);
        f.all_service_accounts = Err("forbidden".into());
        let report = evaluate(&config, &target(), &f);
        assert!(report.ok);
        assert!(report
            .findings
            .iter()
            .any(|f| f.check == "fleet" && f.status == Status::Warn));
    }
}
