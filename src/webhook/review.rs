//! AdmissionReview (`admission.k8s.io/v1`) in and out.
//!
//! The API server posts one review per admission; whatever happens, it must
//! get back a well-formed review echoing the request's `uid`, or it applies
//! the webhook's `failurePolicy` to a pod the user may not even have opted
//! in. So parsing never panics, says precisely what was wrong, and keeps the
//! `uid` whenever it could be read so that even a refusal is a valid answer.

use std::collections::HashMap;

use base64::Engine;
use k8s_openapi::api::core::v1::Pod;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

/// The only review version this webhook speaks (the chart declares
/// `admissionReviewVersions: ["v1"]`).
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// The only review kind this webhook speaks.
pub const KIND: &str = "AdmissionReview";

/// Largest review body accepted. etcd refuses objects over about 1.5 MiB
/// and the API server limits request bodies to 3 MiB, so a larger review
/// cannot come from a real API server; refusing it bounds the memory one
/// request can take. The HTTP layer must stop reading at this size too.
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;

/// A review this webhook can act on.
#[derive(Debug, Clone)]
pub struct Review {
    /// `request.uid`, echoed in the response.
    pub uid: String,
    /// `request.namespace` (authoritative: a pod created by a controller
    /// often has no `metadata.namespace` yet). Empty for cluster-scoped
    /// passthroughs.
    pub namespace: String,
    /// `request.operation`: CREATE, UPDATE, DELETE or CONNECT.
    pub operation: String,
    /// `request.dryRun`: nothing here has side effects, so it changes
    /// nothing, but the integrator may want to log it.
    pub dry_run: bool,
    /// What to do with it.
    pub action: Action,
}

/// What a parsed review asks of the webhook.
#[derive(Debug, Clone)]
pub enum Action {
    /// A core/v1 Pod is being created: decide whether to inject.
    Mutate(Box<Pod>),
    /// Not a pod creation (DELETE, UPDATE, a subresource): allow it
    /// untouched. The reason is for logs.
    AllowUnchanged(String),
}

/// Why a body could not be acted on. Each message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReviewError {
    /// The body is over [`MAX_BODY_BYTES`].
    #[error("admission review body is {size} bytes, over the {limit}-byte limit")]
    TooLarge {
        /// The body's length in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body is not JSON at all; carries the parser's error.
    #[error("admission review body is not JSON: {0}")]
    NotJson(String),
    /// The body is JSON but not an `admission.k8s.io/v1` AdmissionReview.
    #[error("expected apiVersion {API_VERSION} and kind {KIND}, got apiVersion {api_version:?} and kind {kind:?}")]
    NotAReview {
        /// The body's `apiVersion` (empty when absent).
        api_version: String,
        /// The body's `kind` (empty when absent).
        kind: String,
    },
    /// The review has no `request` object.
    #[error("admission review has no request")]
    MissingRequest,
    /// The request has no (or an empty) `uid`, so no answer can echo one.
    #[error("admission review request has no uid")]
    MissingUid,
    /// A CREATE of something other than a core/v1 Pod: the webhook's rules
    /// are wider than they should be.
    #[error("this webhook only mutates core/v1 Pods, got {found}; check the webhook's rules")]
    NotAPod {
        /// `request.uid`.
        uid: String,
        /// The object's group/version and kind, as `GROUP/VERSION KIND`.
        found: String,
    },
    /// A pod CREATE without `request.object`.
    #[error("pod CREATE review has no request.object")]
    MissingObject {
        /// `request.uid`.
        uid: String,
    },
    /// A pod CREATE without `request.namespace`.
    #[error("pod CREATE review has no request.namespace")]
    MissingNamespace {
        /// `request.uid`.
        uid: String,
    },
    /// `request.object` does not deserialize as a Pod.
    #[error("request.object is not a valid Pod: {error}")]
    InvalidPod {
        /// `request.uid`.
        uid: String,
        /// The deserialization error.
        error: String,
    },
}

impl ReviewError {
    /// The request's uid, when it could be read.
    pub fn uid(&self) -> Option<&str> {
        match self {
            ReviewError::NotAPod { uid, .. }
            | ReviewError::MissingObject { uid }
            | ReviewError::MissingNamespace { uid }
            | ReviewError::InvalidPod { uid, .. } => Some(uid),
            _ => None,
        }
    }

    /// The answer to send: a denial echoing the uid when there is one, else
    /// [`error_response`].
    pub fn response(&self) -> Value {
        match self.uid() {
            Some(uid) => deny(uid, 400, &self.to_string()),
            None => error_response(&self.to_string()),
        }
    }
}

/// A JSON object's members, each kept as its unparsed text: a review is
/// read without building a tree of it, and the pod is deserialized once,
/// straight from the body (a `Value` of the review, then a `Pod` from
/// that, took most of an admission's time in the webhook's profile).
type Members<'a> = HashMap<String, &'a RawValue>;

/// The members of `raw` when it is a JSON object, else `None`. The text is
/// valid JSON already, so an error here only means "not an object".
fn members(raw: &RawValue) -> Option<Members<'_>> {
    serde_json::from_str(raw.get()).ok()
}

/// `key`'s value when it is a string (absent, or of another type: `None`).
fn text(members: &Members, key: &str) -> Option<String> {
    members
        .get(key)
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
}

/// Parses an AdmissionReview v1 body.
pub fn parse(body: &[u8]) -> Result<Review, ReviewError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ReviewError::TooLarge {
            size: body.len(),
            limit: MAX_BODY_BYTES,
        });
    }
    // Valid JSON that is not an object is a body without apiVersion and
    // kind (NotAReview below), not a parse error.
    let review: Members = match serde_json::from_slice(body) {
        Ok(members) => members,
        Err(e) if e.is_data() => Members::new(),
        Err(e) => return Err(ReviewError::NotJson(e.to_string())),
    };
    let api_version = text(&review, "apiVersion").unwrap_or_default();
    let kind = text(&review, "kind").unwrap_or_default();
    if api_version != API_VERSION || kind != KIND {
        return Err(ReviewError::NotAReview { api_version, kind });
    }
    let request = review
        .get("request")
        .and_then(|raw| members(raw))
        .ok_or(ReviewError::MissingRequest)?;
    let uid = text(&request, "uid")
        .filter(|u| !u.is_empty())
        .ok_or(ReviewError::MissingUid)?;
    let namespace = text(&request, "namespace").unwrap_or_default();
    let operation = text(&request, "operation").unwrap_or_default();
    let dry_run = request
        .get("dryRun")
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or(false);
    let passthrough = |reason: String| Review {
        uid: uid.clone(),
        namespace: namespace.clone(),
        operation: operation.clone(),
        dry_run,
        action: Action::AllowUnchanged(reason),
    };

    // A subresource (pods/ephemeralcontainers, pods/status, ...) is not the
    // pod's creation, whatever its kind; let it through.
    if let Some(sub) = text(&request, "subResource").filter(|s| !s.is_empty()) {
        return Ok(passthrough(format!("subresource {sub} is not mutated")));
    }
    // Only creation is mutated. Anything else is let through whatever its
    // kind: refusing a DELETE because the webhook's rules were too wide
    // would block cleanup cluster-wide.
    if operation != "CREATE" {
        return Ok(passthrough(format!(
            "{} is not mutated",
            if operation.is_empty() {
                "an unnamed operation"
            } else {
                operation.as_str()
            }
        )));
    }
    let group_version_kind = request
        .get("kind")
        .and_then(|raw| members(raw))
        .unwrap_or_default();
    let field = |k: &str| text(&group_version_kind, k).unwrap_or_default();
    let (group, version, object_kind) = (field("group"), field("version"), field("kind"));
    if !(group.is_empty() && version == "v1" && object_kind == "Pod") {
        let api = if group.is_empty() {
            version
        } else {
            format!("{group}/{version}")
        };
        return Err(ReviewError::NotAPod {
            uid,
            found: format!("{api} {object_kind}").trim().to_string(),
        });
    }
    if namespace.is_empty() {
        return Err(ReviewError::MissingNamespace { uid });
    }
    let object = match request.get("object") {
        Some(raw) if raw.get().starts_with('{') => raw,
        _ => return Err(ReviewError::MissingObject { uid }),
    };
    let pod: Pod = serde_json::from_str(object.get()).map_err(|e| ReviewError::InvalidPod {
        uid: uid.clone(),
        error: e.to_string(),
    })?;
    Ok(Review {
        uid,
        namespace,
        operation,
        dry_run,
        action: Action::Mutate(Box::new(pod)),
    })
}

fn envelope(response: Map<String, Value>) -> Value {
    json!({
        "apiVersion": API_VERSION,
        "kind": KIND,
        "response": Value::Object(response),
    })
}

/// Allows the request, with `patch` (JSON Patch, base64 as the API server
/// expects) when it has operations, and `warnings` shown to the client
/// (`kubectl` prints them; a controller's logs may).
pub fn allow(uid: &str, patch: Option<&json_patch::Patch>, warnings: &[String]) -> Value {
    let mut response = Map::new();
    response.insert("uid".into(), json!(uid));
    response.insert("allowed".into(), json!(true));
    if let Some(patch) = patch.filter(|p| !p.0.is_empty()) {
        // A Patch is plain data; serializing it cannot fail. Should it ever,
        // answering without the patch would silently skip injection, so
        // refuse instead.
        let bytes = match serde_json::to_vec(patch) {
            Ok(b) => b,
            Err(e) => return deny(uid, 500, &format!("cannot encode the patch: {e}")),
        };
        response.insert("patchType".into(), json!("JSONPatch"));
        response.insert(
            "patch".into(),
            json!(base64::engine::general_purpose::STANDARD.encode(bytes)),
        );
    }
    if !warnings.is_empty() {
        response.insert("warnings".into(), json!(warnings));
    }
    envelope(response)
}

/// Refuses the request with an HTTP-like `code` and a message the user sees
/// in `kubectl`'s error or the controller's events.
pub fn deny(uid: &str, code: u16, message: &str) -> Value {
    let mut response = Map::new();
    response.insert("uid".into(), json!(uid));
    response.insert("allowed".into(), json!(false));
    response.insert("status".into(), json!({ "code": code, "message": message }));
    envelope(response)
}

/// The answer to a body that is not even a review (no uid to echo). The API
/// server will treat it as a failed call and apply the failurePolicy; it is
/// still a well-formed review so that the failure is legible in its logs.
pub fn error_response(message: &str) -> Value {
    deny("", 400, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(request: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request}))
            .unwrap()
    }

    #[test]
    fn pod_create_is_parsed() {
        let body = review(json!({
            "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "namespace": "ml", "operation": "CREATE", "dryRun": true,
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "w-"},
                       "spec": {"containers": [{"name": "c", "image": "i"}]}}
        }));
        let r = parse(&body).unwrap();
        assert_eq!((r.uid.as_str(), r.namespace.as_str()), ("u-1", "ml"));
        assert!(r.dry_run);
        let Action::Mutate(pod) = r.action else {
            panic!("expected a pod to mutate")
        };
        assert_eq!(pod.metadata.generate_name.as_deref(), Some("w-"));
    }

    #[test]
    fn allow_encodes_the_patch_and_omits_an_empty_one() {
        let patch: json_patch::Patch =
            serde_json::from_value(json!([{"op": "add", "path": "/a", "value": 1}])).unwrap();
        let v = allow("u", Some(&patch), &["w".into()]);
        let encoded = v["response"]["patch"].as_str().unwrap();
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Value>(&decoded).unwrap(),
            json!([{"op": "add", "path": "/a", "value": 1}])
        );
        assert_eq!(v["response"]["patchType"], "JSONPatch");
        assert_eq!(v["response"]["warnings"], json!(["w"]));
        let empty = allow("u", Some(&json_patch::Patch(vec![])), &[]);
        assert!(empty["response"].get("patch").is_none());
        assert!(empty["response"].get("patchType").is_none());
        assert!(empty["response"].get("warnings").is_none());
    }

    #[test]
    fn errors_keep_the_uid_when_known() {
        let body = review(
            json!({"uid": "u-2", "kind": {"group": "apps", "version": "v1", "kind": "Deployment"}, "operation": "CREATE"}),
        );
        let e = parse(&body).unwrap_err();
        assert_eq!(e.uid(), Some("u-2"));
        let r = e.response();
        assert_eq!(r["response"]["uid"], "u-2");
        assert_eq!(r["response"]["allowed"], false);
        assert!(r["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("apps/v1 Deployment"));
        assert_eq!(parse(b"{").unwrap_err().uid(), None);
    }

    #[test]
    fn each_malformed_shape_gets_its_own_error() {
        let not_a_review = |body: &[u8]| matches!(parse(body), Err(ReviewError::NotAReview { .. }));
        assert!(not_a_review(b"5"));
        assert!(not_a_review(
            br#"["admission.k8s.io/v1", "AdmissionReview"]"#
        ));
        assert!(not_a_review(
            br#"{"apiVersion": 1, "kind": "AdmissionReview"}"#
        ));
        assert!(matches!(parse(b"{\"a\": "), Err(ReviewError::NotJson(_))));
        let envelope = |request: &str| {
            format!(r#"{{"apiVersion": "{API_VERSION}", "kind": "{KIND}", "request": {request}}}"#)
        };
        for request in ["null", "[]", "\"r\""] {
            assert_eq!(
                parse(envelope(request).as_bytes()).unwrap_err(),
                ReviewError::MissingRequest
            );
        }
        for uid in [r#""uid": """#, r#""uid": 7"#] {
            let body = envelope(&format!("{{{uid}, \"operation\": \"CREATE\"}}"));
            assert_eq!(parse(body.as_bytes()).unwrap_err(), ReviewError::MissingUid);
        }
        let pod_create = |object: &str| {
            envelope(&format!(
                r#"{{"uid": "u", "namespace": "ml", "operation": "CREATE",
                    "kind": {{"group": "", "version": "v1", "kind": "Pod"}}{object}}}"#
            ))
        };
        for object in ["", r#", "object": null"#, r#", "object": [1]"#] {
            let e = parse(pod_create(object).as_bytes()).unwrap_err();
            assert_eq!(e, ReviewError::MissingObject { uid: "u".into() });
        }
        let e = parse(pod_create(r#", "object": {"spec": {"containers": 3}}"#).as_bytes());
        assert!(matches!(e, Err(ReviewError::InvalidPod { uid, .. }) if uid == "u"));
        // Escapes in keys and values are read like any other text.
        let body = br#"{"api\u0056ersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u\u002d3", "operation": "DELETE"}}"#;
        let r = parse(body).unwrap();
        assert_eq!(r.uid, "u-3");
        assert!(matches!(r.action, Action::AllowUnchanged(_)));
    }
}
