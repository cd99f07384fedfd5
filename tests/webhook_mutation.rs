//! The admission webhook end to end on real AdmissionReview bodies: parse,
//! mutate, encode the response as the API server receives it, decode and
//! apply the patch to the pod exactly as it was sent, and check the pod
//! that would be stored, field by field.

mod support;

use std::collections::BTreeMap;

use base64::Engine;
use k8s_openapi::api::core::v1::{Container, EnvVar, Pod, Volume};
use serde_json::{json, Value};

use lanyard::cloud::{azure, Bindings, Cloud};
use lanyard::serve::sdk_env::SdkDefaults;
use lanyard::webhook::review::{self, Action, ReviewError, MAX_BODY_BYTES};
use lanyard::webhook::vocabulary::{
    API_TOKEN_DIR, API_TOKEN_SHIELD_VOLUME, APP_TOKEN_DIR, APP_TOKEN_FILE, APP_TOKEN_VOLUME,
    REDIRECT_NAME, SIDECAR_NAME, TOKENS_VOLUME, TOKEN_DIR, TRANSPARENT_ANNOTATION,
};
use lanyard::webhook::{mutate, respond, Answer, InjectionConfig, Mutation};
use support::fixture;

const GCP_PROVIDER: &str =
    "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/k8s/providers/prod";
const TENANT: &str = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b";
const CLIENT: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
const ROLE: &str = "arn:aws:iam::111122223333:role/ray";

/// A fixture with `edit` applied to its `request.object`.
fn edited(name: &str, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut review: Value = serde_json::from_slice(&fixture(name)).unwrap();
    edit(&mut review["request"]["object"]);
    serde_json::to_vec(&review).unwrap()
}

fn config() -> InjectionConfig {
    let mut config = InjectionConfig {
        sidecar_image: "ghcr.io/example/lanyard:0.1.0".into(),
        image_pull_policy: Some("IfNotPresent".into()),
        sdk: SdkDefaults {
            azure_tenant_id: Some(TENANT.into()),
            aws_region: Some("us-east-1".into()),
            gcp_universe_domain: None,
        },
        ..InjectionConfig::default()
    };
    config.audiences[Cloud::Gcp] = Some(GCP_PROVIDER.into());
    config
}

fn azure() -> Vec<azure::Binding> {
    vec![azure::Binding {
        client_id: CLIENT.into(),
        tenant_id: None,
        object_id: None,
        resource_id: None,
        app: None,
    }]
}

fn all_clouds() -> Bindings {
    Bindings {
        azure: azure(),
        gcp: vec!["ray@proj.iam.gserviceaccount.com".into()],
        aws: vec![ROLE.into()],
    }
}

struct Outcome {
    mutation: Mutation,
    response: Value,
    /// The pod after the patch, as JSON and typed.
    json: Value,
    pod: Pod,
}

/// What the API server does with our answer: decode the base64 patch and
/// apply it to the object it sent.
fn apply_response(original: &Value, response: &Value) -> Value {
    let mut doc = original.clone();
    if let Some(encoded) = response["response"]["patch"].as_str() {
        assert_eq!(response["response"]["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut doc, &patch).unwrap();
    }
    doc
}

fn run_body(body: &[u8], bindings: &Bindings, config: &InjectionConfig) -> Outcome {
    let original: Value =
        serde_json::from_slice::<Value>(body).unwrap()["request"]["object"].clone();
    let review = review::parse(body).unwrap();
    let Action::Mutate(pod) = &review.action else {
        panic!("expected a pod to mutate, got {:?}", review.action)
    };
    let mutation = mutate(pod, &review.namespace, bindings, config).unwrap();
    let response = to_value(respond(&review.uid, &Ok(mutation.clone())));
    assert_eq!(response["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(response["kind"], "AdmissionReview");
    assert_eq!(response["response"]["uid"], review.uid.as_str());
    assert_eq!(response["response"]["allowed"], true);
    let json = apply_response(&original, &response);
    let pod: Pod = serde_json::from_value(json.clone()).unwrap();
    Outcome {
        mutation,
        response,
        json,
        pod,
    }
}

/// Mutates an already-mutated pod again (reinvocation).
fn rerun(previous: &Outcome, namespace: &str, bindings: &Bindings) -> Mutation {
    mutate(&previous.pod, namespace, bindings, &config()).unwrap()
}

fn init_containers(pod: &Pod) -> &[Container] {
    pod.spec
        .as_ref()
        .unwrap()
        .init_containers
        .as_deref()
        .unwrap_or_default()
}

fn containers(pod: &Pod) -> &[Container] {
    &pod.spec.as_ref().unwrap().containers
}

fn container<'a>(pod: &'a Pod, name: &str) -> &'a Container {
    init_containers(pod)
        .iter()
        .chain(containers(pod))
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn volumes(pod: &Pod) -> &[Volume] {
    pod.spec
        .as_ref()
        .unwrap()
        .volumes
        .as_deref()
        .unwrap_or_default()
}

fn env_entries<'a>(c: &'a Container, name: &str) -> Vec<&'a EnvVar> {
    c.env
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter(|e| e.name == name)
        .collect()
}

/// The one literal value of `name` in `c`'s env.
fn env(c: &Container, name: &str) -> Option<String> {
    let entries = env_entries(c, name);
    assert!(
        entries.len() <= 1,
        "{name} set {} times in {}",
        entries.len(),
        c.name
    );
    entries.first().map(|e| e.value.clone().unwrap_or_default())
}

/// What a process in `c` sees, as the kubelet builds it: `envFrom` first,
/// then `env` in order with `$(VAR)` expanded from what came before; an
/// undefined reference stays as written.
fn effective_env(c: &Container, env_from: &BTreeMap<&str, &str>) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = env_from
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for e in c.env.as_deref().unwrap_or_default() {
        let Some(raw) = e.value.as_deref() else {
            continue;
        };
        let mut value = String::new();
        let mut rest = raw;
        while let Some(start) = rest.find("$(") {
            value.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            match after.find(')') {
                Some(end) => {
                    let name = &after[..end];
                    match out.get(name) {
                        Some(v) => value.push_str(v),
                        None => value.push_str(&rest[start..start + 3 + end]),
                    }
                    rest = &after[end + 1..];
                }
                None => {
                    value.push_str(&rest[start..]);
                    rest = "";
                }
            }
        }
        value.push_str(rest);
        out.insert(e.name.clone(), value);
    }
    out
}

fn mounts(c: &Container) -> Vec<(String, String, bool)> {
    c.volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            (
                m.name.clone(),
                m.mount_path.clone(),
                m.read_only == Some(true),
            )
        })
        .collect()
}

/// (path, audience, expirationSeconds) of a projected token volume.
fn token_sources(v: &Volume) -> Vec<(String, String, i64)> {
    v.projected
        .as_ref()
        .unwrap()
        .sources
        .as_deref()
        .unwrap()
        .iter()
        .map(|s| {
            let t = s.service_account_token.as_ref().unwrap();
            (
                t.path.clone(),
                t.audience.clone().unwrap(),
                t.expiration_seconds.unwrap(),
            )
        })
        .collect()
}

fn original_pod(body: &[u8]) -> Pod {
    let review: Value = serde_json::from_slice(body).unwrap();
    serde_json::from_value(review["request"]["object"].clone()).unwrap()
}

fn assert_sidecar(pod: &Pod, cfg: &InjectionConfig, aws: bool) -> String {
    let sidecar = &init_containers(pod)[0];
    assert_eq!(sidecar.name, SIDECAR_NAME);
    assert_eq!(
        init_containers(pod)
            .iter()
            .filter(|c| c.name == SIDECAR_NAME)
            .count(),
        1
    );
    assert_eq!(sidecar.restart_policy.as_deref(), Some("Always"));
    assert_eq!(sidecar.image.as_deref(), Some(cfg.sidecar_image.as_str()));
    assert_eq!(sidecar.image_pull_policy.as_deref(), Some("IfNotPresent"));
    assert_eq!(sidecar.command.as_deref().unwrap(), ["lanyard-sidecar"]);
    assert_eq!(
        sidecar.args.as_deref().unwrap(),
        [
            "--listen",
            "127.0.0.1:8642",
            "--probe-listen",
            "0.0.0.0:8643"
        ]
    );
    let sc = sidecar.security_context.as_ref().unwrap();
    assert_eq!(sc.run_as_non_root, Some(true));
    assert_eq!(sc.run_as_user, Some(65532));
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    assert_eq!(
        sc.capabilities.as_ref().unwrap().drop.as_deref().unwrap(),
        ["ALL"]
    );
    assert_eq!(sc.seccomp_profile.as_ref().unwrap().type_, "RuntimeDefault");
    // No startup probe: the postStart hook waits for readiness, and the
    // kubelet starts the next container once it returns.
    assert!(sidecar.startup_probe.is_none());
    let hook = sidecar
        .lifecycle
        .as_ref()
        .and_then(|l| l.post_start.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.as_deref())
        .unwrap();
    assert_eq!(
        hook,
        [
            "lanyard-sidecar",
            "wait-ready",
            "--port",
            "8643",
            "--timeout",
            "120"
        ]
    );
    let liveness = sidecar
        .liveness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(liveness.path.as_deref(), Some("/healthz"));
    assert_eq!(
        liveness.port,
        k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(8643)
    );
    assert_eq!(liveness.host, None, "probes reach the pod IP");
    let resources = sidecar.resources.as_ref().unwrap();
    assert!(resources.requests.as_ref().unwrap().contains_key("memory"));
    assert!(resources.limits.as_ref().unwrap().contains_key("memory"));

    let names: Vec<&str> = sidecar
        .env
        .as_deref()
        .unwrap()
        .iter()
        .map(|e| e.name.as_str())
        .collect();
    let host_ip = names.iter().position(|n| *n == "LANYARD_HOST_IP").unwrap();
    let agent = names
        .iter()
        .position(|n| *n == "LANYARD_AGENT_URL")
        .unwrap();
    assert!(
        host_ip < agent,
        "the kubelet expands only earlier variables"
    );
    let host_ip_var = env_entries(sidecar, "LANYARD_HOST_IP")[0];
    assert_eq!(
        host_ip_var
            .value_from
            .as_ref()
            .unwrap()
            .field_ref
            .as_ref()
            .unwrap()
            .field_path,
        "status.hostIP"
    );
    assert_eq!(
        env(sidecar, "LANYARD_AGENT_URL").unwrap(),
        "http://$(LANYARD_HOST_IP):8700"
    );
    assert_eq!(env(sidecar, "LANYARD_TOKEN_DIR").unwrap(), TOKEN_DIR);
    let header = env(sidecar, "IDENTITY_HEADER").unwrap();
    assert!(header.len() >= 32, "a real secret, not {header:?}");
    let mut expected_mounts = vec![(TOKENS_VOLUME.to_string(), TOKEN_DIR.to_string(), true)];
    if aws {
        assert_eq!(
            env(sidecar, "LANYARD_APP_TOKEN_FILE").unwrap(),
            APP_TOKEN_FILE
        );
        expected_mounts.push((APP_TOKEN_VOLUME.into(), APP_TOKEN_DIR.into(), true));
    } else {
        assert_eq!(env(sidecar, "LANYARD_APP_TOKEN_FILE"), None);
    }
    // Its own empty volume where the ServiceAccount admission plugin would
    // mount the API token: the plugin, run again after the patch, skips it.
    expected_mounts.push((API_TOKEN_SHIELD_VOLUME.into(), API_TOKEN_DIR.into(), true));
    assert_eq!(mounts(sidecar), expected_mounts);
    header
}

/// Only the sidecar sees the cloud tokens.
fn assert_tokens_only_in_sidecar(pod: &Pod) {
    for c in init_containers(pod).iter().chain(containers(pod)) {
        if c.name != SIDECAR_NAME {
            assert!(
                !mounts(c).iter().any(|(n, _, _)| n == TOKENS_VOLUME),
                "{} mounts the cloud tokens",
                c.name
            );
        }
    }
}

#[test]
fn kuberay_head_gets_every_cloud() {
    let body = fixture("kuberay_head_create.json");
    let cfg = config();
    let out = run_body(&body, &all_clouds(), &cfg);
    let before = original_pod(&body);

    assert_eq!(
        out.mutation.summary.clouds,
        [Cloud::Azure, Cloud::Gcp, Cloud::Aws]
    );
    assert_eq!(out.mutation.summary.containers, ["ray-head"]);
    assert!(out.mutation.summary.sidecar_added);
    assert!(
        out.mutation.warnings.is_empty(),
        "{:?}",
        out.mutation.warnings
    );

    // The head had no init containers: the sidecar is the only one.
    assert_eq!(init_containers(&out.pod).len(), 1);
    let header = assert_sidecar(&out.pod, &cfg, true);

    // Volumes: the originals, in order, then ours.
    let vols = volumes(&out.pod);
    assert_eq!(&vols[..3], volumes(&before));
    assert_eq!(vols.len(), 6);
    assert_eq!(vols[5].name, API_TOKEN_SHIELD_VOLUME);
    assert_eq!(vols[3].name, TOKENS_VOLUME);
    assert_eq!(
        token_sources(&vols[3]),
        [
            (
                "azure".to_string(),
                "api://AzureADTokenExchange".to_string(),
                7200
            ),
            ("gcp".to_string(), GCP_PROVIDER.to_string(), 7200),
            ("aws".to_string(), "sts.amazonaws.com".to_string(), 7200),
        ]
    );
    assert_eq!(vols[4].name, APP_TOKEN_VOLUME);
    assert_eq!(
        token_sources(&vols[4]),
        [("app".to_string(), "lanyard".to_string(), 7200)]
    );

    let head = container(&out.pod, "ray-head");
    let head_before = container(&before, "ray-head");
    // Nothing the operator set is lost or reordered.
    let env_before = head_before.env.as_deref().unwrap();
    let env_after = head.env.as_deref().unwrap();
    for (a, b) in env_before.iter().zip(env_after) {
        if a.name != "NO_PROXY" {
            assert_eq!(a, b);
        }
    }
    assert_eq!(
        env(head, "AZURE_POD_IDENTITY_AUTHORITY_HOST").unwrap(),
        "http://127.0.0.1:8642"
    );
    assert_eq!(
        env(head, "IDENTITY_ENDPOINT").unwrap(),
        "http://127.0.0.1:8642/msi/token"
    );
    assert_eq!(env(head, "IDENTITY_HEADER").unwrap(), header);
    assert_eq!(env(head, "AZURE_CLIENT_ID").unwrap(), CLIENT);
    assert_eq!(
        env(head, "AZURE_TENANT_ID").unwrap(),
        TENANT,
        "the configured default tenant"
    );
    for name in ["GCE_METADATA_HOST", "GCE_METADATA_IP", "GCE_METADATA_ROOT"] {
        assert_eq!(env(head, name).unwrap(), "127.0.0.1:8642", "{name}");
    }
    assert_eq!(
        env(head, "AWS_CONTAINER_CREDENTIALS_FULL_URI").unwrap(),
        "http://127.0.0.1:8642/v1/credentials"
    );
    assert_eq!(
        env(head, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE").unwrap(),
        APP_TOKEN_FILE
    );
    assert_eq!(
        env(head, "AWS_REGION").unwrap(),
        "eu-west-1",
        "the pod's own value wins"
    );
    assert_eq!(
        env(head, "AWS_DEFAULT_REGION").unwrap(),
        "$(AWS_REGION)",
        "botocore's variable follows the pod's own choice"
    );
    let region_at = |name: &str| {
        head.env
            .as_deref()
            .unwrap()
            .iter()
            .position(|e| e.name == name)
            .unwrap()
    };
    assert!(
        region_at("AWS_REGION") < region_at("AWS_DEFAULT_REGION"),
        "a dependent variable must follow the one it names"
    );
    assert_eq!(
        env(head, "NO_PROXY").unwrap(),
        "localhost,.svc,.cluster.local,127.0.0.1"
    );
    assert_eq!(env(head, "no_proxy").unwrap(), "$(NO_PROXY)");
    let seen = effective_env(head, &BTreeMap::new());
    assert_eq!(seen["no_proxy"], "localhost,.svc,.cluster.local,127.0.0.1");
    assert_eq!(seen["HTTPS_PROXY"], "http://proxy.corp.example:3128");

    // The app token only, read-only, beside the existing mounts.
    let mut expected = mounts(head_before);
    expected.push((APP_TOKEN_VOLUME.into(), APP_TOKEN_DIR.into(), true));
    assert_eq!(mounts(head), expected);
    assert_tokens_only_in_sidecar(&out.pod);

    // Skipped by annotation: exactly as it was.
    assert_eq!(
        container(&out.pod, "autoscaler"),
        container(&before, "autoscaler")
    );
    // Everything outside spec untouched.
    assert_eq!(out.pod.metadata, before.metadata);

    // Minimal patch: existing arrays are appended to, never replaced, and
    // the only replacement is the NO_PROXY value.
    let patch = out
        .mutation
        .patch
        .0
        .iter()
        .map(|op| serde_json::to_value(op).unwrap());
    for op in patch {
        let path = op["path"].as_str().unwrap();
        match op["op"].as_str().unwrap() {
            "add" => assert!(
                path.ends_with("/-") || path == "/spec/initContainers",
                "unexpected add at {path}"
            ),
            "replace" => assert_eq!(path, "/spec/containers/0/env/0/value"),
            other => panic!("unexpected {other} at {path}"),
        }
    }
}

#[test]
fn kuberay_worker_with_wait_gcs_ready_and_irsa_leftovers() {
    let body = fixture("kuberay_worker_create.json");
    let mut cfg = config();
    cfg.audiences[Cloud::Gcp] = None;
    let bindings = Bindings {
        azure: vec![azure::Binding {
            tenant_id: Some("11111111-2222-4333-8444-555555555555".into()),
            ..azure().remove(0)
        }],
        gcp: Vec::new(),
        aws: vec![ROLE.into()],
    };
    let out = run_body(&body, &bindings, &cfg);
    let before = original_pod(&body);
    assert_eq!(out.mutation.summary.clouds, [Cloud::Azure, Cloud::Aws]);
    assert_eq!(
        out.mutation.summary.containers,
        ["wait-gcs-ready", "ray-worker"]
    );

    // Sidecar first, KubeRay's init container after it, unchanged but for env and mounts.
    let init = init_containers(&out.pod);
    assert_eq!(init.len(), 2);
    let header = assert_sidecar(&out.pod, &cfg, true);
    assert_eq!(init[1].name, "wait-gcs-ready");
    assert_eq!(init[1].args, init_containers(&before)[0].args);

    for name in ["wait-gcs-ready", "ray-worker"] {
        let c = container(&out.pod, name);
        assert_eq!(env(c, "IDENTITY_HEADER").unwrap(), header, "{name}");
        assert_eq!(env(c, "AZURE_CLIENT_ID").unwrap(), CLIENT);
        assert_eq!(
            env(c, "AZURE_TENANT_ID").unwrap(),
            "11111111-2222-4333-8444-555555555555",
            "the binding's tenant over the default"
        );
        assert_eq!(
            env(c, "GCE_METADATA_HOST"),
            None,
            "Google is not configured"
        );
        assert_eq!(env(c, "AWS_REGION").unwrap(), "us-east-1");
        assert_eq!(env(c, "AWS_DEFAULT_REGION").unwrap(), "us-east-1");
        assert!(
            env(c, "AWS_EC2_METADATA_SERVICE_ENDPOINT")
                .unwrap()
                .starts_with("http://127.0.0.1:"),
            "instance metadata goes to the sidecar, never the node's role"
        );
        assert_eq!(
            env(c, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE").unwrap(),
            APP_TOKEN_FILE
        );
        // Left alone, and reported.
        assert_eq!(
            env(c, "AWS_ROLE_ARN").unwrap(),
            "arn:aws:iam::111122223333:role/legacy-irsa"
        );
        assert!(
            out.mutation
                .warnings
                .iter()
                .any(|w| w.contains(&format!("{name:?}")) && w.contains("AWS_ROLE_ARN")),
            "no AWS_ROLE_ARN warning for {name}: {:?}",
            out.mutation.warnings
        );
        // Only no_proxy was set: it is extended, NO_PROXY follows it.
        assert_eq!(env(c, "no_proxy").unwrap(), ".svc,.cluster.local,127.0.0.1");
        assert_eq!(env(c, "NO_PROXY").unwrap(), "$(no_proxy)");
        let seen = effective_env(c, &BTreeMap::new());
        assert_eq!(seen["NO_PROXY"], seen["no_proxy"]);
        assert!(mounts(c).contains(&(APP_TOKEN_VOLUME.into(), APP_TOKEN_DIR.into(), true)));
    }
    let response_warnings = out.response["response"]["warnings"].as_array().unwrap();
    assert_eq!(response_warnings.len(), out.mutation.warnings.len());
    assert_tokens_only_in_sidecar(&out.pod);
    let vols = volumes(&out.pod);
    assert_eq!(
        token_sources(vols.iter().find(|v| v.name == TOKENS_VOLUME).unwrap()),
        [
            (
                "azure".to_string(),
                "api://AzureADTokenExchange".to_string(),
                3600
            ),
            ("aws".to_string(), "sts.amazonaws.com".to_string(), 3600),
        ]
    );
}

#[test]
fn job_pod_with_env_from_and_no_volumes() {
    let body = fixture("job_create.json");
    let bindings = Bindings {
        aws: vec![ROLE.into()],
        ..Bindings::default()
    };
    let mut cfg = config();
    cfg.audiences[Cloud::Gcp] = None;
    let out = run_body(&body, &bindings, &cfg);
    let before = original_pod(&body);
    assert_eq!(out.pod.metadata.name, None);
    assert_eq!(
        out.pod.metadata.generate_name.as_deref(),
        Some("nightly-train-28930140-")
    );
    assert_eq!(out.mutation.summary.clouds, [Cloud::Aws]);
    assert_sidecar(&out.pod, &cfg, true);
    assert_eq!(init_containers(&out.pod)[1].name, "fetch-data");

    // The pod had no volumes at all (automountServiceAccountToken: false).
    let vols = volumes(&out.pod);
    assert_eq!(
        vols.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(),
        [TOKENS_VOLUME, APP_TOKEN_VOLUME, API_TOKEN_SHIELD_VOLUME]
    );
    assert_eq!(
        token_sources(&vols[0]),
        [("aws".to_string(), "sts.amazonaws.com".to_string(), 3600)]
    );

    for name in ["fetch-data", "train"] {
        let c = container(&out.pod, name);
        assert_eq!(
            env(c, "AWS_CONTAINER_CREDENTIALS_FULL_URI").unwrap(),
            "http://127.0.0.1:8642/v1/credentials"
        );
        assert_eq!(env(c, "IDENTITY_HEADER"), None, "Azure is not bound");
        assert_eq!(env(c, "AZURE_CLIENT_ID"), None);
        assert_eq!(
            mounts(c),
            [(
                APP_TOKEN_VOLUME.to_string(),
                APP_TOKEN_DIR.to_string(),
                true
            )]
        );
    }
    // No envFrom: plain values.
    let fetch = container(&out.pod, "fetch-data");
    assert_eq!(env(fetch, "NO_PROXY").unwrap(), "127.0.0.1");
    assert_eq!(env(fetch, "no_proxy").unwrap(), "127.0.0.1");

    // envFrom kept, and a proxy list that comes from it survives.
    let train = container(&out.pod, "train");
    assert_eq!(train.env_from, container(&before, "train").env_from);
    let from_config_map = BTreeMap::from([
        ("HTTPS_PROXY", "http://proxy.corp.example:3128"),
        ("NO_PROXY", "corp.example,.internal"),
    ]);
    let seen = effective_env(train, &from_config_map);
    for name in ["NO_PROXY", "no_proxy"] {
        let entries: Vec<&str> = seen[name].split(',').collect();
        for wanted in ["corp.example", ".internal", "127.0.0.1"] {
            assert!(
                entries.contains(&wanted),
                "{name}={} lacks {wanted}",
                seen[name]
            );
        }
    }
    // And without any proxy settings in envFrom, loopback is still excluded.
    let seen = effective_env(train, &BTreeMap::new());
    assert!(seen["NO_PROXY"].split(',').any(|e| e == "127.0.0.1"));
    assert!(seen["no_proxy"].split(',').any(|e| e == "127.0.0.1"));
}

#[test]
fn a_mutated_pod_is_not_mutated_again() {
    for (name, ns, bindings) in [
        ("kuberay_head_create.json", "ml", all_clouds()),
        ("kuberay_worker_create.json", "ml", all_clouds()),
        (
            "job_create.json",
            "batch",
            Bindings {
                aws: vec![ROLE.into()],
                ..Bindings::default()
            },
        ),
    ] {
        let first = run_body(&fixture(name), &bindings, &config());
        for w in &first.mutation.warnings {
            // The API server may truncate longer warnings.
            assert!(w.len() <= 256, "{name}: {} chars: {w}", w.len());
        }
        let second = rerun(&first, ns, &bindings);
        assert!(second.is_empty(), "{name}: {:?}", second.patch);
        assert!(second.summary.already_injected);
        assert!(!second.summary.sidecar_added);
        let response = to_value(respond("u", &Ok(second)));
        assert!(response["response"].get("patch").is_none(), "{name}");
    }
}

#[test]
fn a_partly_injected_pod_gets_the_rest_with_the_sidecars_header() {
    let first = run_body(
        &fixture("kuberay_head_create.json"),
        &all_clouds(),
        &config(),
    );
    let header = env(&init_containers(&first.pod)[0], "IDENTITY_HEADER").unwrap();
    let mut json = first.json.clone();
    let head_env = json["spec"]["containers"][0]["env"].as_array_mut().unwrap();
    head_env.retain(|e| e["name"] != "IDENTITY_HEADER" && e["name"] != "AZURE_CLIENT_ID");
    let pod: Pod = serde_json::from_value(json.clone()).unwrap();
    let m = mutate(&pod, "ml", &all_clouds(), &config()).unwrap();
    assert_eq!(m.patch.0.len(), 2, "{:?}", m.patch);
    json_patch::patch(&mut json, &as_sent(&m)).unwrap();
    let pod: Pod = serde_json::from_value(json).unwrap();
    assert_eq!(
        env(container(&pod, "ray-head"), "IDENTITY_HEADER").unwrap(),
        header
    );
    assert_eq!(
        env(container(&pod, "ray-head"), "AZURE_CLIENT_ID").unwrap(),
        CLIENT
    );
}

#[test]
fn a_transparent_job_pod_gets_the_redirect_before_the_sidecar() {
    let body = edited("job_create.json", |pod| {
        pod["metadata"]["annotations"][TRANSPARENT_ANNOTATION] = json!("true")
    });
    let bindings = Bindings {
        aws: vec![ROLE.into()],
        ..Bindings::default()
    };
    let cfg = config();
    let out = run_body(&body, &bindings, &cfg);
    assert!(out.mutation.summary.redirect_added);
    assert!(
        out.mutation.warnings.is_empty(),
        "{:?}",
        out.mutation.warnings
    );
    let names: Vec<&str> = init_containers(&out.pod)
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, [REDIRECT_NAME, SIDECAR_NAME, "fetch-data"]);

    // The init container exactly as the API server stores it.
    assert_eq!(
        out.json["spec"]["initContainers"][0],
        json!({
            "name": "lanyard-redirect",
            "image": "ghcr.io/example/lanyard:0.1.0",
            "imagePullPolicy": "IfNotPresent",
            "command": ["lanyard-sidecar", "redirect", "--port", "8642"],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "capabilities": {"add": ["NET_ADMIN"], "drop": ["ALL"]},
                "privileged": false,
                "readOnlyRootFilesystem": true,
                "runAsNonRoot": false,
                "runAsUser": 0,
                "seccompProfile": {"type": "RuntimeDefault"}
            },
            "terminationMessagePolicy": "FallbackToLogsOnError"
        })
    );
    // The pod says runAsNonRoot: true; the redirect's own context wins.
    let pod_sc = out.pod.spec.as_ref().unwrap().security_context.as_ref();
    assert_eq!(pod_sc.and_then(|s| s.run_as_non_root), Some(true));
    let redirect = container(&out.pod, REDIRECT_NAME);
    assert!(redirect.env.is_none() && redirect.volume_mounts.is_none());

    let aliases = out
        .pod
        .spec
        .as_ref()
        .unwrap()
        .host_aliases
        .as_deref()
        .unwrap();
    assert_eq!(aliases.len(), 1);
    assert_eq!(aliases[0].ip, "169.254.169.254");
    assert_eq!(
        aliases[0].hostnames.as_deref().unwrap(),
        ["metadata.google.internal", "metadata"]
    );

    // Everything else is as without transparent mode.
    let plain = run_body(&fixture("job_create.json"), &bindings, &cfg);
    let mut without: Value = out.json.clone();
    without["spec"]["initContainers"]
        .as_array_mut()
        .unwrap()
        .remove(0);
    without["spec"]
        .as_object_mut()
        .unwrap()
        .remove("hostAliases");
    without["metadata"]["annotations"]
        .as_object_mut()
        .unwrap()
        .remove(TRANSPARENT_ANNOTATION);
    // The identity header is random per run (and the sidecar's only for
    // Azure-bound pods): compared without it.
    let strip = |mut v: Value| {
        for c in v["spec"]["initContainers"].as_array_mut().unwrap() {
            if let Some(env) = c["env"].as_array_mut() {
                env.retain(|e| e["name"] != "IDENTITY_HEADER");
            }
        }
        v
    };
    assert_eq!(strip(without), strip(plain.json));

    // Reinvocation adds nothing.
    let second = rerun(&out, "batch", &bindings);
    assert!(second.is_empty(), "{:?}", second.patch);
    assert!(!second.summary.redirect_added);
}

#[test]
fn a_bad_transparent_annotation_is_denied() {
    let body = edited("kuberay_head_create.json", |pod| {
        pod["metadata"]["annotations"][TRANSPARENT_ANNOTATION] = json!("on")
    });
    let review = review::parse(&body).unwrap();
    let Action::Mutate(pod) = &review.action else {
        panic!()
    };
    let denial = mutate(pod, "ml", &all_clouds(), &config()).unwrap_err();
    let response = to_value(respond(&review.uid, &Err(denial)));
    assert_error_response(&response, review.uid.as_str(), "lanyard.dev/transparent");
    let message = response["response"]["status"]["message"].as_str().unwrap();
    assert!(message.contains("\"on\""), "{message}");
}

#[test]
fn host_network_pods_are_denied() {
    let body = edited("kuberay_head_create.json", |pod| {
        pod["spec"]["hostNetwork"] = json!(true)
    });
    let review = review::parse(&body).unwrap();
    let Action::Mutate(pod) = &review.action else {
        panic!()
    };
    let denial = mutate(pod, "ml", &all_clouds(), &config()).unwrap_err();
    assert_eq!(denial.code, 403);
    assert!(denial.message.contains("hostNetwork"), "{}", denial.message);
    assert!(
        denial.message.contains("ml/raycluster-kuberay-head-*"),
        "{}",
        denial.message
    );
    let response = to_value(respond(&review.uid, &Err(denial)));
    assert_eq!(
        response["response"]["uid"],
        "0d6a3f27-5b8e-4c41-9e0f-2a7c9b1d4e53"
    );
    assert_eq!(response["response"]["allowed"], false);
    assert_eq!(response["response"]["status"]["code"], 403);
    assert!(response["response"].get("patch").is_none());
}

#[test]
fn bad_token_expiration_is_denied() {
    for bad in ["60", "100000", "2h", ""] {
        let body = edited("kuberay_head_create.json", |pod| {
            pod["metadata"]["annotations"]["lanyard.dev/token-expiration"] = json!(bad)
        });
        let review = review::parse(&body).unwrap();
        let Action::Mutate(pod) = &review.action else {
            panic!()
        };
        let denial = mutate(pod, "ml", &all_clouds(), &config()).unwrap_err();
        assert_eq!(denial.code, 400, "{bad}");
        assert!(
            denial.message.contains("lanyard.dev/token-expiration"),
            "{}",
            denial.message
        );
        assert!(
            denial.message.contains(&format!("{bad:?}")),
            "{}",
            denial.message
        );
    }
}

#[test]
fn pods_without_the_label_or_bindings_are_left_alone() {
    for edit in [
        |pod: &mut Value| {
            pod["metadata"]["labels"]
                .as_object_mut()
                .unwrap()
                .remove("lanyard.dev/inject");
        },
        |pod: &mut Value| pod["metadata"]["labels"]["lanyard.dev/inject"] = json!("false"),
    ] {
        let out = run_body(
            &edited("kuberay_worker_create.json", edit),
            &all_clouds(),
            &config(),
        );
        assert!(out.mutation.is_empty());
        assert!(out.mutation.warnings.is_empty());
        assert!(out.response["response"].get("patch").is_none());
    }
    let out = run_body(
        &fixture("kuberay_worker_create.json"),
        &Bindings::default(),
        &config(),
    );
    assert!(out.mutation.is_empty());
    assert_eq!(out.mutation.warnings.len(), 1);
    assert!(
        out.mutation.warnings[0].contains("ml/ray-worker"),
        "{:?}",
        out.mutation.warnings
    );
    assert_eq!(
        out.response["response"]["warnings"][0],
        out.mutation.warnings[0].as_str()
    );
    assert!(out.response["response"].get("patch").is_none());
}

/// The mutation's patch as the API server reads it.
fn as_sent(m: &Mutation) -> json_patch::Patch {
    serde_json::from_slice(&serde_json::to_vec(&m.patch).unwrap()).unwrap()
}

/// The answer as the API server reads it.
fn to_value(answer: Answer) -> Value {
    serde_json::to_value(answer).unwrap()
}

fn assert_error_response(value: &Value, uid: &str, needle: &str) {
    assert_eq!(value["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(value["kind"], "AdmissionReview");
    assert_eq!(value["response"]["uid"], uid);
    assert_eq!(value["response"]["allowed"], false);
    assert_eq!(value["response"]["status"]["code"], 400);
    let message = value["response"]["status"]["message"].as_str().unwrap();
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
}

#[test]
fn malformed_reviews_get_clear_answers() {
    let err = review::parse(b"<html>").unwrap_err();
    assert!(matches!(err, ReviewError::NotJson(_)));
    assert_error_response(&to_value(err.response()), "", "not JSON");

    let err = review::parse(br#"{"apiVersion":"v1","kind":"Pod","metadata":{}}"#).unwrap_err();
    assert_error_response(&to_value(err.response()), "", "admission.k8s.io/v1");

    let err = review::parse(br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"x"}}"#)
        .unwrap_err();
    assert!(matches!(err, ReviewError::NotAReview { .. }), "{err:?}");

    let err = review::parse(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#)
        .unwrap_err();
    assert_eq!(err, ReviewError::MissingRequest);
    assert_error_response(&to_value(err.response()), "", "no request");

    let mut review: Value = serde_json::from_slice(&fixture("kuberay_head_create.json")).unwrap();
    review["request"].as_object_mut().unwrap().remove("uid");
    let err = review::parse(&serde_json::to_vec(&review).unwrap()).unwrap_err();
    assert_eq!(err, ReviewError::MissingUid);
    assert_error_response(&to_value(err.response()), "", "uid");

    let mut review: Value = serde_json::from_slice(&fixture("kuberay_head_create.json")).unwrap();
    review["request"]["object"] = Value::Null;
    let err = review::parse(&serde_json::to_vec(&review).unwrap()).unwrap_err();
    assert_error_response(
        &to_value(err.response()),
        "0d6a3f27-5b8e-4c41-9e0f-2a7c9b1d4e53",
        "request.object",
    );

    let mut review: Value = serde_json::from_slice(&fixture("kuberay_head_create.json")).unwrap();
    review["request"]["object"]["spec"]["containers"] = json!("not a list");
    let err = review::parse(&serde_json::to_vec(&review).unwrap()).unwrap_err();
    assert!(matches!(err, ReviewError::InvalidPod { .. }), "{err:?}");
    assert_error_response(
        &to_value(err.response()),
        "0d6a3f27-5b8e-4c41-9e0f-2a7c9b1d4e53",
        "not a valid Pod",
    );

    // A valid review padded past the limit: refused before parsing.
    let mut big = fixture("kuberay_head_create.json");
    big.resize(MAX_BODY_BYTES + 1, b' ');
    let err = review::parse(&big).unwrap_err();
    assert_eq!(
        err,
        ReviewError::TooLarge {
            size: MAX_BODY_BYTES + 1,
            limit: MAX_BODY_BYTES
        }
    );
    assert_error_response(&to_value(err.response()), "", "limit");
    // At the limit it is still accepted.
    big.truncate(MAX_BODY_BYTES);
    assert!(review::parse(&big).is_ok());

    let err = review::parse(&fixture("service_create.json")).unwrap_err();
    assert_eq!(err.uid(), Some("8a1c3e5f-7b9d-4f1a-a3c5-e7f9b1d3f5a7"));
    assert_error_response(
        &to_value(err.response()),
        "8a1c3e5f-7b9d-4f1a-a3c5-e7f9b1d3f5a7",
        "v1 Service",
    );

    // Arbitrary garbage never panics.
    for body in [
        &b""[..],
        b"null",
        b"[]",
        b"{\"apiVersion\":1}",
        b"\xff\xfe",
        b"{\"apiVersion\":\"admission.k8s.io/v1\",\"kind\":\"AdmissionReview\",\"request\":[]}",
    ] {
        let err = review::parse(body).unwrap_err();
        assert_eq!(to_value(err.response())["response"]["allowed"], false);
    }
}

#[test]
fn delete_and_subresources_pass_untouched() {
    let review = review::parse(&fixture("pod_delete.json")).unwrap();
    assert_eq!(review.operation, "DELETE");
    assert!(matches!(review.action, Action::AllowUnchanged(_)));
    let response = to_value(review::allow(&review.uid, None, &[]));
    assert_eq!(
        response["response"]["uid"],
        "f0e1d2c3-b4a5-4968-8776-a5b4c3d2e1f0"
    );
    assert_eq!(response["response"]["allowed"], true);
    assert!(response["response"].get("patch").is_none());
    assert!(response["response"].get("patchType").is_none());

    // Whatever the kind: the webhook never blocks a deletion.
    let mut v: Value = serde_json::from_slice(&fixture("service_create.json")).unwrap();
    v["request"]["operation"] = json!("DELETE");
    v["request"]["oldObject"] = v["request"]["object"].take();
    let review = review::parse(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(matches!(review.action, Action::AllowUnchanged(_)));

    let mut v: Value = serde_json::from_slice(&fixture("kuberay_head_create.json")).unwrap();
    v["request"]["subResource"] = json!("ephemeralcontainers");
    v["request"]["operation"] = json!("UPDATE");
    let review = review::parse(&serde_json::to_vec(&v).unwrap()).unwrap();
    assert!(matches!(review.action, Action::AllowUnchanged(_)));
}
