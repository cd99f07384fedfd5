//! The registered admission configurations (MutatingWebhookConfiguration,
//! ValidatingWebhookConfiguration, ValidatingAdmissionPolicy and its
//! bindings) and where each webhook Service's endpoints are.
//!
//! A configuration is checked when it is registered, as the API server's
//! validation checks it (`pkg/apis/admissionregistration/validation/
//! validation.go`: `admissionReviewVersions` must include a version the
//! server speaks, `sideEffects` must be `None` or `NoneOnDryRun` in v1,
//! exactly one of `url` and `service`, an `https` URL, `timeoutSeconds`
//! from 1 to 30; a policy's expressions must compile). `matchConditions`
//! are refused: the fake does not evaluate them, and a configuration that
//! relied on them would be matched more widely than in a cluster.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::Value;

use super::matching::Rule;
use super::policy::{Binding, Policy};
use crate::FakeKube;

/// Where a webhook is called.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Target {
    /// `clientConfig.url`.
    Url(String),
    /// `clientConfig.service`: called at `https://NAME.NAMESPACE.svc:PORT
    /// PATH`, connected to one of the Service's endpoints.
    Service {
        namespace: String,
        name: String,
        path: String,
        port: u16,
    },
}

/// One webhook of a configuration.
#[derive(Debug, Clone)]
pub(crate) struct Hook {
    /// `CONFIGURATION/NAME/INDEX`, as the dispatcher keys reinvocation.
    pub(crate) uid: String,
    pub(crate) name: String,
    pub(crate) target: Target,
    /// `clientConfig.caBundle`, decoded (PEM).
    pub(crate) ca_pem: Option<Vec<u8>>,
    pub(crate) rules: Vec<Rule>,
    pub(crate) namespace_selector: Value,
    pub(crate) object_selector: Value,
    /// `failurePolicy: Fail` (the default) rather than `Ignore`.
    pub(crate) fail_closed: bool,
    /// `reinvocationPolicy: IfNeeded` (mutating webhooks only).
    pub(crate) reinvoke_if_needed: bool,
    pub(crate) timeout: Duration,
}

/// Everything registered; see the module doc.
#[derive(Default)]
pub(crate) struct Registry {
    mutating: BTreeMap<String, Vec<Arc<Hook>>>,
    validating: BTreeMap<String, Vec<Arc<Hook>>>,
    policies: BTreeMap<String, Arc<Policy>>,
    bindings: BTreeMap<String, Arc<Binding>>,
    endpoints: HashMap<(String, String), Vec<SocketAddr>>,
    turn: usize,
    /// Every webhook call, oldest first: `NAME OPERATION[/SUBRESOURCE]`.
    calls: std::collections::VecDeque<String>,
    /// HTTPS clients by webhook and endpoint (their connections reused).
    clients: HashMap<ClientKey, reqwest::Client>,
}

/// A webhook's uid and the endpoint it is called at (`None` for a URL).
pub(crate) type ClientKey = (String, Option<SocketAddr>);

/// Most webhook calls kept for [`FakeKube::webhook_calls`].
const MAX_CALLS: usize = 10_000;

impl Registry {
    /// Registers (or replaces) one admissionregistration.k8s.io/v1 object.
    pub(crate) fn register(&mut self, obj: &Value) -> Result<(), String> {
        // A configuration registered anew may carry another caBundle.
        self.clients.clear();
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or("metadata.name is required")?
            .to_string();
        match obj["kind"].as_str() {
            Some("MutatingWebhookConfiguration") => {
                let hooks = hooks(&name, obj, true)?;
                self.mutating.insert(name, hooks);
            }
            Some("ValidatingWebhookConfiguration") => {
                let hooks = hooks(&name, obj, false)?;
                self.validating.insert(name, hooks);
            }
            Some("ValidatingAdmissionPolicy") => {
                let policy = Policy::parse(&name, obj)?;
                self.policies.insert(name, Arc::new(policy));
            }
            Some("ValidatingAdmissionPolicyBinding") => {
                let binding = Binding::parse(&name, obj)?;
                self.bindings.insert(name, Arc::new(binding));
            }
            other => return Err(format!("not an admission configuration: kind {other:?}")),
        }
        Ok(())
    }

    /// Removes a registered object; false when there was none.
    pub(crate) fn remove(&mut self, kind: &str, name: &str) -> bool {
        match kind {
            "MutatingWebhookConfiguration" => self.mutating.remove(name).is_some(),
            "ValidatingWebhookConfiguration" => self.validating.remove(name).is_some(),
            "ValidatingAdmissionPolicy" => self.policies.remove(name).is_some(),
            "ValidatingAdmissionPolicyBinding" => self.bindings.remove(name).is_some(),
            _ => false,
        }
    }

    /// The mutating webhooks in calling order: configurations sorted by
    /// name (`configuration/mutating_webhook_manager.go`
    /// `sort.SliceStable(... ByName)`), webhooks in their listed order.
    pub(crate) fn mutating(&self) -> Vec<Arc<Hook>> {
        self.mutating.values().flatten().cloned().collect()
    }

    /// The validating webhooks, in the same order.
    pub(crate) fn validating(&self) -> Vec<Arc<Hook>> {
        self.validating.values().flatten().cloned().collect()
    }

    /// Each binding with the policy it names (a binding whose policy is
    /// not registered does nothing, as in the API server).
    pub(crate) fn bound_policies(&self) -> Vec<(Arc<Binding>, Arc<Policy>)> {
        self.bindings
            .values()
            .filter_map(|b| Some((b.clone(), self.policies.get(&b.policy)?.clone())))
            .collect()
    }

    pub(crate) fn client(&self, key: &ClientKey) -> Option<reqwest::Client> {
        self.clients.get(key).cloned()
    }

    pub(crate) fn keep_client(&mut self, key: ClientKey, client: reqwest::Client) {
        self.clients.insert(key, client);
    }

    pub(crate) fn record_call(&mut self, call: String) {
        if self.calls.len() >= MAX_CALLS {
            self.calls.pop_front();
        }
        self.calls.push_back(call);
    }

    pub(crate) fn set_endpoints(
        &mut self,
        namespace: &str,
        name: &str,
        addresses: Vec<SocketAddr>,
    ) {
        self.endpoints
            .insert((namespace.to_string(), name.to_string()), addresses);
    }

    /// The next ready endpoint of a Service, in turn, as the API server's
    /// client balances over them; `None` when it has none.
    pub(crate) fn endpoint(&mut self, namespace: &str, name: &str) -> Option<SocketAddr> {
        let list = self
            .endpoints
            .get(&(namespace.to_string(), name.to_string()))?;
        if list.is_empty() {
            return None;
        }
        self.turn = self.turn.wrapping_add(1);
        Some(list[self.turn % list.len()])
    }
}

fn hooks(config: &str, obj: &Value, mutating: bool) -> Result<Vec<Arc<Hook>>, String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (i, w) in obj["webhooks"].as_array().into_iter().flatten().enumerate() {
        let at = |field: &str| format!("webhooks[{i}].{field}");
        let name = w["name"].as_str().ok_or(at("name: Required value"))?;
        if name.split('.').count() < 3 {
            return Err(format!(
                "{}: Invalid value: {name:?}: should be a domain with at least three segments separated by dots",
                at("name")
            ));
        }
        let versions = w["admissionReviewVersions"].as_array();
        if !versions.into_iter().flatten().any(|v| v == "v1") {
            return Err(format!(
                "{}: Invalid value: must include v1 (the only version this API server sends)",
                at("admissionReviewVersions")
            ));
        }
        if !matches!(w["sideEffects"].as_str(), Some("None" | "NoneOnDryRun")) {
            return Err(format!(
                "{}: Unsupported value: {}: supported values: \"None\", \"NoneOnDryRun\"",
                at("sideEffects"),
                w["sideEffects"]
            ));
        }
        if w.get("matchConditions").is_some_and(|m| !m.is_null()) {
            return Err(format!(
                "{}: this fake API server does not evaluate matchConditions",
                at("matchConditions")
            ));
        }
        let client = &w["clientConfig"];
        let target = match (client["url"].as_str(), client.get("service")) {
            (Some(url), None) if url.starts_with("https://") => Target::Url(url.to_string()),
            (Some(_), None) => {
                return Err(format!(
                    "{}: Invalid value: 'https' is the only allowed URL scheme",
                    at("clientConfig.url")
                ))
            }
            (None, Some(service)) => Target::Service {
                namespace: service["namespace"]
                    .as_str()
                    .ok_or(at("clientConfig.service.namespace: Required value"))?
                    .into(),
                name: service["name"]
                    .as_str()
                    .ok_or(at("clientConfig.service.name: Required value"))?
                    .into(),
                path: service["path"].as_str().unwrap_or("/").into(),
                port: service["port"]
                    .as_u64()
                    .map_or(Ok(443), u16::try_from)
                    .map_err(|e| e.to_string())?,
            },
            _ => {
                return Err(format!(
                    "{}: Required value: exactly one of url or service is required",
                    at("clientConfig")
                ))
            }
        };
        let ca_pem = match client["caBundle"].as_str() {
            Some(b64) => Some(
                STANDARD
                    .decode(b64)
                    .map_err(|e| format!("{}: {e}", at("clientConfig.caBundle")))?,
            ),
            None => None,
        };
        let rules = w["rules"]
            .as_array()
            .into_iter()
            .flatten()
            .map(Rule::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("{}: {e}", at("rules")))?;
        let timeout = w["timeoutSeconds"].as_u64().unwrap_or(10);
        if !(1..=30).contains(&timeout) {
            return Err(format!(
                "{}: Invalid value: {timeout}: the timeout value must be between 1 and 30 seconds",
                at("timeoutSeconds")
            ));
        }
        let fail_closed = match w["failurePolicy"].as_str() {
            None | Some("Fail") => true,
            Some("Ignore") => false,
            Some(other) => {
                return Err(format!(
                    "{}: Unsupported value: {other:?}",
                    at("failurePolicy")
                ))
            }
        };
        let reinvoke_if_needed = match w["reinvocationPolicy"].as_str() {
            None | Some("Never") => false,
            Some("IfNeeded") if mutating => true,
            Some(other) => {
                return Err(format!(
                    "{}: Unsupported value: {other:?}",
                    at("reinvocationPolicy")
                ))
            }
        };
        let index = seen.entry(name.to_string()).or_default();
        let uid = format!("{config}/{name}/{index}");
        *index += 1;
        out.push(Arc::new(Hook {
            uid,
            name: name.to_string(),
            target,
            ca_pem,
            rules,
            namespace_selector: w["namespaceSelector"].clone(),
            object_selector: w["objectSelector"].clone(),
            fail_closed,
            reinvoke_if_needed,
            timeout: Duration::from_secs(timeout),
        }));
    }
    Ok(out)
}

impl FakeKube {
    /// Registers an `admissionregistration.k8s.io/v1` object: a
    /// MutatingWebhookConfiguration, a ValidatingWebhookConfiguration, a
    /// ValidatingAdmissionPolicy or a ValidatingAdmissionPolicyBinding.
    /// Pods written through the API afterwards are admitted with it.
    pub fn register_admission(&self, obj: &Value) -> Result<(), String> {
        self.admission_registry().register(obj)
    }

    /// Removes a registered admission object of `kind` and `name`.
    pub fn unregister_admission(&self, kind: &str, name: &str) -> bool {
        self.admission_registry().remove(kind, name)
    }

    /// Sets the ready endpoints of Service `namespace/name`, where a
    /// webhook registered with `clientConfig.service` is called (in turn,
    /// one per call), as the endpoints controller keeps them.
    pub fn set_endpoints(&self, namespace: &str, name: &str, addresses: Vec<SocketAddr>) {
        self.admission_registry()
            .set_endpoints(namespace, name, addresses);
    }

    /// Every webhook call made, oldest first, as `NAME OPERATION` (with
    /// `/SUBRESOURCE` when there is one), and every policy evaluated, as
    /// `ValidatingAdmissionPolicy NAME OPERATION`: what tests assert
    /// reinvocation on.
    pub fn webhook_calls(&self) -> Vec<String> {
        self.admission_registry().calls.iter().cloned().collect()
    }

    pub(crate) fn admission_registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.admission.lock().unwrap_or_else(|p| p.into_inner())
    }
}
