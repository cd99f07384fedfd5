//! The workspace's layering, as Cargo resolves it: the crates beneath the
//! product depend on nothing above them, and the core does no I/O. Read
//! from `cargo metadata`'s resolved graph (normal dependencies only, every
//! feature of the workspace as it builds), so a dependency that arrives
//! through another crate counts too.

use std::collections::{BTreeSet, HashMap};
use std::process::Command;

use serde_json::Value;

/// Every package `name` depends on, directly or not, through normal
/// (not dev or build) dependencies.
fn closure(name: &str) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--locked"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let names: HashMap<&str, &str> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| (p["id"].as_str().unwrap(), p["name"].as_str().unwrap()))
        .collect();
    let nodes: HashMap<&str, Vec<&str>> = meta["resolve"]["nodes"]
        .as_array()
        .expect("the resolved graph")
        .iter()
        .map(|n| {
            let normal = n["deps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k["kind"].is_null())
                })
                .map(|d| d["pkg"].as_str().unwrap())
                .collect();
            (n["id"].as_str().unwrap(), normal)
        })
        .collect();
    let root = names
        .iter()
        .find(|(_, n)| **n == name)
        .map(|(id, _)| *id)
        .unwrap_or_else(|| panic!("no package {name} in the workspace"));
    let mut seen = BTreeSet::new();
    let mut todo = vec![root];
    while let Some(id) = todo.pop() {
        for dep in nodes.get(id).into_iter().flatten() {
            if seen.insert(names[dep].to_string()) {
                todo.push(dep);
            }
        }
    }
    seen
}

/// What `deps` has of `forbidden` (a name, or a family: `kube` also
/// means `kube-client`), and every Lanyard crate but those of `beneath`.
fn breaches(deps: &BTreeSet<String>, forbidden: &[&str], beneath: &[&str]) -> Vec<String> {
    deps.iter()
        .filter(|c| {
            forbidden
                .iter()
                .any(|f| *c == f || c.starts_with(&format!("{f}-")))
                || (c.starts_with("lanyard") && !beneath.contains(&c.as_str()))
        })
        .cloned()
        .collect()
}

#[test]
fn the_core_does_no_io_and_depends_on_no_other_lanyard_crate() {
    let deps = closure("lanyard-core");
    assert!(deps.contains("secrecy"), "{deps:?}");
    let bad = breaches(
        &deps,
        &["tokio", "hyper", "reqwest", "kube", "cedar-policy", "axum"],
        &[],
    );
    assert!(bad.is_empty(), "lanyard-core reaches {bad:?}");
}

#[test]
fn http_serving_knows_no_cloud_kubernetes_or_policy() {
    let deps = closure("lanyard-http");
    assert!(deps.contains("hyper"), "{deps:?}");
    let bad = breaches(
        &deps,
        &["reqwest", "kube", "k8s-openapi", "cedar-policy"],
        &[],
    );
    assert!(bad.is_empty(), "lanyard-http reaches {bad:?}");
}

/// What neither the agent API nor the surfaces may link: the pipeline's
/// and the exchangers' dependencies.
const ABOVE_THE_HOP: [&str; 5] = [
    "reqwest",
    "kube",
    "k8s-openapi",
    "cedar-policy",
    "aws-sigv4",
];

#[test]
fn the_agent_api_links_no_pipeline_policy_kubernetes_or_exchanger() {
    let deps = closure("lanyard-agent-api");
    assert!(
        deps.contains("hyper") && deps.contains("lanyard-core"),
        "{deps:?}"
    );
    // Of Lanyard's crates, only the core: not the product (the pipeline,
    // the exchangers), the serving crate or the emulators.
    let forbidden = [ABOVE_THE_HOP.as_slice(), &["axum"]].concat();
    let bad = breaches(&deps, &forbidden, &["lanyard-core"]);
    assert!(bad.is_empty(), "lanyard-agent-api reaches {bad:?}");
}

#[test]
fn the_surfaces_link_no_pipeline_policy_kubernetes_or_exchanger() {
    let deps = closure("lanyard-surfaces");
    assert!(
        deps.contains("axum") && deps.contains("lanyard-agent-api"),
        "{deps:?}"
    );
    let bad = breaches(
        &deps,
        &ABOVE_THE_HOP,
        &["lanyard-core", "lanyard-http", "lanyard-agent-api"],
    );
    assert!(bad.is_empty(), "lanyard-surfaces reaches {bad:?}");
}

#[test]
fn start_up_links_no_serving_pipeline_policy_kubernetes_or_exchanger() {
    let deps = closure("lanyard-startup");
    assert!(
        deps.contains("figment") && deps.contains("tracing-subscriber"),
        "{deps:?}"
    );
    let forbidden = [ABOVE_THE_HOP.as_slice(), &["hyper", "axum"]].concat();
    let bad = breaches(&deps, &forbidden, &["lanyard-core"]);
    assert!(bad.is_empty(), "lanyard-startup reaches {bad:?}");
}

/// The slim sidecar, in every opted-in pod, links the surfaces and the
/// agent API's client, and nothing of the agent: no Cedar, no Kubernetes
/// client, no exchanger (reqwest, the AWS signer), no emulator, not the
/// product crate.
#[test]
fn the_sidecar_links_no_cedar_kubernetes_or_exchanger() {
    let deps = closure("lanyard-sidecar");
    assert!(
        deps.contains("lanyard-surfaces") && deps.contains("lanyard-agent-api"),
        "{deps:?}"
    );
    let beneath = [
        "lanyard-core",
        "lanyard-http",
        "lanyard-startup",
        "lanyard-agent-api",
        "lanyard-surfaces",
    ];
    let bad = breaches(&deps, &ABOVE_THE_HOP, &beneath);
    assert!(bad.is_empty(), "lanyard-sidecar reaches {bad:?}");
    // The same, as `cargo tree` prints it (the command a reviewer runs).
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--locked", "-p", "lanyard-sidecar", "-e", "normal"])
        .args(["--prefix", "none", "--format", "{p}"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let printed: BTreeSet<String> = tree
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(printed.contains("lanyard-surfaces"), "{tree}");
    let bad = breaches(
        &printed,
        &ABOVE_THE_HOP,
        &[&beneath[..], &["lanyard-sidecar"]].concat(),
    );
    assert!(
        bad.is_empty(),
        "cargo tree -p lanyard-sidecar shows {bad:?}"
    );
}

#[test]
fn the_product_stands_on_both() {
    let deps = closure("lanyard");
    assert!(
        deps.contains("lanyard-core")
            && deps.contains("lanyard-http")
            && deps.contains("lanyard-agent-api")
            && deps.contains("lanyard-surfaces")
            && deps.contains("lanyard-startup")
            && deps.contains("lanyard-sidecar"),
        "{deps:?}"
    );
    // The check sees what the layers beneath must not have.
    for above in ["kube", "cedar-policy", "reqwest", "aws-sigv4"] {
        assert!(
            deps.iter()
                .any(|d| d == above || d.starts_with(&format!("{above}-"))),
            "{above}"
        );
    }
}
