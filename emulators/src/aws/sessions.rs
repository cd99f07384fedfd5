//! What the STS emulator remembers of the credentials it issued.
//!
//! Two stores, both bounded, because thousands of pods exchange for
//! hours in the soak tests and the bench drivers:
//!
//! * [`CredentialStore`]: access key id → the secret (needed to verify
//!   signatures), a digest of the session token, the expiry and the
//!   principal the credentials stand for. Signed `AssumeRole` and
//!   `GetCallerIdentity` calls are checked against it, as AWS checks its
//!   own. Full, it forgets expired credentials first, then those closest
//!   to expiry (their holders get `InvalidClientTokenId` and exchange
//!   again), like the Google emulator's federated-token store. Expired
//!   entries are otherwise kept, so that a late caller hears
//!   `ExpiredToken` as it would from AWS.
//! * [`SessionLog`]: one [`SessionRecord`] per issuance, what CloudTrail
//!   would show, so tests can assert what the emulator was asked
//!   ("both calls, the second with the six tags"). The newest
//!   [`SESSION_RECORD_CAPACITY`] are kept.

use std::collections::{HashMap, VecDeque};

use sha2::{Digest, Sha256};

/// How many live credentials the emulator remembers.
pub(super) const CREDENTIAL_CAPACITY: usize = 65_536;
/// How many issuances [`super::AwsSts::sessions`] reports, newest kept.
pub const SESSION_RECORD_CAPACITY: usize = 10_000;

/// The STS operation that issued a session's credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionAction {
    /// `AssumeRoleWithWebIdentity`: a web identity token exchanged.
    AssumeRoleWithWebIdentity,
    /// `AssumeRole`: credentials of an earlier session exchanged (role
    /// chaining; the emulator has no IAM users).
    AssumeRole,
}

/// One issuance as the emulator saw it (CloudTrail's `requestParameters`
/// and `responseElements`, without the secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    /// The operation.
    pub action: SessionAction,
    /// The answer's `RequestId`.
    pub request_id: String,
    /// The issued access key id (`ASIA…`).
    pub access_key_id: String,
    /// The role assumed (`arn:aws:iam::ACCOUNT:role/NAME`).
    pub role_arn: String,
    /// The session's ARN (`arn:aws:sts::ACCOUNT:assumed-role/NAME/SESSION`).
    pub assumed_role_arn: String,
    /// `RoleSessionName`.
    pub session_name: String,
    /// For `AssumeRoleWithWebIdentity`: the token's `sub`.
    pub subject: Option<String>,
    /// For `AssumeRole`: the role whose session called (the source of the
    /// chain's previous link).
    pub source_role_arn: Option<String>,
    /// For `AssumeRole`: the calling session's ARN.
    pub source_assumed_role_arn: Option<String>,
    /// The session tags the request passed (`Tags.member.N`), in order,
    /// with their case.
    pub tags: Vec<(String, String)>,
    /// `TransitiveTagKeys.member.N`, in order.
    pub transitive_tag_keys: Vec<String>,
    /// Transitive tags inherited from the calling session (they apply to
    /// this session and stay transitive).
    pub inherited_tags: Vec<(String, String)>,
    /// The `ExternalId` presented, if any (not a secret, AWS says).
    pub external_id: Option<String>,
    /// Whether an inline session policy (`Policy`) was passed.
    pub session_policy: bool,
    /// The `PackedPolicySize` answered, when the session has tags or a
    /// policy.
    pub packed_policy_size: Option<u32>,
    /// The session's lifetime.
    pub duration_seconds: u64,
    /// Unix seconds at which the credentials expire.
    pub expires_at: u64,
}

/// Who a set of issued credentials stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Principal {
    /// The role (`arn:…:iam::ACCOUNT:role/PATH/NAME`).
    pub role_arn: String,
    /// The session (`arn:…:sts::ACCOUNT:assumed-role/NAME/SESSION`).
    pub assumed_role_arn: String,
    /// `AROA…:SESSION`, what `GetCallerIdentity` calls `UserId`.
    pub user_id: String,
    /// The role's 12-digit account.
    pub account: String,
    /// The session's transitive tags: they pass to any session it assumes.
    pub transitive_tags: Vec<(String, String)>,
}

/// Issued credentials, as much of them as verification needs.
pub(super) struct Credential {
    /// The secret access key: the HMAC chain needs it in the clear.
    secret: String,
    /// SHA-256 of the session token: enough to recognise it.
    token_digest: [u8; 32],
    /// Unix seconds.
    expires_at: u64,
    principal: Principal,
}

impl Credential {
    pub(super) fn new(secret: &str, token: &str, expires_at: u64, principal: Principal) -> Self {
        Credential {
            secret: secret.to_string(),
            token_digest: Sha256::digest(token.as_bytes()).into(),
            expires_at,
            principal,
        }
    }

    /// Whether `token` is this credential's session token.
    pub(super) fn token_matches(&self, token: &str) -> bool {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        aws_lc_rs::constant_time::verify_slices_are_equal(&digest, &self.token_digest).is_ok()
    }

    pub(super) fn secret(&self) -> &str {
        &self.secret
    }

    pub(super) fn expires_at(&self) -> u64 {
        self.expires_at
    }

    pub(super) fn principal(&self) -> &Principal {
        &self.principal
    }
}

/// Access key id → issued credential, bounded.
pub(super) struct CredentialStore {
    credentials: HashMap<String, Credential>,
    capacity: usize,
}

impl CredentialStore {
    pub(super) fn new(capacity: usize) -> Self {
        CredentialStore {
            credentials: HashMap::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers `credential` under `access_key_id`, making room first.
    pub(super) fn insert(&mut self, access_key_id: &str, credential: Credential, now: u64) {
        if self.credentials.len() >= self.capacity {
            self.credentials.retain(|_, c| c.expires_at > now);
        }
        while self.credentials.len() >= self.capacity {
            // Still full of live credentials: forget the one closest to expiry.
            let Some(victim) = self
                .credentials
                .iter()
                .min_by_key(|(_, c)| c.expires_at)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            self.credentials.remove(&victim);
        }
        self.credentials
            .insert(access_key_id.to_string(), credential);
    }

    /// The credential issued as `access_key_id`, expired or not.
    pub(super) fn get(&self, access_key_id: &str) -> Option<&Credential> {
        self.credentials.get(access_key_id)
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.credentials.len()
    }
}

/// The newest [`SESSION_RECORD_CAPACITY`] issuances.
pub(super) struct SessionLog {
    records: VecDeque<SessionRecord>,
    capacity: usize,
}

impl Default for SessionLog {
    fn default() -> Self {
        SessionLog {
            records: VecDeque::new(),
            capacity: SESSION_RECORD_CAPACITY,
        }
    }
}

impl SessionLog {
    pub(super) fn push(&mut self, record: SessionRecord) {
        while self.records.len() >= self.capacity {
            self.records.pop_front();
        }
        self.records.push_back(record);
    }

    /// Oldest first.
    pub(super) fn snapshot(&self) -> Vec<SessionRecord> {
        self.records.iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(n: u32) -> Principal {
        Principal {
            role_arn: format!("arn:aws:iam::111122223333:role/r{n}"),
            assumed_role_arn: format!("arn:aws:sts::111122223333:assumed-role/r{n}/s"),
            user_id: format!("AROAEXAMPLE:s{n}"),
            account: "111122223333".into(),
            transitive_tags: Vec::new(),
        }
    }

    #[test]
    fn aws_credential_store_forgets_expired_then_closest_to_expiry() {
        let mut store = CredentialStore::new(3);
        store.insert("A", Credential::new("sa", "ta", 100, principal(1)), 0);
        store.insert("B", Credential::new("sb", "tb", 300, principal(2)), 0);
        store.insert("C", Credential::new("sc", "tc", 200, principal(3)), 0);
        assert_eq!(store.len(), 3);
        // At 150, A has expired: it goes first, the live ones stay.
        store.insert("D", Credential::new("sd", "td", 400, principal(4)), 150);
        assert!(store.get("A").is_none());
        assert!(store.get("B").is_some() && store.get("C").is_some());
        // All live: C expires soonest.
        store.insert("E", Credential::new("se", "te", 500, principal(5)), 150);
        assert!(store.get("C").is_none());
        assert_eq!(store.len(), 3);
        let d = store.get("D").unwrap();
        assert!(d.token_matches("td"));
        assert!(!d.token_matches("tc"));
        assert_eq!(d.secret(), "sd");
        assert_eq!(d.expires_at(), 400);
        assert_eq!(d.principal(), &principal(4));
    }

    #[test]
    fn aws_session_log_keeps_the_newest() {
        let mut log = SessionLog {
            records: VecDeque::new(),
            capacity: 2,
        };
        for n in 0..3 {
            log.push(SessionRecord {
                action: SessionAction::AssumeRole,
                request_id: n.to_string(),
                access_key_id: String::new(),
                role_arn: String::new(),
                assumed_role_arn: String::new(),
                session_name: String::new(),
                subject: None,
                source_role_arn: None,
                source_assumed_role_arn: None,
                tags: Vec::new(),
                transitive_tag_keys: Vec::new(),
                inherited_tags: Vec::new(),
                external_id: None,
                session_policy: false,
                packed_policy_size: None,
                duration_seconds: 900,
                expires_at: 0,
            });
        }
        let ids: Vec<String> = log.snapshot().into_iter().map(|r| r.request_id).collect();
        assert_eq!(ids, ["1", "2"]);
    }
}
