//! [`CedarPolicy`]: the [`Policy`] seam answered by a Cedar policy set
//! loaded from a directory, and kept current as the directory changes.
//!
//! With a set loaded, a request is denied unless a `permit` applies, and a
//! `forbid` always wins (Cedar's semantics). A policy whose evaluation
//! fails denies the request (fail closed), naming itself. A new set takes
//! effect only if all of it is valid; otherwise the last good set stays in
//! force and the rejection is reported.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use cedar_policy::{Authorizer, Entities};

use super::entities::{self, MappingError};
use super::load::{self, LoadError, Loaded};
use super::{Decision, Policy, PolicyInput};
use crate::directory::{Attributes, Metadata};

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
    entities: EntityCache,
    decisions: DecisionCache,
    /// This cluster's name (`audit.cluster`), as `context.cluster`.
    cluster: String,
    /// What the last refusal refused (the digest of the files, or the
    /// read error): the same refusal is reported once, however its
    /// diagnostics are ordered.
    last_rejected: Mutex<Option<String>>,
}

/// Most remembered entity sets; the cache is cleared when full.
const ENTITY_CACHE_MAX: usize = 4096;

/// The entities of recent callers: they depend on who asks for which
/// identity (and their labels), not on what is asked, and building them is
/// most of a decision's cost. A relabelled object comes with new labels,
/// which no longer match, so nothing stale is reused.
#[derive(Default)]
struct EntityCache {
    map: Mutex<HashMap<u64, (EntityKey, Arc<Entities>)>>,
    hasher: RandomState,
}

/// What the entities of a decision are built from.
struct EntityKey {
    texts: [String; 12],
    attributes: [Metadata; 4],
}

fn key_texts<'a>(input: &'a PolicyInput<'_>) -> [&'a str; 12] {
    let c = input.caller;
    let i = input.identity;
    [
        &c.namespace,
        &c.service_account,
        c.pod.as_ref().map_or("", |p| p.name.as_str()),
        c.pod.as_ref().map_or("", |p| p.uid.as_str()),
        c.node.as_ref().map_or("", |n| n.name.as_str()),
        i.cloud.name(),
        &i.account,
        &i.id,
        i.account_number.as_deref().unwrap_or("\0"),
        // A chained identity's first hop, and what its second carries.
        i.via.as_ref().map_or("\0", |v| v.id.as_str()),
        i.via.as_ref().map_or("\0", |v| flag(v.session_tags)),
        i.via.as_ref().map_or("\0", |v| flag(v.session_policy)),
    ]
}

fn flag(on: bool) -> &'static str {
    if on {
        "1"
    } else {
        "0"
    }
}

fn key_attributes(a: &Attributes) -> [&Metadata; 4] {
    [
        &a.service_account_labels,
        &a.service_account_annotations,
        &a.namespace_labels,
        &a.pod_labels,
    ]
}

impl EntityKey {
    fn of(input: &PolicyInput<'_>) -> EntityKey {
        EntityKey {
            texts: key_texts(input).map(str::to_string),
            attributes: key_attributes(input.attributes).map(Metadata::clone),
        }
    }

    fn matches(&self, input: &PolicyInput<'_>) -> bool {
        self.texts.iter().zip(key_texts(input)).all(|(a, b)| a == b)
            && self
                .attributes
                .iter()
                .zip(key_attributes(input.attributes))
                .all(|(a, b)| Metadata::ptr_eq(a, b) || a == b)
    }
}

impl EntityCache {
    fn get_or_build(&self, input: &PolicyInput<'_>) -> Result<Arc<Entities>, MappingError> {
        let texts = key_texts(input);
        let hash = self.hasher.hash_one(texts);
        {
            let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((key, entities)) = map.get(&hash) {
                if key.matches(input) {
                    return Ok(entities.clone());
                }
            }
        }
        let entities = Arc::new(entities::entities(input)?);
        let key = EntityKey::of(input);
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= ENTITY_CACHE_MAX {
            map.clear();
        }
        map.insert(hash, (key, entities.clone()));
        Ok(entities)
    }
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
            entities: EntityCache::default(),
            decisions: DecisionCache::default(),
            cluster: String::new(),
            last_rejected: Mutex::new(None),
        })
    }

    /// Names this cluster in every decision's context (`context.cluster`),
    /// so that one policy set can serve a fleet; unset: `""`.
    // INVARIANT: set before the first decision: the decision cache does not
    // key on the cluster, which is the same for every decision after.
    pub fn with_cluster(mut self, cluster: impl Into<String>) -> Self {
        self.cluster = cluster.into();
        self
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

    /// Reads the directory again: `Some(event)` when it changed (loaded,
    /// or rejected with the last good set kept), `None` when it holds the
    /// set in force or the set last rejected.
    pub fn reload(&self) -> Option<ReloadEvent> {
        let files = match load::read_files(&self.dir) {
            Ok(files) => files,
            Err(e) => return self.rejected(e.to_string(), e.to_string()),
        };
        let digest = load::digest(&files);
        if digest == self.loaded().digest {
            *self.last_rejected.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return None;
        }
        Some(match load::parse(&files) {
            Ok(loaded) => {
                *self.last_rejected.lock().unwrap_or_else(|p| p.into_inner()) = None;
                let event = ReloadEvent::Loaded {
                    policies: loaded.count,
                    digest: loaded.digest.clone(),
                };
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(loaded);
                // Decisions of the old set would never match again; drop
                // them, and the old set with them.
                self.decisions
                    .map
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clear();
                event
            }
            Err(e) => return self.rejected(digest, e.to_string()),
        })
    }

    /// A refusal of `what`, unless it is the one refused last.
    fn rejected(&self, what: String, error: String) -> Option<ReloadEvent> {
        let mut last = self.last_rejected.lock().unwrap_or_else(|p| p.into_inner());
        if last.as_deref() == Some(what.as_str()) {
            return None;
        }
        *last = Some(what);
        Some(ReloadEvent::Rejected { error })
    }

    /// Checks the directory every `every` and reports each change once to
    /// `on_event` ([`CedarPolicy::reload`] reports a rejected set once).
    /// Reading and parsing run off the runtime's worker threads.
    pub fn watch(
        self: Arc<Self>,
        every: Duration,
        on_event: impl Fn(ReloadEvent) + Send + Sync + 'static,
    ) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let policy = self.clone();
                if let Ok(Some(event)) = tokio::task::spawn_blocking(move || policy.reload()).await
                {
                    on_event(event);
                }
            }
        })
    }
}

/// Longest denial reason; policies can name long identities.
const MAX_REASON: usize = 512;

fn bounded(mut s: String) -> String {
    if s.len() > MAX_REASON {
        s.truncate(s.floor_char_boundary(MAX_REASON));
        s.push('…');
    }
    s
}

impl Policy for CedarPolicy {
    fn decide(&self, input: &PolicyInput<'_>) -> Decision {
        let loaded = self.loaded();
        let second = input
            .time
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let hash = self.decisions.hash(input, &loaded, second);
        if let Some(decision) = self.decisions.get(hash, input, &loaded, second) {
            return decision;
        }
        let decision = self.evaluate(input, &loaded);
        self.decisions.put(hash, input, &loaded, second, &decision);
        decision
    }

    fn wants_attributes(&self) -> bool {
        true
    }
}

/// Most remembered decisions; cleared when full.
const DECISION_CACHE_MAX: usize = 4096;

/// Recent decisions. A decision is a function of the set in force, the
/// entities (who asks for which identity, with which labels), the request
/// (kind, scopes, audience, lifetime, surface) and the time, which policies
/// see to the second: the same request within the same second of the same
/// set gets the same answer, so a cache hit is a lookup, not an evaluation.
#[derive(Default)]
struct DecisionCache {
    map: Mutex<HashMap<u64, (DecisionKey, Decision)>>,
    hasher: RandomState,
}

struct DecisionKey {
    set: Arc<Loaded>,
    second: u64,
    entity: EntityKey,
    kind: crate::cloud::Kind,
    surface: crate::cloud::Surface,
    scopes: Vec<String>,
    audience: Option<String>,
    lifetime: Option<Duration>,
}

impl DecisionCache {
    fn hash(&self, input: &PolicyInput<'_>, set: &Arc<Loaded>, second: u64) -> u64 {
        let r = input.request;
        let i = input.identity;
        // INVARIANT: the hash only picks the slot; `get` compares the whole
        // key. So the caller is hashed by address: the verifier shares one
        // caller per token, and a pod's repeated requests find their
        // decision without its names being hashed each time. An equal
        // caller elsewhere in memory merely misses; another caller at a
        // reused address fails the comparison.
        self.hasher.hash_one((
            Arc::as_ptr(set) as usize,
            std::ptr::from_ref(input.caller) as usize,
            second,
            [i.cloud.name(), &i.account, &i.id],
            &i.account_number,
            r.kind,
            r.surface,
            &r.scopes,
            &r.audience,
            input.lifetime,
        ))
    }

    fn get(
        &self,
        hash: u64,
        input: &PolicyInput<'_>,
        set: &Arc<Loaded>,
        second: u64,
    ) -> Option<Decision> {
        let map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        let (key, decision) = map.get(&hash)?;
        let r = input.request;
        let same = Arc::ptr_eq(&key.set, set)
            && key.second == second
            && key.entity.matches(input)
            && key.kind == r.kind
            && key.surface == r.surface
            && key.scopes == r.scopes
            && key.audience == r.audience
            && key.lifetime == input.lifetime;
        same.then(|| decision.clone())
    }

    fn put(
        &self,
        hash: u64,
        input: &PolicyInput<'_>,
        set: &Arc<Loaded>,
        second: u64,
        decision: &Decision,
    ) {
        let r = input.request;
        let key = DecisionKey {
            set: set.clone(),
            second,
            entity: EntityKey::of(input),
            kind: r.kind,
            surface: r.surface,
            scopes: r.scopes.clone(),
            audience: r.audience.clone(),
            lifetime: input.lifetime,
        };
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= DECISION_CACHE_MAX {
            map.clear();
        }
        map.insert(hash, (key, decision.clone()));
    }
}

impl CedarPolicy {
    /// Evaluates `input` against `loaded`.
    fn evaluate(&self, input: &PolicyInput<'_>, loaded: &Loaded) -> Decision {
        let built = entities::cedar_request(input, &self.cluster)
            .and_then(|request| Ok((request, self.entities.get_or_build(input)?)));
        let (request, entities) = match built {
            Ok(r) => r,
            Err(e) => {
                return Decision::Deny {
                    reason: bounded(e.to_string()),
                    policies: Vec::new(),
                }
            }
        };
        let response = self.authorizer.is_authorized(
            &request,
            loaded.index.for_request(
                &input.caller.namespace,
                &entities::resource_id(input.identity),
            ),
            &entities,
        );
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
}
