//! The container authorization token (`AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE`)
//! as the AWS container-credentials endpoint checks it, across rotations.
//!
//! botocore reads the file and sends its contents as `Authorization`; the
//! endpoint reads the same file and compares. The kubelet rotates the file
//! (an atomic symlink swap at 80% of the token's lifetime), so a client can
//! read the old token an instant before the swap and arrive after it: a
//! plain comparison with the file refuses that call. The pod end-to-end
//! harness caught exactly this. So the endpoint also accepts the token the
//! file held just before, for [`GRACE`] after it saw the file change, and
//! [`ContainerToken::observe`] runs on a timer so that a change is seen
//! even while no one calls.
//!
//! The old token is no weaker than the new: both were written into the
//! pod's own file, only the pod's containers can read either, and the
//! grace ends soon after the swap.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use lanyard_core::secret::{constant_time_eq, ExposeSecret, SecretString};

/// How long the token a rotation replaced is still accepted.
pub const GRACE: Duration = Duration::from_secs(60);

/// How often [`ContainerToken::observe`] should run while idle.
pub const OBSERVE_EVERY: Duration = Duration::from_secs(5);

/// A token matching what the file held this recently is accepted without
/// reading the file again.
pub const REREAD_AFTER: Duration = Duration::from_secs(1);

/// What the file held, as last read.
#[derive(Default)]
struct Seen {
    current: Option<SecretString>,
    /// The token before `current`, and when it was replaced.
    previous: Option<(SecretString, Instant)>,
    /// When the file was last read.
    read_at: Option<Instant>,
}

/// The file, and what it held as last read.
pub struct ContainerToken {
    file: PathBuf,
    seen: Mutex<Seen>,
}

/// Why a presented token was not checked.
#[derive(Debug, thiserror::Error)]
pub enum ContainerTokenError {
    /// The file cannot be read (not written yet, or not mounted).
    #[error("cannot read {file}: {source}")]
    Unreadable {
        /// The token file.
        file: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

impl ContainerToken {
    /// The token in `file`; nothing read yet.
    pub fn new(file: impl Into<PathBuf>) -> Self {
        ContainerToken {
            file: file.into(),
            seen: Mutex::default(),
        }
    }

    /// The token file.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Reads the file and notes a change.
    pub async fn observe(&self) -> Result<(), ContainerTokenError> {
        let contents = tokio::fs::read_to_string(&self.file)
            .await
            .map_err(|source| ContainerTokenError::Unreadable {
                file: self.file.clone(),
                source,
            })?;
        let now = contents.trim();
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.read_at = Some(Instant::now());
        let changed = seen
            .current
            .as_ref()
            .is_none_or(|c| !constant_time_eq(c.expose_secret().as_bytes(), now.as_bytes()));
        if changed {
            let replaced = seen.current.take();
            seen.previous = replaced.map(|old| (old, Instant::now()));
            seen.current = Some(SecretString::from(now.to_string()));
        }
        Ok(())
    }

    /// Whether `presented` is the file's token (read now, or matched less
    /// than [`REREAD_AFTER`] after the last read), or the one it replaced
    /// less than [`GRACE`] ago. An empty file accepts nothing.
    pub async fn accepts(&self, presented: &[u8]) -> Result<bool, ContainerTokenError> {
        let matches = |token: &SecretString| {
            let token = token.expose_secret().as_bytes();
            !token.is_empty() && constant_time_eq(presented, token)
        };
        {
            // The token the file held less than a second ago is accepted
            // without reading it again: a read on every request (a blocking
            // file read, handed to another thread) cost a third of this
            // endpoint's throughput. A rotation is seen at the next
            // mismatch or within the second, and the token it replaced
            // stays accepted for GRACE anyway.
            let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if seen.read_at.is_some_and(|at| at.elapsed() < REREAD_AFTER)
                && seen.current.as_ref().is_some_and(matches)
            {
                return Ok(true);
            }
        }
        self.observe().await?;
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        // INVARIANT: both comparisons always run, so the time taken does not
        // tell which token (if any) matched. (The early answer above only
        // tells a caller that already holds the current token that it does.)
        let current = seen.current.as_ref().is_some_and(matches);
        let previous = seen
            .previous
            .as_ref()
            .is_some_and(|(token, replaced)| replaced.elapsed() < GRACE && matches(token));
        Ok(current | previous)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_replaced_token_is_accepted_only_within_the_grace() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("app");
        std::fs::write(&file, "token-one\n").unwrap();
        let token = ContainerToken::new(&file);
        assert!(token.accepts(b"token-one").await.unwrap());
        assert!(!token.accepts(b"token-two").await.unwrap());
        std::fs::write(&file, "token-two").unwrap();
        assert!(token.accepts(b"token-two").await.unwrap());
        assert!(
            token.accepts(b"token-one").await.unwrap(),
            "within the grace"
        );
        tokio::time::advance(GRACE + Duration::from_secs(1)).await;
        assert!(
            !token.accepts(b"token-one").await.unwrap(),
            "after the grace"
        );
        assert!(token.accepts(b"token-two").await.unwrap());
        // Only the one just replaced: two rotations back is refused.
        std::fs::write(&file, "token-three").unwrap();
        token.observe().await.unwrap();
        assert!(!token.accepts(b"token-one").await.unwrap());
        assert!(token.accepts(b"token-two").await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_match_is_trusted_for_a_second_then_the_file_is_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("app");
        std::fs::write(&file, "token-one").unwrap();
        let token = ContainerToken::new(&file);
        assert!(token.accepts(b"token-one").await.unwrap());
        // Gone from disk: within the second the match needs no read...
        std::fs::remove_file(&file).unwrap();
        assert!(token.accepts(b"token-one").await.unwrap());
        // ...a mismatch always reads, and after the second so does a match.
        assert!(token.accepts(b"token-two").await.is_err());
        tokio::time::advance(REREAD_AFTER).await;
        assert!(token.accepts(b"token-one").await.is_err());
    }

    #[tokio::test]
    async fn an_empty_or_missing_file_accepts_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("app");
        let token = ContainerToken::new(&file);
        assert!(token.accepts(b"").await.is_err());
        std::fs::write(&file, "\n").unwrap();
        assert!(!token.accepts(b"").await.unwrap());
        assert!(!token.accepts(b"x").await.unwrap());
    }
}
