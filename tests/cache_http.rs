//! The cache through real HTTP against the emulators: herds of concurrent
//! SDK-style requests cost one upstream exchange per identity, and the
//! admin port's metrics say so.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use support::{dev_stack, export};

/// Sum of a metric's samples whose label text contains `labels`.
fn metric(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn herd(urls: Vec<(String, Vec<(&'static str, String)>)>) -> Vec<String> {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for (url, headers) in urls {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut req = client.get(url);
            for (k, v) in headers {
                req = req.header(k, v);
            }
            let resp = req.send().await.unwrap();
            assert_eq!(resp.status(), 200);
            resp.text().await.unwrap()
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn herds_cost_one_exchange_per_identity() {
    let (stack, _) = dev_stack().await;
    let azure = format!(
        "{}/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F",
        export(&stack, "AZURE_POD_IDENTITY_AUTHORITY_HOST")
    );
    let bodies = herd(
        (0..300)
            .map(|_| (azure.clone(), vec![("Metadata", "true".to_string())]))
            .collect(),
    )
    .await;
    let tokens: std::collections::HashSet<String> = bodies
        .iter()
        .map(|b| {
            serde_json::from_str::<serde_json::Value>(b).unwrap()["access_token"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(tokens.len(), 1);
    let entra = stack.entra.as_ref().unwrap();
    assert_eq!(entra.stats.issued.load(Ordering::Relaxed), 1);
    assert_eq!(entra.stats.requests.load(Ordering::Relaxed), 1);

    // Another resource is another entry: one more exchange.
    let vault = azure.replace("storage.azure.com", "vault.azure.net");
    herd(
        (0..50)
            .map(|_| (vault.clone(), vec![("Metadata", "true".to_string())]))
            .collect(),
    )
    .await;
    assert_eq!(entra.stats.issued.load(Ordering::Relaxed), 2);

    let gce = format!(
        "http://{}/computeMetadata/v1/instance/service-accounts/default/token",
        export(&stack, "GCE_METADATA_HOST")
    );
    herd(
        (0..200)
            .map(|_| (gce.clone(), vec![("Metadata-Flavor", "Google".to_string())]))
            .collect(),
    )
    .await;
    let gcp = stack.gcp.as_ref().unwrap();
    assert_eq!(gcp.stats.sts_issued.load(Ordering::Relaxed), 1);
    assert_eq!(gcp.stats.iam_issued.load(Ordering::Relaxed), 1);

    let container = export(&stack, "AWS_CONTAINER_CREDENTIALS_FULL_URI").to_string();
    let token =
        std::fs::read_to_string(export(&stack, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")).unwrap();
    herd(
        (0..200)
            .map(|_| {
                (
                    container.clone(),
                    vec![("Authorization", token.trim().to_string())],
                )
            })
            .collect(),
    )
    .await;
    let aws = stack.aws.as_ref().unwrap();
    assert_eq!(aws.stats.issued.load(Ordering::Relaxed), 1);

    let text = reqwest::get(format!("http://{}/metrics", stack.admin_addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(
            &text,
            "lanyard_upstream_requests_total",
            "cloud=\"azure\",outcome=\"ok\""
        ),
        2.0,
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "lanyard_upstream_requests_total",
            "cloud=\"gcp\",outcome=\"ok\""
        ),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "lanyard_upstream_requests_total",
            "cloud=\"aws\",outcome=\"ok\""
        ),
        1.0
    );
    let azure_requests = metric(&text, "lanyard_cache_hits_total", "cloud=\"azure\"")
        + metric(&text, "lanyard_cache_misses_total", "cloud=\"azure\"")
        + metric(&text, "lanyard_cache_coalesced_total", "cloud=\"azure\"");
    assert_eq!(azure_requests, 350.0, "every request accounted for");
    assert_eq!(metric(&text, "lanyard_cache_entries", ""), 4.0);
    assert!(text.contains("lanyard_upstream_latency_seconds_bucket"));

    let health = reqwest::get(format!("http://{}/healthz", stack.admin_addr))
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let ready = reqwest::get(format!("http://{}/readyz", stack.admin_addr))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    stack.stop().await;
}
