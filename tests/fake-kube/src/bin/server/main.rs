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
//!   object (a pod applied here is stored as given, as the scheduler's and
//!   the kubelet's writes are; a pod a user creates goes through the API
//!   and its admission); or an admission configuration
//!   (MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
//!   ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding), which
//!   pods written through the API are then admitted with;
//! - `POST /endpoints`: `{"namespace", "name", "addresses": ["IP:PORT"]}`,
//!   the ready endpoints of a webhook's Service;
//! - `GET /admission/calls`: every webhook call made and policy evaluated,
//!   in order; `DELETE /admission/{kind}/{name}` removes a registered
//!   admission object; `POST /admission/policies` answers what the
//!   registered ValidatingAdmissionPolicies decide on an AdmissionReview
//!   (`{"allowed", "code", "message", "warnings"}`), for tests that hold
//!   the fake's CEL runtime to another;
//! - `POST /apply` also takes a ClusterRole or ClusterRoleBinding, which
//!   access reviews are answered from (`lanyard_fake_kube::rbac`);
//! - `DELETE /objects/{serviceaccounts|pods|namespaces|clusterroles|clusterrolebindings}/{namespace}/{name}`
//!   (the namespace segment is `-` for cluster-scoped kinds);
//! - `POST /token`: mints a projected token for a stored pod, as the kubelet
//!   requests one: `{"namespace", "pod", "audiences": [..],
//!   "expiration_seconds"}`; the ServiceAccount, the node and the uids come
//!   from the stored objects;
//! - `GET /requests?prefix=PATH`: how many API requests began with PATH.
//!
//! With `--clouds FILE` it also runs the clouds' token services (see
//! `clouds.rs`), trusting this cluster's issuer, which it then serves over
//! HTTP on a listener of its own; the control port answers
//! `GET /clouds/whois?credential=C` (which cloud issued C, to whom) and
//! `GET /clouds/counts` (credentials issued per principal),
//! `GET /clouds/aws/sessions` (every STS session: role, calling role, tags,
//! external id) and
//! `POST /clouds/faults?cloud=azure|gcp|aws&fault=KIND[&count=N]`, which
//! makes that cloud misbehave for its next N requests (without `count`:
//! until `fault=clear`): `fault=status&status=503[&retry_after=S]` (an
//! error in the service's own format; 429 is its throttling answer, STS's
//! `Throttling`), `fault=latency&ms=MS`, `fault=hang` (never answers),
//! `fault=drop` (the connection reset after the headers),
//! `fault=truncated`, or `fault=clear` (removes every scheduled fault).
//!
//! `POST /control/keys?rotate=true` rotates the issuer's signing key (new
//! tokens are signed with a new key; the JWKS, served by the API server and
//! the issuer's own listener, publishes it and the one it replaced), and
//! `POST /control/keys?unavailable=true|false` makes the API server answer
//! its discovery document and JWKS 503 while everything else works; both
//! answer `{"kids", "signing"}`.
//!
//! The API server itself can be taken down and its watches ended:
//! `POST /control/unavailable?on=true|false` (while on, every API request
//! is answered 503 and open watches end) and
//! `POST /control/watches?expire=false|true` (ends every open watch;
//! `expire=true` also compacts the history, so clients must relist after a
//! 410).
//!
//! With `--imds ADDR` (and `--clouds`) it also serves the node's Azure
//! IMDS at ADDR (`169.254.169.254:80` in the pod harness), for the managed
//! identities the clouds file assigns to the node pool
//! (`azure_node_identities`).
//!
//! With `azure_identity_binding` in the clouds file (the proxy's server
//! name, `<label>.ests.aks`), AKS's identity-binding proxy answers on the
//! API server's HTTPS address to that server name, as at AKS, and lets a
//! ServiceAccount use an identity when a ClusterRoleBinding grants it
//! `use-managed-identity` on the identity's client id.
//!
//! `--host IP` binds every listener on IP (any free port) instead of
//! 127.0.0.1, for a process run in a network namespace of its own.
//!
//! The API is also served over HTTPS (`api_https`), for kubectl, with an
//! administrator's kubeconfig (`admin_kubeconfig`: `system:masters`, pod
//! writes through admission) and the cluster CA (`ca`); a mesh injector,
//! someone else's mutating webhook, listens at `mesh_injector` (see
//! `https.rs`).
//!
//! On start it prints one JSON line to stdout: `{"api", "control",
//! "kubeconfig", "issuer", "api_https", "admin_kubeconfig", "ca",
//! "mesh_injector"}`, with `"azure"`, `"gcp"` and `"aws"` (each
//! emulator's base URL) when the clouds run. It stops on SIGTERM or SIGINT.

mod clouds;
mod https;

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

use lanyard_emulators::{identity_binding, Issuer, PodIdentity, SigningKey};
use lanyard_fake_kube::FakeKube;

/// The issuer URL real clusters commonly use; the agent reads it from the
/// discovery document, never from the token alone.
const ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

struct Args {
    listen: SocketAddr,
    control: SocketAddr,
    host: std::net::IpAddr,
    dir: PathBuf,
    clouds: Option<PathBuf>,
    imds: Option<SocketAddr>,
}

fn args() -> Result<Args, String> {
    let mut host: std::net::IpAddr = [127, 0, 0, 1].into();
    let mut listen = None;
    let mut control = None;
    let mut dir = None;
    let mut clouds = None;
    let mut imds = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = Some(value.parse().map_err(|e| format!("--listen: {e}"))?),
            "--control" => control = Some(value.parse().map_err(|e| format!("--control: {e}"))?),
            "--host" => host = value.parse().map_err(|e| format!("--host: {e}"))?,
            "--dir" => dir = Some(PathBuf::from(value)),
            "--clouds" => clouds = Some(PathBuf::from(value)),
            "--imds" => imds = Some(value.parse().map_err(|e| format!("--imds: {e}"))?),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let dir = dir.ok_or(
        "usage: lanyard-fake-kube --dir DIR [--host IP] [--listen ADDR] [--control ADDR] [--clouds FILE [--imds ADDR]]",
    )?;
    Ok(Args {
        listen: listen.unwrap_or(SocketAddr::new(host, 0)),
        control: control.unwrap_or(SocketAddr::new(host, 0)),
        host,
        dir,
        clouds,
        imds,
    })
}

#[derive(Clone)]
struct Ctl {
    kube: Arc<FakeKube>,
    issuer: Arc<Issuer>,
    clouds: Option<Arc<clouds::Clouds>>,
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
    let clouds_config: Option<clouds::CloudsConfig> = match &args.clouds {
        Some(path) => Some(serde_json::from_slice(&std::fs::read(path)?)?),
        None => None,
    };
    let mut info = serde_json::Map::new();
    // The clouds fetch the issuer's keys over HTTP: serve it where they can.
    let issuer_listener = match clouds_config {
        Some(_) => Some(tokio::net::TcpListener::bind((args.host, 0)).await?),
        None => None,
    };
    let issuer_url = match &issuer_listener {
        Some(l) => format!("http://{}", l.local_addr()?),
        None => ISSUER.to_string(),
    };
    let issuer = Arc::new(Issuer::new(issuer_url, SigningKey::generate_rs256()?));
    if let Some(listener) = issuer_listener {
        let router = issuer.router();
        tokio::spawn(async move { axum::serve(listener, router).await });
    }
    let clouds = match &clouds_config {
        Some(config) => {
            let clouds = Arc::new(clouds::Clouds::new(config, issuer.url())?);
            let tls = match &config.tls {
                Some(tls) => {
                    let pki = tls.pki()?;
                    let ca = args.dir.join("clouds-ca.crt");
                    std::fs::create_dir_all(&args.dir)?;
                    std::fs::write(&ca, &pki.ca_pem)?;
                    info.insert("clouds_ca".into(), json!(ca));
                    let rustls = axum_server::tls_rustls::RustlsConfig::from_pem(
                        pki.cert_pem.into_bytes(),
                        pki.key_pem.into_bytes(),
                    )
                    .await?;
                    Some((tls, rustls))
                }
                None => None,
            };
            for (name, router) in clouds.routers() {
                match &tls {
                    Some((serving, rustls)) => {
                        let addr = serving
                            .address(name)
                            .ok_or_else(|| anyhow::anyhow!("no TLS address for {name}"))?;
                        let listener = std::net::TcpListener::bind(addr)?;
                        listener.set_nonblocking(true)?;
                        info.insert(name.into(), Value::from(format!("https://{addr}")));
                        let server = axum_server::from_tcp_rustls(listener, rustls.clone())?;
                        tokio::spawn(async move { server.serve(router.into_make_service()).await });
                    }
                    None => {
                        let listener = tokio::net::TcpListener::bind((args.host, 0)).await?;
                        info.insert(
                            name.into(),
                            Value::from(format!("http://{}", listener.local_addr()?)),
                        );
                        tokio::spawn(async move { axum::serve(listener, router).await });
                    }
                }
            }
            if let Some(addr) = args.imds {
                // The node's IMDS, as the node pool's VM scale set has it.
                let listener = tokio::net::TcpListener::bind(addr).await?;
                info.insert("imds".into(), Value::from(format!("http://{addr}")));
                let router = clouds.imds_router();
                tokio::spawn(async move { axum::serve(listener, router).await });
            }
            Some(clouds)
        }
        None => None,
    };
    let token = uuid::Uuid::new_v4().to_string();
    let kube = FakeKube::new(issuer.url(), issuer.key().jwk(), &token);
    kube.set_admin_token(&uuid::Uuid::new_v4().to_string());
    let api = tokio::net::TcpListener::bind(args.listen).await?;
    let control = tokio::net::TcpListener::bind(args.control).await?;
    let api_url = format!("http://{}", api.local_addr()?);
    let control_url = format!("http://{}", control.local_addr()?);
    std::fs::create_dir_all(&args.dir)?;
    let kubeconfig = args.dir.join("kubeconfig");
    std::fs::write(&kubeconfig, kube.kubeconfig(&api_url))?;

    info.insert("api".into(), Value::from(api_url));
    info.insert("control".into(), Value::from(control_url));
    info.insert("kubeconfig".into(), json!(kubeconfig));
    info.insert("issuer".into(), Value::from(issuer.url()));
    let proxy = match (
        &clouds,
        clouds_config
            .as_ref()
            .and_then(|c| c.azure_identity_binding.clone()),
    ) {
        (Some(clouds), Some(sni)) => {
            Some(identity_binding_proxy(clouds, &kube, issuer.url(), sni, args.host).await?)
        }
        _ => None,
    };
    let served = https::start(kube.clone(), args.host, &args.dir, proxy).await?;
    info.insert("api_https".into(), Value::from(served.api));
    info.insert("admin_kubeconfig".into(), json!(served.admin_kubeconfig));
    info.insert("ca".into(), json!(served.ca));
    info.insert("mesh_injector".into(), Value::from(served.mesh_injector));
    let ctl = Ctl {
        kube: kube.clone(),
        issuer,
        clouds,
    };
    let control_router = Router::new()
        .route("/apply", post(apply))
        .route("/objects/{kind}/{namespace}/{name}", delete(remove))
        .route("/token", post(mint))
        .route("/endpoints", post(endpoints))
        .route("/admission/calls", get(admission_calls))
        .route("/admission/policies", post(policies))
        .route("/admission/{kind}/{name}", delete(unregister))
        .route("/requests", get(requests))
        .route("/clouds/whois", get(whois))
        .route("/clouds/counts", get(counts))
        .route("/clouds/aws/sessions", get(aws_sessions))
        .route("/clouds/faults", post(faults))
        .route("/control/unavailable", post(unavailable))
        .route("/control/watches", post(watches))
        .route("/control/keys", post(keys))
        .with_state(ctl);
    tokio::spawn(async move { axum::serve(api, kube.router()).await });
    tokio::spawn(async move { axum::serve(control, control_router).await });
    println!("{}", Value::Object(info));
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

/// RBAC's answers from the ClusterRoles and ClusterRoleBindings applied
/// to the fake API server, for the identity-binding proxy.
struct KubeGrants(Arc<FakeKube>);

impl identity_binding::Grants for KubeGrants {
    fn may_use(&self, namespace: &str, name: &str, client_id: &str) -> bool {
        self.0.authorize(
            &lanyard_fake_kube::rbac::service_account_user(namespace, name),
            &lanyard_fake_kube::rbac::Attributes {
                verb: identity_binding::VERB,
                api_group: identity_binding::API_GROUP,
                resource: client_id,
                name: None,
            },
        )
    }
}

/// AKS's identity-binding proxy for this cluster, answering on the API
/// server's HTTPS address to the server name `sni` (see `https.rs`):
/// RBAC from `kube`, Entra reached on a plain listener of its own (the
/// proxy runs in AKS's network, not the nodes'), and its identities'
/// issuer (`ib.oic.prod-aks.azure.com`) stood in for on another.
async fn identity_binding_proxy(
    clouds: &clouds::Clouds,
    kube: &Arc<FakeKube>,
    cluster_issuer: &str,
    sni: String,
    host: std::net::IpAddr,
) -> anyhow::Result<(String, Router)> {
    let entra = clouds.entra().router();
    let entra_listener = tokio::net::TcpListener::bind((host, 0)).await?;
    let entra_url = format!("http://{}", entra_listener.local_addr()?);
    tokio::spawn(async move { axum::serve(entra_listener, entra).await });
    let proxy = Arc::new(
        identity_binding::Proxy::new(
            identity_binding::ProxyConfig {
                sni_name: sni.clone(),
                cluster_issuer: cluster_issuer.to_string(),
                entra: entra_url,
                bindings: clouds.identity_bindings().to_vec(),
            },
            lanyard::http::client(),
        )?
        .with_grants(Arc::new(KubeGrants(kube.clone()))),
    );
    let issuers = tokio::net::TcpListener::bind((host, 0)).await?;
    clouds.entra().stand_in(
        identity_binding::ISSUER_ORIGIN,
        &format!("http://{}", issuers.local_addr()?),
    );
    let router = proxy.issuer_router();
    tokio::spawn(async move { axum::serve(issuers, router).await });
    Ok((sni, proxy.router()))
}

fn bad(message: impl std::fmt::Display) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": message.to_string()})),
    )
        .into_response()
}

fn respond<T: serde::Serialize>(result: Result<T, String>) -> Response {
    match result {
        Ok(stored) => Json(stored).into_response(),
        Err(e) => bad(e),
    }
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
        Some("ClusterRole") => {
            return respond(
                serde_json::from_value(object)
                    .map_err(|e| e.to_string())
                    .and_then(|o| ctl.kube.apply_cluster_role(o)),
            )
        }
        Some("ClusterRoleBinding") => {
            return respond(
                serde_json::from_value(object)
                    .map_err(|e| e.to_string())
                    .and_then(|o| ctl.kube.apply_cluster_role_binding(o)),
            )
        }
        Some(
            "MutatingWebhookConfiguration"
            | "ValidatingWebhookConfiguration"
            | "ValidatingAdmissionPolicy"
            | "ValidatingAdmissionPolicyBinding",
        ) => {
            return match ctl.kube.register_admission(&object) {
                Ok(()) => Json(object).into_response(),
                Err(e) => bad(e),
            }
        }
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
        "clusterroles" => ctl.kube.delete_cluster_role(&name),
        "clusterrolebindings" => ctl.kube.delete_cluster_role_binding(&name),
        _ => return StatusCode::BAD_REQUEST,
    };
    if found {
        StatusCode::OK
    } else {
        StatusCode::NOT_FOUND
    }
}

#[derive(Deserialize)]
struct Endpoints {
    namespace: String,
    name: String,
    addresses: Vec<SocketAddr>,
}

async fn endpoints(State(ctl): State<Ctl>, Json(e): Json<Endpoints>) -> Json<Value> {
    ctl.kube
        .set_endpoints(&e.namespace, &e.name, e.addresses.clone());
    Json(json!({"namespace": e.namespace, "name": e.name, "addresses": e.addresses}))
}

async fn unregister(
    State(ctl): State<Ctl>,
    Path((kind, name)): Path<(String, String)>,
) -> StatusCode {
    match ctl.kube.unregister_admission(&kind, &name) {
        true => StatusCode::OK,
        false => StatusCode::NOT_FOUND,
    }
}

async fn policies(State(ctl): State<Ctl>, Json(review): Json<Value>) -> Json<Value> {
    Json(match ctl.kube.evaluate_policies(&review["request"]) {
        Ok(warnings) => json!({"allowed": true, "warnings": warnings}),
        Err((code, message)) => json!({"allowed": false, "code": code, "message": message}),
    })
}

async fn admission_calls(State(ctl): State<Ctl>) -> Json<Value> {
    Json(json!({"calls": ctl.kube.webhook_calls()}))
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

#[derive(Deserialize)]
struct Credential {
    credential: String,
}

async fn whois(State(ctl): State<Ctl>, Query(q): Query<Credential>) -> Response {
    let Some(clouds) = &ctl.clouds else {
        return bad("the clouds are not running (--clouds)");
    };
    match clouds.whois(&q.credential) {
        Some(v) => Json(v).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no cloud issued this credential"})),
        )
            .into_response(),
    }
}

async fn counts(State(ctl): State<Ctl>) -> Response {
    match &ctl.clouds {
        Some(clouds) => Json(clouds.counts()).into_response(),
        None => bad("the clouds are not running (--clouds)"),
    }
}

async fn aws_sessions(State(ctl): State<Ctl>) -> Response {
    match &ctl.clouds {
        Some(clouds) => Json(clouds.aws_sessions()).into_response(),
        None => bad("the clouds are not running (--clouds)"),
    }
}

async fn faults(State(ctl): State<Ctl>, Query(q): Query<clouds::FaultQuery>) -> Response {
    let Some(clouds) = &ctl.clouds else {
        return bad("the clouds are not running (--clouds)");
    };
    match clouds.schedule(&q) {
        Ok(v) => Json(v).into_response(),
        Err(e) => bad(e),
    }
}

#[derive(Deserialize)]
struct Switch {
    on: bool,
}

async fn unavailable(State(ctl): State<Ctl>, Query(q): Query<Switch>) -> Json<Value> {
    ctl.kube.set_unavailable(q.on);
    Json(json!({"unavailable": q.on}))
}

#[derive(Deserialize)]
struct Watches {
    #[serde(default)]
    expire: bool,
}

async fn watches(State(ctl): State<Ctl>, Query(q): Query<Watches>) -> Json<Value> {
    if q.expire {
        ctl.kube.expire_watches();
    } else {
        ctl.kube.end_watches();
    }
    Json(json!({"watches_ended": true, "expired": q.expire}))
}

#[derive(Deserialize)]
struct Keys {
    #[serde(default)]
    rotate: bool,
    unavailable: Option<bool>,
}

async fn keys(State(ctl): State<Ctl>, Query(q): Query<Keys>) -> Response {
    if let Some(down) = q.unavailable {
        ctl.kube.set_keys_unavailable(down);
    }
    if q.rotate {
        match SigningKey::generate_rs256() {
            Ok(key) => ctl.issuer.rotate(key),
            Err(e) => return bad(format!("cannot generate a key: {e}")),
        }
        ctl.kube.set_issuer_keys(ctl.issuer.jwks());
    }
    let jwks = ctl.issuer.jwks();
    let kids: Vec<&Value> = jwks["keys"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|k| k.get("kid"))
        .collect();
    Json(json!({"kids": kids, "signing": ctl.issuer.key().kid()})).into_response()
}
