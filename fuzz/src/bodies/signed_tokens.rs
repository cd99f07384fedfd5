//! Service-account tokens through the agent's verifier, signature checked.
//!
//! [`jwt_claims`](super::jwt_claims) covers the standalone sidecar's
//! verifier, which leaves the signature to the cloud; this target covers
//! the one the node agent trusts pods by: [`Verifier::new`] over a
//! [`KeySet`] that fetches a JWKS document ([`KeySource::Jwks`]) with the
//! agent's HTTP client, from a small server on loopback. That server, its
//! runtime and the verifier are made once per process, so the key set's
//! cache and the verifier's memo carry over between inputs as they do in
//! the agent.
//!
//! The input is a JOSE header and the claims as JSON, separated by the
//! first newline. Both are taken byte for byte and signed with the fixture
//! key, by the key's algorithm (ES256) whatever the header says, so the
//! fuzzer mutates the header (`alg`, `kid`, anything) and the claims while
//! the signature stays valid. Any other input is a compact token as is.
//!
//! Beside "never panics", a token the verifier accepts is signed by the
//! published key's algorithm (no `none`, HMAC or RSA confusion), names the
//! published `kid` or none, the verifier's issuer and the audience asked
//! for, is not expired, and its subject is the ServiceAccount its
//! `kubernetes.io` claim names; with another signature it is refused;
//! [`Verifier::verify`] agrees with [`Verifier::verify_claims`], twice (the
//! second answer comes from its memo).

use std::sync::OnceLock;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey};

use lanyard::token::{KeySet, KeySource, KeysError, Verifier, VerifyError, LEEWAY_SECS};

/// The issuer the verifier trusts (an EKS cluster's, as in the corpus).
const ISSUER: &str = "https://oidc.eks.us-west-2.amazonaws.com/id/ABC";
/// The audience asked for (Azure's, as the agent asks it).
const AUDIENCE: &str = "api://AzureADTokenExchange";
/// The published key's id and algorithm.
const KID: &str = "lanyard-fuzz-es256";
const ALG: Algorithm = Algorithm::ES256;

/// A fuzzing fixture with no other use: a P-256 key made for this target
/// (`openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8
/// -topk8 -nocrypt`), trusted by nothing but the verifier built here.
const PRIVATE_KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgs+uvjwrEXzR09Dat
vUNaMmkcM/XOFoMca2cmd1i4HfShRANCAAS+6bUjCXu7hXM8ODpnj30JGYIeP7vV
k4olqfYGPfx0S7EFDWBWuFsp2CBWNIxgWgqEUifiYKplJg/47VWdiAMV
-----END PRIVATE KEY-----
";
/// The JWKS document served: the fixture key's public half, bound to ES256
/// by its `alg` as a Kubernetes issuer's keys are.
const JWKS: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"vum1Iwl7u4VzPDg6Z499CRmCHj-71ZOKJan2Bj38dEs","y":"sQUNYFa4WynYIFY0jGBaCoRSJ-JgqmUmD_jtVZ2IAxU","kid":"lanyard-fuzz-es256","alg":"ES256","use":"sig"}]}"#;

/// What every input shares.
struct Fixture {
    /// Serves [`JWKS`] on its worker thread; inputs run on the caller's.
    runtime: tokio::runtime::Runtime,
    verifier: Verifier,
    key: EncodingKey,
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime for the JWKS server");
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("a loopback port for the JWKS server");
        let url = format!(
            "http://{}/jwks",
            listener.local_addr().expect("the JWKS server's address")
        );
        let app = axum::Router::new().route("/jwks", axum::routing::get(|| async { JWKS }));
        runtime.spawn(async move { axum::serve(listener, app).await });
        let keys = KeySet::new(KeySource::Jwks { url }, lanyard::http::client());
        Fixture {
            runtime,
            verifier: Verifier::new(ISSUER, keys),
            key: EncodingKey::from_ec_pem(PRIVATE_KEY_PEM.as_bytes()).expect("the fixture key"),
        }
    })
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let fixture = fixture();
    let token = match text.split_once('\n') {
        Some((header, claims)) if header.trim_start().starts_with('{') => {
            let message = format!(
                "{}.{}",
                URL_SAFE_NO_PAD.encode(header),
                URL_SAFE_NO_PAD.encode(claims)
            );
            // Signing does not depend on what is signed.
            let signature = jsonwebtoken::crypto::sign(message.as_bytes(), &fixture.key, ALG)
                .expect("the fixture key signs");
            format!("{message}.{signature}")
        }
        _ => text.trim().to_string(),
    };

    let verifier = &fixture.verifier;
    let before = super::now();
    let (claims, caller, again) = fixture.runtime.block_on(async {
        (
            verifier.verify_claims(&token, AUDIENCE).await,
            verifier.verify(&token, AUDIENCE).await,
            verifier.verify(&token, AUDIENCE).await,
        )
    });
    let after = super::now();
    for e in [
        claims.as_ref().err(),
        caller.as_ref().err(),
        again.as_ref().err(),
    ] {
        // The loopback server always answers: were it not to, every input
        // would be refused. (Other `Keys` errors, such as `NotRefetched`,
        // are the key set's to give.)
        let broken = matches!(
            e,
            Some(VerifyError::Keys(
                KeysError::Fetch { .. } | KeysError::Parse { .. }
            ))
        );
        assert!(!broken, "the JWKS fixture failed: {e:?}");
    }
    let Some((claims, caller, again)) = super::agreed(claims, caller, again) else {
        return;
    };

    let header = jsonwebtoken::decode_header(&token);
    let header = header.expect("accepted a token whose header does not decode");
    assert_eq!(header.alg, ALG, "accepted another algorithm than the key's");
    if let Some(kid) = &header.kid {
        assert_eq!(kid, KID, "accepted a kid the issuer does not publish");
    }
    assert_eq!(claims.iss, ISSUER, "accepted another issuer");
    assert!(claims.aud.contains(AUDIENCE), "accepted another audience");
    // jsonwebtoken refuses `exp < now - leeway`, with its clock read after
    // `before`.
    assert!(
        claims.exp.saturating_add(LEEWAY_SECS) >= before,
        "accepted an expired token"
    );
    let not_before = claims.nbf.unwrap_or(0).max(claims.iat);
    assert!(
        not_before <= after.saturating_add(LEEWAY_SECS),
        "accepted a token not valid yet"
    );
    super::assert_caller_of(&claims, &caller, &again);

    // The signature is what was checked: another one is refused.
    if let Some((message, signature)) = token.rsplit_once('.') {
        let other = if signature.starts_with('A') { 'B' } else { 'A' };
        let forged = format!("{message}.{other}{}", signature.get(1..).unwrap_or(""));
        let forged = fixture
            .runtime
            .block_on(verifier.verify_claims(&forged, AUDIENCE));
        assert_eq!(
            forged.err().map(|e| e.reason()),
            Some("signature"),
            "a token with another signature is not refused for it"
        );
    }
}
