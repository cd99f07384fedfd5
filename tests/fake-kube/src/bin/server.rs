//! `lanyard-fake-kube`: the fake API server as a process, for tests that
//! are not written in Rust (tests/python: the chart's roles, pods run as
//! the kubelet would run them).
//!
//! It serves the Kubernetes API on `--listen` with a built-in issuer (the
//! discovery document and keys through the API, as kube-apiserver serves
//! them), writes a kubeconfig for it, and takes state changes on a second,
//! control listener, the way the kubelet and controllers change a real
//! cluster:
//!
//! - `POST /apply`: a ServiceAccount, Pod or Namespace (JSON, as kubectl
//!   would send it); uids are assigned when missing; answers the stored
//!   object;
//! - `DELETE /objects/{serviceaccounts|pods|namespaces}/{namespace}/{name}`
//!   (the namespace segment is `-` for namespaces);
//! - `POST /token`: mints a projected token for a stored pod, as the kubelet
//!   requests one: `{"namespace", "pod", "audiences": [..],
//!   "expiration_seconds"}`; the ServiceAccount, the node and the uids come
//!   from the stored objects;
//! - `GET /requests?prefix=PATH`: how many API requests began with PATH.
//!
//! On start it prints one JSON line to stdout: `{"api", "control",
//! "kubeconfig", "issuer"}`. It stops on SIGTERM or SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use serde::Deserialize;
use serde_json::{json, Value};

use lanyard::emulator::{Issuer, PodIdentity, SigningKey};
use lanyard_fake_kube::FakeKube;

/// The issuer URL real clusters commonly use; the agent reads it from the
/// discovery document, never from the token alone.
const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

struct Args {
    listen: SocketAddr,
    control: SocketAddr,
    dir: PathBuf,
}

fn args() -> Result<Args, String> {
    let mut listen = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
    let mut control = "127.0.0.1:0".parse().map_err(|e| format!("{e}"))?;
    let mut dir = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = value.parse().map_err(|e| format!("--listen: {e}"))?,
            "--control" => control = value.parse().map_err(|e| format!("--control: {e}"))?,
            "--dir" => dir = Some(PathBuf::from(value)),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let dir = dir.ok_or("usage: lanyard-fake-kube --dir DIR [--listen ADDR] [--control ADDR]")?;
    Ok(Args {
        listen,
        control,
        dir,
    })
}

#[derive(Clone)]
struct Ctl {
    kube: Arc<FakeKube>,
    issuer: Arc<Issuer>,
}

fn main() -> std::process::ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("lanyard-fake-kube: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lanyard-fake-kube: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lanyard-fake-kube: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let issuer = Arc::new(Issuer::new(ISSUER, SigningKey::generate_rs256()?));
    let token = uuid::Uuid::new_v4().to_string();
    let kube = FakeKube::new(issuer.url(), issuer.key().jwk(), &token);
    let api = tokio::net::TcpListener::bind(args.listen).await?;
    let control = tokio::net::TcpListener::bind(args.control).await?;
    let api_url = format!("http://{}", api.local_addr()?);
    let control_url = format!("http://{}", control.local_addr()?);
    std::fs::create_dir_all(&args.dir)?;
    let kubeconfig = args.dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kube.kubeconfig(&api_url))?;

    let ctl = Ctl {
        kube: kube.clone(),
        issuer,
    };
    let control_router = Router::new()
        .route("/apply", post(apply))
        .route("/objects/{kind}/{namespace}/{name}", delete(remove))
        .route("/token", post(mint))
        .route("/requests", get(requests))
        .with_state(ctl);
    tokio::spawn(async move { axum::serve(api, kube.router()).await });
    tokio::spawn(async move { axum::serve(control, control_router).await });
    println!(
        "{}",
        json!({"api": api_url, "control": control_url, "kubeconfig": kubeconfig, "issuer": ISSUER})
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

fn bad(message: impl std::fmt::Display) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": message.to_string()})),
    )
        .into_response()
}

fn with_uid(mut object: Value) -> Value {
    if object["metadata"]["uid"].as_str().is_none() {
        object["metadata"]["uid"] = Value::from(uuid::Uuid::new_v4().to_string());
    }
    object
}

async fn apply(State(ctl): State<Ctl>, Json(object): Json<Value>) -> Response {
    if object["metadata"]["name"].as_str().is_none() {
        return bad("metadata.name is required");
    }
    let object = with_uid(object);
    let stored = match object["kind"].as_str() {
        Some("ServiceAccount") => serde_json::from_value::<ServiceAccount>(object)
            .map(|o| serde_json::to_value(ctl.kube.apply_service_account(o))),
        Some("Pod") => serde_json::from_value::<Pod>(object)
            .map(|o| serde_json::to_value(ctl.kube.apply_pod(o))),
        Some("Namespace") => serde_json::from_value::<Namespace>(object)
            .map(|o| serde_json::to_value(ctl.kube.apply_namespace(o))),
        other => return bad(format!("cannot apply kind {other:?}")),
    };
    match stored {
        Ok(Ok(v)) => Json(v).into_response(),
        Ok(Err(e)) | Err(e) => bad(e),
    }
}

async fn remove(
    State(ctl): State<Ctl>,
    Path((kind, namespace, name)): Path<(String, String, String)>,
) -> StatusCode {
    let found = match kind.as_str() {
        "serviceaccounts" => ctl.kube.delete_service_account(&namespace, &name),
        "pods" => ctl.kube.delete_pod(&namespace, &name),
        "namespaces" => ctl.kube.delete_namespace(&name),
        _ => return StatusCode::BAD_REQUEST,
    };
    if found {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

#[derive(Deserialize)]
struct TokenRequest {
    namespace: String,
    pod: String,
    audiences: Vec<String>,
    expiration_seconds: u64,
}

async fn mint(State(ctl): State<Ctl>, Json(req): Json<TokenRequest>) -> Response {
    let Some(pod) = ctl.kube.pod(&req.namespace, &req.pod) else {
        return bad(format!("no pod {}/{}", req.namespace, req.pod));
    };
    let spec = pod.spec.unwrap_or_default();
    let account = spec
        .service_account_name
        .unwrap_or_else(|| "default".into());
    let Some(sa) = ctl.kube.service_account(&req.namespace, &account) else {
        return bad(format!("no serviceaccount {}/{account}", req.namespace));
    };
    // The kubelet asks only for pods bound to its node.
    let Some(node) = spec.node_name else {
        return bad("the pod is not scheduled (no spec.nodeName)");
    };
    if !(600..=86_400 * 2).contains(&req.expiration_seconds) {
        return bad("expiration_seconds must be at least 600");
    }
    let mut identity = PodIdentity::new(&req.namespace, &account, &req.pod, &node);
    identity.pod_uid = pod.metadata.uid.unwrap_or_default();
    identity.service_account_uid = sa.metadata.uid.unwrap_or_default();
    let audiences: Vec<&str> = req.audiences.iter().map(String::as_str).collect();
    match ctl.issuer.mint(
        &identity,
        &audiences,
        Duration::from_secs(req.expiration_seconds),
    ) {
        Ok(token) => Json(json!({"token": token})).into_response(),
        Err(e) => bad(e),
    }
}

#[derive(Deserialize)]
struct Prefix {
    prefix: String,
}

async fn requests(State(ctl): State<Ctl>, Query(q): Query<Prefix>) -> Json<Value> {
    Json(json!({"count": ctl.kube.requests(&q.prefix)}))
}
