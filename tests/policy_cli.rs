//! `lanyard policy check` and `lanyard policy test` as operators run them in
//! their CI: exit codes, and messages that name the file, line and case.

use std::path::Path;
use std::process::{Command, Output};

fn lanyard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(args)
        .env_remove("LANYARD_CONFIG")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn the_example_sets_check_and_pass_their_cases() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies");
    for set in [
        "allow-bound",
        "team-storage",
        "aws-max-session",
        "untrusted-pods",
        "operator-only",
        "aws-chain",
    ] {
        let dir = root.join(set);
        let dir = dir.to_str().unwrap();
        let check = lanyard(&["policy", "check", dir]);
        assert_eq!(check.status.code(), Some(0), "{set}: {}", text(&check));
        assert!(text(&check).contains("are valid"), "{}", text(&check));
        let cases = format!("{dir}/cases.yaml");
        let test = lanyard(&["policy", "test", dir, &cases]);
        assert_eq!(test.status.code(), Some(0), "{set}: {}", text(&test));
        assert!(text(&test).contains("cases passed"), "{}", text(&test));
    }
}

#[test]
fn a_broken_set_fails_the_check_naming_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("team.cedar"),
        "permit (principal, action, resource)\nwhen { principal.nmae == \"x\" };\n",
    )
    .unwrap();
    let out = lanyard(&["policy", "check", dir.path().to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("team.cedar:2:"), "{}", text(&out));
    assert!(text(&out).contains("nmae"), "{}", text(&out));
}

#[test]
fn a_wrong_expectation_fails_the_test_naming_the_case_and_the_policies() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("p.cedar"),
        "@id(\"no-aws\") forbid (principal, action, resource) when { resource.cloud == \"aws\" };\n@id(\"all\") permit (principal, action, resource);\n",
    )
    .unwrap();
    let cases = dir.path().join("cases.yaml");
    std::fs::write(
        &cases,
        "cases:\n  - name: aws is expected but refused\n    principal: { namespace: a, service_account: b }\n    action: aws_credentials\n    identity: { cloud: aws, id: \"arn:aws:iam::111122223333:role/r\", account: \"111122223333\" }\n    expect: allow\n",
    )
    .unwrap();
    let d = dir.path().to_str().unwrap();
    let out = lanyard(&["policy", "test", d, cases.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("aws is expected but refused") && t.contains("no-aws"),
        "{t}"
    );
    assert!(t.contains("0 of 1 cases passed"), "{t}");

    // The right decision by the wrong policy fails too, saying both.
    std::fs::write(
        &cases,
        "cases:\n  - name: denied by the wrong one\n    principal: { namespace: a, service_account: b }\n    action: aws_credentials\n    identity: { cloud: aws, id: \"arn:aws:iam::111122223333:role/r\", account: \"111122223333\" }\n    expect: deny\n    policies: [all]\n",
    )
    .unwrap();
    let out = lanyard(&["policy", "test", d, cases.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("expected deny (decided by: all), got deny (decided by: no-aws)"),
        "{t}"
    );

    std::fs::write(&cases, "cases:\n  - name: x\n    expectation: allow\n").unwrap();
    let out = lanyard(&["policy", "test", d, cases.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "an unusable CASES file: {}",
        text(&out)
    );
    assert!(text(&out).contains("cases.yaml"), "{}", text(&out));
}

#[test]
fn cases_are_decided_in_the_cluster_they_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("p.cedar"),
        "@id(\"prod-data-only-in-prod\") forbid (principal, action, resource) when { resource.id == \"arn:aws:iam::111122223333:role/prod-data\" && !(context.cluster like \"prod-*\") };\n@id(\"all\") permit (principal, action, resource);\n",
    )
    .unwrap();
    let case = "cases:\n  - name: the prod role\n    principal: { namespace: ray, service_account: ray-worker }\n    action: aws_credentials\n    identity: { cloud: aws, id: \"arn:aws:iam::111122223333:role/prod-data\", account: \"111122223333\" }\n    expect: deny\n    policies: [prod-data-only-in-prod]\n";
    let d = dir.path().to_str().unwrap();
    let cases = dir.path().join("cases.yaml");
    for (cluster, code) in [("staging-eu-1", 0), ("prod-eu-1", 1), ("", 0)] {
        let head = match cluster {
            "" => String::new(),
            name => format!("cluster: {name}\n"),
        };
        std::fs::write(&cases, format!("{head}{case}")).unwrap();
        let out = lanyard(&["policy", "test", d, cases.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(code), "{cluster}: {}", text(&out));
    }
}
