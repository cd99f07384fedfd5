//! Whether a webhook or a policy applies to a pod request: its rules, its
//! `namespaceSelector` and its `objectSelector`, as
//! `k8s.io/apiserver/pkg/admission/plugin/webhook/predicates/` decides
//! (`rules/rules.go`, `namespace/matcher.go`, `object/matcher.go`; the same
//! predicates serve ValidatingAdmissionPolicy's `matchResources`).

use serde_json::Value;

use super::Attributes;

/// One `rules[]` / `resourceRules[]` entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Rule {
    operations: Vec<String>,
    api_groups: Vec<String>,
    api_versions: Vec<String>,
    resources: Vec<String>,
    scope: String,
}

impl Rule {
    pub(crate) fn parse(value: &Value) -> Result<Rule, String> {
        let list = |field: &str| -> Vec<String> {
            value[field]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        };
        let rule = Rule {
            operations: list("operations"),
            api_groups: list("apiGroups"),
            api_versions: list("apiVersions"),
            resources: list("resources"),
            scope: value["scope"].as_str().unwrap_or("*").to_string(),
        };
        if rule.operations.is_empty() || rule.resources.is_empty() {
            return Err("a rule needs operations and resources".into());
        }
        Ok(rule)
    }

    /// `rules.Matcher.Matches` for a core/v1 pod request: operation, group
    /// `""`, version `v1`, resource and subresource (`pods` matches no
    /// subresource, `pods/ephemeralcontainers` only that one, `pods/*` both,
    /// `*` every resource without a subresource), and scope.
    pub(crate) fn matches(&self, a: &Attributes) -> bool {
        let any = |list: &[String], want: &str| list.iter().any(|v| v == "*" || v == want);
        let resource = self.resources.iter().any(|r| {
            let (res, sub) = r.split_once('/').unwrap_or((r.as_str(), ""));
            (res == "*" || res == "pods") && (sub == "*" || sub == a.sub_resource)
        });
        let scope = match self.scope.as_str() {
            "Cluster" => a.namespace.is_empty(),
            "Namespaced" => !a.namespace.is_empty(),
            _ => true,
        };
        any(&self.operations, a.operation.as_str())
            && any(&self.api_groups, "")
            && any(&self.api_versions, "v1")
            && resource
            && scope
    }
}

/// A `metav1.LabelSelector` against `labels` (a JSON object): every
/// `matchLabels` pair and every `matchExpressions` requirement. An absent
/// or empty selector matches everything.
pub(crate) fn selector_matches(selector: &Value, labels: &Value) -> Result<bool, String> {
    let label = |key: &str| labels.get(key).and_then(Value::as_str);
    if let Some(want) = selector.get("matchLabels").and_then(Value::as_object) {
        for (key, value) in want {
            if label(key) != value.as_str() {
                return Ok(false);
            }
        }
    }
    let expressions = selector.get("matchExpressions").and_then(Value::as_array);
    for e in expressions.into_iter().flatten() {
        let key = e["key"].as_str().ok_or("a matchExpression needs a key")?;
        let values: Vec<&str> = e["values"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        let ok = match e["operator"].as_str() {
            Some("In") => label(key).is_some_and(|v| values.contains(&v)),
            Some("NotIn") => label(key).is_none_or(|v| !values.contains(&v)),
            Some("Exists") => label(key).is_some(),
            Some("DoesNotExist") => label(key).is_none(),
            other => return Err(format!("unknown selector operator {other:?}")),
        };
        if !ok {
            return Ok(false);
        }
    }
    Ok(true)
}

/// `object.Matcher`: the selector matches when either the object's or the
/// old object's labels match.
pub(crate) fn object_matches(selector: &Value, a: &Attributes) -> Result<bool, String> {
    let labels = |obj: &Value| {
        obj.pointer("/metadata/labels")
            .cloned()
            .unwrap_or(Value::Null)
    };
    if selector_matches(selector, &labels(&a.object))? {
        return Ok(true);
    }
    match &a.old_object {
        Some(old) => selector_matches(selector, &labels(old)),
        None => Ok(false),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Operation;
    use super::*;
    use serde_json::json;

    #[test]
    fn subresources_match_as_rules_go_splits_them() {
        let rule = |resources: Value| {
            Rule::parse(
                &json!({"operations": ["UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                                "resources": resources}),
            )
            .unwrap()
        };
        let mut a = Attributes::for_test(Operation::Update, json!({}));
        assert!(rule(json!(["pods"])).matches(&a));
        assert!(rule(json!(["*"])).matches(&a));
        a.sub_resource = "ephemeralcontainers";
        assert!(!rule(json!(["pods"])).matches(&a));
        assert!(!rule(json!(["*"])).matches(&a));
        assert!(rule(json!(["pods/ephemeralcontainers"])).matches(&a));
        assert!(rule(json!(["pods/*"])).matches(&a));
        a.operation = Operation::Create;
        assert!(!rule(json!(["pods/*"])).matches(&a));
    }

    #[test]
    fn selectors() {
        let labels = json!({"a": "1", "b": "2"});
        for (selector, want) in [
            (json!({}), true),
            (Value::Null, true),
            (json!({"matchLabels": {"a": "1"}}), true),
            (json!({"matchLabels": {"a": "2"}}), false),
            (
                json!({"matchExpressions": [{"key": "c", "operator": "NotIn", "values": ["x"]}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "b", "operator": "In", "values": ["1", "2"]}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "b", "operator": "DoesNotExist"}]}),
                false,
            ),
        ] {
            assert_eq!(selector_matches(&selector, &labels), Ok(want), "{selector}");
        }
    }
}
