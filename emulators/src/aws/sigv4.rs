//! AWS Signature Version 4 as a service checks it, written from the
//! specification ("Create a signed AWS API request", IAM User Guide) and
//! pinned by its published example, not shared with the product's signer:
//! a signer and a verifier built from one canonicalisation would agree on
//! its bugs.
//!
//! What STS checks, in the order AWS reports it (the order follows
//! `scratchstack-aws-signature`, a server-side implementation written
//! against AWS's answers; the texts are AWS's, as quoted in SDK issues and
//! the IAM guide's "Troubleshoot signed requests"):
//!
//! 1. an `Authorization` header at all (`MissingAuthenticationToken`),
//!    of algorithm `AWS4-HMAC-SHA256` with `Credential`, `SignedHeaders`,
//!    `Signature` and an `X-Amz-Date` header (`IncompleteSignature`);
//! 2. the date in ISO 8601 basic format (`IncompleteSignature`);
//! 3. `host` and `x-amz-date` among the signed headers;
//! 4. the date within 15 minutes of the server's clock ("Signature
//!    expired" / "Signature not yet current", `SignatureDoesNotMatch`);
//! 5. a five-part credential scope (`IncompleteSignature`) naming service
//!    `sts`, some region, terminator `aws4_request` and the request's date
//!    (`SignatureDoesNotMatch`);
//! 6. the access key and its session token (`InvalidClientTokenId`,
//!    `ExpiredToken`: the caller's lookup decides);
//! 7. an `x-amz-content-sha256`, when sent, equal to the body's digest;
//! 8. the signature itself, compared in constant time.
//!
//! Everything runs on bytes: header values are hashed as received, so a
//! proxy that rewrote one (or a client that signed another `host` than it
//! sent) fails here as it would at AWS.

use aws_lc_rs::hmac;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

/// The only signing algorithm STS accepts.
pub(super) const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// The service name every STS credential scope must carry.
pub(super) const SERVICE: &str = "sts";
/// The scope's terminator.
const TERMINATOR: &str = "aws4_request";
/// How far a request's date may be from the server's clock.
pub(super) const MAX_SKEW_SECS: i64 = 15 * 60;

/// AWS's text for a signature that does not verify.
pub(super) const SIGNATURE_MISMATCH: &str = "The request signature we calculated does not match the signature you provided. Check your AWS Secret Access Key and signing method. Consult the service documentation for details.";
/// AWS's text for a request that needs credentials and carries none.
pub(super) const MISSING_TOKEN: &str = "Request is missing Authentication Token";
/// AWS's text for an unknown access key or a session token that is not its.
pub(super) const INVALID_TOKEN: &str = "The security token included in the request is invalid.";
/// AWS's text for a session whose credentials have expired (no full stop).
pub(super) const EXPIRED_TOKEN: &str = "The security token included in the request is expired";

/// Why a request's signature was refused; each maps to one STS error code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SigV4Error {
    /// No `Authorization` header: `MissingAuthenticationToken` (403).
    Missing,
    /// A malformed `Authorization` header: `IncompleteSignature` (400).
    Incomplete(String),
    /// Scope, clock or signature wrong: `SignatureDoesNotMatch` (403).
    Mismatch(String),
    /// Unknown access key or wrong session token: `InvalidClientTokenId` (403).
    InvalidToken,
    /// The credentials' session has ended: `ExpiredToken` (403).
    ExpiredToken,
}

impl SigV4Error {
    /// STS's error code.
    pub(super) fn code(&self) -> &'static str {
        match self {
            SigV4Error::Missing => "MissingAuthenticationToken",
            SigV4Error::Incomplete(_) => "IncompleteSignature",
            SigV4Error::Mismatch(_) => "SignatureDoesNotMatch",
            SigV4Error::InvalidToken => "InvalidClientTokenId",
            SigV4Error::ExpiredToken => "ExpiredToken",
        }
    }

    /// STS's message.
    pub(super) fn message(&self) -> &str {
        match self {
            SigV4Error::Missing => MISSING_TOKEN,
            SigV4Error::Incomplete(m) | SigV4Error::Mismatch(m) => m,
            SigV4Error::InvalidToken => INVALID_TOKEN,
            SigV4Error::ExpiredToken => EXPIRED_TOKEN,
        }
    }
}

/// The parts of an HTTP request a signature covers.
pub(super) struct SignedRequest<'a> {
    /// `POST`, `GET`, …
    pub method: &'a str,
    /// The path as received (still percent-encoded).
    pub path: &'a str,
    /// The raw query string, without `?` (empty when there is none).
    pub query: &'a str,
    /// Every header as received.
    pub headers: &'a HeaderMap,
    /// The body as received.
    pub body: &'a [u8],
}

/// A parsed `Authorization: AWS4-HMAC-SHA256 …` header.
#[derive(Debug)]
struct Authorization<'a> {
    /// `AKID/DATE/REGION/SERVICE/aws4_request`.
    credential: &'a str,
    /// Lowercased by the client and sorted here, as the canonical request
    /// lists them.
    signed_headers: Vec<&'a str>,
    signature: &'a str,
}

/// What the caller's key lookup returns: the secret to verify with and
/// whatever the caller wants back once the signature holds.
pub(super) struct KeyMaterial<T> {
    /// The secret access key.
    pub secret: String,
    /// Handed back by [`verify`] on success.
    pub principal: T,
}

/// Verifies `request`'s SigV4 signature at `now` (unix seconds).
/// `lookup(access_key_id, session_token)` finds the credential: it answers
/// `InvalidToken` for an unknown key or a token that is not the key's, and
/// `ExpiredToken` for an ended session.
pub(super) fn verify<T>(
    request: &SignedRequest<'_>,
    now: i64,
    lookup: impl FnOnce(&str, Option<&str>) -> Result<KeyMaterial<T>, SigV4Error>,
) -> Result<T, SigV4Error> {
    verify_for_service(request, now, SERVICE, lookup)
}

/// [`verify`] for a scope naming `expected_service` (tests check the
/// verifier against AWS's published example, which is IAM's).
fn verify_for_service<T>(
    request: &SignedRequest<'_>,
    now: i64,
    expected_service: &str,
    lookup: impl FnOnce(&str, Option<&str>) -> Result<KeyMaterial<T>, SigV4Error>,
) -> Result<T, SigV4Error> {
    let headers = request.headers;
    let Some(raw) = headers.get(axum::http::header::AUTHORIZATION) else {
        return Err(SigV4Error::Missing);
    };
    // Latin-1 as HTTP allows; a header that is not text cannot be ours.
    let raw = raw
        .to_str()
        .map_err(|_| SigV4Error::Incomplete("Authorization header is not valid text.".into()))?;
    let amz_date = header_text(headers, "x-amz-date");
    let auth = parse_authorization(raw, amz_date.is_some())?;
    let amz_date = amz_date.unwrap_or_default();

    let Some(signed_at) = parse_amz_date(amz_date) else {
        return Err(SigV4Error::Incomplete(format!(
            "Date must be in ISO-8601 'basic format'. Got '{amz_date}'. See http://en.wikipedia.org/wiki/ISO_8601"
        )));
    };
    if !auth
        .signed_headers
        .iter()
        .any(|h| h.eq_ignore_ascii_case("host"))
    {
        return Err(SigV4Error::Mismatch(
            "'Host' or ':authority' must be a 'SignedHeader' in the AWS Authorization.".into(),
        ));
    }
    if !auth
        .signed_headers
        .iter()
        .any(|h| h.eq_ignore_ascii_case("x-amz-date"))
    {
        return Err(SigV4Error::Mismatch(
            "'X-Amz-Date' must be a 'SignedHeader' in the AWS Authorization.".into(),
        ));
    }
    check_clock(signed_at, now)?;

    let parts: Vec<&str> = auth.credential.split('/').collect();
    let [access_key_id, date, region, service, terminator] = parts.as_slice() else {
        return Err(SigV4Error::Incomplete(format!(
            "Credential must have exactly 5 slash-delimited elements, e.g. keyid/date/region/service/term, got '{}'",
            auth.credential
        )));
    };
    check_scope(
        date,
        region,
        service,
        terminator,
        amz_date,
        expected_service,
    )?;

    let token = header_text(headers, "x-amz-security-token");
    let key = lookup(access_key_id, token)?;

    let body_digest = hex(&Sha256::digest(request.body));
    if let Some(claimed) = header_text(headers, "x-amz-content-sha256") {
        // STS signs the body itself; a claimed digest must be the body's,
        // or the signature would not cover what was received.
        if !claimed.eq_ignore_ascii_case(&body_digest) {
            return Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()));
        }
    }
    let canonical = canonical_request(request, &auth.signed_headers, &body_digest);
    let scope = format!("{date}/{region}/{service}/{terminator}");
    let to_sign = string_to_sign(amz_date, &scope, &canonical);
    let signing_key = signing_key(&key.secret, date, region, service);
    let provided =
        unhex(auth.signature).ok_or_else(|| SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))?;
    hmac::verify(&signing_key, to_sign.as_bytes(), &provided)
        .map_err(|_| SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))?;
    Ok(key.principal)
}

/// A header's value as text, if present and text.
fn header_text<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Splits `AWS4-HMAC-SHA256 Credential=…, SignedHeaders=…, Signature=…`.
fn parse_authorization(raw: &str, has_date: bool) -> Result<Authorization<'_>, SigV4Error> {
    let raw = raw.trim();
    let (algorithm, rest) = raw.split_once(' ').unwrap_or((raw, ""));
    if algorithm != ALGORITHM {
        return Err(SigV4Error::Incomplete(format!(
            "Unsupported AWS 'algorithm': '{algorithm}'."
        )));
    }
    let (mut credential, mut signed_headers, mut signature) = (None, None, None);
    for parameter in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((name, value)) = parameter.split_once('=') else {
            return Err(SigV4Error::Incomplete(format!(
                "'{parameter}' not a valid key=value pair (missing equal-sign) in Authorization header: '{raw}'"
            )));
        };
        // The last of a repeated parameter wins, as at AWS.
        match name {
            "Credential" => credential = Some(value),
            "SignedHeaders" => signed_headers = Some(value),
            "Signature" => signature = Some(value),
            _ => {}
        }
    }
    let mut missing = Vec::new();
    if credential.is_none() {
        missing.push("Authorization header requires 'Credential' parameter.");
    }
    if signature.is_none() {
        missing.push("Authorization header requires 'Signature' parameter.");
    }
    if signed_headers.is_none() {
        missing.push("Authorization header requires 'SignedHeaders' parameter.");
    }
    if !has_date {
        missing.push(
            "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header.",
        );
    }
    match (credential, signed_headers, signature) {
        (Some(credential), Some(signed_headers), Some(signature)) if missing.is_empty() => {
            let mut signed_headers: Vec<&str> = signed_headers.split(';').collect();
            signed_headers.sort_unstable();
            Ok(Authorization {
                credential,
                signed_headers,
                signature,
            })
        }
        _ => Err(SigV4Error::Incomplete(format!(
            "{} Authorization={algorithm}",
            missing.join(" ")
        ))),
    }
}

/// `20150830T123600Z` as unix seconds.
pub(super) fn parse_amz_date(value: &str) -> Option<i64> {
    let format = time::macros::format_description!("[year][month][day]T[hour][minute][second]Z");
    time::PrimitiveDateTime::parse(value, format)
        .ok()
        .map(|t| t.assume_utc().unix_timestamp())
}

/// Unix seconds as `20150830T123600Z`.
pub(super) fn format_amz_date(unix: i64) -> String {
    let format = time::macros::format_description!("[year][month][day]T[hour][minute][second]Z");
    time::OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| t.format(format).ok())
        .unwrap_or_default()
}

/// AWS's 15-minute window, with its texts.
fn check_clock(signed_at: i64, now: i64) -> Result<(), SigV4Error> {
    let earliest = now - MAX_SKEW_SECS;
    let latest = now + MAX_SKEW_SECS;
    if signed_at < earliest {
        return Err(SigV4Error::Mismatch(format!(
            "Signature expired: {} is now earlier than {} ({} - 15 min.)",
            format_amz_date(signed_at),
            format_amz_date(earliest),
            format_amz_date(now)
        )));
    }
    if signed_at > latest {
        return Err(SigV4Error::Mismatch(format!(
            "Signature not yet current: {} is still later than {} ({} + 15 min.)",
            format_amz_date(signed_at),
            format_amz_date(latest),
            format_amz_date(now)
        )));
    }
    Ok(())
}

/// The credential scope's date, region, service and terminator; every
/// fault is reported at once, as AWS does. Any non-empty region is
/// accepted: STS answers on regional endpoints too.
fn check_scope(
    date: &str,
    region: &str,
    service: &str,
    terminator: &str,
    amz_date: &str,
    expected_service: &str,
) -> Result<(), SigV4Error> {
    let mut faults = Vec::new();
    if region.is_empty() {
        faults.push(format!(
            "Credential should be scoped to a valid region, not '{region}'."
        ));
    }
    if service != expected_service {
        faults.push(format!(
            "Credential should be scoped to correct service: '{expected_service}'."
        ));
    }
    if terminator != TERMINATOR {
        faults.push(format!(
            "Credential should be scoped with a valid terminator: '{TERMINATOR}', not '{terminator}'."
        ));
    }
    let request_day = amz_date.get(..8).unwrap_or(amz_date);
    if date != request_day {
        faults.push(format!(
            "Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: '{date}' != '{request_day}', from '{amz_date}'."
        ));
    }
    if faults.is_empty() {
        Ok(())
    } else {
        Err(SigV4Error::Mismatch(faults.join(" ")))
    }
}

/// The canonical request: method, canonical URI, canonical query string,
/// the signed headers' canonical lines, the signed-header list and the
/// payload's hex SHA-256, joined by newlines.
pub(super) fn canonical_request(
    request: &SignedRequest<'_>,
    signed_headers: &[&str],
    payload_digest: &str,
) -> Vec<u8> {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(request.method.as_bytes());
    out.push(b'\n');
    out.extend_from_slice(canonical_uri(request.path).as_bytes());
    out.push(b'\n');
    out.extend_from_slice(canonical_query(request.query).as_bytes());
    out.push(b'\n');
    for name in signed_headers {
        let lower = name.to_ascii_lowercase();
        let mut values = request.headers.get_all(lower.as_str()).iter().peekable();
        if values.peek().is_none() {
            // A header signed but not received: the line is absent, so the
            // signature cannot match.
            continue;
        }
        out.extend_from_slice(lower.as_bytes());
        out.push(b':');
        for (i, value) in values.enumerate() {
            if i > 0 {
                out.push(b',');
            }
            canonical_header_value(value.as_bytes(), &mut out);
        }
        out.push(b'\n');
    }
    out.push(b'\n');
    out.extend_from_slice(signed_headers.join(";").as_bytes());
    out.push(b'\n');
    out.extend_from_slice(payload_digest.as_bytes());
    out
}

/// A header value trimmed, with runs of spaces collapsed to one.
fn canonical_header_value(value: &[u8], out: &mut Vec<u8>) {
    let trimmed = value.trim_ascii();
    let mut previous_space = false;
    for &b in trimmed {
        let space = b == b' ';
        if !(space && previous_space) {
            out.push(b);
        }
        previous_space = space;
    }
}

/// The path with `.`/`..` segments resolved and empty segments dropped,
/// each segment URI-encoded again (so an encoded path is encoded twice, as
/// every service but S3 expects).
fn canonical_uri(path: &str) -> String {
    let mut segments: Vec<&str> = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::from("/");
    out.push_str(
        &segments
            .iter()
            .map(|s| uri_encode(s.as_bytes(), true))
            .collect::<Vec<_>>()
            .join("/"),
    );
    if path.ends_with('/') && !segments.is_empty() {
        out.push('/');
    }
    out
}

/// Each name and value percent-decoded, URI-encoded again, and the pairs
/// sorted by name, then value.
fn canonical_query(query: &str) -> String {
    let mut pairs: Vec<(String, String)> = query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (
                uri_encode(&percent_decode(name), true),
                uri_encode(&percent_decode(value), true),
            )
        })
        .collect();
    pairs.sort();
    pairs
        .iter()
        .map(|(n, v)| format!("{n}={v}"))
        .collect::<Vec<_>>()
        .join("&")
}

/// `%XX` sequences to bytes; anything else (including `+`) literally.
fn percent_decode(s: &str) -> Vec<u8> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hi = bytes.get(i + 1).and_then(|&b| hex_value(b));
            let lo = bytes.get(i + 2).and_then(|&b| hex_value(b));
            if let (Some(hi), Some(lo)) = (hi, lo) {
                out.push(hi << 4 | lo);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// RFC 3986 encoding as SigV4 specifies it: unreserved characters as they
/// are, every other byte as `%XX` in upper case (`/` too when `encode_slash`).
fn uri_encode(bytes: &[u8], encode_slash: bool) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(bytes.len());
    for &b in bytes {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (b == b'/' && !encode_slash)
        {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0x0f)]));
        }
    }
    out
}

/// `AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hex sha256(canonical)}`.
pub(super) fn string_to_sign(amz_date: &str, scope: &str, canonical: &[u8]) -> String {
    format!(
        "{ALGORITHM}\n{amz_date}\n{scope}\n{}",
        hex(&Sha256::digest(canonical))
    )
}

/// kSigning: HMAC chain over date, region, service and `aws4_request`,
/// keyed first by `AWS4` + the secret.
pub(super) fn signing_key(secret: &str, date: &str, region: &str, service: &str) -> hmac::Key {
    let step = |key: &[u8], data: &str| {
        hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data.as_bytes())
    };
    let k_date = step(format!("AWS4{secret}").as_bytes(), date);
    let k_region = step(k_date.as_ref(), region);
    let k_service = step(k_region.as_ref(), service);
    let k_signing = step(k_service.as_ref(), TERMINATOR);
    hmac::Key::new(hmac::HMAC_SHA256, k_signing.as_ref())
}

/// Lowercase hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    out
}

/// Hex (either case) to bytes; `None` unless every character is a digit
/// and the length is even.
fn unhex(s: &str) -> Option<Vec<u8>> {
    let bytes = s.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks(2)
        .map(|pair| Some(hex_value(pair[0])? << 4 | hex_value(pair[1])?))
        .collect()
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// A client-side signer for tests: what botocore does, from the same
/// specification, so requests can be built that the verifier must accept
/// or refuse. (The published example pins the shared canonicalisation.)
#[cfg(test)]
pub(super) mod testing {
    use super::*;

    /// Credentials and scope to sign with.
    pub(crate) struct Signer<'a> {
        pub access_key_id: &'a str,
        pub secret: &'a str,
        pub region: &'a str,
        pub service: &'a str,
    }

    impl Signer<'_> {
        /// The `Authorization` value for `request` signed at `amz_date`
        /// over `signed_headers` (lowercase, sorted).
        pub(crate) fn authorization(
            &self,
            request: &SignedRequest<'_>,
            signed_headers: &[&str],
            amz_date: &str,
        ) -> String {
            let date = &amz_date[..8];
            let scope = format!("{date}/{}/{}/{TERMINATOR}", self.region, self.service);
            let canonical =
                canonical_request(request, signed_headers, &hex(&Sha256::digest(request.body)));
            let to_sign = string_to_sign(amz_date, &scope, &canonical);
            let key = signing_key(self.secret, date, self.region, self.service);
            let signature = hex(hmac::sign(&key, to_sign.as_bytes()).as_ref());
            format!(
                "{ALGORITHM} Credential={}/{scope}, SignedHeaders={}, Signature={signature}",
                self.access_key_id,
                signed_headers.join(";")
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::Signer;
    use super::*;
    use axum::http::HeaderValue;

    // The example of the IAM User Guide ("Create a signed AWS API request",
    // and the older "Signature Version 4 signing process" examples):
    // GET https://iam.amazonaws.com/?Action=ListUsers&Version=2010-05-08.
    const DOC_SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
    const DOC_DATE: &str = "20150830T123600Z";
    const DOC_CANONICAL_HASH: &str =
        "f536975d06c0309214f805bb90ccff089219ecd68b2577efef23edd43b7e1a59";
    const DOC_SIGNING_KEY: &str =
        "c4afb1cc5771d871763a393e44b703571b55cc28424d1a5e86da6ed3c154a4b9";
    const DOC_SIGNATURE: &str = "5d672d79c15b13162d9279b0855cfba6789a8edb4c82c400e06b5924a6f2b5d7";

    fn doc_headers() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/x-www-form-urlencoded; charset=utf-8"),
        );
        h.insert("host", HeaderValue::from_static("iam.amazonaws.com"));
        h.insert("x-amz-date", HeaderValue::from_static(DOC_DATE));
        h
    }

    fn doc_request(headers: &HeaderMap) -> SignedRequest<'_> {
        SignedRequest {
            method: "GET",
            path: "/",
            query: "Action=ListUsers&Version=2010-05-08",
            headers,
            body: b"",
        }
    }

    #[test]
    fn sigv4_reproduces_the_documented_example_step_by_step() {
        let headers = doc_headers();
        let request = doc_request(&headers);
        let signed = ["content-type", "host", "x-amz-date"];
        let canonical = canonical_request(&request, &signed, &hex(&Sha256::digest(b"")));
        assert_eq!(
            String::from_utf8(canonical.clone()).unwrap(),
            "GET\n/\nAction=ListUsers&Version=2010-05-08\ncontent-type:application/x-www-form-urlencoded; charset=utf-8\nhost:iam.amazonaws.com\nx-amz-date:20150830T123600Z\n\ncontent-type;host;x-amz-date\ne3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(hex(&Sha256::digest(&canonical)), DOC_CANONICAL_HASH);
        let to_sign = string_to_sign(DOC_DATE, "20150830/us-east-1/iam/aws4_request", &canonical);
        assert_eq!(
            to_sign,
            format!("AWS4-HMAC-SHA256\n{DOC_DATE}\n20150830/us-east-1/iam/aws4_request\n{DOC_CANONICAL_HASH}")
        );
        // kSigning itself, through the same chain without the final Key.
        let step = |key: &[u8], data: &str| {
            hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data.as_bytes())
        };
        let k = step(format!("AWS4{DOC_SECRET}").as_bytes(), "20150830");
        let k = step(k.as_ref(), "us-east-1");
        let k = step(k.as_ref(), "iam");
        let k = step(k.as_ref(), "aws4_request");
        assert_eq!(hex(k.as_ref()), DOC_SIGNING_KEY);
        let key = signing_key(DOC_SECRET, "20150830", "us-east-1", "iam");
        assert_eq!(
            hex(hmac::sign(&key, to_sign.as_bytes()).as_ref()),
            DOC_SIGNATURE
        );
    }

    #[test]
    fn sigv4_verifier_accepts_the_documented_request_and_only_with_its_secret() {
        let mut headers = doc_headers();
        headers.insert(
            "authorization",
            HeaderValue::from_str(&format!(
                "AWS4-HMAC-SHA256 Credential=AKIDEXAMPLE/20150830/us-east-1/iam/aws4_request, SignedHeaders=content-type;host;x-amz-date, Signature={DOC_SIGNATURE}"
            ))
            .unwrap(),
        );
        let request = doc_request(&headers);
        let now = parse_amz_date(DOC_DATE).unwrap();
        let with_secret = |secret: &'static str| {
            move |akid: &str, token: Option<&str>| {
                assert_eq!((akid, token), ("AKIDEXAMPLE", None));
                Ok(KeyMaterial {
                    secret: secret.to_string(),
                    principal: "iam-user",
                })
            }
        };
        assert_eq!(
            verify_for_service(&request, now, "iam", with_secret(DOC_SECRET)),
            Ok("iam-user")
        );
        assert_eq!(
            verify_for_service(
                &request,
                now,
                "iam",
                with_secret("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEZ")
            ),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
        // STS's verifier refuses a scope for IAM before looking at keys.
        assert_eq!(
            verify(&request, now, |_, _| -> Result<KeyMaterial<()>, _> {
                unreachable!("the scope is checked before keys")
            }),
            Err(SigV4Error::Mismatch(
                "Credential should be scoped to correct service: 'sts'.".into()
            ))
        );
    }

    const AKID: &str = "ASIATESTTESTTESTTEST";
    const SECRET: &str = "c2VjcmV0LXNlY3JldC1zZWNyZXQtc2VjcmV0LXNl";
    const TOKEN: &str = "IQoJb3JpZ2luX2VjEtoken+/=";
    const BODY: &[u8] = b"Action=GetCallerIdentity&Version=2011-06-15";

    /// A signed STS request as botocore sends it, at `amz_date`.
    fn sts_headers(secret: &str, amz_date: &str, body: &[u8]) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            "content-type",
            HeaderValue::from_static("application/x-www-form-urlencoded; charset=utf-8"),
        );
        h.insert(
            "host",
            HeaderValue::from_static("sts.us-east-1.amazonaws.com"),
        );
        h.insert("x-amz-date", HeaderValue::from_str(amz_date).unwrap());
        h.insert("x-amz-security-token", HeaderValue::from_static(TOKEN));
        let signer = Signer {
            access_key_id: AKID,
            secret,
            region: "us-east-1",
            service: "sts",
        };
        let auth = signer.authorization(
            &SignedRequest {
                method: "POST",
                path: "/",
                query: "",
                headers: &h,
                body,
            },
            &["content-type", "host", "x-amz-date", "x-amz-security-token"],
            amz_date,
        );
        h.insert("authorization", HeaderValue::from_str(&auth).unwrap());
        h
    }

    fn lookup(
        expired: bool,
    ) -> impl FnOnce(&str, Option<&str>) -> Result<KeyMaterial<&'static str>, SigV4Error> {
        move |akid, token| {
            if akid != AKID || token != Some(TOKEN) {
                return Err(SigV4Error::InvalidToken);
            }
            if expired {
                return Err(SigV4Error::ExpiredToken);
            }
            Ok(KeyMaterial {
                secret: SECRET.into(),
                principal: "caller",
            })
        }
    }

    fn check(headers: &HeaderMap, body: &[u8], now: i64) -> Result<&'static str, SigV4Error> {
        verify(
            &SignedRequest {
                method: "POST",
                path: "/",
                query: "",
                headers,
                body,
            },
            now,
            lookup(false),
        )
    }

    const NOW: i64 = 1_767_225_600; // 2026-01-01T00:00:00Z

    #[test]
    fn sigv4_accepts_its_own_signature_and_refuses_each_fault() {
        let date = format_amz_date(NOW);
        assert_eq!(date, "20260101T000000Z");
        let good = sts_headers(SECRET, &date, BODY);
        assert_eq!(check(&good, BODY, NOW), Ok("caller"));

        // Wrong secret.
        let bad = sts_headers("wrong-secret", &date, BODY);
        assert_eq!(
            check(&bad, BODY, NOW),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
        // Tampered body.
        assert_eq!(
            check(&good, b"Action=GetCallerIdentity&Version=2011-06-16", NOW),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
        // Wrong or missing token.
        let mut other_token = good.clone();
        other_token.insert("x-amz-security-token", HeaderValue::from_static("other"));
        assert_eq!(
            check(&other_token, BODY, NOW),
            Err(SigV4Error::InvalidToken)
        );
        let mut no_token = good.clone();
        no_token.remove("x-amz-security-token");
        assert_eq!(check(&no_token, BODY, NOW), Err(SigV4Error::InvalidToken));
        // Expired session.
        assert_eq!(
            verify(
                &SignedRequest {
                    method: "POST",
                    path: "/",
                    query: "",
                    headers: &good,
                    body: BODY
                },
                NOW,
                lookup(true)
            ),
            Err(SigV4Error::ExpiredToken)
        );
        // A host other than the one signed.
        let mut moved = good.clone();
        moved.insert("host", HeaderValue::from_static("127.0.0.1:8080"));
        assert_eq!(
            check(&moved, BODY, NOW),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
        // A claimed payload digest that is not the body's.
        let mut claimed = good.clone();
        claimed.insert(
            "x-amz-content-sha256",
            HeaderValue::from_static("UNSIGNED-PAYLOAD"),
        );
        assert_eq!(
            check(&claimed, BODY, NOW),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
        let mut honest = good.clone();
        honest.insert(
            "x-amz-content-sha256",
            HeaderValue::from_str(&hex(&Sha256::digest(BODY))).unwrap(),
        );
        assert_eq!(check(&honest, BODY, NOW), Ok("caller"));
    }

    #[test]
    fn sigv4_refuses_skewed_clocks_with_aws_texts() {
        let old = sts_headers(SECRET, &format_amz_date(NOW - 16 * 60), BODY);
        assert_eq!(
            check(&old, BODY, NOW),
            Err(SigV4Error::Mismatch(
                "Signature expired: 20251231T234400Z is now earlier than 20251231T234500Z (20260101T000000Z - 15 min.)".into()
            ))
        );
        let future = sts_headers(SECRET, &format_amz_date(NOW + 16 * 60), BODY);
        assert_eq!(
            check(&future, BODY, NOW),
            Err(SigV4Error::Mismatch(
                "Signature not yet current: 20260101T001600Z is still later than 20260101T001500Z (20260101T000000Z + 15 min.)".into()
            ))
        );
        // Within the window either way.
        let slightly = sts_headers(SECRET, &format_amz_date(NOW - 14 * 60), BODY);
        assert_eq!(check(&slightly, BODY, NOW), Ok("caller"));
    }

    #[test]
    fn sigv4_reports_malformed_headers_like_aws() {
        let date = format_amz_date(NOW);
        let mut h = sts_headers(SECRET, &date, BODY);
        h.remove("authorization");
        assert_eq!(check(&h, BODY, NOW), Err(SigV4Error::Missing));

        h.insert(
            "authorization",
            HeaderValue::from_static("AWS4-HMAC-SHA256 Credential=x"),
        );
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Incomplete(
                "Authorization header requires 'Signature' parameter. Authorization header requires 'SignedHeaders' parameter. Authorization=AWS4-HMAC-SHA256".into()
            ))
        );
        h.insert("authorization", HeaderValue::from_static("Bearer abc"));
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Incomplete(
                "Unsupported AWS 'algorithm': 'Bearer'.".into()
            ))
        );
        h.insert(
            "authorization",
            HeaderValue::from_static(
                "AWS4-HMAC-SHA256 Credential=a/b, SignedHeaders=host;x-amz-date, Signature=00",
            ),
        );
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Incomplete(
                "Credential must have exactly 5 slash-delimited elements, e.g. keyid/date/region/service/term, got 'a/b'".into()
            ))
        );
        h.insert(
            "authorization",
            HeaderValue::from_static("AWS4-HMAC-SHA256 Credential=a/20260101/us-east-1/sts/aws4_request, SignedHeaders=x-amz-date, Signature=00"),
        );
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Mismatch(
                "'Host' or ':authority' must be a 'SignedHeader' in the AWS Authorization.".into()
            ))
        );
        h.insert(
            "authorization",
            HeaderValue::from_static("AWS4-HMAC-SHA256 Credential=a/20251231/eu-west-1/iam/aws5_request, SignedHeaders=host;x-amz-date, Signature=00"),
        );
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Mismatch(
                "Credential should be scoped to correct service: 'sts'. Credential should be scoped with a valid terminator: 'aws4_request', not 'aws5_request'. Date in Credential scope does not match YYYYMMDD from ISO-8601 version of date from HTTP: '20251231' != '20260101', from '20260101T000000Z'.".into()
            ))
        );
        h.insert(
            "x-amz-date",
            HeaderValue::from_static("2026-01-01T00:00:00Z"),
        );
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Incomplete(
                "Date must be in ISO-8601 'basic format'. Got '2026-01-01T00:00:00Z'. See http://en.wikipedia.org/wiki/ISO_8601".into()
            ))
        );
        h.remove("x-amz-date");
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Incomplete(
                "Authorization header requires existence of either a 'X-Amz-Date' or a 'Date' header. Authorization=AWS4-HMAC-SHA256".into()
            ))
        );
    }

    #[test]
    fn sigv4_survives_hostile_signed_header_lists() {
        let date = format_amz_date(NOW);
        let mut h = sts_headers(SECRET, &date, BODY);
        for list in [
            "host;x-amz-date;bad header;\"quoted\";;",
            "host;x-amz-date;x-amz-date;host",
            "HOST;X-Amz-Date",
        ] {
            let auth = format!(
                "AWS4-HMAC-SHA256 Credential={AKID}/20260101/us-east-1/sts/aws4_request, SignedHeaders={list}, Signature={}",
                "0".repeat(64)
            );
            h.insert("authorization", HeaderValue::from_str(&auth).unwrap());
            assert_eq!(
                check(&h, BODY, NOW),
                Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into())),
                "{list}"
            );
        }
        let auth = format!(
            "AWS4-HMAC-SHA256 Credential={AKID}/20260101/us-east-1/sts/aws4_request, SignedHeaders=host;x-amz-date, Signature=not-hex"
        );
        h.insert("authorization", HeaderValue::from_str(&auth).unwrap());
        assert_eq!(
            check(&h, BODY, NOW),
            Err(SigV4Error::Mismatch(SIGNATURE_MISMATCH.into()))
        );
    }

    #[test]
    fn sigv4_canonicalises_paths_and_queries() {
        assert_eq!(canonical_uri(""), "/");
        assert_eq!(canonical_uri("/"), "/");
        assert_eq!(canonical_uri("/a/./b/../c//d/"), "/a/c/d/");
        assert_eq!(canonical_uri("/a%20b"), "/a%2520b");
        assert_eq!(canonical_query(""), "");
        assert_eq!(canonical_query("b=2&a=z&a=y&c"), "a=y&a=z&b=2&c=");
        assert_eq!(canonical_query("k=a%2Fb+c~"), "k=a%2Fb%2Bc~");
        assert_eq!(unhex("0aFf"), Some(vec![0x0a, 0xff]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
    }
}
