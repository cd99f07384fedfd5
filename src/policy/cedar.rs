//! [`CedarPolicy`]: the [`Policy`] seam answered by a Cedar policy set
//! loaded from a directory, and kept current as the directory changes.
//!
//! With a set loaded, a request is denied unless a `permit` applies, and a
//! `forbid` always wins (Cedar's semantics). A policy whose evaluation
//! fails denies the request (fail closed), naming itself. A new set takes
//! effect only if all of it is valid; otherwise the last good set stays in
//! force and the rejection is reported.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cedar_policy::Authorizer;

use super::entities;
use super::load::{self, LoadError, Loaded};
use super::{Decision, Policy, PolicyInput};

/// What a reload did, for logs, metrics and the audit trail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadEvent {
    /// A new set is in force.
    Loaded {
        /// Policies in it.
        policies: usize,
        /// Its digest.
        digest: String,
    },
    /// The directory changed but its set was refused (or the directory
    /// cannot be read); the previous set stays in force.
    Rejected {
        /// Why, naming the file and line.
        error: String,
    },
}

/// A Cedar policy set from a directory.
pub struct CedarPolicy {
    dir: PathBuf,
    current: RwLock<Arc<Loaded>>,
    authorizer: Authorizer,
}

impl CedarPolicy {
    /// Loads the set in `dir`; refuses an invalid one with every problem.
    pub fn load(dir: impl Into<PathBuf>) -> Result<Self, LoadError> {
        let dir = dir.into();
        let loaded = load::load(&dir)?;
        Ok(CedarPolicy {
            dir,
            current: RwLock::new(Arc::new(loaded)),
            authorizer: Authorizer::new(),
        })
    }

    /// The directory the set comes from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Policies in force.
    pub fn policies(&self) -> usize {
        self.loaded().count
    }

    /// Digest of the set in force.
    pub fn digest(&self) -> String {
        self.loaded().digest.clone()
    }

    fn loaded(&self) -> Arc<Loaded> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the directory again: `Ok(Some(event))` when it changed
    /// (loaded, or rejected with the last good set kept), `Ok(None)` when
    /// it holds the set in force.
    pub fn reload(&self) -> Option<ReloadEvent> {
        let files = match load::read_files(&self.dir) {
            Ok(files) => files,
            Err(e) => {
                return Some(ReloadEvent::Rejected {
                    error: e.to_string(),
                })
            }
        };
        if load::digest(&files) == self.loaded().digest {
            return None;
        }
        Some(match load::parse(&files) {
            Ok(loaded) => {
                let event = ReloadEvent::Loaded {
                    policies: loaded.count,
                    digest: loaded.digest.clone(),
                };
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(loaded);
                event
            }
            Err(e) => ReloadEvent::Rejected {
                error: e.to_string(),
            },
        })
    }

    /// Checks the directory every `every` and reports each change once to
    /// `on_event` (a rejected set is not reported again until the
    /// directory changes again). Reading and parsing run off the runtime's
    /// worker threads.
    pub fn watch(
        self: Arc<Self>,
        every: Duration,
        on_event: impl Fn(ReloadEvent) + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut last_rejected: Option<String> = None;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let policy = self.clone();
                let Ok(event) = tokio::task::spawn_blocking(move || policy.reload()).await else {
                    continue;
                };
                match event {
                    None => last_rejected = None,
                    Some(ReloadEvent::Rejected { error }) => {
                        if last_rejected.as_deref() != Some(error.as_str()) {
                            last_rejected = Some(error.clone());
                            on_event(ReloadEvent::Rejected { error });
                        }
                    }
                    Some(loaded) => {
                        last_rejected = None;
                        on_event(loaded);
                    }
                }
            }
        })
    }
}

/// Longest denial reason; policies can name long identities.
const MAX_REASON: usize = 512;

fn bounded(mut s: String) -> String {
    if s.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

impl Policy for CedarPolicy {
    fn decide(&self, input: &PolicyInput<'_>) -> Decision {
        let (request, entities) = match entities::request(input) {
            Ok(r) => r,
            Err(e) => {
                return Decision::Deny {
                    reason: bounded(e.to_string()),
                    policies: Vec::new(),
                }
            }
        };
        let loaded = self.loaded();
        let response = self
            .authorizer
            .is_authorized(&request, &loaded.set, &entities);
        let diagnostics = response.diagnostics();
        let failed: Vec<String> = diagnostics
            .errors()
            .map(|e| match e {
                cedar_policy::AuthorizationError::PolicyEvaluationError(e) => {
                    e.policy_id().to_string()
                }
            })
            .collect();
        if !failed.is_empty() {
            // Cedar skips a policy whose evaluation fails; a skipped forbid
            // would let the request through. Fail closed instead.
            return Decision::Deny {
                reason: "a policy could not be evaluated".into(),
                policies: failed,
            };
        }
        let policies: Vec<String> = diagnostics.reason().map(ToString::to_string).collect();
        match response.decision() {
            cedar_policy::Decision::Allow => Decision::Allow { policies },
            cedar_policy::Decision::Deny if policies.is_empty() => {
                let caller = input.caller;
                let identity = input.identity;
                Decision::Deny {
                    reason: bounded(format!(
                        "no policy permits service account {}/{} to get {} for {} identity {}",
                        caller.namespace,
                        caller.service_account,
                        input.request.kind.name().replace('_', " "),
                        identity.cloud,
                        identity.id
                    )),
                    policies,
                }
            }
            cedar_policy::Decision::Deny => Decision::Deny {
                reason: "forbidden by policy".into(),
                policies,
            },
        }
    }

    fn wants_attributes(&self) -> bool {
        true
    }
}
