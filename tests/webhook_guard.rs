//! The governed-namespace guard on the shared fixtures
//! (`tests/fixtures/guard/cases.json`): each case is a pod a pod author
//! could submit (a base pod and a JSON Patch), sent as the AdmissionReview
//! the API server would send to `POST /validate`, with the decision and
//! rule it must get. `tests/python/test_guard_policy.py` evaluates the
//! chart's ValidatingAdmissionPolicy on the same cases with a CEL
//! implementation and the running webhook, and both must agree.
//!
//! The `injected` base is the `app` base as the mutation injects it (all
//! three clouds); [`the_injected_base_is_what_the_mutation_makes`] keeps it
//! so. `LANYARD_BLESS=1` rewrites it after a deliberate change to the
//! sidecar.

mod support;

use serde_json::{json, Value};

use lanyard::cloud::Cloud;
use lanyard::webhook::guard::{self, Guard};
use lanyard::webhook::review::{self, Action, Scope};
use lanyard::webhook::{mutate, InjectionConfig};
use support::guard::{all_clouds, cases, extra, injection, DIR};

fn patched(base: &Value, patch: &Value) -> Value {
    let mut doc = base.clone();
    let patch: json_patch::Patch = serde_json::from_value(patch.clone()).unwrap();
    json_patch::patch(&mut doc, &patch).unwrap();
    doc
}

/// The `app` base through the mutation, its random header set to `header`.
fn injected(cases: &Value, header: &str) -> Value {
    let app = &cases["bases"]["app"];
    let pod = serde_json::from_value(app.clone()).unwrap();
    let m = mutate(&pod, "ml", &all_clouds(), &injection(&cases["settings"])).unwrap();
    let mut out = patched(app, &serde_json::to_value(&m.patch).unwrap());
    for list in ["initContainers", "containers"] {
        for c in out["spec"][list].as_array_mut().unwrap() {
            for e in c["env"].as_array_mut().into_iter().flatten() {
                if e["name"] == "IDENTITY_HEADER" || e["name"] == "MSI_SECRET" {
                    e["value"] = json!(header);
                }
            }
        }
    }
    out
}

fn bases(cases: &Value) -> Value {
    let mut bases = cases["bases"].clone();
    bases["injected"] = support::guard::injected();
    bases["stored"] = support::guard::stored();
    bases
}

#[test]
fn the_injected_base_is_what_the_mutation_makes() {
    let cases = cases();
    let made = injected(&cases, "0123456789abcdef0123456789abcdef");
    let path = format!("{DIR}/injected.json");
    if std::env::var_os("LANYARD_BLESS").is_some() {
        std::fs::write(&path, serde_json::to_string_pretty(&made).unwrap() + "\n").unwrap();
    }
    let stored: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(
        stored, made,
        "{path} is not what the mutation injects now; LANYARD_BLESS=1 rewrites it"
    );
    // It is Lanyard's sidecar to the guard, and the mutation leaves it be.
    let pod = serde_json::from_value(made).unwrap();
    let settings = &cases["settings"];
    assert_eq!(
        guard::check(&pod, &Guard::new(&injection(settings), &extra(settings))),
        Ok(())
    );
    let again = mutate(&pod, "ml", &all_clouds(), &injection(settings)).unwrap();
    assert!(again.is_empty(), "{:?}", again.patch);
}

/// The review the API server sends for `case`.
pub fn review_of(case: &Value, bases: &Value, uid: &str) -> Value {
    let base = &bases[case["base"].as_str().unwrap()];
    let object = patched(base, &case["patch"]);
    let update = case["operation"] == "UPDATE";
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "subResource": case["subResource"],
        "namespace": "ml",
        "operation": case["operation"],
        "userInfo": {"username": "jane@example.com"},
        "object": object,
        "oldObject": if update { base.clone() } else { Value::Null },
        "dryRun": false,
    }})
}

#[test]
fn every_case_gets_its_decision_and_rule() {
    let cases = cases();
    let settings = &cases["settings"];
    let guard = Guard::new(&injection(settings), &extra(settings));
    let bases = bases(&cases);
    let mut refused = 0;
    for case in &support::guard::runs(&cases) {
        let name = case["name"].as_str().unwrap();
        let body = serde_json::to_vec(&review_of(case, &bases, "u")).unwrap();
        let review = review::parse_for(&body, Scope::Guard).unwrap();
        let Action::Mutate(pod) = review.action else {
            panic!("{name}: not reviewed: {:?}", review.action)
        };
        let outcome = guard::check(&pod, &guard);
        match (case["allowed"].as_bool().unwrap(), outcome) {
            (true, Ok(())) => {}
            (false, Err(refusal)) => {
                refused += 1;
                assert_eq!(refusal.rule.name(), case["rule"], "{name}");
                assert!(
                    refusal.message.contains(refusal.rule.name()),
                    "{name}: {}",
                    refusal.message
                );
            }
            (want, got) => panic!("{name}: want allowed={want}, got {got:?}"),
        }
    }
    assert!(refused >= 40, "{refused}");
}

#[test]
fn refusals_name_the_container_and_volume() {
    let cases = cases();
    let settings = &cases["settings"];
    let guard = Guard::new(&injection(settings), &extra(settings));
    let bases = bases(&cases);
    let find = |name: &str| {
        cases["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
            .clone()
    };
    let message = |name: &str| {
        let review = review_of(&find(name), &bases, "u");
        let pod = serde_json::from_value(review["request"]["object"].clone()).unwrap();
        guard::check(&pod, &guard).unwrap_err().message
    };
    let m = message("a debug container mounts lanyard-tokens");
    assert!(m.contains("ephemeral container \"debugger-x9\""), "{m}");
    assert!(m.contains("volume \"lanyard-tokens\""), "{m}");
    let m = message("the app projects its own sts.amazonaws.com token");
    assert!(m.contains("container \"ray-worker\""), "{m}");
    assert!(m.contains("\"sts.amazonaws.com\""), "{m}");
    let m = message("the sidecar's image swapped on an update");
    assert!(
        m.contains("init container \"lanyard\" (not Lanyard's sidecar: it differs in image)"),
        "{m}"
    );
    let m = message("hostAliases naming the agent");
    assert!(m.contains("lanyard-agent.lanyard-system.svc"), "{m}");
}

#[test]
fn what_the_guard_does_not_review_passes() {
    let cases = cases();
    let bases = bases(&cases);
    let base = json!({"base": "injected", "patch": [], "operation": "DELETE", "subResource": ""});
    for (operation, sub) in [
        ("DELETE", ""),
        ("CONNECT", "exec"),
        ("UPDATE", "status"),
        ("UPDATE", "resize"),
        ("CREATE", "binding"),
    ] {
        let mut case = base.clone();
        case["operation"] = json!(operation);
        case["subResource"] = json!(sub);
        let body = serde_json::to_vec(&review_of(&case, &bases, "u")).unwrap();
        let review = review::parse_for(&body, Scope::Guard).unwrap();
        assert!(
            matches!(review.action, Action::AllowUnchanged(_)),
            "{operation} {sub}"
        );
    }
}

#[test]
fn brokered_audiences_follow_the_configuration() {
    let cases = cases();
    let settings = &cases["settings"];
    let guard = Guard::new(&injection(settings), &extra(settings));
    for audience in [
        "api://AzureADTokenExchange",
        "api://azureadtokenexchangechina",
        "sts.amazonaws.com",
        "STS.amazonaws.com",
        settings["gcp_audience"].as_str().unwrap(),
        "https://iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/ray/providers/aks",
        "lanyard-data-lake",
    ] {
        assert!(guard.is_cloud_audience(audience), "{audience}");
    }
    for audience in [
        "vault",
        "https://kubernetes.default.svc",
        "",
        "sts.amazonaws.com/x",
    ] {
        assert!(!guard.is_cloud_audience(audience), "{audience}");
    }
    // Without Google configured, its provider is not a cloud audience.
    let mut no_google = injection(settings);
    no_google.audiences[Cloud::Gcp] = None;
    assert!(
        !Guard::new(&no_google, &[]).is_cloud_audience(settings["gcp_audience"].as_str().unwrap())
    );
    // A node-local agent reached at the node's IP has no host to redirect.
    let host_port = InjectionConfig {
        agent_url: "http://$(LANYARD_HOST_IP):8700".into(),
        ..injection(settings)
    };
    assert_eq!(Guard::new(&host_port, &[]).agent_host, None);
}
