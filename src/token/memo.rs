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
//!
//! Entries are keyed by a SHA-256 of token and audience, and hashing a
//! projected token (about a kilobyte) was the largest single cost of a
//! cached hit where every request is verified (`lanyard dev`, a standalone
//! sidecar: about 4 % of the process's CPU under load). So the memo also
//! keeps the keys of the last few tokens presented ([`Recent`]): a token
//! presented again, byte for byte, finds its key by a comparison instead
//! of a hash. The comparison takes a time that depends only on the
//! lengths: the token in a slot may be another pod's.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use sha2::{Digest, Sha256};
use tokio::sync::watch;

use crate::secret::{ExposeSecret, SecretString};

use super::{Caller, VerifyError, LEEWAY_SECS};

/// How long a successful verification is remembered. Short, so that a key
/// the issuer stops publishing stops being honoured soon after.
const VERIFIED_TTL: Duration = Duration::from_secs(300);
/// Most remembered verifications; the memo is cleared when full.
const VERIFIED_MAX: usize = 16_384;

/// A SHA-256 of token and audience.
pub(super) type Key = [u8; 32];

/// How many recently presented tokens keep their key: a pod's SDKs use a
/// token per cloud, and a node's few busy pods each their own.
const RECENT_SLOTS: usize = 8;

/// The maps' hasher: a [`Key`] is a SHA-256, uniformly distributed and
/// chosen by no caller (only a verified token is remembered), so eight of
/// its bytes are a hash already; SipHash over it cost more than the lookup.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // A `[u8; 32]` hashes as its length, then its bytes: the length
        // is the same for every key, the bytes' first eight are the hash.
        for (i, b) in bytes.iter().take(8).enumerate() {
            self.0 ^= u64::from(*b) << (8 * i);
        }
    }
}

type KeyMap<V> = HashMap<Key, V, BuildHasherDefault<KeyHasher>>;

/// A token presented recently, with its key.
struct Recent {
    token: SecretString,
    audience: Box<str>,
    key: Key,
}

/// A verification's answer.
pub(super) type Verified = Result<Arc<Caller>, VerifyError>;

/// What a leader's followers learn: `None` until it has an answer.
type Landed = Option<Verified>;

/// Recent successes and verifications under way, by [`Key`].
#[derive(Default)]
pub(super) struct Memo {
    verified: Mutex<KeyMap<(Arc<Caller>, Instant)>>,
    /// Each verification under way, as its followers watch it. An entry
    /// lives exactly as long as its [`Leader`].
    flights: Mutex<KeyMap<watch::Receiver<Landed>>>,
    /// Keys of tokens presented recently, each token in the slot its last
    /// bytes (its signature's) pick.
    recent: [ArcSwapOption<Recent>; RECENT_SLOTS],
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
    /// The key of `token` for `audience`: found among the tokens presented
    /// recently, or hashed (and then kept there).
    pub(super) fn key(&self, token: &str, audience: &str) -> Key {
        let slot = &self.recent[slot_of(token)];
        if let Some(recent) = &*slot.load() {
            if recent.audience.as_ref() == audience
                && same_bytes(recent.token.expose_secret().as_bytes(), token.as_bytes())
            {
                return recent.key;
            }
        }
        let key = hashed(token, audience);
        slot.store(Some(Arc::new(Recent {
            token: token.into(),
            audience: audience.into(),
            key,
        })));
        key
    }

    /// The caller verified for `key` recently, while its token is valid
    /// (`now`: Unix seconds).
    pub(super) fn remembered(&self, key: &Key, now: u64) -> Option<Arc<Caller>> {
        Self::find(&lock(&self.verified), key, now)
    }

    fn find(verified: &KeyMap<(Arc<Caller>, Instant)>, key: &Key, now: u64) -> Option<Arc<Caller>> {
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

/// The [`Key`] of `token` for `audience`.
fn hashed(token: &str, audience: &str) -> Key {
    Sha256::new()
        .chain_update(token.as_bytes())
        .chain_update([0u8])
        .chain_update(audience.as_bytes())
        .finalize()
        .into()
}

/// The slot of [`Memo::recent`] for `token`: from its last eight bytes,
/// which for a signed token are its signature's (base64url text).
fn slot_of(token: &str) -> usize {
    let tail = token.as_bytes().iter().rev().take(8);
    let mixed = tail.fold(0u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    // RECENT_SLOTS is a power of two: the top bits, well mixed, pick one.
    (mixed >> (64 - RECENT_SLOTS.trailing_zeros())) as usize
}

/// Whether `a` and `b` are the same bytes, in a time that depends only on
/// their lengths: no early exit at the first difference, so a caller
/// cannot learn, a byte at a time, the token another pod left in a slot.
/// Eight bytes at a time, which the compiler vectorizes; `subtle`'s
/// comparison goes a byte at a time and costs more than the hash it saves.
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let (a_words, a_rest) = a.as_chunks::<8>();
    let (b_words, b_rest) = b.as_chunks::<8>();
    let words = a_words.iter().zip(b_words).fold(0u64, |d, (x, y)| {
        d | (u64::from_ne_bytes(*x) ^ u64::from_ne_bytes(*y))
    });
    let rest = a_rest.iter().zip(b_rest).fold(0u8, |d, (x, y)| d | (x ^ y));
    std::hint::black_box(words | u64::from(rest)) == 0
}

/// The maps are left consistent at every step, so a panic elsewhere while
/// one was held does not make it unusable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_presented_again_has_the_key_it_hashes_to() {
        let memo = Memo::default();
        let token = format!("header.payload.{}", "s".repeat(342));
        // The same last bytes (so the same slot), one byte different.
        let other = format!("Header.payload.{}", "s".repeat(342));
        assert_eq!(slot_of(&token), slot_of(&other));
        for _ in 0..3 {
            for (t, a) in [
                (&token, "aud"),
                (&other, "aud"),
                (&token, "aud2"),
                (&token, "aud"),
            ] {
                assert_eq!(memo.key(t, a), hashed(t, a), "{a}");
            }
        }
        // Found in its slot when asked again: the slot holds this token.
        memo.key(&token, "aud");
        let slot = memo.recent[slot_of(&token)].load();
        let recent = slot.as_ref().expect("kept");
        assert_eq!(recent.token.expose_secret(), token);
        assert_eq!(recent.key, hashed(&token, "aud"));
        // A prefix or an extension of a token is another token.
        for t in [&token[..token.len() - 1], &format!("{token}s")] {
            assert_eq!(memo.key(t, "aud"), hashed(t, "aud"));
        }
    }

    #[test]
    fn same_bytes_compares_every_byte_and_the_length() {
        let a: Vec<u8> = (0..=255u8).cycle().take(1037).collect();
        assert!(same_bytes(&a, &a.clone()));
        assert!(same_bytes(b"", b""));
        for i in 0..a.len() {
            let mut b = a.clone();
            b[i] ^= 0x01;
            assert!(!same_bytes(&a, &b), "{i}");
        }
        assert!(!same_bytes(&a, &a[..a.len() - 1]));
        assert!(!same_bytes(&a[1..], &a[..a.len() - 1]));
    }

    #[test]
    fn slots_spread_tokens() {
        let used: std::collections::HashSet<usize> = (0..64)
            .map(|i| slot_of(&format!("h.p.signature{i:04}")))
            .collect();
        assert!(used.len() >= RECENT_SLOTS - 1, "{used:?}");
        assert!(used.iter().all(|&s| s < RECENT_SLOTS));
    }
}
