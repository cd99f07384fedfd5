//! What the SDK surfaces answer while a cloud's token service misbehaves:
//! errors (5xx, throttling with `Retry-After`), connections dropped
//! mid-answer, answers that never come, truncated bodies, slow answers.
//! Expected: no panic and no stuck request; a clear, retryable error in the
//! surface's own format with no credential in it; credentials already
//! cached keep flowing; the next request after the fault clears works.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lanyard::cloud::Cloud;
use lanyard::dev::DevStack;
use lanyard_emulators::faults::{Fault, Faults};
use support::{dev_stack, export};

// Every cloud, from the cloud table: a new cloud is in the fault tests
// without joining a list, and the matches below do not compile until they
// say how to reach its emulator.
const CLOUDS: [Cloud; Cloud::COUNT] = Cloud::ALL;

struct Answer {
    status: u16,
    retry_after: Option<String>,
    body: String,
}

impl Answer {
    /// The credential in a successful answer.
    fn credential(&self) -> String {
        let v: serde_json::Value = serde_json::from_str(&self.body).unwrap_or_default();
        ["access_token", "AccessKeyId"]
            .iter()
            .find_map(|k| v[k].as_str())
            .unwrap_or_else(|| panic!("no credential in {}", self.body))
            .to_string()
    }

    /// What every SDK retries: 503, or 429 with `Retry-After` (Lanyard
    /// answers a transient Entra code, AADSTS90033, as throttling so that
    /// callers back off).
    fn is_retryable(&self) -> bool {
        self.status == 503 || (self.status == 429 && self.retry_after.is_some())
    }

    fn has_no_credential(&self) -> bool {
        ![
            "access_token",
            "AccessKeyId",
            "SecretAccessKey",
            "ya29.",
            // Entra's access tokens are JWTs: base64url of `{"`.
            "eyJ",
        ]
        .iter()
        .any(|s| self.body.contains(s))
    }
}

fn faults(stack: &DevStack, cloud: Cloud) -> Arc<Faults> {
    match cloud {
        Cloud::Azure => stack.entra.as_ref().unwrap().faults.clone(),
        Cloud::Gcp => stack.gcp.as_ref().unwrap().faults.clone(),
        Cloud::Aws => stack.aws.as_ref().unwrap().faults.clone(),
    }
}

/// One SDK request for `cloud`; `variant` picks a distinct cache key where
/// the surface has one (resource, scopes), so each is a fresh exchange.
async fn ask(stack: &DevStack, base: &str, cloud: Cloud, variant: &str) -> Answer {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let req = match cloud {
        Cloud::Azure => http
            .get(format!("{base}/metadata/identity/oauth2/token"))
            .query(&[
                ("api-version", "2018-02-01"),
                ("resource", &format!("https://{variant}.vault.azure.net")),
            ])
            .header("Metadata", "true"),
        Cloud::Gcp => http
            .get(format!(
                "{base}/computeMetadata/v1/instance/service-accounts/default/token"
            ))
            .query(&[(
                "scopes",
                &format!("https://www.googleapis.com/auth/{variant}"),
            )])
            .header("Metadata-Flavor", "Google"),
        Cloud::Aws => {
            let file = export(stack, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE");
            let token = std::fs::read_to_string(file).unwrap();
            http.get(export(stack, "AWS_CONTAINER_CREDENTIALS_FULL_URI"))
                .header("Authorization", token.trim())
        }
    };
    let resp = req.send().await.expect("the surface answers");
    Answer {
        status: resp.status().as_u16(),
        retry_after: resp
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string()),
        body: resp.text().await.unwrap(),
    }
}

/// A fault on a cold key: a retryable error (see [`Answer::is_retryable`]),
/// no credential, answered within `bound`; and the key works once the
/// fault is cleared.
async fn cold_fault_then_recovery(fault: Fault, bound: Duration) {
    // The clouds side by side: each has a stack of its own.
    futures::future::join_all(CLOUDS.map(|cloud| one_cold_fault(cloud, fault.clone(), bound)))
        .await;
}

async fn one_cold_fault(cloud: Cloud, fault: Fault, bound: Duration) {
    let (stack, base) = dev_stack().await;
    let faults = faults(&stack, cloud);
    faults.push(fault.clone(), None);
    let started = Instant::now();
    let answer = ask(&stack, &base, cloud, "cold").await;
    let took = started.elapsed();
    assert!(
        answer.is_retryable(),
        "{cloud:?} {fault:?}: {} {}",
        answer.status,
        answer.body
    );
    assert!(answer.has_no_credential(), "{cloud:?}: {}", answer.body);
    assert!(took < bound, "{cloud:?} {fault:?}: answered after {took:?}");
    faults.clear();
    // Transient failures are not remembered as refusals: the next
    // request exchanges again (after any backoff the error asked for).
    let recovered = async {
        loop {
            let answer = ask(&stack, &base, cloud, "cold").await;
            if answer.status == 200 {
                return answer;
            }
            assert!(answer.is_retryable(), "{cloud:?}: {}", answer.body);
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let answer = tokio::time::timeout(Duration::from_secs(30), recovered)
        .await
        .unwrap_or_else(|_| panic!("{cloud:?} did not recover from {fault:?}"));
    assert!(!answer.credential().is_empty());
}

#[tokio::test]
async fn service_unavailable_is_retryable_and_recovers() {
    let fault = Fault::Status {
        status: 503,
        retry_after: None,
    };
    cold_fault_then_recovery(fault, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn internal_errors_are_retryable_and_recover() {
    let fault = Fault::Status {
        status: 500,
        retry_after: None,
    };
    cold_fault_then_recovery(fault, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn a_dropped_connection_is_retryable_and_recovers() {
    cold_fault_then_recovery(Fault::Drop, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn a_truncated_answer_is_retryable_and_recovers() {
    cold_fault_then_recovery(Fault::Truncated, Duration::from_secs(20)).await;
}

#[tokio::test]
async fn an_answer_that_never_comes_times_out_and_recovers() {
    // The outbound client's 15 s timeout ends it; nothing waits forever.
    cold_fault_then_recovery(Fault::Hang, Duration::from_secs(25)).await;
}

#[tokio::test]
async fn throttling_is_a_429_with_retry_after() {
    for cloud in CLOUDS {
        let (stack, base) = dev_stack().await;
        faults(&stack, cloud).push(
            Fault::Status {
                status: 429,
                retry_after: Some(7),
            },
            None,
        );
        let answer = ask(&stack, &base, cloud, "throttled").await;
        assert!(answer.has_no_credential(), "{cloud:?}: {}", answer.body);
        assert!(
            answer.status == 429 || answer.status == 503,
            "{cloud:?}: {} {}",
            answer.status,
            answer.body
        );
        let after: u64 = answer
            .retry_after
            .as_deref()
            .unwrap_or_else(|| panic!("{cloud:?}: no Retry-After on {}", answer.status))
            .parse()
            .unwrap();
        assert!((1..=60).contains(&after), "{cloud:?}: Retry-After {after}");
    }
}

#[tokio::test]
async fn cached_credentials_keep_flowing_while_the_cloud_is_down() {
    for cloud in CLOUDS {
        let (stack, base) = dev_stack().await;
        let warm = ask(&stack, &base, cloud, "warm").await;
        assert_eq!(warm.status, 200, "{cloud:?}: {}", warm.body);
        let faults = faults(&stack, cloud);
        faults.push(Fault::Hang, None);
        for _ in 0..3 {
            let started = Instant::now();
            let again = ask(&stack, &base, cloud, "warm").await;
            assert_eq!(again.status, 200, "{cloud:?}: {}", again.body);
            assert_eq!(again.credential(), warm.credential(), "{cloud:?}");
            assert!(started.elapsed() < Duration::from_secs(2), "{cloud:?}");
        }
        faults.clear();
    }
}

#[tokio::test]
async fn a_slow_cloud_still_costs_one_exchange_for_a_burst() {
    for cloud in CLOUDS {
        let (stack, base) = dev_stack().await;
        faults(&stack, cloud).push(Fault::Latency { ms: 300 }, None);
        let counts_before = issued(&stack, cloud);
        let started = Instant::now();
        let answers =
            futures::future::join_all((0..20).map(|_| ask(&stack, &base, cloud, "slow"))).await;
        let took = started.elapsed();
        let tokens: std::collections::BTreeSet<String> = answers
            .iter()
            .map(|a| {
                assert_eq!(a.status, 200, "{cloud:?}: {}", a.body);
                a.credential()
            })
            .collect();
        assert_eq!(tokens.len(), 1, "{cloud:?}: one exchange, one credential");
        assert_eq!(issued(&stack, cloud) - counts_before, 1, "{cloud:?}");
        assert!(took >= Duration::from_millis(300), "{cloud:?}: {took:?}");
    }
}

/// Credentials the emulator issued to the dev identity (for Google: the
/// service-account tokens, one per exchange).
fn issued(stack: &DevStack, cloud: Cloud) -> u64 {
    let counts = match cloud {
        Cloud::Azure => stack.entra.as_ref().unwrap().ledger.counts(),
        Cloud::Gcp => stack.gcp.as_ref().unwrap().ledger.counts(),
        Cloud::Aws => stack.aws.as_ref().unwrap().ledger.counts(),
    };
    counts
        .iter()
        .filter(|(principal, _)| matches!(cloud, Cloud::Gcp) == principal.contains('@'))
        .filter(|(principal, _)| !principal.ends_with("(id token)"))
        .map(|(_, n)| n)
        .sum()
}
