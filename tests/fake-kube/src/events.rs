//! Kubernetes Events (`events.k8s.io/v1`): creation and patches, checked
//! as the API server validates them, and lists of a namespace's (what
//! `kubectl events` and `lanyard doctor` read).

use super::*;

impl FakeKube {
    /// `POST /apis/events.k8s.io/v1/namespaces/NS/events`, validated as
    /// the API server validates an `events.k8s.io/v1` Event.
    pub(crate) fn create_event(&self, namespace: &str, body: &[u8]) -> Response {
        let mut event: Value = match serde_json::from_slice(body) {
            Ok(v @ Value::Object(_)) => v,
            _ => return bad_request("the body of the request was in an unknown format".into()),
        };
        let name = event
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if let Some(invalid) = invalid_event(&event, namespace, &name, true) {
            return invalid;
        }
        let key = (namespace.to_string(), name.clone());
        let mut events = self
            .recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if events.contains_key(&key) {
            return status_error(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("events.events.k8s.io \"{name}\" already exists"),
                Some(json!({"name": name, "group": "events.k8s.io", "kind": "events"})),
            );
        }
        let rv = {
            let mut store = self.lock();
            store.rv += 1;
            store.rv
        };
        if let Some(meta) = event.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
            meta.insert(
                "uid".into(),
                Value::String(uuid::Uuid::new_v4().to_string()),
            );
            meta.insert("namespace".into(), Value::String(namespace.to_string()));
        }
        event["apiVersion"] = json!("events.k8s.io/v1");
        event["kind"] = json!("Event");
        events.insert(key, event.clone());
        self.stats.events_created.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::CREATED, &event)
    }

    /// `GET /apis/events.k8s.io/v1/namespaces/NS/events`: the namespace's
    /// Events, oldest first, as an `EventList` (no selectors: clients
    /// filter, as `kubectl events --for` does).
    pub(crate) fn list_events(&self, namespace: &str) -> Response {
        let events = self
            .recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let items: Vec<Value> = events
            .iter()
            .filter(|((ns, _), _)| ns == namespace)
            .map(|(_, e)| e.clone())
            .collect();
        let rv = self.lock().rv;
        json_response(
            StatusCode::OK,
            &json!({
                "apiVersion": "events.k8s.io/v1",
                "kind": "EventList",
                "metadata": {"resourceVersion": rv.to_string()},
                "items": items,
            }),
        )
    }

    /// `PATCH …/events/NAME` with a JSON merge patch, as
    /// `kube::runtime::events::Recorder` sends a repeat.
    pub(crate) fn patch_event(
        &self,
        namespace: &str,
        name: &str,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response {
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        if !content_type.starts_with("application/merge-patch+json") {
            return status_error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "UnsupportedMediaType",
                format!("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml (got {content_type:?})"),
                None,
            );
        }
        let patch: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return bad_request(format!("error decoding patch: {e}")),
        };
        let key = (namespace.to_string(), name.to_string());
        let mut events = self
            .recorded_events
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let Some(stored) = events.get(&key) else {
            return status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("events.events.k8s.io \"{name}\" not found"),
                Some(json!({"name": name, "group": "events.k8s.io", "kind": "events"})),
            );
        };
        let mut merged = stored.clone();
        json_patch::merge(&mut merged, &patch);
        if let Some(invalid) = invalid_event(&merged, namespace, name, false) {
            return invalid;
        }
        let rv = {
            let mut store = self.lock();
            store.rv += 1;
            store.rv
        };
        merged["metadata"]["resourceVersion"] = json!(rv.to_string());
        events.insert(key, merged.clone());
        self.stats.events_patched.fetch_add(1, Ordering::Relaxed);
        json_response(StatusCode::OK, &merged)
    }
}

/// The API server's validation of an `events.k8s.io/v1` Event: `None`
/// when valid, else its 422 `Invalid` Status with one cause per field.
pub(crate) fn invalid_event(
    event: &Value,
    namespace: &str,
    name: &str,
    create: bool,
) -> Option<Response> {
    let text = |pointer: &str| event.pointer(pointer).and_then(Value::as_str);
    let mut causes = Vec::new();
    let mut cause = |reason: &str, message: String, field: &str| {
        causes.push(json!({"reason": reason, "message": message, "field": field}));
    };
    if name.is_empty() {
        cause(
            "FieldValueRequired",
            "Required value: name or generateName is required".into(),
            "metadata.name",
        );
    }
    match text("/metadata/namespace") {
        Some(ns) if ns != namespace => cause(
            "FieldValueInvalid",
            format!("Invalid value: {ns:?}: does not match the namespace of the request"),
            "metadata.namespace",
        ),
        _ => {}
    }
    if text("/eventTime").is_none() {
        cause("FieldValueRequired", "Required value".into(), "eventTime");
    }
    for field in [
        "reportingController",
        "reportingInstance",
        "action",
        "reason",
    ] {
        match text(&format!("/{field}")) {
            None | Some("") => cause("FieldValueRequired", "Required value".into(), field),
            Some(v) if v.len() > 128 => cause(
                "FieldValueTooLong",
                "Too long: may not be more than 128 bytes".into(),
                field,
            ),
            Some(_) => {}
        }
    }
    match text("/type") {
        Some("Normal" | "Warning") => {}
        other => cause(
            "FieldValueNotSupported",
            format!(
                "Unsupported value: {:?}: supported values: \"Normal\", \"Warning\"",
                other.unwrap_or("")
            ),
            "type",
        ),
    }
    if text("/note").is_some_and(|n| n.len() > 1024) {
        cause(
            "FieldValueTooLong",
            "Too long: may not be more than 1024 bytes".into(),
            "note",
        );
    }
    if event.get("regarding").is_none_or(Value::is_null) {
        cause("FieldValueRequired", "Required value".into(), "regarding");
    }
    if let Some(ns) = text("/regarding/namespace") {
        if ns != namespace {
            cause(
                "FieldValueInvalid",
                format!("Invalid value: {ns:?}: does not match event.namespace"),
                "regarding.namespace",
            );
        }
    }
    if create && event.get("series").is_some_and(|s| !s.is_null()) {
        let count = event
            .pointer("/series/count")
            .and_then(Value::as_i64)
            .unwrap_or(0);
        if count < 2 {
            cause(
                "FieldValueInvalid",
                format!("Invalid value: {count}: should be at least 2"),
                "series.count",
            );
        }
    }
    if causes.is_empty() {
        return None;
    }
    let summary = causes
        .iter()
        .map(|c| {
            format!(
                "{}: {}",
                c["field"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    Some(status_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        "Invalid",
        format!("Event.events.k8s.io \"{name}\" is invalid: [{summary}]"),
        Some(json!({"name": name, "group": "events.k8s.io", "kind": "Event", "causes": causes})),
    ))
}
