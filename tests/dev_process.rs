//! `lanyard dev` as a newcomer runs it: a separate process that prints its
//! exports, serves tokens, shuts down cleanly on SIGTERM, and never logs a
//! token. Also the Rust azure_identity ManagedIdentityCredential through
//! `IDENTITY_ENDPOINT`, unmodified.
// Needs the `dev` feature (built-in issuer, emulators, `lanyard dev`).
#![cfg(feature = "dev")]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Dev {
    child: Child,
    exports: HashMap<String, String>,
}

fn start(extra: &[&str]) -> Dev {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args([
            "dev",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("RUST_LOG", "trace")
        .env_remove("LANYARD_CONFIG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("lanyard binary starts");
    let stdout = child.stdout.take().unwrap();
    let mut exports = HashMap::new();
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if line == lanyard::dev::READY_LINE {
            break;
        }
        if let Some(comment) = line.strip_prefix("# lanyard ") {
            // `# lanyard admin URL`, `# lanyard token-dir DIR`, `# lanyard upstream NAME URL`
            let (key, value) = comment.rsplit_once(' ').unwrap_or((comment, ""));
            exports.insert(format!("#{key}"), value.to_string());
            continue;
        }
        let (name, value) = line
            .strip_prefix("export ")
            .and_then(|l| l.split_once('='))
            .unwrap_or_else(|| panic!("unexpected stdout line {line:?}"));
        exports.insert(name.to_string(), value.trim_matches('\'').to_string());
    }
    Dev { child, exports }
}

impl Dev {
    /// SIGTERM, wait, and return (exit success, stderr).
    fn stop(mut self) -> (bool, String) {
        let pid = self.child.id() as i32;
        // SAFETY-free: use the kill command rather than libc.
        Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .unwrap();
        let status = self.child.wait().unwrap();
        let mut log = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut log)
            .unwrap();
        (status.success(), log)
    }
}

#[tokio::test]
async fn dev_prints_exports_serves_tokens_and_stops_cleanly_without_logging_secrets() {
    let dev = start(&["--token-lifetime", "900"]);
    for name in [
        "AZURE_POD_IDENTITY_AUTHORITY_HOST",
        "IDENTITY_ENDPOINT",
        "IDENTITY_HEADER",
        "AZURE_CLIENT_ID",
        "AZURE_TENANT_ID",
        "GCE_METADATA_HOST",
        "GCE_METADATA_IP",
        "GCE_METADATA_ROOT",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
        "AWS_EC2_METADATA_SERVICE_ENDPOINT",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
    ] {
        assert!(dev.exports.contains_key(name), "missing export {name}");
    }
    let http = reqwest::Client::new();
    let imds: serde_json::Value = http
        .get(format!(
            "{}/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://vault.azure.net",
            dev.exports["AZURE_POD_IDENTITY_AUTHORITY_HOST"]
        ))
        .header("Metadata", "true")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let expires_in: u64 = imds["expires_in"].as_str().unwrap().parse().unwrap();
    assert!(
        (890..=900).contains(&expires_in),
        "--token-lifetime honoured: {expires_in}"
    );
    let msi: serde_json::Value = http
        .get(format!(
            "{}?api-version=2019-08-01&resource=https://vault.azure.net",
            dev.exports["IDENTITY_ENDPOINT"]
        ))
        .header("X-IDENTITY-HEADER", &dev.exports["IDENTITY_HEADER"])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tokens = [
        imds["access_token"].as_str().unwrap().to_string(),
        msi["access_token"].as_str().unwrap().to_string(),
    ];
    let header = dev.exports["IDENTITY_HEADER"].clone();

    let (ok, log) = dev.stop();
    assert!(ok, "exit status after SIGTERM:\n{log}");
    assert!(
        log.contains("lanyard dev ready") && log.contains("shutting down"),
        "{log}"
    );
    assert!(log.contains("credential issued"), "audit records present");
    // Latencies are written to the microsecond, as in the JSON record,
    // not with a float's every digit.
    for line in log.lines().filter(|l| l.contains("credential issued")) {
        let latency = line
            .split("latency_ms=")
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no latency_ms in {line}"));
        let decimals = latency.split('.').nth(1).map_or(0, str::len);
        assert!(
            latency.parse::<f64>().is_ok() && decimals <= 3,
            "latency_ms={latency} in {line}"
        );
    }
    assert!(
        log.contains("token_fingerprint"),
        "audit carries fingerprints"
    );
    for t in &tokens {
        assert!(
            !log.contains(t.as_str()),
            "access token leaked into the log"
        );
    }
    assert!(
        !log.contains(&header),
        "identity header leaked into the log"
    );
    assert!(!log.contains("eyJ"), "a JWT leaked into the log");
}

#[test]
fn bad_configuration_exits_non_zero_naming_the_key() {
    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(["dev", "--token-lifetime", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dev.token_lifetime"), "{err}");

    let out = Command::new(env!("CARGO_BIN_EXE_lanyard"))
        .args(["dev"])
        .env("LANYARD_AZURE_AUTHORITY_HOST", "http://login.example.com")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("azure.authority_host"), "{err}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let dev = start(&["--log-format", "json"]);
    std::thread::sleep(Duration::from_millis(200));
    let (ok, log) = dev.stop();
    assert!(ok);
    let lines: Vec<&str> = log.lines().filter(|l| !l.is_empty()).collect();
    assert!(!lines.is_empty());
    for line in lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v.get("level").is_some() && v.get("timestamp").is_some(),
            "{line}"
        );
    }
}

#[tokio::test]
async fn rust_azure_identity_managed_identity_credential_via_identity_endpoint() {
    use azure_core::credentials::TokenCredential;
    let dev = start(&[]);
    // This test binary's only test that touches these variables, and no
    // other thread of this test reads or writes the environment. A safe
    // call in edition 2021, which `unsafe_code = "forbid"` relies on: an
    // `unsafe` block here would not compile.
    std::env::set_var("IDENTITY_ENDPOINT", &dev.exports["IDENTITY_ENDPOINT"]);
    std::env::set_var("IDENTITY_HEADER", &dev.exports["IDENTITY_HEADER"]);
    let cred = azure_identity::ManagedIdentityCredential::new(None).unwrap();
    let token = cred
        .get_token(&["https://storage.azure.com/.default"], None)
        .await
        .unwrap();
    let claims: serde_json::Value =
        jsonwebtoken::dangerous::insecure_decode_claims(token.token.secret()).unwrap();
    assert_eq!(claims["aud"], "https://storage.azure.com");
    assert_eq!(
        claims["iss"],
        format!(
            "https://sts.windows.net/{}/",
            claims["tid"].as_str().unwrap()
        )
    );
    let remaining = token.expires_on - azure_core::time::OffsetDateTime::now_utc();
    assert!(remaining.whole_seconds() > 3000, "{remaining}");

    // A user-assigned identity that is not bound to this pod is refused.
    let other = azure_identity::ManagedIdentityCredential::new(Some(
        azure_identity::ManagedIdentityCredentialOptions {
            user_assigned_id: Some(azure_identity::UserAssignedId::ClientId(
                "99999999-9999-9999-9999-999999999999".into(),
            )),
            ..Default::default()
        },
    ))
    .unwrap();
    let err = other
        .get_token(&["https://storage.azure.com/.default"], None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not been assigned"), "{err}");
    let (ok, log) = dev.stop();
    assert!(ok);
    assert!(!log.contains(token.token.secret()));
}
