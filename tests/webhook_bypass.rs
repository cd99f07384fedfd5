//! The mutation on hostile pod specs: every way a pod author could place
//! Lanyard's names in the pod to get the cloud-audience tokens into a
//! container of their own is denied with a message naming the object; the
//! benign look-alikes (reinvocation after the API server's defaulting, a
//! spec copied from a mutated pod, names that merely resemble Lanyard's)
//! are admitted as before. Each case goes in as the AdmissionReview the API
//! server sends and comes out as the answer it reads.

mod support;

use base64::Engine;
use serde_json::{json, Value};

use lanyard::directory::Bindings;
use lanyard::webhook::review::{self, Action};
use lanyard::webhook::{mutate, respond, InjectionConfig};
use support::guard::{all_clouds, cases, injected};

fn app() -> Value {
    cases()["bases"]["app"].clone()
}

fn config() -> InjectionConfig {
    support::guard::injection(&cases()["settings"])
}

/// The answer `/mutate` gives for `pod` created in `ml`, and the pod after
/// its patch.
fn admit(pod: &Value, bindings: &Bindings) -> (Value, Value) {
    let body = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "namespace": "ml", "operation": "CREATE", "object": pod}}))
    .unwrap();
    let parsed = review::parse(&body).unwrap();
    let Action::Mutate(typed) = parsed.action else {
        panic!("not mutated")
    };
    let answer = serde_json::to_value(respond(
        &parsed.uid,
        &mutate(&typed, "ml", bindings, &config()),
    ))
    .unwrap();
    let mut out = pod.clone();
    if let Some(encoded) = answer["response"]["patch"].as_str() {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .unwrap();
        let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        json_patch::patch(&mut out, &patch).unwrap();
    }
    (answer["response"].clone(), out)
}

/// Asserts `pod` is refused with a message containing each of `needles`.
fn assert_denied(pod: &Value, needles: &[&str]) {
    let (response, _) = admit(pod, &all_clouds());
    assert_eq!(response["allowed"], false, "{response}");
    assert_eq!(response["status"]["code"], 403, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    for needle in needles {
        assert!(message.contains(needle), "{needle:?} not in: {message}");
    }
}

fn mount(name: &str, path: &str) -> Value {
    json!({"name": name, "mountPath": path, "readOnly": true})
}

#[test]
fn pre_mounting_the_token_volume_is_denied_in_any_container() {
    let mut pod = app();
    pod["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(mount("lanyard-tokens", "/stolen"));
    assert_denied(
        &pod,
        &["app container \"ray-worker\"", "\"lanyard-tokens\""],
    );

    let mut pod = app();
    pod["spec"]["initContainers"] = json!([{"name": "stage-in", "image": "busybox:1.36",
                                           "volumeMounts": [mount("lanyard-tokens", "/stolen")]}]);
    assert_denied(&pod, &["init container \"stage-in\""]);

    let mut pod = app();
    pod["spec"]["initContainers"] = json!([{"name": "shipper", "image": "fluent/fluent-bit:3.1",
                                           "restartPolicy": "Always",
                                           "volumeMounts": [mount("lanyard-tokens", "/stolen")]}]);
    assert_denied(&pod, &["init container \"shipper\""]);

    // And in a pod that already went through Lanyard once.
    let mut pod = injected();
    pod["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(mount("lanyard-tokens", "/stolen"));
    assert_denied(&pod, &["app container \"ray-worker\""]);
}

#[test]
fn pre_declaring_the_volumes_is_denied() {
    for volume in [
        json!({"name": "lanyard-tokens", "emptyDir": {}}),
        json!({"name": "lanyard-tokens", "hostPath": {"path": "/var/lib/kubelet/pods"}}),
        json!({"name": "lanyard-tokens", "projected": {"sources": [
            {"serviceAccountToken": {"audience": "sts.amazonaws.com", "path": "aws"}}]}}),
        json!({"name": "lanyard-app-token", "emptyDir": {}}),
    ] {
        let mut pod = app();
        pod["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(volume.clone());
        let name = volume["name"].as_str().unwrap();
        assert_denied(&pod, &[&format!("volume \"{name}\""), "is not Lanyard's"]);
    }
}

#[test]
fn look_alike_containers_are_denied() {
    let look_alike = json!({"name": "lanyard", "image": "attacker.example/lanyard:0.1.0",
                            "restartPolicy": "Always",
                            "volumeMounts": [mount("lanyard-tokens", "/var/run/lanyard/tokens")]});
    let mut pod = app();
    pod["spec"]["initContainers"] = json!([look_alike]);
    assert_denied(
        &pod,
        &["init container \"lanyard\"", "is not Lanyard's", "image"],
    );

    let mut pod = app();
    pod["spec"]["initContainers"] = json!([{"name": "lanyard", "image": "busybox:1.36"}]);
    assert_denied(&pod, &["init container \"lanyard\""]);

    for transparent in ["true", "false"] {
        let mut pod = app();
        pod["metadata"]["annotations"] = json!({"lanyard.dev/transparent": transparent});
        pod["spec"]["initContainers"] =
            json!([{"name": "lanyard-redirect", "image": "busybox:1.36", "command": ["true"]}]);
        assert_denied(&pod, &["init container \"lanyard-redirect\""]);
    }

    let mut pod = app();
    pod["spec"]["ephemeralContainers"] = json!([{"name": "lanyard", "image": "busybox:1.36"}]);
    assert_denied(&pod, &["ephemeral container \"lanyard\""]);

    // The real sidecar with one thing changed is not Lanyard's either.
    let mut pod = injected();
    pod["spec"]["initContainers"][0]["env"][1]["value"] = json!("http://collector.example:8700");
    assert_denied(&pod, &["init container \"lanyard\"", "env"]);
    let mut pod = injected();
    pod["spec"]["initContainers"][0]["lifecycle"] =
        json!({"postStart": {"exec": {"command": ["lanyard", "sidecar"]}}});
    assert_denied(&pod, &["lifecycle"]);
}

#[test]
fn redirecting_the_agent_host_is_denied() {
    let mut pod = app();
    pod["spec"]["hostAliases"] = json!([{"ip": "10.9.9.9", "hostnames": ["lanyard-agent.lanyard-system.svc.cluster.local"]}]);
    assert_denied(
        &pod,
        &[
            "hostAliases",
            "lanyard-agent.lanyard-system.svc.cluster.local",
        ],
    );
    let mut pod = app();
    pod["spec"]["dnsPolicy"] = json!("None");
    pod["spec"]["dnsConfig"] = json!({"nameservers": ["10.9.9.9"]});
    assert_denied(&pod, &["dnsPolicy: None"]);
}

/// `pod` with the defaults kube-apiserver fills in after each mutating
/// webhook's patch (SetDefaults_* of core/v1).
fn defaulted(mut pod: Value) -> Value {
    let spec = pod["spec"].as_object_mut().unwrap();
    for list in ["initContainers", "containers"] {
        for c in spec
            .get_mut(list)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let c = c.as_object_mut().unwrap();
            c.entry("terminationMessagePath")
                .or_insert(json!("/dev/termination-log"));
            c.entry("terminationMessagePolicy").or_insert(json!("File"));
            c.entry("imagePullPolicy").or_insert(json!("IfNotPresent"));
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                if let Some(p) = c.get_mut(probe).and_then(Value::as_object_mut) {
                    p.entry("timeoutSeconds").or_insert(json!(1));
                    p.entry("periodSeconds").or_insert(json!(10));
                    p.entry("successThreshold").or_insert(json!(1));
                    p.entry("failureThreshold").or_insert(json!(3));
                    if let Some(get) = p.get_mut("httpGet").and_then(Value::as_object_mut) {
                        get.entry("scheme").or_insert(json!("HTTP"));
                    }
                }
            }
            for e in c
                .get_mut("env")
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if let Some(field) = e.pointer_mut("/valueFrom/fieldRef") {
                    field["apiVersion"] = json!("v1");
                }
            }
        }
    }
    for v in spec["volumes"].as_array_mut().unwrap() {
        if let Some(projected) = v.get_mut("projected").and_then(Value::as_object_mut) {
            projected.entry("defaultMode").or_insert(json!(420));
        }
    }
    pod
}

#[test]
fn reinvocation_after_defaulting_and_copied_specs_are_admitted_unchanged() {
    let (response, once) = admit(&app(), &all_clouds());
    assert_eq!(response["allowed"], true);
    // Reinvoked by the API server, which defaulted our objects meanwhile.
    let (again, out) = admit(&defaulted(once.clone()), &all_clouds());
    assert_eq!(again["allowed"], true, "{again}");
    assert!(again.get("patch").is_none(), "{again}");
    assert_eq!(out, defaulted(once.clone()));
    // A controller that creates a pod from a stored (mutated, defaulted) one.
    let mut copy = defaulted(once);
    copy["metadata"]["name"] = json!("ray-worker-copy");
    let (answer, _) = admit(&copy, &all_clouds());
    assert_eq!(answer["allowed"], true, "{answer}");
    assert!(answer.get("patch").is_none(), "{answer}");
}

#[test]
fn a_copy_made_for_other_bindings_is_denied_with_what_to_do() {
    let copy = defaulted(injected());
    let azure_only = Bindings {
        gcp: Vec::new(),
        aws: Vec::new(),
        ..all_clouds()
    };
    let (response, _) = admit(&copy, &azure_only);
    assert_eq!(response["allowed"], false, "{response}");
    let message = response["status"]["message"].as_str().unwrap();
    assert!(message.contains("remove it from the pod spec"), "{message}");
}

#[test]
fn names_that_merely_resemble_lanyards_are_injected_as_usual() {
    let mut pod = app();
    pod["spec"]["containers"][0]["name"] = json!("lanyard-exporter");
    pod["spec"]["volumes"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "lanyard-tokens-cache", "emptyDir": {}}));
    pod["spec"]["containers"][0]["volumeMounts"]
        .as_array_mut()
        .unwrap()
        .push(mount("lanyard-tokens-cache", "/cache"));
    let (response, out) = admit(&pod, &all_clouds());
    assert_eq!(response["allowed"], true, "{response}");
    assert_eq!(out["spec"]["initContainers"][0]["name"], "lanyard");
    // Only the sidecar mounts the cloud-token volume.
    let mounting: Vec<&str> = ["initContainers", "containers"]
        .iter()
        .flat_map(|l| out["spec"][l].as_array().unwrap())
        .filter(|c| {
            c["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["name"] == "lanyard-tokens"))
        })
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(mounting, ["lanyard"]);
}
