//! A [`PolicyInput`] as Cedar sees it: the request (principal, action,
//! resource, context) and the entities it names, built per decision.
//!
//! Entity ids: `ServiceAccount::"NS/NAME"` in `Namespace::"NS"`,
//! `Pod::"NS/NAME"`, `CloudIdentity::"CLOUD/ACCOUNT/ID"`; labels are tags
//! and a ServiceAccount's annotations are the tags of its `Annotations`
//! entity. `docs/policy.md` documents the model; `policies/schema.cedarschema`
//! is its definition.

use std::time::UNIX_EPOCH;

use cedar_policy::{
    Context, Entities, Entity, EntityId, EntityTypeName, EntityUid, Request, RestrictedExpression,
};

use super::PolicyInput;
use crate::cloud::{Identity, Kind};
use crate::directory::Metadata;

/// Why an input could not be turned into a Cedar request (a defect of the
/// mapping, which the tests exercise; the caller fails closed on it).
#[derive(Debug, thiserror::Error)]
#[error("policy request could not be built: {0}")]
pub struct MappingError(String);

fn uid(kind: &str, id: &str) -> Result<EntityUid, MappingError> {
    let name: EntityTypeName = kind
        .parse()
        .map_err(|e| MappingError(format!("entity type {kind}: {e}")))?;
    Ok(EntityUid::from_type_name_and_id(name, EntityId::new(id)))
}

fn string(s: &str) -> RestrictedExpression {
    RestrictedExpression::new_string(s.to_string())
}

fn tags(map: &Metadata) -> impl Iterator<Item = (String, RestrictedExpression)> + '_ {
    map.iter().map(|(k, v)| (k.to_string(), string(v)))
}

/// The action a request kind is (`None` for identity lookups, which are
/// not decided).
pub fn action_name(kind: Kind) -> Option<&'static str> {
    match kind {
        Kind::AccessToken => Some("access_token"),
        Kind::IdToken => Some("id_token"),
        Kind::AwsCredentials => Some("aws_credentials"),
        Kind::Identity => None,
    }
}

/// The id of an identity's `CloudIdentity` entity: `CLOUD/ACCOUNT/ID`.
pub fn resource_id(identity: &Identity) -> String {
    format!(
        "{}/{}/{}",
        identity.cloud.name(),
        identity.account,
        identity.id
    )
}

/// The Cedar request and entities for `input` in `cluster`.
pub fn request(
    input: &PolicyInput<'_>,
    cluster: &str,
) -> Result<(Request, Entities), MappingError> {
    Ok((cedar_request(input, cluster)?, entities(input)?))
}

/// The uids a request names: principal, pod, resource.
struct Uids {
    principal: EntityUid,
    pod: EntityUid,
    resource: EntityUid,
}

impl Uids {
    fn of(input: &PolicyInput<'_>) -> Result<Uids, MappingError> {
        let caller = input.caller;
        let ns = caller.namespace.as_str();
        let pod_name = caller.pod.as_ref().map_or("", |p| p.name.as_str());
        let identity = input.identity;
        Ok(Uids {
            principal: uid(
                "ServiceAccount",
                &format!("{ns}/{}", caller.service_account),
            )?,
            pod: uid("Pod", &format!("{ns}/{pod_name}"))?,
            resource: uid("CloudIdentity", &resource_id(identity))?,
        })
    }
}

/// The entities `input` names: its ServiceAccount, namespace, annotations,
/// pod and cloud identity, and the schema's actions. They depend only on
/// who asks for which identity, not on what is asked, so a decision may
/// reuse them.
pub fn entities(input: &PolicyInput<'_>) -> Result<Entities, MappingError> {
    let caller = input.caller;
    let ns = caller.namespace.as_str();
    let sa_key = format!("{ns}/{}", caller.service_account);
    let attributes = input.attributes;

    let namespace = uid("Namespace", ns)?;
    let annotations = uid("Annotations", &sa_key)?;
    let principal = uid("ServiceAccount", &sa_key)?;
    let pod_name = caller.pod.as_ref().map_or("", |p| p.name.as_str());
    let pod_uid = caller.pod.as_ref().map_or("", |p| p.uid.as_str());
    let node = caller.node.as_ref().map_or("", |n| n.name.as_str());
    let pod = uid("Pod", &format!("{ns}/{pod_name}"))?;
    let identity = input.identity;
    let resource = uid("CloudIdentity", &resource_id(identity))?;

    let bad = |e: cedar_policy::EntityAttrEvaluationError| MappingError(e.to_string());
    let mut identity_attrs = vec![
        ("cloud".to_string(), string(identity.cloud.name())),
        ("id".to_string(), string(&identity.id)),
        ("account".to_string(), string(&identity.account)),
        ("source".to_string(), string(identity.source.as_str())),
    ];
    if let Some(number) = &identity.account_number {
        identity_attrs.push(("account_number".to_string(), string(number)));
    }
    if let Some(via) = &identity.via {
        let record = RestrictedExpression::new_record([
            ("id".to_string(), string(&via.id)),
            ("account".to_string(), string(&via.account)),
            (
                "session_tags".to_string(),
                RestrictedExpression::new_bool(via.session_tags),
            ),
            (
                "session_policy".to_string(),
                RestrictedExpression::new_bool(via.session_policy),
            ),
        ])
        .map_err(|e| MappingError(e.to_string()))?;
        identity_attrs.push(("via".to_string(), record));
    }
    let entities = [
        Entity::new_with_tags(
            namespace.clone(),
            [("name".to_string(), string(ns))],
            [],
            tags(&attributes.namespace_labels),
        )
        .map_err(bad)?,
        Entity::new_with_tags(
            annotations.clone(),
            [],
            [],
            tags(&attributes.service_account_annotations),
        )
        .map_err(bad)?,
        Entity::new_with_tags(
            principal.clone(),
            [
                ("name".to_string(), string(&caller.service_account)),
                (
                    "namespace".to_string(),
                    RestrictedExpression::new_entity_uid(namespace.clone()),
                ),
                (
                    "annotations".to_string(),
                    RestrictedExpression::new_entity_uid(annotations),
                ),
            ],
            [namespace],
            tags(&attributes.service_account_labels),
        )
        .map_err(bad)?,
        Entity::new_with_tags(
            pod.clone(),
            [
                ("name".to_string(), string(pod_name)),
                ("uid".to_string(), string(pod_uid)),
                ("node".to_string(), string(node)),
            ],
            [],
            tags(&attributes.pod_labels),
        )
        .map_err(bad)?,
        Entity::new_with_tags(resource.clone(), identity_attrs, [], []).map_err(bad)?,
    ];
    let actions = super::schema::actions().iter().cloned();
    let entities = Entities::from_entities(actions.chain(entities), None)
        .map_err(|e| MappingError(e.to_string()))?;
    Ok(entities)
}

/// The Cedar request for `input` in `cluster`: principal, action,
/// resource, context.
pub fn cedar_request(input: &PolicyInput<'_>, cluster: &str) -> Result<Request, MappingError> {
    let Uids {
        principal,
        pod,
        resource,
    } = Uids::of(input)?;
    let action = uid(
        "Action",
        action_name(input.request.kind)
            .ok_or_else(|| MappingError("identity lookups are not decided".into()))?,
    )?;
    let node = input.caller.node.as_ref().map_or("", |n| n.name.as_str());
    let request = input.request;
    let time = input
        .time
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut context = vec![
        ("pod".to_string(), RestrictedExpression::new_entity_uid(pod)),
        (
            "scopes".to_string(),
            RestrictedExpression::new_set(request.scopes.iter().map(|s| string(s))),
        ),
        ("surface".to_string(), string(request.surface.name())),
        ("node".to_string(), string(node)),
        ("cluster".to_string(), string(cluster)),
        (
            "time".to_string(),
            RestrictedExpression::new_long(i64::try_from(time).unwrap_or(i64::MAX)),
        ),
    ];
    if let Some(audience) = &request.audience {
        context.push(("audience".to_string(), string(audience)));
    }
    if let Some(lifetime) = input.lifetime {
        let seconds = i64::try_from(lifetime.as_secs()).unwrap_or(i64::MAX);
        context.push((
            "lifetime".to_string(),
            RestrictedExpression::new_long(seconds),
        ));
    }
    let context = Context::from_pairs(context).map_err(|e| MappingError(e.to_string()))?;
    Request::new(principal, action, resource, context, None)
        .map_err(|e| MappingError(e.to_string()))
}
