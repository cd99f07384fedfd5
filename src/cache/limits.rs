//! Upstream protection: a concurrency limit across all clouds and a token
//! bucket per cloud, so that a herd of pods cannot exceed a cloud's quota
//! (Google STS allows 6,000 exchanges a minute per project).

use std::time::Duration;

use tokio::sync::{Semaphore, SemaphorePermit};
use tokio::time::Instant;

use crate::cloud::{Cloud, PerCloud};

/// A token bucket: `rate` tokens a second, at most `burst` saved up,
/// served first come, first served.
///
/// Kept as the bucket's "theoretical arrival time" (GCRA): each caller
/// reserves the next free slot under the lock and sleeps until it, so
/// callers are admitted in the order they asked, each woken once. (A
/// bucket whose waiters all sleep until the next token and race for it
/// lets a late caller win again and again: with 2,000 callers at 50 a
/// second, some waited past their clients' 20-s timeout.) Not `governor`,
/// the well-kept GCRA crate: its `until_ready` sleeps until the bucket
/// could admit and then asks again, racing every other waiter (its docs:
/// "might resolve at some later time (depending on what other measurements
/// are made)"), which is that same unordered wait; the order is the reason
/// for these forty lines, not speed.
pub struct TokenBucket {
    schedule: Gcra,
    /// When the bucket would next be empty if no burst were allowed.
    next: std::sync::Mutex<Instant>,
}

/// The schedule of a token bucket kept as its "theoretical arrival time"
/// (GCRA): `rate` tokens a second, `burst` at once. Both of Lanyard's
/// buckets use it: [`TokenBucket`], which queues its callers, and the
/// per-caller buckets of `fairness.rs`, which refuse at once.
#[derive(Debug, Clone, Copy)]
pub struct Gcra {
    /// Seconds between tokens.
    interval: Duration,
    /// How far ahead of the arrival time a caller may go: `burst - 1`
    /// intervals.
    tolerance: Duration,
}

impl Gcra {
    /// `rate_per_second` is raised to at least 0.001 and `burst` to at
    /// least one token, so that the bucket always admits eventually.
    pub fn new(rate_per_second: f64, burst: f64) -> Self {
        let rate = rate_per_second.max(0.001);
        let interval = Duration::from_secs_f64(1.0 / rate);
        let burst = burst.max(1.0);
        Gcra {
            interval,
            tolerance: interval.mul_f64(burst - 1.0),
        }
    }

    /// The earliest a caller asking `now` may go, given the arrival time
    /// `next`: the burst lets it run ahead of the steady schedule by the
    /// tolerance, never before now.
    fn slot(&self, next: Instant, now: Instant) -> (Instant, Instant) {
        let base = next.max(now);
        let slot = base.checked_sub(self.tolerance).unwrap_or(now).max(now);
        (slot, base + self.interval)
    }

    /// Reserves the next slot, however far off: the instant this caller
    /// may go.
    pub fn reserve(&self, next: &mut Instant, now: Instant) -> Instant {
        let (slot, after) = self.slot(*next, now);
        *next = after;
        slot
    }

    /// Takes a token now, or says how long until one is there and takes
    /// nothing.
    pub fn try_take(&self, next: &mut Instant, now: Instant) -> Result<(), Duration> {
        let (slot, after) = self.slot(*next, now);
        if slot > now {
            return Err(slot - now);
        }
        *next = after;
        Ok(())
    }
}

impl TokenBucket {
    /// A full bucket (see [`Gcra::new`] for the bounds on its arguments).
    pub fn new(rate_per_second: f64, burst: f64) -> Self {
        // INVARIANT: `next` starts at or before now, so the first `burst`
        // callers pass at once.
        TokenBucket {
            schedule: Gcra::new(rate_per_second, burst),
            next: std::sync::Mutex::new(Instant::now()),
        }
    }

    /// Reserves the next slot: the instant this caller may go.
    fn reserve(&self) -> Instant {
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        self.schedule.reserve(&mut next, Instant::now())
    }

    /// Waits until a token is available and takes it. Callers are admitted
    /// in the order they called; a caller that gives up (its future
    /// dropped) leaves its slot unused, which only slows the bucket.
    pub async fn acquire(&self) {
        let slot = self.reserve();
        if slot > Instant::now() {
            tokio::time::sleep_until(slot).await;
        }
    }
}

/// The limits every upstream call passes.
pub struct UpstreamLimits {
    concurrency: Semaphore,
    buckets: PerCloud<TokenBucket>,
}

impl UpstreamLimits {
    /// `rates`: exchanges per second, per cloud.
    pub fn new(concurrency: usize, rates: PerCloud<f64>) -> Self {
        UpstreamLimits {
            concurrency: Semaphore::new(concurrency.max(1)),
            buckets: rates.map(|r| TokenBucket::new(r, r)),
        }
    }

    /// Waits for this cloud's rate limit and a concurrency slot.
    pub async fn admit(&self, cloud: Cloud) -> Option<SemaphorePermit<'_>> {
        self.buckets[cloud].acquire().await;
        self.concurrency.acquire().await.ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn bucket_spaces_requests_at_its_rate() {
        let bucket = TokenBucket::new(10.0, 2.0);
        let start = Instant::now();
        for _ in 0..12 {
            bucket.acquire().await;
        }
        // Two from the burst, ten more at 10/s.
        let elapsed = start.elapsed();
        assert!(elapsed >= Duration::from_millis(990), "{elapsed:?}");
        assert!(elapsed <= Duration::from_millis(1100), "{elapsed:?}");
    }

    /// Drained, then 2 ms later: the next caller waits out the rest of
    /// its interval (once, a sub-nanosecond deficit made this spin forever
    /// on a paused clock).
    #[tokio::test(start_paused = true)]
    async fn a_drained_bucket_waits_the_rest_of_an_interval() {
        let bucket = TokenBucket::new(50.0, 50.0);
        for _ in 0..50 {
            bucket.acquire().await;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        let start = Instant::now();
        bucket.acquire().await;
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(17), "{waited:?}");
        assert!(waited <= Duration::from_millis(20), "{waited:?}");
    }

    /// Each caller's slot is fixed when it asks, in the order it asked:
    /// a burst of 3 passes at once, then one slot per interval, so no
    /// later caller can take an earlier caller's turn.
    #[tokio::test(start_paused = true)]
    async fn slots_are_reserved_in_call_order() {
        let bucket = TokenBucket::new(10.0, 3.0);
        let now = Instant::now();
        let slots: Vec<Duration> = (0..6).map(|_| bucket.reserve() - now).collect();
        let ms = |m| Duration::from_millis(m);
        assert_eq!(slots, [ms(0), ms(0), ms(0), ms(100), ms(200), ms(300)]);
    }

    /// 500 callers at 50 a second: admitted in the order they asked, the
    /// last after about 10 s, none starved.
    #[tokio::test(start_paused = true)]
    async fn callers_are_admitted_first_come_first_served() {
        let bucket = std::sync::Arc::new(TokenBucket::new(50.0, 1.0));
        let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let start = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..500usize {
            let (bucket, order) = (bucket.clone(), order.clone());
            tasks.push(tokio::spawn(async move {
                bucket.acquire().await;
                order.lock().unwrap().push((i, start.elapsed()));
            }));
            // Each asks a little after the one before.
            tokio::task::yield_now().await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let order = order.lock().unwrap();
        let indices: Vec<usize> = order.iter().map(|(i, _)| *i).collect();
        assert_eq!(indices, (0..500).collect::<Vec<_>>(), "not in order");
        let last = order.last().unwrap().1;
        assert!(last >= Duration::from_millis(9_950), "{last:?}");
        assert!(last <= Duration::from_millis(10_050), "{last:?}");
    }
}
