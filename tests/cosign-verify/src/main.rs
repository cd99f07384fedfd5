//! `lanyard-cosign-verify --key PUB.pem [--plain-http] HOST/REPO:TAG|@DIGEST`
//!
//! Verifies that the artifact the reference names carries a cosign
//! signature (cosign's `sha256-<hex>.sig` tag scheme) made with the key,
//! the way `cosign verify --key` does, through sigstore-rs's own client
//! and its `PublicKeyVerifier`: the signature layer's payload must name the
//! artifact's manifest digest and verify under the key. Nothing here
//! re-implements the check; this binary only wires sigstore-rs's pieces
//! together, so the release test verifies with code that is not Lanyard's.
//!
//! Prints the verified digest and exits 0, or prints why and exits 1
//! (2 for bad arguments).

use std::process::ExitCode;

use sigstore::cosign::verification_constraint::{PublicKeyVerifier, VerificationConstraintVec};
use sigstore::cosign::{ClientBuilder, CosignCapabilities};
use sigstore::crypto::SigningScheme;
use sigstore::registry::{Auth, ClientConfig, ClientProtocol, OciReference};

struct Args {
    key: String,
    plain_http: bool,
    reference: String,
}

fn args() -> Result<Args, String> {
    let mut key = None;
    let mut plain_http = false;
    let mut reference = None;
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--key" => key = it.next(),
            "--plain-http" => plain_http = true,
            _ if reference.is_none() && !arg.starts_with('-') => reference = Some(arg),
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    Ok(Args {
        key: key.ok_or("--key PUB.pem is required")?,
        plain_http,
        reference: reference.ok_or("a reference HOST/REPO:TAG is required")?,
    })
}

async fn verify(args: &Args) -> Result<String, String> {
    let key = std::fs::read(&args.key).map_err(|e| format!("reading {}: {e}", args.key))?;
    let reference: OciReference = args
        .reference
        .parse()
        .map_err(|e| format!("bad reference {:?}: {e}", args.reference))?;
    let config = ClientConfig {
        protocol: if args.plain_http {
            ClientProtocol::Http
        } else {
            ClientProtocol::Https
        },
        ..Default::default()
    };
    let mut client = ClientBuilder::default()
        .with_oci_client_config(config)
        .build()
        .map_err(|e| format!("client: {e}"))?;
    let (_, digest) = client
        .triangulate(&reference, &Auth::Anonymous)
        .await
        .map_err(|e| format!("resolving {}: {e}", args.reference))?;
    let layers = client
        .trusted_signature_layers(&Auth::Anonymous, &reference)
        .await
        .map_err(|e| format!("fetching signatures: {e}"))?;
    if layers.is_empty() {
        return Err(format!("no signature for {digest}"));
    }
    let verifier = PublicKeyVerifier::new(&key, &SigningScheme::ECDSA_P256_SHA256_ASN1)
        .map_err(|e| format!("key: {e}"))?;
    let constraints: VerificationConstraintVec = vec![Box::new(verifier)];
    sigstore::cosign::verify_constraints(&layers, constraints.iter())
        .map_err(|_| format!("no signature of {digest} verifies under the key"))?;
    Ok(digest)
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match verify(&args).await {
        Ok(digest) => {
            println!("verified {digest}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
