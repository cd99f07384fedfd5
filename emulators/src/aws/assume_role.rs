//! `AssumeRole` and `GetCallerIdentity`: the two signed actions.
//!
//! Every caller of `AssumeRole` here holds credentials of an earlier
//! session (the emulator has no IAM users), so every call is role chaining
//! and AWS's rules for chains apply: at most one hour, transitive session
//! tags carried over and never overridden.
//!
//! Checks, in order (each with AWS's code and text; sources in the
//! constants' comments):
//!
//! 1. the API model's constraints, collected into one `ValidationError`
//!    (`RoleArn`, `RoleSessionName`, `Policy`, `DurationSeconds`, `Tags`,
//!    `TransitiveTagKeys`, `ExternalId`);
//! 2. the role ARN's shape (`ValidationError` "ARN is invalid");
//! 3. the session policy's JSON (`MalformedPolicyDocument`);
//! 4. tag semantics: keys unique regardless of case, transitive keys among
//!    the tags, no tag overriding an inherited transitive tag
//!    (`InvalidParameterValue`);
//! 5. the role's trust policy: the role exists, trusts the caller's role
//!    (or its account), and its `sts:ExternalId` condition holds
//!    (`AccessDenied`, the same text for all three, so callers cannot probe);
//! 6. `sts:TagSession` when the session gets tags, passed or inherited
//!    (`AccessDenied`);
//! 7. the one-hour chaining limit, then the role's `MaxSessionDuration`
//!    (`ValidationError`);
//! 8. the packed size of tags and policy (`PackedPolicyTooLarge`).
//!
//! ## The packed-size model
//!
//! AWS compresses session policies and tags into a binary form of
//! undocumented size and reports how full it is as a percentage
//! (`PackedPolicySize`). The emulator models it deterministically:
//!
//! `percent = ceil((Σ UTF-8 bytes of every tag key and value the session
//! carries, passed and inherited + UTF-8 bytes of the policy) × 100 /
//! AwsEmulatorConfig::packed_policy_limit)`
//!
//! With the default limit ([`super::DEFAULT_PACKED_POLICY_LIMIT`], 2048
//! bytes) the six session tags EKS Pod Identity sets, with realistic
//! values (keys 114 bytes, values 100–250), come to 11–18%; 50 tags of
//! 256-character values (over 12,800 bytes) overflow six times over, as
//! they would at AWS. Over 100% the request
//! fails; otherwise the answer carries `PackedPolicySize` whenever the
//! session has tags or a policy.

use std::collections::{BTreeMap, HashMap, HashSet};

use axum::http::StatusCode;
use axum::response::Response;
use quick_xml::escape::escape;

use super::sessions::{Principal, SessionAction};
use super::validation::{duration, external_id_char, policy_char, tag_char, Shown, Violations};
use super::{sts_error, xml_response, AwsRole, AwsSts, Grant, StsError, STS_NAMESPACE};
use crate::arn::RoleArn;

/// STS's bounds on an `AssumeRole` session, independent of the role.
const MIN_DURATION: u64 = 900;
const MAX_DURATION: u64 = 43_200;
const DEFAULT_DURATION: u64 = 3600;
/// The longest session a chained `AssumeRole` may ask for.
const CHAINED_MAX_DURATION: u64 = 3600;
/// The API model's limits (botocore's `sts/2011-06-15/service-2.json`).
const MAX_TAGS: usize = 50;
const MAX_TAG_KEY: usize = 128;
const MAX_TAG_VALUE: usize = 256;
/// The plaintext limit on session policies (the AssumeRole reference:
/// "can't exceed 2,048 characters").
const MAX_POLICY: usize = 2048;

// AWS's texts for refused tags, recorded against AWS by LocalStack's
// snapshot tests (tests/aws/services/sts/test_sts.snapshot.json).
const DUPLICATE_TAG_KEYS: &str =
    "Duplicate tag keys found. Please note that Tag keys are case insensitive.";
const TRANSITIVE_KEY_NOT_A_TAG: &str =
    "The specified transitive tag key must be included in the requested tags.";
const OVERRIDES_INHERITED_TAG: &str = "One of the specified transitive tag keys can't be set because it conflicts with a transitive tag key from the calling session.";
// STS's answers quoted in SDK issues (aws-vault#263, eks-anywhere#9485).
const CHAINED_TOO_LONG: &str =
    "The requested DurationSeconds exceeds the 1 hour session limit for roles assumed by role chaining.";
const OVER_MAX_SESSION: &str =
    "The requested DurationSeconds exceeds the MaxSessionDuration set for this role.";
// STS's answer to a session policy that is not JSON (Hadoop S3A's
// assumed-roles troubleshooting guide quotes it), and to JSON that is not
// a policy document.
const POLICY_NOT_JSON: &str = "The policy is not in the valid JSON format.";
const POLICY_SYNTAX: &str = "Syntax errors in policy.";

/// The `AssumeRole` request after the model's constraints.
struct AssumeRoleRequest<'a> {
    role_arn: &'a str,
    session_name: &'a str,
    duration: u64,
    external_id: Option<&'a str>,
    policy: Option<&'a str>,
    tags: Vec<(&'a str, &'a str)>,
    transitive_keys: Vec<&'a str>,
}

/// The members of a query-protocol list (`PREFIX.N.FIELD=value`), by
/// their index `N` (from 1), each with its fields (`""` for a list of
/// strings, `PREFIX.N=value`). Other indices are not list members.
fn list_members<'a>(
    form: &'a HashMap<String, String>,
    prefix: &str,
) -> BTreeMap<u32, HashMap<&'a str, &'a str>> {
    let mut members: BTreeMap<u32, HashMap<&str, &str>> = BTreeMap::new();
    for (name, value) in form {
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let (index, field) = rest.split_once('.').unwrap_or((rest, ""));
        match index.parse::<u32>() {
            Ok(n) if n >= 1 => {
                members.entry(n).or_default().insert(field, value.as_str());
            }
            _ => {}
        }
    }
    members
}

/// A tag key against `tagKeyType` (1–128, `[\p{L}\p{Z}\p{N}_.:/=+\-@]+`).
fn check_tag_key(violations: &mut Violations, key: &str, member: &str) {
    violations.length(key, Shown::Value(key), member, 1, MAX_TAG_KEY);
    if key.is_empty() || !key.chars().all(tag_char) {
        violations.fail(
            Shown::Value(key),
            member,
            r"Member must satisfy regular expression pattern: [\p{L}\p{Z}\p{N}_.:/=+\-@]+",
        );
    }
}

/// Applies the API model's constraints to the form.
fn parse_request(form: &HashMap<String, String>) -> Result<AssumeRoleRequest<'_>, StsError> {
    let field = |name: &str| form.get(name).map(String::as_str);
    let mut v = Violations::default();

    let role_arn = field("RoleArn");
    let session_name = field("RoleSessionName");
    v.role_and_session(role_arn, session_name);
    let policy = field("Policy");
    if let Some(p) = policy {
        v.length(p, Shown::Value(p), "policy", 1, MAX_POLICY);
        v.pattern(
            p,
            Shown::Value(p),
            "policy",
            policy_char,
            r"[\u0009\u000A\u000D\u0020-\u00FF]+",
        );
    }
    let duration = duration(
        &mut v,
        field("DurationSeconds"),
        MIN_DURATION,
        MAX_DURATION,
        DEFAULT_DURATION,
    );

    let tag_members = list_members(form, "Tags.member.");
    if tag_members.len() > MAX_TAGS {
        v.fail(
            Shown::Hidden,
            "tags",
            &format!("Member must have length less than or equal to {MAX_TAGS}"),
        );
    }
    let mut tags = Vec::with_capacity(tag_members.len().min(MAX_TAGS));
    for (position, fields) in (1..).zip(tag_members.values()) {
        let key_member = format!("tags.{position}.member.key");
        let value_member = format!("tags.{position}.member.value");
        let key = fields.get("Key").copied();
        let value = fields.get("Value").copied();
        match key {
            None => v.fail(Shown::Null, &key_member, "Member must not be null"),
            Some(k) => check_tag_key(&mut v, k, &key_member),
        }
        match value {
            None => v.fail(Shown::Null, &value_member, "Member must not be null"),
            Some(val) => {
                v.length(val, Shown::Value(val), &value_member, 0, MAX_TAG_VALUE);
                v.pattern(
                    val,
                    Shown::Value(val),
                    &value_member,
                    tag_char,
                    r"[\p{L}\p{Z}\p{N}_.:/=+\-@]*",
                );
            }
        }
        if let (Some(k), Some(val)) = (key, value) {
            tags.push((k, val));
        }
    }

    let key_members = list_members(form, "TransitiveTagKeys.member.");
    if key_members.len() > MAX_TAGS {
        v.fail(
            Shown::Hidden,
            "transitiveTagKeys",
            &format!("Member must have length less than or equal to {MAX_TAGS}"),
        );
    }
    let mut transitive_keys = Vec::with_capacity(key_members.len().min(MAX_TAGS));
    for (position, fields) in (1..).zip(key_members.values()) {
        let member = format!("transitiveTagKeys.{position}.member");
        match fields.get("").copied() {
            None => v.fail(Shown::Null, &member, "Member must not be null"),
            Some(k) => {
                check_tag_key(&mut v, k, &member);
                transitive_keys.push(k);
            }
        }
    }

    let external_id = field("ExternalId");
    if let Some(id) = external_id {
        v.length(id, Shown::Value(id), "externalId", 2, 1224);
        v.pattern(
            id,
            Shown::Value(id),
            "externalId",
            external_id_char,
            r"[\w+=,.@:\/-]*",
        );
    }

    match (role_arn, session_name) {
        (Some(role_arn), Some(session_name)) if v.is_empty() => Ok(AssumeRoleRequest {
            role_arn,
            session_name,
            duration,
            external_id,
            policy,
            tags,
            transitive_keys,
        }),
        _ => {
            v.finish()?;
            // Unreachable: a missing member is a violation.
            Err(sts_error(
                StatusCode::BAD_REQUEST,
                "ValidationError",
                "1 validation error detected",
            ))
        }
    }
}

/// Whether `value` has an ARN's six parts, with partition, service and
/// resource non-empty (what STS checks before looking the role up).
fn arn_shaped(value: &str) -> bool {
    let parts: Vec<&str> = value.splitn(6, ':').collect();
    matches!(parts.as_slice(), ["arn", partition, service, _, _, resource]
        if !partition.is_empty() && !service.is_empty() && !resource.is_empty())
}

/// STS's refusal of an action on a role by a session: the same for a
/// missing role, an untrusted caller and a wrong external id.
fn not_authorized(caller: &Principal, action: &str, role_arn: &str) -> StsError {
    sts_error(
        StatusCode::FORBIDDEN,
        "AccessDenied",
        format!(
            "User: {} is not authorized to perform: {action} on resource: {role_arn}",
            caller.assumed_role_arn
        ),
    )
}

fn invalid_parameter(message: &str) -> StsError {
    sts_error(StatusCode::BAD_REQUEST, "InvalidParameterValue", message)
}

/// Whether `role`'s trust policy names the caller: its role ARN, or its
/// account (`arn:PARTITION:iam::ACCOUNT:root` or the bare 12-digit id; the
/// emulator has no identity policies, so an account grant suffices).
fn trusts(role: &AwsRole, caller: &Principal) -> bool {
    role.trusted_roles.iter().any(|principal| {
        if principal == &caller.role_arn || principal == &caller.account {
            return true;
        }
        let parts: Vec<&str> = principal.splitn(6, ':').collect();
        matches!(parts.as_slice(), ["arn", _, "iam", "", account, "root"] if *account == caller.account)
    })
}

/// Bytes of every tag key and value.
fn tag_bytes<'a>(tags: impl IntoIterator<Item = (&'a str, &'a str)>) -> usize {
    tags.into_iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// The packed-size percentage of `bytes` against `limit` (rounded up).
pub(super) fn packed_percent(bytes: usize, limit: usize) -> u64 {
    let limit = limit.max(1) as u64;
    (bytes as u64 * 100).div_ceil(limit)
}

/// `AssumeRole` for `caller`, whose signature has been verified.
pub(super) fn assume_role(
    sts: &AwsSts,
    caller: &Principal,
    form: &HashMap<String, String>,
    now: u64,
) -> Result<Response, StsError> {
    let request = parse_request(form)?;
    if !arn_shaped(request.role_arn) {
        return Err(sts_error(
            StatusCode::BAD_REQUEST,
            "ValidationError",
            format!("{} is invalid", request.role_arn),
        ));
    }
    if let Some(policy) = request.policy {
        match serde_json::from_str::<serde_json::Value>(policy) {
            Err(_) => {
                return Err(sts_error(
                    StatusCode::BAD_REQUEST,
                    "MalformedPolicyDocument",
                    POLICY_NOT_JSON,
                ))
            }
            Ok(doc) if !doc.is_object() => {
                return Err(sts_error(
                    StatusCode::BAD_REQUEST,
                    "MalformedPolicyDocument",
                    POLICY_SYNTAX,
                ))
            }
            Ok(_) => {}
        }
    }

    let mut keys = HashSet::new();
    if !request
        .tags
        .iter()
        .all(|(k, _)| keys.insert(k.to_lowercase()))
    {
        return Err(invalid_parameter(DUPLICATE_TAG_KEYS));
    }
    if !request
        .transitive_keys
        .iter()
        .all(|k| keys.contains(&k.to_lowercase()))
    {
        return Err(invalid_parameter(TRANSITIVE_KEY_NOT_A_TAG));
    }
    let inherited: HashSet<String> = caller
        .transitive_tags
        .iter()
        .map(|(k, _)| k.to_lowercase())
        .collect();
    if request
        .tags
        .iter()
        .any(|(k, _)| inherited.contains(&k.to_lowercase()))
    {
        return Err(invalid_parameter(OVERRIDES_INHERITED_TAG));
    }

    let denied = || not_authorized(caller, "sts:AssumeRole", request.role_arn);
    let role = sts
        .config
        .roles
        .iter()
        .find(|r| r.arn == request.role_arn)
        .ok_or_else(denied)?;
    let target = RoleArn::parse(&role.arn).map_err(|_| denied())?;
    if !trusts(role, caller) {
        return Err(denied());
    }
    if let Some(expected) = role.external_id.as_deref() {
        if request.external_id != Some(expected) {
            return Err(denied());
        }
    }
    // Passing tags, marking them transitive or inheriting transitive ones
    // all set session tags, which the trust policy must allow.
    let tagged = !request.tags.is_empty()
        || !request.transitive_keys.is_empty()
        || !caller.transitive_tags.is_empty();
    if tagged && !role.allow_tag_session {
        return Err(not_authorized(caller, "sts:TagSession", request.role_arn));
    }

    if request.duration > CHAINED_MAX_DURATION {
        return Err(super::validation(CHAINED_TOO_LONG));
    }
    if request.duration > role.max_session_duration {
        return Err(super::validation(OVER_MAX_SESSION));
    }

    let inherited_pairs = caller
        .transitive_tags
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()));
    let bytes = tag_bytes(inherited_pairs)
        + tag_bytes(request.tags.iter().copied())
        + request.policy.map_or(0, str::len);
    let carries = tagged || request.policy.is_some();
    let percent = packed_percent(bytes, sts.config.packed_policy_limit);
    if percent > 100 {
        // AWS words it after what was passed: a policy, or only tags
        // (CloudTrail records quoted in aws/containers-roadmap#2413 and
        // aws-actions/configure-aws-credentials#1803 for tags; AWS re:Post
        // "iam-role-aws-sts-error" for a policy, with its closing advice).
        let message = if request.policy.is_some() {
            format!(
                "Packed policy consumes {percent}% of allotted space, please use smaller policy."
            )
        } else {
            format!("Packed size of session tags consumes {percent}% of allotted space.")
        };
        return Err(sts_error(
            StatusCode::BAD_REQUEST,
            "PackedPolicyTooLarge",
            message,
        ));
    }
    let packed_policy_size = carries.then(|| u32::try_from(percent).unwrap_or(u32::MAX));

    // The new session's transitive tags: every inherited one stays
    // transitive; passed tags become so when their key is listed.
    let listed: HashSet<String> = request
        .transitive_keys
        .iter()
        .map(|k| k.to_lowercase())
        .collect();
    let mut transitive_tags = caller.transitive_tags.clone();
    transitive_tags.extend(
        request
            .tags
            .iter()
            .filter(|(k, _)| listed.contains(&k.to_lowercase()))
            .map(|(k, v)| (k.to_string(), v.to_string())),
    );

    let minted = sts.issue(
        Grant {
            action: SessionAction::AssumeRole,
            role_arn: role.arn.clone(),
            session_name: request.session_name.to_string(),
            duration: request.duration,
            subject: None,
            source: Some(caller.clone()),
            tags: pairs(&request.tags),
            transitive_tag_keys: request
                .transitive_keys
                .iter()
                .map(|k| k.to_string())
                .collect(),
            inherited_tags: caller.transitive_tags.clone(),
            transitive_tags,
            external_id: request.external_id.map(str::to_string),
            session_policy: request.policy.is_some(),
            packed_policy_size,
        },
        &target,
        now,
    )?;
    sts.stats
        .assume_role_issued
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);

    let packed = packed_policy_size
        .map(|p| format!("    <PackedPolicySize>{p}</PackedPolicySize>\n"))
        .unwrap_or_default();
    let body = format!(
        "<AssumeRoleResponse xmlns=\"{STS_NAMESPACE}\">\n  <AssumeRoleResult>\n    <AssumedRoleUser>\n      <Arn>{}</Arn>\n      <AssumedRoleId>{}</AssumedRoleId>\n    </AssumedRoleUser>\n    <Credentials>\n      <AccessKeyId>{}</AccessKeyId>\n      <SecretAccessKey>{}</SecretAccessKey>\n      <SessionToken>{}</SessionToken>\n      <Expiration>{}</Expiration>\n    </Credentials>\n{packed}  </AssumeRoleResult>\n  <ResponseMetadata>\n    <RequestId>{}</RequestId>\n  </ResponseMetadata>\n</AssumeRoleResponse>\n",
        escape(minted.assumed_role_arn.as_str()),
        escape(minted.assumed_role_id.as_str()),
        minted.credentials.access_key_id,
        escape(minted.credentials.secret_access_key.as_str()),
        escape(minted.credentials.session_token.as_str()),
        minted.expiration,
        minted.request_id,
    );
    Ok(xml_response(body, minted.request_id))
}

fn pairs(tags: &[(&str, &str)]) -> Vec<(String, String)> {
    tags.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `GetCallerIdentity`: who the verified caller is.
pub(super) fn caller_identity(caller: &Principal) -> Response {
    let request_id = uuid::Uuid::new_v4().to_string();
    let body = format!(
        "<GetCallerIdentityResponse xmlns=\"{STS_NAMESPACE}\">\n  <GetCallerIdentityResult>\n    <Arn>{}</Arn>\n    <UserId>{}</UserId>\n    <Account>{}</Account>\n  </GetCallerIdentityResult>\n  <ResponseMetadata>\n    <RequestId>{request_id}</RequestId>\n  </ResponseMetadata>\n</GetCallerIdentityResponse>\n",
        escape(caller.assumed_role_arn.as_str()),
        escape(caller.user_id.as_str()),
        escape(caller.account.as_str()),
    );
    xml_response(body, request_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const ROLE: &str = "arn:aws:iam::111122223333:role/target";

    #[test]
    fn aws_assume_role_parses_lists_in_index_order() {
        let f = form(&[
            ("RoleArn", ROLE),
            ("RoleSessionName", "s1"),
            ("Tags.member.2.Key", "b"),
            ("Tags.member.2.Value", "2"),
            ("Tags.member.1.Key", "a"),
            ("Tags.member.1.Value", ""),
            ("Tags.member.x.Key", "ignored"),
            ("TransitiveTagKeys.member.1", "a"),
            ("ExternalId", "ext-123"),
        ]);
        let r = parse_request(&f).ok().unwrap();
        assert_eq!(r.tags, [("a", ""), ("b", "2")]);
        assert_eq!(r.transitive_keys, ["a"]);
        assert_eq!(r.external_id, Some("ext-123"));
        assert_eq!(r.duration, 3600);
        assert_eq!(r.policy, None);
    }

    #[test]
    fn aws_assume_role_collects_every_violation() {
        let long_value = "v".repeat(257);
        let f = form(&[
            ("RoleArn", ROLE),
            ("RoleSessionName", "bad name"),
            ("DurationSeconds", "600"),
            ("Tags.member.1.Key", "ok"),
            ("Tags.member.1.Value", &long_value),
            ("Tags.member.2.Key", "bad#key"),
            ("Tags.member.2.Value", "v"),
            ("Tags.member.3.Key", "novalue"),
            ("ExternalId", "x"),
        ]);
        let e = parse_request(&f).err().unwrap();
        assert_eq!(e.code, "ValidationError");
        assert_eq!(
            e.message,
            format!(
                "6 validation errors detected: Value 'bad name' at 'roleSessionName' failed to satisfy constraint: Member must satisfy regular expression pattern: [\\w+=,.@-]*; Value '600' at 'durationSeconds' failed to satisfy constraint: Member must have value greater than or equal to 900; Value '{long_value}' at 'tags.1.member.value' failed to satisfy constraint: Member must have length less than or equal to 256; Value 'bad#key' at 'tags.2.member.key' failed to satisfy constraint: Member must satisfy regular expression pattern: [\\p{{L}}\\p{{Z}}\\p{{N}}_.:/=+\\-@]+; Value null at 'tags.3.member.value' failed to satisfy constraint: Member must not be null; Value 'x' at 'externalId' failed to satisfy constraint: Member must have length greater than or equal to 2"
            )
        );

        let mut many: Vec<(String, String)> = vec![
            ("RoleArn".into(), ROLE.into()),
            ("RoleSessionName".into(), "s1".into()),
        ];
        for n in 1..=51 {
            many.push((format!("Tags.member.{n}.Key"), format!("k{n}")));
            many.push((format!("Tags.member.{n}.Value"), "v".into()));
        }
        let f: HashMap<String, String> = many.into_iter().collect();
        let e = parse_request(&f).err().unwrap();
        assert_eq!(
            e.message,
            "1 validation error detected: Value at 'tags' failed to satisfy constraint: Member must have length less than or equal to 50"
        );

        let e = parse_request(&form(&[("RoleSessionName", "s1")]))
            .err()
            .unwrap();
        assert_eq!(
            e.message,
            "1 validation error detected: Value null at 'roleArn' failed to satisfy constraint: Member must not be null"
        );
        let big_policy = format!("{{\"a\":\"{}\"}}", "x".repeat(2048));
        let e = parse_request(&form(&[
            ("RoleArn", ROLE),
            ("RoleSessionName", "s1"),
            ("Policy", &big_policy),
        ]))
        .err()
        .unwrap();
        assert!(
            e.message
                .ends_with("at 'policy' failed to satisfy constraint: Member must have length less than or equal to 2048"),
            "{}",
            e.message
        );
    }

    #[test]
    fn aws_arn_shape_and_trust_principals() {
        assert!(arn_shaped(ROLE));
        for bad in [
            "nothing-valid-in-here",
            "arn::b:::something/test-role",
            "arn:a::::something/test-role",
            "arn:a:::something/test-role",
            "arn:a:a::aaaaaaaaaa:",
        ] {
            assert!(!arn_shaped(bad), "{bad}");
        }
        let caller = Principal {
            role_arn: "arn:aws:iam::111122223333:role/source".into(),
            assumed_role_arn: "arn:aws:sts::111122223333:assumed-role/source/s".into(),
            user_id: "AROA:s".into(),
            account: "111122223333".into(),
            transitive_tags: Vec::new(),
        };
        let role = |trusted: &[&str]| AwsRole {
            arn: ROLE.into(),
            trusted_subjects: Vec::new(),
            max_session_duration: 3600,
            trusted_roles: trusted.iter().map(|s| s.to_string()).collect(),
            external_id: None,
            allow_tag_session: false,
        };
        assert!(trusts(
            &role(&["arn:aws:iam::111122223333:role/source"]),
            &caller
        ));
        assert!(trusts(&role(&["arn:aws:iam::111122223333:root"]), &caller));
        assert!(trusts(&role(&["111122223333"]), &caller));
        assert!(!trusts(
            &role(&["arn:aws:iam::111122223333:role/other"]),
            &caller
        ));
        assert!(!trusts(&role(&["arn:aws:iam::444455556666:root"]), &caller));
        assert!(!trusts(&role(&[]), &caller));
    }

    #[test]
    fn aws_packed_percent_rounds_up() {
        assert_eq!(packed_percent(0, 2048), 0);
        assert_eq!(packed_percent(1, 2048), 1);
        assert_eq!(packed_percent(2048, 2048), 100);
        assert_eq!(packed_percent(2049, 2048), 101);
        assert_eq!(packed_percent(10, 0), 1000);
    }
}
