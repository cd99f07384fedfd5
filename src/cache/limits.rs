//! Upstream protection: a concurrency limit across all clouds and a token
//! bucket per cloud, so that a herd of pods cannot exceed a cloud's quota
//! (Google STS allows 6,000 exchanges a minute per project).

use std::time::Duration;

use tokio::sync::{Mutex, Semaphore, SemaphorePermit};
use tokio::time::Instant;

use crate::cloud::{Cloud, PerCloud};

/// A token bucket: `rate` tokens a second, at most `burst` saved up.
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    state: Mutex<(f64, Instant)>,
}

impl TokenBucket {
    /// A full bucket. `rate_per_second` is raised to at least 0.001 and `burst`
    /// to at least one token, so that it always admits eventually.
    pub fn new(rate_per_second: f64, burst: f64) -> Self {
        let burst = burst.max(1.0);
        TokenBucket {
            rate: rate_per_second.max(0.001),
            burst,
            state: Mutex::new((burst, Instant::now())),
        }
    }

    /// Waits until a token is available and takes it.
    pub async fn acquire(&self) {
        loop {
            let wait = {
                let mut state = self.state.lock().await;
                let now = Instant::now();
                let elapsed = now.duration_since(state.1).as_secs_f64();
                state.0 = (state.0 + elapsed * self.rate).min(self.burst);
                state.1 = now;
                if state.0 >= 1.0 {
                    state.0 -= 1.0;
                    return;
                }
                // Never zero: a deficit of under a nanosecond (float
                // rounding: 0.1 + 0.018 * 50 < 1) would spin here without
                // letting a paused clock move, forever.
                Duration::from_secs_f64((1.0 - state.0) / self.rate).max(Duration::from_nanos(1))
            };
            tokio::time::sleep(wait).await;
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

    /// Drained, then 2 ms later: the deficit left after the first wait
    /// rounded to 0 ns, and `acquire` spun forever on a paused clock.
    #[test]
    fn a_deficit_under_a_nanosecond_still_waits() {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(async {
                let bucket = TokenBucket::new(50.0, 50.0);
                for _ in 0..50 {
                    bucket.acquire().await;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                let start = Instant::now();
                bucket.acquire().await;
                let waited = start.elapsed();
                assert!(waited >= Duration::from_millis(18), "{waited:?}");
                assert!(waited <= Duration::from_millis(20), "{waited:?}");
            });
            let _ = done.send(());
        });
        assert!(
            finished.recv_timeout(Duration::from_secs(10)).is_ok(),
            "acquire never returned"
        );
    }
}
