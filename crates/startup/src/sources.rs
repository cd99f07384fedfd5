//! Where configuration comes from: defaults, then a YAML file, then the
//! `LANYARD_*` environment (sections, aliases, raw strings read lossily),
//! then command-line flags, each overriding the last; and figment's errors
//! worded to name the key and the source of the bad value.
//!
//! Generic over the schema: the full configuration (`lanyard::config`)
//! and the slim sidecar's (`lanyard-sidecar`) read the same file, the
//! same variables and the same flags the same way, each into its own type.

use std::path::Path;

use figment::providers::{Env, Format, Serialized};
use figment::Figment;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// YAML through serde_norway (the maintained serde_yaml fork).
struct Yaml;

impl Format for Yaml {
    type Error = serde_norway::Error;
    const NAME: &'static str = "YAML";

    fn from_str<T: DeserializeOwned>(s: &str) -> Result<T, Self::Error> {
        serde_norway::from_str(s)
    }
}

/// Loads `T`: its defaults < `file` < the `LANYARD_*` environment <
/// `overrides` (flags, as a nested map of the same keys). The error names
/// each bad key and where its value came from.
pub fn load<T>(file: Option<&Path>, overrides: serde_json::Value) -> Result<T, String>
where
    T: Default + Serialize + DeserializeOwned,
{
    let mut figment = Figment::from(Serialized::defaults(T::default()));
    if let Some(path) = file {
        if !path.is_file() {
            return Err(format!(
                "config file {} does not exist or is not a file",
                path.display()
            ));
        }
        figment = figment.merge(figment::providers::Data::<Yaml>::file(path));
    }
    figment = figment
        .merge(RawEnv::new(&T::default()))
        .merge(Flags(overrides));
    // Lossy: the environment's raw strings become numbers and booleans
    // where the key wants one (see `RawEnv`).
    figment.extract_lossy().map_err(describe)
}

/// Command-line flags as a provider, so errors can say "command-line flag".
struct Flags(serde_json::Value);

impl figment::Provider for Flags {
    fn metadata(&self) -> figment::Metadata {
        figment::Metadata::named("command-line flag")
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        Serialized::defaults(&self.0).data()
    }
}

/// Sections whose environment variables are `LANYARD_<SECTION>_<KEY>`,
/// besides the clouds' own (named after each cloud, from its table row).
/// Every schema maps the same names: a variable of a section the schema
/// does not read is left to the role that reads it.
const SECTIONS: [&str; 7] = [
    "cache", "cluster", "policy", "audit", "sidecar", "webhook", "dev",
];
/// Environment names kept short for the sidecar, as the webhook sets them.
const ALIASES: [(&str, &str); 2] = [
    ("agent_url", "sidecar.agent_url"),
    ("token_dir", "sidecar.token_dir"),
];
/// Top-level keys settable from the environment.
const TOP_LEVEL: [&str; 5] = [
    "log_format",
    "log_level",
    "listen",
    "admin_listen",
    "shutdown_delay_seconds",
];

/// Turns figment's errors into messages that name the key and where the
/// bad value came from (file, environment variable or flag).
fn describe(errors: figment::Error) -> String {
    let messages: Vec<String> = errors
        .into_iter()
        .map(|e| {
            let key = e.path.join(".").to_ascii_lowercase();
            let source = match &e.metadata {
                Some(m) if m.name.contains("environment") => {
                    format!(
                        " (environment variable LANYARD_{})",
                        e.path.join("_").to_ascii_uppercase()
                    )
                }
                Some(m) => match &m.source {
                    Some(figment::Source::File(path)) => format!(" (in {})", path.display()),
                    _ => format!(" ({})", m.name),
                },
                None => String::new(),
            };
            if key.is_empty() {
                format!("{}{source}", e.kind)
            } else {
                format!("{key}{source}: {}", e.kind)
            }
        })
        .collect();
    messages.join("; ")
}

/// `LANYARD_*` variables as a provider that keeps their values as written.
///
/// figment's `Env` parses every value (`123456789012` becomes a number,
/// `true` a boolean, `[a]` a list), and a string-typed key then refuses it
/// with "invalid type": a numeric project number, client id or header
/// secret could not be set from the environment. Here every value stays a
/// string, and `extract_lossy` turns strings into numbers and booleans only
/// for keys whose type asks for one. Only the keys whose value is a list or
/// map (known from the defaults: their default is an array or an empty
/// object) are parsed with figment's value syntax.
struct RawEnv {
    env: Env,
    structured: std::collections::BTreeSet<String>,
}

impl RawEnv {
    fn new(defaults: &impl Serialize) -> Self {
        let mut structured = std::collections::BTreeSet::new();
        if let Ok(defaults) = serde_json::to_value(defaults) {
            structured_keys(&defaults, "", &mut structured);
        }
        RawEnv {
            env: env_provider(),
            structured,
        }
    }
}

/// Dotted keys of `value`'s lists and maps: arrays and empty objects (a
/// section is an object with fields; a map's default is empty).
pub fn structured_keys(
    value: &serde_json::Value,
    prefix: &str,
    out: &mut std::collections::BTreeSet<String>,
) {
    use serde_json::Value as J;
    match value {
        J::Object(fields) if !fields.is_empty() => {
            for (key, v) in fields {
                let path = if prefix.is_empty() {
                    key.clone()
                } else {
                    format!("{prefix}.{key}")
                };
                structured_keys(v, &path, out);
            }
        }
        J::Object(_) | J::Array(_) if !prefix.is_empty() => {
            out.insert(prefix.to_string());
        }
        _ => {}
    }
}

impl figment::Provider for RawEnv {
    fn metadata(&self) -> figment::Metadata {
        self.env.metadata()
    }

    fn data(
        &self,
    ) -> Result<figment::value::Map<figment::Profile, figment::value::Dict>, figment::Error> {
        use figment::value::{Dict, Value};
        fn insert(dict: &mut Dict, path: &[&str], value: Value) {
            match path {
                [] => {}
                [last] => {
                    dict.insert((*last).to_string(), value);
                }
                [first, rest @ ..] => {
                    let entry = dict
                        .entry((*first).to_string())
                        .or_insert_with(|| Dict::new().into());
                    if !matches!(entry, Value::Dict(..)) {
                        *entry = Dict::new().into();
                    }
                    if let Value::Dict(_, inner) = entry {
                        insert(inner, rest, value);
                    }
                }
            }
        }
        let mut dict = Dict::new();
        for (key, raw) in self.env.iter() {
            let key = key.as_str();
            let value = if self.structured.contains(key) {
                raw.parse::<Value>().unwrap_or_else(|never| match never {})
            } else {
                Value::from(raw)
            };
            let path: Vec<&str> = key.split('.').collect();
            insert(&mut dict, &path, value);
        }
        Ok(figment::Profile::Default.collect(dict))
    }
}

fn env_provider() -> Env {
    // Keys arrive with the prefix stripped but in the environment's case.
    fn section_key(key: &str) -> Option<String> {
        let key = key.to_ascii_lowercase();
        if TOP_LEVEL.contains(&key.as_str()) {
            return Some(key);
        }
        if let Some((_, target)) = ALIASES.iter().find(|(alias, _)| *alias == key) {
            return Some(target.to_string());
        }
        // Each cloud's section is named after the cloud, from its table
        // row: a new cloud's variables map without a list to join.
        let clouds = lanyard_core::cloud::Cloud::ALL.map(lanyard_core::cloud::Cloud::name);
        clouds.iter().chain(SECTIONS.iter()).find_map(|section| {
            key.strip_prefix(section)
                .and_then(|r| r.strip_prefix('_'))
                .filter(|r| !r.is_empty())
                .map(|rest| format!("{section}.{rest}"))
        })
    }
    Env::prefixed("LANYARD_")
        .filter(|key| section_key(key.as_str()).is_some())
        .map(|key| {
            section_key(key.as_str())
                .unwrap_or_else(|| key.as_str().to_string())
                .into()
        })
}
