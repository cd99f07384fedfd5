//! The sidecar's flags, shared by `lanyard sidecar` and the
//! `lanyard-sidecar` binary, and what the sidecar does instead of serving:
//! transparent mode's `redirect` and the postStart hook's `wait-ready`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use lanyard_startup::logging::{self, LogFormat, LogWrites};
use lanyard_startup::{GlobalArgs, Overrides, UsageError};
use serde_json::{Map, Value};

/// The sidecar's lines keep the target they had in the product, so that
/// operators' filters (`lanyard=debug`) still match them.
const TARGET: &str = "lanyard::cli";

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
        match crate::probe::probe_ready(args.port) {
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
    let _log = logging::init(
        global.log_format.unwrap_or(LogFormat::Text),
        global.log_level.as_deref().unwrap_or("info"),
        LogWrites::Direct,
    );
    match crate::transparent::install(port) {
        Ok(()) => {
            tracing::info!(
                target: TARGET,
                table = %format_args!("ip {}", crate::transparent::TABLE),
                "transparent mode: TCP to {}:{} from this pod now goes to 127.0.0.1:{port}",
                crate::transparent::METADATA_ADDR,
                crate::transparent::METADATA_PORT,
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(target: TARGET, error = %e, "transparent mode: redirect not installed");
            eprintln!("lanyard-sidecar redirect: {e}");
            ExitCode::FAILURE
        }
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
