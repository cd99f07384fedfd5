//! The official Rust SDKs' default credential chains, unmodified, with
//! nothing but the environment a pod has: `aws-config` (container
//! credentials or IMDSv2, as `AWS_*` choose), `google-cloud-auth` (the
//! metadata server at `GCE_METADATA_HOST`) and `azure_identity`'s
//! `ManagedIdentityCredential` (the App Service endpoint at
//! `IDENTITY_ENDPOINT`, the identity `AZURE_CLIENT_ID` names). Prints one
//! JSON line per client for the Python tests to judge.
//!
//!     lanyard-rust-clients aws      aws-config's default provider chain
//!     lanyard-rust-clients google   google-cloud-auth's default credentials
//!     lanyard-rust-clients azure    azure_identity's ManagedIdentityCredential, for Storage
//!     lanyard-rust-clients azure-herd N SCOPE
//!                                   N ManagedIdentityCredentials at once (each with
//!                                   its own cache, as N processes would), for SCOPE;
//!                                   prints how many distinct tokens came back

use aws_credential_types::provider::ProvideCredentials;
use serde_json::json;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let which = std::env::args().nth(1).unwrap_or_default();
    let result = match which.as_str() {
        "aws" => aws().await,
        "google" => google().await,
        "azure" => azure().await,
        "azure-herd" => azure_herd().await,
        other => Err(format!(
            "unknown client {other:?}: aws, google, azure or azure-herd"
        )),
    };
    match result {
        Ok(value) => {
            println!("{value}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{}", json!({ "ok": false, "error": e }));
            std::process::ExitCode::from(1)
        }
    }
}

async fn aws() -> Result<serde_json::Value, String> {
    let config = aws_config::load_from_env().await;
    let provider = config
        .credentials_provider()
        .ok_or("aws-config found no credentials provider")?;
    let creds = provider
        .provide_credentials()
        .await
        .map_err(|e| format!("{e:?}"))?;
    Ok(json!({
        "ok": true,
        "access_key_id": creds.access_key_id(),
        "secret_access_key": creds.secret_access_key(),
        "session_token": creds.session_token(),
        "expiry": creds
            .expiry()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs()),
        "region": config.region().map(|r| r.to_string()),
    }))
}

async fn google() -> Result<serde_json::Value, String> {
    let credentials = google_cloud_auth::credentials::Builder::default()
        .build()
        .map_err(|e| format!("{e}"))?;
    let headers = credentials
        .headers(Default::default())
        .await
        .map_err(|e| format!("{e}"))?;
    let google_cloud_auth::credentials::CacheableResource::New { data, .. } = headers else {
        return Err("no headers on the first call".into());
    };
    let authorization = data
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .ok_or("no authorization header")?;
    let token = authorization
        .strip_prefix("Bearer ")
        .ok_or("not a bearer token")?;
    Ok(json!({ "ok": true, "token": token }))
}

fn managed_identity() -> Result<std::sync::Arc<azure_identity::ManagedIdentityCredential>, String> {
    let options = azure_identity::ManagedIdentityCredentialOptions {
        user_assigned_id: std::env::var("AZURE_CLIENT_ID")
            .ok()
            .map(azure_identity::UserAssignedId::ClientId),
        ..Default::default()
    };
    azure_identity::ManagedIdentityCredential::new(Some(options)).map_err(|e| format!("{e}"))
}

async fn azure_herd() -> Result<serde_json::Value, String> {
    use azure_core::credentials::TokenCredential;
    let mut args = std::env::args().skip(2);
    let n: usize = args
        .next()
        .and_then(|n| n.parse().ok())
        .ok_or("azure-herd N SCOPE: N must be a number")?;
    let scope = args.next().ok_or("azure-herd N SCOPE: no scope")?;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let credential = managed_identity()?;
        let scope = scope.clone();
        tasks.spawn(async move {
            credential
                .get_token(&[scope.as_str()], None)
                .await
                .map(|t| t.token.secret().to_string())
                .map_err(|e| format!("{e}"))
        });
    }
    let mut tokens = std::collections::BTreeSet::new();
    while let Some(joined) = tasks.join_next().await {
        tokens.insert(joined.map_err(|e| format!("{e}"))??);
    }
    Ok(json!({
        "ok": true,
        "requests": n,
        "distinct": tokens.len(),
        "token": tokens.first(),
    }))
}

async fn azure() -> Result<serde_json::Value, String> {
    use azure_core::credentials::TokenCredential;
    let credential = managed_identity()?;
    let token = credential
        .get_token(&["https://storage.azure.com/.default"], None)
        .await
        .map_err(|e| format!("{e}"))?;
    Ok(json!({
        "ok": true,
        "token": token.token.secret(),
        "expires_on": token.expires_on.unix_timestamp(),
    }))
}
