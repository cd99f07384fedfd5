//! AKS identity bindings: the agent's exchange through the cluster's
//! identity-binding proxy (`lanyard::cloud::azure::identity_binding`)
//! against the proxy emulator (`lanyard_emulators::identity_binding`),
//! reached as the API server's address with the proxy's TLS server name and
//! the cluster CA, with Entra's emulator behind it holding only the
//! identity's `aks-identity-binding` credential.
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::azure::identity_binding::{self, IdentityBindingProxy};
use lanyard::cloud::azure::{AzureExchanger, AzureRequest};
use lanyard::cloud::CloudError;
use lanyard::http::{Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::entra::Entra;
use lanyard_emulators::identity_binding::{Proxy, ProxyConfig, ISSUER_ORIGIN};
use lanyard_emulators::pki::Pki;
use lanyard_emulators::{
    Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, PodIdentity, SigningKey,
};

use support::{loopback, loopback_issuer, rejected};

const TENANT: &str = "72f988bf-86f1-41af-91ab-2d7cd011db47";
const IDENTITY: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
const SNI: &str = "a1b2c3d4e5.ests.aks";
const SCOPE: &str = "https://storage.azure.com/.default";
const HOUR: Duration = Duration::from_secs(3600);

struct Env {
    issuer: Arc<Issuer>,
    entra: Arc<Entra>,
    proxy: Arc<Proxy>,
    /// `https://127.0.0.1:PORT`: the API server's address.
    api_server: String,
    ca_file: tempfile::NamedTempFile,
    entra_url: String,
    _stop: ShutdownTrigger,
}

async fn start() -> Env {
    let (stop, shutdown) = Shutdown::new();
    let issuer = loopback_issuer(&shutdown).await;
    let url = issuer.url().to_string();
    let set = EmulatorSet::new(
        &CloudsConfig {
            issuer: url.clone(),
            azure_tenant_id: TENANT.into(),
            azure_audience: "api://AzureADTokenExchange".into(),
            gcp_provider: "//iam.googleapis.com/projects/1/locations/global/workloadIdentityPools/p/providers/c".into(),
            gcp_allowed_audiences: vec![],
            gcp_gke: None,
            aws_audience: "sts.amazonaws.com".into(),
            lifetimes: Lifetimes::all(HOUR),
            // RBAC lets ml/trainer use the identity; nobody else.
            bindings: vec![Binding {
                subject: "system:serviceaccount:ml:trainer".into(),
                azure_client_id: Some(IDENTITY.into()),
                ..Binding::default()
            }],
            azure_identity_binding: true,
            azure_node_identities: vec![],
        },
        lanyard::http::client(),
    )
    .unwrap();
    let entra_url = loopback(set.entra.router(), &shutdown).await;
    let proxy = Arc::new(
        Proxy::new(
            ProxyConfig {
                sni_name: SNI.into(),
                cluster_issuer: url,
                entra: entra_url.clone(),
                bindings: set.identity_bindings.clone(),
            },
            lanyard::http::client(),
        )
        .unwrap(),
    );
    // Entra fetches the identities' issuer (ib.oic.prod-aks.azure.com)
    // from the proxy's stand-in for it.
    let ib_issuer = loopback(proxy.issuer_router(), &shutdown).await;
    set.entra.stand_in(ISSUER_ORIGIN, &ib_issuer);

    let pki = Pki::generate("test cluster CA", vec![SNI.into()]).unwrap();
    let ca_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca_file.path(), &pki.ca_pem).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let api_server = format!("https://{}", listener.local_addr().unwrap());
    let server = axum_server::from_tcp_rustls(
        listener,
        axum_server::tls_rustls::RustlsConfig::from_config(proxy.tls(&pki).unwrap()),
    )
    .unwrap();
    let router = proxy.router();
    tokio::spawn(async move { server.serve(router.into_make_service()).await });
    Env {
        issuer,
        entra: set.entra,
        proxy,
        api_server,
        ca_file,
        entra_url,
        _stop: stop,
    }
}

impl Env {
    fn pod_token(&self, sa: &str, audience: &str) -> SecretString {
        let pod = PodIdentity::new("ml", sa, &format!("{sa}-0"), "node-a");
        SecretString::from(self.issuer.mint(&pod, &[audience], HOUR).unwrap())
    }

    /// The agent's side, as `azure.identity_binding_*` configure it.
    fn agent(&self, sni: &str) -> IdentityBindingProxy {
        IdentityBindingProxy::new(
            sni.into(),
            identity_binding::api_server(Some(&self.api_server), (None, None)).unwrap(),
            self.ca_file.path().to_path_buf(),
        )
    }
}

fn request<'a>(assertion: &'a SecretString) -> AzureRequest<'a> {
    AzureRequest {
        tenant_id: TENANT,
        client_id: IDENTITY,
        scope: SCOPE,
        assertion,
    }
}

#[tokio::test]
async fn the_pods_token_becomes_the_identitys_through_the_proxy() {
    let env = start().await;
    let token = env.pod_token("trainer", identity_binding::AUDIENCE);
    let issued = env.agent(SNI).exchange(&request(&token)).await.unwrap();
    // An Entra token for the identity, obtained with the proxy's own
    // assertion: the pod's token never reached Entra.
    assert_eq!(
        env.entra.ledger.owner(issued.token.expose_secret()),
        Some(format!("{TENANT}/{IDENTITY}"))
    );
    assert!(issued.expires_at > issued.issued_at);
    assert_eq!(env.proxy.stats.exchanged.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn entra_refuses_the_pods_identity_binding_token_presented_directly() {
    // What Microsoft Learn says of a client that bypasses the proxy: the
    // identity trusts no credential for the cluster's issuer.
    let env = start().await;
    let token = env.pod_token("trainer", identity_binding::AUDIENCE);
    let entra = AzureExchanger::new(lanyard::http::client(), &env.entra_url);
    let (code, message) = rejected(entra.exchange(&request(&token)).await);
    assert_eq!(code, "AADSTS700211", "{message}");
}

#[tokio::test]
async fn the_proxy_refuses_what_rbac_and_its_audience_refuse() {
    let env = start().await;
    let agent = env.agent(SNI);

    // Another ServiceAccount: no use-managed-identity grant.
    let other = env.pod_token("intruder", identity_binding::AUDIENCE);
    let (code, message) = rejected(agent.exchange(&request(&other)).await);
    assert_eq!(code, "unauthorized_client");
    assert!(
        message.contains("ml/intruder cannot use-managed-identity"),
        "{message}"
    );

    // The pod's token for Entra's audience is not the proxy's.
    let wrong = env.pod_token("trainer", "api://AzureADTokenExchange");
    let (code, message) = rejected(agent.exchange(&request(&wrong)).await);
    assert_eq!(code, "invalid_client");
    assert!(message.contains("api://AKSIdentityBinding"), "{message}");

    // A token the cluster did not sign.
    let forged_issuer = Issuer::new(env.issuer.url(), SigningKey::generate_rs256().unwrap());
    let pod = PodIdentity::new("ml", "trainer", "trainer-0", "node-a");
    let forged = SecretString::from(
        forged_issuer
            .mint(&pod, &[identity_binding::AUDIENCE], HOUR)
            .unwrap(),
    );
    let (code, _) = rejected(agent.exchange(&request(&forged)).await);
    assert_eq!(code, "invalid_client");

    // An identity with no binding in this cluster.
    let token = env.pod_token("trainer", identity_binding::AUDIENCE);
    let unbound = AzureRequest {
        client_id: "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
        ..request(&token)
    };
    let (code, message) = rejected(agent.exchange(&unbound).await);
    assert_eq!(code, "unauthorized_client");
    assert!(message.contains("no identity binding"), "{message}");

    // No refusal carries the pod's token.
    let err = agent.exchange(&request(&other)).await.unwrap_err();
    assert!(!format!("{err} {err:?}").contains(other.expose_secret()));
    assert_eq!(env.proxy.stats.exchanged.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn only_the_proxys_name_and_the_cluster_ca_reach_it() {
    let env = start().await;
    let token = env.pod_token("trainer", identity_binding::AUDIENCE);

    // Another server name: at AKS that is the API server, no token
    // endpoint; here the handshake finds no certificate.
    match env
        .agent("b9f8e7.ests.aks")
        .exchange(&request(&token))
        .await
    {
        Err(CloudError::Unavailable { reason, .. }) => {
            assert!(reason.contains("identity-binding proxy"), "{reason}")
        }
        other => panic!("expected the handshake to fail, got {other:?}"),
    }

    // The cluster CA rotated to one that did not sign the proxy's
    // certificate: the file is read again and the handshake fails; back to
    // the right CA, it works, with no restart.
    let agent = env.agent(SNI);
    agent.exchange(&request(&token)).await.unwrap();
    let stranger = Pki::generate("another CA", vec![SNI.into()]).unwrap();
    let right = std::fs::read(env.ca_file.path()).unwrap();
    std::fs::write(env.ca_file.path(), &stranger.ca_pem).unwrap();
    assert!(matches!(
        agent.exchange(&request(&token)).await,
        Err(CloudError::Unavailable { .. })
    ));
    std::fs::write(env.ca_file.path(), &right).unwrap();
    agent.exchange(&request(&token)).await.unwrap();
    // Mid-rotation (an empty file), the client built last is kept.
    std::fs::write(env.ca_file.path(), b"").unwrap();
    agent.exchange(&request(&token)).await.unwrap();
}
