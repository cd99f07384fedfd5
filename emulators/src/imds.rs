//! The managed-identity endpoint of a node's Azure Instance Metadata
//! Service, for the user-assigned identities assigned to the node pool (the
//! VM scale set): `GET /metadata/identity/oauth2/token?api-version=…
//! &resource=…[&client_id=…|&object_id=…|&msi_res_id=…]` with `Metadata:
//! true`, answered from the Entra emulator ([`Entra::imds_token`]) without
//! any assertion: a token the identity gets this way is one Entra accepts
//! as an app's federated credential.
//!
//! What it enforces, each with its source:
//! - `Metadata: true`, in lower case, else 400 `invalid_request` "Required
//!   metadata header not specified" (the IMDS FAQ quotes the 400 and the
//!   text, and "How to use managed identities … to acquire an access token"
//!   says the value must be `true` in all lower case; the `error` value is
//!   what aad-pod-identity, Microsoft's IMDS stand-in, answers:
//!   `pkg/nmi/server/server.go`);
//! - `X-Forwarded-For` refused, 400 (the IMDS page, "Security and
//!   authentication": requests must not contain it; the text and status
//!   are the emulator's own, no public capture shows them);
//! - `resource` required: 400 `invalid_request` "Required query variable
//!   'resource' is missing" (captured from IMDS in aad-pod-identity pull
//!   request #450); `api-version` required (the identity endpoint's text is
//!   not published; this one is aad-pod-identity's and DataDog/attache's);
//! - a selector naming no identity on the node, or no selector and none on
//!   it: 400 `invalid_request` "Identity not found" (MicrosoftDocs/azure-docs
//!   issue #21322, a VM without the identity);
//! - no selector with more than one user-assigned identity on the node: 400
//!   `{"error":"invalid_request","error_description":"Multiple user
//!   assigned identities exist, please specify the clientId / resourceId of
//!   the identity in the token request"}` (captured in
//!   Hexadite/acs-keyvault-agent pull request #43; azure-sdk-for-rust pull
//!   request #748, from an AKS node pool with two identities); with exactly
//!   one, that one (the managed identities FAQ);
//! - the answer: every field a string (`access_token`, `client_id`,
//!   `expires_in`, `expires_on`, `ext_expires_in`, `not_before`,
//!   `resource`, `token_type`), as captured replies show (the documented
//!   sample also has an empty `refresh_token` and no `client_id`).
//!
//! `client_id` and `object_id` select (the identity's principal id, as
//! Entra's emulator derives it); `msi_res_id` names nothing the emulator
//! models (no ARM resource ids) and is answered "Identity not found".

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;

use crate::entra::Entra;

/// The node's IMDS, serving the identities `entra` has assigned to the
/// node ([`Entra::node_identities`]).
pub fn router(entra: Arc<Entra>) -> Router {
    Router::new()
        .route("/metadata/identity/oauth2/token", get(token))
        .with_state(entra)
}

fn bad(description: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": "invalid_request", "error_description": description})),
    )
        .into_response()
}

async fn token(
    State(entra): State<Arc<Entra>>,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if headers.contains_key("x-forwarded-for") {
        return bad("Request with X-Forwarded-For header is not allowed");
    }
    let metadata = headers
        .get("metadata")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v == "true");
    if !metadata {
        return bad("Required metadata header not specified");
    }
    if query.get("api-version").is_none_or(|v| v.is_empty()) {
        return bad("Required query variable 'api-version' is missing");
    }
    let Some(resource) = query.get("resource").filter(|r| !r.is_empty()) else {
        return bad("Required query variable 'resource' is missing");
    };
    let client_id = match (
        query.get("client_id"),
        query.get("object_id"),
        query.get("msi_res_id"),
    ) {
        (Some(id), None, None) => id.clone(),
        (None, Some(object_id), None) => match entra
            .node_identities()
            .find(|a| a.object_id().eq_ignore_ascii_case(object_id))
        {
            Some(identity) => identity.client_id.clone(),
            None => return bad("Identity not found"),
        },
        (None, None, None) => {
            let mut on_node = entra.node_identities();
            match (on_node.next(), on_node.next()) {
                (Some(only), None) => only.client_id.clone(),
                (Some(_), Some(_)) => return bad("Multiple user assigned identities exist, please specify the clientId / resourceId of the identity in the token request"),
                (None, _) => return bad("Identity not found"),
            }
        }
        _ => return bad("Identity not found"),
    };
    let Some(issued) = entra.imds_token(&client_id, resource) else {
        return bad("Identity not found");
    };
    let now = jsonwebtoken::get_current_timestamp();
    Json(json!({
        "access_token": issued.access_token,
        "client_id": client_id,
        "expires_in": issued.expires_in.to_string(),
        "expires_on": (now + issued.expires_in).to_string(),
        "ext_expires_in": issued.expires_in.to_string(),
        "not_before": now.to_string(),
        "resource": resource,
        "token_type": "Bearer",
    }))
    .into_response()
}
