//! The fuzz targets' bodies: one module per parsing surface, each with a
//! `run(&[u8])` that feeds the bytes to the product's own entry point and
//! panics only when the product does, or breaks a property it promises.
//!
//! The same files are compiled twice: here, by the `lanyard-fuzz` crate
//! that cargo-fuzz builds on nightly, and by the main crate's
//! `tests/fuzz_corpus.rs` (`#[path]` to this file), which replays every
//! seed in `fuzz/corpus/<target>/` and every crash kept in
//! `fuzz/artifacts/<target>/` on stable, in the normal test command. One
//! body, two harnesses: a crash fixed once stays fixed without nightly.
//! So the bodies use only `lanyard`'s public API and crates the main
//! crate already depends on, at the same versions; no `fuzzing` feature is
//! added to the product (and no product file changes for it).

pub mod admission_review;
pub mod cedar_policies;
pub mod config_yaml;
pub mod jwt_claims;
pub mod signed_tokens;
pub mod sts_xml;
pub mod surface_requests;

/// A target's body: runs one input, panicking on a failure.
pub type Body = fn(&[u8]);

/// Every target, by the name of its `fuzz_targets/` binary and its corpus
/// directory.
pub const TARGETS: [(&str, Body); 7] = [
    ("surface_requests", surface_requests::run),
    ("jwt_claims", jwt_claims::run),
    ("signed_tokens", signed_tokens::run),
    ("sts_xml", sts_xml::run),
    ("admission_review", admission_review::run),
    ("config_yaml", config_yaml::run),
    ("cedar_policies", cedar_policies::run),
];

/// The current Unix time in seconds.
fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// What an accepted token must hold, whichever verifier accepted it: its
/// subject is the ServiceAccount its `kubernetes.io` claim names, the
/// caller is read from the claims, and the memo's answer (`again`) is the
/// same caller.
fn assert_caller_of(
    claims: &lanyard::token::ServiceAccountClaims,
    caller: &lanyard::token::Caller,
    again: &lanyard::token::Caller,
) {
    let k = &claims.kubernetes;
    assert_eq!(
        lanyard::token::parse_subject(&claims.sub),
        Some((k.namespace.as_str(), k.serviceaccount.name.as_str())),
        "accepted a subject that is not its kubernetes.io ServiceAccount"
    );
    assert_eq!(caller.namespace, k.namespace);
    assert_eq!(caller.service_account, k.serviceaccount.name);
    assert_eq!(caller.service_account_uid, k.serviceaccount.uid);
    assert_eq!(caller.pod, k.pod);
    assert_eq!(caller.node, k.node);
    assert_eq!(caller.token_expires_at, claims.exp);
    assert_eq!(caller, again, "the memo answered another caller");
}

/// The three answers of a verifier for one token (`verify_claims`, then
/// `verify` twice, the second from its memo), when all accepted it; `None`
/// when all refused it; a panic when they disagree.
fn agreed<C, A, E>(
    claims: Result<C, E>,
    caller: Result<A, E>,
    again: Result<A, E>,
) -> Option<(C, A, A)> {
    match (claims, caller, again) {
        (Ok(claims), Ok(caller), Ok(again)) => Some((claims, caller, again)),
        (Err(_), Err(_), Err(_)) => None,
        (claims, caller, again) => panic!(
            "verify_claims and verify disagree: {:?} / {:?} / {:?}",
            claims.is_ok(),
            caller.is_ok(),
            again.is_ok()
        ),
    }
}
