//! The `lanyard` command line: role dispatch.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Map, Value};

use lanyard::config::Config;
use lanyard::telemetry::{self, LogFormat};

#[derive(Parser)]
#[command(
    name = "lanyard",
    version,
    about = "Node-local credential broker for Kubernetes: projected service-account tokens in, short-lived Entra ID credentials out, on the endpoints the cloud SDKs already speak."
)]
struct Cli {
    /// YAML configuration file.
    #[arg(long, global = true, env = "LANYARD_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Log line format on stderr.
    #[arg(long, global = true, value_enum, value_name = "FORMAT")]
    log_format: Option<LogFormat>,
    /// Default log filter (RUST_LOG overrides), e.g. `info` or `lanyard=debug`.
    #[arg(long, global = true, value_name = "FILTER")]
    log_level: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run issuer, cloud emulators, broker and SDK endpoints on loopback, and
    /// print the environment an SDK needs to use them.
    Dev(DevArgs),
}

#[derive(Args)]
struct DevArgs {
    /// Address of the SDK-facing endpoints.
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<String>,
    /// Lifetime in seconds of the credentials the emulators issue.
    #[arg(long, value_name = "SECONDS")]
    token_lifetime: Option<u64>,
    /// Namespace of the development pod identity.
    #[arg(long)]
    namespace: Option<String>,
    /// Service account of the development pod identity.
    #[arg(long)]
    service_account: Option<String>,
}

impl DevArgs {
    /// Flags as a nested map of configuration keys (only those given).
    fn overrides(&self, cli: &Cli) -> Value {
        let mut top = Map::new();
        let mut dev = Map::new();
        if let Some(v) = &self.listen {
            top.insert("listen".into(), json!(v));
        }
        if let Some(v) = &self.admin_listen {
            top.insert("admin_listen".into(), json!(v));
        }
        if let Some(v) = cli.log_format {
            top.insert("log_format".into(), json!(v));
        }
        if let Some(v) = &cli.log_level {
            top.insert("log_level".into(), json!(v));
        }
        if let Some(v) = self.token_lifetime {
            dev.insert("token_lifetime".into(), json!(v));
        }
        if let Some(v) = &self.namespace {
            dev.insert("namespace".into(), json!(v));
        }
        if let Some(v) = &self.service_account {
            dev.insert("service_account".into(), json!(v));
        }
        if !dev.is_empty() {
            top.insert("dev".into(), Value::Object(dev));
        }
        Value::Object(top)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let overrides = match &cli.command {
        Command::Dev(args) => args.overrides(&cli),
    };
    let config = match Config::load(cli.config.as_deref(), overrides) {
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
    let result = runtime.block_on(async {
        match cli.command {
            Command::Dev(_) => lanyard::dev::run(config).await,
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "lanyard failed");
            eprintln!("lanyard: {e:#}");
            ExitCode::FAILURE
        }
    }
}
