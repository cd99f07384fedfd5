//! The AWS exchanger against the validating STS emulator: success and every
//! refusal, each surfacing as the typed error and STS code that AWS gives.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::aws::{AwsCredentials, AwsExchanger};
use lanyard::cloud::CloudError;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::aws::{
    AwsEmulatorConfig, AwsRole, AwsSts, OidcProvider, DEFAULT_AUDIENCE, STS_NAMESPACE,
};
use lanyard_emulators::{Issuer, PodIdentity, SigningKey};

const ACCOUNT: &str = "123456789012";
const ROLE: &str = "arn:aws:iam::123456789012:role/ray-data";
const EXACT_ROLE: &str = "arn:aws:iam::123456789012:role/team/exact";
/// The MaxSessionDuration of `ROLE`.
const ROLE_MAX: u64 = 7200;
const HOUR: Duration = Duration::from_secs(3600);

/// An issuer, an STS emulator trusting it, and an exchanger pointed at it;
/// the servers stop when this is dropped.
struct Env {
    issuer: Arc<Issuer>,
    sts: Arc<AwsSts>,
    sts_url: String,
    exchanger: AwsExchanger,
    _trigger: ShutdownTrigger,
}

async fn listen() -> (tokio::net::TcpListener, SocketAddr) {
    let listener = bind("127.0.0.1:0".parse().unwrap(), "test server")
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

/// A loopback URL nothing listens on.
async fn dead_url() -> String {
    let (listener, addr) = listen().await;
    drop(listener);
    format!("http://{addr}")
}

/// `extra_providers` are registered too (issuers that may not be running).
async fn start(extra_providers: &[&str]) -> Env {
    let (trigger, shutdown) = Shutdown::new();
    let (listener, addr) = listen().await;
    let issuer = Arc::new(Issuer::new(
        format!("http://{addr}"),
        SigningKey::generate_rs256().unwrap(),
    ));
    spawn_server(listener, issuer.router(), shutdown.clone());

    let mut providers = vec![OidcProvider {
        issuer: issuer.url().to_string(),
        audiences: vec![DEFAULT_AUDIENCE.to_string()],
    }];
    providers.extend(extra_providers.iter().map(|url| OidcProvider {
        issuer: url.to_string(),
        audiences: vec![DEFAULT_AUDIENCE.to_string()],
    }));
    let sts = Arc::new(AwsSts::new(
        AwsEmulatorConfig {
            providers,
            roles: vec![
                AwsRole {
                    arn: ROLE.into(),
                    trusted_subjects: vec!["system:serviceaccount:ml:ray-*".into()],
                    max_session_duration: ROLE_MAX,
                    trusted_roles: Vec::new(),
                    external_id: None,
                    allow_tag_session: false,
                },
                AwsRole {
                    arn: EXACT_ROLE.into(),
                    trusted_subjects: vec!["system:serviceaccount:ml:exact".into()],
                    max_session_duration: 43200,
                    trusted_roles: Vec::new(),
                    external_id: None,
                    allow_tag_session: false,
                },
            ],
            ..Default::default()
        },
        lanyard::http::client(),
    ));
    let (listener, addr) = listen().await;
    spawn_server(listener, sts.router(), shutdown.clone());
    let sts_url = format!("http://{addr}");
    Env {
        issuer,
        sts,
        exchanger: AwsExchanger::new(lanyard::http::client(), sts_url.clone()),
        sts_url,
        _trigger: trigger,
    }
}

fn ray_pod() -> PodIdentity {
    PodIdentity::new("ml", "ray-worker", "ray-worker-0", "node-a")
}

impl Env {
    fn token(&self, pod: &PodIdentity) -> SecretString {
        SecretString::from(self.issuer.mint(pod, &[DEFAULT_AUDIENCE], HOUR).unwrap())
    }

    async fn assume(
        &self,
        role: &str,
        session: &str,
        token: &SecretString,
        duration: Duration,
    ) -> Result<AwsCredentials, CloudError> {
        self.exchanger
            .assume_role_with_web_identity(role, session, token, duration)
            .await
    }

    fn requests(&self) -> u64 {
        self.sts.stats.requests.load(Ordering::Relaxed)
    }

    fn issued(&self) -> u64 {
        self.sts.stats.issued.load(Ordering::Relaxed)
    }
}

/// The code and message of a rejection; anything else fails the test.
fn rejected(result: Result<AwsCredentials, CloudError>) -> (String, String) {
    match result {
        Err(CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

#[tokio::test]
async fn valid_token_gets_session_credentials() {
    let env = start(&[]).await;
    let pod = ray_pod();
    let session = AwsExchanger::session_name(&pod.namespace, &pod.service_account);
    let before = now();
    let creds = env
        .assume(ROLE, &session, &env.token(&pod), HOUR)
        .await
        .unwrap();

    assert!(
        creds.expires_at >= before + 3600 && creds.expires_at <= now() + 3600,
        "expires_at {} not about now+3600 ({before})",
        creds.expires_at
    );
    assert!(creds.issued_at >= before && creds.issued_at <= now());
    assert_eq!(creds.account_id, ACCOUNT);
    assert_eq!(
        creds.assumed_role_arn,
        "arn:aws:sts::123456789012:assumed-role/ray-data/lanyard-ml_ray-worker"
    );
    assert!(creds.access_key_id.starts_with("ASIA"));
    assert_eq!(creds.access_key_id.len(), 20);
    assert_eq!(creds.secret_access_key.expose_secret().len(), 40);
    assert!(creds.session_token.expose_secret().len() > 500);
    assert_eq!((env.requests(), env.issued()), (1, 1));

    // A role path is dropped from the assumed-role ARN, as STS does.
    let exact = PodIdentity::new("ml", "exact", "exact-0", "node-a");
    let creds = env
        .assume(
            EXACT_ROLE,
            "s1",
            &env.token(&exact),
            Duration::from_secs(43200),
        )
        .await
        .unwrap();
    assert_eq!(
        creds.assumed_role_arn,
        "arn:aws:sts::123456789012:assumed-role/exact/s1"
    );
    assert!(creds.expires_at >= before + 43200);
    assert_eq!((env.requests(), env.issued()), (2, 2));
}

#[tokio::test]
async fn success_xml_has_the_sts_shape() {
    let env = start(&[]).await;
    let pod = ray_pod();
    let token = env.token(&pod);
    let before = now();
    let resp = lanyard::http::client()
        .post(format!("{}/", env.sts_url))
        .form(&[
            ("Action", "AssumeRoleWithWebIdentity"),
            ("Version", "2011-06-15"),
            ("RoleArn", ROLE),
            ("RoleSessionName", "shape-check"),
            ("WebIdentityToken", token.expose_secret()),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/xml");
    let body = resp.text().await.unwrap();
    let provider_id = env.issuer.url().trim_start_matches("http://");
    for part in [
        format!("<AssumeRoleWithWebIdentityResponse xmlns=\"{STS_NAMESPACE}\">"),
        "<AssumeRoleWithWebIdentityResult>".to_string(),
        "<Audience>sts.amazonaws.com</Audience>".to_string(),
        ":shape-check</AssumedRoleId>".to_string(),
        "<AssumedRoleId>AROA".to_string(),
        "<Arn>arn:aws:sts::123456789012:assumed-role/ray-data/shape-check</Arn>".to_string(),
        format!("<Provider>arn:aws:iam::123456789012:oidc-provider/{provider_id}</Provider>"),
        "<AccessKeyId>ASIA".to_string(),
        "<SubjectFromWebIdentityToken>system:serviceaccount:ml:ray-worker</SubjectFromWebIdentityToken>"
            .to_string(),
        "<ResponseMetadata>".to_string(),
        "<RequestId>".to_string(),
    ] {
        assert!(body.contains(&part), "missing {part} in {body}");
    }
    // No DurationSeconds: STS's default of one hour, from when it answered.
    let after = now();
    let expirations: Vec<String> = (before..=after)
        .map(|t| {
            let at = time::OffsetDateTime::from_unix_timestamp(t as i64 + 3600).unwrap();
            format!(
                "<Expiration>{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z</Expiration>",
                at.year(),
                u8::from(at.month()),
                at.day(),
                at.hour(),
                at.minute(),
                at.second()
            )
        })
        .collect();
    assert!(
        expirations.iter().any(|e| body.contains(e)),
        "none of {expirations:?} in {body}"
    );
}

#[tokio::test]
async fn token_signed_by_another_key_is_an_invalid_identity_token() {
    let env = start(&[]).await;
    let pod = ray_pod();
    let claims = env.issuer.claims_for(&pod, &[DEFAULT_AUDIENCE], HOUR);
    let other = SigningKey::generate_rs256().unwrap();

    // Its own kid: not among the issuer's keys.
    let forged = SecretString::from(other.sign(&claims).unwrap());
    let (code, _) = rejected(env.assume(ROLE, "s1", &forged, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");

    // The issuer's kid, the wrong key: the signature does not verify.
    let forged = SecretString::from(
        other
            .sign_with_kid(&claims, env.issuer.key().kid())
            .unwrap(),
    );
    let (code, message) = rejected(env.assume(ROLE, "s1", &forged, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");
    assert!(message.contains("signature"), "{message}");

    // Not a JWT at all.
    let junk = SecretString::from("not-a-jwt".to_string());
    let (code, _) = rejected(env.assume(ROLE, "s1", &junk, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");

    assert_eq!((env.requests(), env.issued()), (3, 0));
}

#[tokio::test]
async fn expired_token_is_an_expired_token_exception() {
    let env = start(&[]).await;
    let mut claims = env.issuer.claims_for(&ray_pod(), &[DEFAULT_AUDIENCE], HOUR);
    claims.iat = now() - 7200;
    claims.nbf = Some(now() - 7200);
    claims.exp = now() - 60;
    let token = SecretString::from(env.issuer.sign(&claims).unwrap());
    let err = env.assume(ROLE, "s1", &token, HOUR).await.unwrap_err();
    assert!(!err.is_retryable(), "a fresh token is needed, not a retry");
    let (code, message) = rejected(Err(err));
    assert_eq!(code, "ExpiredTokenException");
    assert!(
        message.starts_with("Token expired: current date/time ")
            && message.ends_with(&format!(
                " must be before the expiration date/time {}",
                claims.exp
            )),
        "{message}"
    );
    assert_eq!(env.issued(), 0);
}

#[tokio::test]
async fn wrong_audience_is_an_invalid_identity_token() {
    let env = start(&[]).await;
    let token = SecretString::from(
        env.issuer
            .mint(&ray_pod(), &["api://AzureADTokenExchange"], HOUR)
            .unwrap(),
    );
    let (code, message) = rejected(env.assume(ROLE, "s1", &token, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");
    assert_eq!(message, "Incorrect token audience");

    // A token without any audience is refused for that by name.
    let mut claims = serde_json::to_value(env.issuer.claims_for(
        &ray_pod(),
        &["sts.amazonaws.com"],
        HOUR,
    ))
    .unwrap();
    claims.as_object_mut().unwrap().remove("aud");
    let token = SecretString::from(env.issuer.sign(&claims).unwrap());
    let (code, message) = rejected(env.assume(ROLE, "s1", &token, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");
    assert_eq!(message, "Missing a required claim: aud");
    assert_eq!(env.issued(), 0);
}

#[tokio::test]
async fn unregistered_issuer_is_refused_without_fetching_its_keys() {
    let env = start(&[]).await;
    // An issuer nobody registered, at an address where nothing listens: if
    // the emulator tried to fetch its keys the answer would be the
    // key-retrieval failure instead.
    let stranger = Issuer::new(dead_url().await, SigningKey::generate_rs256().unwrap());
    let token = SecretString::from(
        stranger
            .mint(&ray_pod(), &[DEFAULT_AUDIENCE], HOUR)
            .unwrap(),
    );
    let (code, message) = rejected(env.assume(ROLE, "s1", &token, HOUR).await);
    assert_eq!(code, "InvalidIdentityToken");
    assert_eq!(
        message,
        format!(
            "No OpenIDConnect provider found in your account for {}",
            stranger.url()
        )
    );
}

#[tokio::test]
async fn unreachable_issuer_keys_are_unavailable_not_rejected() {
    let down = dead_url().await;
    let env = start(&[&down]).await;
    let registered_but_down = Issuer::new(down, SigningKey::generate_rs256().unwrap());
    let token = SecretString::from(
        registered_but_down
            .mint(&ray_pod(), &[DEFAULT_AUDIENCE], HOUR)
            .unwrap(),
    );
    match env.assume(ROLE, "s1", &token, HOUR).await {
        Err(e @ CloudError::Unavailable { .. }) => {
            assert!(e.is_retryable());
            assert!(
                e.to_string().contains("Couldn't retrieve verification key"),
                "{e}"
            );
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

#[tokio::test]
async fn untrusted_subject_and_unknown_role_are_access_denied() {
    let env = start(&[]).await;
    let outsider = PodIdentity::new("web", "ray-worker", "web-0", "node-a");
    let (code, message) = rejected(env.assume(ROLE, "s1", &env.token(&outsider), HOUR).await);
    assert_eq!(code, "AccessDenied");
    assert_eq!(
        message,
        "Not authorized to perform sts:AssumeRoleWithWebIdentity"
    );

    // The wildcard is a prefix match, not a substring one.
    let near = PodIdentity::new("ml", "not-ray-worker", "p", "node-a");
    let (code, _) = rejected(env.assume(ROLE, "s1", &env.token(&near), HOUR).await);
    assert_eq!(code, "AccessDenied");

    // An exact subject does not match a longer one.
    let longer = PodIdentity::new("ml", "exact2", "p", "node-a");
    let (code, _) = rejected(
        env.assume(EXACT_ROLE, "s1", &env.token(&longer), HOUR)
            .await,
    );
    assert_eq!(code, "AccessDenied");

    let (code, message) = rejected(
        env.assume(
            "arn:aws:iam::123456789012:role/no-such-role",
            "s1",
            &env.token(&ray_pod()),
            HOUR,
        )
        .await,
    );
    assert_eq!(code, "AccessDenied");
    assert_eq!(
        message,
        "Not authorized to perform sts:AssumeRoleWithWebIdentity"
    );
    assert_eq!((env.requests(), env.issued()), (4, 0));
}

#[tokio::test]
async fn duration_outside_bounds_is_a_validation_error() {
    let env = start(&[]).await;
    let token = env.token(&ray_pod());

    let (code, message) = rejected(
        env.assume(ROLE, "s1", &token, Duration::from_secs(899))
            .await,
    );
    assert_eq!(code, "ValidationError");
    assert_eq!(
        message,
        "1 validation error detected: Value '899' at 'durationSeconds' failed to satisfy constraint: Member must have value greater than or equal to 900"
    );

    let (code, message) = rejected(
        env.assume(ROLE, "s1", &token, Duration::from_secs(50000))
            .await,
    );
    assert_eq!(code, "ValidationError");
    assert_eq!(
        message,
        "1 validation error detected: Value '50000' at 'durationSeconds' failed to satisfy constraint: Member must have value less than or equal to 43200"
    );

    let (code, message) = rejected(
        env.assume(ROLE, "s1", &token, Duration::from_secs(ROLE_MAX + 1))
            .await,
    );
    assert_eq!(code, "ValidationError");
    assert_eq!(
        message,
        "The requested DurationSeconds exceeds the MaxSessionDuration set for this role."
    );

    // The bounds themselves are allowed.
    env.assume(ROLE, "s1", &token, Duration::from_secs(900))
        .await
        .unwrap();
    env.assume(ROLE, "s1", &token, Duration::from_secs(ROLE_MAX))
        .await
        .unwrap();
    assert_eq!((env.requests(), env.issued()), (5, 2));
}

#[tokio::test]
async fn bad_session_name_is_a_validation_error() {
    let env = start(&[]).await;
    let token = env.token(&ray_pod());

    let (code, message) = rejected(env.assume(ROLE, "a<b&c", &token, HOUR).await);
    assert_eq!(code, "ValidationError");
    // Echoed value survives the XML round trip unmangled.
    assert_eq!(
        message,
        r"1 validation error detected: Value 'a<b&c' at 'roleSessionName' failed to satisfy constraint: Member must satisfy regular expression pattern: [\w+=,.@-]*"
    );

    let (code, message) = rejected(env.assume(ROLE, "x", &token, HOUR).await);
    assert_eq!(code, "ValidationError");
    assert!(
        message.ends_with("Member must have length greater than or equal to 2"),
        "{message}"
    );

    let (code, message) = rejected(env.assume(ROLE, &"s".repeat(65), &token, HOUR).await);
    assert_eq!(code, "ValidationError");
    assert!(
        message.ends_with("Member must have length less than or equal to 64"),
        "{message}"
    );

    // What session_name derives is always accepted, however long the input.
    let long = PodIdentity::new("ml", &format!("ray-{}", "w".repeat(100)), "p", "node-a");
    let session = AwsExchanger::session_name(&long.namespace, &long.service_account);
    env.assume(ROLE, &session, &env.token(&long), HOUR)
        .await
        .unwrap();
    assert_eq!(env.issued(), 1);
}

#[tokio::test]
async fn throttle_knob_makes_requests_throttled() {
    let env = start(&[]).await;
    let token = env.token(&ray_pod());
    env.sts.set_throttle(2);
    for _ in 0..2 {
        match env.assume(ROLE, "s1", &token, HOUR).await {
            Err(e @ CloudError::Throttled { .. }) => {
                assert_eq!(e.code(), Some("Throttling"));
                assert!(e.is_retryable());
            }
            other => panic!("expected Throttled, got {other:?}"),
        }
    }
    env.assume(ROLE, "s1", &token, HOUR).await.unwrap();
    assert_eq!((env.requests(), env.issued()), (3, 1));
    assert_eq!(env.sts.stats.throttled.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn unknown_action_and_version_are_invalid_action() {
    let env = start(&[]).await;
    let http = lanyard::http::client();
    for (form, message) in [
        (
            vec![("Action", "GetSessionToken"), ("Version", "2011-06-15")],
            "Could not find operation GetSessionToken for version 2011-06-15",
        ),
        (
            vec![
                ("Action", "AssumeRoleWithWebIdentity"),
                ("Version", "2010-01-01"),
            ],
            "Could not find operation AssumeRoleWithWebIdentity for version 2010-01-01",
        ),
    ] {
        let resp = http
            .post(format!("{}/", env.sts_url))
            .form(&form)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 400);
        assert_eq!(resp.headers()["content-type"], "text/xml");
        let body = resp.text().await.unwrap();
        assert!(
            body.starts_with(&format!("<ErrorResponse xmlns=\"{STS_NAMESPACE}\">")),
            "{body}"
        );
        assert!(body.contains("<Type>Sender</Type>"), "{body}");
        assert!(body.contains("<Code>InvalidAction</Code>"), "{body}");
        assert!(
            body.contains(&format!("<Message>{message}</Message>")),
            "{body}"
        );
    }
    assert_eq!(env.issued(), 0);
}

#[tokio::test]
async fn errors_and_credentials_never_show_secrets() {
    let env = start(&[]).await;
    let token = env.token(&ray_pod());
    let err = env
        .assume("arn:aws:iam::123456789012:role/nope", "s1", &token, HOUR)
        .await
        .unwrap_err();
    for shown in [err.to_string(), format!("{err:?}")] {
        assert!(!shown.contains(token.expose_secret()), "{shown}");
    }
    let creds = env.assume(ROLE, "s1", &token, HOUR).await.unwrap();
    let shown = format!("{creds:?}");
    assert!(shown.contains(&creds.access_key_id));
    assert!(
        !shown.contains(creds.secret_access_key.expose_secret()),
        "{shown}"
    );
    assert!(
        !shown.contains(creds.session_token.expose_secret()),
        "{shown}"
    );
}

#[tokio::test]
async fn invalid_role_arn_is_refused_before_sending() {
    let env = start(&[]).await;
    let (code, _) = rejected(
        env.assume("ray-data", "s1", &env.token(&ray_pod()), HOUR)
            .await,
    );
    assert_eq!(code, "InvalidRoleArn");
    assert_eq!(env.requests(), 0);
}

#[tokio::test]
async fn unreachable_sts_is_unavailable() {
    let env = start(&[]).await;
    let exchanger = AwsExchanger::new(lanyard::http::client(), dead_url().await);
    match exchanger
        .assume_role_with_web_identity(ROLE, "s1", &env.token(&ray_pod()), HOUR)
        .await
    {
        Err(e @ CloudError::Unavailable { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Unavailable, got {other:?}"),
    }
}
