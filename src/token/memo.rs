//! What the verifier remembers of tokens: verifications that succeeded
//! recently, and verifications under way.
//!
//! A pod asks again and again with the same projected token; a signature
//! check (and, when enabled, a TokenReview) per request would be wasted,
//! so a success is remembered for a few minutes. Many requests with one
//! token can also arrive together, before any verification of it has
//! finished: the worker processes of a pod starting at once, or every
//! caller queued behind the first fetch of the issuer's keys. They wait
//! for one verification instead of each running its own signature check
//! and TokenReview.
//!
//! The followers get the leader's answer, a refusal included: it is the
//! verdict on the same token for the same audience at the same moment.
//! Only successes are remembered past the flight. When a leader is
//! cancelled (its client went away) before it finishes, one of its
//! followers takes over.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{Caller, VerifyError, LEEWAY_SECS};

/// How long a successful verification is remembered. Short, so that a key
/// the issuer stops publishing stops being honoured soon after.
const VERIFIED_TTL: Duration = Duration::from_secs(300);
/// Most remembered verifications; the memo is cleared when full.
const VERIFIED_MAX: usize = 16_384;

/// A SHA-256 of token and audience.
pub(super) type Key = [u8; 32];

/// A verification's answer.
pub(super) type Verified = Result<Arc<Caller>, VerifyError>;

/// What a leader's followers learn: `None` until it has an answer.
type Landed = Option<Verified>;

/// Recent successes and verifications under way, by [`Key`].
#[derive(Default)]
pub(super) struct Memo {
    verified: Mutex<HashMap<Key, (Arc<Caller>, Instant)>>,
    /// Each verification under way, as its followers watch it. An entry
    /// lives exactly as long as its [`Leader`].
    flights: Mutex<HashMap<Key, watch::Receiver<Landed>>>,
}

/// What a request for a token does.
pub(super) enum Turn<'a> {
    /// Answered from memory.
    Remembered(Arc<Caller>),
    /// Verify, then [`Leader::land`].
    Lead(Leader<'a>),
    /// Wait for the leader with [`Follower::wait`].
    Follow(Follower),
}

/// The one verification under way for a key.
pub(super) struct Leader<'a> {
    memo: &'a Memo,
    key: Key,
    landed: watch::Sender<Landed>,
}

/// A request waiting for another's verification of the same token.
pub(super) struct Follower(watch::Receiver<Landed>);

impl Memo {
    /// The caller verified for `key` recently, while its token is valid
    /// (`now`: Unix seconds).
    pub(super) fn remembered(&self, key: &Key, now: u64) -> Option<Arc<Caller>> {
        Self::find(&lock(&self.verified), key, now)
    }

    fn find(
        verified: &HashMap<Key, (Arc<Caller>, Instant)>,
        key: &Key,
        now: u64,
    ) -> Option<Arc<Caller>> {
        let (caller, at) = verified.get(key)?;
        (at.elapsed() < VERIFIED_TTL && caller.token_expires_at.saturating_add(LEEWAY_SECS) > now)
            .then(|| caller.clone())
    }

    /// Remembers a success.
    fn remember(&self, key: Key, caller: Arc<Caller>) {
        let mut verified = lock(&self.verified);
        if verified.len() >= VERIFIED_MAX {
            verified.clear();
        }
        verified.insert(key, (caller, Instant::now()));
    }

    /// The caller remembered for `key`, or the turn to verify it: lead,
    /// or follow the verification under way.
    pub(super) fn turn(&self, key: Key, now: u64) -> Turn<'_> {
        let mut flights = lock(&self.flights);
        if let Some(landed) = flights.get(&key) {
            return Turn::Follow(Follower(landed.clone()));
        }
        // INVARIANT: a leader remembers its success before it leaves the
        // flights. Looked up here, under the flights' lock, no request
        // misses both and verifies again a token just verified.
        if let Some(caller) = Self::find(&lock(&self.verified), &key, now) {
            return Turn::Remembered(caller);
        }
        let (landed, watched) = watch::channel(None);
        flights.insert(key, watched);
        Turn::Lead(Leader {
            memo: self,
            key,
            landed,
        })
    }
}

impl Leader<'_> {
    /// Remembers a success and gives the followers the answer.
    pub(super) fn land(self, answer: &Verified) {
        if let Ok(caller) = answer {
            self.memo.remember(self.key, caller.clone());
        }
        self.landed.send_replace(Some(answer.clone()));
        // Dropped here: the flight ends after the memo has the answer.
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        lock(&self.memo.flights).remove(&self.key);
    }
}

impl Follower {
    /// The leader's answer; `None` when it was cancelled before it had
    /// one (take another [`Memo::turn`]).
    pub(super) async fn wait(mut self) -> Option<Verified> {
        // An error: the leader was dropped without landing.
        let landed = self.0.wait_for(Option::is_some).await.ok()?;
        landed.clone()
    }
}

/// The maps are left consistent at every step, so a panic elsewhere while
/// one was held does not make it unusable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
