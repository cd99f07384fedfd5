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
//! Lanyard's sidecar is an init container that runs Lanyard's code with
//! Lanyard's settings and sees only Lanyard's volumes: named `lanyard`,
//! `restartPolicy: Always`, the configured image, command and arguments, no
//! `envFrom`, only the sidecar's own variables with their values (its
//! `IDENTITY_HEADER` is the pod's own), only the two token mounts at their
//! paths (and the empty volume over the API token's path), no lifecycle hook but its own `wait-ready` (or none, as injected
//! before it existed) and no exec probes ([`SidecarShape`]). These
//! are the fields that decide what runs and where the tokens go; the CEL
//! policy checks the same ones, field for field.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Lifecycle, Pod, PodSpec, Probe, SecurityContext, VolumeMount,
};

use super::vocabulary::{
    InjectionConfig, API_TOKEN_DIR, API_TOKEN_SHIELD_VOLUME, APP_TOKEN_DIR, APP_TOKEN_VOLUME,
    SIDECAR_NAME, TOKENS_VOLUME, TOKEN_DIR,
};
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

/// What Lanyard's sidecar is, field by field (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SidecarShape {
    /// The configured sidecar image.
    pub image: String,
    /// `command`.
    pub command: Vec<String>,
    /// `args`.
    pub args: Vec<String>,
    /// Variables with a fixed literal value.
    pub fixed_env: BTreeMap<String, String>,
    /// The postStart hook's command (`lanyard-sidecar wait-ready`).
    pub post_start: Vec<String>,
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

impl SidecarShape {
    /// The shape of the sidecar [`InjectionConfig`] injects, read off the
    /// container the mutation builds (with an AWS binding, so that every
    /// variable it may carry is listed).
    pub fn of(config: &InjectionConfig) -> SidecarShape {
        let built = super::inject::sidecar(config, "", true);
        let fixed_env = built
            .env
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.value_from.is_none() && e.name != IDENTITY_HEADER)
            .filter_map(|e| Some((e.name, e.value?)))
            .collect();
        SidecarShape {
            image: config.sidecar_image.clone(),
            command: built.command.unwrap_or_default(),
            args: built.args.unwrap_or_default(),
            fixed_env,
            post_start: super::inject::wait_ready_command(config),
        }
    }

    /// Whether `c`, an init container, is Lanyard's sidecar.
    pub fn matches(&self, c: &Container) -> bool {
        c.name == SIDECAR_NAME
            && c.restart_policy.as_deref() == Some("Always")
            && c.image.as_deref() == Some(self.image.as_str())
            && c.command.as_deref().unwrap_or_default() == self.command.as_slice()
            && c.args.as_deref().unwrap_or_default() == self.args.as_slice()
            && c.env_from.as_deref().unwrap_or_default().is_empty()
            && c.env.as_deref().unwrap_or_default().iter().all(|e| {
                let from = e.value_from.as_ref();
                match e.name.as_str() {
                    HOST_IP => from
                        .and_then(|f| f.field_ref.as_ref())
                        .is_some_and(|f| f.field_path == "status.hostIP"),
                    IDENTITY_HEADER => from.is_none(),
                    name => {
                        from.is_none()
                            && self.fixed_env.get(name).map(String::as_str) == e.value.as_deref()
                            && e.value.is_some()
                    }
                }
            })
            && c.volume_mounts
                .as_deref()
                .unwrap_or_default()
                .iter()
                .all(|m| {
                    (m.name == TOKENS_VOLUME && m.mount_path == TOKEN_DIR)
                        || (m.name == APP_TOKEN_VOLUME && m.mount_path == APP_TOKEN_DIR)
                        || (m.name == API_TOKEN_SHIELD_VOLUME && m.mount_path == API_TOKEN_DIR)
                })
            && c.lifecycle.as_ref().is_none_or(|l| self.own_hook(l))
            && [&c.startup_probe, &c.liveness_probe, &c.readiness_probe]
                .into_iter()
                .all(|p| p.as_ref().is_none_or(|p: &Probe| p.exec.is_none()))
    }

    /// Whether `lifecycle` is the sidecar's own: a postStart exec of
    /// `wait-ready` and nothing else. Sidecars injected before the hook
    /// existed have no lifecycle, and are Lanyard's too.
    fn own_hook(&self, lifecycle: &Lifecycle) -> bool {
        lifecycle.pre_stop.is_none()
            && lifecycle.post_start.as_ref().is_some_and(|h| {
                h.http_get.is_none()
                    && h.sleep.is_none()
                    && h.tcp_socket.is_none()
                    && h.exec
                        .as_ref()
                        .and_then(|e| e.command.as_deref())
                        .is_some_and(|c| c == self.post_start.as_slice())
            })
    }
}

const HOST_IP: &str = "LANYARD_HOST_IP";
const IDENTITY_HEADER: &str = "IDENTITY_HEADER";

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
    let refuse = |list: &str, container: &str, mount: &VolumeMount| {
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
                "lanyard guard ({}): {list} {container:?} mounts volume {:?}, {what}; in this namespace only Lanyard's sidecar may hold such tokens (see docs/threat-model.md, \"Bypass\")",
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
            if !guard.sidecar.matches(c) {
                return refuse("init container", &c.name, mount);
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
            return refuse(list, name, mount);
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
