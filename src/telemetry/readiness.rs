//! What `/readyz` answers: a role's named start-up conditions (issuer keys
//! loaded, reflectors synced, certificate loaded), each set by the code that
//! satisfies it.
//!
//! A probe that says "ready" before the process can serve sends traffic to
//! it too early: kubelet marks the pod ready, the Service routes to it, and
//! callers get errors the process would not give a moment later. So each
//! role declares what it waits for, and `/readyz` answers 503 naming every
//! condition not met yet (which is also what an operator needs to see when
//! a pod stays unready), and 200 `ready` once all are.
//!
//! Conditions are declared on a [`ReadinessBuilder`] and frozen by
//! [`ReadinessBuilder::build`], so none can appear after the admin port has
//! started answering: a probe can never see "ready" just before a late
//! condition would have been added. Conditions only ever become met; losing
//! a dependency later (a watch that drops) is the component's own business
//! (reflectors keep serving their last list and resync).
//!
//! The one way back to "not ready" is [`Readiness::stop`], at SIGTERM: the
//! role keeps serving for its shutdown delay while `/readyz` says
//! `shutting down`, so endpoints stop routing to it before it stops
//! listening ([`crate::http::shutdown_delay`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug)]
struct State {
    name: &'static str,
    met: AtomicBool,
}

/// The readiness of one process: all of its conditions, cheap to clone.
#[derive(Debug, Clone)]
pub struct Readiness {
    conditions: Arc<[Arc<State>]>,
    unmet: Arc<AtomicUsize>,
    stopping: Arc<AtomicBool>,
}

/// Declares a [`Readiness`]'s conditions; see [`Readiness::builder`].
#[derive(Debug, Default)]
pub struct ReadinessBuilder {
    conditions: Vec<Arc<State>>,
    unmet: Arc<AtomicUsize>,
}

/// One condition, held by the code that satisfies it.
#[derive(Debug, Clone)]
pub struct Condition {
    state: Arc<State>,
    unmet: Arc<AtomicUsize>,
}

impl Readiness {
    /// Starts declaring conditions.
    pub fn builder() -> ReadinessBuilder {
        ReadinessBuilder::default()
    }

    /// A process with nothing to wait for (`lanyard dev`: its issuer and
    /// bindings are in memory from the start).
    pub fn ready() -> Readiness {
        Readiness::builder().build()
    }

    /// Names of the conditions not met yet, in declaration order, then
    /// `shutting down` once [`Readiness::stop`] was called.
    pub fn unmet(&self) -> Vec<&'static str> {
        let mut unmet: Vec<&'static str> = self
            .conditions
            .iter()
            .filter(|c| !c.met.load(Ordering::Acquire))
            .map(|c| c.name)
            .collect();
        if self.stopping.load(Ordering::Acquire) {
            unmet.push("shutting down");
        }
        unmet
    }

    /// Whether every condition is met and the process is not stopping.
    pub fn is_ready(&self) -> bool {
        self.unmet.load(Ordering::Acquire) == 0 && !self.stopping.load(Ordering::Acquire)
    }

    /// Not ready from now on, for good: the process is stopping.
    pub fn stop(&self) {
        if !self.stopping.swap(true, Ordering::AcqRel) {
            tracing::info!("not ready: shutting down");
        }
    }
}

impl ReadinessBuilder {
    /// Declares a condition, unmet until its [`Condition::set`] is called.
    /// `name` says what is awaited ("issuer keys loaded"); `/readyz` shows it.
    pub fn condition(&mut self, name: &'static str) -> Condition {
        let state = Arc::new(State {
            name,
            met: AtomicBool::new(false),
        });
        self.conditions.push(state.clone());
        self.unmet.fetch_add(1, Ordering::AcqRel);
        Condition {
            state,
            unmet: self.unmet.clone(),
        }
    }

    /// Freezes the set of conditions.
    pub fn build(self) -> Readiness {
        Readiness {
            conditions: self.conditions.into(),
            unmet: self.unmet,
            stopping: Arc::default(),
        }
    }
}

impl Condition {
    /// Marks the condition met (idempotent), logging it and, when it was
    /// the last one, that the process is ready.
    pub fn set(&self) {
        // INVARIANT: `met` flips false -> true exactly once, and only that
        // flip decrements `unmet`, so the counter reaches 0 exactly when
        // every declared condition has been set.
        if self.state.met.swap(true, Ordering::AcqRel) {
            return;
        }
        let left = self.unmet.fetch_sub(1, Ordering::AcqRel) - 1;
        tracing::info!(condition = self.state.name, left, "readiness condition met");
        if left == 0 {
            tracing::info!("ready");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Readiness;

    #[test]
    fn ready_once_every_condition_is_set() {
        let mut builder = Readiness::builder();
        let keys = builder.condition("issuer keys loaded");
        let synced = builder.condition("ServiceAccount list synced");
        let readiness = builder.build();
        assert!(!readiness.is_ready());
        assert_eq!(
            readiness.unmet(),
            ["issuer keys loaded", "ServiceAccount list synced"]
        );
        synced.set();
        synced.set();
        assert!(!readiness.is_ready(), "setting one twice counts once");
        assert_eq!(readiness.unmet(), ["issuer keys loaded"]);
        keys.clone().set();
        assert!(readiness.is_ready());
        assert!(readiness.unmet().is_empty());
    }

    #[test]
    fn nothing_to_wait_for_is_ready() {
        assert!(Readiness::ready().is_ready());
    }

    #[test]
    fn stopping_is_not_ready_for_good() {
        let mut builder = Readiness::builder();
        let keys = builder.condition("issuer keys loaded");
        let readiness = builder.build();
        readiness.clone().stop();
        assert!(!readiness.is_ready());
        assert_eq!(readiness.unmet(), ["issuer keys loaded", "shutting down"]);
        keys.set();
        assert!(
            !readiness.is_ready(),
            "a condition met later does not undo it"
        );
        assert_eq!(readiness.unmet(), ["shutting down"]);
    }
}
