//! The defaults kube-apiserver fills into a pod after every mutating
//! webhook's patch (its `SetDefaults_*` for core/v1), and the comparison of
//! two objects once both have them.
//!
//! Why: Lanyard recognises its own objects in a pod by their content
//! ([`super::own`], [`super::recognise`]); a reinvoked webhook sees them as
//! the API server stored them, with these fields filled in, and must still
//! find them equal to what it builds.

use k8s_openapi::api::core::v1::{Container, Probe, Volume};
use serde_json::Value;

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
pub(super) fn differing_fields<T: serde::Serialize>(actual: &T, wanted: &T) -> Vec<String> {
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
