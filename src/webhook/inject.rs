//! What the webhook injects, built from its settings: the sidecar (a
//! native sidecar), the transparent mode's redirect init container, the
//! projected token volumes and their mounts. `mutate` decides which apply
//! and patches them in; `own` compares a pod's copies against these.

use k8s_openapi::api::core::v1::{
    Capabilities, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource, ExecAction, HTTPGetAction,
    Lifecycle, LifecycleHandler, ObjectFieldSelector, Probe, ProjectedVolumeSource,
    ResourceRequirements, SeccompProfile, SecurityContext, ServiceAccountTokenProjection, Volume,
    VolumeMount, VolumeProjection,
};
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::vocabulary::*;
use crate::cloud::Cloud;

pub(super) fn plain_env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_string(),
        value: Some(value.to_string()),
        value_from: None,
    }
}

pub(super) fn mount(volume: &str, path: &str) -> VolumeMount {
    VolumeMount {
        name: volume.to_string(),
        mount_path: path.to_string(),
        read_only: Some(true),
        ..Default::default()
    }
}

pub(super) fn token_source(path: &str, audience: &str, expiration: i64) -> VolumeProjection {
    VolumeProjection {
        service_account_token: Some(ServiceAccountTokenProjection {
            audience: Some(audience.to_string()),
            expiration_seconds: Some(expiration),
            path: path.to_string(),
        }),
        ..Default::default()
    }
}

/// The cloud-token volume: one token per cloud that applies, in
/// [`Cloud::ALL`] order, each for that cloud's audience.
pub(super) fn tokens_volume(config: &InjectionConfig, clouds: &[Cloud], expiration: i64) -> Volume {
    let sources = clouds
        .iter()
        .filter_map(|&cloud| {
            let audience = config.audiences[cloud].as_deref()?;
            Some(token_source(cloud.name(), audience, expiration))
        })
        .collect();
    projected(TOKENS_VOLUME, sources)
}

/// The app-facing token's volume (AWS container endpoint's authorization).
pub(super) fn app_token_volume(config: &InjectionConfig, expiration: i64) -> Volume {
    projected(
        APP_TOKEN_VOLUME,
        vec![token_source("app", &config.app_audience, expiration)],
    )
}

/// The empty volume the sidecar mounts where the ServiceAccount admission
/// plugin would mount the API token ([`API_TOKEN_SHIELD_VOLUME`]).
pub(super) fn api_token_shield_volume() -> Volume {
    Volume {
        name: API_TOKEN_SHIELD_VOLUME.to_string(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Default::default()
    }
}

pub(super) fn projected(name: &str, sources: Vec<VolumeProjection>) -> Volume {
    Volume {
        name: name.to_string(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(sources),
            default_mode: None,
        }),
        ..Default::default()
    }
}

/// The sidecar as a native sidecar (restartable init container): it starts
/// before the other init containers and the apps, which start only once its
/// startup probe passes, and it does not keep a Job's pod alive.
pub(super) fn sidecar(
    config: &InjectionConfig,
    identity_header: &str,
    app_token: bool,
) -> Container {
    let mut env = vec![
        // First: the agent URL refers to it as $(LANYARD_HOST_IP), and the
        // kubelet only expands references to earlier entries.
        EnvVar {
            name: "LANYARD_HOST_IP".into(),
            value: None,
            value_from: Some(EnvVarSource {
                field_ref: Some(ObjectFieldSelector {
                    api_version: None,
                    field_path: "status.hostIP".into(),
                }),
                ..Default::default()
            }),
        },
        plain_env("LANYARD_AGENT_URL", &config.agent_url),
        plain_env("LANYARD_TOKEN_DIR", TOKEN_DIR),
    ];
    if app_token {
        env.push(plain_env("LANYARD_APP_TOKEN_FILE", APP_TOKEN_FILE));
        for (name, value) in config.sdk.sidecar_vars() {
            env.push(plain_env(name, &value));
        }
    }
    env.push(plain_env("IDENTITY_HEADER", identity_header));
    let mut mounts = vec![mount(TOKENS_VOLUME, TOKEN_DIR)];
    if app_token {
        mounts.push(mount(APP_TOKEN_VOLUME, APP_TOKEN_DIR));
    }
    // INVARIANT: the sidecar has a mount at the API token's path, so the
    // ServiceAccount admission plugin, run again after this webhook's
    // patch, adds none (API_TOKEN_SHIELD_VOLUME's doc).
    mounts.push(mount(API_TOKEN_SHIELD_VOLUME, API_TOKEN_DIR));
    let probe = |path: &str, period: i32, failures: i32| Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(i32::from(config.probe_port)),
            ..Default::default()
        }),
        period_seconds: Some(period),
        timeout_seconds: Some(2),
        failure_threshold: Some(failures),
        ..Default::default()
    };
    Container {
        name: SIDECAR_NAME.into(),
        image: Some(config.sidecar_image.clone()),
        image_pull_policy: config.image_pull_policy.clone(),
        // The slim sidecar binary the image ships next to `lanyard`.
        command: Some(vec![SIDECAR_COMMAND.into()]),
        args: Some(vec![
            "--listen".into(),
            format!("{LOOPBACK}:{}", config.port),
            "--probe-listen".into(),
            format!("0.0.0.0:{}", config.probe_port),
        ]),
        env: Some(env),
        volume_mounts: Some(mounts),
        restart_policy: Some("Always".into()),
        // INVARIANT: the hook is what keeps the apps from starting before
        // the sidecar is ready. The kubelet runs a postStart hook inside
        // the start of its container (kuberuntime_container.go
        // startContainer) and starts the next init container only on a
        // later sync that sees this one running with no startup probe left
        // to pass (kuberuntime_manager.go computeInitContainerActions), so
        // the next container starts once the hook has returned, and it
        // returns as soon as the sidecar is ready. A startup probe would
        // add a probe period on top (its first probe comes on the worker's
        // next tick after the container is seen running), so there is none.
        // A hook that fails (`--timeout`, 120 s: the kubelet sets none)
        // makes the kubelet kill and restart the sidecar, and nothing after
        // it starts meanwhile.
        lifecycle: Some(Lifecycle {
            post_start: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(wait_ready_command(config)),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        liveness_probe: Some(probe("/healthz", 10, 3)),
        resources: Some(resources(&config.resources)),
        security_context: Some(SecurityContext {
            run_as_non_root: Some(true),
            run_as_user: Some(SIDECAR_UID),
            run_as_group: Some(SIDECAR_UID),
            ..locked_down(None)
        }),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    }
}

/// The sidecar's postStart hook: `lanyard-sidecar wait-ready` on its probe
/// port, for as long as the startup probe would wait.
pub(super) fn wait_ready_command(config: &InjectionConfig) -> Vec<String> {
    vec![
        SIDECAR_COMMAND.into(),
        "wait-ready".into(),
        "--port".into(),
        config.probe_port.to_string(),
        "--timeout".into(),
        "120".into(),
    ]
}

/// Transparent mode's init container: `lanyard-sidecar redirect --port
/// PORT` installs the nf_tables rule that sends TCP to 169.254.169.254:80
/// to the sidecar's port, in the pod's network namespace, and exits. It is
/// the one container Lanyard runs as root: a capability added to a non-root
/// container is not effective, and the rule needs `CAP_NET_ADMIN`; it gets
/// that one capability and nothing else, and runs for milliseconds.
pub(super) fn redirect(config: &InjectionConfig) -> Container {
    Container {
        name: REDIRECT_NAME.into(),
        image: Some(config.sidecar_image.clone()),
        image_pull_policy: config.image_pull_policy.clone(),
        command: Some(vec![
            SIDECAR_COMMAND.into(),
            "redirect".into(),
            "--port".into(),
            config.port.to_string(),
        ]),
        resources: Some(resources(&config.resources)),
        security_context: Some(SecurityContext {
            // Overrides a pod-level runAsNonRoot: true.
            run_as_non_root: Some(false),
            run_as_user: Some(0),
            ..locked_down(Some(vec!["NET_ADMIN".into()]))
        }),
        termination_message_policy: Some("FallbackToLogsOnError".into()),
        ..Default::default()
    }
}

/// What every container Lanyard injects shares: a read-only root, no
/// privilege escalation, every capability dropped but `add`, the runtime's
/// seccomp profile. The user is each container's own.
pub(super) fn locked_down(add: Option<Vec<String>>) -> SecurityContext {
    SecurityContext {
        read_only_root_filesystem: Some(true),
        allow_privilege_escalation: Some(false),
        privileged: Some(false),
        capabilities: Some(Capabilities {
            add,
            drop: Some(vec!["ALL".into()]),
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

/// The sidecar's requests and limits (`webhook.sidecar_*`); the redirect
/// container takes the same, well above what it uses.
pub(super) fn resources(r: &SidecarResources) -> ResourceRequirements {
    let quantities = |pairs: [(&str, &Option<String>); 2]| {
        let map: BTreeMap<String, Quantity> = pairs
            .into_iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| (k.to_string(), Quantity(v.clone()))))
            .collect();
        (!map.is_empty()).then_some(map)
    };
    ResourceRequirements {
        requests: quantities([("cpu", &r.cpu_request), ("memory", &r.memory_request)]),
        limits: quantities([("cpu", &r.cpu_limit), ("memory", &r.memory_limit)]),
        claims: None,
    }
}
