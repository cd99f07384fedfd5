//! The Google exchanger against the Google emulator, with the built-in
//! issuer as the workload identity provider's OIDC issuer: STS exchange,
//! service-account impersonation, and each way Google says no.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::jwk::JwkSet;
use jsonwebtoken::{DecodingKey, Validation};
use lanyard::cloud::gcp::GcpExchanger;
use lanyard::cloud::CloudError;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::gcp::{
    principal_for, Gcp, GcpEmulatorConfig, GcpServiceAccount, WorkloadIdentityProvider,
};
use lanyard_emulators::{Issuer, PodIdentity, SigningKey};

const PROJECT_NUMBER: &str = "123456789012";
const POOL: &str = "lanyard-dev";
const HEAD_SA: &str = "ray-head@lanyard-dev.iam.gserviceaccount.com";
const POOL_SA: &str = "pool-wide@lanyard-dev.iam.gserviceaccount.com";
const LOCKED_SA: &str = "locked@lanyard-dev.iam.gserviceaccount.com";
const HOUR: Duration = Duration::from_secs(3600);

fn provider(id: &str) -> String {
    format!(
        "//iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}/providers/{id}"
    )
}

fn https_provider(id: &str) -> String {
    provider(id).replacen("//", "https://", 1)
}

struct Env {
    issuer: Arc<Issuer>,
    gcp: Arc<Gcp>,
    gcp_url: String,
    exchanger: GcpExchanger,
    pod: PodIdentity,
    _stop: ShutdownTrigger,
}

async fn start(lifetime: Duration) -> Env {
    let (stop, shutdown) = Shutdown::new();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let issuer_url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(
        &issuer_url,
        SigningKey::generate_rs256().unwrap(),
    ));
    spawn_server(listener, issuer.router(), shutdown.clone());

    let pod = PodIdentity::new("ray", "head", "ray-head-0", "node-a");
    let config = GcpEmulatorConfig {
        providers: vec![
            WorkloadIdentityProvider {
                name: provider("k8s"),
                issuer: issuer_url.clone(),
                allowed_audiences: vec![],
            },
            WorkloadIdentityProvider {
                name: provider("custom-aud"),
                issuer: issuer_url.clone(),
                allowed_audiences: vec!["lanyard-gcp".into()],
            },
            WorkloadIdentityProvider {
                name: provider("elsewhere"),
                issuer: "https://issuer.invalid".into(),
                allowed_audiences: vec![],
            },
        ],
        service_accounts: vec![
            GcpServiceAccount {
                email: HEAD_SA.into(),
                members: vec![principal_for(&provider("k8s"), &pod.subject())],
            },
            GcpServiceAccount {
                email: POOL_SA.into(),
                members: vec![format!(
                    "principalSet://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}/*"
                )],
            },
            GcpServiceAccount {
                email: LOCKED_SA.into(),
                members: vec![principal_for(
                    &provider("k8s"),
                    "system:serviceaccount:other:someone",
                )],
            },
        ],
        clusters: vec![],
        lifetime,
    };
    let gcp = Arc::new(Gcp::new(config, lanyard::http::client()).unwrap());
    let listener = bind("127.0.0.1:0".parse().unwrap(), "gcp emulator")
        .await
        .unwrap();
    let gcp_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(listener, gcp.router(), shutdown);

    let exchanger = GcpExchanger::new(lanyard::http::client(), &gcp_url, &gcp_url);
    Env {
        issuer,
        gcp,
        gcp_url,
        exchanger,
        pod,
        _stop: stop,
    }
}

impl Env {
    fn token(&self, audience: &str, lifetime: Duration) -> SecretString {
        SecretString::from(self.issuer.mint(&self.pod, &[audience], lifetime).unwrap())
    }

    async fn federated(&self) -> SecretString {
        self.exchanger
            .exchange(&self.token(&provider("k8s"), HOUR), &provider("k8s"), &[])
            .await
            .unwrap()
            .token
    }
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

/// The code and message of a `Rejected`, failing the test on anything else.
#[track_caller]
fn rejected(result: Result<impl std::fmt::Debug, CloudError>) -> (String, String) {
    match result {
        Err(CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected CloudError::Rejected, got {other:?}"),
    }
}

#[tokio::test]
async fn exchange_then_impersonate_for_access_and_id_tokens() {
    let env = start(HOUR).await;

    // STS: the federated token lives as long as the subject token, at most
    // the configured lifetime.
    let subject = env.token(&provider("k8s"), Duration::from_secs(600));
    let federated = env
        .exchanger
        .exchange(&subject, &provider("k8s"), &[])
        .await
        .unwrap();
    let lived = federated.expires_at - federated.issued_at;
    assert!((595..=600).contains(&lived), "federated lifetime {lived}");
    assert_eq!(
        env.gcp.federated_principal(federated.token.expose_secret()),
        Some(format!(
            "principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}/subject/system:serviceaccount:ray:head"
        ))
    );

    // generateAccessToken with a 10-minute lifetime.
    let sa_token = env
        .exchanger
        .generate_access_token(
            &federated.token,
            HEAD_SA,
            &["https://www.googleapis.com/auth/devstorage.read_only".into()],
            Duration::from_secs(600),
        )
        .await
        .unwrap();
    assert!(!sa_token.token.expose_secret().is_empty());
    assert_ne!(
        sa_token.token.expose_secret(),
        federated.token.expose_secret()
    );
    let left = sa_token.expires_at as i64 - now() as i64;
    assert!((595..=601).contains(&left), "SA token lifetime {left}");

    // generateIdToken, verified against the emulator's published keys.
    let id = env
        .exchanger
        .generate_id_token(&federated.token, HEAD_SA, "https://ray.example", true)
        .await
        .unwrap();
    let jwks: JwkSet = reqwest::get(format!("{}/oauth2/v3/certs", env.gcp_url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let header = jsonwebtoken::decode_header(id.token.expose_secret()).unwrap();
    assert_eq!(header.alg, jsonwebtoken::Algorithm::RS256);
    let jwk = jwks.find(header.kid.as_deref().unwrap()).unwrap();
    let key = DecodingKey::from_jwk(jwk).unwrap();
    let mut validation = Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_audience(&["https://ray.example"]);
    validation.set_issuer(&["https://accounts.google.com"]);
    let claims =
        jsonwebtoken::decode::<serde_json::Value>(id.token.expose_secret(), &key, &validation)
            .unwrap()
            .claims;
    assert_eq!(claims["email"], HEAD_SA);
    assert_eq!(claims["email_verified"], true);
    let sub = claims["sub"].as_str().unwrap();
    assert_eq!(sub.len(), 21);
    assert!(sub.bytes().all(|b| b.is_ascii_digit()));
    assert_eq!(claims["azp"], claims["sub"]);
    assert_eq!(claims["exp"].as_u64(), Some(id.expires_at));
    assert!((3590..=3601).contains(&(id.expires_at as i64 - now() as i64)));

    // The same token is refused for another audience: the check is real.
    let mut other_aud = Validation::new(jsonwebtoken::Algorithm::RS256);
    other_aud.set_audience(&["https://other.example"]);
    assert!(
        jsonwebtoken::decode::<serde_json::Value>(id.token.expose_secret(), &key, &other_aud)
            .is_err()
    );

    // Without includeEmail there is no email claim.
    let id = env
        .exchanger
        .generate_id_token(&federated.token, HEAD_SA, "https://ray.example", false)
        .await
        .unwrap();
    let claims =
        jsonwebtoken::decode::<serde_json::Value>(id.token.expose_secret(), &key, &validation)
            .unwrap()
            .claims;
    assert!(claims.get("email").is_none());
    assert!(claims.get("email_verified").is_none());

    let stats = &env.gcp.stats;
    assert_eq!(stats.sts_requests.load(Ordering::Relaxed), 1);
    assert_eq!(stats.sts_issued.load(Ordering::Relaxed), 1);
    assert_eq!(stats.iam_requests.load(Ordering::Relaxed), 3);
    assert_eq!(stats.iam_issued.load(Ordering::Relaxed), 3);
}

#[tokio::test]
async fn default_and_custom_provider_audiences() {
    let env = start(HOUR).await;

    // Google's default: the provider name with // or https:// in front.
    for aud in [provider("k8s"), https_provider("k8s")] {
        let token = env.token(&aud, HOUR);
        let federated = env.exchanger.exchange(&token, &provider("k8s"), &[]).await;
        assert!(federated.is_ok(), "{aud}: {federated:?}");
    }

    // A provider with allowed audiences accepts those and only those.
    let custom = env.token("lanyard-gcp", HOUR);
    assert!(env
        .exchanger
        .exchange(&custom, &provider("custom-aud"), &[])
        .await
        .is_ok());
    let default_aud = env.token(&provider("custom-aud"), HOUR);
    let (code, message) = rejected(
        env.exchanger
            .exchange(&default_aud, &provider("custom-aud"), &[])
            .await,
    );
    assert_eq!(code, "invalid_grant");
    assert!(
        message.starts_with("The audience in ID Token ["),
        "{message}"
    );

    let stats = &env.gcp.stats;
    assert_eq!(stats.sts_requests.load(Ordering::Relaxed), 4);
    assert_eq!(stats.sts_issued.load(Ordering::Relaxed), 3);
}

#[tokio::test]
async fn sts_refuses_bad_subject_tokens() {
    let env = start(HOUR).await;
    let k8s = provider("k8s");

    // Signed by another key that claims the issuer's kid.
    let claims = env.issuer.claims_for(&env.pod, &[&k8s], HOUR);
    let impostor = SigningKey::generate_rs256().unwrap();
    let forged = SecretString::from(
        impostor
            .sign_with_kid(&claims, env.issuer.key().kid())
            .unwrap(),
    );
    let (code, message) = rejected(env.exchanger.exchange(&forged, &k8s, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(message, "Unable to verify the ID Token signature.");

    // A kid the issuer does not publish.
    let unknown_kid = SecretString::from(impostor.sign(&claims).unwrap());
    let (code, message) = rejected(env.exchanger.exchange(&unknown_kid, &k8s, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(
        message,
        "Error connecting to the given credential's issuer."
    );

    // Expired well beyond Google's minute of skew.
    let mut stale = env.issuer.claims_for(&env.pod, &[&k8s], HOUR);
    stale.iat = now() - 7200;
    stale.nbf = Some(stale.iat);
    stale.exp = now() - 3600;
    let expired = SecretString::from(env.issuer.sign(&stale).unwrap());
    let (code, message) = rejected(env.exchanger.exchange(&expired, &k8s, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(
        message,
        format!("ID Token issued at {} is stale to sign-in.", stale.iat)
    );

    // Minted for Entra, presented to Google.
    let wrong_aud = env.token("api://AzureADTokenExchange", HOUR);
    let (code, message) = rejected(env.exchanger.exchange(&wrong_aud, &k8s, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(
        message,
        "The audience in ID Token [api://AzureADTokenExchange] does not match the expected audience."
    );

    // Not a JWT at all.
    let garbage = SecretString::from("not-a-jwt".to_string());
    let (code, message) = rejected(env.exchanger.exchange(&garbage, &k8s, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(message, "Unable to parse the ID Token.");

    // No error ever carries the subject token.
    let err = env
        .exchanger
        .exchange(&forged, &k8s, &[])
        .await
        .unwrap_err();
    assert!(!format!("{err} {err:?}").contains(forged.expose_secret()));

    let stats = &env.gcp.stats;
    assert_eq!(stats.sts_requests.load(Ordering::Relaxed), 6);
    assert_eq!(stats.sts_issued.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn sts_refuses_unknown_or_mismatched_providers() {
    let env = start(HOUR).await;

    // Well-formed, but no such provider.
    let token = env.token(&provider("nope"), HOUR);
    let (code, message) = rejected(env.exchanger.exchange(&token, &provider("nope"), &[]).await);
    assert_eq!(code, "invalid_target");
    assert!(message
        .starts_with("The target service indicated by the \"audience\" parameters is invalid."));

    // A project ID where the number belongs is well formed to Google but
    // names no provider: invalid_target, as google-github-actions/auth#202
    // reports it.
    let by_id = provider("k8s").replace(
        &format!("projects/{PROJECT_NUMBER}/"),
        "projects/lanyard-dev/",
    );
    let (code, _) = rejected(env.exchanger.exchange(&token, &by_id, &[]).await);
    assert_eq!(code, "invalid_target");

    // Not a provider's full resource name (the https:// form is a token
    // audience, not an STS audience).
    let (code, message) = rejected(
        env.exchanger
            .exchange(&token, &https_provider("k8s"), &[])
            .await,
    );
    assert_eq!(code, "invalid_request");
    assert!(
        message.starts_with("Invalid value for \"audience\"."),
        "{message}"
    );

    // The provider trusts another issuer; our issuer's token is refused
    // before any key of it is looked at.
    let token = env.token(&provider("elsewhere"), HOUR);
    let (code, message) = rejected(
        env.exchanger
            .exchange(&token, &provider("elsewhere"), &[])
            .await,
    );
    assert_eq!(code, "invalid_grant");
    assert_eq!(
        message,
        format!(
            "The issuer in ID Token {} does not match the expected one in config: https://issuer.invalid.",
            env.issuer.url()
        )
    );
}

#[tokio::test]
async fn throttled_sts_answers_in_oauth_form_and_iam_in_api_form() {
    let env = start(HOUR).await;
    let throttle = || lanyard_emulators::faults::Fault::Status {
        status: 429,
        retry_after: Some(3),
    };
    let token = env.token(&provider("k8s"), HOUR);
    env.gcp.faults.push(throttle(), Some(1));
    match env.exchanger.exchange(&token, &provider("k8s"), &[]).await {
        Err(CloudError::Throttled { code, .. }) => assert_eq!(code, "quota_exceeded"),
        other => panic!("expected STS's quota_exceeded, got {other:?}"),
    }
    let federated = env.federated().await;
    env.gcp.faults.push(throttle(), Some(1));
    match env
        .exchanger
        .generate_access_token(&federated, POOL_SA, &[], HOUR)
        .await
    {
        Err(CloudError::Throttled { code, .. }) => assert_eq!(code, "RESOURCE_EXHAUSTED"),
        other => panic!("expected IAM's RESOURCE_EXHAUSTED, got {other:?}"),
    }
}

#[tokio::test]
async fn iam_refuses_without_binding_account_or_credential() {
    let env = start(HOUR).await;
    let federated = env.federated().await;

    // A principalSet covering the pool grants impersonation.
    assert!(env
        .exchanger
        .generate_access_token(&federated, POOL_SA, &[], HOUR)
        .await
        .is_ok());

    // The binding names another principal.
    let (code, message) = rejected(
        env.exchanger
            .generate_access_token(&federated, LOCKED_SA, &[], HOUR)
            .await,
    );
    assert_eq!(code, "PERMISSION_DENIED");
    assert_eq!(
        message,
        "Permission 'iam.serviceAccounts.getAccessToken' denied on resource (or it may not exist)."
    );
    let (code, message) = rejected(
        env.exchanger
            .generate_id_token(&federated, LOCKED_SA, "https://x.example", true)
            .await,
    );
    assert_eq!(code, "PERMISSION_DENIED");
    assert!(message.contains("iam.serviceAccounts.getOpenIdToken"));

    // No such account.
    let missing = "ghost@lanyard-dev.iam.gserviceaccount.com";
    let (code, message) = rejected(
        env.exchanger
            .generate_access_token(&federated, missing, &[], HOUR)
            .await,
    );
    assert_eq!(code, "NOT_FOUND");
    assert!(message.contains(missing));

    // A federated token the emulator never issued.
    let bogus = SecretString::from("ya29.bogus".to_string());
    let (code, _) = rejected(
        env.exchanger
            .generate_access_token(&bogus, HEAD_SA, &[], HOUR)
            .await,
    );
    assert_eq!(code, "UNAUTHENTICATED");

    // Over IAM's one-hour limit.
    let (code, message) = rejected(
        env.exchanger
            .generate_access_token(&federated, HEAD_SA, &[], Duration::from_secs(7200))
            .await,
    );
    assert_eq!(code, "INVALID_ARGUMENT");
    assert!(message.contains("more than 1 hour"), "{message}");

    let stats = &env.gcp.stats;
    assert_eq!(stats.iam_requests.load(Ordering::Relaxed), 6);
    assert_eq!(stats.iam_issued.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn federated_tokens_expire() {
    let env = start(Duration::from_secs(1)).await;
    let federated = env
        .exchanger
        .exchange(&env.token(&provider("k8s"), HOUR), &provider("k8s"), &[])
        .await
        .unwrap();
    assert_eq!(federated.expires_at - federated.issued_at, 1);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (code, _) = rejected(
        env.exchanger
            .generate_access_token(&federated.token, HEAD_SA, &[], HOUR)
            .await,
    );
    assert_eq!(code, "UNAUTHENTICATED");
}

#[tokio::test]
async fn raw_wire_format() {
    let env = start(HOUR).await;
    let http = reqwest::Client::new();
    let subject = env
        .issuer
        .mint(&env.pod, &[&provider("k8s")], HOUR)
        .unwrap();

    // JSON body, camelCase names, id_token subject type.
    let resp = http
        .post(format!("{}/v1/token", env.gcp_url))
        .json(&serde_json::json!({
            "grantType": "urn:ietf:params:oauth:grant-type:token-exchange",
            "audience": provider("k8s"),
            "requestedTokenType": "urn:ietf:params:oauth:token-type:access_token",
            "subjectTokenType": "urn:ietf:params:oauth:token-type:id_token",
            "subjectToken": subject,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(
        body["issued_token_type"],
        "urn:ietf:params:oauth:token-type:access_token"
    );
    assert_eq!(body["token_type"], "Bearer");
    assert!(body["expires_in"].is_u64());
    let federated = body["access_token"].as_str().unwrap().to_string();

    // Wrong grant type.
    let resp = http
        .post(format!("{}/v1/token", env.gcp_url))
        .form(&[
            ("grant_type", "client_credentials"),
            ("audience", &provider("k8s")),
        ])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"], "unsupported_grant_type");

    // generateAccessToken: RFC 3339 expireTime in Zulu.
    let url = format!(
        "{}/v1/projects/-/serviceAccounts/{HEAD_SA}:generateAccessToken",
        env.gcp_url
    );
    let resp = http
        .post(&url)
        .bearer_auth(&federated)
        .json(&serde_json::json!({"scope": ["https://www.googleapis.com/auth/cloud-platform"], "lifetime": "3600s"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: serde_json::Value = resp.json().await.unwrap();
    let expire = body["expireTime"].as_str().unwrap();
    assert!(expire.ends_with('Z') && expire.len() == 20, "{expire}");

    // No credential: 401 in Google's shape, with a Bearer challenge.
    let resp = http
        .post(&url)
        .json(&serde_json::json!({"scope": ["https://www.googleapis.com/auth/cloud-platform"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    assert!(resp.headers().contains_key("www-authenticate"));
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], 401);
    assert_eq!(body["error"]["status"], "UNAUTHENTICATED");

    // Unknown method after the colon.
    let resp = http
        .post(format!(
            "{}/v1/projects/-/serviceAccounts/{HEAD_SA}:signBlob",
            env.gcp_url
        ))
        .bearer_auth(&federated)
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
}

#[tokio::test]
async fn unreachable_endpoints_are_unavailable() {
    let listener = bind("127.0.0.1:0".parse().unwrap(), "closed")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    let exchanger = GcpExchanger::new(lanyard::http::client(), &url, &url);
    let subject = SecretString::from("x.y.z".to_string());
    let err = exchanger
        .exchange(&subject, &provider("k8s"), &[])
        .await
        .unwrap_err();
    assert!(matches!(err, CloudError::Unavailable { .. }), "{err:?}");
    assert!(err.is_retryable());
}
