//! GKE's own Workload Identity pool: the Google side configured with
//! `gcp.gke_cluster` exchanges through `PROJECT.svc.id.goog` against the
//! Google emulator holding only the grants GKE Workload Identity users
//! already made (`serviceAccount:PROJECT.svc.id.goog[NS/KSA]`, the direct
//! `principal://…/subject/ns/NS/sa/KSA`, a namespace's `principalSet`), and
//! each way Google says no.
// Needs the `dev` feature (built-in issuer, emulators).
#![cfg(feature = "dev")]

mod support;

use std::sync::Arc;
use std::time::Duration;

use lanyard::cloud::gcp::{GcpCloud, Settings};
use lanyard::cloud::CloudError;
use lanyard::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::gcp::{Gcp, GcpEmulatorConfig, GcpServiceAccount, GkeCluster};
use lanyard_emulators::{Issuer, PodIdentity};

const PROJECT: &str = "ray-prod-4821";
const PROJECT_NUMBER: &str = "310987654321";
const CLUSTER: &str = "projects/ray-prod-4821/locations/us-central1/clusters/ray";
const POOL: &str = "ray-prod-4821.svc.id.goog";
const HEAD_SA: &str = "ray-head@ray-prod-4821.iam.gserviceaccount.com";
const TEAM_SA: &str = "team@ray-prod-4821.iam.gserviceaccount.com";
const OTHER_SA: &str = "other@ray-prod-4821.iam.gserviceaccount.com";
const HOUR: Duration = Duration::from_secs(3600);

struct Env {
    issuer: Arc<Issuer>,
    stranger: Arc<Issuer>,
    google: GcpCloud,
    pod: PodIdentity,
    gcp: Arc<Gcp>,
    _stop: ShutdownTrigger,
}

async fn start() -> Env {
    let (stop, shutdown) = Shutdown::new();
    let issuer = support::loopback_issuer(&shutdown).await;
    // Another cluster's issuer, which this pool does not trust.
    let stranger = support::loopback_issuer(&shutdown).await;
    let cluster = GkeCluster::named(CLUSTER, PROJECT_NUMBER, issuer.url()).unwrap();
    let principal_set = format!(
        "principalSet://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}/namespace/team"
    );
    let config = GcpEmulatorConfig {
        providers: vec![],
        clusters: vec![cluster.clone()],
        service_accounts: vec![
            GcpServiceAccount {
                email: HEAD_SA.into(),
                members: vec![format!("serviceAccount:{POOL}[ray/head]")],
            },
            GcpServiceAccount {
                email: TEAM_SA.into(),
                members: vec![principal_set],
            },
            GcpServiceAccount {
                email: OTHER_SA.into(),
                members: vec![cluster.principal("ray", "worker")],
            },
        ],
        lifetime: HOUR,
    };
    let gcp = Arc::new(Gcp::new(config, lanyard::http::client()).unwrap());
    let listener = bind("127.0.0.1:0".parse().unwrap(), "gcp").await.unwrap();
    let gcp_url = format!("http://{}", listener.local_addr().unwrap());
    spawn_server(listener, gcp.router(), shutdown);

    let settings = Settings {
        gke_cluster: Some(CLUSTER.into()),
        project_number: Some(PROJECT_NUMBER.into()),
        sts_endpoint: Some(gcp_url.clone()),
        iamcredentials_endpoint: Some(gcp_url),
        ..Settings::default()
    };
    settings.check().unwrap();
    let google = settings
        .exchanger(lanyard::http::client())
        .unwrap()
        .expect("GKE mode serves Google");
    Env {
        issuer,
        stranger,
        google,
        pod: PodIdentity::new("ray", "head", "ray-head-0", "node-a"),
        gcp,
        _stop: stop,
    }
}

impl Env {
    fn token(&self, pod: &PodIdentity, audience: &str) -> SecretString {
        SecretString::from(self.issuer.mint(pod, &[audience], HOUR).unwrap())
    }

    async fn federate(&self, pod: &PodIdentity) -> Result<SecretString, CloudError> {
        let token = self.token(pod, &self.google.audience);
        self.google
            .exchanger
            .exchange(&token, &self.google.provider, &[])
            .await
            .map(|t| t.token)
    }
}

#[track_caller]
fn rejected(result: Result<impl std::fmt::Debug, CloudError>) -> (String, String) {
    match result {
        Err(CloudError::Rejected { code, message, .. }) => (code, message),
        other => panic!("expected CloudError::Rejected, got {other:?}"),
    }
}

#[tokio::test]
async fn the_cluster_names_gkes_pool_as_gkes_metadata_server_does() {
    let env = start().await;
    assert_eq!(env.google.audience, POOL);
    assert_eq!(
        env.google.provider,
        format!("identitynamespace:{POOL}:https://container.googleapis.com/v1/{CLUSTER}")
    );
    assert_eq!(env.google.project_id, PROJECT);
    assert_eq!(env.google.project_number, PROJECT_NUMBER);
}

#[tokio::test]
async fn existing_gke_grants_work_unchanged() {
    let env = start().await;
    let federated = env.federate(&env.pod).await.unwrap();
    // Direct resource access: the federated principal GKE grants name.
    assert_eq!(
        env.gcp.federated_principal(federated.expose_secret()),
        Some(format!(
            "principal://iam.googleapis.com/projects/{PROJECT_NUMBER}/locations/global/workloadIdentityPools/{POOL}/subject/ns/ray/sa/head"
        ))
    );
    // serviceAccount:PROJECT.svc.id.goog[ray/head] on the head's account.
    let ex = &env.google.exchanger;
    let token = ex
        .generate_access_token(&federated, HEAD_SA, &[], HOUR)
        .await
        .unwrap();
    assert_eq!(
        env.gcp.ledger.owner(token.token.expose_secret()).as_deref(),
        Some(HEAD_SA)
    );
    let id = ex
        .generate_id_token(&federated, HEAD_SA, "https://ray.example", true)
        .await
        .unwrap();
    assert!(id.token.expose_secret().starts_with("eyJ"));

    // A namespace's principalSet covers every service account in it.
    let team_pod = PodIdentity::new("team", "anyone", "job-0", "node-a");
    let team = env.federate(&team_pod).await.unwrap();
    assert!(ex
        .generate_access_token(&team, TEAM_SA, &[], HOUR)
        .await
        .is_ok());
    // ...and nothing outside it.
    let (code, _) = rejected(
        ex.generate_access_token(&federated, TEAM_SA, &[], HOUR)
            .await,
    );
    assert_eq!(code, "PERMISSION_DENIED");
}

#[tokio::test]
async fn an_ungranted_service_account_is_refused_with_googles_error() {
    let env = start().await;
    let federated = env.federate(&env.pod).await.unwrap();
    // Granted to ray/worker's principal, not to ray/head.
    let (code, message) = rejected(
        env.google
            .exchanger
            .generate_access_token(&federated, OTHER_SA, &[], HOUR)
            .await,
    );
    assert_eq!(code, "PERMISSION_DENIED");
    assert_eq!(
        message,
        "Permission 'iam.serviceAccounts.getAccessToken' denied on resource (or it may not exist)."
    );
}

#[tokio::test]
async fn sts_validates_gkes_pool_like_google() {
    let env = start().await;
    let ex = &env.google.exchanger;
    let sts_audience = &env.google.provider;

    // A token for a provider-style audience is not one for the pool.
    let wrong_aud = env.token(&env.pod, "//iam.googleapis.com/projects/1/x");
    let (code, message) = rejected(ex.exchange(&wrong_aud, sts_audience, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert_eq!(
        message,
        "The audience in ID Token [//iam.googleapis.com/projects/1/x] does not match the expected audience."
    );

    // Another cluster's token, with the right audience.
    let foreign = SecretString::from(env.stranger.mint(&env.pod, &[POOL], HOUR).unwrap());
    let (code, message) = rejected(ex.exchange(&foreign, sts_audience, &[]).await);
    assert_eq!(code, "invalid_grant");
    assert!(
        message.starts_with(&format!(
            "The issuer in ID Token {} does not match",
            env.stranger.url()
        )),
        "{message}"
    );

    // A cluster the project does not have.
    let token = env.token(&env.pod, POOL);
    let elsewhere = sts_audience.replace("/clusters/ray", "/clusters/batch");
    let (code, _) = rejected(ex.exchange(&token, &elsewhere, &[]).await);
    assert_eq!(code, "invalid_target");

    // Not GKE's audience format.
    for bad in [
        format!("identitynamespace:{POOL}"),
        format!("identitynamespace:{PROJECT}:https://container.googleapis.com/v1/{CLUSTER}"),
        format!("identitynamespace:{POOL}:https://example.com/v1/{CLUSTER}"),
    ] {
        let (code, _) = rejected(ex.exchange(&token, &bad, &[]).await);
        assert_eq!(code, "invalid_request", "{bad}");
    }
    assert_eq!(
        env.gcp
            .stats
            .sts_issued
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}
