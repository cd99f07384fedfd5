//! `lanyard doctor` as a user runs it: the binary, with only a kubeconfig
//! for a (fake) API server and the agent's configuration file, on pods the
//! real mutation injected. A healthy pod passes and gets its trust; each
//! broken case (not opted in, not injected, a token for the wrong
//! audience, no ready agent on the node, a refusal the agent recorded, a ServiceAccount that names no identity or does not exist, an
//! issuer configured with another trailing slash) fails with its check
//! named and a fix; a bad target or configuration exits 2.
// Needs the `dev` feature (the emulators' signing key for the fake's
// discovery document).
#![cfg(feature = "dev")]

mod support;

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use lanyard::cloud::Bindings;
use lanyard::config::Config;
use lanyard::webhook::{mutate, InjectionConfig};
use lanyard_emulators::SigningKey;
use lanyard_fake_kube::FakeKube;
use serde_json::Value;
use support::serve_router;

const TOKEN: &str = "doctor-kube-token";
/// An AKS-style issuer: it ends with '/'.
const ISSUER: &str = "https://oidc.prod-aks.azure.com/00000000-0000-0000-0000-00000000000a/11111111-0000-0000-0000-00000000000b/";
const CLIENT: &str = "22222222-3333-4444-5555-666666666666";
const ROLE: &str = "arn:aws:iam::111122223333:role/ray/reader";

struct Cluster {
    kube: Arc<FakeKube>,
    dir: tempfile::TempDir,
    _trigger: lanyard::http::ShutdownTrigger,
}

async fn cluster(config_yaml: &str) -> Cluster {
    let key = SigningKey::generate_rs256().unwrap();
    let kube = FakeKube::new(ISSUER, key.jwk(), TOKEN);
    let (url, trigger) = serve_router(kube.router(), "fake kube").await;
    let dir = tempfile::tempdir().unwrap();
    // The user's kubeconfig (an administrator's), and the agent's (its
    // least privilege: it may create Events, not list them).
    kube.set_admin_token("doctor-admin-token");
    std::fs::write(
        dir.path().join("kubeconfig"),
        kube.admin_kubeconfig(&url).unwrap(),
    )
    .unwrap();
    std::fs::write(dir.path().join("agent.kubeconfig"), kube.kubeconfig(&url)).unwrap();
    std::fs::write(dir.path().join("agent.yaml"), config_yaml).unwrap();
    kube.apply_pod(agent_pod("node-a", true));
    kube.apply_pod(agent_pod("node-b", false));
    Cluster {
        kube,
        dir,
        _trigger: trigger,
    }
}

fn service_account(ns: &str, name: &str, annotations: &[(&str, &str)]) -> ServiceAccount {
    ServiceAccount {
        metadata: ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{ns}-{name}")),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// Lanyard's agent pod on `node`, as the chart's DaemonSet makes it.
fn agent_pod(node: &str, ready: bool) -> Pod {
    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    let labels = [
        ("app.kubernetes.io/name", "lanyard"),
        ("app.kubernetes.io/instance", "lanyard"),
        ("app.kubernetes.io/component", "agent"),
    ];
    Pod {
        metadata: ObjectMeta {
            namespace: Some("lanyard-system".into()),
            name: Some(format!("lanyard-agent-{node}")),
            uid: Some(format!("uid-agent-{node}")),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "agent".into(),
                image: Some("lanyard:0.1.0".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready { "True" } else { "False" }.into(),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

/// A pod of `sa`, labelled to opt in when `opted_in`, as the user wrote it.
fn written_pod(ns: &str, name: &str, sa: &str, opted_in: bool) -> Pod {
    Pod {
        metadata: ObjectMeta {
            namespace: Some(ns.into()),
            name: Some(name.into()),
            uid: Some(format!("uid-{name}")),
            labels: opted_in
                .then(|| [("lanyard.dev/inject".to_string(), "true".to_string())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node-a".into()),
            service_account_name: Some(sa.into()),
            containers: vec![Container {
                name: "ray-worker".into(),
                image: Some("rayproject/ray:2.40.0".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The pod as Lanyard's mutation leaves it for `config` and `sa`'s
/// annotations (the JSON Patch applied as the API server applies it).
fn injected(pod: &Pod, config: &Config, sa: &ServiceAccount) -> Pod {
    let bindings = Bindings::from_annotations(&sa.metadata.annotations.clone().unwrap_or_default());
    let ns = pod.metadata.namespace.clone().unwrap();
    let mutation = mutate(pod, &ns, &bindings, &InjectionConfig::from_config(config)).unwrap();
    let mut doc = serde_json::to_value(pod).unwrap();
    let patch: json_patch::Patch =
        serde_json::from_value(serde_json::to_value(&mutation.patch).unwrap()).unwrap();
    json_patch::patch(&mut doc, &patch).unwrap();
    serde_json::from_value(doc).unwrap()
}

impl Cluster {
    fn doctor(&self, args: &[&str]) -> (i32, String, String) {
        let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
            .arg("--config")
            .arg(self.dir.path().join("agent.yaml"))
            .arg("doctor")
            .args(args)
            .env("KUBECONFIG", self.dir.path().join("kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Records the agent's Event for a refusal of `pod`, through the API
    /// as the agent does.
    async fn record_refusal(&self, pod: &Pod, note: &str) {
        use k8s_openapi::api::core::v1::ObjectReference;
        use kube::runtime::events::{Event, EventType, Recorder, Reporter};
        let kubeconfig =
            kube::config::Kubeconfig::read_from(self.dir.path().join("agent.kubeconfig")).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        let client = kube::Client::try_from(config).unwrap();
        let reporter = Reporter {
            controller: lanyard::pod_events::CONTROLLER.into(),
            instance: Some("lanyard-agent-node-a".into()),
        };
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: pod.metadata.namespace.clone(),
            name: pod.metadata.name.clone(),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: lanyard::pod_events::REASON.into(),
            note: Some(note.into()),
            action: lanyard::pod_events::ACTION.into(),
            secondary: None,
        };
        Recorder::new(client, reporter)
            .publish(&event, &reference)
            .await
            .unwrap();
    }

    /// The agent's configuration, as the doctor loads it.
    fn config(&self) -> Config {
        Config::load(
            Some(&self.dir.path().join("agent.yaml")),
            serde_json::json!({}),
        )
        .unwrap()
    }

    /// `ray/worker` with `annotations`, and its pod `ray/worker-0` as the
    /// mutation injects it; the configuration and the ServiceAccount.
    fn bound_worker(&self, annotations: &[(&str, &str)]) -> (Config, ServiceAccount) {
        let config = self.config();
        let sa = service_account("ray", "worker", annotations);
        self.kube.apply_service_account(sa.clone());
        self.kube.apply_pod(injected(
            &written_pod("ray", "worker-0", "worker", true),
            &config,
            &sa,
        ));
        (config, sa)
    }

    fn json(&self, args: &[&str]) -> (i32, Value) {
        let mut all = args.to_vec();
        all.extend(["--output", "json"]);
        let (code, stdout, stderr) = self.doctor(&all);
        let report =
            serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout} {stderr}"));
        (code, report)
    }
}

fn config_yaml() -> &'static str {
    "azure:\n  tenant_id: 00000000-0000-0000-0000-00000000000a\n"
}

fn failed(report: &Value) -> Vec<(String, String)> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["status"] == "fail")
        .map(|f| {
            (
                f["check"].as_str().unwrap().to_string(),
                f["cloud"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_pod_passes_and_gets_each_clouds_exact_trust() {
    let c = cluster(config_yaml()).await;
    c.bound_worker(&[
        ("azure.workload.identity/client-id", CLIENT),
        ("eks.amazonaws.com/role-arn", ROLE),
    ]);

    let (code, report) = c.json(&["pod", "ray/worker-0"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(report["version"], 1);
    assert_eq!(report["ok"], true);
    assert_eq!(report["issuer"], ISSUER);
    assert_eq!(report["target"]["service_account"], "ray/worker");
    let checks: Vec<&str> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["check"].as_str().unwrap())
        .collect();
    for want in [
        "pod",
        "opted-in",
        "sidecar",
        "token-audience",
        "agent",
        "serviceaccount",
        "binding",
        "issuer",
        "trust",
    ] {
        assert!(checks.contains(&want), "{want} missing from {checks:?}");
    }
    let trust = report["trust"].as_array().unwrap();
    assert_eq!(trust.len(), 2);
    let azure = &trust[0];
    assert_eq!(azure["cloud"], "azure");
    assert_eq!(
        azure["issuer"], ISSUER,
        "the issuer as the cluster says it, slash and all"
    );
    assert_eq!(azure["subject"], "system:serviceaccount:ray:worker");
    assert_eq!(azure["audience"], "api://AzureADTokenExchange");
    assert!(azure["commands"][1]
        .as_str()
        .unwrap()
        .starts_with("az identity federated-credential create"));
    let aws = &trust[1];
    assert_eq!(aws["cloud"], "aws");
    let provider = ISSUER.trim_start_matches("https://").trim_end_matches('/');
    assert_eq!(
        aws["document"]["Statement"][0]["Condition"]["StringEquals"][format!("{provider}:sub")],
        "system:serviceaccount:ray:worker"
    );
    assert_eq!(
        aws["document"]["Statement"][0]["Condition"]["StringEquals"][format!("{provider}:aud")],
        "sts.amazonaws.com"
    );

    // The table says the same for a person.
    let (code, table, _) = c.doctor(&["pod", "ray/worker-0"]);
    assert_eq!(code, 0);
    assert!(
        table.starts_with("lanyard doctor: pod ray/worker-0 (ServiceAccount ray/worker)"),
        "{table}"
    );
    assert!(
        table.contains("$ az identity federated-credential create"),
        "{table}"
    );
    assert!(table.ends_with("No problem found.\n"), "{table}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_broken_case_is_named_with_its_fix() {
    let c = cluster(config_yaml()).await;
    let config = c.config();
    let bound = service_account(
        "ray",
        "worker",
        &[("azure.workload.identity/client-id", CLIENT)],
    );
    c.kube.apply_service_account(bound.clone());
    c.kube.apply_service_account(service_account(
        "ray",
        "unbound",
        &[("lanyard.dev/azure-clientid", CLIENT)],
    ));

    // Not opted in: the webhook left it alone.
    c.kube
        .apply_pod(written_pod("ray", "plain", "worker", false));
    // Opted in, but created while the webhook was away.
    c.kube
        .apply_pod(written_pod("ray", "missed", "worker", true));
    // Injected by a webhook configured with another Azure audience than
    // the agent's.
    let mut other = config.clone();
    other.azure.audience = "api://SomethingElse".into();
    c.kube.apply_pod(injected(
        &written_pod("ray", "stale", "worker", true),
        &other,
        &bound,
    ));
    // Its ServiceAccount names no identity (a typo in the annotation).
    let unbound = written_pod("ray", "unbound-0", "unbound", true);
    c.kube.apply_pod(unbound);
    // Its ServiceAccount does not exist.
    c.kube
        .apply_pod(written_pod("ray", "orphan", "nobody", true));
    // On a node whose agent is not ready.
    let mut stranded = injected(
        &written_pod("ray", "stranded", "worker", true),
        &config,
        &bound,
    );
    stranded.spec.as_mut().unwrap().node_name = Some("node-b".into());
    c.kube.apply_pod(stranded);

    // Injected and healthy, but the agent recorded Entra's refusal on it,
    // as the agent records one (kube's Recorder, events.k8s.io/v1).
    let refused = injected(
        &written_pod("ray", "refused", "worker", true),
        &config,
        &bound,
    );
    c.kube.apply_pod(refused.clone());
    c.record_refusal(
        &refused,
        &format!("azure access token for identity {CLIENT} was refused: AADSTS700213: No matching federated identity record found for presented assertion subject 'system:serviceaccount:ray:worker'"),
    )
    .await;

    let cases: [(&str, &[(&str, &str)]); 7] = [
        ("refused", &[("refusal", "azure")]),
        ("plain", &[("opted-in", "")]),
        ("stranded", &[("agent", "")]),
        ("missed", &[("sidecar", "")]),
        ("stale", &[("token-audience", "azure")]),
        ("unbound-0", &[("binding", "")]),
        ("orphan", &[("serviceaccount", "")]),
    ];
    for (pod, want) in cases {
        let (code, report) = c.json(&["pod", &format!("ray/{pod}")]);
        assert_eq!(code, 1, "{pod}: {report:#}");
        assert_eq!(report["ok"], false);
        let got = failed(&report);
        for (check, cloud) in want {
            assert!(
                got.contains(&(check.to_string(), cloud.to_string())),
                "{pod}: want {check} in {got:?}"
            );
        }
        for f in report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["status"] == "fail")
        {
            assert!(
                f["fix"].as_str().is_some_and(|s| !s.is_empty()),
                "{pod}: no fix in {f}"
            );
        }
    }
    // The refusal is explained by its code.
    let (_, report) = c.json(&["pod", "ray/refused"]);
    let refusal = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "refusal")
        .unwrap();
    assert!(
        refusal["message"]
            .as_str()
            .unwrap()
            .contains("AADSTS700213"),
        "{refusal}"
    );
    assert!(
        refusal["fix"].as_str().unwrap().contains("subject"),
        "{refusal}"
    );

    // The typo is named too.
    let (_, report) = c.json(&["serviceaccount", "ray/unbound"]);
    let warned: Vec<&Value> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == "annotation")
        .collect();
    assert_eq!(warned.len(), 1, "{report:#}");
    assert!(warned[0]["message"]
        .as_str()
        .unwrap()
        .contains("lanyard.dev/azure-clientid"));

    // No such pod.
    let (code, report) = c.json(&["pod", "ray/ghost"]);
    assert_eq!(code, 1);
    assert_eq!(failed(&report), vec![("pod".to_string(), String::new())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_decides_as_the_agent_would() {
    let c = cluster(config_yaml()).await;
    let (config, sa) = c.bound_worker(&[
        ("azure.workload.identity/client-id", CLIENT),
        ("eks.amazonaws.com/role-arn", ROLE),
    ]);
    let mut untrusted = written_pod("ray", "untrusted-0", "worker", true);
    untrusted
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert("tier".into(), "untrusted".into());
    c.kube.apply_pod(injected(&untrusted, &config, &sa));
    // The repository's example: everything bound, but nothing for pods
    // labelled tier=untrusted.
    let policies = c.dir.path().join("policies");
    std::fs::create_dir(&policies).unwrap();
    let example = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("policies/untrusted-pods/untrusted-pods.cedar");
    std::fs::copy(example, policies.join("untrusted-pods.cedar")).unwrap();
    let dir = policies.to_str().unwrap();

    let (code, report) = c.json(&["pod", "ray/worker-0", "--policy-dir", dir]);
    assert_eq!(code, 0, "{report:#}");
    let verdicts: Vec<&Value> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == "policy")
        .collect();
    assert_eq!(verdicts.len(), 2, "one per identity: {verdicts:?}");
    for v in &verdicts {
        assert_eq!(v["status"], "ok");
        assert!(
            v["message"]
                .as_str()
                .unwrap()
                .contains("allowed by allow-bound"),
            "{v}"
        );
    }

    let (code, report) = c.json(&["pod", "ray/untrusted-0", "--policy-dir", dir]);
    assert_eq!(code, 1);
    let denied: Vec<&Value> = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["check"] == "policy" && f["status"] == "fail")
        .collect();
    assert_eq!(denied.len(), 2, "{report:#}");
    assert!(denied.iter().all(|f| f["message"]
        .as_str()
        .unwrap()
        .contains("untrusted-pods-get-nothing")));
    assert_eq!(denied[0]["cloud"], "azure");
    assert_eq!(denied[1]["cloud"], "aws");

    // A directory that is not here is said, not guessed.
    let (_, report) = c.json(&[
        "pod",
        "ray/worker-0",
        "--policy-dir",
        "/nonexistent/policies",
    ]);
    let missing = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "policy")
        .unwrap();
    assert_eq!(missing["status"], "warn");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_it_may_not_make_are_warnings_not_failures() {
    let c = cluster(config_yaml()).await;
    c.bound_worker(&[("azure.workload.identity/client-id", CLIENT)]);
    // As the agent's ServiceAccount, which may not list Events.
    std::fs::copy(
        c.dir.path().join("agent.kubeconfig"),
        c.dir.path().join("kubeconfig"),
    )
    .unwrap();
    let (code, report) = c.json(&["pod", "ray/worker-0"]);
    assert_eq!(code, 0, "{report:#}");
    let refusal = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "refusal")
        .unwrap();
    assert_eq!(refusal["status"], "warn");
    assert!(
        refusal["message"].as_str().unwrap().contains("forbidden"),
        "{refusal}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_issuer_configured_without_its_trailing_slash_is_caught() {
    let without = ISSUER.trim_end_matches('/');
    let c = cluster(&format!("{}cluster:\n  issuer: {without}\n", config_yaml())).await;
    c.kube.apply_service_account(service_account(
        "ray",
        "worker",
        &[("azure.workload.identity/client-id", CLIENT)],
    ));
    let (code, report) = c.json(&["sa", "ray/worker"]);
    assert_eq!(code, 1);
    let issuer = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["check"] == "issuer")
        .unwrap();
    assert_eq!(issuer["status"], "fail");
    assert!(
        issuer["message"].as_str().unwrap().contains("trailing '/'"),
        "{issuer}"
    );
    assert!(issuer["fix"].as_str().unwrap().contains(ISSUER));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_exits_2_with_a_bounded_message() {
    let c = cluster(config_yaml()).await;
    let long = format!("ray/{}", "x".repeat(100_000));
    for target in ["no-slash", "Ray/worker", long.as_str()] {
        let (code, stdout, stderr) = c.doctor(&["pod", target]);
        assert_eq!(code, 2, "{target}");
        assert!(stdout.is_empty());
        assert!(
            stderr.contains("want NAMESPACE/NAME") && stderr.len() < 500,
            "{stderr}"
        );
    }
    std::fs::write(
        c.dir.path().join("agent.yaml"),
        "azure:\n  tenant_id: not a tenant\n",
    )
    .unwrap();
    let (code, _, stderr) = c.doctor(&["pod", "ray/worker-0"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("azure.tenant_id"), "{stderr}");
}
