//! Query-string parsing shared by the surfaces: tolerant of encoding,
//! strict about repeated parameters (a repeated `client_id` could otherwise
//! be read one way by us and another way by a proxy).

use std::collections::HashMap;

/// A parsed query string that remembers whether a parameter was repeated.
pub struct Query {
    params: HashMap<String, String>,
    duplicated: Option<String>,
}

impl Query {
    /// Parses `raw` (`None`: no query) as `application/x-www-form-urlencoded`;
    /// of a repeated parameter the last value is kept and the first repeated
    /// name recorded for [`Query::duplicated`].
    pub fn parse(raw: Option<&str>) -> Query {
        let mut params = HashMap::new();
        let mut duplicated = None;
        for (k, v) in url::form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
            if params.insert(k.to_string(), v.into_owned()).is_some() && duplicated.is_none() {
                duplicated = Some(k.into_owned());
            }
        }
        Query { params, duplicated }
    }

    /// A parameter's value, `None` when absent or empty.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.params
            .get(name)
            .map(String::as_str)
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
}
