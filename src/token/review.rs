//! Optional TokenReview: on first sight of a token, ask the API server
//! whether it still authenticates (the server also checks that the bound
//! pod and ServiceAccount still exist with the token's uids). Off by
//! default: it costs an API call per new token, and the agent's own checks
//! (signature, claims, pod liveness from its watch) cover the same ground
//! a moment later.

use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use kube::api::PostParams;
use kube::Api;

use super::VerifyError;

/// Reviews tokens through the Kubernetes API (`create tokenreviews`).
pub struct TokenReviewer {
    api: Api<TokenReview>,
}

impl TokenReviewer {
    /// A reviewer creating TokenReviews with `client`'s credentials.
    pub fn new(client: kube::Client) -> Self {
        TokenReviewer {
            api: Api::all(client),
        }
    }

    /// `Ok(())` when the API server authenticates `token` for `audience`.
    pub async fn review(&self, token: &str, audience: &str) -> Result<(), VerifyError> {
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_string()),
                audiences: Some(vec![audience.to_string()]),
            },
            ..Default::default()
        };
        let unavailable = |reason: String| {
            VerifyError::Keys(super::KeysError::Fetch {
                url: "kubernetes API tokenreviews".into(),
                reason,
            })
        };
        let answer = tokio::time::timeout(
            crate::http::KUBE_REQUEST_TIMEOUT,
            self.api.create(&PostParams::default(), &review),
        )
        .await
        .map_err(|_| unavailable("timed out".into()))?
        .map_err(|e| unavailable(e.to_string()))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated == Some(true) {
            Ok(())
        } else {
            Err(VerifyError::Refused {
                reason: "token_review".into(),
                message: format!(
                    "the API server does not authenticate this token: {}",
                    status.error.unwrap_or_else(|| "no reason given".into())
                ),
            })
        }
    }
}
