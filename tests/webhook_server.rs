//! The webhook's HTTPS server: real AdmissionReviews over TLS, the
//! ServiceAccount looked up (with a retry for one created a moment after
//! the review arrives), malformed input answered, the certificate
//! reloaded when its files are replaced, in-flight reviews drained on stop,
//! and `lanyard webhook` unready until its ServiceAccount list arrives.

mod support;

use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use lanyard::directory::file::{ServiceAccountEntry, StaticDirectory};
use lanyard::directory::{Bindings, Directory, DirectoryError};
use lanyard::webhook::guard::Guard;
use lanyard::webhook::server::{TlsFiles, WebhookServer};
use lanyard::webhook::InjectionConfig;
use serde_json::Value;
use support::fixture;

struct Pki {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
}

/// A CA and a serving certificate for 127.0.0.1/localhost.
fn pki() -> Pki {
    pki_until(None)
}

/// As [`pki`], the serving certificate valid until `not_after` (Unix
/// seconds) when given.
fn pki_until(not_after: Option<i64>) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()]).unwrap();
    if let Some(t) = not_after {
        params.not_after = time::OffsetDateTime::from_unix_timestamp(t).unwrap();
    }
    let cert = params.signed_by(&key, &issuer).unwrap();
    Pki {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

fn client(ca_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(ca_pem.as_bytes()).unwrap()])
        .build()
        .unwrap()
}

/// A directory whose ServiceAccounts appear after a delay, as one created
/// moments before its pod might.
struct LateDirectory {
    inner: StaticDirectory,
    visible_after: tokio::time::Instant,
}

#[async_trait::async_trait]
impl Directory for LateDirectory {
    async fn lookup(
        &self,
        ns: &str,
        name: &str,
    ) -> Result<Option<std::sync::Arc<Bindings>>, DirectoryError> {
        if tokio::time::Instant::now() < self.visible_after {
            return Ok(None);
        }
        self.inner.lookup(ns, name).await
    }
}

/// The audit trail a webhook writes: the chained file at `path`.
fn audit_file_sink(
    path: &std::path::Path,
    metrics: Arc<lanyard::telemetry::metrics::Metrics>,
) -> lanyard::audit::sinks::Sinks {
    use lanyard::audit::file::{FileOptions, FileSink};
    use lanyard::audit::record::Origin;
    let origin = Arc::new(Origin::new("test", "", "webhook"));
    let options = FileOptions {
        path: path.to_path_buf(),
        max_bytes: 1 << 20,
        max_age: Duration::from_secs(3600),
        keep: 2,
        fsync: true,
        handling: "refused",
        checkpoint_every: None,
    };
    let file = FileSink::open(options, origin.clone(), metrics.clone()).unwrap();
    lanyard::audit::sinks::Sinks::new(origin, Default::default(), metrics).with_file(file)
}

async fn start(dir: &std::path::Path, pki: &Pki, delay: Duration) -> WebhookServer {
    start_with_metrics(
        dir,
        pki,
        delay,
        Arc::new(lanyard::telemetry::metrics::Metrics::new()),
    )
    .await
}

async fn start_with_metrics(
    dir: &std::path::Path,
    pki: &Pki,
    delay: Duration,
    metrics: Arc<lanyard::telemetry::metrics::Metrics>,
) -> WebhookServer {
    let cert = dir.join("tls.crt");
    let key = dir.join("tls.key");
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    std::fs::write(&key, &pki.key_pem).unwrap();
    let accounts = [ServiceAccountEntry {
        labels: Default::default(),
        namespace: "ml".into(),
        name: "raycluster-kuberay".into(),
        annotations: [(
            "azure.workload.identity/client-id".to_string(),
            "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21".to_string(),
        )]
        .into_iter()
        .collect(),
    }];
    let directory = Arc::new(LateDirectory {
        inner: StaticDirectory::new(&accounts),
        visible_after: tokio::time::Instant::now() + delay,
    });
    let injection = InjectionConfig {
        sidecar_image: "registry.example/lanyard:test".into(),
        sdk: lanyard::serve::sdk_env::SdkDefaults {
            azure_tenant_id: Some("3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b".into()),
            aws_region: Some("us-east-1".into()),
            gcp_universe_domain: None,
        },
        ..Default::default()
    };
    WebhookServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TlsFiles {
            cert,
            key,
            reload_every: Duration::from_millis(200),
        },
        injection.clone(),
        Guard::new(&injection, &[]),
        directory,
        metrics.clone(),
        Arc::new(audit_file_sink(&dir.join("audit.jsonl"), metrics)),
    )
    .await
    .unwrap()
}

async fn review(client: &reqwest::Client, addr: std::net::SocketAddr, body: Vec<u8>) -> Value {
    let resp = client
        .post(format!("https://127.0.0.1:{}/mutate", addr.port()))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutates_over_tls_and_retries_a_late_service_account() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    // The ServiceAccount shows up 400 ms after the review: within the retry.
    let metrics = Arc::new(lanyard::telemetry::metrics::Metrics::new());
    let server = start_with_metrics(
        dir.path(),
        &pki,
        Duration::from_millis(400),
        metrics.clone(),
    )
    .await;
    let client = client(&pki.ca_pem);
    let answer = review(&client, server.addr, fixture("kuberay_head_create.json")).await;
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(
        answer["response"]["uid"],
        "0d6a3f27-5b8e-4c41-9e0f-2a7c9b1d4e53"
    );
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    let patch = base64::engine::general_purpose::STANDARD
        .decode(answer["response"]["patch"].as_str().unwrap())
        .unwrap();
    let patch: Value = serde_json::from_slice(&patch).unwrap();
    assert!(
        patch.as_array().unwrap().iter().any(|op| op["path"]
            .as_str()
            .unwrap()
            .starts_with("/spec/initContainers")),
        "{patch}"
    );

    // Malformed and unexpected input: clear answers, never a crash.
    let answer = review(&client, server.addr, b"{not json".to_vec()).await;
    assert!(answer["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("not JSON"));
    let answer = review(&client, server.addr, fixture("pod_delete.json")).await;
    assert_eq!(answer["response"]["allowed"], true);
    assert!(answer["response"].get("patch").is_none());
    let big = vec![b' '; 3 * 1024 * 1024 + 10];
    let answer = review(&client, server.addr, big).await;
    assert!(
        answer["response"]["status"]["message"]
            .as_str()
            .unwrap()
            .contains("limit"),
        "{answer}"
    );
    let get = client
        .get(format!("https://127.0.0.1:{}/mutate", server.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 405);
    let text = metrics.render();
    assert!(
        text.contains("lanyard_admissions_total{decision=\"inject\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("lanyard_admissions_total{decision=\"unchanged\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("lanyard_admissions_total{decision=\"error\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("lanyard_admission_latency_seconds_count 4"),
        "{text}"
    );
    server.stop().await;
    // The opted-in pod's admission is in the audit trail; reviews of pods
    // that did not opt in, and malformed ones, are not admissions.
    let text = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    let records: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(records.len(), 1, "{text}");
    let r = &records[0];
    assert_eq!(r["type"], "admission");
    assert_eq!(r["role"], "webhook");
    assert_eq!(r["decision"], "inject");
    assert_eq!(r["review_uid"], "0d6a3f27-5b8e-4c41-9e0f-2a7c9b1d4e53");
    assert_eq!(r["pod"]["namespace"], "ml");
    assert_eq!(r["pod"]["service_account"], "raycluster-kuberay");
    assert!(
        r["clouds"]
            .as_array()
            .unwrap()
            .contains(&Value::from("azure")),
        "{r}"
    );
}

/// `lanyard_webhook_certificate_expiry_timestamp_seconds` now.
fn expiry(metrics: &lanyard::telemetry::metrics::Metrics) -> i64 {
    let text = metrics.render();
    let line = text
        .lines()
        .find(|l| l.starts_with("lanyard_webhook_certificate_expiry_timestamp_seconds "))
        .unwrap_or_else(|| panic!("no expiry gauge in:\n{text}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_the_certificate_expiry_and_follows_rotations() {
    let dir = tempfile::tempdir().unwrap();
    let (t1, t2) = (4_102_444_800, 4_133_980_800); // 2100-01-01, 2101-01-01
    let first = pki_until(Some(t1));
    let metrics = Arc::new(lanyard::telemetry::metrics::Metrics::new());
    let server = start_with_metrics(dir.path(), &first, Duration::ZERO, metrics.clone()).await;
    assert_eq!(expiry(&metrics), t1);

    // The renewed certificate's expiry once it is loaded.
    let second = pki_until(Some(t2));
    std::fs::write(dir.path().join("tls.key"), &second.key_pem).unwrap();
    std::fs::write(dir.path().join("tls.crt"), &second.cert_pem).unwrap();
    // Up to 20 s: the reload is checked every few hundred milliseconds,
    // later on a loaded machine.
    for _ in 0..200 {
        if expiry(&metrics) == t2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(expiry(&metrics), t2);

    // A pair that is refused leaves the one in use, and its expiry.
    std::fs::write(dir.path().join("tls.crt"), "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(expiry(&metrics), t2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_a_rotated_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let first = pki();
    let server = start(dir.path(), &first, Duration::ZERO).await;
    let old_client = client(&first.ca_pem);
    review(&old_client, server.addr, fixture("pod_delete.json")).await;

    // cert-manager writes a new pair from another CA.
    let second = pki();
    std::fs::write(dir.path().join("tls.key"), &second.key_pem).unwrap();
    std::fs::write(dir.path().join("tls.crt"), &second.cert_pem).unwrap();
    let new_client = client(&second.ca_pem);
    let mut reloaded = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let ok = new_client
            .post(format!("https://127.0.0.1:{}/mutate", server.addr.port()))
            .body(fixture("pod_delete.json"))
            .send()
            .await
            .is_ok();
        if ok {
            reloaded = true;
            break;
        }
    }
    assert!(reloaded, "the new certificate was never served");
    // A fresh connection that trusts only the old CA now fails.
    let old_again = client(&first.ca_pem);
    assert!(old_again
        .post(format!("https://127.0.0.1:{}/mutate", server.addr.port()))
        .body(fixture("pod_delete.json"))
        .send()
        .await
        .is_err());

    // A broken pair is refused and the current one kept.
    std::fs::write(dir.path().join("tls.crt"), "not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    review(&new_client, server.addr, fixture("pod_delete.json")).await;
    server.stop().await;

    // Both are in the audit trail: the new certificate by fingerprint of
    // its file (never the key), the refused one with its error, once.
    let records: Vec<Value> = std::fs::read_to_string(dir.path().join("audit.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &Value| r["type"] == "config_reload")
        .collect();
    let loaded: Vec<&Value> = records.iter().filter(|r| r["result"] == "loaded").collect();
    let (last_loaded, _) = loaded.split_last().expect("a loaded record");
    assert_eq!(last_loaded["what"], "webhook_tls");
    assert_eq!(
        last_loaded["fingerprint"],
        lanyard::secret::fingerprint(&second.cert_pem)
    );
    assert!(last_loaded["source"].as_str().unwrap().ends_with("tls.crt"));
    // After the last load, the broken pair: one record, though it stayed
    // broken for several checks.
    let after: Vec<&Value> = records
        .iter()
        .skip_while(|r| !std::ptr::eq(*r, *last_loaded))
        .skip(1)
        .collect();
    assert_eq!(after.len(), 1, "{records:?}");
    assert_eq!(after[0]["result"], "rejected");
    assert!(after[0]["error"].as_str().is_some_and(|e| !e.is_empty()));
    let text = std::fs::read_to_string(dir.path().join("audit.jsonl")).unwrap();
    assert!(!text.contains("PRIVATE KEY") && !text.contains(second.key_pem.trim()));
}

/// A directory that cannot be read.
struct BrokenDirectory;

#[async_trait::async_trait]
impl Directory for BrokenDirectory {
    async fn lookup(
        &self,
        _: &str,
        _: &str,
    ) -> Result<Option<std::sync::Arc<Bindings>>, DirectoryError> {
        Err(DirectoryError("API server unreachable".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_service_account_denies_rather_than_admitting_without_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    let cert = dir.path().join("tls.crt");
    let key = dir.path().join("tls.key");
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    std::fs::write(&key, &pki.key_pem).unwrap();
    let server = WebhookServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TlsFiles {
            cert,
            key,
            reload_every: Duration::from_secs(10),
        },
        InjectionConfig {
            sidecar_image: "registry.example/lanyard:test".into(),
            ..Default::default()
        },
        Guard::new(&InjectionConfig::default(), &[]),
        Arc::new(BrokenDirectory),
        Arc::new(lanyard::telemetry::metrics::Metrics::new()),
        Arc::new(lanyard::audit::LogSink),
    )
    .await
    .unwrap();
    let answer = review(
        &client(&pki.ca_pem),
        server.addr,
        fixture("kuberay_head_create.json"),
    )
    .await;
    assert_eq!(answer["response"]["allowed"], false);
    assert_eq!(answer["response"]["status"]["code"], 503);
    assert!(answer["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("raycluster-kuberay"));
    // A pod that did not opt in is admitted untouched, API or no API.
    let body = String::from_utf8(fixture("kuberay_head_create.json"))
        .unwrap()
        .replace(
            "\"lanyard.dev/inject\": \"true\"",
            "\"lanyard.dev/inject\": \"false\"",
        );
    let answer = review(&client(&pki.ca_pem), server.addr, body.into_bytes()).await;
    assert_eq!(answer["response"]["allowed"], true, "{answer}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_drains_a_review_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    // The ServiceAccount appears only after 800 ms, so the review is still
    // retrying its lookup when `stop` is called.
    let metrics = Arc::new(lanyard::telemetry::metrics::Metrics::new());
    let server = start_with_metrics(
        dir.path(),
        &pki,
        Duration::from_millis(800),
        metrics.clone(),
    )
    .await;
    let addr = server.addr;
    let http = client(&pki.ca_pem);
    let in_flight = tokio::spawn({
        let http = http.clone();
        async move {
            http.post(format!("https://127.0.0.1:{}/mutate", addr.port()))
                .header("content-type", "application/json")
                .body(fixture("kuberay_head_create.json"))
                .send()
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!in_flight.is_finished(), "the review is in flight");
    server.stop().await;
    // `stop` returned only once the review was answered (the process may
    // exit right after it, which would cut off anything still running).
    let text = metrics.render();
    assert!(
        text.contains("lanyard_admissions_total{decision=\"inject\"} 1"),
        "answered before stop returned: {text}"
    );

    let resp = in_flight.await.unwrap().expect("answered, not cut off");
    assert_eq!(resp.status(), 200);
    let answer: Value = resp.json().await.unwrap();
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch", "{answer}");
    // Stopped: nothing new is accepted.
    assert!(client(&pki.ca_pem)
        .post(format!("https://127.0.0.1:{}/mutate", addr.port()))
        .body(fixture("pod_delete.json"))
        .send()
        .await
        .is_err());
}

#[cfg(feature = "dev")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_until_the_service_account_list_arrives() {
    use lanyard_emulators::{Issuer, SigningKey};
    use lanyard_fake_kube::FakeKube;
    use support::{eventually_answers, get_status, serve_router, Proc};

    let issuer = Arc::new(Issuer::new(
        "https://issuer.lanyard.test",
        SigningKey::generate_rs256().unwrap(),
    ));
    let kube = FakeKube::new(issuer.url(), issuer.key().jwk(), "webhook-kube-token");
    let (kube_url, _trigger) = serve_router(kube.router(), "fake kube").await;
    kube.hold_lists(true);

    let dir = tempfile::tempdir().unwrap();
    let pki = pki();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &pki.cert_pem).unwrap();
    std::fs::write(&key, &pki.key_pem).unwrap();
    std::fs::write(dir.path().join("kubeconfig"), kube.kubeconfig(&kube_url)).unwrap();
    let mut webhook = Proc::spawn(
        std::process::Command::new(env!("CARGO_BIN_EXE_lanyard"))
            .arg("webhook")
            .args(["--listen", "127.0.0.1:0"])
            .args(["--admin-listen", "127.0.0.1:0"])
            .args(["--sidecar-image", "registry.example/lanyard:test"])
            .arg("--tls-cert")
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .env("KUBECONFIG", dir.path().join("kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("LANYARD_CONFIG")
            .env("RUST_LOG", "info"),
    );
    let admin = webhook.listening("admin endpoints").await;
    let readyz = format!("http://{admin}/readyz");
    let eventually = |want: u16| eventually_answers(&readyz, want);
    // `lanyard_ready` says the same to Prometheus.
    let ready_metric = || async {
        let (_, text) = get_status(&format!("http://{admin}/metrics"))
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("lanyard_ready ").map(str::to_string))
            .unwrap_or_else(|| panic!("no lanyard_ready in:\n{text}"))
    };

    // Held: the admin port says what is awaited.
    let body = eventually(503).await;
    assert!(body.contains("ServiceAccount list synced"), "{body}");
    assert!(body.contains("TLS certificate loaded"), "{body}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        get_status(&readyz).await.map(|(s, _)| s),
        Some(503),
        "still held"
    );
    assert_eq!(ready_metric().await, "0");

    // Released: ready, and reviews are answered.
    kube.hold_lists(false);
    assert_eq!(eventually(200).await, "ready");
    assert_eq!(ready_metric().await, "1");
    let addr = webhook.addr("lanyard webhook serving", "addr").await;
    let answer = review(&client(&pki.ca_pem), addr, fixture("pod_delete.json")).await;
    assert_eq!(answer["response"]["allowed"], true);
}
