//! What an emulator handed out and to whom.

/// What an emulator handed out and to whom, as the real service's own
/// records would show (Entra's sign-in log, CloudTrail, IAM audit logs):
/// tests ask it which identity a credential a pod received belongs to, and
/// how many exchanges each identity caused.
///
/// Bounded: it keeps the last [`Ledger::CAPACITY`] credentials; the counts
/// are per principal, of which an emulator knows a configured handful.
#[derive(Default)]
pub struct Ledger {
    inner: std::sync::Mutex<LedgerInner>,
}

#[derive(Default)]
struct LedgerInner {
    owners: std::collections::HashMap<String, String>,
    order: std::collections::VecDeque<String>,
    counts: std::collections::BTreeMap<String, u64>,
}

impl Ledger {
    /// Credentials remembered at most; the oldest are forgotten first.
    pub const CAPACITY: usize = 100_000;

    /// Records that `credential` was issued to `principal`.
    pub fn record(&self, credential: &str, principal: &str) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        *inner.counts.entry(principal.to_string()).or_default() += 1;
        if inner.order.len() >= Self::CAPACITY {
            if let Some(oldest) = inner.order.pop_front() {
                inner.owners.remove(&oldest);
            }
        }
        inner.order.push_back(credential.to_string());
        inner
            .owners
            .insert(credential.to_string(), principal.to_string());
    }

    /// The principal `credential` was issued to, if it was issued here.
    pub fn owner(&self, credential: &str) -> Option<String> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.owners.get(credential).cloned()
    }

    /// Issuances per principal since start.
    pub fn counts(&self) -> std::collections::BTreeMap<String, u64> {
        let inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.counts.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::Ledger;

    #[test]
    fn remembers_owners_and_counts_and_forgets_the_oldest_beyond_capacity() {
        let ledger = Ledger::default();
        ledger.record("c0", "alice");
        ledger.record("c1", "bob");
        ledger.record("c2", "alice");
        assert_eq!(ledger.owner("c1").as_deref(), Some("bob"));
        assert_eq!(ledger.owner("nope"), None);
        assert_eq!(ledger.counts().get("alice"), Some(&2));
        for i in 0..Ledger::CAPACITY {
            ledger.record(&format!("x{i}"), "carol");
        }
        assert_eq!(ledger.owner("c0"), None, "the oldest is forgotten");
        assert_eq!(ledger.owner("x0").as_deref(), Some("carol"));
        assert_eq!(ledger.counts().get("alice"), Some(&2), "counts are kept");
    }
}
