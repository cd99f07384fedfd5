//! Verifier tests against a live built-in issuer on loopback.

use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::http::{bind, spawn_server, Shutdown};
use lanyard_emulators::{Issuer, PodIdentity, SigningKey};

const AUD: &str = "api://AzureADTokenExchange";

struct Fixture {
    issuer: Arc<Issuer>,
    verifier: Verifier,
    pod: PodIdentity,
    /// Takes the issuer down (its discovery document and keys).
    issuer_down: crate::http::ShutdownTrigger,
}

async fn fixture(key: SigningKey) -> Fixture {
    fixture_with(key, |keys| keys).await
}

/// A fixture whose key set `configure` adjusts (the refetch interval is
/// 200 ms before it does).
async fn fixture_with(key: SigningKey, configure: impl FnOnce(KeySet) -> KeySet) -> Fixture {
    let (trigger, shutdown) = Shutdown::new();
    let listener = bind("127.0.0.1:0".parse().unwrap(), "issuer")
        .await
        .unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let issuer = Arc::new(Issuer::new(url.clone(), key));
    spawn_server(listener, issuer.router(), shutdown);
    let verifier = Verifier::new(
        url.clone(),
        configure(
            KeySet::new(KeySource::Discovery { issuer: url }, crate::http::client())
                .with_refetch_interval(Duration::from_millis(200)),
        ),
    );
    Fixture {
        issuer,
        verifier,
        pod: PodIdentity::new("default", "ray-worker", "ray-worker-0", "node-a"),
        issuer_down: trigger,
    }
}

fn hour() -> Duration {
    Duration::from_secs(3600)
}

#[tokio::test]
async fn accepts_rs256_token_and_returns_caller() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let token = f.issuer.mint(&f.pod, &[AUD, "other"], hour()).unwrap();
    let caller = f.verifier.verify(&token, AUD).await.unwrap();
    assert_eq!(caller.namespace, "default");
    assert_eq!(caller.service_account, "ray-worker");
    assert_eq!(caller.pod.as_ref().unwrap().name, "ray-worker-0");
    assert_eq!(caller.node.as_ref().unwrap().name, "node-a");
    assert_eq!(caller.token_fingerprint, crate::secret::fingerprint(&token));
}

#[tokio::test]
async fn accepts_es256_token() {
    let f = fixture(SigningKey::generate_es256().unwrap()).await;
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    assert!(f.verifier.verify(&token, AUD).await.is_ok());
}

#[tokio::test]
async fn refuses_wrong_audience() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let token = f
        .issuer
        .mint(&f.pod, &["sts.amazonaws.com"], hour())
        .unwrap();
    let err = f.verifier.verify(&token, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Audience { .. }), "{err:?}");
}

#[tokio::test]
async fn refuses_expired_and_future_tokens() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.iat -= 7200;
    claims.nbf = Some(claims.iat);
    claims.exp = claims.iat + 600;
    let expired = f.issuer.sign(&claims).unwrap();
    let err = f.verifier.verify(&expired, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Expired), "{err:?}");

    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.nbf = Some(claims.iat + 600);
    let future = f.issuer.sign(&claims).unwrap();
    let err = f.verifier.verify(&future, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::NotYetValid), "{err:?}");
}

#[tokio::test]
async fn tolerates_small_clock_skew() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.nbf = Some(claims.iat + 10);
    claims.exp = jsonwebtoken::get_current_timestamp() - 10;
    let token = f.issuer.sign(&claims).unwrap();
    assert!(f.verifier.verify(&token, AUD).await.is_ok());
}

#[tokio::test]
async fn refuses_wrong_issuer() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.iss = "https://evil.example".into();
    let token = f.issuer.sign(&claims).unwrap();
    let err = f.verifier.verify(&token, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Issuer { .. }), "{err:?}");
}

#[tokio::test]
async fn refuses_token_signed_by_another_key_with_same_kid() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let other = SigningKey::generate_rs256().unwrap();
    let claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    let forged = other.sign_with_kid(&claims, f.issuer.key().kid()).unwrap();
    let err = f.verifier.verify(&forged, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Signature), "{err:?}");
}

#[tokio::test]
async fn unknown_kid_refetches_at_most_once_per_interval() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let other = SigningKey::generate_rs256().unwrap();
    let claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    let forged = other.sign(&claims).unwrap();
    // Prime the cache with a good token.
    let good = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    f.verifier.verify(&good, AUD).await.unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let err = f.verifier.verify(&forged, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::UnknownKey), "{err:?}");
    // Immediately again: refused from cache without a refetch storm.
    let err = f.verifier.verify(&forged, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::UnknownKey), "{err:?}");
}

#[tokio::test]
async fn refuses_hmac_and_none_algorithms() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    let hs = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(b"secret").unwrap(),
    )
    .unwrap();
    assert!(matches!(
        f.verifier.verify(&hs, AUD).await.unwrap_err(),
        VerifyError::Algorithm(_)
    ));
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(s);
    let none = format!(
        "{}.{}.",
        b64(r#"{"alg":"none","typ":"JWT"}"#),
        b64(&serde_json::to_string(&claims).unwrap())
    );
    let err = f.verifier.verify(&none, AUD).await.unwrap_err();
    assert!(
        matches!(err, VerifyError::Malformed | VerifyError::Algorithm(_)),
        "{err:?}"
    );
}

#[tokio::test]
async fn refuses_garbage_and_tampered_tokens() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    for junk in ["", "abc", "a.b.c", "....", "eyJ.eyJ.sig"] {
        let err = f.verifier.verify(junk, AUD).await.unwrap_err();
        assert!(matches!(err, VerifyError::Malformed), "{junk:?}: {err:?}");
    }
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let mut parts: Vec<String> = token.split('.').map(str::to_string).collect();
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.sub = "system:serviceaccount:kube-system:admin".into();
    claims.kubernetes.namespace = "kube-system".into();
    claims.kubernetes.serviceaccount.name = "admin".into();
    use base64::Engine;
    parts[1] = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .encode(serde_json::to_vec(&claims).unwrap());
    let tampered = parts.join(".");
    let err = f.verifier.verify(&tampered, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Signature), "{err:?}");
}

#[tokio::test]
async fn refuses_subject_that_disagrees_with_kubernetes_claim() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.sub = "system:serviceaccount:default:someone-else".into();
    let token = f.issuer.sign(&claims).unwrap();
    assert!(matches!(
        f.verifier.verify(&token, AUD).await.unwrap_err(),
        VerifyError::Subject
    ));
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.sub = "user:alice".into();
    let token = f.issuer.sign(&claims).unwrap();
    assert!(matches!(
        f.verifier.verify(&token, AUD).await.unwrap_err(),
        VerifyError::Subject
    ));
}

#[tokio::test]
async fn unreachable_issuer_is_a_transient_key_error() {
    let verifier = Verifier::new(
        "http://127.0.0.1:9",
        KeySet::new(
            KeySource::Discovery {
                issuer: "http://127.0.0.1:9".into(),
            },
            crate::http::client(),
        ),
    );
    let key = SigningKey::generate_rs256().unwrap();
    let issuer = Issuer::new("http://127.0.0.1:9", key);
    let pod = PodIdentity::new("default", "sa", "p", "n");
    let token = issuer.mint(&pod, &[AUD], hour()).unwrap();
    let err = verifier.verify(&token, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Keys(_)), "{err:?}");
    assert!(err.is_transient());
}

/// Takes the fixture's issuer down and waits until it refuses connections.
async fn take_down(f: &Fixture) {
    f.issuer_down.trigger();
    let url = format!("{}/openid/v1/jwks", f.issuer.url());
    for _ in 0..100 {
        if crate::http::client().get(&url).send().await.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the issuer still answers after its shutdown");
}

#[tokio::test]
async fn keys_due_for_refresh_stay_in_use_while_the_issuer_is_down() {
    // Refresh due after 100 ms; kept for up to 30 s when it fails.
    let f = fixture_with(SigningKey::generate_rs256().unwrap(), |k| {
        k.with_ages(Duration::from_millis(100), Duration::from_secs(30))
    })
    .await;
    let first = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    f.verifier.verify(&first, AUD).await.unwrap();
    take_down(&f).await;
    tokio::time::sleep(Duration::from_millis(250)).await;
    // A token never seen (not from the memo), signed by the known key.
    let second = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let caller = f.verifier.verify(&second, AUD).await.unwrap();
    assert_eq!(
        caller.token_fingerprint,
        crate::secret::fingerprint(&second)
    );
    // Still refused: a token of another key, which the last keys do not
    // have and the issuer cannot be asked about — transient, not a verdict.
    let other = SigningKey::generate_rs256().unwrap();
    let forged = other
        .sign(&f.issuer.claims_for(&f.pod, &[AUD], hour()))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(250)).await;
    let err = f.verifier.verify(&forged, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Keys(_)), "{err:?}");
    assert!(err.is_transient());
}

#[tokio::test]
async fn keys_past_the_stale_limit_are_not_used() {
    let f = fixture_with(SigningKey::generate_rs256().unwrap(), |k| {
        k.with_ages(Duration::from_millis(50), Duration::from_millis(300))
    })
    .await;
    let first = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    f.verifier.verify(&first, AUD).await.unwrap();
    take_down(&f).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let second = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let err = f.verifier.verify(&second, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Keys(_)), "{err:?}");
}

#[tokio::test]
async fn a_failed_fetch_is_not_retried_within_the_refetch_interval() {
    let verifier = Verifier::new(
        "http://127.0.0.1:9",
        KeySet::new(
            KeySource::Jwks {
                url: "http://127.0.0.1:9/openid/v1/jwks".into(),
            },
            crate::http::client(),
        ),
    );
    let issuer = Issuer::new("http://127.0.0.1:9", SigningKey::generate_rs256().unwrap());
    let pod = PodIdentity::new("default", "sa", "p", "n");
    let err = |e: VerifyError| match e {
        VerifyError::Keys(k) => k.to_string(),
        other => panic!("{other:?}"),
    };
    let token = issuer.mint(&pod, &[AUD], hour()).unwrap();
    let first = err(verifier.verify(&token, AUD).await.unwrap_err());
    assert!(!first.contains("the last attempt failed"), "{first}");
    // Within the (default 10 s) interval: answered without a fetch.
    let token = issuer.mint(&pod, &[AUD], hour()).unwrap();
    let second = err(verifier.verify(&token, AUD).await.unwrap_err());
    assert!(second.contains("the last attempt failed"), "{second}");
}

#[tokio::test]
async fn remembered_verification_still_honours_audience_and_expiry() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    assert!(f.verifier.verify(&token, AUD).await.is_ok());
    assert!(
        f.verifier.verify(&token, AUD).await.is_ok(),
        "from the memo"
    );
    // The memo is per audience: the same token for another audience fails.
    let err = f
        .verifier
        .verify(&token, "sts.amazonaws.com")
        .await
        .unwrap_err();
    assert!(matches!(err, VerifyError::Audience { .. }), "{err:?}");
    // A token that expires is not honoured from the memo past its expiry.
    let mut claims = f.issuer.claims_for(&f.pod, &[AUD], hour());
    claims.exp = jsonwebtoken::get_current_timestamp() - LEEWAY_SECS + 1;
    let brief = f.issuer.sign(&claims).unwrap();
    assert!(f.verifier.verify(&brief, AUD).await.is_ok());
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let err = f.verifier.verify(&brief, AUD).await.unwrap_err();
    assert!(matches!(err, VerifyError::Expired), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_one_token_arriving_together_share_one_verification() {
    let f = Arc::new(fixture(SigningKey::generate_rs256().unwrap()).await);
    let token: Arc<str> = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap().into();
    // The keys are not fetched yet: all of them arrive before any
    // verification can finish.
    let herd: Vec<_> = (0..50)
        .map(|_| {
            let (f, token) = (f.clone(), token.clone());
            tokio::spawn(async move { f.verifier.verify(&token, AUD).await })
        })
        .collect();
    let mut callers = Vec::new();
    for task in herd {
        callers.push(task.await.unwrap().unwrap());
    }
    // One verification made one caller; each of its own would be another.
    assert!(
        callers.iter().all(|c| Arc::ptr_eq(c, &callers[0])),
        "verified more than once"
    );
    // Remembered afterwards.
    let again = f.verifier.verify(&token, AUD).await.unwrap();
    assert!(Arc::ptr_eq(&again, &callers[0]));

    // A refusal reaches every request that waited for it, and is not
    // remembered: the same token for the right audience still passes.
    let herd: Vec<_> = (0..20)
        .map(|_| {
            let (f, token) = (f.clone(), token.clone());
            tokio::spawn(async move { f.verifier.verify(&token, "sts.amazonaws.com").await })
        })
        .collect();
    for task in herd {
        let err = task.await.unwrap().unwrap_err();
        assert!(matches!(err, VerifyError::Audience { .. }), "{err:?}");
    }
}

#[tokio::test]
async fn a_cancelled_verification_is_taken_over_by_one_waiting_for_it() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let mut leader = Box::pin(f.verifier.verify(&token, AUD));
    // Polled once: it leads, and waits for the issuer's keys.
    assert!(futures::poll!(leader.as_mut()).is_pending());
    let mut follower = Box::pin(f.verifier.verify(&token, AUD));
    assert!(futures::poll!(follower.as_mut()).is_pending());
    // Its client went away.
    drop(leader);
    let caller = tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the follower waited for a leader that is gone")
        .unwrap();
    assert_eq!(caller.service_account, "ray-worker");
}

#[tokio::test]
async fn a_lookup_cancelled_during_the_first_fetch_does_not_hold_up_the_next() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let mut first = Box::pin(f.verifier.verify(&token, AUD));
    // It starts the first fetch of the issuer's keys, then goes away.
    assert!(futures::poll!(first.as_mut()).is_pending());
    drop(first);
    // The fetch it started finishes and counts: the next request, within
    // the refetch interval, is not told that the last attempt failed.
    let caller = f.verifier.verify(&token, AUD).await.unwrap();
    assert_eq!(caller.service_account, "ray-worker");
}

#[tokio::test]
async fn preloaded_keys_verify_the_first_token_without_a_fetch() {
    let f = fixture(SigningKey::generate_rs256().unwrap()).await;
    let url = f.issuer.url().to_string();
    let keys = KeySet::new(
        KeySource::Discovery {
            issuer: url.clone(),
        },
        crate::http::client(),
    );
    keys.preload().await.unwrap();
    // The issuer goes away: the first token is verified with what was
    // loaded at start.
    take_down(&f).await;
    let verifier = Verifier::new(url, keys);
    let token = f.issuer.mint(&f.pod, &[AUD], hour()).unwrap();
    let caller = verifier.verify(&token, AUD).await.unwrap();
    assert_eq!(caller.service_account, "ray-worker");
}
