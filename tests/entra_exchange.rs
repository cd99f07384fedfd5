//! The Azure exchanger against the validating Entra emulator: success and
//! every refusal, each surfacing as a typed error with its AADSTS code.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;
use std::time::Duration;

use lanyard::cloud::azure::{AzureExchanger, AzureRequest};
use lanyard::cloud::CloudError;
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard_emulators::entra::FEDERATION_AUDIENCE;
use lanyard_emulators::SigningKey;
use support::*;

const SCOPE: &str = "https://storage.azure.com/.default";

async fn exchange(
    up: &Upstreams,
    tenant: &str,
    client: &str,
    scope: &str,
    assertion: &str,
) -> Result<lanyard::cloud::AccessToken, CloudError> {
    let ex = AzureExchanger::new(lanyard::http::client(), up.entra_url.clone());
    ex.exchange(&AzureRequest {
        tenant_id: tenant,
        client_id: client,
        scope,
        assertion: &SecretString::from(assertion.to_string()),
    })
    .await
}

/// The pod's token for Entra's federation audience, valid an hour.
fn federation_token(up: &Upstreams, p: &lanyard_emulators::PodIdentity) -> String {
    up.issuer
        .mint(p, &[FEDERATION_AUDIENCE], Duration::from_secs(3600))
        .unwrap()
}

/// The code of `assertion`'s refusal, which must be final (not worth a
/// retry).
async fn refusal(up: &Upstreams, assertion: &str) -> String {
    let err = exchange(up, TENANT, CLIENT, SCOPE, assertion)
        .await
        .unwrap_err();
    assert!(!err.is_retryable());
    code(err)
}

fn code(err: CloudError) -> String {
    match err {
        CloudError::Rejected { code, .. } => code,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

#[tokio::test]
async fn valid_assertion_gets_a_token() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let assertion = federation_token(&up, &p);
    let token = exchange(&up, TENANT, CLIENT, SCOPE, &assertion)
        .await
        .unwrap();
    // A JWT as Entra's v1 access tokens are, signed with a key the tenant's
    // JWKS publishes.
    let jwt = token.token.expose_secret();
    let header = jsonwebtoken::decode_header(jwt).unwrap();
    let jwks: jsonwebtoken::jwk::JwkSet =
        reqwest::get(format!("{}/{TENANT}/discovery/v2.0/keys", up.entra_url))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
    let jwk = jwks.find(header.kid.as_deref().unwrap()).unwrap();
    let mut validation = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::RS256);
    validation.set_audience(&["https://storage.azure.com"]);
    validation.set_issuer(&[format!("https://sts.windows.net/{TENANT}/")]);
    let claims = jsonwebtoken::decode::<serde_json::Value>(
        jwt,
        &jsonwebtoken::DecodingKey::from_jwk(jwk).unwrap(),
        &validation,
    )
    .unwrap()
    .claims;
    assert_eq!(claims["tid"], TENANT);
    assert_eq!(claims["appid"], CLIENT);
    assert_eq!(claims["ver"], "1.0");
    assert_eq!(claims["sub"], claims["oid"]);
    // Another key does not verify it.
    let other = SigningKey::generate_rs256().unwrap();
    let other: jsonwebtoken::jwk::Jwk = serde_json::from_value(other.jwk().clone()).unwrap();
    assert!(jsonwebtoken::decode::<serde_json::Value>(
        jwt,
        &jsonwebtoken::DecodingKey::from_jwk(&other).unwrap(),
        &validation,
    )
    .is_err());
    assert!(
        token.expires_at >= token.issued_at + 1799 && token.expires_at <= token.issued_at + 1801
    );
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn subject_without_federated_credential_is_aadsts700213() {
    let p = pod();
    let up = upstreams("system:serviceaccount:other:sa", Duration::from_secs(1800)).await;
    let assertion = federation_token(&up, &p);
    assert_eq!(refusal(&up, &assertion).await, "AADSTS700213");
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 0);
}

/// A federated credential added just now is not honoured until it has
/// propagated (Learn: "may fail … because the cache is populated in the
/// directory with old data"): the same assertion is refused as matching
/// no record, then accepted.
#[tokio::test]
async fn a_new_federated_credential_is_refused_until_it_has_propagated() {
    let p = pod();
    let up = upstreams("system:serviceaccount:other:sa", Duration::from_secs(1800)).await;
    let credential = lanyard_emulators::entra::FederatedCredential {
        issuer: up.issuer.url().to_string(),
        subject: p.subject(),
        audience: FEDERATION_AUDIENCE.to_string(),
    };
    let propagation = Duration::from_millis(1500);
    assert!(up
        .entra
        .add_federated_credential(CLIENT, credential.clone(), propagation));
    assert!(!up
        .entra
        .add_federated_credential("no-such-app", credential, propagation));
    let assertion = federation_token(&up, &p);
    assert_eq!(refusal(&up, &assertion).await, "AADSTS700213");
    tokio::time::sleep(propagation + Duration::from_millis(100)).await;
    exchange(&up, TENANT, CLIENT, SCOPE, &assertion)
        .await
        .expect("honoured once propagated");
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 1);
}

/// A subject that differs only in case: Entra has matched subjects
/// case-sensitively since September 2024, and says so (AADSTS7002138).
#[tokio::test]
async fn a_subject_differing_in_case_is_aadsts7002138() {
    let p = pod();
    let up = upstreams(&p.subject().to_uppercase(), Duration::from_secs(1800)).await;
    let assertion = federation_token(&up, &p);
    let err = exchange(&up, TENANT, CLIENT, SCOPE, &assertion)
        .await
        .unwrap_err();
    let text = err.to_string();
    assert_eq!(code(err), "AADSTS7002138");
    assert!(
        text.contains("case-insensitive comparison, but not with case-sensitive"),
        "{text}"
    );
}

#[tokio::test]
async fn wrong_audience_is_aadsts700212() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let assertion = up
        .issuer
        .mint(&p, &["sts.amazonaws.com"], Duration::from_secs(3600))
        .unwrap();
    let err = exchange(&up, TENANT, CLIENT, SCOPE, &assertion)
        .await
        .unwrap_err();
    assert_eq!(code(err), "AADSTS700212");
}

#[tokio::test]
async fn expired_assertion_is_aadsts700024() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let mut claims = up
        .issuer
        .claims_for(&p, &[FEDERATION_AUDIENCE], Duration::from_secs(600));
    claims.iat -= 7200;
    claims.nbf = Some(claims.iat);
    claims.exp = claims.iat + 600;
    let assertion = up.issuer.sign(&claims).unwrap();
    let err = exchange(&up, TENANT, CLIENT, SCOPE, &assertion)
        .await
        .unwrap_err();
    assert_eq!(code(err), "AADSTS700024");
}

#[tokio::test]
async fn assertion_signed_by_unknown_key_fails_signature_validation() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let claims = up
        .issuer
        .claims_for(&p, &[FEDERATION_AUDIENCE], Duration::from_secs(600));
    let rogue = SigningKey::generate_rs256().unwrap();
    // A key the issuer never published (Entra names its kid)…
    let unknown_kid = rogue.sign(&claims).unwrap();
    let err = exchange(&up, TENANT, CLIENT, SCOPE, &unknown_kid)
        .await
        .unwrap_err();
    assert_eq!(code(err), "AADSTS7000272");
    // …and one that claims the issuer's kid.
    let forged = rogue.sign_with_kid(&claims, up.issuer.key().kid()).unwrap();
    let err = exchange(&up, TENANT, CLIENT, SCOPE, &forged)
        .await
        .unwrap_err();
    assert_eq!(code(err), "AADSTS50013");
    assert_eq!(up.entra.stats.issued.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn malformed_assertion_is_aadsts50027() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    for junk in ["not-a-jwt", "a.b.c", "eyJhbGciOiJSUzI1NiJ9.e30.sig"] {
        let err = exchange(&up, TENANT, CLIENT, SCOPE, junk)
            .await
            .unwrap_err();
        assert_eq!(code(err), "AADSTS50027", "{junk}");
    }
}

#[tokio::test]
async fn unknown_client_is_aadsts700016_and_unknown_tenant_aadsts90002() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let assertion = federation_token(&up, &p);
    let err = exchange(
        &up,
        TENANT,
        "00000000-0000-0000-0000-000000000000",
        SCOPE,
        &assertion,
    )
    .await
    .unwrap_err();
    assert_eq!(code(err), "AADSTS700016");
    let err = exchange(&up, "not-a-tenant", CLIENT, SCOPE, &assertion)
        .await
        .unwrap_err();
    assert_eq!(code(err), "AADSTS90002");
}

#[tokio::test]
async fn scope_without_default_suffix_is_refused() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let assertion = federation_token(&up, &p);
    let err = exchange(
        &up,
        TENANT,
        CLIENT,
        "https://storage.azure.com/user_impersonation",
        &assertion,
    )
    .await
    .unwrap_err();
    assert_eq!(code(err), "AADSTS1002012");
}

#[tokio::test]
async fn error_bodies_have_entras_shape() {
    let p = pod();
    let up = upstreams(&p.subject(), Duration::from_secs(1800)).await;
    let resp = reqwest::Client::new()
        .post(format!("{}/{TENANT}/oauth2/v2.0/token", up.entra_url))
        .form(&[("grant_type", "password")])
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let body: serde_json::Value = resp.json().await.unwrap();
    assert_eq!(body["error"], "unsupported_grant_type");
    assert!(body["error_description"]
        .as_str()
        .unwrap()
        .starts_with("AADSTS70003: "));
    assert_eq!(body["error_codes"][0], 70003);
    for field in ["trace_id", "correlation_id", "timestamp"] {
        assert!(
            body[field].as_str().is_some_and(|v| !v.is_empty()),
            "{field}"
        );
    }
}

#[tokio::test]
async fn unreachable_authority_is_retryable() {
    let ex = AzureExchanger::new(lanyard::http::client(), "http://127.0.0.1:9");
    let err = ex
        .exchange(&AzureRequest {
            tenant_id: TENANT,
            client_id: CLIENT,
            scope: SCOPE,
            assertion: &SecretString::from("x".to_string()),
        })
        .await
        .unwrap_err();
    assert!(matches!(err, CloudError::Unavailable { .. }), "{err:?}");
    assert!(err.is_retryable());
}
