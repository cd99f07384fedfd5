//! A cache entry's key, and its borrowed form for lookups without
//! allocating: both hash the same bytes, in one write to the hasher.

use std::sync::Arc;

use crate::cloud::Cloud;

/// What a cache entry is for. Two requests share an entry only when every
/// field is equal, so different identities, scopes or service accounts can
/// never receive each other's credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    /// The cloud the credential is for.
    pub cloud: Cloud,
    /// The identity's tenant, project or account.
    pub account: String,
    /// Client id, service account email / principal, or role ARN.
    pub identity: String,
    /// Resource, sorted scope set, or ID-token audience.
    pub scope: String,
    /// The caller's namespace: ServiceAccounts of different namespaces never
    /// share an entry, even when bound to the same identity.
    pub namespace: String,
    /// The caller's ServiceAccount name.
    pub service_account: String,
    /// Set when the cache is scoped per pod.
    pub pod_uid: Option<String>,
}

/// A [`CacheKey`] borrowed from the request it is for: what a lookup
/// hashes and compares, so a cache hit copies no text. Only an insertion
/// makes the owned key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyRef<'a> {
    /// See [`CacheKey::cloud`].
    pub cloud: Cloud,
    /// See [`CacheKey::account`].
    pub account: &'a str,
    /// See [`CacheKey::identity`].
    pub identity: &'a str,
    /// See [`CacheKey::scope`].
    pub scope: &'a str,
    /// See [`CacheKey::namespace`].
    pub namespace: &'a str,
    /// See [`CacheKey::service_account`].
    pub service_account: &'a str,
    /// See [`CacheKey::pod_uid`].
    pub pod_uid: Option<&'a str>,
}

impl KeyRef<'_> {
    /// The owned key.
    pub fn to_key(&self) -> CacheKey {
        CacheKey {
            cloud: self.cloud,
            account: self.account.to_string(),
            identity: self.identity.to_string(),
            scope: self.scope.to_string(),
            namespace: self.namespace.to_string(),
            service_account: self.service_account.to_string(),
            pod_uid: self.pod_uid.map(str::to_string),
        }
    }
}

impl CacheKey {
    /// The key, borrowed.
    pub fn as_ref(&self) -> KeyRef<'_> {
        KeyRef {
            cloud: self.cloud,
            account: &self.account,
            identity: &self.identity,
            scope: &self.scope,
            namespace: &self.namespace,
            service_account: &self.service_account,
            pod_uid: self.pod_uid.as_deref(),
        }
    }
}

/// Longest key hashed in one write; a longer one (a long scope) is hashed
/// field by field.
const ONE_WRITE: usize = 320;

impl std::hash::Hash for KeyRef<'_> {
    /// The fields, each after its length, in one write to the hasher: a
    /// SipHash write has a fixed cost besides its bytes, and field by field
    /// (the derived hash: twelve writes) it was the largest part of a
    /// cache hit's lookup.
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        let fields = [
            self.account,
            self.identity,
            self.scope,
            self.namespace,
            self.service_account,
            self.pod_uid.unwrap_or(""),
        ];
        let mut buf = [0u8; ONE_WRITE];
        buf[0] = self.cloud as u8;
        buf[1] = u8::from(self.pod_uid.is_some());
        let mut at = 2;
        for field in fields {
            let end = at + 2 + field.len();
            let (Some(slot), Ok(len)) = (buf.get_mut(at..end), u16::try_from(field.len())) else {
                // Too long for one write.
                self.cloud.hash(state);
                self.pod_uid.is_some().hash(state);
                fields.hash(state);
                return;
            };
            slot[..2].copy_from_slice(&len.to_le_bytes());
            slot[2..].copy_from_slice(field.as_bytes());
            at = end;
        }
        state.write(&buf[..at]);
    }
}

// INVARIANT: a key hashes exactly as its borrowed form does, and compares
// equal to it field by field; lookups by `KeyRef` depend on both.
impl std::hash::Hash for CacheKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_ref().hash(state)
    }
}

impl hashbrown::Equivalent<Arc<CacheKey>> for KeyRef<'_> {
    fn equivalent(&self, key: &Arc<CacheKey>) -> bool {
        *self == CacheKey::as_ref(key)
    }
}
