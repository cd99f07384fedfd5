//! The flags every Lanyard binary takes, and command-line flags as
//! configuration keys: a nested map holding only the flags that were
//! given, so that they override the file and the environment key by key.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::logging::LogFormat;

/// Flags every role takes.
#[derive(Args)]
pub struct GlobalArgs {
    /// YAML configuration file.
    #[arg(long, global = true, env = "LANYARD_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log line format on stderr.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Default log filter (RUST_LOG overrides), e.g. `info` or `lanyard=debug`.
    #[arg(long, global = true, value_name = "FILTER")]
    pub log_level: Option<String>,
}

impl GlobalArgs {
    /// The logging flags as configuration keys (only those given); each
    /// role adds its own flags to this.
    pub fn overrides(&self) -> Overrides {
        Overrides::default()
            .set(None, "log_format", self.log_format)
            .set(None, "log_level", self.log_level.as_ref())
    }
}

/// Command-line flags as a nested map of configuration keys, holding only
/// the flags that were given, so that they override the file and the
/// environment key by key.
#[derive(Default)]
pub struct Overrides {
    map: Map<String, Value>,
    error: Option<UsageError>,
}

/// A flag that was given but cannot be used: a usage error (exit 2).
#[derive(Debug, thiserror::Error)]
pub enum UsageError {
    /// The value cannot be represented as configuration (a non-UTF-8 path).
    #[error("command-line flag for `{key}`: {reason}")]
    Unrepresentable {
        /// The configuration key the flag sets, as `section.key`.
        key: String,
        /// Why its value could not be converted.
        reason: String,
    },
    /// `--annotation` (or `LANYARD_SIDECAR_ANNOTATIONS`) without `KEY=`.
    #[error("--annotation {value:?}: expected KEY=VALUE with a non-empty KEY (from the flag or LANYARD_SIDECAR_ANNOTATIONS)")]
    Annotation {
        /// The value as given, without its `KEY=` part.
        value: String,
    },
}

impl Overrides {
    /// Sets `section.key` (or top-level `key`) when `value` is given. A
    /// value that is not valid configuration (a path that is not UTF-8) is
    /// kept as an error for [`Overrides::into_value`].
    pub fn set(mut self, section: Option<&str>, key: &str, value: Option<impl Serialize>) -> Self {
        let Some(value) = value else { return self };
        let value = match serde_json::to_value(value) {
            Ok(v) => v,
            Err(e) => {
                let key = section.map_or(key.to_string(), |s| format!("{s}.{key}"));
                return self.fail(UsageError::Unrepresentable {
                    key,
                    reason: e.to_string(),
                });
            }
        };
        let map = match section {
            None => &mut self.map,
            Some(section) => match self
                .map
                .entry(section)
                .or_insert_with(|| Value::Object(Map::new()))
            {
                Value::Object(inner) => inner,
                _ => return self,
            },
        };
        map.insert(key.into(), value);
        self
    }

    /// Records a flag that cannot be taken; the first one is reported.
    pub fn fail(mut self, error: UsageError) -> Self {
        self.error.get_or_insert(error);
        self
    }

    /// The map, or the first flag that could not be taken.
    pub fn into_value(self) -> Result<Value, UsageError> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(Value::Object(self.map)),
        }
    }
}
