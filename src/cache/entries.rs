//! The cache's entries, and beside them which caller (ServiceAccount)
//! holds which.
//!
//! A new key needs its caller's holding (how many entries, how many with an
//! exchange in flight), and a full cache evicts the least recently used
//! idle entry of the caller holding the most. Both used to scan every entry
//! under the cache lock, so each miss cost O(entries) (10,000 by default,
//! up to 1,000,000) while every hit waited on that lock. With the keys
//! indexed by caller, a miss looks at its own caller's entries only
//! (`cache.caller_max_entries`, 1,000 by default) and an eviction at the
//! callers' counts and the heaviest caller's entries. A hit touches neither:
//! it finds its entry in the map and stamps its `last_access`, as before.
//!
//! INVARIANT: `callers` holds exactly the keys of `map`, each under its
//! caller, and no empty set. Every insertion and removal goes through the
//! methods here; the map is never handed out mutably.

use std::hash::Hash;
use std::sync::Arc;

use hashbrown::{Equivalent, HashMap, HashSet};
use tokio::time::Instant;

use super::{CacheKey, Entry};

/// Whose entries a set is: a ServiceAccount.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Caller {
    namespace: Box<str>,
    service_account: Box<str>,
}

/// A caller named by borrowed strings, for lookups without allocating.
/// Hashes as [`Caller`] does (field by field, each as a `str`).
#[derive(Hash)]
struct CallerRef<'a> {
    namespace: &'a str,
    service_account: &'a str,
}

impl Equivalent<Caller> for CallerRef<'_> {
    fn equivalent(&self, caller: &Caller) -> bool {
        *caller.namespace == *self.namespace && *caller.service_account == *self.service_account
    }
}

type Keys = HashSet<Arc<CacheKey>, std::hash::RandomState>;

/// The entries' map (keyed by [`CacheKey`], looked up by `KeyRef`, with
/// std's randomly keyed SipHash: scopes are caller-chosen text) and its
/// index by caller.
#[derive(Default)]
pub(super) struct Entries {
    map: HashMap<Arc<CacheKey>, Entry, std::hash::RandomState>,
    callers: HashMap<Caller, Keys, std::hash::RandomState>,
}

impl Entries {
    /// How many entries there are.
    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    /// The entry of `key`.
    pub(super) fn get_mut<Q>(&mut self, key: &Q) -> Option<&mut Entry>
    where
        Q: Hash + Equivalent<Arc<CacheKey>> + ?Sized,
    {
        self.map.get_mut(key)
    }

    /// The entry of `key`, with the stored key.
    pub(super) fn get_key_value_mut<Q>(&mut self, key: &Q) -> Option<(&Arc<CacheKey>, &mut Entry)>
    where
        Q: Hash + Equivalent<Arc<CacheKey>> + ?Sized,
    {
        self.map.get_key_value_mut(key)
    }

    /// Adds (or replaces) the entry of `key`.
    pub(super) fn insert(&mut self, key: Arc<CacheKey>, entry: Entry) {
        let caller = CallerRef {
            namespace: &key.namespace,
            service_account: &key.service_account,
        };
        match self.callers.get_mut(&caller) {
            Some(keys) => {
                keys.insert(key.clone());
            }
            None => {
                let owner = Caller {
                    namespace: key.namespace.as_str().into(),
                    service_account: key.service_account.as_str().into(),
                };
                let mut keys = Keys::default();
                keys.insert(key.clone());
                self.callers.insert(owner, keys);
            }
        }
        self.map.insert(key, entry);
    }

    /// Removes the entry of `key`.
    pub(super) fn remove(&mut self, key: &Arc<CacheKey>) -> Option<Entry> {
        let entry = self.map.remove(key)?;
        self.unindex(key);
        Some(entry)
    }

    /// Keeps only the entries `keep` says to; returns how many went.
    pub(super) fn retain(&mut self, mut keep: impl FnMut(&CacheKey, &Entry) -> bool) -> usize {
        let mut gone = Vec::new();
        self.map.retain(|k, e| {
            let kept = keep(k, e);
            if !kept {
                gone.push(k.clone());
            }
            kept
        });
        for key in &gone {
            self.unindex(key);
        }
        gone.len()
    }

    fn unindex(&mut self, key: &Arc<CacheKey>) {
        let caller = CallerRef {
            namespace: &key.namespace,
            service_account: &key.service_account,
        };
        if let Some(keys) = self.callers.get_mut(&caller) {
            keys.remove(key);
            if keys.is_empty() {
                self.callers.remove(&caller);
            }
        }
    }

    /// The entries of one caller.
    fn of<'s>(&'s self, keys: &'s Keys) -> impl Iterator<Item = (&'s Arc<CacheKey>, &'s Entry)> {
        keys.iter().filter_map(|k| self.map.get_key_value(k))
    }

    fn keys_of(&self, namespace: &str, service_account: &str) -> Option<&Keys> {
        self.callers.get(&CallerRef {
            namespace,
            service_account,
        })
    }

    /// How many entries a caller holds, and how many of them have an
    /// exchange in flight.
    pub(super) fn holding(&self, namespace: &str, service_account: &str) -> (usize, usize) {
        let Some(keys) = self.keys_of(namespace, service_account) else {
            return (0, 0);
        };
        let inflight = self.of(keys).filter(|(_, e)| e.inflight.is_some()).count();
        (keys.len(), inflight)
    }

    /// A caller's least recently used entry without an exchange in flight.
    pub(super) fn least_recent_idle(
        &self,
        namespace: &str,
        service_account: &str,
    ) -> Option<Arc<CacheKey>> {
        let keys = self.keys_of(namespace, service_account)?;
        self.lru_idle(keys).map(|(k, _)| k.clone())
    }

    fn lru_idle<'s>(&'s self, keys: &'s Keys) -> Option<(&'s Arc<CacheKey>, Instant)> {
        self.of(keys)
            .filter(|(_, e)| e.inflight.is_none())
            .map(|(k, e)| (k, e.last_access))
            .min_by_key(|(_, at)| *at)
    }

    /// What a full cache evicts: the least recently used idle entry of the
    /// caller holding the most entries (among callers holding as many, the
    /// one whose entry is least recently used), so that a caller filling
    /// the cache loses its own entries first. `None` when every entry has
    /// an exchange in flight.
    pub(super) fn eviction_victim(&self) -> Option<Arc<CacheKey>> {
        let mut callers: Vec<&Keys> = self.callers.values().collect();
        callers.sort_unstable_by_key(|keys| std::cmp::Reverse(keys.len()));
        let mut best: Option<(usize, Instant, &Arc<CacheKey>)> = None;
        for keys in callers {
            if best.is_some_and(|(held, _, _)| keys.len() < held) {
                break;
            }
            if let Some((key, at)) = self.lru_idle(keys) {
                if best.is_none_or(|(_, best_at, _)| at < best_at) {
                    best = Some((keys.len(), at, key));
                }
            }
        }
        best.map(|(_, _, key)| key.clone())
    }

    /// Whether the index holds exactly the map's keys, each under its
    /// caller (the module's invariant), for the tests.
    #[cfg(test)]
    pub(super) fn index_is_exact(&self) -> bool {
        let indexed: usize = self.callers.values().map(|keys| keys.len()).sum();
        indexed == self.map.len()
            && self.callers.iter().all(|(caller, keys)| {
                !keys.is_empty()
                    && keys.iter().all(|k| {
                        self.map.contains_key(k)
                            && *k.namespace == *caller.namespace
                            && *k.service_account == *caller.service_account
                    })
            })
    }
}
