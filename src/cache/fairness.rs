//! Fairness between callers (ServiceAccounts) on one node.
//!
//! The upstream limits ([`super::limits`]) protect the clouds; they are
//! node-wide, so without these bounds one pod asking for many distinct
//! scopes (each a miss) would take the node's upstream budget and, filling
//! the cache, evict other pods' credentials. Per ServiceAccount:
//! - at most `inflight` exchanges of its own at once;
//! - new cache keys at most `new_keys_per_second` (with a burst): the
//!   cloud's rate is shared, one caller's flood cannot spend it all;
//! - at most `max_entries` entries: past it, its own least recently used
//!   entry makes room; and when the whole cache is full, the entry evicted
//!   is the least recently used of the caller holding the most.
//!
//! A caller over a bound gets a throttling answer (429 with `Retry-After`
//! in its SDK's format); others are not slowed. Cache hits are never
//! limited.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::limits::Gcra;

/// The bounds, per ServiceAccount (`cache.caller_*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CallerLimits {
    /// Most exchanges one caller has in flight at once.
    pub inflight: usize,
    /// New cache keys a second, sustained.
    pub new_keys_per_second: f64,
    /// New cache keys allowed at once before the rate applies.
    pub new_keys_burst: f64,
    /// Most cache entries one caller holds.
    pub max_entries: usize,
}

impl Default for CallerLimits {
    /// A Ray worker asks for a handful of scopes; a few hundred distinct
    /// ones is already unusual, and 8 exchanges at once serve a pod that
    /// starts with every SDK at once.
    fn default() -> Self {
        CallerLimits {
            inflight: 8,
            new_keys_per_second: 5.0,
            new_keys_burst: 50.0,
            max_entries: 1_000,
        }
    }
}

pub use crate::cloud::CallerLimit;

/// Per-caller token buckets for new keys, by (namespace, ServiceAccount):
/// each an arrival time on the upstream buckets' schedule ([`Gcra`]),
/// taken from without waiting, since a caller over its bound is answered
/// at once rather than queued.
pub struct NewKeyBuckets {
    buckets: HashMap<(String, String), Instant>,
    /// Bucket count at which refilled buckets are next forgotten.
    prune_at: usize,
}

/// Buckets kept before the first pruning. A bucket that has refilled (its
/// arrival time past: the caller idle for `burst / rate` seconds, 10 s by
/// default) means nothing and is forgotten; pruning when the count has
/// doubled since the last keeps memory proportional to the callers
/// actually being limited (a node with 10,000 ServiceAccounts would
/// otherwise keep 10,000 buckets) at an amortized constant cost per new
/// key.
const PRUNE_FLOOR: usize = 256;

impl NewKeyBuckets {
    /// No caller seen yet.
    pub fn new() -> Self {
        NewKeyBuckets {
            buckets: HashMap::new(),
            prune_at: PRUNE_FLOOR,
        }
    }

    /// Takes a token for `caller`, or says how long until one is there.
    pub fn take(
        &mut self,
        namespace: &str,
        service_account: &str,
        limits: &CallerLimits,
        now: Instant,
    ) -> Result<(), Duration> {
        let schedule = Gcra::new(limits.new_keys_per_second, limits.new_keys_burst);
        if self.buckets.len() >= self.prune_at {
            self.buckets.retain(|_, next| *next > now);
            self.buckets.shrink_to_fit();
            self.prune_at = (self.buckets.len() * 2).max(PRUNE_FLOOR);
        }
        let key = (namespace.to_string(), service_account.to_string());
        // A caller not seen (or forgotten) has a full bucket.
        let next = self.buckets.entry(key).or_insert(now);
        schedule.try_take(next, now)
    }
}

impl Default for NewKeyBuckets {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refilled_buckets_are_forgotten_and_limited_callers_are_not() {
        let limits = CallerLimits::default();
        let mut b = NewKeyBuckets::new();
        let t0 = Instant::now();
        // A flood that is being limited.
        while b.take("a", "flood", &limits, t0).is_ok() {}
        // 5,000 callers asking once each, 11 s after the flood.
        let later = t0 + Duration::from_secs(11);
        for i in 0..5_000 {
            let t = later + Duration::from_millis(i);
            assert!(b.take("ns", &format!("sa-{i}"), &limits, t).is_ok());
        }
        assert!(
            b.buckets.len() < 1_000,
            "{} buckets kept for callers that refilled",
            b.buckets.len()
        );
        // The flood's bucket refilled too (11 s idle): nothing is lost by
        // forgetting it, as a fresh bucket is full.
        assert!(b.take("a", "flood", &limits, later).is_ok());
    }

    #[test]
    fn each_caller_has_its_own_bucket() {
        let limits = CallerLimits {
            new_keys_per_second: 2.0,
            new_keys_burst: 3.0,
            ..CallerLimits::default()
        };
        let mut b = NewKeyBuckets::new();
        let t0 = Instant::now();
        for _ in 0..3 {
            assert!(b.take("a", "flood", &limits, t0).is_ok());
        }
        let wait = b.take("a", "flood", &limits, t0).unwrap_err();
        assert!(wait > Duration::from_millis(400) && wait <= Duration::from_millis(500));
        // Another ServiceAccount, even of the same namespace, is untouched.
        assert!(b.take("a", "quiet", &limits, t0).is_ok());
        // Half a second later the flood has one more token.
        assert!(b
            .take("a", "flood", &limits, t0 + Duration::from_millis(500))
            .is_ok());
    }
}
