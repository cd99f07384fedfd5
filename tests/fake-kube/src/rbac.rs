//! ClusterRoles and ClusterRoleBindings, and the answer RBAC's authorizer
//! gives from them, for components that ask the API server whether a
//! subject may do something (a SubjectAccessReview): AKS's identity-binding
//! proxy asks whether a pod's ServiceAccount may `use-managed-identity`
//! an identity, and the grant is the ClusterRole and ClusterRoleBinding
//! Microsoft Learn's "Identity bindings" how-to writes.
//!
//! The matching is kube-apiserver's (`pkg/apis/rbac/v1/evaluation_helpers.go`
//! and `plugin/pkg/auth/authorizer/rbac/rbac.go`; the rules are also in the
//! Kubernetes RBAC reference): a rule matches when its `verbs`,
//! `apiGroups` and `resources` each hold the asked value or `*`, and its
//! `resourceNames`, when present, hold the object's name; a binding's
//! subject matches a `User` by name, a `Group` by any of the user's groups
//! and a `ServiceAccount` by namespace and name; a ServiceAccount's user is
//! `system:serviceaccount:NS:NAME` in the groups `system:serviceaccounts`,
//! `system:serviceaccounts:NS` and `system:authenticated`. Only the
//! cluster scope is modelled (Learn's grant is a ClusterRoleBinding); the
//! API's own callers keep the fixed least-privilege model in `request.rs`.

use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, Subject};

use crate::User;

/// The RBAC objects the fake holds, by name.
#[derive(Debug, Default)]
pub(crate) struct Rbac {
    roles: std::collections::BTreeMap<String, ClusterRole>,
    bindings: std::collections::BTreeMap<String, ClusterRoleBinding>,
}

/// What is asked of the authorizer, at the cluster scope.
#[derive(Debug, Clone, Copy)]
pub struct Attributes<'a> {
    /// The verb (`get`, `use-managed-identity`, ...).
    pub verb: &'a str,
    /// The API group (`""` for the core group).
    pub api_group: &'a str,
    /// The resource.
    pub resource: &'a str,
    /// The object's name, if one is named.
    pub name: Option<&'a str>,
}

impl Rbac {
    pub(crate) fn apply_role(&mut self, role: ClusterRole) -> Result<ClusterRole, String> {
        let name = role
            .metadata
            .name
            .clone()
            .ok_or("metadata.name is required")?;
        self.roles.insert(name, role.clone());
        Ok(role)
    }

    pub(crate) fn apply_binding(
        &mut self,
        binding: ClusterRoleBinding,
    ) -> Result<ClusterRoleBinding, String> {
        let name = binding
            .metadata
            .name
            .clone()
            .ok_or("metadata.name is required")?;
        // kube-apiserver's validation: roleRef is ClusterRole in the RBAC
        // group for a ClusterRoleBinding.
        if binding.role_ref.kind != "ClusterRole"
            || binding.role_ref.api_group != "rbac.authorization.k8s.io"
        {
            return Err(
                "roleRef.kind: Unsupported value: must be ClusterRole in rbac.authorization.k8s.io"
                    .into(),
            );
        }
        self.bindings.insert(name, binding.clone());
        Ok(binding)
    }

    pub(crate) fn delete_role(&mut self, name: &str) -> bool {
        self.roles.remove(name).is_some()
    }

    pub(crate) fn delete_binding(&mut self, name: &str) -> bool {
        self.bindings.remove(name).is_some()
    }

    /// Whether some ClusterRoleBinding grants `user` what `attrs` asks.
    pub(crate) fn allows(&self, user: &User, attrs: &Attributes<'_>) -> bool {
        self.bindings
            .values()
            .filter(|b| {
                b.subjects
                    .iter()
                    .flatten()
                    .any(|s| subject_matches(s, user))
            })
            .filter_map(|b| self.roles.get(&b.role_ref.name))
            .flat_map(|role| role.rules.iter().flatten())
            .any(|rule| rule_allows(rule, attrs))
    }
}

/// The user a ServiceAccount authenticates as.
pub fn service_account_user(namespace: &str, name: &str) -> User {
    User {
        name: format!("system:serviceaccount:{namespace}:{name}"),
        groups: vec![
            "system:serviceaccounts".into(),
            format!("system:serviceaccounts:{namespace}"),
            "system:authenticated".into(),
        ],
    }
}

fn has(list: &[String], value: &str) -> bool {
    list.iter().any(|v| v == "*" || v == value)
}

fn rule_allows(rule: &PolicyRule, attrs: &Attributes<'_>) -> bool {
    let names = rule.resource_names.as_deref().unwrap_or_default();
    has(&rule.verbs, attrs.verb)
        && has(
            rule.api_groups.as_deref().unwrap_or_default(),
            attrs.api_group,
        )
        && has(
            rule.resources.as_deref().unwrap_or_default(),
            attrs.resource,
        )
        && (names.is_empty() || attrs.name.is_some_and(|n| names.iter().any(|v| v == n)))
}

fn subject_matches(subject: &Subject, user: &User) -> bool {
    match subject.kind.as_str() {
        "User" => subject.name == user.name,
        "Group" => user.groups.contains(&subject.name),
        "ServiceAccount" => subject
            .namespace
            .as_deref()
            .is_some_and(|ns| user.name == format!("system:serviceaccount:{ns}:{}", subject.name)),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Learn's grant for one identity and one ServiceAccount.
    fn learn_grant(rbac: &mut Rbac, client_id: &str, namespace: &str, name: &str) {
        rbac.apply_role(
            serde_json::from_value(json!({
                "metadata": {"name": format!("use-mi-{client_id}")},
                "rules": [{"verbs": ["use-managed-identity"], "apiGroups": ["cid.wi.aks.azure.com"],
                           "resources": [client_id]}]}))
            .unwrap(),
        )
        .unwrap();
        rbac.apply_binding(
            serde_json::from_value(json!({
                "metadata": {"name": format!("use-mi-{client_id}")},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": format!("use-mi-{client_id}")},
                "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]}))
            .unwrap(),
        )
        .unwrap();
    }

    fn use_identity(client_id: &str) -> Attributes<'_> {
        Attributes {
            verb: "use-managed-identity",
            api_group: "cid.wi.aks.azure.com",
            resource: client_id,
            name: None,
        }
    }

    #[test]
    fn learns_grant_lets_its_service_account_use_its_identity_and_nothing_else() {
        let mut rbac = Rbac::default();
        learn_grant(&mut rbac, "c1", "demo", "demo");
        let demo = service_account_user("demo", "demo");
        assert!(rbac.allows(&demo, &use_identity("c1")));
        assert!(!rbac.allows(&demo, &use_identity("c2")), "another identity");
        assert!(!rbac.allows(&service_account_user("demo", "other"), &use_identity("c1")));
        assert!(!rbac.allows(&service_account_user("other", "demo"), &use_identity("c1")));
        let get = Attributes {
            verb: "get",
            ..use_identity("c1")
        };
        assert!(!rbac.allows(&demo, &get), "another verb");
        // The binding without its role grants nothing.
        assert!(rbac.delete_role("use-mi-c1"));
        assert!(!rbac.allows(&demo, &use_identity("c1")));
    }

    #[test]
    fn groups_wildcards_and_resource_names_match_as_kube_apiservers_rules_do() {
        let mut rbac = Rbac::default();
        rbac.apply_role(
            serde_json::from_value(json!({"metadata": {"name": "any"},
                "rules": [{"verbs": ["*"], "apiGroups": ["cid.wi.aks.azure.com"], "resources": ["*"],
                           "resourceNames": ["only"]}]}))
            .unwrap(),
        )
        .unwrap();
        rbac.apply_binding(
            serde_json::from_value(json!({"metadata": {"name": "team"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "any"},
                "subjects": [{"kind": "Group", "name": "system:serviceaccounts:team",
                              "apiGroup": "rbac.authorization.k8s.io"}]}))
            .unwrap(),
        )
        .unwrap();
        let member = service_account_user("team", "x");
        let named = Attributes {
            name: Some("only"),
            ..use_identity("c1")
        };
        assert!(rbac.allows(&member, &named));
        assert!(
            !rbac.allows(&member, &use_identity("c1")),
            "resourceNames need a name"
        );
        assert!(!rbac.allows(&service_account_user("other", "x"), &named));
        // A binding to a Role is refused, as the API server validates it.
        let wrong: ClusterRoleBinding = serde_json::from_value(json!({"metadata": {"name": "w"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "any"}}))
        .unwrap();
        assert!(rbac.apply_binding(wrong).is_err());
    }
}
