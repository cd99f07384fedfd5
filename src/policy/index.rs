//! Which policies a decision evaluates. Cedar evaluates every policy of the
//! set it is given, and a set of a thousand per-team or per-job permits
//! costs a thousand evaluations (about 1.5 ms, bench/policy) when only a
//! handful can apply. A policy whose scope names a namespace
//! (`principal in Namespace::"N"`, `principal == ServiceAccount::"N/…"`)
//! can only apply to callers in N, and one whose scope names an identity
//! (`resource == CloudIdentity::"…"`) only to requests for it; so the set
//! is split once, at load, by both, and a decision gets the slice for its
//! caller's namespace and its identity.

use std::collections::HashMap;
use std::sync::Arc;

use cedar_policy::{Policy, PolicySet};

/// Most policies the per-identity slices of one namespace may hold in all
/// (each slice repeats the namespace's unscoped policies); a namespace over
/// it is not split by identity, which costs speed, never correctness.
const MAX_SLICED: usize = 200_000;

/// The policies that can apply to a request, by its caller's namespace and
/// the identity asked for.
// INVARIANT: a ServiceAccount's only ancestor is its namespace, and a
// CloudIdentity has none (the entity mapping makes it so): that is what
// makes `in` and `==` on them exact scopes.
#[derive(Debug, Clone, Default)]
pub struct Index {
    /// For callers of a namespace no policy's scope names.
    pub general: Slices,
    /// For a namespace some policy's scope names.
    pub by_namespace: HashMap<String, Slices>,
}

/// One namespace's policies (or the general ones), split by identity.
#[derive(Debug, Clone, Default)]
pub struct Slices {
    /// Those whose scope names no identity; every slice below holds them
    /// too. Alone, the answer for an identity no policy's scope names.
    pub unscoped: Arc<PolicySet>,
    /// For an identity (`CloudIdentity` id) some policy's scope names.
    pub by_identity: HashMap<String, Arc<PolicySet>>,
    /// All of them, unsplit, where splitting would pass [`MAX_SLICED`].
    pub unsplit: Option<Arc<PolicySet>>,
}

impl Slices {
    fn get(&self, identity: &str) -> &PolicySet {
        if let Some(all) = &self.unsplit {
            return all;
        }
        self.by_identity.get(identity).unwrap_or(&self.unscoped)
    }
}

/// A policy's place in the index: the namespace and the identity its
/// scope confines it to.
type Place = (Option<String>, Option<String>);

impl Index {
    /// The policies to evaluate for a caller in `namespace` asking for the
    /// identity whose `CloudIdentity` id is `identity`.
    pub fn for_request(&self, namespace: &str, identity: &str) -> &PolicySet {
        self.by_namespace
            .get(namespace)
            .unwrap_or(&self.general)
            .get(identity)
    }

    /// Splits `set`.
    pub fn build(set: &PolicySet) -> Result<Index, String> {
        let placed: Vec<(Place, &Policy)> = set
            .policies()
            .map(|p| ((scope_namespace(p), scope_identity(p)), p))
            .collect();
        let general = slices(placed.iter().filter(|((ns, _), _)| ns.is_none()))?;
        let mut namespaces: Vec<&String> = placed
            .iter()
            .filter_map(|((ns, _), _)| ns.as_ref())
            .collect();
        namespaces.sort();
        namespaces.dedup();
        let mut by_namespace = HashMap::with_capacity(namespaces.len());
        for ns in namespaces {
            let own = placed
                .iter()
                .filter(|((n, _), _)| n.is_none() || n.as_ref() == Some(ns));
            by_namespace.insert(ns.clone(), slices(own)?);
        }
        Ok(Index {
            general,
            by_namespace,
        })
    }
}

/// `policies` split by the identity their scope names.
fn slices<'a>(
    policies: impl Iterator<Item = &'a (Place, &'a Policy)> + Clone,
) -> Result<Slices, String> {
    let add = |set: &mut PolicySet, p: &Policy| set.add(p.clone()).map_err(|e| e.to_string());
    let mut unscoped = PolicySet::new();
    let mut scoped: HashMap<&str, Vec<&Policy>> = HashMap::new();
    for ((_, identity), policy) in policies.clone() {
        match identity {
            Some(id) => scoped.entry(id.as_str()).or_default().push(policy),
            None => add(&mut unscoped, policy)?,
        }
    }
    let unscoped_count = unscoped.policies().count();
    let total: usize = scoped.values().map(|p| unscoped_count + p.len()).sum();
    if total > MAX_SLICED {
        let mut all = PolicySet::new();
        for (_, policy) in policies {
            add(&mut all, policy)?;
        }
        return Ok(Slices {
            unsplit: Some(Arc::new(all)),
            ..Slices::default()
        });
    }
    let mut by_identity = HashMap::with_capacity(scoped.len());
    for (id, own) in scoped {
        let mut slice = unscoped.clone();
        for policy in own {
            add(&mut slice, policy)?;
        }
        by_identity.insert(id.to_string(), Arc::new(slice));
    }
    Ok(Slices {
        unscoped: Arc::new(unscoped),
        by_identity,
        unsplit: None,
    })
}

/// The namespace a policy's principal scope confines it to, if any.
fn scope_namespace(policy: &Policy) -> Option<String> {
    use cedar_policy::PrincipalConstraint as P;
    let uid = match policy.principal_constraint() {
        P::In(uid) | P::Eq(uid) | P::IsIn(_, uid) => uid,
        P::Any | P::Is(_) => return None,
    };
    let id = uid.id().unescaped();
    match uid.type_name().to_string().as_str() {
        "Namespace" => Some(id.to_string()),
        "ServiceAccount" => id.split_once('/').map(|(ns, _)| ns.to_string()),
        _ => None,
    }
}

/// The identity a policy's resource scope confines it to, if any: the id
/// of `CloudIdentity::"CLOUD/ACCOUNT/ID"` after `==` or `in`.
fn scope_identity(policy: &Policy) -> Option<String> {
    use cedar_policy::ResourceConstraint as R;
    let uid = match policy.resource_constraint() {
        R::In(uid) | R::Eq(uid) | R::IsIn(_, uid) => uid,
        R::Any | R::Is(_) => return None,
    };
    (uid.type_name().to_string() == "CloudIdentity").then(|| uid.id().unescaped().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index(text: &str) -> Index {
        Index::build(&text.parse::<PolicySet>().unwrap()).unwrap()
    }

    fn ids(set: &PolicySet) -> Vec<String> {
        let mut ids: Vec<String> = set
            .policies()
            .filter_map(|p| p.annotation("id").map(str::to_string))
            .collect();
        ids.sort();
        ids
    }

    const SET: &str = r#"
        @id("all") permit (principal, action, resource);
        @id("ns-a") permit (principal in Namespace::"a", action, resource);
        @id("sa-a") permit (principal == ServiceAccount::"a/w", action, resource);
        @id("x-anywhere") forbid (principal, action, resource == CloudIdentity::"aws/1/x");
        @id("x-in-a") permit (principal == ServiceAccount::"a/w", action, resource == CloudIdentity::"aws/1/x");
        @id("y-in-b") permit (principal in Namespace::"b", action, resource == CloudIdentity::"aws/1/y");
    "#;

    #[test]
    fn each_request_gets_every_policy_that_can_apply_and_no_other() {
        let index = index(SET);
        assert_eq!(
            ids(index.for_request("a", "aws/1/x")),
            ["all", "ns-a", "sa-a", "x-anywhere", "x-in-a"]
        );
        assert_eq!(
            ids(index.for_request("a", "aws/1/y")),
            ["all", "ns-a", "sa-a"]
        );
        assert_eq!(ids(index.for_request("b", "aws/1/y")), ["all", "y-in-b"]);
        assert_eq!(
            ids(index.for_request("b", "aws/1/x")),
            ["all", "x-anywhere"]
        );
        assert_eq!(
            ids(index.for_request("c", "aws/1/x")),
            ["all", "x-anywhere"]
        );
        assert_eq!(ids(index.for_request("c", "aws/1/z")), ["all"]);
    }

    #[test]
    fn a_slice_past_the_bound_is_left_whole() {
        let mut text = String::from("@id(\"all\") permit (principal, action, resource);\n");
        let n = MAX_SLICED / 2 + 1;
        for i in 0..n {
            text.push_str(&format!(
                "@id(\"p{i}\") permit (principal, action, resource == CloudIdentity::\"aws/1/r{i}\");\n"
            ));
        }
        let index = index(&text);
        assert!(index.general.unsplit.is_some());
        assert_eq!(index.for_request("a", "aws/1/r0").policies().count(), n + 1);
    }
}
