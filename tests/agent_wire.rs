//! The agent API's wire format, frozen: sidecars are not replaced when the
//! agent DaemonSet rolls, so every agent must read what older sidecars
//! send and answer what they read, and every sidecar must read answers
//! that carry fields added after it. `tests/fixtures/agent-api/v1.json`
//! holds this version's requests, grants and errors; each must read into
//! this version's types and write back byte-for-value the same, and read
//! the same with a field added.

use lanyard::broker::wire::{self, ErrorBody, WireGrant};
use lanyard::broker::{BrokerError, Grant};
use lanyard::cloud::TokenRequest;
use serde_json::{json, Value};

fn fixtures() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/agent-api/v1.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn entries(name: &str) -> Vec<Value> {
    let all = fixtures()[name].as_array().unwrap().clone();
    assert!(all.len() >= 5, "{name}: {} entries", all.len());
    all
}

/// `value` with an unknown member added to it and to every object in it,
/// but a `selector`: a one-key map naming its kind, to which a new kind
/// is a new key, not an added field (agents roll first, so no agent reads
/// a selector kind newer than itself).
fn with_added_fields(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut out: serde_json::Map<String, Value> = map
                .iter()
                .map(|(k, v)| match k.as_str() {
                    "selector" => (k.clone(), v.clone()),
                    _ => (k.clone(), with_added_fields(v)),
                })
                .collect();
            out.insert("added_later".into(), json!({"n": 1}));
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(with_added_fields).collect()),
        other => other.clone(),
    }
}

#[test]
fn requests_older_sidecars_send_read_and_write_as_frozen() {
    for frozen in entries("requests") {
        let request: TokenRequest = serde_json::from_value(frozen.clone())
            .unwrap_or_else(|e| panic!("{frozen}: this agent cannot read it: {e}"));
        assert_eq!(
            serde_json::to_value(&request).unwrap(),
            frozen,
            "this sidecar writes it differently"
        );
        // A newer sidecar's request, with a field this agent does not know.
        let newer: TokenRequest = serde_json::from_value(with_added_fields(&frozen))
            .unwrap_or_else(|e| panic!("{frozen} with an added field: {e}"));
        assert_eq!(newer, request);
    }
}

#[test]
fn grants_read_and_write_as_frozen_and_tolerate_added_fields() {
    for frozen in entries("grants") {
        let wire: WireGrant = serde_json::from_value(frozen.clone())
            .unwrap_or_else(|e| panic!("{}: this sidecar cannot read it: {e}", frozen["identity"]));
        // Through the sidecar's grant and back, as an agent renders it.
        let grant = Grant::from(wire);
        let written = serde_json::to_value(WireGrant::from(&grant)).unwrap();
        assert_eq!(written, frozen, "this agent writes it differently");
        let newer: WireGrant = serde_json::from_value(with_added_fields(&frozen))
            .unwrap_or_else(|e| panic!("a newer agent's grant: {e}"));
        assert_eq!(
            serde_json::to_value(WireGrant::from(&Grant::from(newer))).unwrap(),
            frozen
        );
    }
}

#[test]
fn errors_read_and_write_as_frozen_with_their_status() {
    for frozen in entries("errors") {
        let body = &frozen["body"];
        let read: ErrorBody = serde_json::from_value(body.clone())
            .unwrap_or_else(|e| panic!("{body}: this sidecar cannot read it: {e}"));
        assert_eq!(
            serde_json::to_value(&read).unwrap(),
            *body,
            "this agent writes it differently"
        );
        let err = BrokerError::from(read.error);
        assert_eq!(
            u64::from(wire::status(&err)),
            frozen["status"].as_u64().unwrap(),
            "{body}"
        );
        let newer: ErrorBody = serde_json::from_value(with_added_fields(body))
            .unwrap_or_else(|e| panic!("a newer agent's error: {e}"));
        assert_eq!(serde_json::to_value(&newer).unwrap(), *body);
    }
    // A kind added later is read as retryable: the SDK tries again.
    let later: ErrorBody =
        serde_json::from_value(json!({"error": {"kind": "added_later", "message": "x"}})).unwrap();
    assert!(BrokerError::from(later.error).is_retryable());
}

#[test]
fn every_error_kind_and_credential_type_is_frozen() {
    let kinds: std::collections::BTreeSet<String> = entries("errors")
        .iter()
        .map(|e| e["body"]["error"]["kind"].as_str().unwrap().to_string())
        .collect();
    let want = [
        "unauthenticated",
        "not_bound",
        "identity_not_found",
        "cloud_disabled",
        "bad_request",
        "policy_denied",
        "upstream_rejected",
        "upstream_throttled",
        "caller_limited",
        "upstream_unavailable",
        "upstream_protocol",
        "unavailable",
    ];
    assert_eq!(kinds, want.iter().map(|k| k.to_string()).collect());
    let credential_types: Vec<String> = entries("grants")
        .iter()
        .filter_map(|g| g["credential"]["type"].as_str().map(str::to_string))
        .collect();
    for t in ["token", "id_token", "aws"] {
        assert!(credential_types.iter().any(|c| c == t), "{t} is not frozen");
    }
}
