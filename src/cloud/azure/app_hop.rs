//! Entra's managed-identity-to-app hop: a user-assigned managed identity
//! that an app registration trusts as a federated credential ("managed
//! identity as a federated identity credential"). The pod's token gives
//! the managed identity named in `azure.workload.identity/client-id` a
//! token for the cloud's token-exchange audience (`api://AzureADTokenExchange`
//! and its sovereign twins: the audience of the pod's own token); that
//! token is the app's `client_assertion` in the app's tenant, often
//! another one (a multi-tenant app provisioned there). Annotations:
//! `lanyard.dev/azure-app-client-id`, `lanyard.dev/azure-app-tenant-id`.
//!
//! The first hop's token never leaves Lanyard. It is kept per
//! ServiceAccount and identity ([`FirstHops`]): every app and resource the
//! identity reaches for that ServiceAccount shares it, and requests that
//! need it at the same moment wait for one exchange.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cloud::{now_unix, AccessToken, CloudError};
use crate::secret::SecretString;

/// Most first-hop tokens kept: one per ServiceAccount and identity that
/// uses the hop on this node.
const MAX_FIRST_HOPS: usize = 4096;

/// A first-hop token is used while it has at least this long to live:
/// the second hop's token may then outlive it, as Entra allows.
const MIN_REMAINING: Duration = Duration::from_secs(300);

type Slot = Arc<tokio::sync::Mutex<Option<AccessToken>>>;

/// The first hop's tokens, by ServiceAccount and identity.
#[derive(Default)]
pub struct FirstHops {
    slots: Mutex<HashMap<String, Slot>>,
}

/// Which hop of the chain a failure came from, for the message the SDK
/// reads.
#[derive(Debug, Clone, Copy)]
pub enum Hop<'a> {
    /// The managed identity's token for the token-exchange audience.
    Identity {
        /// Its client id.
        client_id: &'a str,
        /// Its tenant.
        tenant: &'a str,
    },
    /// The app's token for the resource.
    App {
        /// The app's client id.
        client_id: &'a str,
        /// The tenant asked.
        tenant: &'a str,
    },
}

impl Hop<'_> {
    /// `error` as it happened in this hop: the message names the hop, so
    /// that the SDK's error says which trust is missing.
    pub fn named(self, error: CloudError) -> CloudError {
        let name = match self {
            Hop::Identity { client_id, tenant } => format!(
                "managed identity hop (identity {client_id} in tenant {tenant}, for the app's assertion)"
            ),
            Hop::App { client_id, tenant } => {
                format!("app hop (app {client_id} in tenant {tenant}, with the managed identity's token)")
            }
        };
        match error {
            CloudError::Rejected {
                cloud,
                code,
                message,
            } => CloudError::Rejected {
                cloud,
                code,
                message: format!("{name}: {message}"),
            },
            CloudError::Unavailable { cloud, reason } => CloudError::Unavailable {
                cloud,
                reason: format!("{name}: {reason}"),
            },
            CloudError::Protocol { cloud, reason } => CloudError::Protocol {
                cloud,
                reason: format!("{name}: {reason}"),
            },
            other => other,
        }
    }
}

impl FirstHops {
    /// The first hop's token for `key`: the one kept, while it has
    /// [`MIN_REMAINING`] to live, else a new one from `exchange` (which
    /// callers of the same key wait for, rather than each exchanging).
    /// Failures are not kept.
    pub async fn get<F, Fut>(&self, key: String, exchange: F) -> Result<SecretString, CloudError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<AccessToken, CloudError>>,
    {
        let slot = self.slot(key);
        let mut held = slot.lock().await;
        if let Some(token) = held.as_ref() {
            if token.expires_at > now_unix() + MIN_REMAINING.as_secs() {
                return Ok(token.token.clone());
            }
        }
        let token = exchange().await?;
        let secret = token.token.clone();
        *held = Some(token);
        Ok(secret)
    }

    fn slot(&self, key: String) -> Slot {
        // A poisoned lock only means another request panicked while
        // holding it; the map is still whole.
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if !slots.contains_key(&key) && slots.len() >= MAX_FIRST_HOPS {
            // INVARIANT: only idle slots go (no request holds them); the
            // rest are re-exchanged when next needed.
            slots.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
        slots.entry(key).or_default().clone()
    }

    /// How many are kept (tests).
    #[cfg(test)]
    fn kept(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cloud::Cloud;
    use crate::secret::ExposeSecret;
    use std::sync::atomic::{AtomicU32, Ordering};

    fn token(secret: &str, lives: u64) -> AccessToken {
        AccessToken {
            rendered: Default::default(),
            token: SecretString::from(secret.to_string()),
            issued_at: now_unix(),
            expires_at: now_unix() + lives,
        }
    }

    #[tokio::test]
    async fn a_first_hop_is_shared_while_it_lives_and_exchanged_once_under_a_herd() {
        let hops = Arc::new(FirstHops::default());
        let calls = Arc::new(AtomicU32::new(0));
        let mut herd = Vec::new();
        for _ in 0..50 {
            let (hops, calls) = (hops.clone(), calls.clone());
            herd.push(tokio::spawn(async move {
                hops.get("ns/sa/mi".into(), || async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    Ok(token("first", 3600))
                })
                .await
            }));
        }
        for h in herd {
            assert_eq!(h.await.unwrap().unwrap().expose_secret(), "first");
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Near its end, a new one is fetched.
        let soon = FirstHops::default();
        soon.get("k".into(), || async { Ok(token("old", 60)) })
            .await
            .unwrap();
        let got = soon
            .get("k".into(), || async { Ok(token("new", 3600)) })
            .await
            .unwrap();
        assert_eq!(got.expose_secret(), "new");
    }

    #[tokio::test]
    async fn failures_are_not_kept_and_the_hop_is_named() {
        let hops = FirstHops::default();
        let refused = hops
            .get("k".into(), || async {
                Err(CloudError::Rejected {
                    cloud: Cloud::Azure,
                    code: "AADSTS70021".into(),
                    message: "No matching federated identity record found".into(),
                })
            })
            .await
            .unwrap_err();
        let named = Hop::Identity {
            client_id: "mi",
            tenant: "t",
        }
        .named(refused);
        assert!(
            named
                .to_string()
                .contains("managed identity hop (identity mi in tenant t"),
            "{named}"
        );
        let got = hops
            .get("k".into(), || async { Ok(token("ok", 3600)) })
            .await
            .unwrap();
        assert_eq!(got.expose_secret(), "ok");
    }

    #[tokio::test]
    async fn the_memo_is_bounded() {
        let hops = FirstHops::default();
        for i in 0..MAX_FIRST_HOPS + 10 {
            hops.get(format!("k{i}"), || async { Ok(token("t", 3600)) })
                .await
                .unwrap();
        }
        assert!(hops.kept() <= MAX_FIRST_HOPS);
    }
}
