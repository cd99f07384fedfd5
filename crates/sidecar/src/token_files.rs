//! The pod's projected tokens, read from the directory the kubelet keeps
//! fresh: one file per cloud audience (`azure`, `gcp`, `aws`), re-read as
//! the kubelet rotates them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use lanyard_core::cloud::Cloud;
use lanyard_core::secret::SecretString;
use lanyard_surfaces::token_shelf::TokenShelf;
use lanyard_surfaces::SubjectTokens;

/// How long a read token file is trusted before it is read again. The
/// kubelet rotates at 80% of a token's life (minutes at the least), so a
/// few seconds of staleness never serves an expired token.
const REREAD_AFTER: Duration = Duration::from_secs(5);

/// The file that holds the projected token for `cloud`.
pub fn token_file(dir: &Path, cloud: Cloud) -> PathBuf {
    dir.join(cloud.to_string())
}

/// Projected tokens from files, re-read as the kubelet rotates them.
pub struct FileTokens {
    dir: PathBuf,
    shelf: TokenShelf,
}

impl FileTokens {
    /// Tokens from the files in `dir`, one per cloud ([`token_file`]). Nothing
    /// is read until a token is asked for; a token read more than five seconds
    /// ago is read again, so a rotation by the kubelet is picked up promptly.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileTokens {
            dir: dir.into(),
            shelf: TokenShelf::new(REREAD_AFTER),
        }
    }

    /// Whether at least one cloud's token file is readable.
    pub async fn any_readable(&self) -> bool {
        for cloud in Cloud::ALL {
            if tokio::fs::metadata(token_file(&self.dir, cloud))
                .await
                .is_ok()
            {
                return true;
            }
        }
        false
    }

    /// Reads `cloud`'s token file.
    async fn read(&self, cloud: Cloud) -> Result<SecretString, String> {
        let path = token_file(&self.dir, cloud);
        let contents = tokio::fs::read_to_string(&path).await.map_err(|e| {
            format!(
                "cannot read the {cloud} projected token {}: {e}",
                path.display()
            )
        })?;
        let token = contents.trim();
        if token.is_empty() {
            return Err(format!(
                "the {cloud} projected token {} is empty",
                path.display()
            ));
        }
        Ok(SecretString::from(token.to_string()))
    }
}

#[async_trait::async_trait]
impl SubjectTokens for FileTokens {
    async fn token(&self, cloud: Cloud) -> Result<Arc<SecretString>, String> {
        self.shelf.get(cloud, || self.read(cloud)).await
    }
}
