//! Calling the registered webhooks: the mutating dispatcher with its
//! reinvocation, the validating dispatcher, and one call over HTTPS.
//!
//! Sources (`k8s.io/apiserver/pkg/admission/plugin/webhook/`):
//! - `mutating/dispatcher.go` `Dispatch`: a webhook whose predicates match
//!   is called; when its patch changed the object (compared before the
//!   object is defaulted again), every `IfNeeded` webhook invoked so far is
//!   marked for reinvocation and the chain is asked to run again; a
//!   webhook is added to the invoked set after its own call, so its own
//!   change does not mark it. On the second pass only marked webhooks are
//!   called, and when the built-in plugins changed the object since the
//!   last webhook ran, the invoked ones are marked too
//!   (`IsOutputChangedSinceLastWebhookInvocation`); a webhook is never
//!   called for the first time then. `mutating/reinvocationcontext.go`
//!   keeps those sets.
//! - `request/admissionreview.go`: the AdmissionReview sent
//!   (`admission.k8s.io/v1`, `kind`/`resource`/`subResource` and their
//!   `request*` twins, `userInfo`, `object`, `oldObject`, `dryRun`,
//!   `options`) and the checks on the answer (`apiVersion` and `kind`,
//!   `response.uid` equal to the request's, `patchType: JSONPatch`).
//! - `errors/statuserror.go` `ToStatusErr`: a refusal becomes `admission
//!   webhook "NAME" denied the request: MESSAGE` (the webhook's reason
//!   when it gave no message), with its code, at least 400.
//! - `pkg/util/webhook/error.go` and `generic` failure handling: a call
//!   that fails is `failed calling webhook "NAME": failed to call webhook:
//!   ...`, refused as an internal error (500) under `failurePolicy: Fail`
//!   and skipped under `Ignore`.
//! - the webhook client (`k8s.io/apiserver/pkg/util/webhook`): a Service is
//!   called at `https://NAME.NAMESPACE.svc:PORT/PATH?timeout=Ns`, its
//!   certificate checked against `caBundle` for that name.
//!
//! One difference: the API server calls validating webhooks in parallel
//! and answers with the first refusal it collects; the fake calls them in
//! order, so that a test's outcome does not depend on timing.

use std::collections::BTreeSet;
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};

use super::defaults;
use super::matching::{object_matches, selector_matches};
use super::registry::{Hook, Target};
use super::{Attributes, Rejection};
use crate::FakeKube;

/// What the dispatcher remembers across the two passes of one request.
#[derive(Debug, Default)]
pub(crate) struct Reinvocation {
    should_reinvoke: bool,
    is_reinvoke: bool,
    last_output: Option<Value>,
    previously_invoked: BTreeSet<String>,
    reinvoke: BTreeSet<String>,
}

impl Reinvocation {
    /// Whether a webhook changed the object, so the chain runs again.
    pub(crate) fn should_reinvoke(&self) -> bool {
        self.should_reinvoke
    }

    pub(crate) fn start_reinvoke(&mut self) {
        self.is_reinvoke = true;
    }

    fn require_reinvoking_previously_invoked(&mut self) {
        let invoked = std::mem::take(&mut self.previously_invoked);
        self.reinvoke.extend(invoked);
    }
}

/// How one call went wrong.
enum CallError {
    /// The webhook answered `allowed: false`.
    Denied(Rejection),
    /// The call failed; `failurePolicy` decides.
    Failed(String),
}

/// A webhook's answer to an allowed request.
struct Reply {
    patch: Option<Vec<u8>>,
    warnings: Vec<String>,
}

impl FakeKube {
    /// One pass of the mutating webhooks over `a` (see the module doc).
    pub(super) async fn call_mutating(
        self: &Arc<Self>,
        a: &mut Attributes,
        r: &mut Reinvocation,
        warnings: &mut Vec<String>,
    ) -> Result<(), Rejection> {
        if r.is_reinvoke
            && r.last_output
                .as_ref()
                .is_some_and(|last| !defaults::semantic_eq(last, &a.object))
        {
            r.require_reinvoking_previously_invoked();
        }
        let hooks = self.admission_registry().mutating();
        for hook in hooks {
            if !self.hook_matches(&hook, a)? {
                continue;
            }
            if r.is_reinvoke && !r.reinvoke.contains(&hook.uid) {
                continue;
            }
            let reply = match self.call(&hook, a).await {
                Ok(reply) => reply,
                Err(CallError::Denied(rejection)) => return Err(rejection),
                Err(CallError::Failed(why)) if hook.fail_closed => {
                    return Err(Rejection::internal(&why))
                }
                Err(CallError::Failed(why)) => {
                    tracing::warn!(webhook = %hook.name, "{why}; failurePolicy Ignore");
                    continue;
                }
            };
            warnings.extend(reply.warnings);
            let changed = match reply.patch {
                Some(patch) => apply_patch(&hook, a, &patch)?,
                None => false,
            };
            if changed {
                r.require_reinvoking_previously_invoked();
                r.should_reinvoke = true;
            }
            if hook.reinvoke_if_needed {
                r.previously_invoked.insert(hook.uid.clone());
            }
        }
        r.last_output = Some(a.object.clone());
        Ok(())
    }

    /// The validating webhooks over the final object.
    pub(super) async fn call_validating(
        self: &Arc<Self>,
        a: &Attributes,
        warnings: &mut Vec<String>,
    ) -> Result<(), Rejection> {
        let hooks = self.admission_registry().validating();
        for hook in hooks {
            if !self.hook_matches(&hook, a)? {
                continue;
            }
            match self.call(&hook, a).await {
                Ok(Reply { patch: Some(_), .. }) => {
                    return Err(Rejection::internal(&format!(
                        "failed calling webhook \"{}\": received invalid webhook response: validating webhooks may not return a patch",
                        hook.name
                    )))
                }
                Ok(reply) => warnings.extend(reply.warnings),
                Err(CallError::Denied(rejection)) => return Err(rejection),
                Err(CallError::Failed(why)) if hook.fail_closed => {
                    return Err(Rejection::internal(&why))
                }
                Err(CallError::Failed(why)) => {
                    tracing::warn!(webhook = %hook.name, "{why}; failurePolicy Ignore");
                }
            }
        }
        Ok(())
    }

    /// `generic/webhook.go` `ShouldCallHook`: namespaceSelector,
    /// objectSelector, then the rules.
    fn hook_matches(&self, hook: &Hook, a: &Attributes) -> Result<bool, Rejection> {
        let labels = self.namespace_labels(&a.namespace).ok_or_else(|| {
            Rejection::new(
                404,
                "NotFound",
                format!("namespaces \"{}\" not found", a.namespace),
            )
        })?;
        let selected = |result: Result<bool, String>| {
            result.map_err(|e| Rejection::internal(&format!("webhook {:?}: {e}", hook.name)))
        };
        Ok(
            selected(selector_matches(&hook.namespace_selector, &labels))?
                && selected(object_matches(&hook.object_selector, a))?
                && hook.rules.iter().any(|rule| rule.matches(a)),
        )
    }

    /// One call of `hook` with the review of `a`.
    async fn call(self: &Arc<Self>, hook: &Hook, a: &Attributes) -> Result<Reply, CallError> {
        let timeout = format!("timeout={}s", hook.timeout.as_secs());
        let (url, resolve) = match &hook.target {
            Target::Url(url) => {
                let sep = if url.contains('?') { '&' } else { '?' };
                (format!("{url}{sep}{timeout}"), None)
            }
            Target::Service {
                namespace,
                name,
                path,
                port,
            } => {
                let host = format!("{name}.{namespace}.svc");
                let url = format!("https://{host}:{port}{path}?{timeout}");
                let endpoint = self.admission_registry().endpoint(namespace, name);
                let Some(endpoint) = endpoint else {
                    return Err(failed(
                        hook,
                        &url,
                        format!("no endpoints available for service \"{name}\""),
                    ));
                };
                (url, Some((host, endpoint)))
            }
        };
        let client = self
            .client(hook, resolve)
            .map_err(|e| failed(hook, &url, e))?;
        let uid = uuid::Uuid::new_v4().to_string();
        let review = review(a, &uid);
        let sub = match a.sub_resource {
            "" => String::new(),
            sub => format!("/{sub}"),
        };
        self.admission_registry().record_call(format!(
            "{} {}{sub}",
            hook.name,
            a.operation.as_str()
        ));
        let response = client
            .post(&url)
            .json(&review)
            .send()
            .await
            .map_err(|e| failed(hook, &url, lanyard::error_text::with_causes(&e)))?;
        let status = response.status();
        if !status.is_success() {
            return Err(failed(
                hook,
                &url,
                format!("the server responded with the status code {} but did not return more information", status.as_u16()),
            ));
        }
        let body: Value = response.json().await.map_err(|e| {
            CallError::Failed(format!(
                "failed calling webhook \"{}\": received invalid webhook response: {e}",
                hook.name
            ))
        })?;
        let invalid = |why: String| {
            CallError::Failed(format!(
                "failed calling webhook \"{}\": received invalid webhook response: {why}",
                hook.name
            ))
        };
        if body["apiVersion"] != "admission.k8s.io/v1" || body["kind"] != "AdmissionReview" {
            return Err(invalid(format!(
                "expected webhook response of admission.k8s.io/v1, Kind=AdmissionReview, got {}, Kind={}",
                body["apiVersion"], body["kind"]
            )));
        }
        let answer = &body["response"];
        if answer["uid"].as_str() != Some(uid.as_str()) {
            return Err(invalid(format!(
                "expected response.uid=\"{uid}\", got {}",
                answer["uid"]
            )));
        }
        let warnings = answer["warnings"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|w| w.as_str().map(str::to_string))
            .collect();
        if answer["allowed"].as_bool() != Some(true) {
            return Err(CallError::Denied(denied(&hook.name, &answer["status"])));
        }
        let patch = match answer["patch"].as_str() {
            None => None,
            Some(b64) => {
                if answer["patchType"] != "JSONPatch" {
                    return Err(invalid(format!(
                        "webhook returned a patch with patchType {}",
                        answer["patchType"]
                    )));
                }
                Some(STANDARD.decode(b64).map_err(|e| invalid(e.to_string()))?)
            }
        };
        Ok(Reply { patch, warnings })
    }
}

impl FakeKube {
    /// The HTTPS client for `hook` at `resolve` (the Service's host name
    /// and the endpoint chosen), kept per webhook and endpoint so that
    /// connections are reused across calls, as the API server's webhook
    /// client reuses them.
    fn client(
        &self,
        hook: &Hook,
        resolve: Option<(String, std::net::SocketAddr)>,
    ) -> Result<reqwest::Client, String> {
        let key = (hook.uid.clone(), resolve.as_ref().map(|(_, addr)| *addr));
        if let Some(client) = self.admission_registry().client(&key) {
            return Ok(client);
        }
        let roots = match &hook.ca_pem {
            Some(pem) => {
                reqwest::Certificate::from_pem_bundle(pem).map_err(|e| format!("caBundle: {e}"))?
            }
            None => Vec::new(),
        };
        let mut client = reqwest::Client::builder()
            .timeout(hook.timeout)
            .tls_certs_only(roots);
        if let Some((host, endpoint)) = resolve {
            client = client.resolve(&host, endpoint);
        }
        let client = client.build().map_err(|e| e.to_string())?;
        self.admission_registry().keep_client(key, client.clone());
        Ok(client)
    }
}

/// The AdmissionReview for `a` (`request/admissionreview.go`
/// `CreateV1AdmissionReview`).
fn review(a: &Attributes, uid: &str) -> Value {
    let encoded = |pod: &Value| {
        let mut pod = pod.clone();
        defaults::encode(&mut pod);
        pod
    };
    let kind = json!({"group": "", "version": "v1", "kind": "Pod"});
    let resource = json!({"group": "", "version": "v1", "resource": "pods"});
    let mut request = json!({
        "uid": uid, "kind": kind, "resource": resource,
        "requestKind": kind, "requestResource": resource,
        "namespace": a.namespace, "operation": a.operation.as_str(),
        "userInfo": {"username": a.user.name, "groups": a.user.groups},
        "object": encoded(&a.object),
        "oldObject": a.old_object.as_ref().map(encoded),
        "dryRun": a.dry_run, "options": a.options,
    });
    if !a.name.is_empty() {
        request["name"] = json!(a.name);
    }
    if !a.sub_resource.is_empty() {
        request["subResource"] = json!(a.sub_resource);
        request["requestSubResource"] = json!(a.sub_resource);
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

/// Applies a webhook's JSON Patch to the object and defaults it again;
/// whether the patch changed it (compared before defaulting, as the
/// dispatcher does).
fn apply_patch(hook: &Hook, a: &mut Attributes, patch: &[u8]) -> Result<bool, Rejection> {
    let internal = |why: String| {
        Rejection::internal(&format!("failed calling webhook \"{}\": {why}", hook.name))
    };
    let patch: json_patch::Patch =
        serde_json::from_slice(patch).map_err(|e| internal(format!("JSON Patch: {e}")))?;
    let mut patched = a.object.clone();
    json_patch::patch(&mut patched, &patch).map_err(|e| internal(format!("JSON Patch: {e}")))?;
    // The patched object must still decode as a Pod.
    serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(patched.clone())
        .map_err(|e| internal(format!("the patched object is not a Pod: {e}")))?;
    let patched = defaults::canonical(patched);
    let changed = !defaults::semantic_eq(&a.object, &patched);
    a.object = patched;
    defaults::pod(&mut a.object);
    Ok(changed)
}

fn failed(hook: &Hook, url: &str, why: String) -> CallError {
    CallError::Failed(format!(
        "failed calling webhook \"{}\": failed to call webhook: Post \"{url}\": {why}",
        hook.name
    ))
}

/// `ToStatusErr`.
fn denied(webhook: &str, status: &Value) -> Rejection {
    let by = format!("admission webhook \"{webhook}\" denied the request");
    let text = |field: &str| status[field].as_str().filter(|s| !s.is_empty());
    let message = match (text("message"), text("reason")) {
        (Some(message), _) => format!("{by}: {message}"),
        (None, Some(reason)) => format!("{by}: {reason}"),
        (None, None) => format!("{by} without explanation"),
    };
    let code = status["code"].as_u64().unwrap_or(0).max(400);
    Rejection {
        code: u16::try_from(code).unwrap_or(400),
        reason: text("reason").unwrap_or_default().to_string(),
        message,
        details: Box::new(status.get("details").cloned().unwrap_or_default()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_read_as_to_status_err_writes_them() {
        let r = denied(
            "guard.x.dev",
            &json!({"code": 403, "reason": "Forbidden", "message": "no"}),
        );
        assert_eq!(
            (r.code, r.message.as_str()),
            (
                403,
                "admission webhook \"guard.x.dev\" denied the request: no"
            )
        );
        let r = denied("a.b.c", &json!({"code": 200}));
        assert_eq!(r.code, 400);
        assert_eq!(
            r.message,
            "admission webhook \"a.b.c\" denied the request without explanation"
        );
    }
}
