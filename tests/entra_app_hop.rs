//! Entra's managed-identity-to-app hop, against the validating Entra
//! emulator: the pod's token gives the managed identity a v2 token for the
//! token-exchange audience, which an app (multi-tenant, provisioned in
//! another tenant) takes as its assertion because its federated credential
//! trusts that identity. Each missing trust is refused as Entra refuses it,
//! and through `lanyard dev` a herd costs one exchange per hop.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::azure::{AzureExchanger, AzureRequest};
use lanyard::cloud::CloudError;
use lanyard::config::Config;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::entra::{v2_issuer, Entra, FEDERATION_AUDIENCE};
use lanyard_emulators::{
    AzureApp, Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, PodIdentity, SigningKey,
};
use support::export;

/// The identities' tenant, where the app is registered.
const HOME: &str = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b";
/// The tenant the app is provisioned in, and its tokens asked in.
const RESOURCE: &str = "9d8c7b6a-5f4e-4d3c-8b2a-190817263544";
const IDENTITY: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
/// A managed identity no app trusts.
const LONE_IDENTITY: &str = "6a5b4c3d-2e1f-4a0b-9c8d-7e6f5a4b3c2d";
const APP: &str = "c0ffee00-1234-4abc-8def-0123456789ab";
const EXCHANGE: &str = "api://AzureADTokenExchange/.default";
const STORAGE: &str = "https://storage.azure.com/.default";
const HOUR: Duration = Duration::from_secs(3600);

struct Env {
    audience: &'static str,
    issuer: Arc<Issuer>,
    entra: Arc<Entra>,
    exchanger: AzureExchanger,
    _stop: ShutdownTrigger,
}

async fn start() -> Env {
    start_in(FEDERATION_AUDIENCE).await
}

/// The emulators of a cloud whose token-exchange audience is `audience`.
async fn start_in(audience: &'static str) -> Env {
    let (stop, shutdown) = Shutdown::new();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(&url, SigningKey::generate_rs256().unwrap()));
    spawn_server(listener, issuer.router(), shutdown.clone());
    let binding = |sa: &str, client: &str, app: Option<AzureApp>| Binding {
        subject: format!("system:serviceaccount:ml:{sa}"),
        azure_client_id: Some(client.into()),
        gcp_service_account: None,
        aws_role_arn: None,
        aws_target: None,
        azure_app: app,
    };
    let set = EmulatorSet::new(
        &CloudsConfig {
            issuer: url,
            azure_tenant_id: HOME.into(),
            azure_audience: audience.into(),
            gcp_provider: "//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/p/providers/c".into(),
            gcp_allowed_audiences: vec![],
            gcp_gke: None,
            aws_audience: "sts.amazonaws.com".into(),
            lifetimes: Lifetimes::all(HOUR),
            bindings: vec![
                binding(
                    "operator",
                    IDENTITY,
                    Some(AzureApp {
                        client_id: APP.into(),
                        tenant_id: RESOURCE.into(),
                    }),
                ),
                binding("lone", LONE_IDENTITY, None),
            ],
        },
        lanyard::http::client(),
    )
    .unwrap();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "entra").await.unwrap();
    let entra_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(listener, set.entra.router(), shutdown);
    Env {
        audience,
        issuer,
        entra: set.entra,
        exchanger: AzureExchanger::new(lanyard::http::client(), entra_url),
        _stop: stop,
    }
}

impl Env {
    fn pod_token(&self, sa: &str) -> SecretString {
        let pod = PodIdentity::new("ml", sa, &format!("{sa}-0"), "node-a");
        SecretString::from(self.issuer.mint(&pod, &[self.audience], HOUR).unwrap())
    }

    async fn exchange(
        &self,
        tenant: &str,
        client: &str,
        scope: &str,
        assertion: &SecretString,
    ) -> Result<lanyard::cloud::AccessToken, CloudError> {
        self.exchanger
            .exchange(&AzureRequest {
                tenant_id: tenant,
                client_id: client,
                scope,
                assertion,
            })
            .await
    }
}

fn claims(token: &lanyard::cloud::AccessToken) -> serde_json::Value {
    jsonwebtoken::dangerous::insecure_decode_claims::<serde_json::Value>(
        token.token.expose_secret(),
    )
    .unwrap()
}

fn rejected(result: Result<lanyard::cloud::AccessToken, CloudError>) -> (String, String) {
    match result {
        Err(CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test]
async fn the_identitys_exchange_token_is_the_apps_assertion_in_the_resource_tenant() {
    let env = start().await;
    let first = env
        .exchange(HOME, IDENTITY, EXCHANGE, &env.pod_token("operator"))
        .await
        .unwrap();
    // Entra's v2 token for the token-exchange resource, naming the
    // identity's principal: what the app's federated credential trusts.
    let c = claims(&first);
    assert_eq!(c["iss"], v2_issuer(HOME));
    assert_eq!(c["aud"], FEDERATION_AUDIENCE);
    assert_eq!(c["azp"], IDENTITY);
    assert_eq!(c["ver"], "2.0");
    assert_eq!(c["sub"], c["oid"]);
    let app = env
        .exchange(RESOURCE, APP, STORAGE, &first.token)
        .await
        .unwrap();
    let c = claims(&app);
    assert_eq!(c["appid"], APP);
    assert_eq!(
        c["tid"], RESOURCE,
        "the app's token is the resource tenant's"
    );
    assert_eq!(c["aud"], "https://storage.azure.com");
    assert_eq!(
        env.entra.ledger.owner(app.token.expose_secret()).as_deref(),
        Some(format!("{RESOURCE}/{APP}").as_str())
    );
}

#[tokio::test]
async fn each_missing_trust_is_refused_as_entra_refuses_it() {
    let env = start().await;
    // The pod's own token is no assertion for the app: it trusts the
    // identity, not the cluster.
    let (code, _) = rejected(
        env.exchange(RESOURCE, APP, STORAGE, &env.pod_token("operator"))
            .await,
    );
    assert_eq!(code, "AADSTS70021");
    // Another identity's exchange token: no federated credential names it.
    let lone = env
        .exchange(HOME, LONE_IDENTITY, EXCHANGE, &env.pod_token("lone"))
        .await
        .unwrap();
    let (code, message) = rejected(env.exchange(RESOURCE, APP, STORAGE, &lone.token).await);
    assert_eq!(code, "AADSTS70021");
    assert!(message.contains("Assertion Subject"), "{message}");
    // The app is not provisioned in the identity's... other tenants.
    let first = env
        .exchange(HOME, IDENTITY, EXCHANGE, &env.pod_token("operator"))
        .await
        .unwrap();
    let (code, _) = rejected(
        env.exchange(
            "11111111-2222-4333-8444-555555555555",
            APP,
            STORAGE,
            &first.token,
        )
        .await,
    );
    assert_eq!(code, "AADSTS90002", "an unknown tenant");
    let (code, _) = rejected(
        env.exchange(RESOURCE, LONE_IDENTITY, STORAGE, &first.token)
            .await,
    );
    assert_eq!(
        code, "AADSTS700016",
        "an app the resource tenant does not have"
    );
    // Only a managed identity's token may stand for Entra's issuer: the
    // app's own exchange token, from its home tenant (the issuer its
    // credential names), is refused.
    let app_exchange = env
        .exchange(HOME, APP, EXCHANGE, &first.token)
        .await
        .unwrap();
    let (code, _) = rejected(
        env.exchange(RESOURCE, APP, STORAGE, &app_exchange.token)
            .await,
    );
    assert_eq!(code, "AADSTS700226");
    // A forged token in Entra's name does not verify.
    let forger = SigningKey::generate_rs256().unwrap();
    let now = jsonwebtoken::get_current_timestamp();
    let forged = forger
        .sign(&serde_json::json!({
            "iss": v2_issuer(HOME), "aud": FEDERATION_AUDIENCE, "azp": IDENTITY,
            "sub": claims(&first)["sub"], "exp": now + 600, "nbf": now, "iat": now,
        }))
        .unwrap();
    let (code, _) = rejected(
        env.exchange(RESOURCE, APP, STORAGE, &SecretString::from(forged))
            .await,
    );
    assert_eq!(code, "AADSTS50013");
}

async fn dev_with_app(app: &str) -> lanyard::dev::DevStack {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.dev.azure_app_client_id = Some(app.into());
    config.dev.azure_app_tenant_id = Some(RESOURCE.into());
    lanyard::dev::DevStack::start(&config).await.unwrap()
}

/// What the Azure IMDS surface answers `lanyard dev`'s pod for `resource`.
async fn imds(client: &reqwest::Client, base: &str, resource: &str) -> (u16, serde_json::Value) {
    let resp = client
        .get(format!("{base}/metadata/identity/oauth2/token"))
        .query(&[("api-version", "2018-02-01"), ("resource", resource)])
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.json().await.unwrap())
}

/// A herd of a thousand costs one exchange of each hop; another resource
/// costs only the app's hop again, the identity's token being shared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_herd_costs_one_exchange_per_hop_and_the_first_is_shared() {
    let stack = dev_with_app(APP).await;
    let base = export(&stack, "AZURE_POD_IDENTITY_AUTHORITY_HOST").to_string();
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for _ in 0..1000 {
        let (client, base) = (client.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let (status, body) = imds(&client, &base, "https://storage.azure.com").await;
            assert_eq!(status, 200, "{body}");
            body["access_token"].as_str().unwrap().to_string()
        }));
    }
    let mut tokens = std::collections::HashSet::new();
    for t in tasks {
        tokens.insert(t.await.unwrap());
    }
    assert_eq!(tokens.len(), 1, "one credential for the herd");
    let entra = stack.entra.as_ref().unwrap();
    let token = tokens.into_iter().next().unwrap();
    assert_eq!(
        entra.ledger.owner(&token).as_deref(),
        Some(format!("{RESOURCE}/{APP}").as_str()),
        "the app's token, in the resource tenant"
    );
    assert_eq!(entra.stats.issued.load(Ordering::Relaxed), 2, "one per hop");
    let (status, body) = imds(&client, &base, "https://vault.azure.net").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        entra.stats.issued.load(Ordering::Relaxed),
        3,
        "the identity's token is reused for another resource"
    );
    stack.stop().await;
}

/// Through the Azure exchanger the broker uses: a refusal of either hop
/// names that hop, the identity or app and its tenant.
#[tokio::test]
async fn a_refusal_names_the_hop_that_failed() {
    hops_named_in(FEDERATION_AUDIENCE).await;
}

/// In US Government, both the pod's token and the identity's token for
/// the app are for that cloud's exchange audience, which is what the app's
/// credential names there.
#[tokio::test]
async fn a_sovereign_clouds_exchange_audience_serves_both_hops() {
    hops_named_in("api://AzureADTokenExchangeUSGov").await;
}

async fn hops_named_in(audience: &'static str) {
    use lanyard::cloud::azure::{annotations, AzureCloud};
    use lanyard::cloud::{
        Annotations, Bindings, Cloud, CloudExchanger, Kind, Surface, TokenRequest,
    };
    let env = start_in(audience).await;
    let cloud = AzureCloud {
        exchanger: env.exchanger.clone(),
        default_tenant: Some(HOME.into()),
        audience: env.audience.into(),
        first_hops: Default::default(),
    };
    let caller = |sa: &str| lanyard::token::Caller {
        namespace: "ml".into(),
        service_account: sa.into(),
        service_account_uid: "uid".into(),
        pod: None,
        node: None,
        token_expires_at: 0,
        token_fingerprint: "sha256:0".into(),
    };
    let request = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds)
        .with_scopes(vec!["https://storage.azure.com".into()]);
    let fetch = |sa: &'static str, identity: &'static str| {
        let annotations: Annotations = [
            (annotations::CLIENT_ID, identity),
            (annotations::APP_CLIENT_ID, APP),
            (annotations::APP_TENANT_ID, RESOURCE),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let bound = cloud
            .bind(&Bindings::from_annotations(&annotations), &caller(sa))
            .unwrap()
            .remove(0);
        let identity = cloud.identity(&bound);
        assert_eq!(
            (identity.id.as_str(), identity.account.as_str()),
            (APP, RESOURCE)
        );
        assert_eq!(
            identity.via.as_ref().map(|v| v.account.as_str()),
            Some(HOME)
        );
        (cloud.fetcher(&bound, &request, &caller(sa)))(env.pod_token(sa))
    };
    // The app trusts IDENTITY, not LONE_IDENTITY: the second hop fails.
    let err = fetch("lone", LONE_IDENTITY).await.unwrap_err().to_string();
    assert!(err.contains("AADSTS70021"), "{err}");
    assert!(
        err.contains(&format!("app hop (app {APP} in tenant {RESOURCE}")),
        "{err}"
    );
    // IDENTITY trusts the operator ServiceAccount, not `lone`: the first.
    let err = fetch("lone", IDENTITY).await.unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "managed identity hop (identity {IDENTITY} in tenant {HOME}"
        )),
        "{err}"
    );
    // And the operator's own gets the app's token.
    let credential = fetch("operator", IDENTITY).await.unwrap();
    let token = credential.bearer().unwrap();
    assert_eq!(
        env.entra
            .ledger
            .owner(token.token.expose_secret())
            .as_deref(),
        Some(format!("{RESOURCE}/{APP}").as_str())
    );
}
