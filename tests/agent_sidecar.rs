//! Node agent and pod sidecar as separate processes: the sidecar serves
//! the SDK surfaces from the pod's token files, the agent verifies each
//! token (issuer, expiry, pod binding, node) and exchanges against the
//! emulators; the sidecar survives the agent going away and coming back.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::Ordering;
use std::time::Duration;

use lanyard_emulators::{Issuer, PodIdentity, SigningKey};
use serde_json::Value;
use support::*;

const NODE: &str = "node-a";

fn agent_config(up: &Upstreams, dir: &Path) -> std::path::PathBuf {
    let yaml = format!(
        r#"
azure:
  authority_host: {entra}
  tenant_id: {TENANT}
gcp:
  workload_identity_provider: "{PROVIDER}"
  project_id: lanyard-test
  sts_endpoint: {gcp}
  iamcredentials_endpoint: {gcp}
aws:
  sts_endpoint: {aws}
cluster:
  issuer: {issuer}
  service_accounts:
    - namespace: default
      name: ray-worker
      annotations:
        azure.workload.identity/client-id: {CLIENT}
        iam.gke.io/gcp-service-account: {GCP_SA}
        eks.amazonaws.com/role-arn: {ROLE}
"#,
        entra = up.entra_url,
        gcp = up.gcp_url,
        aws = up.aws_url,
        issuer = up.issuer.url(),
    );
    let path = dir.join("agent.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Starts `lanyard agent` on `listen` (port 0: any free port) and waits
/// until it serves; returns it and the address of its API.
async fn start_agent(config: &Path, listen: &str) -> (Proc, u16) {
    let mut agent = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_lanyard"))
            .args(["--config", config.to_str().unwrap(), "agent"])
            .args(["--listen", listen])
            .args(["--admin-listen", "127.0.0.1:0", "--node-name", NODE])
            .env("RUST_LOG", "debug")
            .env_remove("LANYARD_CONFIG"),
    );
    let api = agent.addr("lanyard agent serving", "api").await;
    (agent, api.port())
}

/// Starts `lanyard-sidecar` on any free port, backed by the agent at
/// `agent_url`; returns it and its port.
async fn start_sidecar(agent_url: &str, token_dir: &Path) -> (Proc, u16) {
    let mut sidecar = Proc::spawn(
        Command::new(slim_sidecar())
            .args(["--listen", "127.0.0.1:0"])
            .args(["--agent", agent_url])
            .args(["--token-dir", token_dir.to_str().unwrap()])
            .env("IDENTITY_HEADER", IDENTITY_HEADER)
            .env("RUST_LOG", "debug"),
    );
    let addr = sidecar.addr("lanyard sidecar serving", "addr").await;
    (sidecar, addr.port())
}

/// Writes the pod's projected tokens as the kubelet would.
fn write_tokens(issuer: &Issuer, pod: &PodIdentity, dir: &Path) {
    let hour = Duration::from_secs(3600);
    for (file, aud) in [
        ("azure", "api://AzureADTokenExchange"),
        ("gcp", PROVIDER),
        ("aws", "sts.amazonaws.com"),
        ("app", "lanyard"),
    ] {
        std::fs::write(dir.join(file), issuer.mint(pod, &[aud], hour).unwrap()).unwrap();
    }
}

async fn imds(port: u16) -> (u16, Value) {
    imds_for(port, "https://storage.azure.com/").await
}

async fn imds_for(port: u16, resource: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .get(format!(
            "http://127.0.0.1:{port}/metadata/identity/oauth2/token"
        ))
        .query(&[("api-version", "2018-02-01"), ("resource", resource)])
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

struct Setup {
    up: Upstreams,
    dir: tempfile::TempDir,
    config: std::path::PathBuf,
}

async fn setup(pod: &PodIdentity) -> Setup {
    let up = upstreams(&pod.subject(), Duration::from_secs(3600)).await;
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::create_dir(&tokens).unwrap();
    write_tokens(&up.issuer, pod, &tokens);
    let config = agent_config(&up, dir.path());
    Setup { up, dir, config }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_clouds_through_sidecar_and_agent_and_recovery_after_agent_restart() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let s = setup(&pod).await;
    let tokens = s.dir.path().join("tokens");
    let (agent, agent_port) = start_agent(&s.config, "127.0.0.1:0").await;
    let (sidecar, sidecar_port) =
        start_sidecar(&format!("http://127.0.0.1:{agent_port}"), &tokens).await;
    let base = format!("http://127.0.0.1:{sidecar_port}");
    wait_ready(&format!("{base}/readyz")).await;

    let (status, body) = imds(sidecar_port).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["client_id"], CLIENT);
    let first_token = body["access_token"].as_str().unwrap().to_string();

    let gce: Value = reqwest::Client::new()
        .get(format!(
            "{base}/computeMetadata/v1/instance/service-accounts/default/token"
        ))
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(gce["access_token"].as_str().unwrap().starts_with("ya29."));
    let email = reqwest::Client::new()
        .get(format!(
            "{base}/computeMetadata/v1/instance/service-accounts/default/email"
        ))
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(email, GCP_SA);

    let app = std::fs::read_to_string(tokens.join("app")).unwrap();
    let aws = reqwest::Client::new()
        .get(format!("{base}/v1/credentials"))
        .header("Authorization", app.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(aws.status(), 200);
    let aws: Value = aws.json().await.unwrap();
    assert_eq!(aws["AccountId"], "111122223333");

    let msi = reqwest::Client::new()
        .get(format!(
            "{base}/msi/token?api-version=2019-08-01&resource=https://storage.azure.com/"
        ))
        .header("X-IDENTITY-HEADER", IDENTITY_HEADER)
        .send()
        .await
        .unwrap();
    assert_eq!(msi.status(), 200);

    // The agent goes away. The question just answered is answered again
    // from the grant the sidecar keeps for its reuse window (10 s by
    // default, `broker::reuse`); a new question gets a retryable 503 and
    // the sidecar is not ready, never a credential.
    let agent_log = agent.stop();
    assert!(!agent_log.contains(&first_token), "agent logged a token");
    assert!(!agent_log.contains("eyJ"), "agent logged a JWT");
    let (status, body) = imds(sidecar_port).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["access_token"], first_token.as_str());
    let (status, body) = imds_for(sidecar_port, "https://vault.azure.net").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.get("access_token").is_none());
    let ready = reqwest::get(format!("{base}/readyz")).await.unwrap();
    assert_eq!(ready.status(), 503);

    // It comes back on the same address: the sidecar recovers by itself.
    let (agent, _) = start_agent(&s.config, &format!("127.0.0.1:{agent_port}")).await;
    wait_ready(&format!("{base}/readyz")).await;
    let (status, body) = imds_for(sidecar_port, "https://vault.azure.net").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        s.up.entra.stats.issued.load(Ordering::Relaxed),
        2,
        "one exchange for storage (App Service's was a hit), one for the vault"
    );

    let sidecar_log = sidecar.stop();
    assert!(!sidecar_log.contains("eyJ"), "sidecar logged a JWT");
    assert!(!sidecar_log.contains(&first_token));
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_agent_and_a_sidecar_on_both_loopbacks() {
    if std::net::TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: this machine has no IPv6 loopback");
        return;
    }
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let s = setup(&pod).await;
    let tokens = s.dir.path().join("tokens");
    // The agent listens on an IPv6 address only; the sidecar reaches it by
    // a bracketed URL.
    let (agent, agent_port) = start_agent(&s.config, "[::1]:0").await;
    let (mut sidecar, v4_port) =
        start_sidecar(&format!("http://[::1]:{agent_port}"), &tokens).await;
    let v4 = std::net::SocketAddr::from(([127, 0, 0, 1], v4_port));
    let v6 = sidecar.listening("sidecar SDK endpoints (IPv6)").await;
    assert!(v6.ip().is_loopback() && v6.is_ipv6(), "{v6}");
    assert_eq!(v6.port(), v4.port(), "one port on both loopbacks");
    wait_ready(&format!("http://{v4}/readyz")).await;
    for base in [format!("http://{v4}"), format!("http://{v6}")] {
        let resp = reqwest::Client::new()
            .get(format!(
                "{base}/computeMetadata/v1/instance/service-accounts/default/token"
            ))
            .header("Metadata-Flavor", "Google")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{base}");
        let body: Value = resp.json().await.unwrap();
        assert!(body["access_token"].as_str().unwrap().starts_with("ya29."));
    }
    sidecar.stop();
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_refuses_other_node_other_issuer_expired_and_unbound_tokens() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let s = setup(&pod).await;
    let (agent, agent_port) = start_agent(&s.config, "127.0.0.1:0").await;
    let url = format!("http://127.0.0.1:{agent_port}/v1/token");
    wait_ready(&format!("http://127.0.0.1:{agent_port}/healthz")).await;
    let http = reqwest::Client::new();
    let ask = |token: String| {
        let http = http.clone();
        let url = url.clone();
        async move {
            let resp = http
                .post(url)
                .bearer_auth(token)
                .json(&serde_json::json!({"cloud": "azure", "kind": "access_token", "scopes": ["https://storage.azure.com/"], "surface": "azure_imds"}))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let aud = ["api://AzureADTokenExchange"];
    let hour = Duration::from_secs(3600);

    let (status, body) = ask(s.up.issuer.mint(&pod, &aud, hour).unwrap()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["credential"]["type"], "token");

    let elsewhere = PodIdentity::new("default", "ray-worker", "ray-worker-9", "node-b");
    let (status, body) = ask(s.up.issuer.mint(&elsewhere, &aud, hour).unwrap()).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "other_node");

    let rogue = Issuer::new(s.up.issuer.url(), SigningKey::generate_rs256().unwrap());
    let (status, body) = ask(rogue.mint(&pod, &aud, hour).unwrap()).await;
    assert_eq!(status, 401);
    assert!(
        body["error"]["code"] == "signature" || body["error"]["code"] == "unknown_key",
        "{body}"
    );

    let mut claims = s.up.issuer.claims_for(&pod, &aud, Duration::from_secs(600));
    claims.iat -= 7200;
    claims.nbf = Some(claims.iat);
    claims.exp = claims.iat + 600;
    let (status, body) = ask(s.up.issuer.sign(&claims).unwrap()).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "expired");

    let mut claims = s.up.issuer.claims_for(&pod, &aud, hour);
    claims.kubernetes.pod = None;
    let (status, body) = ask(s.up.issuer.sign(&claims).unwrap()).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"]["code"], "not_pod_bound");

    let unbound = PodIdentity::new("default", "someone", "someone-0", NODE);
    let (status, body) = ask(s.up.issuer.mint(&unbound, &aud, hour).unwrap()).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["kind"], "not_bound");

    // Malformed calls.
    let resp = http
        .post(&url)
        .json(
            &serde_json::json!({"cloud": "azure", "kind": "access_token", "surface": "azure_imds"}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "no Authorization");
    let good = s.up.issuer.mint(&pod, &aud, hour).unwrap();
    let resp = http
        .post(&url)
        .bearer_auth(&good)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    // A body in no known shape (here, a per-cloud request kind): 400.
    let resp = http
        .post(&url)
        .bearer_auth(&good)
        .json(&serde_json::json!({"request": "azure_token", "resource": "https://storage.azure.com/"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["kind"], "bad_request");
    let resp = http
        .post(&url)
        .bearer_auth(&good)
        .body(vec![b' '; 64 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 413);

    assert_eq!(
        s.up.entra.stats.issued.load(Ordering::Relaxed),
        1,
        "only the good token was exchanged"
    );
    let log = agent.stop();
    assert!(
        log.contains("other_node") && log.contains("credential refused"),
        "refusals audited"
    );
    assert!(!log.contains("eyJ"), "no JWT in the agent's log");
}

#[test]
fn start_errors_say_what_to_fix() {
    // `lanyard sidecar` and the slim `lanyard-sidecar` take the same flags
    // and fail the same way.
    let sidecar_flags = [
        "--agent",
        "http://127.0.0.1:1",
        "--token-dir",
        "/nonexistent/lanyard",
    ];
    for out in [
        Command::new(env!("CARGO_BIN_EXE_lanyard"))
            .arg("sidecar")
            .args(sidecar_flags)
            .output()
            .unwrap(),
        Command::new(slim_sidecar())
            .args(sidecar_flags)
            .output()
            .unwrap(),
    ] {
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("token directory /nonexistent/lanyard"),
            "{err}"
        );
    }
    let out = Command::new(slim_sidecar())
        .args(["--listen", "not-an-address"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a bad flag value is a usage error"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("listen") && err.contains("command-line flag"),
        "{err}"
    );
    let out = Command::new(slim_sidecar())
        .arg("--token-dir")
        .arg(std::ffi::OsStr::from_bytes(b"/tmp/not-utf8-\xff"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "a non-UTF-8 path is a usage error"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sidecar.token_dir"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("agent.yaml");
    std::fs::write(
        &config,
        "cluster:\n  service_accounts:\n    - {namespace: default, name: sa}\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(["--config", config.to_str().unwrap(), "agent"])
        .args(["--issuer", "http://127.0.0.1:1", "--node-name", NODE])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot load the cluster issuer's keys"));

    // Without a node name, the agent does not start (unless told to run
    // unsafely), naming what to set.
    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(["--config", config.to_str().unwrap(), "agent"])
        .args(["--issuer", "http://127.0.0.1:1"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no node name") && err.contains("NODE_NAME"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(["--config", config.to_str().unwrap(), "agent"])
        .args(["--issuer", "http://127.0.0.1:1", "--insecure-no-node-name"])
        .args(["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"])
        .env_remove("NODE_NAME")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot load the cluster issuer's keys"),
        "{err}"
    );
    assert!(err.contains("tokens are not kept to this node"), "{err}");

    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args([
            "agent",
            "--node-name",
            NODE,
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .env("KUBECONFIG", dir.path().join("missing-kubeconfig"))
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no Kubernetes API"), "{err}");
}

#[test]
fn an_annotation_without_equals_is_a_usage_error() {
    // Both binaries, from the flag and from the environment the flag reads.
    let flag = [
        "--standalone",
        "--annotation",
        "a=b",
        "--annotation",
        "role-arn",
    ];
    for (exe, role) in [
        (slim_sidecar(), None),
        (env!("CARGO_BIN_EXE_lanyard").into(), Some("sidecar")),
    ] {
        let mut cmd = Command::new(exe);
        cmd.args(role);
        let out = cmd.args(flag).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "a usage error");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--annotation") && err.contains("\"role-arn\""),
            "{err}"
        );
    }
    let out = Command::new(slim_sidecar())
        .arg("--standalone")
        .env("LANYARD_SIDECAR_ANNOTATIONS", "a=b,oops")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--annotation") && err.contains("\"oops\""),
        "{err}"
    );
}

/// Standalone mode exchanges with the clouds from the pod: the full
/// binary's `lanyard sidecar --standalone`. The slim binary links no
/// exchanger, and says where standalone mode is instead of starting.
#[test]
fn the_slim_sidecar_sends_standalone_mode_to_the_full_binary() {
    let tokens = tempfile::tempdir().unwrap();
    let out = Command::new(slim_sidecar())
        .args(["--standalone", "--listen", "127.0.0.1:0"])
        .args(["--token-dir", tokens.path().to_str().unwrap()])
        .args([
            "--annotation",
            "eks.amazonaws.com/role-arn=arn:aws:iam::111122223333:role/r",
        ])
        .env_remove("LANYARD_AGENT_URL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "refused at start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lanyard sidecar --standalone"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_sidecar_serves_all_three_clouds() {
    let pod = PodIdentity::new("default", "ray-worker", "ray-worker-0", NODE);
    let s = setup(&pod).await;
    let tokens = s.dir.path().join("tokens");
    let mut sidecar = Proc::spawn(
        Command::new(env!("CARGO_BIN_EXE_lanyard"))
            .args([
                "sidecar",
                "--config",
                s.config.to_str().unwrap(),
                "--standalone",
            ])
            .args(["--listen", "127.0.0.1:0"])
            .args(["--token-dir", tokens.to_str().unwrap()])
            .args(["--probe-listen", "127.0.0.1:0"])
            .args([
                "--annotation",
                &format!("azure.workload.identity/client-id={CLIENT}"),
            ])
            .args([
                "--annotation",
                &format!("iam.gke.io/gcp-service-account={GCP_SA}"),
            ])
            .args([
                "--annotation",
                &format!("eks.amazonaws.com/role-arn={ROLE}"),
            ])
            .env("RUST_LOG", "debug")
            .env_remove("LANYARD_AGENT_URL"),
    );
    let sidecar_port = sidecar.addr("lanyard sidecar serving", "addr").await.port();
    let probe_port = sidecar.listening("sidecar probes").await.port();
    let base = format!("http://127.0.0.1:{sidecar_port}");
    wait_ready(&format!("{base}/readyz")).await;

    let (status, body) = imds(sidecar_port).await;
    assert_eq!(status, 200, "{body}");
    // The probe listener answers probes and nothing else.
    wait_ready(&format!("http://127.0.0.1:{probe_port}/readyz")).await;
    let (status, _) = imds(probe_port).await;
    assert_eq!(status, 404, "no SDK surface on the probe port");
    let gce = reqwest::Client::new()
        .get(format!(
            "{base}/computeMetadata/v1/instance/service-accounts/default/token"
        ))
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .unwrap();
    assert_eq!(gce.status(), 200);
    let app = std::fs::read_to_string(tokens.join("app")).unwrap();
    let aws = reqwest::Client::new()
        .get(format!("{base}/v1/credentials"))
        .header("Authorization", app.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(aws.status(), 200);
    assert_eq!(s.up.entra.stats.issued.load(Ordering::Relaxed), 1);
    assert_eq!(s.up.gcp.stats.iam_issued.load(Ordering::Relaxed), 1);
    assert_eq!(s.up.aws.stats.issued.load(Ordering::Relaxed), 1);

    // The kubelet writes an expired token (say, the node clock jumped):
    // refused locally, never sent upstream.
    let mut claims = s.up.issuer.claims_for(
        &pod,
        &["api://AzureADTokenExchange"],
        Duration::from_secs(600),
    );
    claims.iat -= 7200;
    claims.nbf = Some(claims.iat);
    claims.exp = claims.iat + 600;
    std::fs::write(tokens.join("azure"), s.up.issuer.sign(&claims).unwrap()).unwrap();
    tokio::time::sleep(Duration::from_millis(5200)).await; // past the re-read interval
    let resp = reqwest::Client::new()
        .get(format!("{base}/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://vault.azure.net"))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert_eq!(s.up.entra.stats.requests.load(Ordering::Relaxed), 1);
    let log = sidecar.stop();
    assert!(!log.contains("eyJ"));
}
