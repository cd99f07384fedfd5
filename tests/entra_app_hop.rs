//! Entra's managed-identity-to-app hop, against the validating Entra
//! emulator and a stand-in for the node's IMDS: a managed identity
//! assigned to the node pool gets a v2 token for the token-exchange
//! audience from the node's IMDS, which an app (multi-tenant, provisioned
//! in another tenant) takes as its assertion because its federated
//! credential trusts that identity. The same identity's token obtained
//! through its own federated credential (the pod's token as its assertion)
//! is refused there with AADSTS700231, as Entra refuses it
//! (azure-workload-identity issue #1363), and Lanyard refuses to ask for
//! one. Each missing trust is refused as Entra refuses it, and through
//! `lanyard dev` a herd costs one exchange per hop.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::azure::{AzureExchanger, AzureRequest, NodeImds};
use lanyard::cloud::CloudError;
use lanyard::config::Config;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::entra::{v2_issuer, Entra, FEDERATION_AUDIENCE};
use lanyard_emulators::{
    AzureApp, Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, NodeIdentity, PodIdentity,
    SigningKey,
};
use support::{export, rejected};

/// The identities' tenant, where the app is registered.
const HOME: &str = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b";
/// The tenant the app is provisioned in, and its tokens asked in.
const RESOURCE: &str = "9d8c7b6a-5f4e-4d3c-8b2a-190817263544";
/// A managed identity assigned to the node pool, which the app trusts.
const IDENTITY: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
/// A managed identity on the node no app trusts.
const LONE_IDENTITY: &str = "6a5b4c3d-2e1f-4a0b-9c8d-7e6f5a4b3c2d";
/// A managed identity reached through its federated credential (workload
/// identity), which the app also trusts.
const FEDERATED_IDENTITY: &str = "7b6c5d4e-3f2a-4b1c-8d9e-0f1a2b3c4d5e";
const APP: &str = "c0ffee00-1234-4abc-8def-0123456789ab";
const EXCHANGE: &str = "api://AzureADTokenExchange/.default";
const STORAGE: &str = "https://storage.azure.com/.default";
const HOUR: Duration = Duration::from_secs(3600);

struct Env {
    audience: &'static str,
    issuer: Arc<Issuer>,
    entra: Arc<Entra>,
    exchanger: AzureExchanger,
    imds: NodeImds,
    imds_url: String,
    _stop: ShutdownTrigger,
}

async fn start() -> Env {
    start_in(FEDERATION_AUDIENCE).await
}

/// The emulators of a cloud whose token-exchange audience is `audience`.
async fn start_in(audience: &'static str) -> Env {
    let (stop, shutdown) = Shutdown::new();
    let issuer = support::loopback_issuer(&shutdown).await;
    let url = issuer.url().to_string();
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
            bindings: vec![binding(
                "federated",
                FEDERATED_IDENTITY,
                Some(AzureApp {
                    client_id: APP.into(),
                    tenant_id: RESOURCE.into(),
                }),
            )],
            azure_identity_binding: false,
            azure_node_identities: vec![
                NodeIdentity {
                    client_id: IDENTITY.into(),
                    app: Some(AzureApp {
                        client_id: APP.into(),
                        tenant_id: RESOURCE.into(),
                    }),
                },
                NodeIdentity {
                    client_id: LONE_IDENTITY.into(),
                    app: None,
                },
            ],
        },
        lanyard::http::client(),
    )
    .unwrap();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "entra").await.unwrap();
    let entra_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(listener, set.entra.router(), shutdown.clone());
    let listener = bind("127.0.0.1:0".parse().unwrap(), "imds").await.unwrap();
    let imds_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(
        listener,
        lanyard_emulators::imds::router(set.entra.clone()),
        shutdown,
    );
    Env {
        audience,
        issuer,
        entra: set.entra,
        exchanger: AzureExchanger::new(lanyard::http::client(), entra_url),
        imds: NodeImds::new(lanyard::http::client(), &imds_url),
        imds_url,
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

#[tokio::test]
async fn the_node_identitys_token_from_imds_is_the_apps_assertion_in_the_resource_tenant() {
    let env = start().await;
    let first = env.imds.token(IDENTITY, FEDERATION_AUDIENCE).await.unwrap();
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
    // The node's identity's own tokens, for any resource.
    let own = env
        .imds
        .token(IDENTITY, "https://vault.azure.net")
        .await
        .unwrap();
    assert_eq!(claims(&own)["appid"], IDENTITY);
    assert_eq!(claims(&own)["aud"], "https://vault.azure.net");
}

#[tokio::test]
async fn a_token_obtained_through_a_federated_credential_is_refused_as_the_apps_assertion() {
    let env = start().await;
    // The identity's exchange token, obtained with the pod's token through
    // the identity's federated credential: valid, but not an assertion.
    let first = env
        .exchange(
            HOME,
            FEDERATED_IDENTITY,
            EXCHANGE,
            &env.pod_token("federated"),
        )
        .await
        .unwrap();
    assert_eq!(claims(&first)["azp"], FEDERATED_IDENTITY);
    let (code, message) = rejected(env.exchange(RESOURCE, APP, STORAGE, &first.token).await);
    assert_eq!(code, "AADSTS700231");
    assert!(
        message.starts_with("AADSTS700231: Token obtained using another federated identity credential may not be used as federated identity credential."),
        "{message}"
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
    assert_eq!(
        code, "AADSTS700211",
        "the cluster is no issuer the app trusts"
    );
    // Another identity's exchange token: no federated credential names it.
    let lone = env
        .imds
        .token(LONE_IDENTITY, FEDERATION_AUDIENCE)
        .await
        .unwrap();
    let (code, message) = rejected(env.exchange(RESOURCE, APP, STORAGE, &lone.token).await);
    assert_eq!(code, "AADSTS700213");
    assert!(message.contains("presented assertion subject"), "{message}");
    // The app is not provisioned in the identity's... other tenants.
    let first = env.imds.token(IDENTITY, FEDERATION_AUDIENCE).await.unwrap();
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

/// The IMDS stand-in answers as IMDS does: the header, the identity, and
/// which one when the node has several.
#[tokio::test]
async fn the_node_imds_refuses_as_imds_does() {
    let env = start().await;
    let client = reqwest::Client::new();
    let get = |query: Vec<(&'static str, &'static str)>, metadata: bool| {
        let mut req = client
            .get(format!("{}/metadata/identity/oauth2/token", env.imds_url))
            .query(&query);
        if metadata {
            req = req.header("Metadata", "true");
        }
        async move {
            let resp = req.send().await.unwrap();
            (
                resp.status().as_u16(),
                resp.json::<serde_json::Value>().await.unwrap(),
            )
        }
    };
    let storage = ("resource", "https://storage.azure.com");
    let version = ("api-version", "2018-02-01");
    let (status, body) = get(vec![version, storage, ("client_id", IDENTITY)], false).await;
    assert_eq!(
        (status, body["error_description"].as_str()),
        (400, Some("Required metadata header not specified"))
    );
    let (status, body) = get(vec![version, storage], true).await;
    assert_eq!(status, 400);
    assert_eq!(
        body,
        serde_json::json!({"error": "invalid_request", "error_description": "Multiple user assigned identities exist, please specify the clientId / resourceId of the identity in the token request"})
    );
    let (status, body) = get(
        vec![version, storage, ("client_id", FEDERATED_IDENTITY)],
        true,
    )
    .await;
    assert_eq!(
        (status, body["error_description"].as_str()),
        (400, Some("Identity not found"))
    );
    // Through the agent's client, the refusal names the identity.
    let err = env
        .imds
        .token(FEDERATED_IDENTITY, "https://storage.azure.com")
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&format!(
            "the node's IMDS refused managed identity {FEDERATED_IDENTITY}: Identity not found"
        )),
        "{err}"
    );
    let (status, body) = get(vec![version, storage, ("client_id", IDENTITY)], true).await;
    assert_eq!(status, 200, "{body}");
    for field in support::IMDS_TOKEN_FIELDS {
        assert!(body[field].is_string(), "{field}: {body}");
    }
}

/// `lanyard dev` whose pod reaches `app` through the dev identity, on the
/// node, under a policy that permits the dev ServiceAccount the app (a
/// node identity is never served without one); the policy directory lives
/// as long as the returned guard.
async fn dev_with_app(app: &str) -> (lanyard::dev::DevStack, tempfile::TempDir) {
    let mut config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.dev.azure_app_client_id = Some(app.into());
    config.dev.azure_app_tenant_id = Some(RESOURCE.into());
    // The dev identity, assigned to the node pool: its token for the app
    // comes from the (emulated) node's IMDS.
    config.azure.node_identities = vec![config.dev.azure_client_id.clone()];
    let policies = tempfile::tempdir().unwrap();
    std::fs::write(
        policies.path().join("node.cedar"),
        format!(
            "@id(\"dev-reaches-the-app\")\npermit (principal == ServiceAccount::\"{}/{}\", action, resource)\nwhen {{ resource.source == \"node\" && resource has via && resource.via.id == \"{}\" }};\n",
            config.dev.namespace, config.dev.service_account, config.dev.azure_client_id
        ),
    )
    .unwrap();
    config.policy.dir = Some(policies.path().to_path_buf());
    (
        lanyard::dev::DevStack::start(&config).await.unwrap(),
        policies,
    )
}

/// `lanyard dev` refuses an app reached through an identity that is not on
/// the node, saying why: Entra would refuse it.
#[test]
fn dev_refuses_an_app_through_a_federated_identity() {
    let mut config = Config::default();
    config.dev.azure_app_client_id = Some(APP.into());
    let err = config.validate().unwrap_err().to_string();
    assert!(
        err.contains("dev.azure_app_client_id") && err.contains("AADSTS700231"),
        "{err}"
    );
    assert!(err.contains("azure.node_identities"), "{err}");
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
    let (stack, _policies) = dev_with_app(APP).await;
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
        exchange_audience: env.audience.into(),
        first_hops: Default::default(),
        node_identities: [
            IDENTITY,
            LONE_IDENTITY,
            "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
        ]
        .map(String::from)
        .into(),
        node_imds: env.imds.clone(),
        identity_binding: None,
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
        if let Err(refused) = cloud.scope(&bound, &request) {
            return Box::pin(async move {
                Err(CloudError::Protocol {
                    cloud: Cloud::Azure,
                    reason: refused.to_string(),
                })
            })
                as std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>;
        }
        assert_eq!(identity.source.as_str(), "node");
        (cloud.fetcher(&bound, &request, &caller(sa)))(env.pod_token(sa))
    };
    // The app trusts IDENTITY, not LONE_IDENTITY: the second hop fails.
    let err = fetch("lone", LONE_IDENTITY).await.unwrap_err().to_string();
    assert!(err.contains("AADSTS700213"), "{err}");
    assert!(
        err.contains(&format!("app hop (app {APP} in tenant {RESOURCE}")),
        "{err}"
    );
    // Listed on the node, but not assigned to it: IMDS refuses the first.
    let err = fetch("lone", "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d")
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "managed identity hop (identity 0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d in tenant"
        ) && err.contains("Identity not found"),
        "{err}"
    );
    // An identity reached through its federated credential is refused
    // before anything is asked, naming what Entra would answer.
    let err = fetch("federated", FEDERATED_IDENTITY)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("AADSTS700231") && err.contains("azure.node_identities"),
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
