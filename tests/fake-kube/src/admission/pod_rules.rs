//! What the pod registry itself does between mutating and validating
//! admission: the strategy's preparation and the API's validation, the
//! parts of them that decide whether a Lanyard-injected pod is stored.
//!
//! Sources: `pkg/registry/core/pod/strategy.go` (`PrepareForCreate`:
//! `status: {phase: Pending, qosClass}`, `generation: 1`;
//! `PrepareForUpdate`: the status and generation are the stored pod's,
//! the generation bumped when the spec changed; the ephemeral containers'
//! strategy keeps only `spec.ephemeralContainers` of the request);
//! `k8s.io/apiserver/pkg/registry/rest/create.go` (`generateName`, uid,
//! `creationTimestamp`); `pkg/apis/core/validation/validation.go`
//! (`ValidatePodCreate`: unique container and volume names, every
//! `volumeMounts[].name` a volume of the pod, unique `mountPath`s in a
//! container, no ephemeral containers at creation; `ValidatePodUpdate`:
//! only images, `activeDeadlineSeconds`, added tolerations and
//! `terminationGracePeriodSeconds` may change;
//! `ValidatePodEphemeralContainersUpdate`: ephemeral containers may only be
//! added); `pkg/apis/core/helper/qos` (`GetPodQOS`).

use std::collections::BTreeSet;

use serde_json::{json, Value};

use super::Rejection;

const UPDATABLE: &str = "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)";

/// Name, uid, timestamps and status of a pod about to be created.
pub(super) fn prepare_for_create(pod: &mut Value) {
    let meta = &mut pod["metadata"];
    let named = meta["name"].as_str().is_some_and(|n| !n.is_empty());
    if !named {
        if let Some(prefix) = meta["generateName"].as_str() {
            let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_string();
            meta["name"] = json!(format!("{prefix}{suffix}"));
        }
    }
    meta["uid"] = json!(uuid::Uuid::new_v4().to_string());
    meta["creationTimestamp"] = json!(k8s_openapi::jiff::Timestamp::now()
        .round(k8s_openapi::jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default());
    meta["generation"] = json!(1);
    let qos = qos_class(&pod["spec"]);
    pod["status"] = json!({"phase": "Pending", "qosClass": qos});
}

/// `GetPodQOS`: Guaranteed when every init and app container has CPU and
/// memory limits with requests equal to them, BestEffort when none has a
/// CPU or memory request or limit, Burstable otherwise.
fn qos_class(spec: &Value) -> &'static str {
    let containers: Vec<&Value> = ["initContainers", "containers"]
        .iter()
        .flat_map(|list| spec[*list].as_array().into_iter().flatten())
        .collect();
    let quantity = |c: &Value, kind: &str, resource: &str| {
        c.pointer(&format!("/resources/{kind}/{resource}"))
            .and_then(Value::as_str)
            .map(str::to_string)
    };
    let any = containers.iter().any(|c| {
        ["requests", "limits"]
            .iter()
            .any(|k| quantity(c, k, "cpu").is_some() || quantity(c, k, "memory").is_some())
    });
    if !any {
        return "BestEffort";
    }
    let guaranteed = containers.iter().all(|c| {
        ["cpu", "memory"].iter().all(|r| {
            let limit = quantity(c, "limits", r);
            limit.is_some() && quantity(c, "requests", r).is_none_or(|q| Some(q) == limit)
        })
    });
    if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

fn containers<'a>(
    spec: &'a Value,
    lists: &'a [&'a str],
) -> impl Iterator<Item = (String, &'a Value)> + 'a {
    lists.iter().flat_map(move |list| {
        spec[*list]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(move |(i, c)| (format!("spec.{list}[{i}]"), c))
    })
}

/// The structural checks a Lanyard-injected pod must pass; every volume
/// mount (including ephemeral containers') names a volume of the pod.
fn validate_spec(spec: &Value, causes: &mut Vec<(String, String)>) {
    let mut names = BTreeSet::new();
    for (at, c) in containers(
        spec,
        &["initContainers", "containers", "ephemeralContainers"],
    ) {
        let name = c["name"].as_str().unwrap_or_default();
        if name.is_empty() {
            causes.push((format!("{at}.name"), "Required value".into()));
        } else if !names.insert(name.to_string()) {
            causes.push((format!("{at}.name"), format!("Duplicate value: \"{name}\"")));
        }
    }
    let mut volumes = BTreeSet::new();
    for (i, v) in spec["volumes"].as_array().into_iter().flatten().enumerate() {
        let name = v["name"].as_str().unwrap_or_default();
        if !volumes.insert(name.to_string()) {
            causes.push((
                format!("spec.volumes[{i}].name"),
                format!("Duplicate value: \"{name}\""),
            ));
        }
    }
    for (at, c) in containers(
        spec,
        &["initContainers", "containers", "ephemeralContainers"],
    ) {
        let mut paths = BTreeSet::new();
        for (j, m) in c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let name = m["name"].as_str().unwrap_or_default();
            if !volumes.contains(name) {
                causes.push((
                    format!("{at}.volumeMounts[{j}].name"),
                    format!("Not found: \"{name}\""),
                ));
            }
            let path = m["mountPath"].as_str().unwrap_or_default();
            if !paths.insert(path.to_string()) {
                causes.push((
                    format!("{at}.volumeMounts[{j}].mountPath"),
                    "Invalid value: \"".to_string() + path + "\": must be unique",
                ));
            }
        }
    }
    if spec["containers"].as_array().is_none_or(Vec::is_empty) {
        causes.push(("spec.containers".into(), "Required value".into()));
    }
}

/// `ValidatePodCreate`, the parts modelled.
pub(super) fn validate_create(pod: &Value) -> Result<(), Rejection> {
    let spec = &pod["spec"];
    let mut causes = Vec::new();
    validate_spec(spec, &mut causes);
    if spec["ephemeralContainers"]
        .as_array()
        .is_some_and(|e| !e.is_empty())
    {
        causes.push((
            "spec.ephemeralContainers".into(),
            "Forbidden: cannot be set on create".into(),
        ));
    }
    done(pod, causes)
}

fn done(pod: &Value, causes: Vec<(String, String)>) -> Result<(), Rejection> {
    if causes.is_empty() {
        return Ok(());
    }
    let name = pod
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or_default();
    Err(Rejection::invalid(name, &causes))
}

/// `PrepareForUpdate` and `ValidatePodUpdate`: the stored pod's identity,
/// status and generation carried over; a spec change other than the
/// updatable fields refused.
pub(super) fn update(old: &Value, new: &mut Value) -> Result<(), Rejection> {
    for field in ["uid", "creationTimestamp", "generation"] {
        new["metadata"][field] = old["metadata"][field].clone();
    }
    new["status"] = old["status"].clone();
    // What the old spec would be with the allowed changes of the new one.
    let mut allowed = old["spec"].clone();
    for list in ["initContainers", "containers"] {
        let (Some(mine), Some(theirs)) =
            (allowed[list].as_array_mut(), new["spec"][list].as_array())
        else {
            continue;
        };
        if mine.len() == theirs.len() {
            for (m, t) in mine.iter_mut().zip(theirs) {
                m["image"] = t["image"].clone();
            }
        }
    }
    for field in ["activeDeadlineSeconds", "terminationGracePeriodSeconds"] {
        allowed[field] = new["spec"][field].clone();
    }
    let old_tolerations = old["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let new_tolerations = new["spec"]["tolerations"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if old_tolerations.iter().all(|t| new_tolerations.contains(t)) {
        allowed["tolerations"] = new["spec"]["tolerations"].clone();
    }
    let mut causes = Vec::new();
    if !super::defaults::semantic_eq(
        &json!({"spec": allowed}),
        &json!({"spec": new["spec"].clone()}),
    ) {
        causes.push(("spec".to_string(), format!("Forbidden: {UPDATABLE}")));
    }
    done(new, causes)?;
    if !super::defaults::semantic_eq(
        &json!({"spec": old["spec"].clone()}),
        &json!({"spec": new["spec"].clone()}),
    ) {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
        new["metadata"]["generation"] = json!(generation + 1);
    }
    Ok(())
}

/// The ephemeral containers' strategy and validation: of the request only
/// `spec.ephemeralContainers` is kept, and it may only add containers.
pub(super) fn ephemeral_update(old: &Value, new: &mut Value) -> Result<(), Rejection> {
    let ephemeral = new["spec"]["ephemeralContainers"].clone();
    let mut kept = old.clone();
    kept["spec"]["ephemeralContainers"] = ephemeral;
    *new = kept;
    let mut causes = Vec::new();
    let listed = |pod: &Value| {
        pod["spec"]["ephemeralContainers"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    let (before, after) = (listed(old), listed(new));
    for container in &before {
        let name = container["name"].as_str().unwrap_or_default();
        match after.iter().find(|c| c["name"] == container["name"]) {
            None => causes.push((
                "spec.ephemeralContainers".into(),
                format!("Forbidden: existing ephemeral containers \"{name}\" may not be removed\n"),
            )),
            Some(now) if !super::defaults::semantic_eq(now, container) => causes.push((
                "spec.ephemeralContainers".into(),
                format!("Forbidden: existing ephemeral containers \"{name}\" may not be changed\n"),
            )),
            Some(_) => {}
        }
    }
    validate_spec(&new["spec"], &mut causes);
    done(new, causes)?;
    if before.len() != after.len() {
        let generation = old["metadata"]["generation"].as_i64().unwrap_or(1);
        new["metadata"]["generation"] = json!(generation + 1);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_of_a_missing_volume_is_invalid() {
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "a", "volumeMounts": [{"name": "gone", "mountPath": "/x"}]}]}});
        let r = validate_create(&pod).unwrap_err();
        assert_eq!(r.code, 422);
        assert_eq!(
            r.message,
            "Pod \"p\" is invalid: spec.containers[0].volumeMounts[0].name: Not found: \"gone\""
        );
    }

    #[test]
    fn only_images_and_added_tolerations_change_on_update() {
        let old = json!({"metadata": {"name": "p", "uid": "u", "generation": 1}, "status": {"phase": "Running"},
                         "spec": {"containers": [{"name": "a", "image": "x:1"}], "tolerations": [{"key": "k"}]}});
        let mut labelled = old.clone();
        labelled["metadata"]["labels"] = json!({"l": "v"});
        labelled["status"] = json!({});
        update(&old, &mut labelled).unwrap();
        assert_eq!(labelled["status"]["phase"], "Running");
        assert_eq!(labelled["metadata"]["generation"], 1);
        let mut image = old.clone();
        image["spec"]["containers"][0]["image"] = json!("x:2");
        image["spec"]["tolerations"] = json!([{"key": "k"}, {"key": "m"}]);
        update(&old, &mut image).unwrap();
        assert_eq!(image["metadata"]["generation"], 2);
        let mut env = old.clone();
        env["spec"]["containers"][0]["env"] = json!([{"name": "E", "value": "1"}]);
        let r = update(&old, &mut env).unwrap_err();
        assert!(
            r.message
                .contains("spec: Forbidden: pod updates may not change fields other than"),
            "{}",
            r.message
        );
    }

    #[test]
    fn ephemeral_containers_are_only_added() {
        let old = json!({"metadata": {"name": "p", "labels": {"a": "1"}}, "spec": {"containers": [{"name": "a"}],
                         "ephemeralContainers": [{"name": "d1", "image": "busybox"}]}});
        let mut added = old.clone();
        added["metadata"]["labels"] = json!({"changed": "ignored"});
        added["spec"]["ephemeralContainers"] =
            json!([{"name": "d1", "image": "busybox"}, {"name": "d2", "image": "busybox"}]);
        ephemeral_update(&old, &mut added).unwrap();
        assert_eq!(added["metadata"]["labels"], json!({"a": "1"}));
        assert_eq!(
            added["spec"]["ephemeralContainers"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        let mut removed = old.clone();
        removed["spec"]["ephemeralContainers"] = json!([]);
        assert!(ephemeral_update(&old, &mut removed)
            .unwrap_err()
            .message
            .contains("may not be removed"));
    }

    #[test]
    fn qos_classes() {
        let c = |resources: Value| json!({"containers": [{"name": "a", "resources": resources}]});
        assert_eq!(qos_class(&c(json!({}))), "BestEffort");
        assert_eq!(
            qos_class(&c(json!({"requests": {"cpu": "1"}}))),
            "Burstable"
        );
        assert_eq!(
            qos_class(&c(
                json!({"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "1", "memory": "1Gi"}})
            )),
            "Guaranteed"
        );
    }
}
