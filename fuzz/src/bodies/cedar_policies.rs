//! The Cedar policy loader and the decisions of what it loads.
//!
//! The input is a policy directory's contents: one `.cedar` file, or
//! several separated by a line `//@@ next file` (a Cedar comment, so a
//! seed that is a real policy file stays one). It is parsed and validated
//! against the schema as a reload does ([`lanyard::policy::load::parse`]);
//! a set that loads is then written to a directory, loaded from there by
//! [`CedarPolicy::load`] as the agent does at start, and asked to decide a
//! few requests (the shapes of `policies/*/cases.yaml`), twice, since the
//! second answer comes from the decision cache.
//!
//! Beside "never panics": what loads from memory loads from the directory,
//! with the same digest; each decision names only policies of the set, and
//! the cache answers what evaluation answered.

use std::time::{Duration, SystemTime};

use lanyard::cloud::{Cloud, Identity, Kind, Surface, TokenRequest};
use lanyard::directory::{Attributes, Metadata};
use lanyard::policy::cedar::CedarPolicy;
use lanyard::policy::load;
use lanyard::policy::{Decision, Policy, PolicyInput};
use lanyard::token::{Caller, ObjectRef};

/// The line that separates two files in an input.
const NEXT_FILE: &str = "\n//@@ next file\n";
/// Most files one input makes.
const MAX_FILES: usize = 8;

/// Runs one input.
pub fn run(data: &[u8]) {
    let mut files = Vec::new();
    let mut rest = data;
    while files.len() < MAX_FILES - 1 {
        let Some(at) = rest
            .windows(NEXT_FILE.len())
            .position(|w| w == NEXT_FILE.as_bytes())
        else {
            break;
        };
        files.push(rest[..at].to_vec());
        rest = &rest[at + NEXT_FILE.len()..];
    }
    files.push(rest.to_vec());
    let files: Vec<(String, Vec<u8>)> = files
        .into_iter()
        .enumerate()
        .map(|(n, bytes)| (format!("policy-{n}.cedar"), bytes))
        .collect();

    let Ok(loaded) = load::parse(&files) else {
        return;
    };
    let Ok(dir) = tempfile::tempdir() else {
        return;
    };
    for (name, bytes) in &files {
        if std::fs::write(dir.path().join(name), bytes).is_err() {
            return;
        }
    }
    let policy = match CedarPolicy::load(dir.path()) {
        Ok(policy) => policy,
        Err(e) => panic!("a set that parses in memory does not load from its directory: {e}"),
    };
    assert_eq!(policy.digest(), loaded.digest);
    assert_eq!(policy.policies(), loaded.count);
    let ids: Vec<String> = loaded.set.policies().map(|p| p.id().to_string()).collect();

    for input in inputs() {
        let request = input.request();
        let attributes = input.attributes();
        let policy_input = PolicyInput {
            caller: &input.caller,
            identity: &input.identity,
            request: &request,
            attributes: &attributes,
            lifetime: Some(Duration::from_secs(3600)),
            time: SystemTime::now(),
        };
        let first = policy.decide(&policy_input);
        let named = match &first {
            Decision::Allow { policies } | Decision::Deny { policies, .. } => policies,
        };
        for id in named {
            assert!(
                ids.contains(id),
                "decided by {id:?}, not in the set {ids:?}"
            );
        }
        let second = policy.decide(&policy_input);
        assert_eq!(first, second, "the decision cache answered otherwise");
    }
}

/// A request to decide.
struct Case {
    caller: Caller,
    identity: Identity,
    cloud: Cloud,
    kind: Kind,
    scopes: &'static [&'static str],
    namespace_labels: &'static [(&'static str, &'static str)],
    pod_labels: &'static [(&'static str, &'static str)],
}

impl Case {
    fn request(&self) -> TokenRequest {
        let surface = match self.cloud {
            Cloud::Azure => Surface::AzureImds,
            Cloud::Gcp => Surface::Gce,
            Cloud::Aws => Surface::AwsContainer,
        };
        TokenRequest::new(self.cloud, self.kind, surface)
            .with_scopes(self.scopes.iter().map(|s| s.to_string()).collect())
    }

    fn attributes(&self) -> Attributes {
        let map = |pairs: &[(&str, &str)]| pairs.iter().copied().collect::<Metadata>();
        Attributes {
            namespace_labels: map(self.namespace_labels),
            pod_labels: map(self.pod_labels),
            ..Attributes::default()
        }
    }
}

fn caller(namespace: &str, service_account: &str) -> Caller {
    Caller {
        namespace: namespace.into(),
        service_account: service_account.into(),
        service_account_uid: "0d4c5c6b-1f7e-4a55-9d3e-3b7d2c1a0f99".into(),
        pod: Some(ObjectRef {
            name: "raycluster-worker-0".into(),
            uid: "8a1b2c3d-4e5f-4a7b-8c9d-0e1f2a3b4c5d".into(),
        }),
        node: Some(ObjectRef {
            name: "node-a".into(),
            uid: "5e6f7a8b-9c0d-4e1f-8a2b-3c4d5e6f7a8b".into(),
        }),
        token_expires_at: 0,
        token_fingerprint: "0123456789ab".into(),
    }
}

fn inputs() -> [Case; 3] {
    [
        Case {
            caller: caller("team-a", "ray-worker"),
            identity: Identity {
                cloud: Cloud::Azure,
                id: "11111111-2222-3333-4444-555555555555".into(),
                account: "contoso.onmicrosoft.com".into(),
                account_number: None,
                via: None,
                source: lanyard::cloud::Source::Federation,
            },
            cloud: Cloud::Azure,
            kind: Kind::AccessToken,
            scopes: &["https://storage.azure.com/"],
            namespace_labels: &[("team", "a")],
            pod_labels: &[("ray.io/node-type", "worker")],
        },
        Case {
            caller: caller("team-b", "ray-head"),
            identity: Identity {
                cloud: Cloud::Gcp,
                id: "ray@team-b.iam.gserviceaccount.com".into(),
                account: "team-b".into(),
                account_number: Some("123456789012".into()),
                via: None,
                source: lanyard::cloud::Source::Federation,
            },
            cloud: Cloud::Gcp,
            kind: Kind::IdToken,
            scopes: &[],
            namespace_labels: &[("team", "b")],
            pod_labels: &[("ray.io/node-type", "head")],
        },
        Case {
            caller: caller("kube-system", "operator"),
            identity: Identity {
                cloud: Cloud::Aws,
                id: "arn:aws:iam::123456789012:role/ray-data".into(),
                account: "123456789012".into(),
                account_number: None,
                via: None,
                source: lanyard::cloud::Source::Federation,
            },
            cloud: Cloud::Aws,
            kind: Kind::AwsCredentials,
            scopes: &[],
            namespace_labels: &[],
            pod_labels: &[],
        },
    ]
}
