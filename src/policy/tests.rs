//! The Cedar engine: mapping, loading, bad input, reload, examples.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::cases;
use super::cedar::{CedarPolicy, ReloadEvent};
use super::load::LoadError;
use super::{Decision, Policy, PolicyInput};
use crate::cloud::{Cloud, Identity, Kind, Surface, TokenRequest};
use crate::directory::{Attributes, Metadata};
use crate::token::Caller;

fn caller() -> Caller {
    Caller::example()
}

fn identity() -> Identity {
    Identity {
        cloud: Cloud::Gcp,
        id: "ray@proj.iam.gserviceaccount.com".into(),
        account: "proj".into(),
        account_number: Some("123".into()),
        source: crate::cloud::Source::Federation,
        via: None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> Metadata {
    pairs.iter().copied().collect()
}

fn attributes() -> Attributes {
    Attributes {
        service_account_labels: labels(&[("app", "ray")]),
        service_account_annotations: labels(&[("iam.gke.io/gcp-service-account", "ray@proj")]),
        namespace_labels: labels(&[("team", "a")]),
        pod_labels: labels(&[("ray.io/node-type", "worker")]),
    }
}

fn request() -> TokenRequest {
    let mut r = TokenRequest::new(Cloud::Gcp, Kind::AccessToken, Surface::Gce)
        .with_scopes(vec!["https://www.googleapis.com/auth/cloud-platform".into()]);
    r.audience = None;
    r
}

fn dir_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn decide(policy: &CedarPolicy) -> Decision {
    let (c, i, r, a) = (caller(), identity(), request(), attributes());
    policy.decide(&PolicyInput {
        caller: &c,
        identity: &i,
        request: &r,
        attributes: &a,
        lifetime: Some(Duration::from_secs(1800)),
        time: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000),
    })
}

fn allowed(condition: &str) -> bool {
    let text =
        format!("@id(\"p\")\npermit (principal, action, resource) when {{ {condition} }};\n");
    let dir = dir_with(&[("p.cedar", &text)]);
    let policy = CedarPolicy::load(dir.path()).unwrap_or_else(|e| panic!("{condition}: {e}"));
    matches!(decide(&policy), Decision::Allow { .. })
}

#[test]
fn the_cluster_is_in_the_context_as_the_agent_names_it() {
    let text = "@id(\"west\")\npermit (principal, action, resource) when { context.cluster == \"aks-westeurope-1\" };\n";
    let dir = dir_with(&[("p.cedar", text)]);
    let here = CedarPolicy::load(dir.path())
        .unwrap()
        .with_cluster("aks-westeurope-1");
    assert!(matches!(decide(&here), Decision::Allow { .. }));
    let elsewhere = CedarPolicy::load(dir.path())
        .unwrap()
        .with_cluster("gke-us-central1-2");
    assert!(matches!(decide(&elsewhere), Decision::Deny { .. }));
    // Unnamed, it is "".
    assert!(allowed(r#"context.cluster == """#));
}

#[test]
fn every_attribute_lands_where_the_schema_says() {
    let holds = [
        r#"principal == ServiceAccount::"team-a/ray-worker""#,
        r#"principal in Namespace::"team-a""#,
        r#"principal.name == "ray-worker""#,
        r#"principal.namespace.name == "team-a""#,
        r#"principal.namespace.hasTag("team") && principal.namespace.getTag("team") == "a""#,
        r#"principal.hasTag("app") && principal.getTag("app") == "ray""#,
        r#"principal.annotations.hasTag("iam.gke.io/gcp-service-account") && principal.annotations.getTag("iam.gke.io/gcp-service-account") == "ray@proj""#,
        r#"context.pod.name == "ray-worker-0" && context.pod.uid == "pod-uid" && context.pod.node == "node-1""#,
        r#"context.pod.hasTag("ray.io/node-type") && context.pod.getTag("ray.io/node-type") == "worker""#,
        r#"action == Action::"access_token" && action in Action::"credential""#,
        r#"resource.cloud == "gcp" && resource.id == "ray@proj.iam.gserviceaccount.com" && resource.account == "proj""#,
        r#"resource has account_number && resource.account_number == "123""#,
        r#"resource.source == "federation""#,
        r#"context.scopes.contains("https://www.googleapis.com/auth/cloud-platform")"#,
        r#"!(context has audience)"#,
        r#"context has lifetime && context.lifetime == 1800"#,
        r#"context.surface == "gce" && context.node == "node-1""#,
        r#"context.time == 1800000000"#,
    ];
    for condition in holds {
        assert!(allowed(condition), "should hold: {condition}");
    }
    for condition in [
        r#"principal.namespace.hasTag("team") && principal.namespace.getTag("team") == "b""#,
        r#"context.pod.hasTag("tier")"#,
        r#"action == Action::"aws_credentials""#,
        r#"resource.source == "node""#,
    ] {
        assert!(!allowed(condition), "should not hold: {condition}");
    }
}

#[test]
fn the_request_conforms_to_the_schema() {
    let (c, i, r, a) = (caller(), identity(), request(), attributes());
    let input = PolicyInput {
        caller: &c,
        identity: &i,
        request: &r,
        attributes: &a,
        lifetime: Some(Duration::from_secs(60)),
        time: SystemTime::now(),
    };
    let (request, entities) = super::entities::request(&input, "aks-westeurope-1").unwrap();
    let schema = super::schema::schema();
    cedar_policy::Request::new(
        request.principal().unwrap().clone(),
        request.action().unwrap().clone(),
        request.resource().unwrap().clone(),
        request.context().unwrap().clone(),
        Some(schema),
    )
    .expect("the context conforms");
    cedar_policy::Entities::from_entities(entities.iter().cloned(), Some(schema))
        .expect("the entities conform");
}

#[test]
fn no_permit_denies_and_says_who_and_what() {
    let dir = dir_with(&[(
        "p.cedar",
        r#"permit (principal, action, resource) when { resource.cloud == "aws" };"#,
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    match decide(&policy) {
        Decision::Deny { reason, policies } => {
            assert!(policies.is_empty());
            assert!(reason.contains("team-a/ray-worker"), "{reason}");
            assert!(
                reason.contains("ray@proj.iam.gserviceaccount.com"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn forbid_wins_and_is_named() {
    let dir = dir_with(&[(
        "p.cedar",
        "@id(\"all\") permit (principal, action, resource);\n@id(\"no-gcp\") forbid (principal, action, resource) when { resource.cloud == \"gcp\" };\n",
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    assert!(matches!(decide(&policy), Decision::Deny { policies, .. } if policies == ["no-gcp"]));
}

#[test]
fn an_evaluation_error_fails_closed() {
    // Overflows at evaluation: Cedar would skip this forbid and allow.
    let dir = dir_with(&[(
        "p.cedar",
        "@id(\"all\") permit (principal, action, resource);\n@id(\"overflow\") forbid (principal, action, resource) when { context.time * 100000000000 > 0 };\n",
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    assert!(matches!(decide(&policy), Decision::Deny { policies, .. } if policies == ["overflow"]));
}

#[test]
fn unnamed_policies_are_named_by_file_and_position() {
    let dir = dir_with(&[(
        "team.cedar",
        "forbid (principal, action, resource);\npermit (principal, action, resource);\n",
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    assert!(
        matches!(decide(&policy), Decision::Deny { policies, .. } if policies == ["team.cedar#0"])
    );
}

fn problems(dir: &Path) -> String {
    match CedarPolicy::load(dir) {
        Ok(_) => panic!("loaded"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_input_is_named_by_file_line_and_problem() {
    let cases: [(&str, &[u8], &str); 6] = [
        (
            "syntax.cedar",
            b"permit (principal, action, resource)\nwhen { context.scopes.contains( };\n",
            "syntax.cedar:2:",
        ),
        (
            "entity.cedar",
            b"permit (principal == User::\"alice\", action, resource);\n",
            "User",
        ),
        (
            "action.cedar",
            b"permit (principal, action == Action::\"delete\", resource);\n",
            "delete",
        ),
        (
            "attribute.cedar",
            b"permit (principal, action, resource)\nwhen { principal.nmae == \"x\" };\n",
            "attribute.cedar:2:",
        ),
        (
            "utf8.cedar",
            b"permit (principal, action, resource);\n\xff\xfe\n",
            "utf8.cedar:2:1: not valid UTF-8",
        ),
        (
            "template.cedar",
            b"permit (principal == ?principal, action, resource);\n",
            "templates",
        ),
    ];
    for (file, text, expect) in cases {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(file), text).unwrap();
        let message = problems(dir.path());
        assert!(message.contains(file), "{file}: {message}");
        assert!(message.contains(expect), "{file}: {message}");
    }
    let dup = dir_with(&[
        (
            "a.cedar",
            "@id(\"x\") permit (principal, action, resource);",
        ),
        (
            "b.cedar",
            "@id(\"x\") forbid (principal, action, resource);",
        ),
    ]);
    let message = problems(dup.path());
    assert!(
        message.contains("a.cedar") && message.contains("b.cedar"),
        "{message}"
    );
    let missing = problems(Path::new("/nonexistent/lanyard-policies"));
    assert!(
        missing.contains("/nonexistent/lanyard-policies"),
        "{missing}"
    );
}

#[test]
fn an_empty_directory_denies_everything() {
    let dir = tempfile::tempdir().unwrap();
    let policy = CedarPolicy::load(dir.path()).unwrap();
    assert_eq!(policy.policies(), 0);
    assert!(matches!(decide(&policy), Decision::Deny { .. }));
}

#[test]
fn ten_thousand_policies_load_and_decide() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::new();
    for n in 0..10_000 {
        text.push_str(&format!(
            "@id(\"p{n}\")\npermit (principal == ServiceAccount::\"ns-{n}/sa\", action, resource) when {{ resource.cloud == \"gcp\" }};\n"
        ));
    }
    std::fs::write(dir.path().join("many.cedar"), text).unwrap();
    let started = std::time::Instant::now();
    let policy = CedarPolicy::load(dir.path()).unwrap();
    eprintln!("10,000 policies loaded in {:?}", started.elapsed());
    assert_eq!(policy.policies(), 10_000);
    assert!(
        matches!(decide(&policy), Decision::Deny { .. }),
        "none names team-a"
    );
}

/// A directory laid out as the kubelet mounts a ConfigMap.
struct ConfigMapDir {
    dir: tempfile::TempDir,
    generation: u32,
}

impl ConfigMapDir {
    fn new(files: &[(&str, &str)]) -> Self {
        let mut d = ConfigMapDir {
            dir: tempfile::tempdir().unwrap(),
            generation: 0,
        };
        d.update(files);
        d
    }

    /// A new `..TIMESTAMP` directory, `..data` swapped to it atomically,
    /// top-level symlinks for every key.
    fn update(&mut self, files: &[(&str, &str)]) {
        self.generation += 1;
        let root = self.dir.path();
        let data = format!("..2026_12_02_{}", self.generation);
        std::fs::create_dir(root.join(&data)).unwrap();
        for (name, text) in files {
            std::fs::write(root.join(&data).join(name), text).unwrap();
            let link = root.join(name);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(format!("..data/{name}"), &link).unwrap();
            }
        }
        let tmp = root.join("..data_tmp");
        std::os::unix::fs::symlink(&data, &tmp).unwrap();
        std::fs::rename(&tmp, root.join("..data")).unwrap();
    }
}

const ALLOW: &str = "@id(\"allow\") permit (principal, action, resource);";
const DENY_GCP: &str =
    "@id(\"no-gcp\") forbid (principal, action, resource) when { resource.cloud == \"gcp\" };";

#[test]
fn reload_swaps_valid_sets_and_keeps_the_last_good_one() {
    let mut cm = ConfigMapDir::new(&[("p.cedar", ALLOW)]);
    let policy = CedarPolicy::load(cm.dir.path()).unwrap();
    assert!(matches!(decide(&policy), Decision::Allow { .. }));
    assert_eq!(policy.reload(), None, "unchanged");

    cm.update(&[("p.cedar", &format!("{ALLOW}\n{DENY_GCP}"))]);
    assert!(matches!(
        policy.reload(),
        Some(ReloadEvent::Loaded { policies: 2, .. })
    ));
    assert!(
        matches!(decide(&policy), Decision::Deny { .. }),
        "the new set decides"
    );

    cm.update(&[(
        "p.cedar",
        "permit (principal, action, resource) when { nonsense };",
    )]);
    match policy.reload() {
        Some(ReloadEvent::Rejected { error }) => assert!(error.contains("p.cedar"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(decide(&policy), Decision::Deny { policies, .. } if policies == ["no-gcp"]),
        "last good set"
    );

    let gone = cm.dir.path().to_path_buf();
    drop(cm);
    assert!(
        matches!(policy.reload(), Some(ReloadEvent::Rejected { .. })),
        "directory removed"
    );
    assert!(!gone.exists());
    assert!(
        matches!(decide(&policy), Decision::Deny { policies, .. } if policies == ["no-gcp"]),
        "still in force"
    );
}

#[tokio::test]
async fn the_watch_reports_each_change_once() {
    let mut cm = ConfigMapDir::new(&[("p.cedar", ALLOW)]);
    let policy = Arc::new(CedarPolicy::load(cm.dir.path()).unwrap());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let task = policy.clone().watch(Duration::from_millis(20), move |e| {
        let _ = tx.send(e);
    });
    cm.update(&[("p.cedar", "broken (")]);
    let first = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap();
    assert!(matches!(first, Some(ReloadEvent::Rejected { .. })));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(rx.try_recv().is_err(), "a rejection is reported once");
    cm.update(&[("p.cedar", DENY_GCP)]);
    let next = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap();
    assert!(matches!(
        next,
        Some(ReloadEvent::Loaded { policies: 1, .. })
    ));
    task.abort();
}

#[test]
fn every_example_set_passes_its_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    let mut sets = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let dir = entry.unwrap().path();
        if !dir.is_dir() {
            continue;
        }
        let policy = CedarPolicy::load(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let file = dir.join("cases.yaml");
        let cases = cases::read(&file).unwrap();
        assert!(!cases.cases.is_empty());
        for o in cases::run(&policy, &cases, &file.display().to_string()).unwrap() {
            assert!(
                o.passed,
                "{}: {:?}: {:?}",
                dir.display(),
                o.name,
                o.decision
            );
        }
        sets += 1;
    }
    assert!(sets >= 5, "{sets} example sets");
}

#[test]
fn a_cases_file_with_an_unknown_field_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cases.yaml");
    std::fs::write(
        &file,
        "cases:\n  - name: x\n    principal: { namespace: a, service_account: b, colour: red }\n    action: access_token\n    identity: { cloud: azure, id: c }\n    expect: allow\n",
    )
    .unwrap();
    let e = cases::read(&file).unwrap_err().to_string();
    assert!(e.contains("colour") && e.contains("line 3"), "{e}");
}

#[test]
fn load_errors_are_enums() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("x.cedar"), "permit (").unwrap();
    assert!(matches!(
        CedarPolicy::load(dir.path()),
        Err(LoadError::Invalid { .. })
    ));
}

#[test]
fn reused_entities_never_outlive_a_relabel() {
    let dir = dir_with(&[(
        "p.cedar",
        "permit (principal, action, resource) when { principal.namespace.hasTag(\"team\") && principal.namespace.getTag(\"team\") == \"a\" };",
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    let (c, i, r) = (caller(), identity(), request());
    let decide_with = |team: &str| {
        let mut a = attributes();
        a.namespace_labels = labels(&[("team", team)]);
        policy.decide(&PolicyInput {
            caller: &c,
            identity: &i,
            request: &r,
            attributes: &a,
            lifetime: None,
            time: SystemTime::now(),
        })
    };
    for _ in 0..3 {
        assert!(matches!(decide_with("a"), Decision::Allow { .. }));
        assert!(
            matches!(decide_with("b"), Decision::Deny { .. }),
            "relabelled"
        );
    }
}

#[test]
fn remembered_decisions_never_outlive_their_second_or_request() {
    // Permits storage scopes until a moment; every repeated request must be
    // decided for its own time and its own scopes, not from a remembered
    // answer to another.
    let until = 1_800_000_010;
    let dir = dir_with(&[(
        "p.cedar",
        &format!(
            "@id(\"until\") permit (principal, action, resource) when {{ context.time < {until} && context.scopes.contains(\"storage\") }};"
        ),
    )]);
    let policy = CedarPolicy::load(dir.path()).unwrap();
    let (c, i, a) = (caller(), identity(), attributes());
    let decide_at = |second: u64, scope: &str| {
        let r = TokenRequest::new(Cloud::Gcp, Kind::AccessToken, Surface::Gce)
            .with_scopes(vec![scope.into()]);
        policy.decide(&PolicyInput {
            caller: &c,
            identity: &i,
            request: &r,
            attributes: &a,
            lifetime: None,
            time: SystemTime::UNIX_EPOCH + Duration::from_secs(second),
        })
    };
    for _ in 0..3 {
        assert!(matches!(
            decide_at(until - 1, "storage"),
            Decision::Allow { .. }
        ));
        assert!(
            matches!(decide_at(until - 1, "compute"), Decision::Deny { .. }),
            "another scope, same second"
        );
        assert!(
            matches!(decide_at(until, "storage"), Decision::Deny { .. }),
            "the next second"
        );
    }
}

#[test]
fn without_a_policy_a_node_identity_is_refused() {
    use super::AllowBound;
    let (c, r, a) = (caller(), request(), attributes());
    let mut i = identity();
    let input = |i: &Identity| {
        AllowBound.decide(&PolicyInput {
            caller: &c,
            identity: i,
            request: &r,
            attributes: &a,
            lifetime: None,
            time: SystemTime::UNIX_EPOCH,
        })
    };
    assert!(matches!(input(&i), Decision::Allow { .. }));
    // Azure's node-pool identities are the node identities there are.
    i.cloud = crate::cloud::Cloud::Azure;
    i.source = crate::cloud::Source::Node;
    match input(&i) {
        Decision::Deny { reason, policies } => {
            assert!(policies.is_empty());
            assert!(reason.contains("azure.node_identities"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}
