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

use clap::{Args, Subcommand};
use serde::Serialize;
use serde_json::{Map, Value};

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

/// The flags of the sidecar role, shared by `lanyard sidecar` and the
/// `lanyard-sidecar` binary.
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

impl SidecarArgs {
    /// The sidecar's flags added to `global`'s (only those given).
    pub fn overrides(&self, global: &GlobalArgs) -> Overrides {
        let mut annotations = Map::new();
        let mut bad = None;
        for a in &self.annotations {
            match a.split_once('=') {
                Some((k, v)) if !k.trim().is_empty() => {
                    annotations.insert(k.trim().to_string(), Value::from(v.trim()));
                }
                _ => {
                    bad.get_or_insert_with(|| UsageError::Annotation { value: a.clone() });
                }
            }
        }
        let section = Some("sidecar");
        let overrides = match bad {
            Some(e) => global.overrides().fail(e),
            None => global.overrides(),
        };
        overrides
            .set(None, "listen", self.listen.as_ref())
            .set(section, "agent_url", self.agent_url.as_ref())
            .set(section, "token_dir", self.token_dir.as_ref())
            .set(section, "identity_header", self.identity_header.as_ref())
            .set(section, "app_token_file", self.app_token_file.as_ref())
            .set(section, "probe_listen", self.probe_listen.as_ref())
            .set(section, "standalone", self.standalone.then_some(true))
            .set(
                section,
                "annotations",
                (!annotations.is_empty()).then_some(annotations),
            )
    }
}

/// What the sidecar binary (and `lanyard sidecar`) does instead of serving.
#[derive(Subcommand)]
pub enum SidecarCommand {
    /// Transparent mode's init step: redirect TCP to 169.254.169.254:80 in
    /// this network namespace to 127.0.0.1:PORT (one nf_tables rule, needs
    /// CAP_NET_ADMIN), then exit.
    Redirect(RedirectArgs),
    /// The sidecar's postStart hook: wait until this pod's sidecar answers
    /// ready on its probe port, then exit 0 (1 after `--timeout`). The
    /// kubelet starts the pod's next container only once the hook returns.
    WaitReady(WaitReadyArgs),
}

/// The flags of `wait-ready`.
#[derive(Args)]
pub struct WaitReadyArgs {
    /// The sidecar's probe port (its `--probe-listen 0.0.0.0:PORT`).
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
    /// Seconds to wait before giving up (1-3600).
    #[arg(long, value_name = "SECONDS", default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout: u64,
}

/// The flags of `redirect`.
#[derive(Args)]
pub struct RedirectArgs {
    /// The sidecar's loopback port (its `--listen 127.0.0.1:PORT`).
    #[arg(long, value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    pub port: u16,
}

impl SidecarCommand {
    /// Runs the command: logs one line on success; a failure exits 1 with
    /// the reason on stderr.
    pub fn run(&self, global: &GlobalArgs) -> ExitCode {
        match self {
            SidecarCommand::Redirect(args) => redirect(global, args.port),
            SidecarCommand::WaitReady(args) => wait_ready(args),
        }
    }
}

/// `wait-ready`: asks `GET /readyz` on 127.0.0.1:PORT every 10 ms until it
/// answers 200. No runtime and no logging set-up: it runs inside the
/// kubelet's hook, and its output only shows when it fails.
fn wait_ready(args: &WaitReadyArgs) -> ExitCode {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.timeout);
    let mut last = String::from("no answer yet");
    while std::time::Instant::now() < deadline {
        match crate::sidecar::probe_ready(args.port) {
            Ok(()) => return ExitCode::SUCCESS,
            Err(e) => last = e,
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    eprintln!(
        "lanyard-sidecar wait-ready: the sidecar was not ready on port {} within {} s: {last}",
        args.port, args.timeout
    );
    ExitCode::FAILURE
}

/// `redirect`: no configuration and no runtime, one netlink exchange.
fn redirect(global: &GlobalArgs, port: u16) -> ExitCode {
    let _log = telemetry::init(
        global.log_format.unwrap_or(LogFormat::Text),
        global.log_level.as_deref().unwrap_or("info"),
        telemetry::LogWrites::Direct,
    );
    match crate::transparent::install(port) {
        Ok(()) => {
            tracing::info!(
                table = %format_args!("ip {}", crate::transparent::TABLE),
                "transparent mode: TCP to {}:{} from this pod now goes to 127.0.0.1:{port}",
                crate::transparent::METADATA_ADDR,
                crate::transparent::METADATA_PORT,
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %e, "transparent mode: redirect not installed");
            eprintln!("lanyard-sidecar redirect: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Makes the process not dumpable: no core file, and no other process of
/// the same user may read its memory, environment or files through
/// `/proc/PID` (`mem`, `environ`, `root`, `fd`). Every role holds tokens or
/// credentials, and a container that shares the sidecar's process namespace
/// (`shareProcessNamespace`, `hostPID`) under the same uid could otherwise
/// read the sidecar's token volume through `/proc/PID/root`. A failure is
/// logged and start-up goes on: it hardens, it does not gate.
fn not_dumpable() {
    #[cfg(target_os = "linux")]
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        tracing::warn!(error = %e, "cannot make the process non-dumpable");
    }
}

/// Loads the configuration (file < environment < `overrides`), starts
/// logging and the runtime, and runs `role` to completion. A bad
/// configuration exits 2 with its key and source; a failed role exits 1.
pub fn run<F, Fut>(global: &GlobalArgs, overrides: Overrides, role: F) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    run_with(global, overrides, telemetry::LogWrites::Batched, role)
}

/// [`run`], with log lines written as `writes` says.
pub fn run_with<F, Fut>(
    global: &GlobalArgs,
    overrides: Overrides,
    writes: telemetry::LogWrites,
    role: F,
) -> ExitCode
where
    F: FnOnce(Config) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let loaded = overrides
        .into_value()
        .map_err(|e| e.to_string())
        .and_then(|o| Config::load(global.config.as_deref(), o).map_err(|e| e.to_string()));
    let config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lanyard: {e}");
            return ExitCode::from(2);
        }
    };
    // INVARIANT: declared before the runtime, so it is dropped after it:
    // every line logged until the runtime stops is written.
    let _log = telemetry::init(config.log_format, &config.log_level, writes);
    raise_open_files_limit();
    not_dumpable();
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

/// Raises the soft limit on open files to the hard limit. Container
/// runtimes start processes with a soft limit of 1,024, which a node's worth
/// of held connections exhausts; each listener bounds its own connections
/// (`http::Limits`) well below the hard limit instead.
fn raise_open_files_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let (Some(soft), hard) = (limit.current, limit.maximum) else {
        return; // already unlimited
    };
    let target = hard.unwrap_or(u64::MAX);
    if soft >= target {
        return;
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: hard,
            maximum: hard,
        },
    ) {
        Ok(()) => tracing::info!(from = soft, to = target, "raised the open-files limit"),
        Err(e) => tracing::warn!(error = %e, soft, "cannot raise the open-files limit"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        global: GlobalArgs,
        #[command(flatten)]
        sidecar: SidecarArgs,
    }

    fn overrides(args: &[&str]) -> Result<Value, UsageError> {
        let cli =
            Cli::try_parse_from(std::iter::once("lanyard-sidecar").chain(args.iter().copied()))
                .expect("flags parse");
        cli.sidecar.overrides(&cli.global).into_value()
    }

    #[test]
    fn annotations_become_a_map() {
        let v = overrides(&["--annotation", " a = b ", "--annotation", "c=d=e"]).unwrap();
        assert_eq!(
            v["sidecar"]["annotations"],
            serde_json::json!({"a": "b", "c": "d=e"})
        );
        assert_eq!(overrides(&[]).unwrap(), serde_json::json!({}));
    }

    #[test]
    fn an_annotation_without_a_key_is_a_usage_error() {
        for bad in ["novalue", "=v", " =v"] {
            let e = overrides(&["--annotation", "a=b", "--annotation", bad]).unwrap_err();
            assert!(
                matches!(&e, UsageError::Annotation { value } if value == bad),
                "{e:?}"
            );
            let m = e.to_string();
            assert!(m.contains("--annotation") && m.contains(bad.trim()), "{m}");
        }
    }
}
