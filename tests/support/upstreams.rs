//! A built-in issuer and the cloud emulators on loopback, and a surfaces
//! stack wired to them for a chosen pod and directory (the `dev` feature).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use lanyard::broker::assemble::{self, Parts};
use lanyard::cloud::Cloud;
use lanyard::cloud::{aws, azure, gcp};
use lanyard::config::Config;
use lanyard::dev::MintedTokens;
use lanyard::directory::file::{ServiceAccountEntry, StaticDirectory};
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::SecretString;
use lanyard::serve::{self, Surfaces};
use lanyard::token::{KeySet, KeySource, Verifier};
use lanyard_emulators::aws::AwsSts;
use lanyard_emulators::entra::{Entra, FEDERATION_AUDIENCE};
use lanyard_emulators::gcp::Gcp;
use lanyard_emulators::{
    Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, PodIdentity, SigningKey,
};

pub const TENANT: &str = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b";
pub const CLIENT: &str = "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21";
pub const OBJECT: &str = "0c1d2e3f-4a5b-4c6d-8e7f-a0b1c2d3e4f5";
pub const IDENTITY_HEADER: &str = "test-identity-header-secret";

pub const PROVIDER: &str = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/test/providers/cluster";
pub const GCP_SA: &str = "ray-worker@lanyard-test.iam.gserviceaccount.com";
pub const ROLE: &str = "arn:aws:iam::111122223333:role/ray-worker";

/// Issuer + Entra, Google and AWS emulators, running until dropped.
pub struct Upstreams {
    pub issuer: Arc<Issuer>,
    pub entra: Arc<Entra>,
    pub entra_url: String,
    pub gcp: Arc<Gcp>,
    pub gcp_url: String,
    pub aws: Arc<AwsSts>,
    pub aws_url: String,
    pub trigger: ShutdownTrigger,
    pub shutdown: Shutdown,
}

async fn serve(router: impl lanyard::http::Respond, shutdown: &Shutdown) -> SocketAddr {
    let listener = bind("127.0.0.1:0".parse().unwrap(), "test server")
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    spawn_server(listener, router, shutdown.clone());
    addr
}

/// A service-account issuer on loopback, served until `shutdown` fires.
pub async fn loopback_issuer(shutdown: &Shutdown) -> Arc<Issuer> {
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(&url, SigningKey::generate_rs256().unwrap()));
    spawn_server(listener, issuer.router(), shutdown.clone());
    issuer
}

/// `router` on a new loopback listener until `shutdown` fires: its URL.
pub async fn loopback(router: impl lanyard::http::Respond, shutdown: &Shutdown) -> String {
    format!("http://{}", serve(router, shutdown).await)
}

/// The dev pod identity used throughout the tests.
pub fn pod() -> PodIdentity {
    PodIdentity::new("default", "ray-worker", "ray-worker-0", "node-a")
}

/// Starts an issuer and an Entra emulator where `CLIENT` in `TENANT`
/// federates `subject` from that issuer.
pub async fn upstreams(subject: &str, lifetime: Duration) -> Upstreams {
    let (trigger, shutdown) = Shutdown::new();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let issuer_url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(
        issuer_url,
        SigningKey::generate_rs256().unwrap(),
    ));
    spawn_server(listener, issuer.router(), shutdown.clone());
    let set = EmulatorSet::new(
        &CloudsConfig {
            issuer: issuer.url().into(),
            azure_tenant_id: TENANT.into(),
            azure_audience: FEDERATION_AUDIENCE.into(),
            gcp_provider: PROVIDER.into(),
            gcp_allowed_audiences: vec![],
            gcp_gke: None,
            aws_audience: "sts.amazonaws.com".into(),
            lifetimes: Lifetimes::all(lifetime),
            bindings: vec![Binding {
                subject: subject.into(),
                azure_client_id: Some(CLIENT.into()),
                gcp_service_account: Some(GCP_SA.into()),
                aws_role_arn: Some(ROLE.into()),
                aws_target: None,
                azure_app: None,
            }],
            azure_identity_binding: false,
            azure_node_identities: vec![],
        },
        lanyard::http::client(),
    )
    .expect("emulators");
    let EmulatorSet {
        entra, gcp, aws, ..
    } = set;
    let entra_url = format!("http://{}", serve(entra.router(), &shutdown).await);
    let gcp_url = format!("http://{}", serve(gcp.router(), &shutdown).await);
    let aws_url = format!("http://{}", serve(aws.router(), &shutdown).await);
    Upstreams {
        issuer,
        entra,
        entra_url,
        gcp,
        gcp_url,
        aws,
        aws_url,
        trigger,
        shutdown,
    }
}

impl Upstreams {
    /// A configuration whose clouds are these emulators, as an operator
    /// would point Lanyard at private endpoints.
    pub fn config(&self) -> Config {
        Config {
            azure: azure::Settings {
                authority_host: Some(self.entra_url.clone()),
                tenant_id: Some(TENANT.into()),
                ..Default::default()
            },
            gcp: gcp::Settings {
                workload_identity_provider: Some(PROVIDER.into()),
                project_id: Some("lanyard-test".into()),
                project_number: Some("123456789012".into()),
                sts_endpoint: Some(self.gcp_url.clone()),
                iamcredentials_endpoint: Some(self.gcp_url.clone()),
                ..Default::default()
            },
            aws: aws::Settings {
                sts_endpoint: Some(self.aws_url.clone()),
                ..Default::default()
            },
            ..Default::default()
        }
    }
}

/// A ServiceAccount entry with annotations.
pub fn service_account(ns: &str, name: &str, annotations: &[(&str, &str)]) -> ServiceAccountEntry {
    ServiceAccountEntry {
        labels: Default::default(),
        namespace: ns.into(),
        name: name.into(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// The default binding of the dev ServiceAccount.
pub fn bound_dev_account() -> ServiceAccountEntry {
    service_account(
        "default",
        "ray-worker",
        &[
            ("azure.workload.identity/client-id", CLIENT),
            ("azure.workload.identity/tenant-id", TENANT),
            ("lanyard.dev/azure-object-id", OBJECT),
        ],
    )
}

/// Surfaces for `pod`, whose projected tokens `issuer` mints, resolving
/// bindings from `accounts`. Returns the base URL.
pub async fn surfaces(
    up: &Upstreams,
    pod: PodIdentity,
    accounts: &[ServiceAccountEntry],
) -> String {
    surfaces_with_issuer(up, up.issuer.clone(), pod, accounts).await
}

/// As [`surfaces`], but the pod's tokens come from `minting_issuer`
/// (which may differ from the issuer the broker trusts).
pub async fn surfaces_with_issuer(
    up: &Upstreams,
    minting_issuer: Arc<Issuer>,
    pod: PodIdentity,
    accounts: &[ServiceAccountEntry],
) -> String {
    let http = lanyard::http::client();
    let verifier = Verifier::new(
        up.issuer.url(),
        KeySet::new(
            KeySource::Discovery {
                issuer: up.issuer.url().into(),
            },
            http.clone(),
        ),
    );
    let config = up.config();
    let parts = Parts::new(
        &config,
        "dev",
        verifier,
        Arc::new(StaticDirectory::new(accounts)),
    )
    .unwrap();
    let broker = Arc::new(assemble::broker(&config, parts, http).unwrap());
    let subjects = Arc::new(MintedTokens::new(
        minting_issuer,
        pod,
        Duration::from_secs(3600),
        vec![
            (Cloud::Azure, FEDERATION_AUDIENCE.into()),
            (Cloud::Gcp, PROVIDER.into()),
            (Cloud::Aws, "sts.amazonaws.com".into()),
        ],
    ));
    let surfaces = Arc::new(Surfaces {
        broker,
        subjects,
        identity_header: SecretString::from(IDENTITY_HEADER.to_string()),
        app_token: Some(serve::container_token::ContainerToken::new(
            container_token_file(),
        )),
        imds_sessions: serve::aws_imds::SessionTokens::new(),
        defaults: serve::sdk_env::SdkDefaults::default(),
    });
    format!(
        "http://{}",
        serve(serve::router(surfaces), &up.shutdown).await
    )
}

/// A container authorization token file shared by the tests of one binary.
pub fn container_token_file() -> std::path::PathBuf {
    static FILE: std::sync::OnceLock<tempfile::TempPath> = std::sync::OnceLock::new();
    FILE.get_or_init(|| {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, CONTAINER_TOKEN.as_bytes()).unwrap();
        f.into_temp_path()
    })
    .to_path_buf()
}

pub const CONTAINER_TOKEN: &str = "test-container-authorization-token";

/// A full in-process `lanyard dev` stack on loopback, and the base URL of
/// its SDK surfaces.
pub async fn dev_stack() -> (lanyard::dev::DevStack, String) {
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    let stack = lanyard::dev::DevStack::start(&config).await.unwrap();
    let base = format!("http://{}", stack.surfaces_addr);
    (stack, base)
}

/// The value `stack` exports for the variable `name`.
pub fn export<'a>(stack: &'a lanyard::dev::DevStack, name: &str) -> &'a str {
    stack
        .exports
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .unwrap()
}
