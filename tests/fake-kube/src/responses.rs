//! Status bodies and discovery documents in the API server's shapes.

use super::*;

pub(crate) fn status_body(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Option<Value>,
) -> Value {
    let mut body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    if let Some(details) = details {
        body["details"] = details;
    }
    body
}

pub(crate) fn status_error(
    code: StatusCode,
    reason: &str,
    message: String,
    details: Option<Value>,
) -> Response {
    json_response(code, &status_body(code, reason, message, details))
}

pub(crate) fn not_found(kind: Kind, name: &str) -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("{} \"{name}\" not found", kind.plural()),
        Some(json!({"name": name, "kind": kind.plural()})),
    )
}

pub(crate) fn not_found_path() -> Response {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        "the server could not find the requested resource".into(),
        Some(
            json!({"causes": [{"reason": "UnexpectedServerResponse", "message": "404 page not found"}]}),
        ),
    )
}

pub(crate) fn bad_request(message: String) -> Response {
    status_error(StatusCode::BAD_REQUEST, "BadRequest", message, None)
}

pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response {
    json_response_bytes(status, Bytes::from(body.to_string()))
}

pub(crate) fn json_response_bytes(status: StatusCode, body: Bytes) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

pub(crate) fn version_info() -> Value {
    json!({
        "major": "1",
        "minor": "33",
        "emulationMajor": "1",
        "emulationMinor": "33",
        "minCompatibilityMajor": "1",
        "minCompatibilityMinor": "32",
        "gitVersion": "v1.33.0",
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z",
        "goVersion": "go1.24.2",
        "compiler": "gc",
        "platform": "linux/amd64",
    })
}

pub(crate) fn authentication_group() -> Value {
    let version = json!({"groupVersion": "authentication.k8s.io/v1", "version": "v1"});
    json!({"name": "authentication.k8s.io", "versions": [version], "preferredVersion": version})
}

/// Discovery lists what a real server serves, not what the caller may do,
/// so that kubectl resolves `secrets` and then meets RBAC's 403.
pub(crate) fn core_v1_resources() -> Value {
    let all = [
        "create",
        "delete",
        "deletecollection",
        "get",
        "list",
        "patch",
        "update",
        "watch",
    ];
    let resource = |name: &str, singular: &str, namespaced: bool, kind: &str, short: &[&str]| {
        let mut r = json!({
            "name": name, "singularName": singular, "namespaced": namespaced,
            "kind": kind, "verbs": all,
        });
        if !short.is_empty() {
            r["shortNames"] = json!(short);
        }
        r
    };
    let mut pods = resource("pods", "pod", true, "Pod", &["po"]);
    pods["categories"] = json!(["all"]);
    json!({
        "kind": "APIResourceList",
        "groupVersion": "v1",
        "resources": [
            resource("configmaps", "configmap", true, "ConfigMap", &["cm"]),
            resource("namespaces", "namespace", false, "Namespace", &["ns"]),
            resource("nodes", "node", false, "Node", &["no"]),
            pods,
            {"name": "pods/status", "singularName": "", "namespaced": true, "kind": "Pod", "verbs": ["get", "patch", "update"]},
            resource("secrets", "secret", true, "Secret", &[]),
            resource("serviceaccounts", "serviceaccount", true, "ServiceAccount", &["sa"]),
            {"name": "serviceaccounts/token", "singularName": "", "namespaced": true,
             "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest", "verbs": ["create"]},
        ],
    })
}

pub(crate) fn authentication_v1_resources() -> Value {
    json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": "authentication.k8s.io/v1",
        "resources": [
            {"name": "selfsubjectreviews", "singularName": "selfsubjectreview", "namespaced": false, "kind": "SelfSubjectReview", "verbs": ["create"]},
            {"name": "tokenreviews", "singularName": "tokenreview", "namespaced": false, "kind": "TokenReview", "verbs": ["create"]},
        ],
    })
}
