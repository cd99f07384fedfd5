//! docs/configuration.md lists every configuration key, and only those: the
//! keys in the first column of its `| key |` tables are compared with the
//! keys the configuration types serialize (their defaults, plus one element
//! of each list of records), so that a key added, renamed or removed in
//! `src/config.rs` fails here until the reference says so too.

use std::collections::BTreeSet;

use lanyard::config::Config;
use serde_json::{json, Value};

/// One element for each list of records, so that its fields are listed
/// (a default list is empty). A list missing here fails the test below.
fn sample_elements() -> Vec<(&'static str, Value)> {
    vec![
        (
            "cluster.service_accounts",
            json!({"namespace": "ns", "name": "sa"}),
        ),
        ("cluster.namespaces", json!({"name": "ns"})),
        (
            "dev.service_accounts",
            json!({"namespace": "ns", "name": "sa"}),
        ),
    ]
}

fn walk(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(fields) if !fields.is_empty() => {
            for (key, v) in fields {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                walk(v, &path, out);
            }
        }
        // Scalars, maps (empty by default) and lists are keys of their own.
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

fn code_keys() -> BTreeSet<String> {
    let mut defaults = serde_json::to_value(Config::default()).expect("config serializes");
    for (list, element) in sample_elements() {
        let (section, key) = list.split_once('.').expect("section.key");
        defaults[section][key] = json!([element]);
    }
    // The samples must be valid configuration (they go through the real
    // deserializer, unknown fields refused), and come back with every field.
    let config: Config = serde_json::from_value(defaults).expect("samples deserialize");
    let full = serde_json::to_value(&config).expect("config serializes");
    let mut keys = BTreeSet::new();
    walk(&full, "", &mut keys);
    let mut out = BTreeSet::new();
    for key in keys {
        out.insert(key);
    }
    for (list, _) in sample_elements() {
        let (section, key) = list.split_once('.').expect("section.key");
        let mut fields = BTreeSet::new();
        walk(&full[section][key][0], "", &mut fields);
        out.extend(fields.into_iter().map(|f| format!("{list}[].{f}")));
    }
    out
}

fn documented_keys() -> BTreeSet<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let text = std::fs::read_to_string(path).expect("docs/configuration.md");
    let mut keys = BTreeSet::new();
    let mut in_key_table = false;
    for line in text.lines() {
        if !line.starts_with('|') {
            in_key_table = false;
            continue;
        }
        if line.starts_with("| key |") {
            in_key_table = true;
            continue;
        }
        if !in_key_table || line.starts_with("|---") {
            continue;
        }
        let first = line.trim_start_matches('|').split('|').next().unwrap_or("");
        let key = first.trim().trim_matches('`');
        assert!(!key.is_empty(), "an empty key cell in: {line}");
        assert!(
            keys.insert(key.to_string()),
            "{key} is documented twice in docs/configuration.md"
        );
    }
    keys
}

#[test]
fn the_configuration_reference_lists_exactly_the_keys() {
    let code = code_keys();
    let docs = documented_keys();
    // Guards against a walk or a parse that finds nothing.
    assert!(code.len() > 80, "{}", code.len());
    for list in sample_elements().iter().map(|(k, _)| *k) {
        assert!(code.contains(list), "{list} is not a key any more");
    }
    let undocumented: Vec<_> = code.difference(&docs).collect();
    let stale: Vec<_> = docs.difference(&code).collect();
    assert!(
        undocumented.is_empty() && stale.is_empty(),
        "docs/configuration.md is out of step with src/config.rs:\n  \
         missing from the docs: {undocumented:?}\n  documented but not a key: {stale:?}"
    );
}

#[test]
fn every_list_of_records_has_a_sample() {
    // A list whose default is empty but whose elements are records must be
    // in `sample_elements`, or its fields would go unchecked.
    let docs = documented_keys();
    let sampled: BTreeSet<&str> = sample_elements().iter().map(|(k, _)| *k).collect();
    for key in &docs {
        if let Some((list, _)) = key.split_once("[].") {
            assert!(
                sampled.contains(list),
                "{list} has documented fields but no sample element"
            );
        }
    }
}
