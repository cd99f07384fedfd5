//! Labels or annotations of one Kubernetes object, as policies read them:
//! a shared, immutable, sorted slice of pairs.
//!
//! Why not `Arc<BTreeMap<String, String>>`: a directory keeps two of these
//! per ServiceAccount, and a ServiceAccount carries a handful of labels and
//! annotations. A B-tree allocates a node sized for eleven pairs (over 500
//! bytes) however few it holds, so for 10,000 ServiceAccounts the maps
//! alone cost about 11 MB; the slice is one allocation of exactly the
//! pairs. Lookups are a binary search, iteration is in key order, as the
//! map's was, and a clone shares rather than copies, so a reflector's
//! snapshot is handed to every request that needs it.

use std::collections::BTreeMap;
use std::sync::{Arc, LazyLock};

/// Labels or annotations of one object: keys unique, in ascending order.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Metadata(Arc<[(Box<str>, Box<str>)]>);

impl Metadata {
    /// The value of `key`, if the object has it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(k, _)| k.as_ref().cmp(key))
            .ok()
            .map(|i| self.0[i].1.as_ref())
    }

    /// The pairs, in ascending key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> + '_ {
        self.0.iter().map(|(k, v)| (k.as_ref(), v.as_ref()))
    }

    /// How many pairs.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No pairs at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `a` and `b` are the same shared value (not merely equal):
    /// the cheap first test of a memo keyed on metadata.
    pub fn ptr_eq(a: &Metadata, b: &Metadata) -> bool {
        Arc::ptr_eq(&a.0, &b.0)
    }
}

impl Default for Metadata {
    /// No pairs; every empty value shares one allocation.
    fn default() -> Self {
        static EMPTY: LazyLock<Metadata> = LazyLock::new(|| Metadata(Arc::new([])));
        EMPTY.clone()
    }
}

impl From<&BTreeMap<String, String>> for Metadata {
    fn from(map: &BTreeMap<String, String>) -> Self {
        if map.is_empty() {
            return Metadata::default();
        }
        // INVARIANT: a BTreeMap iterates its keys unique and ascending,
        // which is what `get`'s binary search relies on.
        Metadata(
            map.iter()
                .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
                .collect(),
        )
    }
}

impl From<BTreeMap<String, String>> for Metadata {
    fn from(map: BTreeMap<String, String>) -> Self {
        Metadata::from(&map)
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Metadata {
    /// Pairs in any order; of a key given twice, the last value stays (as
    /// inserting into a map would).
    fn from_iter<I: IntoIterator<Item = (K, V)>>(pairs: I) -> Self {
        let map: BTreeMap<String, String> = pairs
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        Metadata::from(&map)
    }
}

impl std::fmt::Debug for Metadata {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_like_the_map_it_was_made_from() {
        let m: Metadata = [("b", "2"), ("a", "1"), ("c", "3"), ("a", "again")]
            .into_iter()
            .collect();
        assert_eq!(m.len(), 3);
        assert_eq!(m.get("a"), Some("again"));
        assert_eq!(m.get("c"), Some("3"));
        assert_eq!(m.get("d"), None);
        assert_eq!(m.get(""), None);
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            [("a", "again"), ("b", "2"), ("c", "3")]
        );
        assert_eq!(format!("{m:?}"), r#"{"a": "again", "b": "2", "c": "3"}"#);
        let map = BTreeMap::from([("x".to_string(), "y".to_string())]);
        assert_eq!(Metadata::from(&map).get("x"), Some("y"));
    }

    #[test]
    fn empty_values_share_one_allocation_and_clones_share() {
        let (a, b) = (Metadata::default(), Metadata::from(BTreeMap::new()));
        assert!(a.is_empty() && b.is_empty());
        assert!(Metadata::ptr_eq(&a, &b));
        let m: Metadata = [("k", "v")].into_iter().collect();
        let same: Metadata = [("k", "v")].into_iter().collect();
        assert!(Metadata::ptr_eq(&m, &m.clone()));
        assert!(!Metadata::ptr_eq(&m, &same));
        assert_eq!(m, same);
        assert_ne!(m, a);
    }
}
