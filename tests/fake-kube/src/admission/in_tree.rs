//! kube-apiserver's built-in mutating admission plugins that change a Pod
//! in a default cluster, in their order (`pkg/kubeapiserver/options/
//! plugins.go` `AllOrderedPlugins`: ... ServiceAccount, ..., Priority,
//! DefaultTolerationSeconds, ..., MutatingAdmissionWebhook). The chain
//! runs them again after a mutating webhook changed the pod
//! (`k8s.io/apiserver/pkg/admission/reinvocation.go`): each is idempotent,
//! and the ServiceAccount plugin's second run is what mounts the API token
//! into containers a webhook added.
//!
//! Not modelled, because they leave these pods alone in the clusters the
//! tests stand for: LimitRanger (no LimitRange), RuntimeClass (no
//! `runtimeClassName`), PodSecurity (validates only), NodeRestriction
//! (kubelets' requests).

use serde_json::{json, Value};

use super::{Attributes, Operation, Rejection};
use crate::FakeKube;

/// `DefaultAPITokenMountPath`.
pub(crate) const API_TOKEN_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// `ServiceAccountVolumeName`, the prefix of the API token volume's name.
pub(crate) const API_VOLUME_PREFIX: &str = "kube-api-access-";
/// `serviceaccount.WarnOnlyBoundTokenExpirationSeconds` (`60*60 + 7`).
pub(crate) const API_TOKEN_SECONDS: i64 = 3607;
/// The annotation that marks a static pod's mirror (`kubernetes.io/config.mirror`).
const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// Runs every modelled plugin on `a`, in kube-apiserver's order.
pub(super) fn admit(fake: &FakeKube, a: &mut Attributes) -> Result<(), Rejection> {
    service_account(fake, a)?;
    priority(a)?;
    default_toleration_seconds(a);
    Ok(())
}

/// The ServiceAccount plugin (`plugin/pkg/admission/serviceaccount/
/// admission.go` `Admit`): on pod CREATE only (not updates, not
/// `pods/ephemeralcontainers`), and not for mirror pods, it defaults
/// `serviceAccountName` to `default`, refuses a pod whose ServiceAccount
/// does not exist, mounts the API token (`mountServiceAccountToken`)
/// unless the pod or, failing that, the ServiceAccount sets
/// `automountServiceAccountToken: false` (`shouldAutomount`: the pod's
/// preference wins), and copies the ServiceAccount's `imagePullSecrets`
/// into a pod that has none.
fn service_account(fake: &FakeKube, a: &mut Attributes) -> Result<(), Rejection> {
    if a.operation != Operation::Create || !a.sub_resource.is_empty() {
        return Ok(());
    }
    let mirror = a
        .object
        .pointer("/metadata/annotations")
        .and_then(|m| m.get(MIRROR_ANNOTATION))
        .is_some();
    if mirror {
        return Ok(());
    }
    let namespace = a.namespace.clone();
    let pod_name = a.display_name();
    let Some(spec) = a.object.get_mut("spec").and_then(Value::as_object_mut) else {
        return Ok(());
    };
    let name = match spec.get("serviceAccountName").and_then(Value::as_str) {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => {
            spec.insert("serviceAccountName".into(), json!("default"));
            "default".to_string()
        }
    };
    let account = fake.stored_value(crate::Kind::ServiceAccount, &namespace, &name);
    // The ServiceAccount controller creates `default` in every namespace
    // as soon as the namespace exists; the fake stands in for it.
    let account = match account {
        Some(account) => account,
        None if name == "default" && fake.namespace_exists(&namespace) => {
            json!({"metadata": {"name": "default", "namespace": namespace}})
        }
        None => {
            return Err(Rejection::forbidden(
                "pods",
                &pod_name,
                &format!(
                    "error looking up service account {namespace}/{name}: serviceaccount \"{name}\" not found"
                ),
            ))
        }
    };
    let automount = spec
        .get("automountServiceAccountToken")
        .and_then(Value::as_bool)
        .or_else(|| account["automountServiceAccountToken"].as_bool())
        .unwrap_or(true);
    if automount {
        mount_api_token(spec);
    }
    let has_secrets = spec
        .get("imagePullSecrets")
        .and_then(Value::as_array)
        .is_some_and(|s| !s.is_empty());
    if !has_secrets {
        let names: Vec<Value> = account["imagePullSecrets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.get("name").cloned())
            .map(|name| json!({ "name": name }))
            .collect();
        if !names.is_empty() {
            spec.insert("imagePullSecrets".into(), Value::Array(names));
        }
    }
    Ok(())
}

/// `mountServiceAccountToken`: the first volume named `kube-api-access-*`
/// is the token's (else a new name, `SimpleNameGenerator`: five characters
/// of `bcdfghjklmnpqrstvwxz2456789`); every init container, then every
/// app container, with no mount at exactly [`API_TOKEN_PATH`] gets a
/// read-only mount of it there (ephemeral containers none); the volume is
/// added when a container needed it and none existed
/// (`TokenVolumeSource`).
pub(crate) fn mount_api_token(spec: &mut serde_json::Map<String, Value>) {
    let existing = spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.get("name")?.as_str())
        .find(|name| name.starts_with(API_VOLUME_PREFIX))
        .map(str::to_string);
    let volume_name = existing.clone().unwrap_or_else(|| {
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let random = uuid::Uuid::new_v4();
        let suffix: String = random.as_bytes()[..5]
            .iter()
            .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
            .collect();
        format!("{API_VOLUME_PREFIX}{suffix}")
    });
    let mut needed = false;
    for list in ["initContainers", "containers"] {
        let containers = spec.get_mut(list).and_then(Value::as_array_mut);
        for container in containers.into_iter().flatten() {
            let Some(container) = container.as_object_mut() else {
                continue;
            };
            let mounts = container.entry("volumeMounts").or_insert_with(|| json!([]));
            let Some(mounts) = mounts.as_array_mut() else {
                continue;
            };
            let has = mounts
                .iter()
                .any(|m| m.get("mountPath").and_then(Value::as_str) == Some(API_TOKEN_PATH));
            if !has {
                mounts.push(
                    json!({"name": volume_name, "readOnly": true, "mountPath": API_TOKEN_PATH}),
                );
                needed = true;
            }
            if mounts.is_empty() {
                container.remove("volumeMounts");
            }
        }
    }
    if existing.is_none() && needed {
        let volumes = spec.entry("volumes").or_insert_with(|| json!([]));
        if let Some(volumes) = volumes.as_array_mut() {
            volumes.push(api_token_volume(&volume_name));
        }
    }
}

/// `TokenVolumeSource`: the token (no audience: the API server's), the
/// cluster's CA and the namespace, mode 0644.
pub(crate) fn api_token_volume(name: &str) -> Value {
    json!({"name": name, "projected": {
        "sources": [
            {"serviceAccountToken": {"expirationSeconds": API_TOKEN_SECONDS, "path": "token"}},
            {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
            {"downwardAPI": {"items": [{"path": "namespace",
                                        "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}]}},
        ],
        "defaultMode": 420,
    }})
}

/// The built-in PriorityClasses every cluster has
/// (`pkg/apis/scheduling` `SystemPriorityClasses`).
const SYSTEM_CLASSES: [(&str, i64); 2] = [
    ("system-node-critical", 2_000_001_000),
    ("system-cluster-critical", 2_000_000_000),
];

/// The Priority plugin (`plugin/pkg/admission/priority/admission.go`
/// `admitPod`), on pod CREATE: with no `priorityClassName` and no global
/// default class, `priority: 0` and `preemptionPolicy:
/// PreemptLowerPriority` (`DefaultPriorityWhenNoDefaultClassExists`); a
/// system class's value; any other class is refused, as is a client's own
/// `priority` or `preemptionPolicy` that differs from the computed one.
fn priority(a: &mut Attributes) -> Result<(), Rejection> {
    if a.operation != Operation::Create || !a.sub_resource.is_empty() {
        return Ok(());
    }
    let pod_name = a.display_name();
    let Some(spec) = a.object.get_mut("spec").and_then(Value::as_object_mut) else {
        return Ok(());
    };
    let class = spec
        .get("priorityClassName")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let value = if class.is_empty() {
        0
    } else {
        match SYSTEM_CLASSES.iter().find(|(name, _)| *name == class) {
            Some((_, value)) => *value,
            None => {
                return Err(Rejection::forbidden(
                    "pods",
                    &pod_name,
                    &format!("no PriorityClass with name {class} was found"),
                ))
            }
        }
    };
    if let Some(given) = spec.get("priority").and_then(Value::as_i64) {
        if given != value {
            return Err(Rejection::forbidden(
                "pods",
                &pod_name,
                &format!("the integer value of priority ({given}) must not be provided in pod spec; priority admission controller computed {value} from the given PriorityClass name"),
            ));
        }
    }
    let policy = "PreemptLowerPriority";
    if let Some(given) = spec.get("preemptionPolicy").and_then(Value::as_str) {
        if given != policy {
            return Err(Rejection::forbidden(
                "pods",
                &pod_name,
                &format!("the string value of PreemptionPolicy ({given}) must not be provided in pod spec; priority admission controller computed {policy} from the given PriorityClass name"),
            ));
        }
    }
    spec.insert("priority".into(), json!(value));
    spec.insert("preemptionPolicy".into(), json!(policy));
    Ok(())
}

/// DefaultTolerationSeconds (`plugin/pkg/admission/
/// defaulttolerationseconds/admission.go`), on pod CREATE and UPDATE
/// (no subresource): a `NoExecute` toleration of 300 s for
/// `node.kubernetes.io/not-ready` and for `node.kubernetes.io/unreachable`,
/// each unless one the pod has already covers it (its key that one or
/// empty, its effect `NoExecute` or empty).
fn default_toleration_seconds(a: &mut Attributes) {
    if !a.sub_resource.is_empty() {
        return;
    }
    let Some(spec) = a.object.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    let tolerations = spec.entry("tolerations").or_insert_with(|| json!([]));
    let Some(tolerations) = tolerations.as_array_mut() else {
        return;
    };
    for key in [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ] {
        let covered = tolerations.iter().any(|t| {
            let text = |field: &str| t.get(field).and_then(Value::as_str).unwrap_or_default();
            (text("key") == key || text("key").is_empty())
                && (text("effect") == "NoExecute" || text("effect").is_empty())
        });
        if !covered {
            tolerations.push(
                json!({"key": key, "operator": "Exists", "effect": "NoExecute",
                                    "tolerationSeconds": 300}),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(value: Value) -> serde_json::Map<String, Value> {
        value.as_object().cloned().unwrap()
    }

    #[test]
    fn the_token_is_mounted_where_no_mount_is_at_its_path() {
        let mut s = spec(json!({
            "initContainers": [{"name": "own", "volumeMounts": [
                {"name": "mine", "mountPath": API_TOKEN_PATH}]}],
            "containers": [{"name": "app"}, {"name": "near", "volumeMounts": [
                {"name": "x", "mountPath": format!("{API_TOKEN_PATH}/")}]}],
            "ephemeralContainers": [{"name": "debug"}],
        }));
        mount_api_token(&mut s);
        let volume = s["volumes"][0]["name"].as_str().unwrap().to_string();
        assert!(
            volume.starts_with(API_VOLUME_PREFIX) && volume.len() == API_VOLUME_PREFIX.len() + 5
        );
        assert_eq!(s["volumes"][0], api_token_volume(&volume));
        // A mount at the exact path keeps it out; a trailing slash does not.
        assert_eq!(
            s["initContainers"][0]["volumeMounts"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            s["containers"][0]["volumeMounts"][0]["name"],
            volume.as_str()
        );
        assert_eq!(
            s["containers"][1]["volumeMounts"][1]["name"],
            volume.as_str()
        );
        assert!(s["ephemeralContainers"][0].get("volumeMounts").is_none());
        // Run again (reinvocation) with a container added: it reuses the volume.
        let containers = s.get_mut("containers").unwrap().as_array_mut().unwrap();
        containers.push(json!({"name": "added"}));
        mount_api_token(&mut s);
        assert_eq!(s["volumes"].as_array().unwrap().len(), 1);
        assert_eq!(
            s["containers"][2]["volumeMounts"][0]["name"],
            volume.as_str()
        );
        assert_eq!(
            s["containers"][0]["volumeMounts"].as_array().unwrap().len(),
            1
        );
    }

    #[test]
    fn the_pods_automount_preference_wins_over_the_service_accounts() {
        let fake = FakeKube::new("https://issuer", &json!({}), "t");
        fake.apply_namespace(serde_json::from_value(json!({"metadata": {"name": "ns"}})).unwrap());
        fake.apply_service_account(
            serde_json::from_value(json!({"metadata": {"name": "quiet", "namespace": "ns"},
                                          "automountServiceAccountToken": false,
                                          "imagePullSecrets": [{"name": "registry"}]}))
            .unwrap(),
        );
        let admitted = |pod_setting: Value, account: &str| {
            let mut spec = json!({"serviceAccountName": account, "containers": [{"name": "app"}]});
            if !pod_setting.is_null() {
                spec["automountServiceAccountToken"] = pod_setting;
            }
            let mut a = Attributes::for_test(Operation::Create, json!({"spec": spec}));
            service_account(&fake, &mut a).map(|()| a.object)
        };
        let mounted = |pod: &Value| {
            pod["spec"]["volumes"]
                .as_array()
                .is_some_and(|v| !v.is_empty())
        };
        // The ServiceAccount's false holds when the pod says nothing...
        let pod = admitted(Value::Null, "quiet").unwrap();
        assert!(!mounted(&pod));
        assert_eq!(
            pod["spec"]["imagePullSecrets"],
            json!([{"name": "registry"}])
        );
        // ...and the pod's own true overrides it.
        assert!(mounted(&admitted(json!(true), "quiet").unwrap()));
        // `default` exists once the namespace does; the pod's false holds.
        assert!(mounted(&admitted(Value::Null, "default").unwrap()));
        assert!(!mounted(&admitted(json!(false), "default").unwrap()));
        let missing = admitted(Value::Null, "nobody").unwrap_err();
        assert_eq!(missing.code, 403);
        assert!(
            missing.message.ends_with(
                "error looking up service account ns/nobody: serviceaccount \"nobody\" not found"
            ),
            "{}",
            missing.message
        );
    }

    #[test]
    fn tolerations_are_added_unless_covered() {
        let mut a = Attributes::for_test(
            Operation::Create,
            json!({"spec": {"tolerations": [{"operator": "Exists"}]}}),
        );
        default_toleration_seconds(&mut a);
        assert_eq!(a.object["spec"]["tolerations"].as_array().unwrap().len(), 1);
        let mut a = Attributes::for_test(Operation::Create, json!({"spec": {}}));
        default_toleration_seconds(&mut a);
        assert_eq!(
            a.object["spec"]["tolerations"][1],
            json!({"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                   "effect": "NoExecute", "tolerationSeconds": 300})
        );
    }

    #[test]
    fn priority_is_computed_not_given() {
        let mut a = Attributes::for_test(Operation::Create, json!({"spec": {}}));
        priority(&mut a).unwrap();
        assert_eq!(a.object["spec"]["priority"], 0);
        assert_eq!(a.object["spec"]["preemptionPolicy"], "PreemptLowerPriority");
        let mut a = Attributes::for_test(Operation::Create, json!({"spec": {"priority": 7}}));
        let refused = priority(&mut a).unwrap_err();
        assert_eq!(refused.code, 403);
        assert!(
            refused.message.contains("priority (7)"),
            "{}",
            refused.message
        );
    }
}
