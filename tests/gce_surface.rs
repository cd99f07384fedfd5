//! The GCE metadata surface over real HTTP against a full in-process dev
//! stack: Google's header rules, text/JSON bodies, directories, redirects,
//! tokens and ID tokens, and refusals.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;

use serde_json::Value;
use support::dev_stack;

async fn get(url: &str, flavor: bool) -> reqwest::Response {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let mut req = client.get(url);
    if flavor {
        req = req.header("Metadata-Flavor", "Google");
    }
    req.send().await.unwrap()
}

fn flavor(resp: &reqwest::Response) -> &str {
    resp.headers()
        .get("metadata-flavor")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

const SA: &str = "ray-worker@lanyard-dev.iam.gserviceaccount.com";

#[tokio::test]
async fn header_rules() {
    let (stack, base) = dev_stack().await;
    let url = format!("{base}/computeMetadata/v1/instance/service-accounts/default/token");
    let resp = get(&url, false).await;
    assert_eq!(resp.status(), 403);
    assert_eq!(flavor(&resp), "Google");
    let resp = reqwest::Client::new()
        .get(&url)
        .header("Metadata-Flavor", "google")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403, "the value is case-sensitive, as on GCE");
    let resp = reqwest::Client::new()
        .get(&url)
        .header("Metadata-Flavor", "Google")
        .header("X-Forwarded-For", "10.0.0.1")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    assert!(!resp.text().await.unwrap().contains("access_token"));
    let gcp = stack.gcp.as_ref().unwrap();
    assert_eq!(
        gcp.stats.sts_requests.load(Ordering::Relaxed),
        0,
        "refused before upstream"
    );
    stack.stop().await;
}

#[tokio::test]
async fn ping_project_and_universe() {
    let (stack, base) = dev_stack().await;
    let resp = get(&format!("{base}/"), true).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(flavor(&resp), "Google");
    let cases = [
        ("project/project-id", "lanyard-dev"),
        ("project/numeric-project-id", "123456789012"),
        ("universe/universe-domain", "googleapis.com"),
        ("instance/service-accounts/default/email", SA),
        (&format!("instance/service-accounts/{SA}/email"), SA),
    ];
    for (path, want) in cases {
        let resp = get(&format!("{base}/computeMetadata/v1/{path}"), true).await;
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(resp.headers()["content-type"], "application/text");
        assert_eq!(flavor(&resp), "Google");
        assert_eq!(resp.text().await.unwrap(), want, "{path}");
    }
    stack.stop().await;
}

/// A Trusted Partner Cloud's universe and GKE's pool: the surface reports
/// the configured universe and the cluster's project, and tokens come
/// through the cluster's pool.
#[tokio::test]
async fn the_configured_universe_and_gke_project_are_reported() {
    let mut config = lanyard::config::Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        ..Default::default()
    };
    config.gcp.universe_domain = "apis-tpczero.goog".into();
    config.gcp.gke_cluster =
        Some("projects/ray-prod-4821/locations/us-central1/clusters/ray".into());
    config.gcp.project_number = Some("310987654321".into());
    let stack = lanyard::dev::DevStack::start(&config).await.unwrap();
    let v1 = format!("http://{}/computeMetadata/v1", stack.surfaces_addr);
    for (path, want) in [
        ("universe/universe-domain", "apis-tpczero.goog"),
        ("universe/universe_domain", "apis-tpczero.goog"),
        ("project/project-id", "ray-prod-4821"),
        ("project/numeric-project-id", "310987654321"),
    ] {
        let resp = get(&format!("{v1}/{path}"), true).await;
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(resp.text().await.unwrap(), want, "{path}");
    }
    let all: Value = get(&format!("{v1}/?recursive=true"), true)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(all["universe"]["universeDomain"], "apis-tpczero.goog");
    let token: Value = get(
        &format!("{v1}/instance/service-accounts/default/token"),
        true,
    )
    .await
    .json()
    .await
    .unwrap();
    let token = token["access_token"].as_str().unwrap();
    let gcp = stack.gcp.as_ref().unwrap();
    assert_eq!(gcp.ledger.owner(token).as_deref(), Some(SA));
    stack.stop().await;
}

#[tokio::test]
async fn directories_listings_recursion_and_redirects() {
    let (stack, base) = dev_stack().await;
    let v1 = format!("{base}/computeMetadata/v1");
    let listing = get(&format!("{v1}/instance/service-accounts/"), true)
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(listing, format!("default/\n{SA}/\n"));
    let listing = get(&format!("{v1}/instance/service-accounts/default/"), true)
        .await
        .text()
        .await
        .unwrap();
    assert_eq!(listing, "aliases\nemail\nidentity\nscopes\ntoken\n");

    let resp = get(
        &format!("{v1}/instance/service-accounts/default/?recursive=true"),
        true,
    )
    .await;
    assert_eq!(resp.headers()["content-type"], "application/json");
    let info: Value = resp.json().await.unwrap();
    assert_eq!(info["email"], SA);
    assert_eq!(info["aliases"][0], "default");
    assert!(!info["scopes"].as_array().unwrap().is_empty());

    let all: Value = get(&format!("{v1}/?recursive=true"), true)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(all["project"]["projectId"], "lanyard-dev");
    assert_eq!(all["project"]["numericProjectId"], 123456789012u64);
    assert_eq!(all["instance"]["serviceAccounts"]["default"]["email"], SA);

    for (from, to) in [
        (
            "/computeMetadata/v1/instance/service-accounts",
            "/computeMetadata/v1/instance/service-accounts/",
        ),
        (
            "/computeMetadata/v1/instance/service-accounts/default?recursive=true",
            "/computeMetadata/v1/instance/service-accounts/default/?recursive=true",
        ),
        (
            "/computeMetadata/v1/project",
            "/computeMetadata/v1/project/",
        ),
    ] {
        let resp = get(&format!("{base}{from}"), true).await;
        assert_eq!(resp.status(), 301, "{from}");
        assert_eq!(resp.headers()["location"], to);
        assert_eq!(flavor(&resp), "Google");
    }
    for missing in [
        "instance/zone",
        "instance/service-accounts/default/nope",
        "nothing",
    ] {
        let resp = get(&format!("{v1}/{missing}"), true).await;
        assert_eq!(resp.status(), 404, "{missing}");
        assert_eq!(flavor(&resp), "Google");
    }
    stack.stop().await;
}

#[tokio::test]
async fn token_with_scopes_and_identity() {
    let (stack, base) = dev_stack().await;
    let v1 = format!("{base}/computeMetadata/v1/instance/service-accounts/default");
    let resp = get(
        &format!("{v1}/token?scopes=https://www.googleapis.com/auth/devstorage.read_only,https://www.googleapis.com/auth/cloud-platform"),
        true,
    )
    .await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: Value = resp.json().await.unwrap();
    assert!(body["access_token"].as_str().unwrap().starts_with("ya29."));
    assert_eq!(body["token_type"], "Bearer");
    let expires_in = body["expires_in"]
        .as_u64()
        .expect("expires_in is an integer");
    assert!(expires_in > 3000);
    let gcp = stack.gcp.as_ref().unwrap();
    assert_eq!(
        gcp.stats.iam_issued.load(Ordering::Relaxed),
        1,
        "impersonated via IAM"
    );

    let resp = get(
        &format!("{v1}/identity?audience=https://svc.example&format=full"),
        true,
    )
    .await;
    assert_eq!(resp.status(), 200);
    let jwt = resp.text().await.unwrap();
    let claims: Value = jsonwebtoken::dangerous::insecure_decode_claims(&jwt).unwrap();
    assert_eq!(claims["aud"], "https://svc.example");
    assert_eq!(claims["email"], SA);
    let resp = get(&format!("{v1}/identity?audience=https://svc.example"), true).await;
    let claims: Value =
        jsonwebtoken::dangerous::insecure_decode_claims(resp.text().await.unwrap()).unwrap();
    assert!(
        claims.get("email").is_none(),
        "format=standard has no email"
    );

    let resp = get(&format!("{v1}/identity"), true).await;
    assert_eq!(resp.status(), 400);
    let resp = get(&format!("{v1}/identity?audience=x&format=weird"), true).await;
    assert_eq!(resp.status(), 400);
    stack.stop().await;
}

#[tokio::test]
async fn other_service_accounts_are_not_found() {
    let (stack, base) = dev_stack().await;
    for account in [
        "admin@lanyard-dev.iam.gserviceaccount.com",
        "lanyard-dev.svc.id.goog",
    ] {
        let resp = get(
            &format!("{base}/computeMetadata/v1/instance/service-accounts/{account}/token"),
            true,
        )
        .await;
        assert_eq!(resp.status(), 404, "{account}");
        assert!(!resp.text().await.unwrap().contains("access_token"));
    }
    let gcp = stack.gcp.as_ref().unwrap();
    assert_eq!(gcp.stats.sts_requests.load(Ordering::Relaxed), 0);
    stack.stop().await;
}
