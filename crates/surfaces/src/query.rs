//! Query-string parsing shared by the surfaces: tolerant of encoding,
//! strict about repeated parameters (a repeated `client_id` could otherwise
//! be read one way by us and another way by a proxy).
//!
//! The pairs are `form_urlencoded`'s (the `url` crate's, WHATWG's
//! `application/x-www-form-urlencoded`): it borrows names and values that
//! need no decoding, as the hand-written decoder it replaced did. That
//! decoder gained nothing measurable on cached hits: two A B B A runs of
//! `bench/compare` (release builds, 2 cores) gave this version 1.05 and
//! 0.95 of its requests/s, while one binary varied by 8-14 % between its
//! own two runs.

use std::borrow::Cow;
use std::collections::HashSet;

/// Up to this many parameters, a repeat is found by comparing names; past
/// it, by a set (a caller's query of thousands of parameters stays linear).
const SCAN_LIMIT: usize = 16;

/// A parsed query string that remembers whether a parameter was repeated.
/// Names and values borrow from the query unless they were percent-encoded:
/// an SDK's query parses without copying most of it (this runs on every
/// cache hit).
pub struct Query<'a> {
    params: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    duplicated: Option<Cow<'a, str>>,
}

impl<'a> Query<'a> {
    /// Parses `raw` (`None`: no query) as `application/x-www-form-urlencoded`;
    /// of a repeated parameter the last value is kept and the first repeated
    /// name recorded for [`Query::duplicated`].
    pub fn parse(raw: Option<&'a str>) -> Query<'a> {
        let mut params: Vec<(Cow<'a, str>, Cow<'a, str>)> = Vec::new();
        let mut names: Option<HashSet<Cow<'a, str>>> = None;
        let mut duplicated = None;
        for (k, v) in url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            let repeated = match &mut names {
                Some(set) => !set.insert(k.clone()),
                None if params.len() < SCAN_LIMIT => params.iter().any(|(n, _)| *n == k),
                None => {
                    let mut set: HashSet<Cow<'a, str>> =
                        params.iter().map(|(n, _)| n.clone()).collect();
                    let repeated = !set.insert(k.clone());
                    names = Some(set);
                    repeated
                }
            };
            if repeated && duplicated.is_none() {
                duplicated = Some(k.clone());
            }
            params.push((k, v));
        }
        Query { params, duplicated }
    }

    /// A parameter's value (its last, when repeated), `None` when absent or
    /// empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .rev()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_ref())
            .filter(|v| !v.is_empty())
    }

    /// The first parameter that appeared more than once.
    pub fn duplicated(&self) -> Option<&str> {
        self.duplicated.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_pieces_are_borrowed_and_encoded_ones_decoded() {
        let q = Query::parse(Some("api-version=2018-02-01&resource=x&scope=a+b%2Fc"));
        assert!(q
            .params
            .iter()
            .take(2)
            .all(|(k, v)| matches!((k, v), (Cow::Borrowed(_), Cow::Borrowed(_)))));
        assert_eq!(q.get("scope"), Some("a b/c"));
    }

    #[test]
    fn parses_and_flags_duplicates() {
        let q = Query::parse(Some(
            "resource=https%3A%2F%2Fstorage.azure.com&api-version=2018-02-01&x=",
        ));
        assert_eq!(q.get("resource"), Some("https://storage.azure.com"));
        assert_eq!(q.get("x"), None);
        assert_eq!(q.duplicated(), None);
        let q = Query::parse(Some("client_id=a&client_id=b"));
        assert_eq!(q.duplicated(), Some("client_id"));
        assert_eq!(Query::parse(None).get("a"), None);
    }

    #[test]
    fn the_last_value_counts_and_the_first_repeat_is_named_at_any_length() {
        for n in [3, SCAN_LIMIT - 1, SCAN_LIMIT, SCAN_LIMIT + 1, 2000] {
            let mut raw: Vec<String> = (0..n).map(|i| format!("p{i}={i}")).collect();
            let joined = raw.join("&");
            let q = Query::parse(Some(&joined));
            assert_eq!(q.duplicated(), None, "{n}");
            assert_eq!(
                q.get(&format!("p{}", n - 1)),
                Some(format!("{}", n - 1).as_str())
            );
            raw.push("p1=last".into());
            raw.push("p0=x".into());
            let joined = raw.join("&");
            let q = Query::parse(Some(&joined));
            assert_eq!(q.duplicated(), Some("p1"), "{n}");
            assert_eq!(q.get("p1"), Some("last"));
            assert_eq!(q.get("p0"), Some("x"));
            assert_eq!(q.get("absent"), None);
        }
        // Names compare decoded: an encoded repeat is a repeat.
        let q = Query::parse(Some("client%5Fid=a&client_id=b"));
        assert_eq!(q.duplicated(), Some("client_id"));
        assert_eq!(q.get("client_id"), Some("b"));
    }
}
