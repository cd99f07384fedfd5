//! AWS's model: the ServiceAccount annotations AWS bindings are read
//! from, the roles (and target roles) they bind, role ARNs and regions as
//! IAM and STS accept them, and the session credentials STS issues.

use std::fmt;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{annotation, distinct, listed, Annotations};
use crate::secret::SecretString;

/// The ServiceAccount annotations AWS bindings are read from.
pub mod annotations {
    /// The IAM role to assume (EKS IRSA's annotation).
    pub const ROLE_ARN: &str = "eks.amazonaws.com/role-arn";
    /// A role to chain into from that one with `sts:AssumeRole`, as EKS
    /// Pod Identity's target role (often in another account).
    pub const TARGET_ROLE_ARN: &str = "lanyard.dev/aws-target-role-arn";
    /// The external id the target role's trust policy asks for
    /// (`sts:ExternalId`).
    pub const EXTERNAL_ID: &str = "lanyard.dev/aws-external-id";
    /// `"false"`: the chained hop carries no session tags (EKS Pod
    /// Identity's `disableSessionTags`).
    pub const SESSION_TAGS: &str = "lanyard.dev/aws-session-tags";
    /// An inline session policy (JSON) for the chained hop.
    pub const SESSION_POLICY: &str = "lanyard.dev/aws-session-policy";
    /// Lanyard's own: further roles the ServiceAccount may assume with its
    /// token, each selected by its name (IMDS's
    /// `security-credentials/ROLE`; comma- or space-separated; after
    /// `ROLE_ARN`'s, or the first is the default).
    pub const ROLE_ARNS: &str = "lanyard.dev/aws-role-arns";
    /// Every annotation above: what Lanyard reads of this cloud's.
    pub const ALL: &[&str] = &[
        ROLE_ARN,
        TARGET_ROLE_ARN,
        EXTERNAL_ID,
        SESSION_TAGS,
        SESSION_POLICY,
        ROLE_ARNS,
    ];
}

/// Session credentials from STS.
#[derive(Clone)]
pub struct AwsCredentials {
    /// The session's access key id (`ASIA…`); not secret on its own.
    pub access_key_id: String,
    /// The session's secret access key, which signs requests.
    pub secret_access_key: SecretString,
    /// The session token SDKs send as `X-Amz-Security-Token`.
    pub session_token: SecretString,
    /// Unix seconds, from STS's `Expiration`.
    pub expires_at: u64,
    /// Unix seconds, when the request was sent (for refresh-ahead).
    pub issued_at: u64,
    /// The account of the role, from the role ARN.
    pub account_id: String,
    /// `arn:aws:sts::ACCOUNT:assumed-role/ROLE/SESSION`.
    pub assumed_role_arn: String,
    /// The last response body these credentials were rendered into.
    pub rendered: super::RenderedBody,
}

/// Written by hand so that neither the secret key nor the session token can
/// reach a log through `{:?}`, whatever `SecretString` prints.
impl fmt::Debug for AwsCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AwsCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"[redacted]")
            .field("session_token", &"[redacted]")
            .field("expires_at", &self.expires_at)
            .field("issued_at", &self.issued_at)
            .field("account_id", &self.account_id)
            .field("assumed_role_arn", &self.assumed_role_arn)
            .finish()
    }
}

/// The IAM role a ServiceAccount assumes, and the role it chains into
/// from there, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The role assumed with the pod's token (`eks.amazonaws.com/role-arn`).
    pub role_arn: String,
    /// The second hop, `sts:AssumeRole` into a target role (shared: a
    /// request clones the binding).
    pub chain: Option<Arc<Chain>>,
}

/// The chained hop's parameters, as EKS Pod Identity's target role
/// association carries them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// The role the credentials are for in the end.
    pub target_role_arn: String,
    /// `ExternalId`, when the target's trust policy asks for one.
    pub external_id: Option<String>,
    /// Whether the hop carries EKS's six session tags (transitive).
    pub session_tags: bool,
    /// `Policy`: an inline session policy, JSON.
    pub session_policy: Option<String>,
    /// Judged once, when the ServiceAccount's annotations are read (not on
    /// each request): the hop's part of the cache key, or the first thing
    /// wrong with its annotations.
    checked: Result<String, String>,
}

impl From<String> for Binding {
    fn from(role_arn: String) -> Self {
        Binding {
            role_arn,
            chain: None,
        }
    }
}

impl From<&str> for Binding {
    fn from(role_arn: &str) -> Self {
        Binding::from(role_arn.to_string())
    }
}

/// The roles `annotations` name, the default first: the
/// `eks.amazonaws.com/role-arn` one, with the chained hop the
/// `lanyard.dev/aws-*` annotations describe, then those of
/// `lanyard.dev/aws-role-arns` (each assumed with the pod's token, no
/// chain). IMDS selects a role by its name alone, so a role whose name an
/// earlier one has (in another account) could never be selected: it is
/// dropped.
pub fn bindings(annotations: &Annotations) -> Vec<Binding> {
    let first = annotation(annotations, annotations::ROLE_ARN).map(|role_arn| {
        let chain = annotation(annotations, annotations::TARGET_ROLE_ARN).map(|target_role_arn| {
            Arc::new(Chain::new(
                &role_arn,
                target_role_arn,
                annotation(annotations, annotations::EXTERNAL_ID),
                annotation(annotations, annotations::SESSION_TAGS)
                    .is_none_or(|v| !v.eq_ignore_ascii_case("false")),
                annotation(annotations, annotations::SESSION_POLICY),
            ))
        });
        Binding { role_arn, chain }
    });
    let listed = listed(annotations, annotations::ROLE_ARNS)
        .into_iter()
        .map(Binding::from);
    distinct(
        first.into_iter().chain(listed),
        |a, b| a.role_name() == b.role_name(),
        annotations::ROLE_ARNS,
    )
}

impl Binding {
    /// The name IMDS selects this binding by: the final role's, after the
    /// last `/` of its ARN.
    pub fn role_name(&self) -> &str {
        let arn = self.final_role();
        arn.rsplit('/').next().unwrap_or(arn)
    }
}

/// STS's bounds on the chained hop's caller-supplied values, checked
/// before anything is sent so that the caller learns which annotation is
/// wrong.
const MAX_POLICY_CHARS: usize = 2048;
const EXTERNAL_ID_CHARS: std::ops::RangeInclusive<usize> = 2..=1224;

impl Chain {
    /// The hop from `role_arn`'s session into `target_role_arn`, checked.
    pub fn new(
        role_arn: &str,
        target_role_arn: String,
        external_id: Option<String>,
        session_tags: bool,
        session_policy: Option<String>,
    ) -> Chain {
        let mut chain = Chain {
            target_role_arn,
            external_id,
            session_tags,
            session_policy,
            checked: Ok(String::new()),
        };
        chain.checked = match chain.find_problem() {
            Some(problem) => Err(problem),
            None => Ok(chain.key(role_arn)),
        };
        chain
    }

    /// The hop's part of the cache key: every parameter of the second hop
    /// is in it, so that a changed annotation is not served the old
    /// session.
    fn key(&self, role_arn: &str) -> String {
        let mut hasher = Sha256::new();
        hasher.update(role_arn.as_bytes());
        hasher.update([0]);
        hasher.update(self.external_id.as_deref().unwrap_or("").as_bytes());
        hasher.update([0]);
        hasher.update(self.session_policy.as_deref().unwrap_or("").as_bytes());
        let digest = hasher.finalize();
        let hash: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("via {role_arn} tags={} {hash}", self.session_tags)
    }

    /// The hop's part of the cache key, or what is wrong with its
    /// annotations, in words naming the annotation.
    pub fn checked(&self) -> Result<&str, &str> {
        self.checked.as_deref().map_err(String::as_str)
    }

    /// The first thing wrong with the hop's annotations.
    fn find_problem(&self) -> Option<String> {
        if RoleArn::parse(self.target_role_arn.as_str()).is_err() {
            return Some(format!(
                "{} is not an IAM role ARN (arn:aws:iam::ACCOUNT:role/NAME)",
                annotations::TARGET_ROLE_ARN
            ));
        }
        if let Some(id) = &self.external_id {
            let ok_chars = id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_+=,.@:/-".contains(c));
            if !EXTERNAL_ID_CHARS.contains(&id.chars().count()) || !ok_chars {
                return Some(format!(
                    "{} must be 2-1224 characters of letters, digits and _+=,.@:/-",
                    annotations::EXTERNAL_ID
                ));
            }
        }
        if let Some(policy) = &self.session_policy {
            if policy.chars().count() > MAX_POLICY_CHARS {
                return Some(format!(
                    "{} is longer than STS's {MAX_POLICY_CHARS} characters",
                    annotations::SESSION_POLICY
                ));
            }
            if serde_json::from_str::<serde::de::IgnoredAny>(policy).is_err() {
                return Some(format!("{} is not JSON", annotations::SESSION_POLICY));
            }
        }
        None
    }
}

impl Binding {
    /// The role the credentials are for in the end.
    pub fn final_role(&self) -> &str {
        self.chain
            .as_ref()
            .map_or(&self.role_arn, |c| &c.target_role_arn)
    }
}

/// Why a role ARN or region was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AwsNameError {
    /// Not of the form `arn:PARTITION:iam::ACCOUNT:role/[PATH/]NAME` at all.
    #[error("{0:?} is not an IAM role ARN (arn:PARTITION:iam::ACCOUNT:role/[PATH/]NAME)")]
    NotRoleArn(String),
    /// The partition does not start with `aws` or has characters other than
    /// lowercase letters and `-`.
    #[error("{0:?} has an unknown partition (aws, aws-cn, aws-us-gov, …)")]
    Partition(String),
    /// The account is not exactly 12 digits.
    #[error("{0:?} does not name a 12-digit account")]
    Account(String),
    /// The role name is not 1–64 of `[\w+=,.@-]`, or the path is not printable
    /// ASCII of at most 510 bytes.
    #[error("{0:?} has an invalid role name (1-64 of letters, digits and _+=,.@-) or path")]
    RoleName(String),
    /// Not a region name: fewer than three `-`-separated parts, a part that is
    /// not lowercase letters and digits, or longer than 64 bytes.
    #[error("{0:?} is not an AWS region such as us-east-1")]
    Region(String),
}

/// An IAM role ARN, `arn:PARTITION:iam::ACCOUNT:role/[PATH/]NAME`, checked
/// once so that its account, name and partition can be read without
/// re-parsing. The rules are IAM's: a partition of lowercase letters and
/// `-` starting with `aws`, a 12-digit account, a path of printable ASCII,
/// and a name of 1–64 of `[\w+=,.@-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RoleArn {
    arn: String,
    /// Byte ranges of the partition, account and name in `arn`.
    partition: (usize, usize),
    account: (usize, usize),
    name: usize,
}

impl RoleArn {
    /// Checks `value` against IAM's rules for role ARNs; the error says which
    /// part is wrong and carries the value.
    pub fn parse(value: impl Into<String>) -> Result<Self, AwsNameError> {
        let arn = value.into();
        let fields: Vec<&str> = arn.splitn(6, ':').collect();
        let ["arn", partition, "iam", "", account, resource] = fields.as_slice() else {
            return Err(AwsNameError::NotRoleArn(arn));
        };
        let Some(path_and_name) = resource.strip_prefix("role/") else {
            return Err(AwsNameError::NotRoleArn(arn));
        };
        if !partition.starts_with("aws")
            || !partition
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b == b'-')
        {
            return Err(AwsNameError::Partition(arn));
        }
        if account.len() != 12 || !account.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AwsNameError::Account(arn));
        }
        let (path, name) = path_and_name
            .rsplit_once('/')
            .unwrap_or(("", path_and_name));
        let name_ok = (1..=64).contains(&name.len()) && name.chars().all(session_name_char);
        let path_ok = path.len() <= 510 && path.bytes().all(|b| (0x21..=0x7e).contains(&b));
        if !name_ok || !path_ok {
            return Err(AwsNameError::RoleName(arn));
        }
        // "arn:" is 4 bytes; ":iam::" 6 more after the partition.
        let p = (4, 4 + partition.len());
        let a_start = p.1 + ":iam::".len();
        let a = (a_start, a_start + account.len());
        let name_start = arn.len() - name.len();
        Ok(RoleArn {
            arn,
            partition: p,
            account: a,
            name: name_start,
        })
    }

    /// The partition: `aws`, `aws-cn`, `aws-us-gov`, …
    pub fn partition(&self) -> &str {
        &self.arn[self.partition.0..self.partition.1]
    }

    /// The 12-digit account id.
    pub fn account(&self) -> &str {
        &self.arn[self.account.0..self.account.1]
    }

    /// The role name without its path (what assumed-role ARNs and IMDS show).
    pub fn name(&self) -> &str {
        &self.arn[self.name..]
    }

    /// The ARN as given.
    pub fn as_str(&self) -> &str {
        &self.arn
    }

    /// The ARN STS reports for a session of this role:
    /// `arn:PARTITION:sts::ACCOUNT:assumed-role/NAME/SESSION`.
    pub fn assumed_role_arn(&self, session_name: &str) -> String {
        format!(
            "arn:{}:sts::{}:assumed-role/{}/{session_name}",
            self.partition(),
            self.account(),
            self.name()
        )
    }
}

impl std::str::FromStr for RoleArn {
    type Err = AwsNameError;
    fn from_str(s: &str) -> Result<Self, AwsNameError> {
        RoleArn::parse(s)
    }
}

impl TryFrom<String> for RoleArn {
    type Error = AwsNameError;
    fn try_from(s: String) -> Result<Self, AwsNameError> {
        RoleArn::parse(s)
    }
}

impl From<RoleArn> for String {
    fn from(r: RoleArn) -> String {
        r.arn
    }
}

impl fmt::Display for RoleArn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.arn)
    }
}

/// `[\w+=,.@-]`: the characters IAM allows in role and session names
/// (`\w` being ASCII letters, digits and underscore).
pub fn session_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '+' | '=' | ',' | '.' | '@' | '-')
}

/// The region the SDK environment names when none is configured
/// (`aws.region`'s default).
pub const DEFAULT_REGION: &str = "us-east-1";

/// An AWS region name: at least three `-`-separated parts of lowercase
/// letters and digits (`us-east-1`, `us-gov-west-1`, `cn-northwest-1`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Region(String);

impl Region {
    /// Checks `value` is a region name (see [`Region`]); nothing checks that
    /// AWS actually has the region, so new regions need no release.
    pub fn parse(value: impl Into<String>) -> Result<Self, AwsNameError> {
        let value = value.into();
        let parts: Vec<&str> = value.split('-').collect();
        let ok = parts.len() >= 3
            && value.len() <= 64
            && parts.iter().all(|p| {
                !p.is_empty()
                    && p.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
            });
        if ok {
            Ok(Region(value))
        } else {
            Err(AwsNameError::Region(value))
        }
    }

    /// The region name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The regional STS endpoint, `https://sts.{region}.amazonaws.com`
    /// (`.amazonaws.com.cn` in the China regions).
    pub fn sts_endpoint(&self) -> String {
        let suffix = if self.0.starts_with("cn-") {
            "amazonaws.com.cn"
        } else {
            "amazonaws.com"
        };
        format!("https://sts.{}.{suffix}", self.0)
    }
}

impl std::str::FromStr for Region {
    type Err = AwsNameError;
    fn from_str(s: &str) -> Result<Self, AwsNameError> {
        Region::parse(s)
    }
}

impl TryFrom<String> for Region {
    type Error = AwsNameError;
    fn try_from(s: String) -> Result<Self, AwsNameError> {
        Region::parse(s)
    }
}

impl From<Region> for String {
    fn from(r: Region) -> String {
        r.0
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_role_arns() {
        let r = RoleArn::parse("arn:aws:iam::123456789012:role/ray-data").unwrap();
        assert_eq!(
            (r.partition(), r.account(), r.name()),
            ("aws", "123456789012", "ray-data")
        );
        assert_eq!(r.to_string(), "arn:aws:iam::123456789012:role/ray-data");
        let r: RoleArn = "arn:aws-cn:iam::123456789012:role/team/a/ray"
            .parse()
            .unwrap();
        assert_eq!(
            (r.partition(), r.account(), r.name()),
            ("aws-cn", "123456789012", "ray")
        );
        assert_eq!(
            RoleArn::parse("arn:aws-us-gov:iam::123456789012:role/p/ray")
                .unwrap()
                .assumed_role_arn("s1"),
            "arn:aws-us-gov:sts::123456789012:assumed-role/ray/s1"
        );
        let bad = |arn: &str| RoleArn::parse(arn).unwrap_err();
        assert!(matches!(bad("ray-data"), AwsNameError::NotRoleArn(_)));
        assert!(matches!(
            bad("arn:aws:iam::123456789012:user/x"),
            AwsNameError::NotRoleArn(_)
        ));
        assert!(matches!(
            bad("arn:aws:sts::123456789012:role/x"),
            AwsNameError::NotRoleArn(_)
        ));
        assert!(matches!(
            bad("arn:aws:iam:us-east-1:123456789012:role/x"),
            AwsNameError::NotRoleArn(_)
        ));
        assert!(matches!(
            bad("arn:gcp:iam::123456789012:role/x"),
            AwsNameError::Partition(_)
        ));
        assert!(matches!(
            bad("arn:AWS:iam::123456789012:role/x"),
            AwsNameError::Partition(_)
        ));
        assert!(matches!(
            bad("arn:aws:iam::1234:role/x"),
            AwsNameError::Account(_)
        ));
        assert!(matches!(
            bad("arn:aws:iam::12345678901a:role/x"),
            AwsNameError::Account(_)
        ));
        for name in ["", "a b", "a/", &"x".repeat(65), "é"] {
            let arn = format!("arn:aws:iam::123456789012:role/{name}");
            assert!(matches!(bad(&arn), AwsNameError::RoleName(_)), "{arn}");
        }
        assert!(matches!(
            bad("arn:aws:iam::123456789012:role/p q/x"),
            AwsNameError::RoleName(_)
        ));
        let e = bad("arn:aws:iam::1:role/x").to_string();
        assert!(
            e.contains("arn:aws:iam::1:role/x") && e.contains("12-digit"),
            "{e}"
        );
    }

    #[test]
    fn aws_role_arn_serde_validates() {
        let r: RoleArn = serde_json::from_str("\"arn:aws:iam::123456789012:role/x\"").unwrap();
        assert_eq!(r.name(), "x");
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            "\"arn:aws:iam::123456789012:role/x\""
        );
        assert!(serde_json::from_str::<RoleArn>("\"arn:aws:iam::1:role/x\"").is_err());
        assert!(RoleArn::try_from("x".to_string()).is_err());
    }

    #[test]
    fn aws_regions() {
        for ok in [
            "us-east-1",
            "us-gov-west-1",
            "cn-northwest-1",
            "eu-central-2",
            "ap-southeast-5",
        ] {
            let r: Region = ok.parse().unwrap();
            assert_eq!(r.as_str(), ok);
            assert_eq!(r.to_string(), ok);
        }
        for bad in [
            "",
            "us-east",
            "US-EAST-1",
            "us--1",
            "us-east-1-",
            "us_east_1",
            "us-east-1 ",
            "eu-ç-1",
        ] {
            assert_eq!(
                Region::parse(bad),
                Err(AwsNameError::Region(bad.into())),
                "{bad:?}"
            );
        }
        assert_eq!(
            Region::parse("cn-north-1").unwrap().sts_endpoint(),
            "https://sts.cn-north-1.amazonaws.com.cn"
        );
        let r: Region = serde_json::from_str("\"us-west-2\"").unwrap();
        assert_eq!(String::from(r), "us-west-2");
        assert!(serde_json::from_str::<Region>("\"mars\"").is_err());
    }

    #[test]
    fn aws_credentials_debug_hides_secrets() {
        let c = AwsCredentials {
            rendered: Default::default(),
            access_key_id: "ASIAEXAMPLE".into(),
            secret_access_key: SecretString::from("very-secret-key".to_string()),
            session_token: SecretString::from("very-secret-token".to_string()),
            expires_at: 1,
            issued_at: 0,
            account_id: "123456789012".into(),
            assumed_role_arn: "arn".into(),
        };
        let shown = format!("{c:?}");
        assert!(shown.contains("ASIAEXAMPLE"));
        assert!(!shown.contains("very-secret"));
    }
}
