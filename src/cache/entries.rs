//! The cache's entries, and beside them which caller (ServiceAccount)
//! holds which, ordered for eviction.
//!
//! A new key needs its caller's holding (how many entries, how many with an
//! exchange in flight), and a full cache evicts the least recently used
//! idle entry among the callers holding the most. Both used to scan every
//! entry under the cache lock, which every cached hit also takes:
//! `bench/cache_misses` (a full cache of 10,000 entries of 100 callers, a
//! new key at a time, 10 hits between them; release, 2 cores, A B B A)
//! measured a miss at 924 and 910 µs mean with the scans, 21.9 and 22.9 µs
//! with this index, and 11,869 and 12,055 against 460,803 and 439,818
//! requests/s.
//!
//! Here each caller has
//! - its keys (a set: its holding is a look at its own entries), and
//! - a lazy min-heap of `(stamp, key)`, where every entry of the caller has
//!   an item stamped no later than its last access. A hit stamps only its
//!   entry (`last_access`), as before, and leaves the heap alone; an item
//!   found stale when it reaches the top is stamped again and sinks.
//!
//! and the callers are filed in one ordered set by (entries held, most
//! first; then the top of their heap, oldest first). Eviction takes the
//! first caller, brings its heap top up to date, and, if the caller still
//! comes first, evicts that entry: the same choice as the full scan, in
//! O(log n) amortized (each hit costs at most one later re-stamp).
//!
//! INVARIANT: `callers` indexes exactly the keys of `map`, each under its
//! caller, with no caller holding none; `order` holds each caller once,
//! under its number of keys and its `filed` stamp; every entry has an item
//! in its caller's heap stamped no later than its `last_access` (which
//! only grows); `filed` is no later than the last access of any of the
//! caller's idle entries (an exchange that ends reports it:
//! [`Entries::exchange_ended`]). Every insertion and removal goes through the methods here; the
//! map is never handed out mutably as a whole.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeSet, BinaryHeap};
use std::hash::Hash;
use std::sync::Arc;

use hashbrown::{Equivalent, HashMap, HashSet};
use tokio::time::Instant;

use super::{CacheKey, Entry};

/// Whose entries they are: a ServiceAccount.
#[derive(Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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

impl Equivalent<Arc<Caller>> for CallerRef<'_> {
    fn equivalent(&self, caller: &Arc<Caller>) -> bool {
        *caller.namespace == *self.namespace && *caller.service_account == *self.service_account
    }
}

/// A heap item: a key and a time no later than its entry's last access.
/// Ordered by the time alone.
struct Stamped {
    at: Instant,
    key: Arc<CacheKey>,
}

impl PartialEq for Stamped {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}
impl Eq for Stamped {}
impl PartialOrd for Stamped {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Stamped {
    fn cmp(&self, other: &Self) -> Ordering {
        self.at.cmp(&other.at)
    }
}

type Keys = HashSet<Arc<CacheKey>, std::hash::RandomState>;

/// One caller's part of the index.
struct Holding {
    keys: Keys,
    heap: BinaryHeap<Reverse<Stamped>>,
    /// The stamp it is filed under in `order`.
    filed: Instant,
}

/// Where a caller is in the eviction order: most entries first, then the
/// oldest heap top.
type Place = (Reverse<usize>, Instant, Arc<Caller>);

/// The entries' map (keyed by [`CacheKey`], looked up by `KeyRef`, with
/// std's randomly keyed SipHash: scopes are caller-chosen text) and its
/// index by caller.
#[derive(Default)]
pub(super) struct Entries {
    map: HashMap<Arc<CacheKey>, Entry, std::hash::RandomState>,
    callers: HashMap<Arc<Caller>, Holding, std::hash::RandomState>,
    order: BTreeSet<Place>,
}

fn caller_of(key: &CacheKey) -> CallerRef<'_> {
    CallerRef {
        namespace: &key.namespace,
        service_account: &key.service_account,
    }
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
        let at = entry.last_access;
        if self.map.insert(key.clone(), entry).is_some() {
            // Replaced: same caller, same count; its item stands (the new
            // entry's last access is no earlier).
            return;
        }
        let caller = match self.callers.get_key_value(&caller_of(&key)) {
            Some((caller, _)) => caller.clone(),
            None => {
                let caller = Arc::new(Caller {
                    namespace: key.namespace.as_str().into(),
                    service_account: key.service_account.as_str().into(),
                });
                let holding = Holding {
                    keys: Keys::default(),
                    heap: BinaryHeap::new(),
                    filed: at,
                };
                self.callers.insert(caller.clone(), holding);
                caller
            }
        };
        let Some(holding) = self.callers.get_mut(&caller) else {
            return;
        };
        let before = holding.keys.len();
        holding.keys.insert(key.clone());
        holding.heap.push(Reverse(Stamped { at, key }));
        // A new caller's stamp is its entry's; an old caller's stays a
        // lower bound (the new entry is the most recent).
        holding.filed = holding.filed.min(at);
        let filed = holding.filed;
        if before > 0 {
            self.order.remove(&(Reverse(before), filed, caller.clone()));
        }
        self.order.insert((Reverse(before + 1), filed, caller));
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
        let Some((caller, holding)) = self.callers.get_key_value_mut(&caller_of(key)) else {
            return;
        };
        let caller = caller.clone();
        let before = holding.keys.len();
        if !holding.keys.remove(key) {
            return;
        }
        self.order
            .remove(&(Reverse(before), holding.filed, caller.clone()));
        if holding.keys.is_empty() {
            self.callers.remove(&caller);
            return;
        }
        // Its item stays behind, stale, until it reaches the top; a heap
        // mostly of such items is rebuilt.
        if holding.heap.len() > 2 * holding.keys.len() + 32 {
            let keys = &holding.keys;
            let mut items = std::mem::take(&mut holding.heap).into_vec();
            items.retain(|Reverse(item)| keys.contains(&item.key));
            holding.heap = BinaryHeap::from(items);
        }
        self.order
            .insert((Reverse(before - 1), holding.filed, caller));
    }

    /// How many entries a caller holds, and how many of them have an
    /// exchange in flight (a look at that caller's entries only).
    pub(super) fn holding(&self, namespace: &str, service_account: &str) -> (usize, usize) {
        let caller = CallerRef {
            namespace,
            service_account,
        };
        let Some(holding) = self.callers.get(&caller) else {
            return (0, 0);
        };
        let inflight = holding
            .keys
            .iter()
            .filter(|k| self.map.get(*k).is_some_and(|e| e.inflight.is_some()))
            .count();
        (holding.keys.len(), inflight)
    }

    /// Brings `caller`'s heap top up to date and files the caller under it;
    /// returns its least recently used idle entry, if it has one.
    fn settle(&mut self, caller: &Arc<Caller>) -> Option<Arc<CacheKey>> {
        let holding = self.callers.get_mut(caller)?;
        let mut in_flight = Vec::new();
        let mut idle = None;
        while let Some(Reverse(top)) = holding.heap.pop() {
            match self.map.get(&top.key) {
                // Removed since, or one of a removed key's items.
                _ if !holding.keys.contains(&top.key) => {}
                None => {}
                Some(entry) if entry.last_access != top.at => {
                    // Used since: stamped again, it sinks to its place.
                    let at = entry.last_access;
                    holding.heap.push(Reverse(Stamped { at, key: top.key }));
                }
                Some(entry) if entry.inflight.is_some() => in_flight.push(top),
                Some(_) => {
                    idle = Some(top);
                    break;
                }
            }
        }
        let found = idle.as_ref().map(|item| (item.at, item.key.clone()));
        holding
            .heap
            .extend(idle.into_iter().chain(in_flight).map(Reverse));
        // Filed under its least recent idle entry (every item below it was
        // removed, stamped again above it, or is in flight); with none idle,
        // where it was (`exchange_ended` files it lower when one ends).
        if let Some((at, _)) = &found {
            self.refile(caller, *at);
        }
        found.map(|(_, key)| key)
    }

    fn refile(&mut self, caller: &Arc<Caller>, at: Instant) {
        let Some(holding) = self.callers.get_mut(caller) else {
            return;
        };
        if holding.filed != at {
            let held = Reverse(holding.keys.len());
            self.order.remove(&(held, holding.filed, caller.clone()));
            holding.filed = at;
            self.order.insert((held, at, caller.clone()));
        }
    }

    /// `key`'s exchange has ended: its entry is idle again, and may be its
    /// caller's least recent.
    pub(super) fn exchange_ended(&mut self, key: &Arc<CacheKey>) {
        let Some(at) = self.map.get(key).map(|e| e.last_access) else {
            return;
        };
        let Some((caller, holding)) = self.callers.get_key_value(&caller_of(key)) else {
            return;
        };
        if at < holding.filed {
            let caller = caller.clone();
            self.refile(&caller, at);
        }
    }

    /// A caller's least recently used entry without an exchange in flight.
    pub(super) fn least_recent_idle(
        &mut self,
        namespace: &str,
        service_account: &str,
    ) -> Option<Arc<CacheKey>> {
        let caller = CallerRef {
            namespace,
            service_account,
        };
        let caller = self.callers.get_key_value(&caller)?.0.clone();
        self.settle(&caller)
    }

    /// What a full cache evicts: among the callers holding the most
    /// entries, the least recently used idle entry, so that a caller
    /// filling the cache loses its own entries first. `None` when every
    /// entry has an exchange in flight.
    pub(super) fn eviction_victim(&mut self) -> Option<Arc<CacheKey>> {
        // Callers whose every entry is in flight, passed over.
        let mut passed: Vec<Place> = Vec::new();
        let result = loop {
            let Some(first) = self.order.pop_first() else {
                break None;
            };
            let (held, filed, caller) = first.clone();
            // Settle it (which files it again, maybe elsewhere).
            self.order.insert(first);
            let idle = self.settle(&caller);
            let Some(holding) = self.callers.get(&caller) else {
                break None;
            };
            if holding.filed != filed {
                // Its stamp moved: another caller may come first now.
                continue;
            }
            match idle {
                Some(key) => break Some(key),
                None => {
                    self.order.remove(&(held, filed, caller.clone()));
                    passed.push((held, filed, caller));
                }
            }
        };
        self.order.extend(passed);
        result
    }

    /// The entry of `key`, for the tests.
    #[cfg(test)]
    pub(super) fn entry_for_tests(&self, key: &Arc<CacheKey>) -> Option<&Entry> {
        self.map.get(key)
    }

    /// Whether the index matches the map (the module's invariant), for
    /// the tests.
    #[cfg(test)]
    pub(super) fn index_is_exact(&self) -> bool {
        let indexed: usize = self.callers.values().map(|h| h.keys.len()).sum();
        indexed == self.map.len()
            && self.order.len() == self.callers.len()
            && self.callers.iter().all(|(caller, holding)| {
                let stamped = |k: &Arc<CacheKey>, e: &Entry| {
                    holding
                        .heap
                        .iter()
                        .any(|Reverse(item)| Arc::ptr_eq(&item.key, k) && item.at <= e.last_access)
                };
                !holding.keys.is_empty()
                    && self.order.contains(&(
                        Reverse(holding.keys.len()),
                        holding.filed,
                        caller.clone(),
                    ))
                    && holding.keys.iter().all(|k| {
                        self.map.get_key_value(k).is_some_and(|(stored, e)| {
                            *k.namespace == *caller.namespace
                                && *k.service_account == *caller.service_account
                                && stamped(stored, e)
                                && (e.inflight.is_some() || holding.filed <= e.last_access)
                        })
                    })
            })
    }
}
