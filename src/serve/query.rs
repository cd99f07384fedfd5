//! Query-string parsing shared by the surfaces: tolerant of encoding,
//! strict about repeated parameters (a repeated `client_id` could otherwise
//! be read one way by us and another way by a proxy).

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
        for (k, v) in pairs(raw.unwrap_or("")) {
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

/// The decoded name-value pairs of `raw`, as `application/x-www-form-urlencoded`
/// (WHATWG URL, and `form_urlencoded::parse`) reads them: split on `&`,
/// empty pieces skipped, the name ending at the first `=`, `+` read as a
/// space, then percent-decoded, invalid UTF-8 replaced. The query is
/// already a `str`, so a piece with no `%` or `+` is itself, borrowed and
/// not checked again.
fn pairs(raw: &str) -> impl Iterator<Item = (Cow<'_, str>, Cow<'_, str>)> {
    raw.split('&')
        .filter(|piece| !piece.is_empty())
        .map(|piece| {
            let (name, value) = piece.split_once('=').unwrap_or((piece, ""));
            (decode(name), decode(value))
        })
}

fn decode(text: &str) -> Cow<'_, str> {
    let special = |b: &u8| *b == b'%' || *b == b'+';
    let bytes = text.as_bytes();
    let Some(first) = bytes.iter().position(special) else {
        return Cow::Borrowed(text);
    };
    // One pass, `+` and `%XX` together: a `+` never joins a `%` escape
    // (`%2+` is `%2 `), so this is the same as replacing `+` first. An
    // escape that is not two hex digits stays as written. The text between
    // escapes is copied a run at a time (this runs on every cache hit, and
    // a byte-by-byte loop cost about 30 instructions a byte).
    let mut out = Vec::with_capacity(bytes.len());
    out.extend_from_slice(&bytes[..first]);
    let mut rest = &bytes[first..];
    while let Some((&b, tail)) = rest.split_first() {
        match b {
            b'+' => {
                out.push(b' ');
                rest = tail;
            }
            b'%' => {
                let escaped = match tail {
                    [hi, lo, after @ ..] => hex(*hi).zip(hex(*lo)).map(|e| (e, after)),
                    _ => None,
                };
                match escaped {
                    Some(((hi, lo), after)) => {
                        out.push(hi << 4 | lo);
                        rest = after;
                    }
                    None => {
                        out.push(b'%');
                        rest = tail;
                    }
                }
            }
            _ => {
                let run = rest.iter().position(special).unwrap_or(rest.len());
                out.extend_from_slice(&rest[..run]);
                rest = &rest[run..];
            }
        }
    }
    match String::from_utf8(out) {
        Ok(decoded) => Cow::Owned(decoded),
        Err(e) => Cow::Owned(String::from_utf8_lossy(e.as_bytes()).into_owned()),
    }
}

/// The value of an ASCII hex digit.
fn hex(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes as `form_urlencoded` (the `url` crate's) does, awkward
    /// input included.
    #[test]
    fn decodes_as_form_urlencoded_does() {
        let pieces = [
            "",
            "a",
            "=",
            "a=",
            "=b",
            "a=b",
            "a==b",
            "a=b=c",
            "+",
            "a+b=c+d",
            "%",
            "%2",
            "%zz",
            "%41",
            "%2B",
            "%25",
            "%2b+%2B",
            "%C3%A9",
            "%C3",
            "%FF%FE",
            "caf%C3%A9=%E2%82%AC",
            "é=ü",
            "a%3Db=c%26d",
            "x=%0A%00",
            "%%41",
            "+%+",
        ];
        let mut cases: Vec<String> = pieces.iter().map(|p| p.to_string()).collect();
        for a in pieces {
            for b in pieces {
                cases.push(format!("{a}&{b}"));
                cases.push(format!("{a}&&{b}&"));
            }
        }
        for raw in &cases {
            let ours: Vec<(String, String)> = pairs(raw)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            let theirs: Vec<(String, String)> = url::form_urlencoded::parse(raw.as_bytes())
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            assert_eq!(ours, theirs, "{raw:?}");
        }
        // Plain pieces are borrowed, not copied.
        let raw = "api-version=2018-02-01&resource=x";
        assert!(pairs(raw).all(|(k, v)| matches!((k, v), (Cow::Borrowed(_), Cow::Borrowed(_)))));
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
