//! The pod writes the fake serves, each through admission: `POST pods`,
//! `PUT` and `PATCH pods/NAME`, `GET`, `PUT` and `PATCH
//! pods/NAME/ephemeralcontainers`, and `DELETE pods/NAME`.
//!
//! As `k8s.io/apiserver/pkg/endpoints/handlers/{create,update,patch}.go`
//! and the generic registry store do: decode with defaults (the request's
//! namespace filled in, a different one refused), mutating admission, the
//! strategy and validation, validating admission, then storage with the
//! stored object's resourceVersion as a precondition (a PATCH is retried
//! on a conflict, a PUT with a stale `resourceVersion` answered 409).
//! `dryRun=All` runs all of it and stores nothing. Webhooks' and
//! policies' warnings come back as `Warning: 299 - "..."` headers, which
//! kubectl prints. Deletion is immediate (no grace period: no kubelet
//! waits on it) and admits nothing (no registered configuration here
//! matches DELETE).

use std::sync::Arc;

use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::{defaults, patches, pod_rules, Attributes, Operation, Rejection, User};
use crate::request::{Query, RequestInfo};
use crate::responses::json_response;
use crate::{FakeKube, Kind};

/// How an update gets its new object.
enum Change<'a> {
    Replace(&'a [u8]),
    Patch(&'a str, &'a [u8]),
}

/// Conflicting writes a PATCH is retried over before giving up.
const PATCH_RETRIES: usize = 5;

impl FakeKube {
    /// Serves a pod write classified as `res` (its RBAC already checked).
    pub(crate) async fn write_pod(
        self: &Arc<Self>,
        user: User,
        method: &Method,
        res: &RequestInfo,
        query: &Query,
        headers: &HeaderMap,
        body: &[u8],
    ) -> Response {
        let Some(namespace) = res.namespace.clone() else {
            return Rejection::new(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource".into(),
            )
            .response();
        };
        let dry_run = query.get("dryRun") == Some("All");
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let sub = res.subresource.as_deref();
        let outcome = match (method, res.name.as_deref(), sub) {
            (&Method::POST, None, None) => self
                .create_pod(user, &namespace, body, dry_run)
                .await
                .map(|(pod, w)| (StatusCode::CREATED, pod, w)),
            (&Method::PUT, Some(name), None | Some("ephemeralcontainers")) => self
                .update_pod(
                    user,
                    &namespace,
                    name,
                    sub_name(sub),
                    Change::Replace(body),
                    dry_run,
                )
                .await
                .map(|(pod, w)| (StatusCode::OK, pod, w)),
            (&Method::PATCH, Some(name), None | Some("ephemeralcontainers")) => self
                .update_pod(
                    user,
                    &namespace,
                    name,
                    sub_name(sub),
                    Change::Patch(content_type, body),
                    dry_run,
                )
                .await
                .map(|(pod, w)| (StatusCode::OK, pod, w)),
            (&Method::GET, Some(name), Some("ephemeralcontainers")) => {
                return self.get(Kind::Pod, &namespace, name)
            }
            (&Method::DELETE, Some(name), None) => self
                .delete_pod_now(&namespace, name)
                .map(|pod| (StatusCode::OK, pod, Vec::new())),
            _ => Err(Rejection::new(
                405,
                "MethodNotAllowed",
                "the server does not allow this method on the requested resource".into(),
            )),
        };
        match outcome {
            Ok((status, pod, warnings)) => with_warnings(json_response(status, &pod), &warnings),
            Err(rejection) => rejection.response(),
        }
    }

    async fn create_pod(
        self: &Arc<Self>,
        user: User,
        namespace: &str,
        body: &[u8],
        dry_run: bool,
    ) -> Result<(Value, Vec<String>), Rejection> {
        let mut pod = decode(body, namespace)?;
        if !self.namespace_exists(namespace) {
            return Err(Rejection {
                code: 404,
                reason: "NotFound".into(),
                message: format!("namespaces \"{namespace}\" not found"),
                details: Box::new(json!({"name": namespace, "kind": "namespaces"})),
            });
        }
        defaults::pod(&mut pod);
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut a = Attributes {
            operation: Operation::Create,
            sub_resource: "",
            namespace: namespace.to_string(),
            name,
            user,
            object: defaults::canonical(pod),
            old_object: None,
            options: json!({"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}),
            dry_run,
        };
        let mut warnings = Vec::new();
        self.mutating_admission(&mut a, &mut warnings).await?;
        pod_rules::prepare_for_create(&mut a.object);
        if a.object["metadata"]["name"]
            .as_str()
            .is_none_or(str::is_empty)
        {
            return Err(Rejection::invalid(
                "",
                &[(
                    "metadata.name".into(),
                    "Required value: name or generateName is required".into(),
                )],
            ));
        }
        pod_rules::validate_create(&a.object)?;
        a.name = a.object["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        self.validating_admission(&a, &mut warnings).await?;
        let mut pod = a.object;
        defaults::encode(&mut pod);
        if dry_run {
            return Ok((pod, warnings));
        }
        Ok((self.commit_pod(pod, None)?, warnings))
    }

    async fn update_pod(
        self: &Arc<Self>,
        user: User,
        namespace: &str,
        name: &str,
        sub: &'static str,
        change: Change<'_>,
        dry_run: bool,
    ) -> Result<(Value, Vec<String>), Rejection> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let current = self
                .stored_value(Kind::Pod, namespace, name)
                .ok_or_else(|| Rejection {
                    code: 404,
                    reason: "NotFound".into(),
                    message: format!("pods \"{name}\" not found"),
                    details: Box::new(json!({"name": name, "kind": "pods"})),
                })?;
            let rv = current["metadata"]["resourceVersion"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let mut new = match &change {
                Change::Replace(body) => {
                    let new = decode(body, namespace)?;
                    if new["metadata"]["name"].as_str() != Some(name) {
                        return Err(Rejection::new(400, "BadRequest", format!(
                            "the name of the object ({}) does not match the name on the URL ({name})",
                            new["metadata"]["name"].as_str().unwrap_or_default()
                        )));
                    }
                    match new["metadata"]["resourceVersion"].as_str() {
                        Some(given) if given != rv => return Err(conflict(name)),
                        _ => new,
                    }
                }
                Change::Patch(content_type, body) => {
                    let mut patched = current.clone();
                    patches::apply(&mut patched, content_type, body).map_err(
                        |(code, message)| {
                            Rejection::new(
                                code,
                                if code == 415 {
                                    "UnsupportedMediaType"
                                } else {
                                    "BadRequest"
                                },
                                message,
                            )
                        },
                    )?;
                    patched
                }
            };
            defaults::pod(&mut new);
            let mut a = Attributes {
                operation: Operation::Update,
                sub_resource: sub,
                namespace: namespace.to_string(),
                name: name.to_string(),
                user: user.clone(),
                object: defaults::canonical(new),
                old_object: Some(current.clone()),
                options: json!({"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}),
                dry_run,
            };
            let mut warnings = Vec::new();
            self.mutating_admission(&mut a, &mut warnings).await?;
            match sub {
                "ephemeralcontainers" => pod_rules::ephemeral_update(&current, &mut a.object)?,
                _ => pod_rules::update(&current, &mut a.object)?,
            }
            a.object["metadata"]["resourceVersion"] = json!(rv);
            self.validating_admission(&a, &mut warnings).await?;
            let mut pod = a.object;
            defaults::encode(&mut pod);
            if dry_run {
                return Ok((pod, warnings));
            }
            match self.commit_pod(pod, Some(&rv)) {
                Err(e)
                    if e.code == 409
                        && matches!(change, Change::Patch(..))
                        && attempt < PATCH_RETRIES =>
                {
                    continue
                }
                other => return other.map(|pod| (pod, warnings)),
            }
        }
    }

    fn delete_pod_now(&self, namespace: &str, name: &str) -> Result<Value, Rejection> {
        let pod = self
            .stored_value(Kind::Pod, namespace, name)
            .ok_or_else(|| Rejection::new(404, "NotFound", format!("pods \"{name}\" not found")))?;
        self.delete(Kind::Pod, namespace, name);
        Ok(pod)
    }

    /// Stores an admitted pod: a new one (`expected_rv: None`; 409 when
    /// the name is taken) or over the stored one at `expected_rv` (409 when
    /// it changed meanwhile). An update that changes nothing is not
    /// written, as the registry skips a no-op.
    fn commit_pod(&self, mut pod: Value, expected_rv: Option<&str>) -> Result<Value, Rejection> {
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        let namespace = pod["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let name = pod["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let key = (namespace, name.clone());
        let mut store = self.lock();
        let existing = store.objects[Kind::Pod.index()].get(&key).cloned();
        match (expected_rv, &existing) {
            (None, Some(_)) => {
                return Err(Rejection {
                    code: 409,
                    reason: "AlreadyExists".into(),
                    message: format!("pods \"{name}\" already exists"),
                    details: Box::new(json!({"name": name, "kind": "pods"})),
                })
            }
            (Some(_), None) => {
                return Err(Rejection::new(
                    404,
                    "NotFound",
                    format!("pods \"{name}\" not found"),
                ))
            }
            (Some(rv), Some(existing)) => {
                if existing["metadata"]["resourceVersion"].as_str() != Some(rv) {
                    return Err(conflict(&name));
                }
                if defaults::semantic_eq(existing, &pod) {
                    return Ok(existing.clone());
                }
            }
            (None, None) => {}
        }
        store.rv += 1;
        pod["metadata"]["resourceVersion"] = json!(store.rv.to_string());
        self.commit(&mut store, Kind::Pod, key, Some(pod.clone()));
        Ok(pod)
    }
}

fn sub_name(sub: Option<&str>) -> &'static str {
    match sub {
        Some("ephemeralcontainers") => "ephemeralcontainers",
        _ => "",
    }
}

/// A request body as a v1 Pod in `namespace`.
fn decode(body: &[u8], namespace: &str) -> Result<Value, Rejection> {
    let mut pod: Value = serde_json::from_slice(body).map_err(|e| {
        Rejection::new(
            400,
            "BadRequest",
            format!("error decoding the request body: {e}"),
        )
    })?;
    if pod["apiVersion"] != "v1" || pod["kind"] != "Pod" {
        return Err(Rejection::new(
            400,
            "BadRequest",
            format!(
                "the object provided is of kind {} in {}, not a v1 Pod",
                pod["kind"], pod["apiVersion"]
            ),
        ));
    }
    serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(pod.clone()).map_err(|e| {
        Rejection::new(
            400,
            "BadRequest",
            format!("Pod in version \"v1\" cannot be handled as a Pod: {e}"),
        )
    })?;
    match pod["metadata"]["namespace"].as_str() {
        Some(given) if !given.is_empty() && given != namespace => {
            return Err(Rejection::new(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on the request".into()));
        }
        _ => pod["metadata"]["namespace"] = json!(namespace),
    }
    Ok(pod)
}

fn conflict(name: &str) -> Rejection {
    Rejection {
        code: 409,
        reason: "Conflict".into(),
        message: format!("Operation cannot be fulfilled on pods \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
        details: Box::new(json!({"name": name, "kind": "pods"})),
    }
}

/// `Warning: 299 - "TEXT"` headers (RFC 7234 warn-code 299, as
/// `k8s.io/apiserver/pkg/warning` writes them).
fn with_warnings(mut response: Response, warnings: &[String]) -> Response {
    for text in warnings {
        let escaped: String = text
            .chars()
            .filter(|c| !c.is_control())
            .map(|c| if c.is_ascii() { c } else { '?' })
            .collect::<String>()
            .replace('\\', "\\\\")
            .replace('"', "\\\"");
        if let Ok(value) = HeaderValue::from_str(&format!("299 - \"{escaped}\"")) {
            response.headers_mut().append(header::WARNING, value);
        }
    }
    response.into_response()
}
