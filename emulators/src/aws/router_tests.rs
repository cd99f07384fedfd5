//! The STS emulator end to end through its router: a web identity from the
//! built-in issuer (served on loopback, found by OIDC discovery as STS
//! finds it), then signed `AssumeRole` and `GetCallerIdentity` calls made
//! the way botocore makes them.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use tower::ServiceExt;

use super::sigv4::testing::Signer;
use super::sigv4::{format_amz_date, SignedRequest};
use super::*;
use crate::{Issuer, PodIdentity, SigningKey};

const SOURCE_ROLE: &str = "arn:aws:iam::111122223333:role/pod-identity";
const TARGET_ROLE: &str = "arn:aws:iam::444455556666:role/team/data-reader";
const NEXT_ROLE: &str = "arn:aws:iam::444455556666:role/next-hop";
const UNTAGGED_ROLE: &str = "arn:aws:iam::444455556666:role/untagged";
const EXTERNAL_ID: &str = "lanyard-ext-1";
const HOST: &str = "sts.us-west-2.amazonaws.com";
const FORM: &str = "application/x-www-form-urlencoded; charset=utf-8";
const SIGNED: [&str; 4] = ["content-type", "host", "x-amz-date", "x-amz-security-token"];

/// The six session tags EKS Pod Identity sets, with realistic values.
const EKS_TAGS: [(&str, &str); 6] = [
    (
        "eks-cluster-arn",
        "arn:aws:eks:us-west-2:111122223333:cluster/lanyard-dev",
    ),
    ("eks-cluster-name", "lanyard-dev"),
    ("kubernetes-namespace", "ml"),
    ("kubernetes-service-account", "ray"),
    ("kubernetes-pod-name", "ray-0"),
    ("kubernetes-pod-uid", "0b9f2a3c-6f53-4c1e-9d6e-2f8a1b7c4d5e"),
];

struct Env {
    sts: Arc<AwsSts>,
    router: Router,
    issuer: Arc<Issuer>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Env {
    fn drop(&mut self) {
        self.server.abort();
    }
}

fn role(arn: &str) -> AwsRole {
    AwsRole {
        arn: arn.into(),
        trusted_subjects: Vec::new(),
        max_session_duration: 43_200,
        trusted_roles: Vec::new(),
        external_id: None,
        allow_tag_session: false,
    }
}

async fn env() -> Env {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let issuer = Arc::new(Issuer::new(
        format!("http://{addr}"),
        SigningKey::generate_rs256().unwrap(),
    ));
    let app = issuer.router();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let config = AwsEmulatorConfig {
        providers: vec![OidcProvider {
            issuer: issuer.url().to_string(),
            audiences: vec![DEFAULT_AUDIENCE.to_string()],
        }],
        roles: vec![
            AwsRole {
                trusted_subjects: vec!["system:serviceaccount:ml:*".into()],
                ..role(SOURCE_ROLE)
            },
            AwsRole {
                trusted_roles: vec![SOURCE_ROLE.into()],
                external_id: Some(EXTERNAL_ID.into()),
                allow_tag_session: true,
                ..role(TARGET_ROLE)
            },
            AwsRole {
                trusted_roles: vec!["444455556666".into()],
                allow_tag_session: true,
                ..role(NEXT_ROLE)
            },
            AwsRole {
                trusted_roles: vec![
                    "arn:aws:iam::111122223333:root".into(),
                    "444455556666".into(),
                ],
                ..role(UNTAGGED_ROLE)
            },
        ],
        ..Default::default()
    };
    let sts = Arc::new(AwsSts::new(config, reqwest::Client::new()));
    let router = sts.router();
    Env {
        sts,
        router,
        issuer,
        server,
    }
}

/// The text between `<name>` and `</name>`, first occurrence.
fn element(xml: &str, name: &str) -> Option<String> {
    let open = format!("<{name}>");
    let start = xml.find(&open)? + open.len();
    let end = start + xml[start..].find(&format!("</{name}>"))?;
    Some(xml[start..end].to_string())
}

/// An STS error answer's code and message.
fn error(xml: &str) -> (String, String) {
    (
        element(xml, "Code").unwrap_or_default(),
        element(xml, "Message")
            .unwrap_or_default()
            .replace("&apos;", "'")
            .replace("&quot;", "\""),
    )
}

struct Creds {
    access_key_id: String,
    secret: String,
    token: String,
    arn: String,
}

fn creds(xml: &str) -> Creds {
    Creds {
        access_key_id: element(xml, "AccessKeyId").unwrap(),
        secret: element(xml, "SecretAccessKey").unwrap(),
        token: element(xml, "SessionToken").unwrap(),
        arn: element(xml, "Arn").unwrap(),
    }
}

fn form(pairs: &[(&str, &str)]) -> String {
    url::form_urlencoded::Serializer::new(String::new())
        .extend_pairs(pairs)
        .finish()
}

async fn send(env: &Env, request: Request<Body>) -> (StatusCode, String) {
    let resp = env.router.clone().oneshot(request).await.unwrap();
    let status = resp.status();
    let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

async fn web_identity(env: &Env, session: &str) -> Creds {
    let pod = PodIdentity::new("ml", "ray", "ray-0", "node-a");
    let token = env
        .issuer
        .mint(&pod, &[DEFAULT_AUDIENCE], Duration::from_secs(3600))
        .unwrap();
    let body = form(&[
        ("Action", "AssumeRoleWithWebIdentity"),
        ("Version", STS_VERSION),
        ("RoleArn", SOURCE_ROLE),
        ("RoleSessionName", session),
        ("WebIdentityToken", &token),
    ]);
    // A stray Authorization header does not matter to this action.
    let request = Request::post("/")
        .header("content-type", FORM)
        .header("authorization", "AWS4-HMAC-SHA256 Credential=nonsense")
        .body(Body::from(body))
        .unwrap();
    let (status, xml) = send(env, request).await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    creds(&xml)
}

/// How to spoil a signed request.
#[derive(Default)]
struct Fault<'a> {
    secret: Option<&'a str>,
    token: Option<&'a str>,
    access_key_id: Option<&'a str>,
    signed_at: Option<u64>,
    /// The body sent instead of the one signed.
    body: Option<&'a str>,
    unsigned: bool,
}

async fn signed(
    env: &Env,
    creds: &Creds,
    params: &[(&str, &str)],
    fault: Fault<'_>,
) -> (StatusCode, String) {
    let body = form(params);
    let now = jsonwebtoken::get_current_timestamp();
    let amz_date = format_amz_date(i64::try_from(fault.signed_at.unwrap_or(now)).unwrap());
    let mut headers = HeaderMap::new();
    headers.insert("content-type", FORM.parse().unwrap());
    headers.insert("host", HOST.parse().unwrap());
    headers.insert("x-amz-date", amz_date.parse().unwrap());
    headers.insert(
        "x-amz-security-token",
        fault.token.unwrap_or(&creds.token).parse().unwrap(),
    );
    let signer = Signer {
        access_key_id: fault.access_key_id.unwrap_or(&creds.access_key_id),
        secret: fault.secret.unwrap_or(&creds.secret),
        region: "us-west-2",
        service: "sts",
    };
    let authorization = signer.authorization(
        &SignedRequest {
            method: "POST",
            path: "/",
            query: "",
            headers: &headers,
            body: body.as_bytes(),
        },
        &SIGNED,
        &amz_date,
    );
    if !fault.unsigned {
        headers.insert("authorization", authorization.parse().unwrap());
    }
    let mut request = Request::post("/");
    for (name, value) in &headers {
        request = request.header(name, value);
    }
    let sent = fault.body.map(str::to_string).unwrap_or(body);
    send(env, request.body(Body::from(sent)).unwrap()).await
}

fn assume_params<'a>(
    role_arn: &'a str,
    session: &'a str,
    extra: &[(&'a str, &'a str)],
) -> Vec<(&'a str, &'a str)> {
    let mut params = vec![
        ("Action", "AssumeRole"),
        ("Version", STS_VERSION),
        ("RoleArn", role_arn),
        ("RoleSessionName", session),
    ];
    params.extend_from_slice(extra);
    params
}

fn tag_params(tags: &[(String, String)]) -> Vec<(String, String)> {
    tags.iter()
        .enumerate()
        .flat_map(|(i, (k, v))| {
            [
                (format!("Tags.member.{}.Key", i + 1), k.clone()),
                (format!("Tags.member.{}.Value", i + 1), v.clone()),
            ]
        })
        .collect()
}

fn as_refs(owned: &[(String, String)]) -> Vec<(&str, &str)> {
    owned
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

fn eks_tags() -> Vec<(String, String)> {
    EKS_TAGS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const CALLER_IDENTITY: [(&str, &str); 2] =
    [("Action", "GetCallerIdentity"), ("Version", STS_VERSION)];

#[tokio::test]
async fn aws_assume_role_chains_with_session_tags_and_an_external_id() {
    let env = env().await;
    let source = web_identity(&env, "s1").await;
    assert_eq!(
        source.arn,
        "arn:aws:sts::111122223333:assumed-role/pod-identity/s1"
    );

    // The web identity's own credentials answer GetCallerIdentity.
    let (status, xml) = signed(&env, &source, &CALLER_IDENTITY, Fault::default()).await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    assert_eq!(element(&xml, "Arn").unwrap(), source.arn);
    assert_eq!(element(&xml, "Account").unwrap(), "111122223333");

    let policy = r#"{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"s3:GetObject","Resource":"*"}]}"#;
    let tags = tag_params(&eks_tags());
    let mut extra = as_refs(&tags);
    extra.extend([
        ("TransitiveTagKeys.member.1", "kubernetes-namespace"),
        ("TransitiveTagKeys.member.2", "eks-cluster-name"),
        ("ExternalId", EXTERNAL_ID),
        ("DurationSeconds", "3600"),
        ("Policy", policy),
    ]);
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &extra),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    assert!(
        xml.starts_with("<AssumeRoleResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\">")
    );
    // AssumedRoleUser, then Credentials, then PackedPolicySize, as in the
    // STS API reference's example.
    let order: Vec<usize> = [
        "<AssumedRoleUser>",
        "<Credentials>",
        "<PackedPolicySize>",
        "<ResponseMetadata>",
    ]
    .iter()
    .map(|e| xml.find(e).unwrap())
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{xml}");
    let target = creds(&xml);
    assert_eq!(
        target.arn,
        "arn:aws:sts::444455556666:assumed-role/data-reader/s2"
    );
    let role_id = element(&xml, "AssumedRoleId").unwrap();
    assert!(
        role_id.starts_with("AROA") && role_id.ends_with(":s2"),
        "{role_id}"
    );
    let tag_bytes: usize = EKS_TAGS.iter().map(|(k, v)| k.len() + v.len()).sum();
    let expected = (tag_bytes + policy.len()) * 100;
    let expected = expected.div_ceil(DEFAULT_PACKED_POLICY_LIMIT);
    assert_eq!(
        element(&xml, "PackedPolicySize").unwrap(),
        expected.to_string()
    );
    assert!(
        tag_bytes * 100 / DEFAULT_PACKED_POLICY_LIMIT < 25,
        "the six tags fit well"
    );
    assert_ne!(target.access_key_id, source.access_key_id);
    assert_eq!(
        env.sts.ledger.owner(&target.access_key_id).as_deref(),
        Some(TARGET_ROLE)
    );

    // The chained credentials are the target's session.
    let (status, xml) = signed(&env, &target, &CALLER_IDENTITY, Fault::default()).await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    assert!(xml.contains("<GetCallerIdentityResult>"));
    assert_eq!(element(&xml, "Arn").unwrap(), target.arn);
    assert_eq!(element(&xml, "UserId").unwrap(), role_id);
    assert_eq!(element(&xml, "Account").unwrap(), "444455556666");

    let sessions = env.sts.sessions();
    assert_eq!(sessions.len(), 2);
    assert_eq!(sessions[0].action, SessionAction::AssumeRoleWithWebIdentity);
    assert_eq!(
        sessions[0].subject.as_deref(),
        Some("system:serviceaccount:ml:ray")
    );
    let second = &sessions[1];
    assert_eq!(second.action, SessionAction::AssumeRole);
    assert_eq!(second.role_arn, TARGET_ROLE);
    assert_eq!(second.session_name, "s2");
    assert_eq!(second.access_key_id, target.access_key_id);
    assert_eq!(second.source_role_arn.as_deref(), Some(SOURCE_ROLE));
    assert_eq!(
        second.source_assumed_role_arn.as_deref(),
        Some(source.arn.as_str())
    );
    assert_eq!(second.tags, eks_tags());
    assert_eq!(
        second.transitive_tag_keys,
        ["kubernetes-namespace", "eks-cluster-name"]
    );
    assert!(second.inherited_tags.is_empty());
    assert_eq!(second.external_id.as_deref(), Some(EXTERNAL_ID));
    assert!(second.session_policy);
    assert_eq!(
        second.packed_policy_size,
        Some(u32::try_from(expected).unwrap())
    );
    assert_eq!(second.duration_seconds, 3600);
    assert_eq!(env.sts.stats.assume_role_issued.load(Ordering::Relaxed), 1);
    assert_eq!(env.sts.stats.issued.load(Ordering::Relaxed), 2);

    // One link further: the transitive tags come along, may not be
    // overridden, and need sts:TagSession on the next role.
    let (status, xml) = signed(
        &env,
        &target,
        &assume_params(
            NEXT_ROLE,
            "s3",
            &[
                ("Tags.member.1.Key", "Kubernetes-Namespace"),
                ("Tags.member.1.Value", "other"),
            ],
        ),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "InvalidParameterValue".into(),
            "One of the specified transitive tag keys can't be set because it conflicts with a transitive tag key from the calling session.".into()
        )
    );
    let (status, xml) = signed(
        &env,
        &target,
        &assume_params(UNTAGGED_ROLE, "s3", &[]),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "AccessDenied".into(),
            format!("User: {} is not authorized to perform: sts:TagSession on resource: {UNTAGGED_ROLE}", target.arn)
        )
    );
    let (status, xml) = signed(
        &env,
        &target,
        &assume_params(NEXT_ROLE, "s3", &[]),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    let third = env.sts.sessions().pop().unwrap();
    assert_eq!(third.source_role_arn.as_deref(), Some(TARGET_ROLE));
    assert_eq!(
        third.inherited_tags,
        // In the order the tags were passed.
        [
            ("eks-cluster-name".to_string(), "lanyard-dev".to_string()),
            ("kubernetes-namespace".to_string(), "ml".to_string()),
        ]
    );
    assert!(third.tags.is_empty());
    assert!(
        element(&xml, "PackedPolicySize").is_some(),
        "inherited tags are packed"
    );
}

#[tokio::test]
async fn aws_assume_role_refuses_like_sts() {
    let env = env().await;
    let source = web_identity(&env, "s1").await;
    let denied = |action: &str, resource: &str| {
        (
            "AccessDenied".to_string(),
            format!(
                "User: arn:aws:sts::111122223333:assumed-role/pod-identity/s1 is not authorized to perform: {action} on resource: {resource}"
            ),
        )
    };
    let call = |extra: Vec<(&'static str, &'static str)>, role: &'static str| {
        let env = &env;
        let source = &source;
        async move {
            let mut extra = extra;
            if role == TARGET_ROLE && !extra.iter().any(|(k, _)| *k == "ExternalId") {
                extra.push(("ExternalId", EXTERNAL_ID));
            }
            signed(
                env,
                source,
                &assume_params(role, "s2", &extra),
                Fault::default(),
            )
            .await
        }
    };

    // Trust: wrong or missing external id, a role that does not trust the
    // caller, a role that does not exist: one answer for all.
    for extra in [vec![("ExternalId", "wrong-id")], vec![("ExternalId", "")]] {
        let (status, xml) = signed(
            &env,
            &source,
            &assume_params(TARGET_ROLE, "s2", &extra),
            Fault::default(),
        )
        .await;
        if extra[0].1.is_empty() {
            // An empty ExternalId breaks the model's length first.
            assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
            assert_eq!(error(&xml).0, "ValidationError");
        } else {
            assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
            assert_eq!(error(&xml), denied("sts:AssumeRole", TARGET_ROLE));
        }
    }
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &[]),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    assert_eq!(error(&xml), denied("sts:AssumeRole", TARGET_ROLE));
    let (status, xml) = call(vec![], NEXT_ROLE).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    assert_eq!(error(&xml), denied("sts:AssumeRole", NEXT_ROLE));
    let missing = "arn:aws:iam::444455556666:role/missing";
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(missing, "s2", &[]),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    assert_eq!(error(&xml), denied("sts:AssumeRole", missing));

    // Tags without sts:TagSession.
    let (status, xml) = call(
        vec![("Tags.member.1.Key", "team"), ("Tags.member.1.Value", "ml")],
        UNTAGGED_ROLE,
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    assert_eq!(error(&xml), denied("sts:TagSession", UNTAGGED_ROLE));
    // ...and without tags the same role is fine (it trusts the account).
    let (status, xml) = call(vec![], UNTAGGED_ROLE).await;
    assert_eq!(status, StatusCode::OK, "{xml}");
    assert!(element(&xml, "PackedPolicySize").is_none());

    // Too many tags.
    let many: Vec<(String, String)> = (1..=51)
        .map(|n| (format!("k{n}"), "v".to_string()))
        .collect();
    let many = tag_params(&many);
    let mut extra = as_refs(&many);
    extra.push(("ExternalId", EXTERNAL_ID));
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &extra),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "ValidationError".into(),
            "1 validation error detected: Value at 'tags' failed to satisfy constraint: Member must have length less than or equal to 50".into()
        )
    );

    // Over the packed budget: 20 tags of 200-character values.
    let big: Vec<(String, String)> = (1..=20)
        .map(|n| (format!("k{n}"), "v".repeat(200)))
        .collect();
    let big_bytes: usize = big.iter().map(|(k, v)| k.len() + v.len()).sum();
    let big = tag_params(&big);
    let mut extra = as_refs(&big);
    extra.push(("ExternalId", EXTERNAL_ID));
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &extra),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    let percent = (big_bytes * 100).div_ceil(DEFAULT_PACKED_POLICY_LIMIT);
    assert_eq!(
        error(&xml),
        (
            "PackedPolicyTooLarge".into(),
            format!("Packed size of session tags consumes {percent}% of allotted space.")
        )
    );
    extra.push(("Policy", r#"{"Version":"2012-10-17"}"#));
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &extra),
        Fault::default(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    let message = error(&xml).1;
    assert!(
        message.starts_with("Packed policy consumes ")
            && message.ends_with("% of allotted space, please use smaller policy."),
        "{xml}"
    );

    // Role chaining is capped at an hour, whatever the role allows.
    let (status, xml) = call(vec![("DurationSeconds", "3601")], TARGET_ROLE).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "ValidationError".into(),
            "The requested DurationSeconds exceeds the 1 hour session limit for roles assumed by role chaining.".into()
        )
    );

    // Tag semantics.
    let (status, xml) = call(
        vec![
            ("Tags.member.1.Key", "Team"),
            ("Tags.member.1.Value", "a"),
            ("Tags.member.2.Key", "team"),
            ("Tags.member.2.Value", "b"),
        ],
        TARGET_ROLE,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "InvalidParameterValue".into(),
            "Duplicate tag keys found. Please note that Tag keys are case insensitive.".into()
        )
    );
    let (status, xml) = call(
        vec![
            ("Tags.member.1.Key", "team"),
            ("Tags.member.1.Value", "a"),
            ("TransitiveTagKeys.member.1", "project"),
        ],
        TARGET_ROLE,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "InvalidParameterValue".into(),
            "The specified transitive tag key must be included in the requested tags.".into()
        )
    );

    // Policy documents and ARNs.
    let (status, xml) = call(vec![("Policy", "{not json")], TARGET_ROLE).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "MalformedPolicyDocument".into(),
            "The policy is not in the valid JSON format.".into()
        )
    );
    let (status, xml) = call(vec![], "nothing-valid-in-here-at-all").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
    assert_eq!(
        error(&xml),
        (
            "ValidationError".into(),
            "nothing-valid-in-here-at-all is invalid".into()
        )
    );

    // Only the untagged role's session was issued, besides the web identity.
    assert_eq!(env.sts.sessions().len(), 2);
    assert_eq!(env.sts.stats.assume_role_issued.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn aws_signed_calls_refuse_bad_credentials() {
    let env = env().await;
    let source = web_identity(&env, "s1").await;
    let check = |status: StatusCode, xml: &str, code: &str, message: &str| {
        assert_eq!(error(xml), (code.to_string(), message.to_string()), "{xml}");
        assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    };

    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            unsigned: true,
            ..Fault::default()
        },
    )
    .await;
    check(
        status,
        &xml,
        "MissingAuthenticationToken",
        "Request is missing Authentication Token",
    );
    let (status, xml) = signed(
        &env,
        &source,
        &assume_params(TARGET_ROLE, "s2", &[]),
        Fault {
            unsigned: true,
            ..Fault::default()
        },
    )
    .await;
    check(
        status,
        &xml,
        "MissingAuthenticationToken",
        "Request is missing Authentication Token",
    );

    let mismatch = "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.";
    let wrong_secret = "A".repeat(40);
    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            secret: Some(&wrong_secret),
            ..Fault::default()
        },
    )
    .await;
    check(status, &xml, "SignatureDoesNotMatch", mismatch);

    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            body: Some("Action=GetCallerIdentity&Version=2011-06-15&Extra=1"),
            ..Fault::default()
        },
    )
    .await;
    check(status, &xml, "SignatureDoesNotMatch", mismatch);

    let invalid = "The security token included in the request is invalid.";
    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            token: Some("IQoJb3JpZ2luX2VjEnot-the-token"),
            ..Fault::default()
        },
    )
    .await;
    check(status, &xml, "InvalidClientTokenId", invalid);
    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            access_key_id: Some("ASIAUNKNOWNUNKNOWN00"),
            ..Fault::default()
        },
    )
    .await;
    check(status, &xml, "InvalidClientTokenId", invalid);

    let now = jsonwebtoken::get_current_timestamp();
    let (status, xml) = signed(
        &env,
        &source,
        &CALLER_IDENTITY,
        Fault {
            signed_at: Some(now - 3600),
            ..Fault::default()
        },
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{xml}");
    let (code, message) = error(&xml);
    assert_eq!(code, "SignatureDoesNotMatch");
    assert!(message.starts_with("Signature expired: "), "{message}");
    assert!(message.ends_with(" - 15 min.)"), "{message}");

    // Credentials whose session has ended.
    let expired = Creds {
        access_key_id: "ASIAEXPIREDEXPIRED00".into(),
        secret: "expired-secret".into(),
        token: "expired-token".into(),
        arn: "arn:aws:sts::111122223333:assumed-role/pod-identity/old".into(),
    };
    env.sts.credentials.lock().unwrap().insert(
        &expired.access_key_id,
        Credential::new(
            &expired.secret,
            &expired.token,
            now - 1,
            Principal {
                role_arn: SOURCE_ROLE.into(),
                assumed_role_arn: expired.arn.clone(),
                user_id: "AROAEXAMPLE:old".into(),
                account: "111122223333".into(),
                transitive_tags: Vec::new(),
            },
        ),
        now,
    );
    let (status, xml) = signed(&env, &expired, &CALLER_IDENTITY, Fault::default()).await;
    check(
        status,
        &xml,
        "ExpiredToken",
        "The security token included in the request is expired",
    );

    assert_eq!(env.sts.stats.auth_failures.load(Ordering::Relaxed), 8);
    assert_eq!(
        env.sts
            .stats
            .caller_identity_requests
            .load(Ordering::Relaxed),
        7
    );
    assert_eq!(
        env.sts.stats.assume_role_requests.load(Ordering::Relaxed),
        1
    );
    // The good credentials still work.
    let (status, xml) = signed(&env, &source, &CALLER_IDENTITY, Fault::default()).await;
    assert_eq!(status, StatusCode::OK, "{xml}");
}

#[tokio::test]
async fn aws_unknown_actions_and_versions_are_refused_before_authentication() {
    let env = env().await;
    for (action, version) in [
        ("GetSessionToken", STS_VERSION),
        ("AssumeRole", "2011-06-16"),
    ] {
        let request = Request::post("/")
            .header("content-type", FORM)
            .body(Body::from(form(&[
                ("Action", action),
                ("Version", version),
            ])))
            .unwrap();
        let (status, xml) = send(&env, request).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{xml}");
        assert_eq!(
            error(&xml),
            (
                "InvalidAction".into(),
                format!("Could not find operation {action} for version {version}")
            )
        );
    }
}
