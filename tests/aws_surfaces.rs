//! AWS container-credentials and IMDSv2 surfaces over real HTTP against a
//! full in-process dev stack.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

mod support;

use std::sync::atomic::Ordering;

use lanyard::config::Config;
use lanyard::dev::DevStack;
use serde_json::Value;
use support::{dev_stack, export};

fn parse_rfc3339(s: &str) -> i64 {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .unwrap()
        .unix_timestamp()
}

fn now() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

#[tokio::test]
async fn container_credentials_with_file_authorization() {
    let (stack, _) = dev_stack().await;
    let url = export(&stack, "AWS_CONTAINER_CREDENTIALS_FULL_URI").to_string();
    let file = export(&stack, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE").to_string();
    let token = std::fs::read_to_string(&file).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "token file readable by others: {mode:o}");
    }
    let http = reqwest::Client::new();
    let resp = http
        .get(&url)
        .header("Authorization", token.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body: Value = resp.json().await.unwrap();
    for f in [
        "AccessKeyId",
        "SecretAccessKey",
        "Token",
        "AccountId",
        "Expiration",
    ] {
        assert!(body[f].is_string(), "{f}: {body}");
    }
    assert_eq!(body["AccountId"], "111122223333");
    assert!(parse_rfc3339(body["Expiration"].as_str().unwrap()) > now() + 15 * 60);

    // Rotating the file's contents takes effect at once.
    std::fs::write(&file, "rotated-token").unwrap();
    // The token it replaced still works for a short grace (a client may
    // have read it just before the rotation: serve::container_token).
    let resp = http
        .get(&url)
        .header("Authorization", token.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let resp = http
        .get(&url)
        .header("Authorization", "rotated-token")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    let sts = stack.aws.as_ref().unwrap();
    let before = sts.stats.requests.load(Ordering::Relaxed);
    for auth in [None, Some(""), Some("rotated-toke"), Some("rotated-token2")] {
        let mut req = http.get(&url);
        if let Some(a) = auth {
            req = req.header("Authorization", a);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{auth:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["code"], "AccessDenied");
    }
    let resp = http
        .get(&url)
        .header("Authorization", "rotated-token")
        .header("X-Forwarded-For", "1.2.3.4")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(
        sts.stats.requests.load(Ordering::Relaxed),
        before,
        "refused before upstream"
    );
    stack.stop().await;
}

#[tokio::test]
async fn imdsv2_session_flow() {
    let (stack, base) = dev_stack().await;
    let http = reqwest::Client::new();
    let resp = http
        .put(format!("{base}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "120")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-aws-ec2-metadata-token-ttl-seconds"],
        "120"
    );
    let session = resp.text().await.unwrap();

    let list = http
        .get(format!("{base}/latest/meta-data/iam/security-credentials/"))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(list.status(), 200);
    let role = list.text().await.unwrap();
    assert_eq!(role, "ray-worker");

    let creds: Value = http
        .get(format!(
            "{base}/latest/meta-data/iam/security-credentials/{role}"
        ))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(creds["Code"], "Success");
    assert_eq!(creds["Type"], "AWS-HMAC");
    assert!(creds["AccessKeyId"].as_str().unwrap().starts_with("ASIA"));
    assert!(parse_rfc3339(creds["Expiration"].as_str().unwrap()) > now() + 15 * 60);
    parse_rfc3339(creds["LastUpdated"].as_str().unwrap());

    let other = http
        .get(format!(
            "{base}/latest/meta-data/iam/security-credentials/admin"
        ))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(other.status(), 404);

    let region = http
        .get(format!("{base}/latest/meta-data/placement/region"))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(region.text().await.unwrap(), "us-east-1");
    stack.stop().await;
}

#[tokio::test]
async fn imdsv1_and_bad_sessions_are_refused() {
    let (stack, base) = dev_stack().await;
    let http = reqwest::Client::new();
    let url = format!("{base}/latest/meta-data/iam/security-credentials/");
    assert_eq!(http.get(&url).send().await.unwrap().status(), 401, "IMDSv1");
    for bad in [
        "",
        "garbage",
        "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
    ] {
        let resp = http
            .get(&url)
            .header("X-aws-ec2-metadata-token", bad)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{bad:?}");
    }
    for ttl in [None, Some("0"), Some("21601"), Some("abc"), Some("-5")] {
        let mut req = http.put(format!("{base}/latest/api/token"));
        if let Some(t) = ttl {
            req = req.header("X-aws-ec2-metadata-token-ttl-seconds", t);
        }
        assert_eq!(req.send().await.unwrap().status(), 400, "{ttl:?}");
    }
    let resp = http
        .put(format!("{base}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "21600")
        .header("X-Forwarded-For", "1.2.3.4")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    // A session token expires with its TTL.
    let session = http
        .put(format!("{base}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "1")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(2100)).await;
    let resp = http
        .get(&url)
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "expired session token");
    assert_eq!(
        stack
            .aws
            .as_ref()
            .unwrap()
            .stats
            .requests
            .load(Ordering::Relaxed),
        0
    );
    stack.stop().await;
}

#[tokio::test]
async fn throttled_sts_is_a_retryable_429_then_recovers() {
    let (stack, base) = dev_stack().await;
    let http = reqwest::Client::new();
    let session = http
        .put(format!("{base}/latest/api/token"))
        .header("X-aws-ec2-metadata-token-ttl-seconds", "60")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // Throttle STS once: the surface answers a retryable 429, then recovers.
    stack.aws.as_ref().unwrap().set_throttle(1);
    let resp = http
        .get(format!(
            "{base}/latest/meta-data/iam/security-credentials/ray-worker"
        ))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let creds = || {
        http.get(format!(
            "{base}/latest/meta-data/iam/security-credentials/ray-worker"
        ))
        .header("X-aws-ec2-metadata-token", &session)
        .send()
    };
    // Within the backoff the cache answers the throttle itself.
    assert_eq!(creds().await.unwrap().status(), 429);
    let sts = stack.aws.as_ref().unwrap();
    assert_eq!(
        sts.stats.requests.load(Ordering::Relaxed),
        1,
        "no upstream call during backoff"
    );
    // After the backoff (1 s at most for a first failure) it recovers.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert_eq!(creds().await.unwrap().status(), 200);
    assert_eq!(creds().await.unwrap().status(), 200);
    assert_eq!(
        sts.stats.issued.load(Ordering::Relaxed),
        1,
        "the second is a cache hit"
    );
    stack.stop().await;
}

#[tokio::test]
async fn external_sts_endpoint_is_used_and_untrusted_subject_is_access_denied() {
    use lanyard_emulators::aws::{AwsEmulatorConfig, AwsRole, AwsSts, OidcProvider};
    use std::sync::Arc;
    // STS listens first so its URL can be configured as the override.
    let listener = lanyard::http::bind("127.0.0.1:0".parse().unwrap(), "sts")
        .await
        .unwrap();
    let sts_url = format!("http://{}", listener.local_addr().unwrap());
    let config = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_listen: "127.0.0.1:0".parse().unwrap(),
        aws: lanyard::cloud::aws::Settings {
            sts_endpoint: Some(sts_url),
            ..Default::default()
        },
        ..Default::default()
    };
    let stack = DevStack::start(&config).await.unwrap();
    assert!(
        stack.aws.is_none(),
        "no built-in STS when an endpoint is configured"
    );
    let sts = Arc::new(AwsSts::new(
        AwsEmulatorConfig {
            providers: vec![OidcProvider {
                issuer: stack.issuer.url().to_string(),
                audiences: vec!["sts.amazonaws.com".into()],
            }],
            roles: vec![AwsRole {
                arn: config.dev.aws_role_arn.clone(),
                trusted_subjects: vec!["system:serviceaccount:other:*".into()],
                max_session_duration: 43_200,
                trusted_roles: Vec::new(),
                external_id: None,
                allow_tag_session: false,
            }],
            ..Default::default()
        },
        lanyard::http::client(),
    ));
    let (_trigger, shutdown) = lanyard::http::Shutdown::new();
    lanyard::http::spawn_server(listener, sts.router(), shutdown);

    let url = export(&stack, "AWS_CONTAINER_CREDENTIALS_FULL_URI").to_string();
    let token =
        std::fs::read_to_string(export(&stack, "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE")).unwrap();
    let resp = reqwest::Client::new()
        .get(&url)
        .header("Authorization", token.trim())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 403);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "AccessDenied");
    assert!(body["message"]
        .as_str()
        .unwrap()
        .contains("sts:AssumeRoleWithWebIdentity"));
    assert_eq!(
        sts.stats.requests.load(Ordering::Relaxed),
        1,
        "the override was used"
    );
    assert_eq!(sts.stats.issued.load(Ordering::Relaxed), 0);
    stack.stop().await;
}
