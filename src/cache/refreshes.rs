//! Refresh ahead: when a credential is refreshed ([`refresh_at`]), and the
//! schedule holding every entry's next refresh in one ordered map, served
//! by one task ([`schedule_refresh`]).
//!
//! A Tokio task and timer per entry, each with its own copy of the key,
//! cost about 0.6 KiB per entry (measured with heaptrack on an agent
//! holding 10,000 credentials: 5.1 MB of task cells, 0.9 MB of keys).
//! Here a scheduled refresh is one map item sharing the entry's key, and the cache's one refresh task sleeps until the earliest is due
//! (or until an earlier one is scheduled).
//!
//! An item names the entry's key and the generation of the value it was
//! scheduled for; the cache ignores it when that value has since been
//! replaced or the entry removed. Such stale items stay until they come
//! due, as the per-entry timers did: at most one per stored value.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::Notify;
use tokio::time::Instant;

use std::sync::Weak;
use std::time::Duration;

use super::{CacheKey, Inner};
use crate::cloud::Cloud;

/// When each entry is to be refreshed next.
pub(super) struct Refreshes {
    /// (due, tie-breaker) → (key, generation).
    due: Mutex<Schedule>,
    /// Wakes the refresh task: an earlier item was scheduled, or the cache
    /// is being dropped.
    wake: Arc<Notify>,
    /// Whether the refresh task was started (on the first schedule, which
    /// runs inside the runtime).
    started: AtomicBool,
}

#[derive(Default)]
struct Schedule {
    items: BTreeMap<(Instant, u64), (Arc<CacheKey>, u64)>,
    next_seq: u64,
}

impl Refreshes {
    pub(super) fn new() -> Self {
        Refreshes {
            due: Mutex::new(Schedule::default()),
            wake: Arc::new(Notify::new()),
            started: AtomicBool::new(false),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Schedule> {
        // Plain data: a panic while holding the lock leaves it usable.
        self.due.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Schedules a refresh of `key`'s value `generation` at `at`, waking
    /// the task when it is now the earliest.
    pub(super) fn schedule(&self, at: Instant, key: Arc<CacheKey>, generation: u64) {
        let earliest = {
            let mut s = self.lock();
            let seq = s.next_seq;
            s.next_seq = s.next_seq.wrapping_add(1);
            s.items.insert((at, seq), (key, generation));
            s.items.first_key_value().is_some_and(|(k, _)| k.1 == seq)
        };
        if earliest {
            self.wake.notify_one();
        }
    }

    /// Removes and returns every item due at `now`, and when the next one
    /// is due.
    pub(super) fn take_due(&self, now: Instant) -> (Vec<(Arc<CacheKey>, u64)>, Option<Instant>) {
        let mut s = self.lock();
        let later = s.items.split_off(&(now, u64::MAX));
        let due = std::mem::replace(&mut s.items, later);
        let next = s.items.first_key_value().map(|(k, _)| k.0);
        (due.into_values().collect(), next)
    }

    /// Items scheduled, stale ones included.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().items.len()
    }

    /// True exactly once: the caller starts the refresh task.
    pub(super) fn start(&self) -> bool {
        !self.started.swap(true, Ordering::AcqRel)
    }

    /// What wakes the refresh task.
    pub(super) fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Wakes the refresh task (the cache is going away).
    pub(super) fn wake(&self) {
        self.wake.notify_one();
    }
}

/// Schedules a refresh of `key`'s value `generation` at `at`. Runs inside
/// the runtime (an exchange's task), where the refresh task is started on
/// first use.
pub(super) fn schedule_refresh(
    inner: &Arc<Inner>,
    key: Arc<CacheKey>,
    generation: u64,
    at: Instant,
) {
    inner.refreshes.schedule(at, key, generation);
    if inner.refreshes.start() {
        inner.spawn(run_refreshes(
            Arc::downgrade(inner),
            inner.refreshes.waker(),
        ));
    }
}

/// The cache's one refresh task: refreshes what is due, then sleeps until
/// the next item is due or an earlier one is scheduled; ends once the
/// cache is dropped.
async fn run_refreshes(inner: Weak<Inner>, wake: Arc<tokio::sync::Notify>) {
    loop {
        // INVARIANT: registered for a wake-up before the schedule is read,
        // so an item scheduled in between is not slept past.
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let next = {
            let Some(inner) = inner.upgrade() else {
                return;
            };
            let (due, next) = inner.refreshes.take_due(Instant::now());
            for (key, generation) in due {
                inner.refresh(&key, generation);
            }
            next
        };
        match next {
            Some(at) => {
                tokio::select! {
                    () = tokio::time::sleep_until(at) => {}
                    () = &mut notified => {}
                }
            }
            None => notified.await,
        }
    }
}

/// When to refresh a credential fetched at `fetched` that expires at
/// `expires`: at half its lifetime, no later than the cloud's refresh
/// window before expiry, and always before the cache stops serving it
/// (`min_remaining` before expiry), never sooner than a quarter of its
/// lifetime unless that deadline comes first; spread at random over up to
/// a tenth of the lifetime before that.
///
/// `None` when the cache can serve the credential for less than
/// [`MIN_REFRESH_AHEAD`]: refreshing such a credential ahead would call
/// the cloud again at once, and again for its successor, until the entry
/// idled out. The next request after it stops being served exchanges.
///
/// The spread matters at scale: thousands of credentials fetched in the
/// same minute (a node's pods starting together, a DaemonSet rolled out)
/// would otherwise come due together every period. Each refresh draws
/// anew, so the rounds drift apart instead of staying in step.
pub fn refresh_at(cloud: Cloud, fetched: Instant, expires: Instant) -> Option<Instant> {
    // INVARIANT: due before the credential stops being served, or callers
    // would wait on an exchange between the two.
    let serving_until = expires.checked_sub(cloud.min_remaining() + Duration::from_secs(1))?;
    if serving_until < fetched + MIN_REFRESH_AHEAD {
        return None;
    }
    let lifetime = expires.saturating_duration_since(fetched);
    let half = fetched + lifetime / 2;
    let latest = expires
        .checked_sub(cloud.refresh_window())
        .unwrap_or(fetched);
    let floor = fetched + (lifetime / 4).max(Duration::from_secs(1));
    let at = half.min(latest).max(floor).min(serving_until);
    let spread = (lifetime / 10).min(at.saturating_duration_since(floor.min(at)));
    let jitter = spread.mul_f64(random_unit());
    Some(at.checked_sub(jitter).unwrap_or(at))
}

/// The shortest time a credential must be servable from the cache for it
/// to be refreshed ahead ([`refresh_at`]): at most two refreshes a minute
/// per entry, however short the credentials a cloud hands out.
pub const MIN_REFRESH_AHEAD: Duration = Duration::from_secs(30);

/// A uniform random number in [0, 1).
pub(super) fn random_unit() -> f64 {
    use aws_lc_rs::rand::SecureRandom;
    let mut buf = [0u8; 8];
    if aws_lc_rs::rand::SystemRandom::new().fill(&mut buf).is_err() {
        return 0.5;
    }
    (u64::from_le_bytes(buf) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::Cloud;
    use std::time::Duration;

    fn key(name: &str) -> Arc<CacheKey> {
        Arc::new(CacheKey {
            cloud: Cloud::Azure,
            account: "tenant".into(),
            identity: "client".into(),
            scope: "https://storage.azure.com/".into(),
            namespace: "default".into(),
            service_account: name.into(),
            pod_uid: None,
        })
    }

    #[tokio::test]
    async fn due_items_come_out_in_order_and_later_ones_stay() {
        let r = Refreshes::new();
        let t0 = Instant::now();
        r.schedule(t0 + Duration::from_secs(30), key("c"), 1);
        r.schedule(t0 + Duration::from_secs(10), key("a"), 7);
        r.schedule(t0 + Duration::from_secs(10), key("b"), 2);
        r.schedule(t0 + Duration::from_secs(20), key("a"), 8);
        assert_eq!(r.len(), 4);

        let (due, next) = r.take_due(t0 + Duration::from_secs(5));
        assert!(due.is_empty());
        assert_eq!(next, Some(t0 + Duration::from_secs(10)));

        // Due at exactly `now` counts; equal times in scheduling order.
        let (due, next) = r.take_due(t0 + Duration::from_secs(20));
        let names: Vec<(&str, u64)> = due
            .iter()
            .map(|(k, g)| (k.service_account.as_str(), *g))
            .collect();
        assert_eq!(names, [("a", 7), ("b", 2), ("a", 8)]);
        assert_eq!(next, Some(t0 + Duration::from_secs(30)));
        assert_eq!(r.len(), 1);

        let (due, next) = r.take_due(t0 + Duration::from_secs(60));
        assert_eq!(due.len(), 1);
        assert_eq!(next, None);
        assert_eq!(r.len(), 0);
    }

    #[tokio::test]
    async fn an_earlier_item_wakes_the_task_a_later_one_does_not() {
        let r = Refreshes::new();
        let wake = r.waker();
        let t0 = Instant::now();
        r.schedule(t0 + Duration::from_secs(10), key("a"), 1);
        // The first item is the earliest: its permit is stored.
        tokio::time::timeout(Duration::from_secs(5), wake.notified())
            .await
            .expect("woken for the first item");
        r.schedule(t0 + Duration::from_secs(20), key("b"), 1);
        let later = tokio::time::timeout(Duration::from_millis(50), wake.notified()).await;
        assert!(later.is_err(), "woken for an item due after the earliest");
        r.schedule(t0 + Duration::from_secs(5), key("c"), 1);
        tokio::time::timeout(Duration::from_secs(5), wake.notified())
            .await
            .expect("woken for an earlier item");
        assert!(r.start());
        assert!(!r.start(), "the task is started once");
    }
}
