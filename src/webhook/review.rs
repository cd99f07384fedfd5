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
use serde::Serialize;
use serde_json::value::RawValue;

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
#[derive(Debug, Clone, PartialEq)]
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
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// A core/v1 Pod the endpoint acts on: created (`/mutate`: decide
    /// whether to inject), or created or updated (`/validate`: check it).
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
    pub fn response(&self) -> Answer {
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

/// Which reviews an endpoint acts on; the rest it lets through untouched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `/mutate`: pod CREATE only.
    Mutation,
    /// `/validate` (the guard): pod CREATE and UPDATE, and UPDATE of the
    /// `ephemeralcontainers` subresource (`kubectl debug`), whose object
    /// is the whole pod.
    Guard,
}

impl Scope {
    /// Whether a pod review of `operation` on `sub_resource` ("" for the
    /// pod itself) is acted on; `Err` carries why not, for the logs.
    fn acts_on(self, operation: &str, sub_resource: &str) -> Result<(), String> {
        let acted = match self {
            Scope::Mutation => operation == "CREATE" && sub_resource.is_empty(),
            Scope::Guard => {
                (operation == "CREATE" && sub_resource.is_empty())
                    || (operation == "UPDATE"
                        && (sub_resource.is_empty() || sub_resource == "ephemeralcontainers"))
            }
        };
        if acted {
            return Ok(());
        }
        let operation = if operation.is_empty() {
            "an unnamed operation"
        } else {
            operation
        };
        Err(match sub_resource {
            "" => format!("{operation} is not reviewed here"),
            sub => format!("{operation} of subresource {sub} is not reviewed here"),
        })
    }
}

/// Parses an AdmissionReview v1 body for `/mutate`.
pub fn parse(body: &[u8]) -> Result<Review, ReviewError> {
    parse_for(body, Scope::Mutation)
}

/// Parses an AdmissionReview v1 body for the endpoint of `scope`.
pub fn parse_for(body: &[u8], scope: Scope) -> Result<Review, ReviewError> {
    if body.len() > MAX_BODY_BYTES {
        return Err(ReviewError::TooLarge {
            size: body.len(),
            limit: MAX_BODY_BYTES,
        });
    }
    // INVARIANT: the fast path answers only the reviews it fully accepts,
    // with exactly what `parse_members` would answer; everything else
    // (every error, every passthrough, duplicate keys, a member of an
    // unexpected type) is decided by `parse_members`.
    match serde_json::from_slice::<fast::Object<fast::Envelope>>(body) {
        Ok(envelope) => match envelope.0.into_pod_review(scope) {
            Some(review) => Ok(review),
            None => parse_members(body, scope),
        },
        Err(_) => parse_members(body, scope),
    }
}

/// The common case in one pass: a well-formed pod CREATE deserialized
/// straight into typed fields, the pod included. Reading the review as
/// members first and the pod from its text after went over the pod's bytes
/// three times, and that took a third of an admission's instructions.
mod fast {
    use std::fmt;
    use std::marker::PhantomData;

    use k8s_openapi::api::core::v1::Pod;
    use serde::de::{value::MapAccessDeserializer, Deserializer, MapAccess, Visitor};
    use serde::Deserialize;

    use super::{Action, Review, Scope, API_VERSION, KIND};

    /// `T` read from a JSON object only. A derived struct also accepts an
    /// array of its fields in order, which the member parser (rightly)
    /// does not take for an object.
    pub(super) struct Object<T>(pub(super) T);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct OnlyMap<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for OnlyMap<T> {
                type Value = T;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                    T::deserialize(MapAccessDeserializer::new(map))
                }
            }
            deserializer
                .deserialize_map(OnlyMap(PhantomData))
                .map(Object)
        }
    }

    #[derive(Deserialize)]
    pub(super) struct Envelope {
        #[serde(rename = "apiVersion")]
        api_version: Option<String>,
        kind: Option<String>,
        request: Option<Object<Request>>,
    }

    #[derive(Deserialize)]
    struct Request {
        uid: Option<String>,
        namespace: Option<String>,
        operation: Option<String>,
        #[serde(rename = "dryRun")]
        dry_run: Option<bool>,
        #[serde(rename = "subResource")]
        sub_resource: Option<String>,
        kind: Option<Object<GroupVersionKind>>,
        object: Option<Object<Box<Pod>>>,
    }

    #[derive(Deserialize)]
    struct GroupVersionKind {
        group: Option<String>,
        version: Option<String>,
        kind: Option<String>,
    }

    impl Envelope {
        /// The review, when it is a pod review `scope` acts on that
        /// `parse_members` would accept as one; `None` sends the body down
        /// the slow path.
        pub(super) fn into_pod_review(self, scope: Scope) -> Option<Review> {
            if self.api_version.as_deref() != Some(API_VERSION)
                || self.kind.as_deref() != Some(KIND)
            {
                return None;
            }
            let request = self.request?.0;
            let kind = request.kind?.0;
            let pod_kind = kind.group.as_deref().unwrap_or_default().is_empty()
                && kind.version.as_deref() == Some("v1")
                && kind.kind.as_deref() == Some("Pod");
            let operation = request.operation?;
            let accepted = pod_kind
                && scope
                    .acts_on(
                        &operation,
                        request.sub_resource.as_deref().unwrap_or_default(),
                    )
                    .is_ok();
            let uid = request.uid.filter(|u| !u.is_empty())?;
            let namespace = request.namespace.filter(|n| !n.is_empty())?;
            let pod = request.object?.0;
            accepted.then(|| Review {
                uid,
                namespace,
                operation,
                dry_run: request.dry_run.unwrap_or(false),
                action: Action::Mutate(pod),
            })
        }
    }
}

/// Parses a review member by member, each check in turn, so that whatever
/// is wrong with it gets its own precise error (and the uid, once read).
fn parse_members(body: &[u8], scope: Scope) -> Result<Review, ReviewError> {
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

    // Whatever the endpoint does not act on is let through whatever its
    // kind: refusing a DELETE because the webhook's rules were too wide
    // would block cleanup cluster-wide.
    let sub_resource = text(&request, "subResource").unwrap_or_default();
    if let Err(reason) = scope.acts_on(&operation, &sub_resource) {
        return Ok(passthrough(reason));
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

/// An AdmissionReview answer. It is serialized once, straight to the
/// response body: building a `Value` tree of it, then writing that out,
/// escaped the base64 patch byte by byte and cost about a fifth of an
/// admission's instructions.
#[derive(Debug, Clone, Serialize)]
pub struct Answer {
    #[serde(rename = "apiVersion")]
    api_version: &'static str,
    kind: &'static str,
    response: AnswerResponse,
}

#[derive(Debug, Clone, Serialize)]
struct AnswerResponse {
    uid: String,
    allowed: bool,
    #[serde(rename = "patchType", skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    /// The base64 text, already quoted: it has nothing to escape.
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    warnings: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<AnswerStatus>,
}

#[derive(Debug, Clone, Serialize)]
struct AnswerStatus {
    code: u16,
    message: String,
}

impl Answer {
    fn new(response: AnswerResponse) -> Self {
        Answer {
            api_version: API_VERSION,
            kind: KIND,
            response,
        }
    }
}

/// `bytes` as a JSON string of their base64.
fn base64_json(bytes: &[u8]) -> Result<Box<RawValue>, serde_json::Error> {
    let mut quoted = String::with_capacity(bytes.len().div_ceil(3) * 4 + 2);
    quoted.push('"');
    base64::engine::general_purpose::STANDARD.encode_string(bytes, &mut quoted);
    quoted.push('"');
    RawValue::from_string(quoted)
}

/// Allows the request, with `patch` (JSON Patch, base64 as the API server
/// expects) when it has operations, and `warnings` shown to the client
/// (`kubectl` prints them; a controller's logs may).
pub fn allow(uid: &str, patch: Option<&super::patch::Patch>, warnings: &[String]) -> Answer {
    let mut response = AnswerResponse {
        uid: uid.to_string(),
        allowed: true,
        patch_type: None,
        patch: None,
        warnings: warnings.to_vec(),
        status: None,
    };
    if let Some(patch) = patch.filter(|p| !p.0.is_empty()) {
        // A Patch is plain data; serializing it cannot fail. Should it ever,
        // answering without the patch would silently skip injection, so
        // refuse instead.
        match serde_json::to_vec(patch).and_then(|bytes| base64_json(&bytes)) {
            Ok(encoded) => {
                response.patch_type = Some("JSONPatch");
                response.patch = Some(encoded);
            }
            Err(e) => return deny(uid, 500, &format!("cannot encode the patch: {e}")),
        }
    }
    Answer::new(response)
}

/// Refuses the request with an HTTP-like `code` and a message the user sees
/// in `kubectl`'s error or the controller's events.
pub fn deny(uid: &str, code: u16, message: &str) -> Answer {
    Answer::new(AnswerResponse {
        uid: uid.to_string(),
        allowed: false,
        patch_type: None,
        patch: None,
        warnings: Vec::new(),
        status: Some(AnswerStatus {
            code,
            message: message.to_string(),
        }),
    })
}

/// The answer to a body that is not even a review (no uid to echo). The API
/// server will treat it as a failed call and apply the failurePolicy; it is
/// still a well-formed review so that the failure is legible in its logs.
pub fn error_response(message: &str) -> Answer {
    deny("", 400, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn value(answer: Answer) -> Value {
        serde_json::to_value(answer).unwrap()
    }

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

    /// Every variant of the fixtures' reviews gets from `parse` (the typed
    /// single pass, falling back) exactly what the member-by-member parser
    /// answers, and the untouched pod CREATEs do take the fast path.
    #[test]
    fn the_fast_path_answers_exactly_as_the_member_parser() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/admission");
        let mut fast = 0;
        let mut bodies = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            let original: Value = serde_json::from_str(&text).unwrap();
            let mut variants = vec![text.clone()];
            // One change at a time, each a way `parse_members` reads a
            // review differently from a typed struct if the fast path were
            // careless: absent, null, empty, mistyped, duplicated members.
            let edits: &[(&str, Value)] = &[
                ("/apiVersion", json!("admission.k8s.io/v1beta1")),
                ("/kind", json!(null)),
                ("/request/uid", json!("")),
                ("/request/uid", json!(7)),
                ("/request/namespace", json!("")),
                ("/request/namespace", json!(null)),
                ("/request/namespace", json!(["ml"])),
                ("/request/operation", json!("UPDATE")),
                ("/request/operation", json!(null)),
                ("/request/dryRun", json!("yes")),
                ("/request/dryRun", json!(null)),
                ("/request/dryRun", json!(true)),
                ("/request/subResource", json!("status")),
                ("/request/subResource", json!("ephemeralcontainers")),
                ("/request/subResource", json!("")),
                ("/request/subResource", json!(3)),
                (
                    "/request/kind",
                    json!({"group": "", "version": "v1", "kind": "Pod"}),
                ),
                ("/request/kind", json!({"version": "v1", "kind": "Pod"})),
                (
                    "/request/kind",
                    json!({"group": null, "version": "v1", "kind": "Pod"}),
                ),
                (
                    "/request/kind",
                    json!({"group": "apps", "version": "v1", "kind": "Pod"}),
                ),
                ("/request/kind", json!(["", "v1", "Pod"])),
                ("/request/object", json!(null)),
                ("/request/object", json!([1])),
                ("/request/object/spec", json!({"containers": 3})),
                ("/request/object/kind", json!("Service")),
                ("/request", json!(null)),
            ];
            for (pointer, value) in edits {
                let mut edited = original.clone();
                let (parent, key) = pointer.rsplit_once('/').unwrap();
                if let Some(Value::Object(members)) = edited.pointer_mut(parent) {
                    members.insert(key.to_string(), value.clone());
                    variants.push(edited.to_string());
                }
                if let Some(Value::Object(members)) = edited.pointer_mut(parent) {
                    members.remove(key);
                    variants.push(edited.to_string());
                }
            }
            // A member given twice: the member parser keeps the last one.
            variants.push(text.replacen("\"uid\":", "\"uid\": \"first\", \"uid\":", 1));
            variants.push(text.replacen("\"request\":", "\"request\": {}, \"request\":", 1));
            variants.push(text.replacen("{", "{\"kind\": \"Other\", ", 1));
            // Each object given as an array of its members' values.
            let request = &original["request"];
            let as_array =
                |v: &Value| Value::Array(v.as_object().unwrap().values().cloned().collect());
            let mut edited = original.clone();
            edited["request"] = as_array(request);
            variants.push(edited.to_string());
            let mut edited = original.clone();
            edited["request"]["kind"] = as_array(&request["kind"]);
            variants.push(edited.to_string());
            if request["object"].is_object() {
                let mut edited = original.clone();
                edited["request"]["object"] = as_array(&request["object"]);
                variants.push(edited.to_string());
            }
            variants.push(as_array(&original).to_string());
            for body in &variants {
                for scope in [Scope::Mutation, Scope::Guard] {
                    bodies += 1;
                    let answer = parse_for(body.as_bytes(), scope);
                    assert_eq!(answer, parse_members(body.as_bytes(), scope), "{body}");
                    let typed = serde_json::from_str::<fast::Object<fast::Envelope>>(body)
                        .ok()
                        .and_then(|e| e.0.into_pod_review(scope));
                    fast += usize::from(typed.is_some());
                    if let Some(review) = typed {
                        assert_eq!(Ok(review), answer, "{body}");
                    }
                }
            }
        }
        // The fixtures hold pod CREATEs: each takes the fast path untouched
        // and again for each edit that leaves it a well-formed CREATE.
        assert!(
            fast >= 2 * 3 * 3,
            "fast path taken {fast} times of {bodies}"
        );
        assert!(bodies > 2 * 5 * 40, "{bodies}");
    }

    #[test]
    fn allow_encodes_the_patch_and_omits_an_empty_one() {
        use super::super::patch::{Op, Operation, Patch};
        let patch = Patch(vec![Operation::new(Op::Add, &["a"], &1).unwrap()]);
        let v = value(allow("u", Some(&patch), &["w".into()]));
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
        let empty = value(allow("u", Some(&Patch::default()), &[]));
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
        let r = value(e.response());
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
