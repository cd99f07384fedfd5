//! What a ServiceAccount's annotations decide, seen through the surfaces:
//! no AWS role → not found; no Google service account → the federated
//! principal is served directly and ID tokens are refused; a Google
//! service account → impersonation.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::Value;
use support::*;

async fn gce(base: &str, path: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{base}/computeMetadata/v1/{path}"))
        .header("Metadata-Flavor", "Google")
        .send()
        .await
        .unwrap()
}

async fn container(base: &str) -> reqwest::Response {
    reqwest::Client::new()
        .get(format!("{base}/v1/credentials"))
        .header("Authorization", CONTAINER_TOKEN)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn unannotated_account_gets_federated_google_token_and_no_aws() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    let base = surfaces(&up, p, &[service_account("default", "ray-worker", &[])]).await;

    let email = gce(&base, "instance/service-accounts/default/email").await;
    assert_eq!(email.text().await.unwrap(), "lanyard-test.svc.id.goog");
    let token: Value = gce(&base, "instance/service-accounts/default/token")
        .await
        .json()
        .await
        .unwrap();
    assert!(token["access_token"].as_str().unwrap().starts_with("ya29."));
    assert_eq!(up.gcp.stats.sts_issued.load(Ordering::Relaxed), 1);
    assert_eq!(
        up.gcp.stats.iam_requests.load(Ordering::Relaxed),
        0,
        "no impersonation"
    );
    let id = gce(
        &base,
        "instance/service-accounts/default/identity?audience=x",
    )
    .await;
    assert_eq!(id.status(), 400);
    assert!(id
        .text()
        .await
        .unwrap()
        .contains("iam.gke.io/gcp-service-account"));

    let resp = container(&base).await;
    assert_eq!(resp.status(), 404);
    let body: Value = resp.json().await.unwrap();
    assert!(body["message"]
        .as_str()
        .unwrap()
        .contains("eks.amazonaws.com/role-arn"));
    assert_eq!(up.aws.stats.requests.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn annotated_account_impersonates_and_assumes_its_role() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    let accounts = [service_account(
        "default",
        "ray-worker",
        &[
            ("iam.gke.io/gcp-service-account", GCP_SA),
            ("eks.amazonaws.com/role-arn", ROLE),
        ],
    )];
    let base = surfaces(&up, p, &accounts).await;
    let email = gce(&base, "instance/service-accounts/default/email").await;
    assert_eq!(email.text().await.unwrap(), GCP_SA);
    let token = gce(&base, &format!("instance/service-accounts/{GCP_SA}/token")).await;
    assert_eq!(token.status(), 200);
    assert_eq!(up.gcp.stats.iam_issued.load(Ordering::Relaxed), 1);
    let id = gce(
        &base,
        "instance/service-accounts/default/identity?audience=https://x.example",
    )
    .await;
    assert_eq!(id.status(), 200);

    let resp = container(&base).await;
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["AccountId"], "111122223333");
    assert_eq!(up.aws.stats.issued.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn google_service_account_the_principal_may_not_impersonate_is_permission_denied() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    let accounts = [service_account(
        "default",
        "ray-worker",
        &[(
            "iam.gke.io/gcp-service-account",
            "admin@lanyard-test.iam.gserviceaccount.com",
        )],
    )];
    let base = surfaces(&up, p, &accounts).await;
    let resp = gce(&base, "instance/service-accounts/default/token").await;
    assert_eq!(resp.status(), 403);
    let text = resp.text().await.unwrap();
    assert!(
        text.contains("NOT_FOUND") || text.contains("PERMISSION_DENIED"),
        "{text}"
    );
    assert!(!text.contains("ya29."));
}
