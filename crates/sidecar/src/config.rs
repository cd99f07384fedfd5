//! The sidecar's configuration: its own section (`sidecar.*`, shared with
//! the full configuration, which embeds it) and [`Settings`], what the
//! slim binary reads of the whole file.
//!
//! Both binaries read the same file, `LANYARD_*` variables and flags
//! through `lanyard_startup::sources`. The slim sidecar reads and checks
//! what it runs: the log settings, `listen`, the `sidecar` section and the
//! three keys the SDK environment takes from the clouds' sections
//! (`azure.tenant_id`, `gcp.universe_domain`, `aws.region`). Every other
//! section and key is accepted unread and left to the role that reads it
//! (`lanyard agent` checks `cache.*`), so one file serves every role; an
//! unknown top-level section or an unknown `sidecar.*` key is still
//! refused, naming it.

use std::net::SocketAddr;
use std::path::Path;

use std::collections::BTreeMap;

use lanyard_core::cloud::{Cloud, Invalid, SdkDefaults};
use lanyard_startup::logging::LogFormat;
use serde::{Deserialize, Serialize};

/// Settings of the sidecar role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SidecarConfig {
    /// Base URL of the node agent (`LANYARD_AGENT_URL`).
    pub agent_url: Option<String>,
    /// Directory of projected tokens: `azure`, `gcp`, `aws`, `app` (`LANYARD_TOKEN_DIR`).
    pub token_dir: Option<std::path::PathBuf>,
    /// The app-facing token that authorizes the AWS container endpoint
    /// (`LANYARD_APP_TOKEN_FILE`); default `TOKEN_DIR/app`.
    pub app_token_file: Option<std::path::PathBuf>,
    /// A second listener serving only `/readyz` and `/healthz`, for the
    /// kubelet's probes (which reach the pod IP, not loopback).
    pub probe_listen: Option<SocketAddr>,
    /// The App Service `IDENTITY_HEADER` secret shared with the app containers.
    pub identity_header: Option<String>,
    /// Exchange directly with the clouds instead of through a node agent.
    pub standalone: bool,
    /// Standalone bindings: the annotations of this pod's ServiceAccount.
    pub annotations: std::collections::BTreeMap<String, String>,
    /// Seconds the sidecar answers a repeated request (same projected
    /// token, same question) from the agent's last grant instead of asking
    /// again; 0 asks the agent every time (the broker's `reuse` module).
    pub grant_reuse_seconds: u64,
}

impl Default for SidecarConfig {
    fn default() -> Self {
        SidecarConfig {
            agent_url: None,
            token_dir: None,
            app_token_file: None,
            probe_listen: None,
            identity_header: None,
            standalone: false,
            annotations: Default::default(),
            // Short enough that a policy change or revocation reaches a
            // pod's repeated question within seconds (docs/policy.md).
            grant_reuse_seconds: 10,
        }
    }
}

impl SidecarConfig {
    /// Checks the section: the agent's URL.
    pub fn check(&self) -> Result<(), Invalid> {
        if let Some(url) = &self.agent_url {
            if url::Url::parse(url)
                .map(|u| u.scheme() != "http" && u.scheme() != "https")
                .unwrap_or(true)
            {
                return Err(Invalid {
                    key: "sidecar.agent_url",
                    expected: "an http:// or https:// URL of the node agent",
                    got: url.clone(),
                });
            }
        }
        Ok(())
    }
}

/// The top-level keys of other roles, accepted unread (the full
/// configuration's other keys; a test in the product keeps the two lists
/// together).
pub const OTHER_ROLES_KEYS: [&str; 8] = [
    "admin_listen",
    "shutdown_delay_seconds",
    "cache",
    "cluster",
    "policy",
    "audit",
    "webhook",
    "dev",
];

/// The configuration as loaded: the sidecar's keys, and every other
/// top-level key as written (the clouds' sections, other roles').
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
struct Loaded {
    log_format: LogFormat,
    log_level: String,
    listen: SocketAddr,
    sidecar: SidecarConfig,
    #[serde(flatten, skip_serializing)]
    sections: BTreeMap<String, serde_json::Value>,
}

impl Default for Loaded {
    fn default() -> Self {
        let settings = Settings::default();
        Loaded {
            log_format: settings.log_format,
            log_level: settings.log_level,
            listen: settings.listen,
            sidecar: settings.sidecar,
            sections: BTreeMap::new(),
        }
    }
}

/// What the slim sidecar reads of the configuration (see the module doc).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Log line format: `text` for people, `json` for collectors.
    pub log_format: LogFormat,
    /// Default tracing filter (`RUST_LOG` overrides).
    pub log_level: String,
    /// Address of the SDK endpoints.
    pub listen: SocketAddr,
    /// The sidecar section.
    pub sidecar: SidecarConfig,
    /// What the SDK environment takes from the clouds' sections.
    pub sdk_defaults: SdkDefaults,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            log_format: LogFormat::Text,
            log_level: "info".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 8642)),
            sidecar: SidecarConfig::default(),
            sdk_defaults: SdkDefaults::unconfigured(),
        }
    }
}

/// A configuration the sidecar refuses.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The file, environment or flags could not be read or do not fit the
    /// schema; the text says which key and where.
    #[error("invalid configuration: {0}")]
    Load(String),
    /// A top-level key no role reads.
    #[error("invalid configuration: unknown key `{0}`: expected one of {1}")]
    Unknown(String, String),
    /// A value of the right type that is not acceptable.
    #[error(transparent)]
    Invalid(#[from] Invalid),
}

impl Settings {
    /// Loads defaults < `file` < environment < `overrides` (flags), then
    /// checks what the sidecar reads.
    pub fn load(file: Option<&Path>, overrides: serde_json::Value) -> Result<Self, SettingsError> {
        let loaded: Loaded =
            lanyard_startup::sources::load(file, overrides).map_err(SettingsError::Load)?;
        for key in loaded.sections.keys() {
            let cloud = Cloud::ALL.iter().any(|c| c.name() == key);
            if !cloud && !OTHER_ROLES_KEYS.contains(&key.as_str()) {
                let known = ["log_format", "log_level", "listen", "sidecar"]
                    .into_iter()
                    .chain(Cloud::ALL.map(Cloud::name))
                    .chain(OTHER_ROLES_KEYS)
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(SettingsError::Unknown(
                    lanyard_core::text::bounded(key).into_owned(),
                    known,
                ));
            }
        }
        loaded.sidecar.check()?;
        let sdk_defaults = SdkDefaults::from_sections(|cloud| loaded.sections.get(cloud.name()))?;
        Ok(Settings {
            log_format: loaded.log_format,
            log_level: loaded.log_level,
            listen: loaded.listen,
            sidecar: loaded.sidecar,
            sdk_defaults,
        })
    }
}

impl lanyard_startup::Logging for Settings {
    fn log_format(&self) -> LogFormat {
        self.log_format
    }
    fn log_level(&self) -> &str {
        &self.log_level
    }
}
