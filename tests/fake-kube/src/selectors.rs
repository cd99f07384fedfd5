//! Label and field selectors, parsed and matched as the API server does.

use super::*;

/// Which objects a list or watch selects.
#[derive(Debug, Default)]
pub(crate) struct Filter {
    pub(crate) namespace: Option<String>,
    pub(crate) name: Option<String>,
    pub(crate) fields: Vec<FieldRequirement>,
    pub(crate) labels: Vec<LabelRequirement>,
}

#[derive(Debug, PartialEq)]
pub(crate) struct FieldRequirement {
    pub(crate) field: String,
    pub(crate) equal: bool,
    pub(crate) value: String,
}

#[derive(Debug, PartialEq)]
pub(crate) enum LabelRequirement {
    Exists(String),
    NotExists(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

impl Filter {
    pub(crate) fn new(
        kind: Kind,
        namespace: Option<&str>,
        name: Option<&str>,
        query: &Query,
    ) -> Result<Filter, String> {
        Ok(Filter {
            namespace: namespace.map(str::to_string),
            name: name.map(str::to_string),
            fields: parse_field_selector(kind, query.get("fieldSelector").unwrap_or_default())?,
            labels: parse_label_selector(query.get("labelSelector").unwrap_or_default())?,
        })
    }

    pub(crate) fn is_unselective(&self) -> bool {
        self.name.is_none() && self.fields.is_empty() && self.labels.is_empty()
    }

    pub(crate) fn matches(&self, kind: Kind, obj: &Value) -> bool {
        let text = |pointer: &str| obj.pointer(pointer).and_then(Value::as_str);
        if self
            .namespace
            .as_deref()
            .is_some_and(|ns| text("/metadata/namespace") != Some(ns))
        {
            return false;
        }
        if self
            .name
            .as_deref()
            .is_some_and(|name| text("/metadata/name") != Some(name))
        {
            return false;
        }
        let fields_match = self.fields.iter().all(|req| {
            let value = kind.field(obj, &req.field).unwrap_or_default();
            (value == req.value) == req.equal
        });
        let label = |key: &str| {
            obj.pointer("/metadata/labels")
                .and_then(|labels| labels.get(key))
                .and_then(Value::as_str)
        };
        fields_match
            && self.labels.iter().all(|req| match req {
                LabelRequirement::Exists(key) => label(key).is_some(),
                LabelRequirement::NotExists(key) => label(key).is_none(),
                LabelRequirement::In(key, values) => {
                    label(key).is_some_and(|v| values.iter().any(|x| x == v))
                }
                LabelRequirement::NotIn(key, values) => {
                    label(key).is_none_or(|v| values.iter().all(|x| x != v))
                }
            })
    }
}

/// `a=b,c!=d` (also `==`); only the fields the real server indexes for the
/// kind.
pub(crate) fn parse_field_selector(
    kind: Kind,
    selector: &str,
) -> Result<Vec<FieldRequirement>, String> {
    let mut out = Vec::new();
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (field, equal, value) = if let Some((f, v)) = term.split_once("!=") {
            (f, false, v)
        } else if let Some((f, v)) = term.split_once("==") {
            (f, true, v)
        } else if let Some((f, v)) = term.split_once('=') {
            (f, true, v)
        } else {
            return Err(format!(
                "invalid selector: '{selector}'; can't understand '{term}'"
            ));
        };
        let field = field.trim();
        if kind.field(&Value::Null, field).is_none() {
            return Err(format!("field label not supported: {field}"));
        }
        out.push(FieldRequirement {
            field: field.to_string(),
            equal,
            value: value.trim().to_string(),
        });
    }
    Ok(out)
}

/// Equality (`=`, `==`, `!=`), set (`in`, `notin`) and existence (`k`,
/// `!k`) requirements, comma-separated.
pub(crate) fn parse_label_selector(selector: &str) -> Result<Vec<LabelRequirement>, String> {
    let valid_key = |k: &str| {
        !k.is_empty()
            && k.len() <= 316
            && k.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'/'))
    };
    let valid_value = |v: &str| {
        v.len() <= 63
            && v.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    let invalid = |term: &str| {
        format!("unable to parse requirement: found '{term}', expected: a valid label selector")
    };
    let mut terms = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);

    let mut out = Vec::new();
    for term in terms.into_iter().map(str::trim).filter(|t| !t.is_empty()) {
        let requirement = if let Some(key) = term.strip_prefix('!') {
            LabelRequirement::NotExists(key.trim().to_string())
        } else if let Some((head, rest)) = term.split_once('(') {
            let values = rest.strip_suffix(')').ok_or_else(|| invalid(term))?;
            let values: Vec<String> = values.split(',').map(|v| v.trim().to_string()).collect();
            if values.iter().any(|v| !valid_value(v)) {
                return Err(invalid(term));
            }
            let mut words = head.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some(key), Some("in"), None) => LabelRequirement::In(key.to_string(), values),
                (Some(key), Some("notin"), None) => {
                    LabelRequirement::NotIn(key.to_string(), values)
                }
                _ => return Err(invalid(term)),
            }
        } else if let Some((key, value)) = term.split_once("!=") {
            LabelRequirement::NotIn(key.trim().to_string(), vec![value.trim().to_string()])
        } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            LabelRequirement::In(key.trim().to_string(), vec![value.trim().to_string()])
        } else {
            LabelRequirement::Exists(term.to_string())
        };
        let (key, values) = match &requirement {
            LabelRequirement::Exists(k) | LabelRequirement::NotExists(k) => (k, None),
            LabelRequirement::In(k, v) | LabelRequirement::NotIn(k, v) => (k, Some(v)),
        };
        if !valid_key(key) || values.is_some_and(|v| v.iter().any(|v| !valid_value(v))) {
            return Err(invalid(term));
        }
        out.push(requirement);
    }
    Ok(out)
}
