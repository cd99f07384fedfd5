//! Pod writes through admission, as kube-apiserver runs it.
//!
//! Why: a webhook is judged by the pod the API server finally stores, and
//! that pod is not the one the webhook returned. kube-apiserver defaults
//! the object, runs its built-in plugins, calls the mutating webhooks in
//! order, and when one of them changed the pod runs the whole mutating
//! chain once more, built-in plugins included, so that the ServiceAccount
//! plugin mounts the API token into containers a webhook added, and
//! `IfNeeded` webhooks see what later webhooks did. Only then do the
//! ValidatingAdmissionPolicies and validating webhooks judge it. A fake
//! that stores what the webhook returned hides every defect of that kind;
//! this one runs the chain.
//!
//! The chain, for `POST pods`, `PUT`/`PATCH pods/NAME` and
//! `pods/NAME/ephemeralcontainers` (`writes.rs`), each step citing the
//! kube-apiserver source it follows:
//!
//! 1. decode with defaults ([`defaults`]), after the patch for a PATCH
//!    (`k8s.io/apiserver/pkg/endpoints/handlers/{create,update,patch}.go`);
//!    NamespaceLifecycle refuses a pod in a namespace that does not exist;
//! 2. the built-in mutating plugins ([`in_tree`]): ServiceAccount, Priority,
//!    DefaultTolerationSeconds;
//! 3. the mutating webhooks of the registered
//!    MutatingWebhookConfigurations, sorted by configuration name, webhooks
//!    in their listed order, each called over HTTPS when its rules,
//!    `namespaceSelector` and `objectSelector` match ([`matching`],
//!    [`webhooks`]), the object defaulted again after each patch;
//! 4. when a webhook changed the pod, steps 2 and 3 once more
//!    (`k8s.io/apiserver/pkg/admission/reinvocation.go`: "Calling admit a
//!    second time will reinvoke all in-tree plugins as well as any webhook
//!    plugins that need to be reinvoked based on the reinvocation policy"),
//!    calling again only the `reinvocationPolicy: IfNeeded` webhooks that
//!    ran before a later change ([`webhooks::Reinvocation`]);
//! 5. the registry's own rules ([`pod_rules`]): name generation, uid,
//!    status, `ValidatePodCreate`/`ValidatePodUpdate`/ the ephemeral
//!    containers' update rules (`pkg/registry/core/pod/strategy.go`,
//!    `pkg/apis/core/validation/validation.go`);
//! 6. the ValidatingAdmissionPolicies with their bindings ([`policy`]),
//!    CEL evaluated by the `cel` crate with Kubernetes' CEL libraries
//!    (`kube-cel`), then the validating webhooks, on the final object;
//! 7. storage.
//!
//! Refusals carry the API server's own texts (`Rejection`), so a client
//! such as kubectl shows what it would show against a real cluster.

pub(crate) mod defaults;
pub(crate) mod in_tree;
mod matching;
mod patches;
mod pod_rules;
mod policy;
mod registry;
mod webhooks;
mod writes;

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::Response;
use serde_json::{json, Value};

use crate::responses::json_response;
use crate::FakeKube;

pub(crate) use registry::Registry;

/// Who makes a request, as the authenticator names them; webhooks and
/// policies see it in `userInfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// `userInfo.username`.
    pub name: String,
    /// `userInfo.groups`.
    pub groups: Vec<String>,
}

/// The admission operation of a pod write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Operation {
    Create,
    Update,
}

impl Operation {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Operation::Create => "CREATE",
            Operation::Update => "UPDATE",
        }
    }
}

/// What admission sees of one request (`admission.Attributes`).
#[derive(Debug, Clone)]
pub(crate) struct Attributes {
    pub(crate) operation: Operation,
    /// `""` or `"ephemeralcontainers"`.
    pub(crate) sub_resource: &'static str,
    pub(crate) namespace: String,
    /// Empty on a CREATE with `generateName` (the name is generated after
    /// mutating admission).
    pub(crate) name: String,
    pub(crate) user: User,
    /// The pod being admitted, as JSON.
    pub(crate) object: Value,
    /// The stored pod an UPDATE replaces.
    pub(crate) old_object: Option<Value>,
    /// `CreateOptions` or `UpdateOptions`, as webhooks receive them.
    pub(crate) options: Value,
    /// `dryRun=All`.
    pub(crate) dry_run: bool,
}

impl Attributes {
    /// The name a refusal gives: the pod's name, else its `generateName`,
    /// else `Unknown` (`k8s.io/apiserver/pkg/admission/errors.go`).
    pub(crate) fn display_name(&self) -> String {
        let meta = |field: &str| {
            self.object
                .pointer(&format!("/metadata/{field}"))
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
        };
        Some(self.name.clone())
            .filter(|n| !n.is_empty())
            .or_else(|| meta("name"))
            .or_else(|| meta("generateName"))
            .unwrap_or_else(|| "Unknown".into())
    }

    #[cfg(test)]
    pub(crate) fn for_test(operation: Operation, object: Value) -> Attributes {
        Attributes {
            operation,
            sub_resource: "",
            namespace: "ns".into(),
            name: "p".into(),
            user: User {
                name: "test".into(),
                groups: vec![],
            },
            object,
            old_object: None,
            options: json!({}),
            dry_run: false,
        }
    }
}

/// A refused request, as the Status the API server answers with.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rejection {
    pub(crate) code: u16,
    pub(crate) reason: String,
    pub(crate) message: String,
    /// The Status's `details` (null: none).
    pub(crate) details: Box<Value>,
}

impl Rejection {
    /// `admission.NewForbidden`: `RESOURCE "NAME" is forbidden: MESSAGE`.
    pub(crate) fn forbidden(resource: &str, name: &str, message: &str) -> Rejection {
        Rejection {
            code: 403,
            reason: "Forbidden".into(),
            message: format!("{resource} \"{name}\" is forbidden: {message}"),
            details: Box::new(json!({"name": name, "kind": resource})),
        }
    }

    /// `apierrors.NewInternalError`.
    pub(crate) fn internal(message: &str) -> Rejection {
        Rejection {
            code: 500,
            reason: "InternalError".into(),
            message: format!("Internal error occurred: {message}"),
            details: Box::new(json!({"causes": [{"message": message}]})),
        }
    }

    /// `apierrors.NewInvalid` for a Pod: `Pod "NAME" is invalid: CAUSES`.
    pub(crate) fn invalid(name: &str, causes: &[(String, String)]) -> Rejection {
        let listed: Vec<String> = causes.iter().map(|(f, m)| format!("{f}: {m}")).collect();
        let text = match listed.as_slice() {
            [one] => one.clone(),
            many => format!("[{}]", many.join(", ")),
        };
        let causes: Vec<Value> = causes
            .iter()
            .map(|(field, message)| json!({"field": field, "message": message}))
            .collect();
        Rejection {
            code: 422,
            reason: "Invalid".into(),
            message: format!("Pod \"{name}\" is invalid: {text}"),
            details: Box::new(json!({"name": name, "kind": "Pod", "causes": causes})),
        }
    }

    pub(crate) fn new(code: u16, reason: &str, message: String) -> Rejection {
        Rejection {
            code,
            reason: reason.into(),
            message,
            details: Box::default(),
        }
    }

    pub(crate) fn response(&self) -> Response {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code,
        });
        if !self.details.is_null() {
            body["details"] = (*self.details).clone();
        }
        json_response(code, &body)
    }
}

impl FakeKube {
    /// Steps 2 to 4 of the module doc: the built-in plugins and the
    /// mutating webhooks, with one reinvocation pass when a webhook changed
    /// the pod. Webhooks' warnings are appended to `warnings`.
    pub(crate) async fn mutating_admission(
        self: &Arc<Self>,
        a: &mut Attributes,
        warnings: &mut Vec<String>,
    ) -> Result<(), Rejection> {
        let mut reinvocation = webhooks::Reinvocation::default();
        in_tree::admit(self, a)?;
        self.call_mutating(a, &mut reinvocation, warnings).await?;
        if reinvocation.should_reinvoke() {
            reinvocation.start_reinvoke();
            in_tree::admit(self, a)?;
            self.call_mutating(a, &mut reinvocation, warnings).await?;
        }
        Ok(())
    }

    /// Step 6: the ValidatingAdmissionPolicies, then the validating
    /// webhooks (plugin order: ValidatingAdmissionPolicy before
    /// ValidatingAdmissionWebhook).
    pub(crate) async fn validating_admission(
        self: &Arc<Self>,
        a: &Attributes,
        warnings: &mut Vec<String>,
    ) -> Result<(), Rejection> {
        self.check_policies(a, warnings)?;
        self.call_validating(a, warnings).await
    }

    /// The labels of namespace `name` as selectors see them, with the
    /// `kubernetes.io/metadata.name` label the API server sets on every
    /// namespace (`SetDefaults_Namespace`); `None` when it does not exist.
    pub(crate) fn namespace_labels(&self, name: &str) -> Option<Value> {
        let ns = self.stored_value(crate::Kind::Namespace, "", name)?;
        let mut labels = ns
            .pointer("/metadata/labels")
            .cloned()
            .filter(Value::is_object)
            .unwrap_or_else(|| json!({}));
        labels["kubernetes.io/metadata.name"] = json!(name);
        Some(labels)
    }

    pub(crate) fn namespace_exists(&self, name: &str) -> bool {
        self.stored_value(crate::Kind::Namespace, "", name)
            .is_some()
    }
}
