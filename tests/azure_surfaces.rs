//! Azure IMDS and App Service surfaces over real HTTP: success bodies in
//! the exact shape the SDKs parse, and every refusal with the right status
//! and the surface's own error format.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use lanyard_emulators::{Issuer, SigningKey};
use serde_json::Value;
use support::*;

const IMDS: &str = "/metadata/identity/oauth2/token";
const MSI: &str = "/msi/token";
const RESOURCE: &str = "https://storage.azure.com/";

async fn stack() -> (Upstreams, String) {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    let base = surfaces(&up, p, &[bound_dev_account()]).await;
    (up, base)
}

async fn imds(base: &str, query: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    get(&format!("{base}{IMDS}?{query}"), headers).await
}

async fn get(url: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let mut req = reqwest::Client::new().get(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn q(extra: &str) -> String {
    format!(
        "api-version=2018-02-01&resource={}{extra}",
        urlencode(RESOURCE)
    )
}

fn urlencode(s: &str) -> String {
    url::form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

#[tokio::test]
async fn imds_success_has_all_string_fields() {
    let (_up, base) = stack().await;
    let (status, body) = imds(&base, &q(""), &[("Metadata", "true")]).await;
    assert_eq!(status, 200, "{body}");
    for field in support::IMDS_TOKEN_FIELDS {
        assert!(body[field].is_string(), "{field} must be a string: {body}");
    }
    assert_eq!(body["client_id"], CLIENT);
    assert_eq!(body["resource"], RESOURCE);
    assert_eq!(body["token_type"], "Bearer");
    let expires_in: u64 = body["expires_in"].as_str().unwrap().parse().unwrap();
    assert!((3590..=3600).contains(&expires_in), "{expires_in}");
    let expires_on: u64 = body["expires_on"].as_str().unwrap().parse().unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(expires_on > now + 3500);
}

#[tokio::test]
async fn imds_selectors_for_the_bound_identity_work() {
    let (_up, base) = stack().await;
    for sel in [
        format!("&client_id={CLIENT}"),
        format!("&object_id={OBJECT}"),
    ] {
        let (status, body) = imds(&base, &q(&sel), &[("Metadata", "true")]).await;
        assert_eq!(status, 200, "{sel}: {body}");
        assert_eq!(body["client_id"], CLIENT);
    }
}

#[tokio::test]
async fn imds_unbound_selector_is_identity_not_found_never_a_token() {
    let (up, base) = stack().await;
    for sel in [
        "&client_id=99999999-9999-9999-9999-999999999999",
        "&object_id=99999999-9999-9999-9999-999999999999",
        "&msi_res_id=/subscriptions/x/resourceGroups/y/providers/Microsoft.ManagedIdentity/userAssignedIdentities/z",
    ] {
        let (status, body) = imds(&base, &q(sel), &[("Metadata", "true")]).await;
        assert_eq!(status, 400, "{sel}");
        assert_eq!(body["error"], "invalid_request");
        assert_eq!(body["error_description"], "Identity not found");
        assert!(body.get("access_token").is_none());
    }
    // Refused before any upstream call.
    assert_eq!(
        up.entra
            .stats
            .requests
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn imds_requires_metadata_header() {
    let (_up, base) = stack().await;
    for headers in [&[][..], &[("Metadata", "false")][..]] {
        let (status, body) = imds(&base, &q(""), headers).await;
        assert_eq!(status, 400);
        assert_eq!(body["error"], "invalid_request");
        assert_eq!(
            body["error_description"],
            "Required metadata header not specified"
        );
    }
}

#[tokio::test]
async fn imds_refuses_forwarded_requests() {
    let (_up, base) = stack().await;
    for h in [
        ("X-Forwarded-For", "10.0.0.1"),
        ("Forwarded", "for=10.0.0.1"),
    ] {
        let (status, body) = imds(&base, &q(""), &[("Metadata", "true"), h]).await;
        assert_eq!(status, 400, "{h:?}");
        assert_eq!(body["error"], "invalid_request");
        assert!(body.get("access_token").is_none());
    }
}

#[tokio::test]
async fn imds_request_validation() {
    let (_up, base) = stack().await;
    let cases = [
        (format!("resource={}", urlencode(RESOURCE)), "api-version"),
        ("api-version=2018-02-01".to_string(), "audience"),
        (
            q(&format!("&client_id={CLIENT}&object_id={OBJECT}")),
            "Only one",
        ),
        (
            q(&format!("&client_id={CLIENT}&client_id=other")),
            "more than once",
        ),
    ];
    for (query, expect) in cases {
        let (status, body) = imds(&base, &query, &[("Metadata", "true")]).await;
        assert_eq!(status, 400, "{query}");
        assert!(
            body["error_description"].as_str().unwrap().contains(expect),
            "{query}: {body}"
        );
    }
    let resp = reqwest::Client::new()
        .post(format!("{base}{IMDS}?{}", q("")))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 405);
    let (status, _) = get(
        &format!("{base}/metadata/instance"),
        &[("Metadata", "true")],
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn app_service_success_and_header_check() {
    let (_up, base) = stack().await;
    let query = format!("api-version=2019-08-01&resource={}", urlencode(RESOURCE));
    let url = format!("{base}{MSI}?{query}");
    let (status, body) = get(&url, &[("X-IDENTITY-HEADER", IDENTITY_HEADER)]).await;
    assert_eq!(status, 200, "{body}");
    for field in [
        "access_token",
        "client_id",
        "expires_on",
        "not_before",
        "resource",
        "token_type",
    ] {
        assert!(body[field].is_string(), "{field}: {body}");
    }
    for bad in [
        &[][..],
        &[("X-IDENTITY-HEADER", "wrong")][..],
        &[("X-IDENTITY-HEADER", "test-identity-header-secre")][..],
    ] {
        let (status, body) = get(&url, bad).await;
        assert_eq!(status, 401, "{bad:?}");
        assert_eq!(body["statusCode"], 401);
        assert!(body["message"]
            .as_str()
            .unwrap()
            .contains("X-IDENTITY-HEADER"));
        assert!(body["correlationId"].is_string());
        assert!(body.get("access_token").is_none());
    }
    let (status, _) = get(
        &url,
        &[
            ("X-IDENTITY-HEADER", IDENTITY_HEADER),
            ("X-Forwarded-For", "1.2.3.4"),
        ],
    )
    .await;
    assert_eq!(status, 400);
    let (status, body) = get(
        &format!("{url}&client_id=99999999-9999-9999-9999-999999999999"),
        &[("X-IDENTITY-HEADER", IDENTITY_HEADER)],
    )
    .await;
    assert_eq!(status, 400);
    assert!(body["message"]
        .as_str()
        .unwrap()
        .contains("Identity not found"));
}

#[tokio::test]
async fn service_account_without_binding_is_identity_not_found() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    let base = surfaces(&up, p, &[service_account("default", "ray-worker", &[])]).await;
    let (status, body) = imds(&base, &q(""), &[("Metadata", "true")]).await;
    assert_eq!(status, 400);
    assert_eq!(body["error_description"], "Identity not found");
}

#[tokio::test]
async fn upstream_rejection_surfaces_the_aadsts_code() {
    // Entra federates a different subject, so the exchange is refused.
    let p = pod();
    let up = upstreams(
        "system:serviceaccount:default:someone-else",
        Duration::from_secs(3600),
    )
    .await;
    let base = surfaces(&up, p, &[bound_dev_account()]).await;
    let (status, body) = imds(&base, &q(""), &[("Metadata", "true")]).await;
    assert_eq!(status, 403);
    assert_eq!(body["error"], "unauthorized_client");
    assert!(
        body["error_description"]
            .as_str()
            .unwrap()
            .contains("AADSTS700213"),
        "{body}"
    );
}

#[tokio::test]
async fn pod_token_from_another_issuer_is_refused_before_upstream() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    // Same issuer URL, different key: a forged projected token.
    let rogue = Arc::new(Issuer::new(
        up.issuer.url(),
        SigningKey::generate_rs256().unwrap(),
    ));
    let base = surfaces_with_issuer(&up, rogue, p, &[bound_dev_account()]).await;
    let (status, body) = imds(&base, &q(""), &[("Metadata", "true")]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body["error_description"]
        .as_str()
        .unwrap()
        .contains("refused"));
    assert_eq!(
        up.entra
            .stats
            .requests
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[tokio::test]
async fn unreachable_entra_is_retryable_5xx() {
    let p = pod();
    let mut up = upstreams(&p.subject(), Duration::from_secs(3600)).await;
    up.entra_url = "http://127.0.0.1:9".into();
    let base = surfaces(&up, p, &[bound_dev_account()]).await;
    let (status, body) = imds(&base, &q(""), &[("Metadata", "true")]).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"], "temporarily_unavailable");
}

#[tokio::test]
async fn app_service_2017_protocol_takes_its_secret_header_and_clientid() {
    let (_up, base) = stack().await;
    let url = format!(
        "{base}{MSI}?api-version=2017-09-01&resource={}",
        urlencode(RESOURCE)
    );
    for query in ["", &format!("&clientid={CLIENT}")] {
        let (status, body) = get(&format!("{url}{query}"), &[("secret", IDENTITY_HEADER)]).await;
        assert_eq!(status, 200, "{query}: {body}");
        for field in ["access_token", "expires_on", "resource", "token_type"] {
            assert!(body[field].is_string(), "{field}: {body}");
        }
        assert_eq!(body["resource"], RESOURCE);
        assert_eq!(body["token_type"], "Bearer");
        // Unix seconds, which every SDK that speaks 2017 reads.
        let expires_on: u64 = body["expires_on"].as_str().unwrap().parse().unwrap();
        assert!(expires_on > 1_700_000_000, "{body}");
        assert!(body.get("not_before").is_none(), "{body}");
    }
    // The 2019 header does not authorize a 2017 request, nor the reverse.
    for (bad, names) in [
        (vec![("X-IDENTITY-HEADER", IDENTITY_HEADER)], "secret"),
        (vec![("secret", "wrong")], "secret"),
        (vec![], "MSI_SECRET"),
    ] {
        let (status, body) = get(&url, &bad).await;
        assert_eq!(status, 401, "{bad:?}: {body}");
        assert!(body["message"].as_str().unwrap().contains(names), "{body}");
        assert!(body.get("access_token").is_none());
    }
    let (status, _) = get(
        &url.replace("2017-09-01", "2019-08-01"),
        &[("secret", IDENTITY_HEADER)],
    )
    .await;
    assert_eq!(status, 401);
    // Only a client id selects, and only the bound one.
    let (status, body) = get(
        &format!("{url}&client_id={CLIENT}"),
        &[("secret", IDENTITY_HEADER)],
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["message"].as_str().unwrap().contains("clientid"),
        "{body}"
    );
    let (status, body) = get(
        &format!("{url}&clientid=99999999-9999-9999-9999-999999999999"),
        &[("secret", IDENTITY_HEADER)],
    )
    .await;
    assert_eq!(status, 400);
    assert!(body["message"]
        .as_str()
        .unwrap()
        .contains("Identity not found"));
}

#[tokio::test]
async fn token_paths_as_clients_spell_them() {
    let (_up, base) = stack().await;
    // msal-node lower-cases the URL and appends a slash; NMI matched
    // `metadata` in any case.
    for path in [
        "/metadata/identity/oauth2/token/",
        "/Metadata/identity/oauth2/token",
    ] {
        let (status, body) = get(&format!("{base}{path}?{}", q("")), &[("Metadata", "true")]).await;
        assert_eq!(status, 200, "{path}: {body}");
        assert!(body["access_token"].is_string());
        // Still the same checks on the other spelling.
        let (status, body) = get(&format!("{base}{path}?{}", q("")), &[]).await;
        assert_eq!(status, 400, "{path}");
        assert_eq!(body["error"], "invalid_request");
    }
    let (status, body) = get(
        &format!(
            "{base}{MSI}/?api-version=2019-08-01&resource={}",
            urlencode(RESOURCE)
        ),
        &[("X-IDENTITY-HEADER", IDENTITY_HEADER)],
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let resp = reqwest::Client::new()
        .post(format!("{base}/metadata/identity/oauth2/token/?{}", q("")))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 405);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"], "invalid_request");
}

#[tokio::test]
async fn unknown_paths_fail_fast_in_each_surfaces_shape() {
    let (_up, base) = stack().await;
    // MSAL's newer managed-identity probes find the feature absent, as on
    // an IMDS without it: 404, which sends MSAL to the token endpoint.
    for path in [
        "/metadata/identity/getplatformmetadata?cred-api-version=2.0",
        "/metadata/identity/issuecredential?cred-api-version=2.0",
        "/metadata/instance?api-version=2021-02-01",
    ] {
        let (status, body) = get(&format!("{base}{path}"), &[("Metadata", "true")]).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["error"], "not_found", "{path}: {body}");
        assert!(body["error_description"]
            .as_str()
            .unwrap()
            .contains("/metadata/identity/oauth2/token"));
    }
    let (status, body) = get(&format!("{base}/msi/other"), &[]).await;
    assert_eq!(status, 404);
    assert_eq!(body["statusCode"], 404);
    assert!(body["correlationId"].is_string());
    let (status, body) = get(&format!("{base}/nowhere"), &[]).await;
    assert_eq!(status, 404);
    assert!(body["error_description"]
        .as_str()
        .unwrap()
        .contains("/computeMetadata/v1/"));
    // A long path is not echoed whole.
    let long = "a".repeat(4000);
    let (status, body) = get(&format!("{base}/{long}"), &[]).await;
    assert_eq!(status, 404);
    assert!(body.to_string().len() < 1000, "{}", body.to_string().len());
}

/// One cached token is rendered into several bodies (each surface keeps
/// the last body it sent on the credential): whichever was rendered last,
/// each request gets its own surface's, protocol's and resource's body.
#[tokio::test]
async fn one_cached_token_renders_each_surfaces_own_body() {
    let (up, base) = stack().await;
    let with_slash = RESOURCE;
    let without = RESOURCE.trim_end_matches('/');
    let imds_url = |resource: &str| {
        format!(
            "{base}{IMDS}?api-version=2018-02-01&resource={}",
            urlencode(resource)
        )
    };
    let msi_url = |version: &str, resource: &str| {
        format!(
            "{base}{MSI}?api-version={version}&resource={}",
            urlencode(resource)
        )
    };
    let mut tokens = std::collections::BTreeSet::new();
    for round in 0..3 {
        // Each surface asked with both spellings in a row, so that a body
        // kept for one spelling is there when the other asks.
        for resource in [with_slash, without] {
            let (status, body) = get(&imds_url(resource), &[("Metadata", "true")]).await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["resource"], resource, "round {round}: {body}");
            assert!(body["ext_expires_in"].is_string(), "{body}");
            tokens.insert(body["access_token"].as_str().unwrap().to_string());
        }
        for resource in [with_slash, without] {
            let (status, body) = get(
                &msi_url("2019-08-01", resource),
                &[("X-IDENTITY-HEADER", IDENTITY_HEADER)],
            )
            .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["resource"], resource, "round {round}: {body}");
            assert_eq!(body["client_id"], CLIENT);
            assert!(body.get("ext_expires_in").is_none(), "{body}");
            assert!(body["not_before"].is_string(), "{body}");
            tokens.insert(body["access_token"].as_str().unwrap().to_string());
        }
        for resource in [with_slash, without] {
            let (status, body) = get(
                &msi_url("2017-09-01", resource),
                &[("secret", IDENTITY_HEADER)],
            )
            .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["resource"], resource, "round {round}: {body}");
            assert!(body.get("not_before").is_none(), "{body}");
            tokens.insert(body["access_token"].as_str().unwrap().to_string());
        }
    }
    // Both spellings name one scope: one exchange, one token.
    assert_eq!(tokens.len(), 1, "{tokens:?}");
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 1);
}
