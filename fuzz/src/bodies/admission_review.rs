//! The mutating webhook, from the body of a `POST /mutate`: AdmissionReview
//! decoding ([`lanyard::webhook::parse`]), the pod mutation
//! ([`lanyard::webhook::mutate`]) and the answer ([`respond`]).
//!
//! The ServiceAccount's bindings, which the webhook looks up in the
//! cluster, are read from the pod's own annotations (the annotation keys a
//! ServiceAccount carries), so the fuzzer controls them too; a pod naming
//! none is mutated as bound to all three clouds.
//!
//! Beside "never panics", what the webhook promises the API server:
//! - every answer is an `admission.k8s.io/v1` AdmissionReview, echoing the
//!   request's uid whenever one could be read;
//! - an allowed pod's JSON Patch applies to the object exactly as it was
//!   sent, and the result is still a Pod;
//! - the webhook invoked again on its own result adds nothing
//!   (`reinvocationPolicy: IfNeeded`);
//! - the guard (`POST /validate`) reads the same body without panicking,
//!   and what the mutation makes of a pod the guard admits, the guard
//!   admits too: Lanyard's own sidecar is Lanyard's sidecar to the guard.

use base64::Engine;
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use lanyard::cloud::{azure, Bindings, Cloud};
use lanyard::webhook::guard::{self, Guard};
use lanyard::webhook::review::{parse_for, Scope};
use lanyard::webhook::{mutate, parse, respond, Action, Answer, InjectionConfig};

/// Runs one input.
pub fn run(data: &[u8]) {
    let review = match parse(data) {
        Ok(review) => review,
        Err(err) => {
            let answer = as_sent(&err.response());
            assert_review(&answer, err.uid());
            return;
        }
    };
    let Action::Mutate(pod) = &review.action else {
        return;
    };
    let bindings = bindings(pod);
    let mut config = InjectionConfig::default();
    config.audiences[Cloud::Gcp] = Some("//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/lanyard-dev/providers/dev-cluster".into());
    config.sdk.azure_tenant_id = Some("72f988bf-86f1-41af-91ab-2d7cd011db47".into());
    let guard = Guard::new(&config, &[]);
    let guarded = guard::check(pod, &guard).is_ok();
    if let Ok(seen) = parse_for(data, Scope::Guard) {
        if let Action::Mutate(pod) = &seen.action {
            let _ = guard::check(pod, &guard);
        }
    }
    let outcome = mutate(pod, &review.namespace, &bindings, &config);
    let answer = as_sent(&respond(&review.uid, &outcome));
    assert_review(&answer, Some(&review.uid));
    let Ok(mutation) = outcome else {
        return;
    };

    // What the API server does with the answer.
    let Some(encoded) = answer["response"]["patch"].as_str() else {
        assert!(mutation.is_empty(), "a patch that was not sent");
        return;
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .expect("the patch is base64");
    let patch: json_patch::Patch =
        serde_json::from_slice(&bytes).expect("the patch is a JSON Patch");
    let sent: Value = serde_json::from_slice(data).expect("a parsed review is JSON");
    let mut object = sent["request"]["object"].clone();
    if let Err(e) = json_patch::patch(&mut object, &patch) {
        panic!("the patch does not apply to the pod as sent: {e}");
    }
    let patched: Pod = match serde_json::from_value(object) {
        Ok(pod) => pod,
        Err(e) => panic!("the patched object is not a Pod: {e}"),
    };
    if guarded {
        if let Err(refusal) = guard::check(&patched, &guard) {
            panic!("the guard refuses what the mutation made of a pod it admits: {refusal:?}");
        }
    }
    match mutate(&patched, &review.namespace, &bindings, &config) {
        Ok(again) => assert!(
            again.is_empty(),
            "reinvoked on its own result, the webhook patches again: {:?}",
            again.patch
        ),
        Err(denial) => panic!("reinvoked on its own result, the webhook refuses: {denial}"),
    }
}

/// The answer as the API server reads it: the bytes the webhook sends.
fn as_sent(answer: &Answer) -> Value {
    let body = serde_json::to_vec(answer).expect("an answer serializes");
    serde_json::from_slice(&body).expect("an answer is JSON")
}

/// An AdmissionReview answer, echoing `uid` when there is one.
fn assert_review(answer: &Value, uid: Option<&str>) {
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
    assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
    assert!(answer["response"]["allowed"].is_boolean(), "{answer}");
    if let Some(uid) = uid {
        assert_eq!(answer["response"]["uid"], uid, "{answer}");
    }
}

/// The bindings the pod's annotations name, or all three clouds.
fn bindings(pod: &Pod) -> Bindings {
    let from_pod = pod
        .metadata
        .annotations
        .as_ref()
        .map(Bindings::from_annotations)
        .unwrap_or_default();
    if !from_pod.is_empty() {
        return from_pod;
    }
    Bindings {
        azure: vec![azure::Binding {
            client_id: "11111111-2222-3333-4444-555555555555".into(),
            tenant_id: None,
            object_id: None,
            resource_id: None,
            app: None,
        }],
        gcp: vec!["ray@team-a.iam.gserviceaccount.com".into()],
        aws: vec!["arn:aws:iam::123456789012:role/ray-data".into()],
    }
}
