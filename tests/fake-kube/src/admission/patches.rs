//! The three PATCH bodies kube-apiserver takes for a Pod, by
//! `Content-Type` (`k8s.io/apiserver/pkg/endpoints/handlers/patch.go`):
//! `application/json-patch+json` (RFC 6902), `application/merge-patch+json`
//! (RFC 7386; what `kubectl label` sends) and
//! `application/strategic-merge-patch+json` (what `kubectl debug` sends to
//! `pods/NAME/ephemeralcontainers`).
//!
//! The strategic merge patch follows `k8s.io/apimachinery/pkg/util/
//! strategicpatch/patch.go` for the Pod's lists that merge by a key
//! (`patchMergeKey` in `k8s.io/api/core/v1/types.go`): containers, init and
//! ephemeral containers, volumes, env and image pull secrets by `name`,
//! volume mounts by `mountPath`, ports by `containerPort`, host aliases by
//! `ip`; other lists are replaced. Of the directives it takes
//! `$setElementOrder/LIST`, `$patch: delete|replace|merge` and
//! `$deleteFromPrimitiveList/LIST`; `$retainKeys` is refused as not
//! modelled.

use serde_json::{Map, Value};

/// The list fields that merge by a key, and that key.
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "resourceClaims"
        | "schedulingGates" => "name",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "ports" => "containerPort",
        "hostAliases" => "ip",
        "ownerReferences" => "uid",
        _ => return None,
    })
}

/// Applies a PATCH body of `content_type` to `target`.
pub(super) fn apply(
    target: &mut Value,
    content_type: &str,
    body: &[u8],
) -> Result<(), (u16, String)> {
    let media = content_type.split(';').next().unwrap_or_default().trim();
    let patch: Value =
        serde_json::from_slice(body).map_err(|e| (400, format!("error decoding patch: {e}")))?;
    match media {
        "application/json-patch+json" => {
            let patch: json_patch::Patch =
                serde_json::from_value(patch).map_err(|e| (400, format!("error decoding patch: {e}")))?;
            json_patch::patch(target, &patch).map_err(|e| (422, e.to_string()))
        }
        "application/merge-patch+json" => {
            json_patch::merge(target, &patch);
            Ok(())
        }
        "application/strategic-merge-patch+json" => strategic(target, &patch).map_err(|e| (400, e)),
        other => Err((
            415,
            format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {other:?})"),
        )),
    }
}

/// A strategic merge patch of a map.
fn strategic(target: &mut Value, patch: &Value) -> Result<(), String> {
    let Some(patch) = patch.as_object() else {
        *target = patch.clone();
        return Ok(());
    };
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut replaced = patch.clone();
            replaced.remove("$patch");
            *target = Value::Object(replaced);
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Object(Map::new());
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => return Err(format!("unknown patch type: {other}")),
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Some(map) = target.as_object_mut() else {
        return Ok(());
    };
    let mut orders = Vec::new();
    for (key, value) in patch {
        if key == "$patch" {
            continue;
        }
        if key == "$retainKeys" {
            return Err("$retainKeys is not modelled by this fake API server".into());
        }
        if let Some(list) = key.strip_prefix("$setElementOrder/") {
            orders.push((list.to_string(), value.clone()));
            continue;
        }
        if let Some(list) = key.strip_prefix("$deleteFromPrimitiveList/") {
            if let Some(items) = map.get_mut(list).and_then(Value::as_array_mut) {
                let gone = value.as_array().cloned().unwrap_or_default();
                items.retain(|i| !gone.contains(i));
            }
            continue;
        }
        if key.starts_with('$') {
            return Err(format!("unknown directive {key}"));
        }
        match value {
            Value::Null => {
                map.remove(key);
            }
            Value::Object(_) => strategic(map.entry(key.clone()).or_insert(Value::Null), value)?,
            Value::Array(items) => match merge_key(key) {
                Some(merge) => merge_list(
                    map.entry(key.clone()).or_insert(Value::Array(vec![])),
                    items,
                    merge,
                )?,
                None => {
                    map.insert(key.clone(), value.clone());
                }
            },
            other => {
                map.insert(key.clone(), other.clone());
            }
        }
    }
    for (list, order) in orders {
        let Some(merge) = merge_key(&list) else {
            continue;
        };
        if let Some(items) = map.get_mut(&list).and_then(Value::as_array_mut) {
            let rank = |item: &Value| {
                order
                    .as_array()
                    .into_iter()
                    .flatten()
                    .position(|o| o[merge] == item[merge])
                    .unwrap_or(usize::MAX)
            };
            items.sort_by_key(rank);
        }
    }
    Ok(())
}

/// Merges `items` into the list `target` by `key`: an item with a key
/// already there is merged into it (or deleted, with `$patch: delete`),
/// a new one appended.
fn merge_list(target: &mut Value, items: &[Value], key: &str) -> Result<(), String> {
    if !target.is_array() {
        *target = Value::Array(vec![]);
    }
    let Some(list) = target.as_array_mut() else {
        return Ok(());
    };
    for item in items {
        let position = list.iter().position(|existing| existing[key] == item[key]);
        let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
        match (position, delete) {
            (Some(i), true) => {
                list.remove(i);
            }
            (None, true) => {}
            (Some(i), false) => strategic(&mut list[i], item)?,
            (None, false) => {
                let mut added = Value::Null;
                strategic(&mut added, item)?;
                list.push(added);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn kubectl_debugs_patch_adds_an_ephemeral_container_in_order() {
        let mut pod = json!({"spec": {"containers": [{"name": "app"}],
                                      "ephemeralContainers": [{"name": "old", "image": "a"}]}});
        let patch = json!({"spec": {
            "$setElementOrder/ephemeralContainers": [{"name": "old"}, {"name": "debugger-x"}],
            "ephemeralContainers": [{"image": "busybox", "name": "debugger-x", "resources": {},
                                     "terminationMessagePolicy": "File"}]}});
        apply(
            &mut pod,
            "application/strategic-merge-patch+json",
            patch.to_string().as_bytes(),
        )
        .unwrap();
        let names: Vec<&str> = pod["spec"]["ephemeralContainers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["old", "debugger-x"]);
        assert_eq!(pod["spec"]["containers"], json!([{"name": "app"}]));
    }

    #[test]
    fn merge_keys_deletes_and_replaced_lists() {
        let mut pod = json!({"spec": {"containers": [
            {"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["1"]},
            {"name": "b"}]}});
        let patch = json!({"spec": {"containers": [
            {"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["2"]},
            {"name": "b", "$patch": "delete"}]}});
        apply(
            &mut pod,
            "application/strategic-merge-patch+json",
            patch.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(
            pod["spec"]["containers"],
            json!([{"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}], "args": ["2"]}])
        );
        let mut labelled = json!({"metadata": {"labels": {"a": "1", "b": "2"}}});
        let merge = json!({"metadata": {"labels": {"b": null, "c": "3"}}});
        apply(
            &mut labelled,
            "application/merge-patch+json",
            merge.to_string().as_bytes(),
        )
        .unwrap();
        assert_eq!(labelled["metadata"]["labels"], json!({"a": "1", "c": "3"}));
        assert_eq!(
            apply(&mut labelled, "text/plain", b"{}").unwrap_err().0,
            415
        );
    }
}
