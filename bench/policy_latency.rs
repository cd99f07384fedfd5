//! Decision latency of the Cedar policy engine, with 10 and with 1,000
//! policies of two shapes operators write — per-namespace permits on
//! labels with a few forbids, and per-job identities (one permit per job,
//! all in one namespace, as `policies/ray-job-identities`) — p50 and p99 of
//! one `CedarPolicy::decide`, both for a
//! request evaluated afresh (each one a second later than the last, so the
//! decision cache never answers; the caller's entities are reused, as for
//! any caller seen before) and for a repeated request (answered from the
//! decision cache, as cache hits of one pod within a second are). Run:
//! `cargo bench --bench policy_latency` (or `bench/policy`). It prints
//! figures; it asserts none.

use std::time::{Duration, Instant, SystemTime};

use lanyard::cloud::{Cloud, Identity, Kind, Surface, TokenRequest};
use lanyard::directory::{Attributes, Metadata};
use lanyard::policy::cedar::CedarPolicy;
use lanyard::policy::{Decision, Policy, PolicyInput};
use lanyard::token::{Caller, ObjectRef};

/// `n` policies: per-team permits (one matches the caller, the last team),
/// plus forbids every caller's request is checked against.
fn policy_text(n: usize) -> String {
    let mut text = String::new();
    text.push_str(
        "@id(\"no-management\")\nforbid (principal, action, resource) when { context.scopes.contains(\"https://management.azure.com/\") };\n\
         @id(\"untrusted\")\nforbid (principal, action, resource) when { context.pod.hasTag(\"tier\") && context.pod.getTag(\"tier\") == \"untrusted\" };\n",
    );
    for team in 0..n.saturating_sub(2) {
        text.push_str(&format!(
            "@id(\"team-{team}\")\npermit (principal in Namespace::\"team-{team}\", action in Action::\"credential\", resource)\n\
             when {{ principal.namespace.hasTag(\"team\") && principal.namespace.getTag(\"team\") == \"{team}\" && resource.cloud == \"azure\" && context.scopes.contains(\"https://storage.azure.com/\") }};\n"
        ));
    }
    text
}

/// `n` per-job permits for one shared ServiceAccount, `team-a/ray-worker`
/// (`policies/ray-job-identities`): job `j`'s pods, labelled
/// `jobs.example.com/name=job-j`, may have role `job-j`.
fn job_policy_text(n: usize) -> String {
    let mut text = String::new();
    for job in 0..n {
        text.push_str(&format!(
            "@id(\"job-{job}\")\npermit (principal == ServiceAccount::\"team-a/ray-worker\", action in Action::\"credential\", \
             resource == CloudIdentity::\"aws/111122223333/arn:aws:iam::111122223333:role/job-{job}\")\n\
             when {{ context.pod.hasTag(\"jobs.example.com/name\") && context.pod.getTag(\"jobs.example.com/name\") == \"job-{job}\" }};\n"
        ));
    }
    text
}

/// A `ray-worker` ServiceAccount's pod `pod` in `namespace`, on node-1.
fn worker(namespace: &str, pod: &str) -> Caller {
    Caller {
        namespace: namespace.into(),
        service_account: "ray-worker".into(),
        service_account_uid: "uid".into(),
        pod: Some(ObjectRef {
            name: pod.into(),
            uid: "pod-uid".into(),
        }),
        node: Some(ObjectRef {
            name: "node-1".into(),
            uid: "node-uid".into(),
        }),
        token_expires_at: 0,
        token_fingerprint: "sha256:0".into(),
    }
}

fn labels(pairs: &[(&str, &str)]) -> Metadata {
    pairs.iter().copied().collect()
}

fn main() {
    let iterations: usize = std::env::var("BENCH_POLICY_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000);
    println!("| shape | policies | decision | request | p50 µs | p99 µs | max µs |");
    println!("|---|---:|---|---|---:|---:|---:|");
    for n in [10usize, 1000] {
        team_shape(n, iterations);
    }
    for n in [10usize, 1000] {
        job_shape(n, iterations);
    }
}

/// Per-namespace permits; the caller is in the third-to-last team.
fn team_shape(n: usize, iterations: usize) {
    {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("bench.cedar"), policy_text(n)).expect("write");
        let policy = CedarPolicy::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let team = n.saturating_sub(3);
        let caller = worker(&format!("team-{team}"), "raycluster-worker-7");
        let identity = Identity {
            cloud: Cloud::Azure,
            id: "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21".into(),
            account: "contoso.onmicrosoft.com".into(),
            account_number: None,
            source: lanyard::cloud::Source::Federation,
            via: None,
        };
        let request = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds)
            .with_scopes(vec!["https://storage.azure.com/".into()]);
        let attributes = Attributes {
            service_account_labels: labels(&[("app.kubernetes.io/name", "ray")]),
            service_account_annotations: labels(&[(
                "azure.workload.identity/client-id",
                "5f2c9e1a",
            )]),
            namespace_labels: labels(&[
                ("team", &team.to_string()),
                ("kubernetes.io/metadata.name", "x"),
            ]),
            pod_labels: labels(&[
                ("ray.io/node-type", "worker"),
                ("ray.io/cluster", "raycluster"),
            ]),
        };
        measure(
            "teams",
            &policy,
            &caller,
            &identity,
            &request,
            &attributes,
            iterations,
        );
    }
}

/// Per-job permits; the caller is a pod of job `n - 3` asking for its
/// job's role.
fn job_shape(n: usize, iterations: usize) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("bench.cedar"), job_policy_text(n)).expect("write");
    let policy = CedarPolicy::load(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let job = n.saturating_sub(3);
    let caller = worker("team-a", &format!("job-{job}-worker-3"));
    let identity = Identity {
        cloud: Cloud::Aws,
        id: format!("arn:aws:iam::111122223333:role/job-{job}"),
        account: "111122223333".into(),
        account_number: None,
        source: lanyard::cloud::Source::Federation,
        via: None,
    };
    let request = TokenRequest::new(Cloud::Aws, Kind::AwsCredentials, Surface::AwsContainer);
    let job_label = format!("job-{job}");
    let attributes = Attributes {
        service_account_labels: labels(&[("app.kubernetes.io/name", "ray")]),
        service_account_annotations: labels(&[(
            "eks.amazonaws.com/role-arn",
            "arn:aws:iam::111122223333:role/ray-worker",
        )]),
        namespace_labels: labels(&[("kubernetes.io/metadata.name", "team-a")]),
        pod_labels: labels(&[
            ("ray.io/node-type", "worker"),
            ("jobs.example.com/name", &job_label),
        ]),
    };
    measure(
        "jobs",
        &policy,
        &caller,
        &identity,
        &request,
        &attributes,
        iterations,
    );
}

/// Prints p50, p99 and max of `policy.decide` for the input, afresh and
/// repeated.
fn measure(
    shape: &str,
    policy: &CedarPolicy,
    caller: &Caller,
    identity: &Identity,
    request: &TokenRequest,
    attributes: &Attributes,
    iterations: usize,
) {
    let start = SystemTime::now();
    let input_at = |i: u64| PolicyInput {
        caller,
        identity,
        request,
        attributes,
        lifetime: None,
        time: start + Duration::from_secs(i),
    };
    let input = input_at(0);
    let decided = match policy.decide(&input) {
        Decision::Allow { policies } => format!("allow ({})", policies.join(",")),
        Decision::Deny { reason, .. } => format!("deny: {reason}"),
    };
    for (label, fresh) in [("evaluated afresh", true), ("repeated", false)] {
        for i in 0..iterations / 10 {
            let t = if fresh { 1_000_000 + i as u64 } else { 0 };
            std::hint::black_box(policy.decide(&input_at(t)));
        }
        let mut samples: Vec<Duration> = Vec::with_capacity(iterations);
        for i in 0..iterations {
            let input = input_at(if fresh { 2_000_000 + i as u64 } else { 0 });
            let started = Instant::now();
            std::hint::black_box(policy.decide(&input));
            samples.push(started.elapsed());
        }
        samples.sort();
        let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "| {shape} | {} | {decided} | {label} | {:.1} | {:.1} | {:.1} |",
            policy.policies(),
            us(at(0.50)),
            us(at(0.99)),
            us(samples[samples.len() - 1])
        );
    }
}
