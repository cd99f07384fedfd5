//! Service-account token parsing and claim checks.
//!
//! The input is a token as a pod presents it (the bytes of an
//! `Authorization: Bearer` value or a projected token file), or, when it
//! starts with `{`, the token's claims as JSON, wrapped here in an unsigned
//! RS256 token: the fuzzer then mutates the claims themselves instead of
//! their base64. It goes through the verifier a standalone sidecar uses
//! ([`Verifier::local_files`]: header, algorithm, claims, audience, times,
//! subject; the signature is the cloud's to check) and through the
//! unverified readers the agent uses to pick an issuer and word errors.
//!
//! Beside "never panics": a token the verifier accepts names the audience
//! asked for, is not expired, and its subject is the ServiceAccount its
//! `kubernetes.io` claim names; [`Verifier::verify`] agrees with
//! [`Verifier::verify_claims`], twice (the second answer comes from its
//! memo).

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;

use lanyard::token::{
    parse_subject, unverified_audiences, unverified_issuer, Verifier, LEEWAY_SECS,
};

/// The audience asked for (Azure's, as the agent asks it).
const AUDIENCE: &str = "api://AzureADTokenExchange";

/// Runs one input.
pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let token = if text.trim_start().starts_with('{') {
        format!(
            "{}.{}.c2lnbmF0dXJl",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"RS256","typ":"JWT","kid":"fuzz"}"#),
            URL_SAFE_NO_PAD.encode(text)
        )
    } else {
        text.trim().to_string()
    };
    let _ = unverified_issuer(&token);
    let _ = unverified_audiences(&token);
    let _ = parse_subject(text);

    // Read before verifying: the verifier's bound is inclusive, so a
    // second ticking over in between must not fail the check below.
    let now = super::now();
    let verifier = Verifier::local_files();
    let claims = futures::executor::block_on(verifier.verify_claims(&token, AUDIENCE));
    let caller = futures::executor::block_on(verifier.verify(&token, AUDIENCE));
    let again = futures::executor::block_on(verifier.verify(&token, AUDIENCE));
    let Some((claims, caller, again)) = super::agreed(claims, caller, again) else {
        return;
    };
    assert!(claims.aud.contains(AUDIENCE), "accepted another audience");
    assert!(
        claims.exp.saturating_add(LEEWAY_SECS) >= now,
        "accepted an expired token"
    );
    super::assert_caller_of(&claims, &caller, &again);
}
