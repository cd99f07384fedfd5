//! The guard of governed namespaces: no container but Lanyard's sidecar
//! gets a token the clouds would exchange.
//!
//! Why: Cedar policy, the audit trail and the fair limits hold only if the
//! sidecar is the only way from a pod's service-account token to a cloud
//! credential. The mutation keeps its own objects honest, but a pod author
//! can also project a token for `sts.amazonaws.com` into their own
//! container and call the cloud directly, mount a volume that holds one
//! into a debug container (`kubectl debug`), or swap the sidecar's image
//! on a pod update. In namespaces the operator governs, `lanyard webhook`
//! answers `POST /validate` for pod CREATE and UPDATE and for
//! `pods/ephemeralcontainers` with [`check`]; the chart ships the same rules
//! as a ValidatingAdmissionPolicy (CEL), tested to agree with this one on
//! the same fixtures.
//!
//! The rules, on the pod as it would be stored:
//! - [`Rule::CloudTokenMount`]: a container other than Lanyard's sidecar
//!   mounts a volume that projects a service-account token for an audience
//!   the clouds exchange ([`Guard::audiences`], compared ASCII
//!   case-insensitively).
//! - [`Rule::TokenVolumeMount`]: a container other than Lanyard's sidecar
//!   mounts the volume named `lanyard-tokens`, whatever it holds.
//! - [`Rule::AgentAddress`]: a pod with Lanyard's sidecar resolves the
//!   agent's host name its own way (`hostAliases` naming it, `dnsPolicy:
//!   None`, extra `dnsConfig.nameservers`), which would send the sidecar's
//!   tokens elsewhere. Only when the agent URL names a host, not an IP.
//! - [`Rule::ProcessAccess`]: in a pod with Lanyard's sidecar, a container
//!   that shares the sidecar's process namespace (the pod's
//!   `shareProcessNamespace` or `hostPID`, or an ephemeral container whose
//!   `targetContainerName` is the sidecar, as `kubectl debug --target`
//!   makes) holds `CAP_SYS_PTRACE` (added, `ALL`, or `privileged`). The
//!   sidecar's process is not dumpable and runs as its own user, so
//!   another user's `/proc/PID/root` and `/proc/PID/environ` are closed
//!   to it (Linux `ptrace_may_access`, `PTRACE_MODE_READ_FSCREDS`) unless
//!   it has that capability: with it, the sidecar's token volume is
//!   readable through `/proc/PID/root`.
//!
//! Lanyard's sidecar is recognised by [`SidecarShape::recognise`], the
//! function the mutation asks too (see [`super::recognise`] for the
//! fields that decide it; the CEL policy checks the same ones, field for
//! field).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Pod, PodSpec, SecurityContext, VolumeMount};

pub use super::recognise::{Recognised, SidecarShape};
use super::vocabulary::{InjectionConfig, SIDECAR_NAME, TOKENS_VOLUME};
use crate::config::Config;

/// Why the guard refused a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// A container other than the sidecar mounts a cloud-audience token.
    CloudTokenMount,
    /// A container other than the sidecar mounts `lanyard-tokens`.
    TokenVolumeMount,
    /// The pod redirects the agent's host name.
    AgentAddress,
    /// A container that can trace the sidecar's process.
    ProcessAccess,
}

impl Rule {
    /// The rule's name in audit records, metrics and messages.
    pub fn name(self) -> &'static str {
        match self {
            Rule::CloudTokenMount => "cloud-token-mount",
            Rule::TokenVolumeMount => "token-volume-mount",
            Rule::AgentAddress => "agent-address",
            Rule::ProcessAccess => "process-access",
        }
    }
}

/// A refusal: the rule, and a message naming the container and volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The rule that refused.
    pub rule: Rule,
    /// What the user is told.
    pub message: String,
}

/// The guard's settings, from the running configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Guard {
    /// Audiences refused outside the sidecar, ASCII-lowercased, sorted.
    pub audiences: Vec<String>,
    /// Lanyard's sidecar.
    pub sidecar: SidecarShape,
    /// The agent URL's host name, lowercased; `None` when it is an IP
    /// address or the node's (`$(LANYARD_HOST_IP)`).
    pub agent_host: Option<String>,
}

impl Guard {
    /// The guard for `config`: the audiences of every cloud Lanyard
    /// brokers there, and the sidecar the webhook injects.
    pub fn from_config(config: &Config) -> Guard {
        Guard::new(
            &InjectionConfig::from_config(config),
            &config.webhook.guard_extra_audiences,
        )
    }

    /// The guard for what `injection` injects: every audience under which
    /// a cloud it injects tokens for accepts them (all of Entra's exchange
    /// audiences, both spellings of a Google provider), and `extra`.
    pub fn new(injection: &InjectionConfig, extra: &[String]) -> Guard {
        let audiences: Vec<String> = injection
            .audiences
            .iter()
            .filter_map(|(cloud, audience)| Some(cloud.accepted_audiences(audience.as_deref()?)))
            .flatten()
            .chain(extra.iter().cloned())
            .collect();
        let mut audiences: Vec<String> = audiences
            .into_iter()
            .map(|a| a.trim().to_ascii_lowercase())
            .filter(|a| !a.is_empty())
            .collect();
        audiences.sort();
        audiences.dedup();
        Guard {
            audiences,
            sidecar: SidecarShape::of(injection),
            agent_host: agent_host(&injection.agent_url),
        }
    }

    /// Whether `audience` is one the guard refuses outside the sidecar.
    pub fn is_cloud_audience(&self, audience: &str) -> bool {
        self.audiences
            .binary_search(&audience.to_ascii_lowercase())
            .is_ok()
    }
}

/// The host name in `agent_url`, when it names one the pod could resolve
/// its own way.
pub(super) fn agent_host(agent_url: &str) -> Option<String> {
    if agent_url.contains("$(") {
        return None;
    }
    match url::Url::parse(agent_url).ok()?.host()? {
        url::Host::Domain(d) => Some(d.trim_end_matches('.').to_ascii_lowercase()),
        url::Host::Ipv4(_) | url::Host::Ipv6(_) => None,
    }
}

/// Checks `pod` against the guard's rules; the first broken rule refuses.
pub fn check(pod: &Pod, guard: &Guard) -> Result<(), Refusal> {
    let Some(spec) = pod.spec.as_ref() else {
        return Ok(());
    };
    // The volumes that hold a cloud-audience token, with that audience.
    let mut cloud_volumes: BTreeMap<&str, &str> = BTreeMap::new();
    for volume in spec.volumes.as_deref().unwrap_or_default() {
        let sources = volume
            .projected
            .as_ref()
            .and_then(|p| p.sources.as_deref())
            .unwrap_or_default();
        let audience = sources
            .iter()
            .filter_map(|s| s.service_account_token.as_ref()?.audience.as_deref())
            .find(|a| guard.is_cloud_audience(a));
        if let Some(audience) = audience {
            cloud_volumes.insert(&volume.name, audience);
        }
    }
    let refuse = |list: &str, container: &str, mount: &VolumeMount, why: &str| {
        let (rule, what) = match cloud_volumes.get(mount.name.as_str()) {
            Some(audience) => (
                Rule::CloudTokenMount,
                format!("which holds a service-account token for the audience {audience:?}"),
            ),
            None => (
                Rule::TokenVolumeMount,
                "which is reserved for Lanyard's sidecar".to_string(),
            ),
        };
        Err(Refusal {
            rule,
            message: format!(
                "lanyard guard ({}): {list} {container:?}{why} mounts volume {:?}, {what}; in this namespace only Lanyard's sidecar may hold such tokens (see docs/threat-model.md, \"Bypass\")",
                rule.name(),
                mount.name
            ),
        })
    };
    let holds_tokens =
        |m: &&VolumeMount| m.name == TOKENS_VOLUME || cloud_volumes.contains_key(m.name.as_str());
    let mut has_sidecar = false;
    for c in spec.init_containers.as_deref().unwrap_or_default() {
        let mounts = c.volume_mounts.as_deref().unwrap_or_default();
        if let Some(mount) = mounts.iter().find(holds_tokens) {
            if let Recognised::Foreign(broken) = guard.sidecar.recognise(c, None) {
                let why = format!(
                    " (not Lanyard's sidecar: it differs in {})",
                    broken.join(", ")
                );
                return refuse("init container", &c.name, mount, &why);
            }
            has_sidecar = true;
        }
    }
    // Lanyard's sidecar is an init container: any other holds none.
    let others = spec
        .containers
        .iter()
        .map(|c| ("container", &c.name, &c.volume_mounts))
        .chain(
            spec.ephemeral_containers
                .iter()
                .flatten()
                .map(|c| ("ephemeral container", &c.name, &c.volume_mounts)),
        );
    for (list, name, mounts) in others {
        if let Some(mount) = mounts.iter().flatten().find(holds_tokens) {
            return refuse(list, name, mount, "");
        }
    }
    if has_sidecar {
        if let Some(refusal) = process_access(spec) {
            return Err(refusal);
        }
        if let Some(host) = &guard.agent_host {
            if let Some(why) = agent_redirect(spec, host) {
                return Err(Refusal {
                    rule: Rule::AgentAddress,
                    message: format!(
                        "lanyard guard ({}): the pod {why}, which decides where Lanyard's sidecar sends the pod's tokens; remove it",
                        Rule::AgentAddress.name()
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The first container of a pod with Lanyard's sidecar that shares the
/// sidecar's process namespace and may trace it ([`Rule::ProcessAccess`]).
fn process_access(spec: &PodSpec) -> Option<Refusal> {
    let shared = if spec.share_process_namespace == Some(true) {
        Some("shareProcessNamespace")
    } else if spec.host_pid == Some(true) {
        Some("hostPID")
    } else {
        None
    };
    let init = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.name != SIDECAR_NAME)
        .map(|c| ("init container", &c.name, None, &c.security_context));
    let apps = spec
        .containers
        .iter()
        .map(|c| ("container", &c.name, None, &c.security_context));
    let ephemeral = spec.ephemeral_containers.iter().flatten().map(|c| {
        let target = c.target_container_name.as_deref();
        ("ephemeral container", &c.name, target, &c.security_context)
    });
    for (list, name, target, security) in init.chain(apps).chain(ephemeral) {
        let how = match (shared, target) {
            (_, Some(SIDECAR_NAME)) => format!("targets Lanyard's sidecar ({SIDECAR_NAME:?})"),
            (Some(field), _) => format!("shares the sidecar's processes ({field})"),
            (None, _) => continue,
        };
        let Some(power) = security.as_ref().and_then(ptrace_power) else {
            continue;
        };
        return Some(Refusal {
            rule: Rule::ProcessAccess,
            message: format!(
                "lanyard guard ({}): {list} {name:?} {how} and {power}, which reads the sidecar's tokens through /proc/PID/root; in this namespace no other container may trace Lanyard's sidecar (see docs/threat-model.md, \"Bypass\")",
                Rule::ProcessAccess.name()
            ),
        });
    }
    None
}

/// How a container's security context grants `CAP_SYS_PTRACE`, if it
/// does: `privileged`, or the capability (or `ALL`) added, in any case and
/// with or without the `CAP_` prefix (containerd and CRI-O upper-case the
/// names and add the prefix).
fn ptrace_power(security: &SecurityContext) -> Option<&'static str> {
    if security.privileged == Some(true) {
        return Some("is privileged");
    }
    let added = security.capabilities.as_ref()?.add.as_deref()?;
    added.iter().find_map(|cap| {
        let cap = cap.to_ascii_uppercase();
        match cap.strip_prefix("CAP_").unwrap_or(&cap) {
            "SYS_PTRACE" => Some("adds CAP_SYS_PTRACE"),
            "ALL" => Some("adds every capability (ALL)"),
            _ => None,
        }
    })
}

/// How `spec` would resolve the agent's `host` its own way, if it does.
pub(super) fn agent_redirect(spec: &PodSpec, host: &str) -> Option<String> {
    let dotted = format!("{host}.");
    for alias in spec.host_aliases.as_deref().unwrap_or_default() {
        for name in alias.hostnames.as_deref().unwrap_or_default() {
            let name = name.to_ascii_lowercase();
            if name == host || name.starts_with(&dotted) {
                return Some(format!(
                    "maps {name:?}, the node agent's host name, in hostAliases"
                ));
            }
        }
    }
    if spec.dns_policy.as_deref() == Some("None") {
        return Some("sets dnsPolicy: None (its own name servers)".into());
    }
    let nameservers = spec
        .dns_config
        .as_ref()
        .and_then(|d| d.nameservers.as_deref())
        .unwrap_or_default();
    if !nameservers.is_empty() {
        return Some("adds name servers in dnsConfig".into());
    }
    None
}
