//! ValidatingAdmissionPolicies and their bindings, evaluated with CEL as
//! the API server evaluates them.
//!
//! Sources (`k8s.io/apiserver/pkg/admission/plugin/policy/validating/`):
//! `dispatcher.go` `Dispatch` (a binding applies when the policy's
//! `matchConstraints` and the binding's `matchResources` both match; each
//! failed validation under a `Deny` action refuses with
//! `ValidatingAdmissionPolicy 'P' with binding 'B' denied request: MSG`,
//! wrapped as `admission.NewForbidden` with the validation's reason, or
//! `Invalid` when it gives none, which sets the code (`policy_decision.go`
//! `reasonToCode`: Forbidden 403, Invalid 422, Unauthorized 401,
//! RequestEntityTooLarge 413); `Warn` turns it into a warning, `Audit`
//! into nothing here); `validator.go` (the variables `object`,
//! `oldObject` (null on CREATE), `request`, `namespaceObject`, `params`,
//! `variables`; a `messageExpression` that fails or gives no text falls
//! back to `message`, then to `failed expression: EXPR`; an expression
//! that fails to evaluate is decided by `failurePolicy`, `Fail` by
//! default).
//!
//! The CEL runtime is the `cel` crate with Kubernetes' CEL libraries from
//! `kube-cel` (`lowerAscii`, lists, sets, regular expressions). Two
//! differences from the API server, neither of which changes a decision
//! the chart's policy makes: `object` is untyped JSON here (the API
//! server types it by the Pod schema), and variables are evaluated once,
//! in order, before the validations (the API server evaluates them
//! lazily, so an unused variable's error would not count there; here it
//! is decided by `failurePolicy`). Policies with `paramKind`,
//! `matchConditions` or `authorizer` are refused at registration.

use std::collections::HashMap;
use std::sync::Arc;

use kube_cel::cel::{self, objects::Key, Program};
use kube_cel::KubeCelExt;
use serde_json::{json, Value};

use super::matching::{object_matches, selector_matches, Rule};
use super::{Attributes, Rejection};
use crate::FakeKube;

/// Where a policy or binding applies (`matchConstraints`,
/// `matchResources`).
#[derive(Debug, Clone, Default)]
struct Match {
    rules: Vec<Rule>,
    exclude: Vec<Rule>,
    namespace_selector: Value,
    object_selector: Value,
}

impl Match {
    fn parse(value: &Value) -> Result<Match, String> {
        let rules = |field: &str| {
            value[field]
                .as_array()
                .into_iter()
                .flatten()
                .map(Rule::parse)
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Match {
            rules: rules("resourceRules")?,
            exclude: rules("excludeResourceRules")?,
            namespace_selector: value["namespaceSelector"].clone(),
            object_selector: value["objectSelector"].clone(),
        })
    }

    /// A binding without `resourceRules` takes the policy's; `all_rules`
    /// says whether an empty rule list matches everything.
    fn matches(&self, a: &Attributes, ns_labels: &Value, all_rules: bool) -> Result<bool, String> {
        let ruled = (all_rules && self.rules.is_empty()) || self.rules.iter().any(|r| r.matches(a));
        Ok(ruled
            && !self.exclude.iter().any(|r| r.matches(a))
            && selector_matches(&self.namespace_selector, ns_labels)?
            && object_matches(&self.object_selector, a)?)
    }
}

#[derive(Debug, Clone)]
struct Validation {
    expression: String,
    message: Option<String>,
    message_expression: Option<String>,
    reason: Option<String>,
}

/// A registered ValidatingAdmissionPolicy (its expressions compiled once
/// at registration to refuse what would not compile).
#[derive(Debug)]
pub(crate) struct Policy {
    name: String,
    fail_closed: bool,
    constraints: Match,
    variables: Vec<(String, String)>,
    validations: Vec<Validation>,
}

/// A registered ValidatingAdmissionPolicyBinding.
#[derive(Debug)]
pub(crate) struct Binding {
    name: String,
    pub(crate) policy: String,
    actions: Vec<String>,
    matching: Option<Match>,
}

fn compile(field: &str, source: &str) -> Result<String, String> {
    if source.contains("authorizer") {
        return Err(format!(
            "{field}: this fake API server has no authorizer for CEL"
        ));
    }
    Program::compile(source)
        .map_err(|e| format!("{field}: Invalid value: compilation failed: {e}"))?;
    Ok(source.to_string())
}

impl Policy {
    pub(crate) fn parse(name: &str, obj: &Value) -> Result<Policy, String> {
        let spec = &obj["spec"];
        for unsupported in ["paramKind", "matchConditions"] {
            if spec.get(unsupported).is_some_and(|v| !v.is_null()) {
                return Err(format!(
                    "spec.{unsupported}: not supported by this fake API server"
                ));
            }
        }
        let variables = spec["variables"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, v)| {
                let name = v["name"]
                    .as_str()
                    .ok_or(format!("spec.variables[{i}].name: Required value"))?;
                let expression = v["expression"].as_str().unwrap_or_default();
                Ok((
                    name.to_string(),
                    compile(&format!("spec.variables[{i}].expression"), expression)?,
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        let validations = spec["validations"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, v)| {
                let text = |field: &str| v[field].as_str().map(str::to_string);
                let expression = compile(
                    &format!("spec.validations[{i}].expression"),
                    v["expression"].as_str().unwrap_or_default(),
                )?;
                let message_expression = match text("messageExpression") {
                    Some(m) => Some(compile(
                        &format!("spec.validations[{i}].messageExpression"),
                        &m,
                    )?),
                    None => None,
                };
                Ok(Validation {
                    expression,
                    message: text("message"),
                    message_expression,
                    reason: text("reason"),
                })
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Policy {
            name: name.to_string(),
            fail_closed: spec["failurePolicy"].as_str() != Some("Ignore"),
            constraints: Match::parse(&spec["matchConstraints"])?,
            variables,
            validations,
        })
    }
}

impl Binding {
    pub(crate) fn parse(name: &str, obj: &Value) -> Result<Binding, String> {
        let spec = &obj["spec"];
        let policy = spec["policyName"]
            .as_str()
            .ok_or("spec.policyName: Required value")?;
        if spec.get("paramRef").is_some_and(|v| !v.is_null()) {
            return Err("spec.paramRef: not supported by this fake API server".into());
        }
        let actions: Vec<String> = spec["validationActions"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string))
            .collect();
        if actions.is_empty()
            || actions
                .iter()
                .any(|a| !matches!(a.as_str(), "Deny" | "Warn" | "Audit"))
        {
            return Err(format!(
                "spec.validationActions: Unsupported value: {actions:?}"
            ));
        }
        let matching = match spec.get("matchResources") {
            Some(m) if !m.is_null() => Some(Match::parse(m)?),
            _ => None,
        };
        Ok(Binding {
            name: name.to_string(),
            policy: policy.to_string(),
            actions,
            matching,
        })
    }
}

/// A JSON value as CEL sees it: integers as `int`, objects as maps.
fn to_cel(value: &Value) -> cel::Value {
    match value {
        Value::Null => cel::Value::Null,
        Value::Bool(b) => cel::Value::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => cel::Value::Int(i),
            None => cel::Value::Float(n.as_f64().unwrap_or_default()),
        },
        Value::String(s) => cel::Value::String(Arc::new(s.clone())),
        Value::Array(items) => cel::Value::List(Arc::new(items.iter().map(to_cel).collect())),
        Value::Object(map) => {
            let map: HashMap<Key, cel::Value> = map
                .iter()
                .map(|(k, v)| (Key::String(Arc::new(k.clone())), to_cel(v)))
                .collect();
            cel::Value::Map(map.into())
        }
    }
}

fn run(source: &str, ctx: &cel::Context) -> Result<cel::Value, String> {
    let program = Program::compile(source).map_err(|e| e.to_string())?;
    program.execute(ctx).map_err(|e| e.to_string())
}

/// The `request` variable.
fn request(a: &Attributes) -> Value {
    let kind = json!({"group": "", "version": "v1", "kind": "Pod"});
    let resource = json!({"group": "", "version": "v1", "resource": "pods"});
    json!({"uid": "", "kind": kind, "resource": resource, "subResource": a.sub_resource,
           "requestKind": kind, "requestResource": resource, "requestSubResource": a.sub_resource,
           "name": a.name, "namespace": a.namespace, "operation": a.operation.as_str(),
           "userInfo": {"username": a.user.name, "groups": a.user.groups},
           "dryRun": a.dry_run, "options": a.options})
}

/// A failed validation: its message and reason.
struct Failure {
    message: String,
    reason: Option<String>,
}

fn evaluate(policy: &Policy, a: &Attributes, namespace: &Value) -> Result<Vec<Failure>, String> {
    let encoded = |pod: &Value| {
        let mut pod = pod.clone();
        super::defaults::encode(&mut pod);
        to_cel(&pod)
    };
    let mut ctx = cel::Context::default().with_all();
    ctx.add_variable_from_value("object", encoded(&a.object));
    ctx.add_variable_from_value(
        "oldObject",
        a.old_object.as_ref().map_or(cel::Value::Null, encoded),
    );
    ctx.add_variable_from_value("request", to_cel(&request(a)));
    ctx.add_variable_from_value("namespaceObject", to_cel(namespace));
    ctx.add_variable_from_value("params", cel::Value::Null);
    let mut variables: HashMap<Key, cel::Value> = HashMap::new();
    ctx.add_variable_from_value("variables", variables.clone());
    for (name, source) in &policy.variables {
        let value =
            run(source, &ctx).map_err(|e| format!("variable '{name}' resulted in error: {e}"))?;
        variables.insert(Key::String(Arc::new(name.clone())), value);
        ctx.add_variable_from_value("variables", variables.clone());
    }
    let mut failures = Vec::new();
    for v in &policy.validations {
        match run(&v.expression, &ctx) {
            Ok(cel::Value::Bool(true)) => continue,
            Ok(cel::Value::Bool(false)) => {}
            Ok(other) => {
                return Err(format!(
                    "expression '{}' resulted in error: expected a bool, got {other:?}",
                    v.expression
                ))
            }
            Err(e) => {
                return Err(format!(
                    "expression '{}' resulted in error: {e}",
                    v.expression
                ))
            }
        }
        let from_expression = v
            .message_expression
            .as_deref()
            .and_then(|m| match run(m, &ctx) {
                Ok(cel::Value::String(s)) if !s.trim().is_empty() => Some(s.to_string()),
                _ => None,
            });
        let message = from_expression
            .or_else(|| v.message.clone())
            .unwrap_or_else(|| format!("failed expression: {}", v.expression));
        failures.push(Failure {
            message,
            reason: v.reason.clone(),
        });
    }
    Ok(failures)
}

fn code(reason: &str) -> u16 {
    match reason {
        "Forbidden" => 403,
        "Unauthorized" => 401,
        "RequestEntityTooLarge" => 413,
        _ => 422,
    }
}

impl FakeKube {
    /// The registered ValidatingAdmissionPolicies' decision on an
    /// AdmissionReview's `request` for a pod, as the chain would reach it:
    /// `Ok` with the warnings, or the refusal's code and message. For
    /// tests that hold this CEL runtime to another one on the same cases.
    pub fn evaluate_policies(&self, request: &Value) -> Result<Vec<String>, (u16, String)> {
        let text = |field: &str| request[field].as_str().unwrap_or_default().to_string();
        let a = Attributes {
            operation: match request["operation"].as_str() {
                Some("UPDATE") => super::Operation::Update,
                _ => super::Operation::Create,
            },
            sub_resource: match request["subResource"].as_str() {
                Some("ephemeralcontainers") => "ephemeralcontainers",
                _ => "",
            },
            namespace: text("namespace"),
            name: text("name"),
            user: super::User {
                name: request["userInfo"]["username"]
                    .as_str()
                    .unwrap_or_default()
                    .into(),
                groups: vec![],
            },
            object: request["object"].clone(),
            old_object: Some(request["oldObject"].clone()).filter(|o| !o.is_null()),
            options: json!({}),
            dry_run: false,
        };
        let mut warnings = Vec::new();
        self.check_policies(&a, &mut warnings)
            .map(|()| warnings)
            .map_err(|r| (r.code, r.message))
    }

    /// Every bound policy that matches `a` (see the module doc).
    pub(super) fn check_policies(
        &self,
        a: &Attributes,
        warnings: &mut Vec<String>,
    ) -> Result<(), Rejection> {
        let bound = self.admission_registry().bound_policies();
        if bound.is_empty() {
            return Ok(());
        }
        let labels = self
            .namespace_labels(&a.namespace)
            .unwrap_or_else(|| json!({}));
        let namespace = self
            .stored_value(crate::Kind::Namespace, "", &a.namespace)
            .unwrap_or(Value::Null);
        for (binding, policy) in bound {
            let applies = policy
                .constraints
                .matches(a, &labels, false)
                .and_then(|ok| match (ok, &binding.matching) {
                    (false, _) => Ok(false),
                    (true, None) => Ok(true),
                    (true, Some(m)) => m.matches(a, &labels, true),
                })
                .map_err(|e| {
                    Rejection::internal(&format!(
                        "ValidatingAdmissionPolicy '{}': {e}",
                        policy.name
                    ))
                })?;
            if !applies {
                continue;
            }
            let sub = match a.sub_resource {
                "" => String::new(),
                sub => format!("/{sub}"),
            };
            self.admission_registry().record_call(format!(
                "ValidatingAdmissionPolicy {} {}{sub}",
                policy.name,
                a.operation.as_str()
            ));
            let denial = |message: &str, reason: &str| {
                let mut r = Rejection::forbidden(
                    "pods",
                    &a.display_name(),
                    &format!(
                        "ValidatingAdmissionPolicy '{}' with binding '{}' denied request: {message}",
                        policy.name, binding.name
                    ),
                );
                r.code = code(reason);
                r.reason = reason.to_string();
                r
            };
            let failures = match evaluate(&policy, a, &namespace) {
                Ok(failures) => failures,
                Err(e) if policy.fail_closed => return Err(denial(&e, "Invalid")),
                Err(e) => {
                    tracing::warn!(policy = %policy.name, "{e}; failurePolicy Ignore");
                    continue;
                }
            };
            for failure in failures {
                if binding.actions.iter().any(|x| x == "Warn") {
                    warnings.push(format!(
                        "Validation failed for ValidatingAdmissionPolicy '{}' with binding '{}': {}",
                        policy.name, binding.name, failure.message
                    ));
                }
                if binding.actions.iter().any(|x| x == "Deny") {
                    return Err(denial(
                        &failure.message,
                        failure.reason.as_deref().unwrap_or("Invalid"),
                    ));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::Operation;
    use super::*;

    #[test]
    fn variables_see_earlier_variables_and_messages_fall_back() {
        let policy = Policy::parse(
            "p",
            &json!({"spec": {
                "variables": [{"name": "names", "expression": "object.spec.containers.map(c, c.name)"},
                              {"name": "upper", "expression": "variables.names.map(n, n.upperAscii())"}],
                "validations": [
                    {"expression": "!('APP' in variables.upper)", "messageExpression": "'no ' + variables.names[0]",
                     "reason": "Forbidden"},
                    {"expression": "size(variables.names) > 5"},
                    {"expression": "true"}]}}),
        )
        .unwrap();
        let a = Attributes::for_test(
            Operation::Create,
            json!({"spec": {"containers": [{"name": "app"}]}}),
        );
        let failures = evaluate(&policy, &a, &Value::Null).unwrap();
        let texts: Vec<&str> = failures.iter().map(|f| f.message.as_str()).collect();
        assert_eq!(
            texts,
            ["no app", "failed expression: size(variables.names) > 5"]
        );
        assert_eq!(failures[0].reason.as_deref(), Some("Forbidden"));
    }

    #[test]
    fn what_does_not_compile_is_refused_at_registration() {
        let bad = json!({"spec": {"validations": [{"expression": "object.spec.("}]}});
        assert!(Policy::parse("p", &bad)
            .unwrap_err()
            .contains("compilation failed"));
    }
}
