//! The guard's shared fixtures (`tests/fixtures/guard`): the cases, the
//! settings they were made with, and the bindings of their pods.

use serde_json::Value;

use lanyard::cloud::{azure, Bindings, Cloud};
use lanyard::serve::sdk_env::SdkDefaults;
use lanyard::webhook::InjectionConfig;

/// Where the fixtures are.
pub const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/guard");

/// `cases.json`: settings, bases and cases.
pub fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/cases.json")).unwrap()).unwrap()
}

/// `injected.json`: the `app` base as the mutation injects it.
pub fn injected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/injected.json")).unwrap()).unwrap()
}

/// `stored.json`: the `app` base as the API server stores it after
/// admission with Lanyard's webhook and a mesh injector
/// (`tests/admission_chain.rs` makes it).
pub fn stored() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{DIR}/stored.json")).unwrap()).unwrap()
}

/// Every case as it is run: as written, and each case on the `injected`
/// base once more on the `stored` one (the pod as a cluster stores it),
/// where it must get the same decision and rule.
pub fn runs(cases: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for case in cases["cases"].as_array().unwrap() {
        out.push(case.clone());
        if case["base"] == "injected" {
            let mut stored = case.clone();
            stored["base"] = "stored".into();
            stored["name"] = format!("{} (as stored)", case["name"].as_str().unwrap()).into();
            out.push(stored);
        }
    }
    out
}

/// What the webhook injects with the fixtures' settings.
pub fn injection(settings: &Value) -> InjectionConfig {
    let text = |k: &str| settings[k].as_str().unwrap().to_string();
    let mut injection = InjectionConfig {
        sidecar_image: text("sidecar_image"),
        agent_url: text("agent_url"),
        sdk: SdkDefaults {
            azure_tenant_id: Some(text("azure_tenant_id")),
            aws_region: Some(text("aws_region")),
            gcp_universe_domain: None,
        },
        ..InjectionConfig::default()
    };
    injection.audiences[Cloud::Gcp] = Some(text("gcp_audience"));
    injection
}

/// The fixtures' `extra_audiences`.
pub fn extra(settings: &Value) -> Vec<String> {
    serde_json::from_value(settings["extra_audiences"].clone()).unwrap()
}

/// The bindings of the fixtures' ServiceAccount: all three clouds.
pub fn all_clouds() -> Bindings {
    Bindings {
        azure: vec![azure::Binding {
            client_id: "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21".into(),
            tenant_id: None,
            object_id: None,
            resource_id: None,
            app: None,
        }],
        gcp: vec!["ray-worker@ml-data.iam.gserviceaccount.com".into()],
        aws: vec!["arn:aws:iam::111122223333:role/ray-worker".into()],
    }
}
