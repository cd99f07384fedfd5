//! Command-line pieces shared by the `lanyard` binary and the slim
//! `lanyard-sidecar` binary: the global flags, the sidecar's flags, and the
//! start-up every role shares (configuration, logging, runtime, exit code).
//!
//! The sidecar has its own binary because it runs in every opted-in pod:
//! linked without the agent, webhook, emulators and the Kubernetes client,
//! it maps far less code, which is most of its resident memory.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use serde_json::{json, Map, Value};

use crate::config::Config;
use crate::telemetry::{self, LogFormat};

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
    /// The logging flags as configuration keys (only those given).
    pub fn overrides(&self) -> Map<String, Value> {
        let mut top = Map::new();
        put(
            &mut top,
            None,
            "log_format",
            self.log_format.map(|v| json!(v)),
        );
        put(
            &mut top,
            None,
            "log_level",
            self.log_level.as_ref().map(|v| json!(v)),
        );
        top
    }
}

#[derive(Args)]
pub struct SidecarArgs {
    /// Address of the SDK endpoints inside the pod.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Base URL of the node agent.
    #[arg(long = "agent", env = "LANYARD_AGENT_URL", value_name = "URL")]
    agent_url: Option<String>,
    /// Directory of the pod's projected tokens (`azure`, `gcp`, `aws`, `app`).
    #[arg(long, env = "LANYARD_TOKEN_DIR", value_name = "DIR")]
    token_dir: Option<PathBuf>,
    /// The App Service identity header secret shared with the app containers.
    #[arg(
        long,
        env = "IDENTITY_HEADER",
        hide_env_values = true,
        value_name = "SECRET"
    )]
    identity_header: Option<String>,
    /// The app-facing token authorizing the AWS container endpoint.
    #[arg(long, env = "LANYARD_APP_TOKEN_FILE", value_name = "FILE")]
    app_token_file: Option<PathBuf>,
    /// Address of a listener serving only /readyz and /healthz (for probes).
    #[arg(long, env = "LANYARD_PROBE_LISTEN", value_name = "ADDR")]
    probe_listen: Option<String>,
    /// Exchange directly with the clouds (no node agent on this node).
    #[arg(long)]
    standalone: bool,
    /// Standalone bindings, as the ServiceAccount's annotations (repeatable).
    #[arg(
        long = "annotation",
        env = "LANYARD_SIDECAR_ANNOTATIONS",
        value_delimiter = ',',
        value_name = "KEY=VALUE"
    )]
    annotations: Vec<String>,
}

/// Inserts `value` at `section.key` (or top-level `key`) when given.
pub fn put(map: &mut Map<String, Value>, section: Option<&str>, key: &str, value: Option<Value>) {
    let Some(value) = value else { return };
    match section {
        None => {
            map.insert(key.into(), value);
        }
        Some(section) => {
            let entry = map
                .entry(section.to_string())
                .or_insert_with(|| Value::Object(Map::new()));
            if let Value::Object(inner) = entry {
                inner.insert(key.into(), value);
            }
        }
    }
}

impl SidecarArgs {
    /// Flags as a nested map of configuration keys (only those given).
    pub fn overrides(&self, global: &GlobalArgs) -> Value {
        let mut top = global.overrides();
        put(
            &mut top,
            None,
            "listen",
            self.listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "agent_url",
            self.agent_url.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "token_dir",
            self.token_dir.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "identity_header",
            self.identity_header.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "app_token_file",
            self.app_token_file.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "probe_listen",
            self.probe_listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("sidecar"),
            "standalone",
            self.standalone.then_some(json!(true)),
        );
        let annotations: Map<String, Value> = self
            .annotations
            .iter()
            .filter_map(|a| a.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), json!(v.trim())))
            .collect();
        put(
            &mut top,
            Some("sidecar"),
            "annotations",
            (!annotations.is_empty()).then_some(Value::Object(annotations)),
        );
        Value::Object(top)
    }
}

/// Loads the configuration (file < environment < `overrides`), starts
/// logging and the runtime, and runs `role` to completion. A bad
/// configuration exits 2 with its key and source; a failed role exits 1.
pub fn run<F, Fut>(global: &GlobalArgs, overrides: Value, role: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let config = match Config::load(global.config.as_deref(), overrides) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lanyard: {e}");
            return ExitCode::from(2);
        }
    };
    telemetry::init(config.log_format, &config.log_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lanyard: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(role(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "lanyard failed");
            eprintln!("lanyard: {e:#}");
            ExitCode::FAILURE
        }
    }
}
