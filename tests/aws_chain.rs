//! AWS target roles, as EKS Pod Identity chains into them: the pod's token
//! gives a role (`AssumeRoleWithWebIdentity`), whose session assumes the
//! target role (a SigV4-signed `sts:AssumeRole`) with EKS's session tags,
//! an external id and a session policy. Against the validating STS
//! emulator, which checks the signature with the first session's keys, the
//! target's trust (source role, `sts:ExternalId`, `sts:TagSession`), the
//! tag limits and the one-hour cap of chained sessions.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::aws::{AssumeRoleOptions, AwsCredentials, AwsExchanger};
use lanyard::cloud::CloudError;
use lanyard::config::Config;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::aws::{
    AwsEmulatorConfig, AwsRole, AwsSts, OidcProvider, SessionAction, DEFAULT_AUDIENCE,
};
use lanyard_emulators::{Issuer, PodIdentity};
use support::export;

const SOURCE: &str = "arn:aws:iam::111122223333:role/ray-worker";
const TARGET: &str = "arn:aws:iam::222233334444:role/data-lake";
const UNTAGGED: &str = "arn:aws:iam::222233334444:role/no-tags";
const EXTERNAL_ID: &str = "lanyard-7f3a-ray";
const CLUSTER_ARN: &str = "arn:aws:eks:us-east-1:111122223333:cluster/ray-prod";
const HOUR: Duration = Duration::from_secs(3600);

struct Env {
    issuer: Arc<Issuer>,
    sts: Arc<AwsSts>,
    exchanger: AwsExchanger,
    _stop: ShutdownTrigger,
}

async fn start() -> Env {
    let (stop, shutdown) = Shutdown::new();
    let issuer = support::loopback_issuer(&shutdown).await;
    let url = issuer.url().to_string();
    let role = |arn: &str, trusted_roles: Vec<String>, allow_tag_session: bool| AwsRole {
        arn: arn.into(),
        trusted_subjects: if trusted_roles.is_empty() {
            vec!["system:serviceaccount:ml:ray-worker".into()]
        } else {
            Vec::new()
        },
        max_session_duration: 43_200,
        trusted_roles,
        external_id: Some(EXTERNAL_ID.into()).filter(|_| allow_tag_session),
        allow_tag_session,
    };
    let sts = Arc::new(AwsSts::new(
        AwsEmulatorConfig {
            providers: vec![OidcProvider {
                issuer: url,
                audiences: vec![DEFAULT_AUDIENCE.into()],
            }],
            roles: vec![
                role(SOURCE, vec![], false),
                role(TARGET, vec![SOURCE.into()], true),
                role(UNTAGGED, vec![SOURCE.into()], false),
            ],
            ..Default::default()
        },
        lanyard::http::client(),
    ));
    let listener = bind("127.0.0.1:0".parse().unwrap(), "sts").await.unwrap();
    let sts_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(listener, sts.router(), shutdown);
    Env {
        issuer,
        sts,
        exchanger: AwsExchanger::new(lanyard::http::client(), sts_url),
        _stop: stop,
    }
}

impl Env {
    async fn first_hop(&self) -> AwsCredentials {
        let pod = PodIdentity::new("ml", "ray-worker", "ray-worker-0", "node-a");
        let token = SecretString::from(self.issuer.mint(&pod, &[DEFAULT_AUDIENCE], HOUR).unwrap());
        self.exchanger
            .assume_role_with_web_identity(SOURCE, "lanyard-ml_ray-worker", &token, HOUR)
            .await
            .unwrap()
    }

    async fn chain(
        &self,
        role: &str,
        duration: Duration,
        options: &AssumeRoleOptions,
    ) -> Result<AwsCredentials, CloudError> {
        let first = self.first_hop().await;
        self.exchanger
            .assume_role(
                &first,
                "us-east-1",
                role,
                "lanyard-ml_ray-worker",
                duration,
                options,
            )
            .await
    }
}

fn eks_tags() -> Vec<(&'static str, String)> {
    vec![
        ("eks-cluster-arn", CLUSTER_ARN.into()),
        ("eks-cluster-name", "ray-prod".into()),
        ("kubernetes-namespace", "ml".into()),
        ("kubernetes-service-account", "ray-worker".into()),
        ("kubernetes-pod-name", "ray-worker-0".into()),
        (
            "kubernetes-pod-uid",
            "1f0e2d3c-4b5a-6978-8695-a4b3c2d1e0f9".into(),
        ),
    ]
}

#[track_caller]
fn rejected(result: Result<AwsCredentials, CloudError>) -> (String, String) {
    match result {
        Err(CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test]
async fn the_target_role_is_assumed_with_tags_external_id_and_policy() {
    let env = start().await;
    let options = AssumeRoleOptions {
        external_id: Some(EXTERNAL_ID.into()),
        policy: Some(r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:GetObject","Resource":"*"}]}"#.into()),
        tags: eks_tags(),
    };
    // Asked for two hours: a chained session gets one.
    let creds = env.chain(TARGET, 2 * HOUR, &options).await.unwrap();
    assert_eq!(
        creds.assumed_role_arn,
        "arn:aws:sts::222233334444:assumed-role/data-lake/lanyard-ml_ray-worker"
    );
    assert_eq!(creds.account_id, "222233334444");
    // Whole seconds on both clocks: STS's may have ticked past the second
    // the request was sent in.
    assert!(creds.expires_at - creds.issued_at <= 3600 + 1);
    assert_eq!(
        env.sts.ledger.owner(&creds.access_key_id).as_deref(),
        Some(TARGET)
    );
    let sessions = env.sts.sessions();
    let chained = sessions
        .iter()
        .find(|s| s.action == SessionAction::AssumeRole)
        .expect("the emulator saw the AssumeRole");
    assert_eq!(chained.role_arn, TARGET);
    assert_eq!(chained.source_role_arn.as_deref(), Some(SOURCE));
    assert_eq!(chained.external_id.as_deref(), Some(EXTERNAL_ID));
    assert!(chained.session_policy);
    let want: Vec<(String, String)> = eks_tags()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(chained.tags, want, "the six EKS session tags, in order");
    assert_eq!(
        chained.transitive_tag_keys,
        want.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>()
    );
    assert_eq!(chained.duration_seconds, 3600);
    assert!(sessions
        .iter()
        .any(|s| s.action == SessionAction::AssumeRoleWithWebIdentity && s.role_arn == SOURCE));
    // No secret of either session in the record's debug text.
    let text = format!("{creds:?}");
    assert!(!text.contains(creds.secret_access_key.expose_secret()));
}

#[tokio::test]
async fn a_wrong_or_missing_external_id_is_access_denied() {
    let env = start().await;
    for external_id in [Some("someone-else".to_string()), None] {
        let options = AssumeRoleOptions {
            external_id,
            tags: eks_tags(),
            ..Default::default()
        };
        let (code, message) = rejected(env.chain(TARGET, HOUR, &options).await);
        assert_eq!(code, "AccessDenied");
        assert_eq!(
            message,
            format!("User: arn:aws:sts::111122223333:assumed-role/ray-worker/lanyard-ml_ray-worker is not authorized to perform: sts:AssumeRole on resource: {TARGET}")
        );
    }
}

#[tokio::test]
async fn tags_need_tag_session_and_fit_sts_limits() {
    let env = start().await;
    // The untagged role's trust grants no sts:TagSession.
    let tagged = AssumeRoleOptions {
        tags: eks_tags(),
        ..Default::default()
    };
    let (code, message) = rejected(env.chain(UNTAGGED, HOUR, &tagged).await);
    assert_eq!(code, "AccessDenied");
    assert!(message.contains("sts:TagSession"), "{message}");
    // Without tags it works.
    assert!(env
        .chain(UNTAGGED, HOUR, &AssumeRoleOptions::default())
        .await
        .is_ok());

    // Long tags beside a long session policy overflow the packed size:
    // STS's code, and the annotation that turns the tags off.
    let long = "x".repeat(256);
    let statements: Vec<String> = (0..12)
        .map(|i| format!(r#"{{"Effect":"Allow","Action":"s3:GetObject","Resource":"arn:aws:s3:::bucket-{i}/*"}}"#))
        .collect();
    let policy = format!(
        r#"{{"Version":"2012-10-17","Statement":[{}]}}"#,
        statements.join(",")
    );
    assert!(policy.len() <= 2048, "{}", policy.len());
    let options = AssumeRoleOptions {
        external_id: Some(EXTERNAL_ID.into()),
        policy: Some(policy),
        tags: [
            "eks-cluster-arn",
            "eks-cluster-name",
            "kubernetes-namespace",
            "kubernetes-service-account",
            "kubernetes-pod-name",
            "kubernetes-pod-uid",
        ]
        .into_iter()
        .map(|k| (k, long.clone()))
        .collect(),
    };
    let (code, message) = rejected(env.chain(TARGET, HOUR, &options).await);
    assert_eq!(code, "PackedPolicyTooLarge");
    assert!(
        message.contains("lanyard.dev/aws-session-tags: \"false\""),
        "{message}"
    );
}

/// Through `lanyard dev` chaining into a target: a herd of a thousand SDK
/// requests costs one exchange of each hop, the credentials are the
/// target's, and the emulator saw the six tags.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_herd_costs_one_exchange_of_each_hop() {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.dev.aws_target_role_arn = Some(TARGET.into());
    config.dev.aws_external_id = Some(EXTERNAL_ID.into());
    config.aws.cluster_arn = Some(CLUSTER_ARN.into());
    let stack = lanyard::dev::DevStack::start(&config).await.unwrap();
    let url = export(&stack, "AWS_CONTAINER_CREDENTIALS_FULL_URI").to_string();
    let token =
        std::fs::read_to_string(export(&stack, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")).unwrap();
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let (client, url, token) = (client.clone(), url.clone(), token.trim().to_string());
        tasks.push(tokio::spawn(async move {
            let resp = client
                .get(url)
                .header("Authorization", token)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.json::<serde_json::Value>().await.unwrap()["AccessKeyId"]
                .as_str()
                .unwrap()
                .to_string()
        }));
    }
    let mut keys = std::collections::HashSet::new();
    for t in tasks {
        keys.insert(t.await.unwrap());
    }
    assert_eq!(keys.len(), 1, "one credential for the herd");
    let sts = stack.aws.as_ref().unwrap();
    let key = keys.into_iter().next().unwrap();
    assert_eq!(sts.ledger.owner(&key).as_deref(), Some(TARGET));
    let sessions = sts.sessions();
    let count = |action| sessions.iter().filter(|s| s.action == action).count();
    assert_eq!(count(SessionAction::AssumeRoleWithWebIdentity), 1);
    assert_eq!(count(SessionAction::AssumeRole), 1);
    let chained = sessions
        .iter()
        .find(|s| s.action == SessionAction::AssumeRole)
        .unwrap();
    let keys: Vec<&str> = chained.tags.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        [
            "eks-cluster-arn",
            "eks-cluster-name",
            "kubernetes-namespace",
            "kubernetes-service-account",
            "kubernetes-pod-name",
            "kubernetes-pod-uid"
        ]
    );
    assert!(chained.tags.contains(&(
        "kubernetes-namespace".to_string(),
        config.dev.namespace.clone()
    )));
    assert!(chained.duration_seconds <= 3600);
    stack.stop().await;
}
