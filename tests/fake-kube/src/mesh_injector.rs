//! Someone else's mutating webhook, as a service mesh's sidecar injector
//! is: it labels and annotates every pod it is sent and appends a proxy
//! container, once (what it finds already there it leaves alone). Tests
//! register it beside Lanyard's webhook so that the fake API server's
//! admission chain reinvokes Lanyard's (`reinvocationPolicy: IfNeeded`)
//! and reruns the built-in plugins, as a cluster with Istio or Linkerd
//! does.
//!
//! It answers `POST /inject` with an `admission.k8s.io/v1` AdmissionReview
//! and counts its calls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use serde_json::{json, Value};

/// The label the injector sets.
pub const MESH_LABEL: &str = "mesh.example/injected";
/// The container it appends.
pub const MESH_CONTAINER: &str = "mesh-proxy";

/// The injector's router and its call counter.
pub fn mesh_injector() -> (Router, Arc<AtomicU64>) {
    let calls = Arc::new(AtomicU64::new(0));
    let router = Router::new()
        .route("/inject", post(inject))
        .with_state(calls.clone());
    (router, calls)
}

async fn inject(State(calls): State<Arc<AtomicU64>>, Json(review): Json<Value>) -> Json<Value> {
    calls.fetch_add(1, Ordering::SeqCst);
    let request = &review["request"];
    let pod = &request["object"];
    let mut ops = Vec::new();
    if pod.pointer("/metadata/labels").is_none() {
        ops.push(json!({"op": "add", "path": "/metadata/labels", "value": {}}));
    }
    if pod
        .pointer(&format!(
            "/metadata/labels/{}",
            MESH_LABEL.replace('/', "~1")
        ))
        .is_none()
    {
        ops.push(json!({"op": "add", "path": format!("/metadata/labels/{}", MESH_LABEL.replace('/', "~1")),
                        "value": "true"}));
    }
    let has_proxy = pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["name"] == MESH_CONTAINER);
    if !has_proxy {
        ops.push(json!({"op": "add", "path": "/spec/containers/-", "value": {
            "name": MESH_CONTAINER,
            "image": "registry.example/mesh/proxy:1.24.0",
            "command": ["/bin/sleep", "infinity"],
            "env": [{"name": "MESH_POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "securityContext": {"runAsUser": 1337, "runAsNonRoot": true, "allowPrivilegeEscalation": false,
                                "capabilities": {"drop": ["ALL"]}},
        }}));
    }
    let mut response = json!({"uid": request["uid"], "allowed": true});
    if !ops.is_empty() {
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(STANDARD.encode(Value::Array(ops).to_string()));
    }
    Json(
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}),
    )
}
