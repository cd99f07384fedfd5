//! Pods created through the fake API server's admission chain
//! (`tests/fake-kube/src/admission`), with Lanyard's real webhook server
//! registered as the chart registers it (a Service, `reinvocationPolicy:
//! IfNeeded`, the guard on a governed namespace) and a foreign mesh
//! injector registered beside it: what a cluster stores, not what the
//! webhook returned.
//!
//! What kube-apiserver does and these tests hold the chain to:
//! - the ServiceAccount plugin runs again after a webhook changed the pod
//!   and mounts `kube-api-access-*` into a container the webhook added
//!   (`plugin/pkg/admission/serviceaccount/admission.go`, rerun through
//!   `k8s.io/apiserver/pkg/admission/reinvocation.go`), but not into
//!   Lanyard's sidecar, which has a mount of its own at that path;
//! - an `IfNeeded` webhook is called again when a later webhook, or a
//!   built-in plugin rerun after one, changed the pod
//!   (`webhook/mutating/dispatcher.go`);
//! - the guard judges the stored pod, its updates and its ephemeral
//!   containers.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use lanyard::directory::file::{ServiceAccountEntry, StaticDirectory};
use lanyard::http::ShutdownTrigger;
use lanyard::webhook::guard::{self, Guard};
use lanyard::webhook::server::{TlsFiles, WebhookServer};
use lanyard::webhook::vocabulary::{
    API_TOKEN_DIR, API_TOKEN_SHIELD_VOLUME, SIDECAR_NAME, TOKENS_VOLUME,
};
use lanyard::webhook::{mutate, InjectionConfig};
use lanyard_fake_kube::mesh_injector::{mesh_injector, MESH_CONTAINER, MESH_LABEL};
use lanyard_fake_kube::FakeKube;
use serde_json::{json, Value};

const ADMIN: &str = "admin-token-for-tests";
const CLIENT_ID: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
const SERVICE: &str = "lanyard-webhook.lanyard-system.svc";

struct Pki {
    ca_pem: String,
    lanyard: (String, String),
    mesh: (String, String),
}

fn pki() -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names)
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    };
    Pki {
        ca_pem: ca_cert.pem(),
        lanyard: leaf(vec![SERVICE.to_string()]),
        mesh: leaf(vec!["127.0.0.1".to_string()]),
    }
}

struct Cluster {
    fake: Arc<FakeKube>,
    api: String,
    http: reqwest::Client,
    injection: InjectionConfig,
    mesh_calls: Arc<std::sync::atomic::AtomicU64>,
    webhook: Option<WebhookServer>,
    _api: ShutdownTrigger,
    _mesh: axum_server::Handle<SocketAddr>,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Some(server) = self.webhook.take() {
            drop(tokio::spawn(server.stop()));
        }
    }
}

/// The chart's MutatingWebhookConfiguration and guard webhook
/// (`charts/lanyard/templates/webhook-tls.yaml`), with `ca`.
fn lanyard_configurations(ca: &str) -> [Value; 2] {
    let bundle = base64::engine::general_purpose::STANDARD.encode(ca);
    let service = |path: &str| {
        json!({"service": {"name": "lanyard-webhook", "namespace": "lanyard-system",
                                                  "path": path, "port": 443}, "caBundle": bundle})
    };
    let outside_system = json!({"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "NotIn",
                                                      "values": ["kube-system", "lanyard-system"]}]});
    [
        json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
               "metadata": {"name": "lanyard-webhook"},
               "webhooks": [{"name": "inject.lanyard.dev", "admissionReviewVersions": ["v1"],
                             "clientConfig": service("/mutate"),
                             "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                        "resources": ["pods"], "scope": "Namespaced"}],
                             "objectSelector": {"matchLabels": {"lanyard.dev/inject": "true"}},
                             "namespaceSelector": outside_system,
                             "failurePolicy": "Fail", "matchPolicy": "Equivalent",
                             "reinvocationPolicy": "IfNeeded", "sideEffects": "None", "timeoutSeconds": 10}]}),
        json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
               "metadata": {"name": "lanyard-webhook-guard"},
               "webhooks": [{"name": "guard.lanyard.dev", "admissionReviewVersions": ["v1"],
                             "clientConfig": service("/validate"),
                             "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                                        "resources": ["pods", "pods/ephemeralcontainers"], "scope": "Namespaced"}],
                             "namespaceSelector": {"matchLabels": {"lanyard.dev/guard": "enforce"},
                                                   "matchExpressions": outside_system["matchExpressions"]},
                             "failurePolicy": "Fail", "matchPolicy": "Equivalent", "sideEffects": "None",
                             "timeoutSeconds": 10}]}),
    ]
}

/// The mesh injector's configuration, named `name` (configurations are
/// called in name order).
fn mesh_configuration(name: &str, url: &str, ca: &str) -> Value {
    json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
           "metadata": {"name": name},
           "webhooks": [{"name": "inject.mesh.example", "admissionReviewVersions": ["v1"],
                         "clientConfig": {"url": url,
                                          "caBundle": base64::engine::general_purpose::STANDARD.encode(ca)},
                         "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
                                    "resources": ["pods"]}],
                         "failurePolicy": "Fail", "sideEffects": "None", "reinvocationPolicy": "Never"}]})
}

async fn cluster(mesh_name: &str) -> Cluster {
    let injection = InjectionConfig {
        sidecar_image: "registry.example/lanyard:0.1.0".into(),
        sdk: lanyard::serve::sdk_env::SdkDefaults {
            azure_tenant_id: Some("72f988bf-86f1-41af-91ab-2d7cd011db47".into()),
            aws_region: None,
            gcp_universe_domain: None,
        },
        ..Default::default()
    };
    cluster_with(
        mesh_name,
        injection,
        &[("azure.workload.identity/client-id", CLIENT_ID)],
    )
    .await
}

/// A cluster whose webhook injects with `injection` and whose
/// `ray-worker` ServiceAccounts carry `annotations`.
async fn cluster_with(
    mesh_name: &str,
    injection: InjectionConfig,
    annotations: &[(&str, &str)],
) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    let fake = FakeKube::new(
        "https://kubernetes.default.svc",
        &json!({"kty": "oct"}),
        "lanyard-token",
    );
    fake.set_admin_token(ADMIN);
    let (api, api_trigger) = support::serve_router(fake.router(), "fake kube-apiserver").await;

    let cert = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    std::fs::write(&cert, &pki.lanyard.0).unwrap();
    std::fs::write(&key, &pki.lanyard.1).unwrap();
    let annotations: Vec<(String, String)> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let accounts: Vec<ServiceAccountEntry> = ["ml", "governed"]
        .iter()
        .map(|ns| ServiceAccountEntry {
            labels: Default::default(),
            namespace: ns.to_string(),
            name: "ray-worker".into(),
            annotations: annotations.iter().cloned().collect(),
        })
        .collect();
    let metrics = Arc::new(lanyard::telemetry::metrics::Metrics::new());
    let origin = Arc::new(lanyard::audit::record::Origin::new("test", "", "webhook"));
    let audit = Arc::new(lanyard::audit::sinks::Sinks::new(
        origin,
        Default::default(),
        metrics.clone(),
    ));
    let webhook = WebhookServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TlsFiles {
            cert,
            key,
            reload_every: Duration::from_secs(60),
        },
        injection.clone(),
        Guard::new(&injection, &[]),
        Arc::new(StaticDirectory::new(&accounts)),
        metrics,
        audit,
    )
    .await
    .unwrap();

    let (router, mesh_calls) = mesh_injector();
    let mesh: axum_server::Handle<SocketAddr> = axum_server::Handle::new();
    let rustls = axum_server::tls_rustls::RustlsConfig::from_pem(
        pki.mesh.0.clone().into_bytes(),
        pki.mesh.1.clone().into_bytes(),
    )
    .await
    .unwrap();
    let server = axum_server::bind_rustls("127.0.0.1:0".parse().unwrap(), rustls)
        .handle(mesh.clone())
        .serve(router.into_make_service());
    tokio::spawn(server);
    let mesh_addr = mesh.listening().await.unwrap();

    for config in lanyard_configurations(&pki.ca_pem) {
        fake.register_admission(&config).unwrap();
    }
    let mesh_url = format!("https://127.0.0.1:{}/inject", mesh_addr.port());
    fake.register_admission(&mesh_configuration(mesh_name, &mesh_url, &pki.ca_pem))
        .unwrap();
    fake.set_endpoints("lanyard-system", "lanyard-webhook", vec![webhook.addr]);
    for (ns, labels) in [
        ("ml", json!({})),
        ("governed", json!({"lanyard.dev/guard": "enforce"})),
    ] {
        fake.apply_namespace(
            serde_json::from_value(json!({"metadata": {"name": ns, "labels": labels}})).unwrap(),
        );
        let annotations: serde_json::Map<String, Value> = annotations
            .iter()
            .map(|(k, v)| (k.clone(), json!(v)))
            .collect();
        fake.apply_service_account(
            serde_json::from_value(json!({"metadata": {"name": "ray-worker", "namespace": ns,
                                                       "annotations": annotations}}))
            .unwrap(),
        );
    }
    Cluster {
        fake,
        api,
        http: reqwest::Client::new(),
        injection,
        mesh_calls,
        webhook: Some(webhook),
        _api: api_trigger,
        _mesh: mesh,
        _dir: dir,
    }
}

impl Cluster {
    /// A write as the administrator: its status and body.
    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        content_type: &str,
        body: Value,
    ) -> (u16, Value) {
        let resp = self
            .http
            .request(method, format!("{}{path}", self.api))
            .bearer_auth(ADMIN)
            .header("content-type", content_type)
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    async fn create(&self, ns: &str, pod: Value) -> (u16, Value) {
        self.send(
            reqwest::Method::POST,
            &format!("/api/v1/namespaces/{ns}/pods"),
            "application/json",
            pod,
        )
        .await
    }
}

/// A KubeRay worker's pod as the operator creates it (the API token
/// automounted).
fn worker(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"lanyard.dev/inject": "true", "ray.io/node-type": "worker"}},
           "spec": {"serviceAccountName": "ray-worker",
                    "containers": [{"name": "ray-worker", "image": "rayproject/ray:2.46.0-py310",
                                    "command": ["ray", "start", "--block"]}]}})
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    pod["spec"][list]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {list} {name} in {pod}"))
}

fn mounts(c: &Value) -> Vec<(String, String)> {
    c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["mountPath"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn api_volume(pod: &Value) -> String {
    let names: Vec<&str> = pod["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .filter(|n| n.starts_with("kube-api-access-"))
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
    names[0].to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_a_later_webhook_adds_gets_the_api_token_and_lanyards_webhook_runs_again() {
    let c = cluster("mesh-injector").await;
    let (status, pod) = c.create("ml", worker("ray-worker-0")).await;
    assert_eq!(status, 201, "{pod}");
    // Lanyard's, then the mesh's, then Lanyard's again (IfNeeded), once.
    assert_eq!(
        c.fake.webhook_calls(),
        [
            "inject.lanyard.dev CREATE",
            "inject.mesh.example CREATE",
            "inject.lanyard.dev CREATE"
        ]
    );
    assert_eq!(c.mesh_calls.load(Ordering::SeqCst), 1);
    let api = api_volume(&pod);
    let path = API_TOKEN_DIR.to_string();
    // The ServiceAccount plugin's second run mounted the API token into
    // the mesh's container, as it did into the app on its first.
    assert!(mounts(container(&pod, "containers", MESH_CONTAINER))
        .contains(&(api.clone(), path.clone())));
    assert!(
        mounts(container(&pod, "containers", "ray-worker")).contains(&(api.clone(), path.clone()))
    );
    // Not into Lanyard's sidecar: it has its own empty volume there.
    let sidecar = container(&pod, "initContainers", SIDECAR_NAME);
    assert_eq!(
        mounts(sidecar),
        [
            (
                TOKENS_VOLUME.to_string(),
                "/var/run/lanyard/tokens".to_string()
            ),
            (API_TOKEN_SHIELD_VOLUME.to_string(), path.clone()),
        ]
    );
    // Lanyard's reinvocation gave the mesh's container the SDK variables.
    let env: Vec<&str> = container(&pod, "containers", MESH_CONTAINER)["env"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(
        env.contains(&"IDENTITY_ENDPOINT") && env.contains(&"MESH_POD"),
        "{env:?}"
    );
    assert_eq!(pod["metadata"]["labels"][MESH_LABEL], "true");
    // The API server's own additions are there.
    assert_eq!(pod["spec"]["priority"], 0);
    assert_eq!(pod["spec"]["serviceAccount"], "ray-worker");
    assert_eq!(pod["status"]["phase"], "Pending");
    assert_eq!(sidecar["terminationMessagePath"], "/dev/termination-log");
    assert_eq!(sidecar["livenessProbe"]["httpGet"]["scheme"], "HTTP");

    // The stored pod is one the guard admits and a reinvoked /mutate
    // leaves alone.
    let typed = serde_json::from_value(pod.clone()).unwrap();
    assert_eq!(guard::check(&typed, &Guard::new(&c.injection, &[])), Ok(()));
    let bindings = lanyard::cloud::Bindings {
        azure: vec![lanyard::cloud::azure::Binding {
            client_id: CLIENT_ID.into(),
            tenant_id: None,
            object_id: None,
            resource_id: None,
            app: None,
        }],
        ..Default::default()
    };
    let again = mutate(&typed, "ml", &bindings, &c.injection).unwrap();
    assert!(again.is_empty(), "{:?}", again.patch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plugins_rerun_reinvokes_lanyards_webhook_when_the_mesh_goes_first() {
    // "aa-mesh" sorts before "lanyard-webhook": the mesh's container is
    // there when Lanyard's webhook first runs; the ServiceAccount plugin's
    // second run then mounts the API token into it, which changes the pod
    // since Lanyard's webhook ran, so Lanyard's is called again.
    let c = cluster("aa-mesh").await;
    let (status, pod) = c.create("ml", worker("ray-worker-1")).await;
    assert_eq!(status, 201, "{pod}");
    assert_eq!(
        c.fake.webhook_calls(),
        [
            "inject.mesh.example CREATE",
            "inject.lanyard.dev CREATE",
            "inject.lanyard.dev CREATE"
        ]
    );
    let api = api_volume(&pod);
    assert!(mounts(container(&pod, "containers", MESH_CONTAINER))
        .contains(&(api, API_TOKEN_DIR.into())));

    // A pod that does not opt in: only the mesh, and no reinvocation of a
    // webhook that was never called.
    let mut plain = worker("plain-0");
    plain["metadata"]["labels"] = json!({});
    let (status, _) = c.create("ml", plain).await;
    assert_eq!(status, 201);
    assert_eq!(
        c.fake.webhook_calls().last().map(String::as_str),
        Some("inject.mesh.example CREATE")
    );
    assert_eq!(c.fake.webhook_calls().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_governed_namespace_the_stored_pod_its_updates_and_a_plain_debug_container_pass() {
    let c = cluster("mesh-injector").await;
    let (status, pod) = c.create("governed", worker("builder-0")).await;
    assert_eq!(status, 201, "{pod}");
    assert!(c
        .fake
        .webhook_calls()
        .contains(&"guard.lanyard.dev CREATE".to_string()));
    let path = "/api/v1/namespaces/governed/pods/builder-0";

    // kubectl label: a merge patch of the labels.
    let (status, labelled) = c
        .send(
            reqwest::Method::PATCH,
            path,
            "application/merge-patch+json",
            json!({"metadata": {"labels": {"team": "data"}}}),
        )
        .await;
    assert_eq!(status, 200, "{labelled}");
    assert_eq!(labelled["metadata"]["labels"]["team"], "data");
    assert!(c
        .fake
        .webhook_calls()
        .contains(&"guard.lanyard.dev UPDATE".to_string()));

    // kubectl debug (the legacy profile, its default through 1.34): a
    // strategic merge patch of pods/NAME/ephemeralcontainers.
    let debug = |name: &str, target: &str, security: Value| {
        let mut c = json!({"image": "busybox:1.36", "name": name, "resources": {}, "stdin": true, "tty": true,
                           "targetContainerName": target, "terminationMessagePolicy": "File"});
        if !security.is_null() {
            c["securityContext"] = security;
        }
        json!({"spec": {"ephemeralContainers": [c]}})
    };
    let ephemeral = format!("{path}/ephemeralcontainers");
    let strategic = "application/strategic-merge-patch+json";
    let (status, debugged) = c
        .send(
            reqwest::Method::PATCH,
            &ephemeral,
            strategic,
            debug("debugger-a1", "ray-worker", Value::Null),
        )
        .await;
    assert_eq!(status, 200, "{debugged}");
    let added = container(&debugged, "ephemeralContainers", "debugger-a1");
    assert_eq!(added["imagePullPolicy"], "IfNotPresent");
    assert!(
        added.get("volumeMounts").is_none(),
        "no API token for ephemeral containers"
    );
    assert!(c
        .fake
        .webhook_calls()
        .contains(&"guard.lanyard.dev UPDATE/ephemeralcontainers".to_string()));

    // The general profile's SYS_PTRACE on the sidecar: refused.
    let (status, refused) = c
        .send(
            reqwest::Method::PATCH,
            &ephemeral,
            strategic,
            debug(
                "debugger-b2",
                SIDECAR_NAME,
                json!({"capabilities": {"add": ["SYS_PTRACE"]}}),
            ),
        )
        .await;
    assert_eq!(status, 403, "{refused}");
    let message = refused["message"].as_str().unwrap();
    assert!(message.starts_with("admission webhook \"guard.lanyard.dev\" denied the request: lanyard guard (process-access): ephemeral container \"debugger-b2\""), "{message}");

    // And the registry's own rule: a pod's spec is immutable but for images.
    let (status, invalid) = c
        .send(reqwest::Method::PATCH, path, "application/json-patch+json",
              json!([{"op": "add", "path": "/spec/containers/0/env", "value": [{"name": "X", "value": "1"}]}]))
        .await;
    assert_eq!(status, 422, "{invalid}");
    // An image swapped on the sidecar is a spec change the registry allows
    // and the guard refuses.
    let (status, swapped) = c
        .send(reqwest::Method::PATCH, path, "application/json-patch+json",
              json!([{"op": "replace", "path": "/spec/initContainers/0/image", "value": "attacker.example/lanyard:1"}]))
        .await;
    assert_eq!(status, 403, "{swapped}");
    assert!(
        swapped["message"]
            .as_str()
            .unwrap()
            .contains("lanyard guard (cloud-token-mount)"),
        "{swapped}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_that_cannot_be_reached_refuses_the_pod_with_the_api_servers_text() {
    let c = cluster("mesh-injector").await;
    c.fake
        .set_endpoints("lanyard-system", "lanyard-webhook", vec![]);
    let (status, refused) = c.create("ml", worker("ray-worker-2")).await;
    assert_eq!(status, 500, "{refused}");
    assert_eq!(
        refused["message"],
        "Internal error occurred: failed calling webhook \"inject.lanyard.dev\": failed to call webhook: Post \"https://lanyard-webhook.lanyard-system.svc:443/mutate?timeout=10s\": no endpoints available for service \"lanyard-webhook\""
    );
    // A namespace that does not exist is refused before any webhook.
    let (status, missing) = c.create("nowhere", worker("x")).await;
    assert_eq!(
        (status, missing["message"].as_str()),
        (404, Some("namespaces \"nowhere\" not found"))
    );
}

/// `tests/fixtures/guard/stored.json`: the guard fixtures' `app` base
/// created through the API server with the fixtures' settings and the mesh
/// injector beside Lanyard's webhook: the pod as a cluster stores it (its
/// random values fixed). The guard's fixture tests (Rust, and the chart's
/// policy in CEL) run every case against it as well as against the
/// injected form. `LANYARD_BLESS=1` rewrites it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_fixtures_stored_base_is_what_the_api_server_stores() {
    let cases = support::guard::cases();
    let settings = &cases["settings"];
    let c = cluster_with(
        "mesh-injector",
        support::guard::injection(settings),
        &[
            ("azure.workload.identity/client-id", CLIENT_ID),
            (
                "iam.gke.io/gcp-service-account",
                "ray-worker@ml-data.iam.gserviceaccount.com",
            ),
            (
                "eks.amazonaws.com/role-arn",
                "arn:aws:iam::111122223333:role/ray-worker",
            ),
        ],
    )
    .await;
    let (status, mut stored) = c.create("ml", cases["bases"]["app"].clone()).await;
    assert_eq!(status, 201, "{stored}");
    // What differs from run to run.
    stored["metadata"]["uid"] = json!("6c2f4a8e-0b1d-4e3f-9a5c-7d8e9f0a1b2c");
    stored["metadata"]["creationTimestamp"] = json!("2026-12-07T00:00:00Z");
    stored["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    for list in ["initContainers", "containers"] {
        for container in stored["spec"][list].as_array_mut().unwrap() {
            for var in container["env"].as_array_mut().into_iter().flatten() {
                if var["name"] == "IDENTITY_HEADER" || var["name"] == "MSI_SECRET" {
                    var["value"] = json!("0123456789abcdef0123456789abcdef");
                }
            }
        }
    }
    let path = format!("{}/stored.json", support::guard::DIR);
    if std::env::var_os("LANYARD_BLESS").is_some() {
        std::fs::write(&path, serde_json::to_string_pretty(&stored).unwrap() + "\n").unwrap();
    }
    let want: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        stored, want,
        "{path} is not what the API server stores now; LANYARD_BLESS=1 rewrites it"
    );
    // The stored form: the mesh's container with the API token mounted by
    // the plugin's second run; Lanyard's sidecar exactly as built.
    assert!(mounts(container(&stored, "containers", MESH_CONTAINER))
        .iter()
        .any(|(name, _)| name == "kube-api-access-8k2vd"));
    let typed = serde_json::from_value(stored).unwrap();
    let guard = Guard::new(&c.injection, &support::guard::extra(settings));
    assert_eq!(guard::check(&typed, &guard), Ok(()));
    let again = mutate(&typed, "ml", &support::guard::all_clouds(), &c.injection).unwrap();
    assert!(again.is_empty(), "{:?}", again.patch);
}
