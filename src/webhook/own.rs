//! Lanyard's own objects in a pod, recognised by their content, never by
//! their names.
//!
//! Why: the pod spec is the author's. A container named `lanyard` may be
//! the sidecar a first pass of the webhook added (reinvocation), one a
//! controller copied from a mutated pod, or the author's own image waiting
//! for the cloud-token volume; a volume named `lanyard-tokens` may be
//! Lanyard's projection or an `emptyDir` whose contents the author
//! chooses. Only the first two may stand. So each of Lanyard's names in the
//! pod must carry exactly what the webhook would inject for this pod now,
//! after the defaults the API server fills in ([`defaulted_container`],
//! [`defaulted_volume`]); anything else denies the pod with a message
//! naming the object and the fields that differ. And the cloud-token volume
//! is mounted by the sidecar alone.

use k8s_openapi::api::core::v1::{Container, PodSpec, Probe, Volume};
use serde_json::Value;

use super::vocabulary::{
    Denial, API_TOKEN_SHIELD_VOLUME, APP_TOKEN_VOLUME, REDIRECT_NAME, SIDECAR_NAME, TOKENS_VOLUME,
};

/// What the webhook would inject into this pod now.
pub(super) struct Expected<'a> {
    /// The sidecar, built with the pod's existing `IDENTITY_HEADER` (the
    /// one free value in it); `None` when Lanyard injects none (or, since
    /// it is then never consulted, when the pod has no `lanyard` init
    /// container).
    pub sidecar: Option<&'a Container>,
    /// The transparent-mode init container (whether or not the pod asks
    /// for transparent mode: the exact container is harmless either way).
    pub redirect: Option<&'a Container>,
    /// The cloud-token volume; `None` when no cloud applies.
    pub tokens: Option<&'a Volume>,
    /// The app-token volume; `None` without an AWS binding.
    pub app_token: Option<&'a Volume>,
    /// The empty volume over the sidecar's API token path; `None` when no
    /// cloud applies.
    pub shield: Option<&'a Volume>,
}

/// Which of Lanyard's objects the pod already carries, each one checked.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Present {
    pub sidecar: bool,
    pub redirect: bool,
    pub tokens: bool,
    pub app_token: bool,
    pub shield: bool,
}

/// Checks every object of the pod that bears one of Lanyard's names, and
/// every mount of the cloud-token volume.
///
/// INVARIANT: on `Ok`, each of Lanyard's names in the pod is exactly
/// Lanyard's object, and no container but the sidecar mounts
/// [`TOKENS_VOLUME`]: the mutation may then leave what is present alone
/// and add only what is missing.
pub(super) fn check(spec: &PodSpec, pod_ref: &str, expected: &Expected) -> Result<Present, Denial> {
    let mut present = Present::default();
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let ephemeral = spec.ephemeral_containers.as_deref().unwrap_or_default();
    let deny = |what: String, why: String| {
        Err(Denial {
            code: 403,
            message: format!(
                "pod {pod_ref}: {what} {why}; Lanyard injects its own objects, so remove it from the pod spec (or rename it)"
            ),
        })
    };
    let mut sidecar_index = None;
    for (index, container) in init.iter().enumerate() {
        let (want, slot) = match container.name.as_str() {
            SIDECAR_NAME => (expected.sidecar, &mut present.sidecar),
            REDIRECT_NAME => (expected.redirect, &mut present.redirect),
            _ => continue,
        };
        if let Err(why) = claim(slot, container, want, defaulted_container) {
            return deny(format!("init container {:?}", container.name), why);
        }
        if container.name == SIDECAR_NAME {
            sidecar_index = Some(index);
        }
    }
    let named = spec
        .containers
        .iter()
        .map(|c| ("app container", &c.name))
        .chain(ephemeral.iter().map(|c| ("ephemeral container", &c.name)));
    for (list, name) in named {
        if name == SIDECAR_NAME || name == REDIRECT_NAME {
            return deny(
                format!("{list} {name:?}"),
                "bears the name of a container Lanyard injects as an init container".into(),
            );
        }
    }
    for volume in spec.volumes.as_deref().unwrap_or_default() {
        let (want, slot) = match volume.name.as_str() {
            TOKENS_VOLUME => (expected.tokens, &mut present.tokens),
            APP_TOKEN_VOLUME => (expected.app_token, &mut present.app_token),
            API_TOKEN_SHIELD_VOLUME => (expected.shield, &mut present.shield),
            _ => continue,
        };
        if let Err(why) = claim(slot, volume, want, defaulted_volume) {
            return deny(format!("volume {:?}", volume.name), why);
        }
    }
    let mounts = |mounts: Option<&Vec<k8s_openapi::api::core::v1::VolumeMount>>| {
        mounts.is_some_and(|m| m.iter().any(|m| m.name == TOKENS_VOLUME))
    };
    let others = init
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != sidecar_index)
        .map(|(_, c)| ("init container", &c.name, mounts(c.volume_mounts.as_ref())))
        .chain(
            spec.containers
                .iter()
                .map(|c| ("app container", &c.name, mounts(c.volume_mounts.as_ref()))),
        )
        .chain(ephemeral.iter().map(|c| {
            (
                "ephemeral container",
                &c.name,
                mounts(c.volume_mounts.as_ref()),
            )
        }));
    for (list, name, mounted) in others {
        if mounted {
            return deny(
                format!("{list} {name:?} mounts volume {TOKENS_VOLUME:?}, which"),
                "holds the cloud-audience tokens and is for Lanyard's sidecar alone".into(),
            );
        }
    }
    Ok(present)
}

/// Takes `actual` as Lanyard's object for its name (`slot`), or says why it
/// is not: the name appears twice, Lanyard injects no such object here, or
/// it differs from `want` once both have the API server's `defaults`.
fn claim<T: Clone + serde::Serialize>(
    slot: &mut bool,
    actual: &T,
    want: Option<&T>,
    defaults: fn(T) -> T,
) -> Result<(), String> {
    if *slot {
        return Err("appears twice".into());
    }
    let Some(want) = want else {
        return Err("is not Lanyard's: Lanyard injects no such object into this pod".into());
    };
    let differ = differing_fields(&defaults(actual.clone()), &defaults(want.clone()));
    if !differ.is_empty() {
        return Err(format!(
            "is not Lanyard's (it differs in {})",
            differ.join(", ")
        ));
    }
    *slot = true;
    Ok(())
}

/// `container` with the defaults the API server fills in (its
/// `SetDefaults_*` for core/v1, applied again after every mutating webhook's
/// patch), so that Lanyard's sidecar as the API server stores it compares
/// equal to the one the webhook builds.
pub(crate) fn defaulted_container(mut c: Container) -> Container {
    if c.image_pull_policy
        .as_deref()
        .unwrap_or_default()
        .is_empty()
    {
        c.image_pull_policy =
            Some(default_pull_policy(c.image.as_deref().unwrap_or_default()).into());
    }
    if c.termination_message_path
        .as_deref()
        .unwrap_or_default()
        .is_empty()
    {
        c.termination_message_path = Some("/dev/termination-log".into());
    }
    if c.termination_message_policy
        .as_deref()
        .unwrap_or_default()
        .is_empty()
    {
        c.termination_message_policy = Some("File".into());
    }
    for probe in [
        &mut c.startup_probe,
        &mut c.liveness_probe,
        &mut c.readiness_probe,
    ]
    .into_iter()
    .flatten()
    {
        default_probe(probe);
    }
    for var in c.env.iter_mut().flatten() {
        if let Some(field) = var.value_from.as_mut().and_then(|f| f.field_ref.as_mut()) {
            if field.api_version.as_deref().unwrap_or_default().is_empty() {
                field.api_version = Some("v1".into());
            }
        }
    }
    if let Some(resources) = c.resources.as_mut() {
        // A limit without a request makes the request equal to the limit.
        if let Some(limits) = resources.limits.clone() {
            let requests = resources.requests.get_or_insert_with(Default::default);
            for (name, quantity) in limits {
                requests.entry(name).or_insert(quantity);
            }
        }
    }
    // Clusters with in-place resize default each resource's policy to
    // NotRequired, which is what no policy means.
    if let Some(policies) = c.resize_policy.as_mut() {
        policies.retain(|p| p.restart_policy != "NotRequired");
    }
    c
}

fn default_probe(probe: &mut Probe) {
    probe.timeout_seconds.get_or_insert(1);
    probe.period_seconds.get_or_insert(10);
    probe.success_threshold.get_or_insert(1);
    probe.failure_threshold.get_or_insert(3);
    if let Some(get) = probe.http_get.as_mut() {
        if get.path.as_deref().unwrap_or_default().is_empty() {
            get.path = Some("/".into());
        }
        if get.scheme.as_deref().unwrap_or_default().is_empty() {
            get.scheme = Some("HTTP".into());
        }
    }
}

/// Kubernetes' default `imagePullPolicy`: `Always` for `:latest` or no
/// tag, else `IfNotPresent` (a digest counts as pinned).
fn default_pull_policy(image: &str) -> &'static str {
    if image.contains('@') {
        return "IfNotPresent";
    }
    let last = image.rsplit('/').next().unwrap_or(image);
    match last.rsplit_once(':') {
        Some((_, "latest")) | None => "Always",
        Some(_) => "IfNotPresent",
    }
}

/// `volume` with the API server's defaults: a projected volume's mode
/// 0644, a token's lifetime one hour.
pub(crate) fn defaulted_volume(mut v: Volume) -> Volume {
    if let Some(projected) = v.projected.as_mut() {
        projected.default_mode.get_or_insert(0o644);
        for source in projected.sources.iter_mut().flatten() {
            if let Some(token) = source.service_account_token.as_mut() {
                token.expiration_seconds.get_or_insert(3600);
            }
        }
    }
    v
}

/// The top-level fields in which two objects differ, once empty lists,
/// maps and nulls (which the API server omits) are dropped.
fn differing_fields<T: serde::Serialize>(actual: &T, wanted: &T) -> Vec<String> {
    let (Ok(actual), Ok(wanted)) = (serde_json::to_value(actual), serde_json::to_value(wanted))
    else {
        return vec!["its encoding".into()];
    };
    let (Value::Object(mut a), Value::Object(mut w)) = (pruned(actual), pruned(wanted)) else {
        return vec!["its shape".into()];
    };
    let mut keys: Vec<String> = a.keys().chain(w.keys()).cloned().collect();
    keys.sort();
    keys.dedup();
    keys.retain(|k| a.remove(k) != w.remove(k));
    keys
}

/// `value` without nulls, empty arrays and empty objects, at any depth.
fn pruned(value: Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, pruned(v)))
                .filter(|(_, v)| !is_empty(v))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.into_iter().map(pruned).collect()),
        other => other,
    }
}

fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ResourceRequirements;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

    #[test]
    fn pull_policy_defaults_follow_the_tag() {
        for (image, policy) in [
            ("lanyard", "Always"),
            ("reg:5000/lanyard", "Always"),
            ("reg:5000/lanyard:latest", "Always"),
            ("reg:5000/lanyard:0.1.0", "IfNotPresent"),
            ("reg/lanyard@sha256:abc", "IfNotPresent"),
        ] {
            assert_eq!(default_pull_policy(image), policy, "{image}");
        }
    }

    #[test]
    fn defaults_make_a_stored_container_equal_to_the_built_one() {
        let built: Container = serde_json::from_value(json!({
            "name": "x", "image": "r/l:1",
            "env": [{"name": "H", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
            "startupProbe": {"httpGet": {"path": "/readyz", "port": 1}, "periodSeconds": 1},
            "resources": {"limits": {"memory": "64Mi"}},
        }))
        .unwrap();
        let stored: Container = serde_json::from_value(json!({
            "name": "x", "image": "r/l:1", "imagePullPolicy": "IfNotPresent",
            "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            "env": [{"name": "H", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.hostIP"}}}],
            "startupProbe": {"httpGet": {"path": "/readyz", "port": 1, "scheme": "HTTP"}, "periodSeconds": 1,
                             "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3},
            "resources": {"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}},
            "resizePolicy": [{"resourceName": "memory", "restartPolicy": "NotRequired"}],
            "args": [],
        }))
        .unwrap();
        assert!(differing_fields(
            &defaulted_container(stored.clone()),
            &defaulted_container(built.clone())
        )
        .is_empty());
        let mut other = stored;
        other.resources = Some(ResourceRequirements {
            limits: Some([("memory".to_string(), Quantity("1Gi".into()))].into()),
            ..Default::default()
        });
        other.image = Some("evil/l:1".into());
        assert_eq!(
            differing_fields(&defaulted_container(other), &defaulted_container(built)),
            ["image", "resources"]
        );
    }
}
