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
    about = "Node-local credential broker for Kubernetes: projected service-account tokens in, short-lived Entra ID, Google and AWS credentials out, on the endpoints the cloud SDKs already speak."
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
    /// Run the node agent (one per node): verify pods' projected tokens,
    /// decide, exchange through the cache, and answer sidecars.
    Agent(AgentArgs),
    /// Run the pod sidecar: every SDK endpoint on loopback, backed by the
    /// node agent.
    Sidecar(SidecarArgs),
    /// Run the mutating admission webhook that injects the sidecar,
    /// projected tokens and SDK environment into opted-in pods.
    Webhook(WebhookArgs),
}

#[derive(Args)]
struct WebhookArgs {
    /// Address of the HTTPS endpoint (`/mutate`).
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Address of /metrics, /healthz and /readyz (plain HTTP).
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<String>,
    /// PEM certificate chain (re-read when the file changes).
    #[arg(long, env = "LANYARD_WEBHOOK_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// PEM private key.
    #[arg(long, env = "LANYARD_WEBHOOK_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Image of the injected sidecar.
    #[arg(long, value_name = "IMAGE")]
    sidecar_image: Option<String>,
    /// Node agent URL as the sidecar sees it.
    #[arg(long, value_name = "URL")]
    agent_url: Option<String>,
}

impl WebhookArgs {
    fn overrides(&self, cli: &Cli) -> Value {
        let mut top = global_overrides(cli);
        put(
            &mut top,
            None,
            "listen",
            self.listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            None,
            "admin_listen",
            self.admin_listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("webhook"),
            "tls_cert",
            self.tls_cert.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("webhook"),
            "tls_key",
            self.tls_key.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("webhook"),
            "sidecar_image",
            self.sidecar_image.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("webhook"),
            "agent_url",
            self.agent_url.as_ref().map(|v| json!(v)),
        );
        Value::Object(top)
    }
}

#[derive(Args)]
struct AgentArgs {
    /// Address of the agent API (`POST /v1/token`).
    #[arg(long, value_name = "ADDR")]
    listen: Option<String>,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<String>,
    /// This node's name; tokens bound to another node are refused.
    #[arg(long, env = "NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
    /// The cluster's service-account issuer URL (OIDC discovery).
    #[arg(long, value_name = "URL")]
    issuer: Option<String>,
    /// Also TokenReview each new token with the API server.
    #[arg(long)]
    token_review: bool,
}

#[derive(Args)]
struct SidecarArgs {
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
fn put(map: &mut Map<String, Value>, section: Option<&str>, key: &str, value: Option<Value>) {
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

fn global_overrides(cli: &Cli) -> Map<String, Value> {
    let mut top = Map::new();
    put(
        &mut top,
        None,
        "log_format",
        cli.log_format.map(|v| json!(v)),
    );
    put(
        &mut top,
        None,
        "log_level",
        cli.log_level.as_ref().map(|v| json!(v)),
    );
    top
}

impl AgentArgs {
    fn overrides(&self, cli: &Cli) -> Value {
        let mut top = global_overrides(cli);
        put(
            &mut top,
            None,
            "listen",
            self.listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            None,
            "admin_listen",
            self.admin_listen.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("cluster"),
            "node_name",
            self.node_name.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("cluster"),
            "issuer",
            self.issuer.as_ref().map(|v| json!(v)),
        );
        put(
            &mut top,
            Some("cluster"),
            "token_review",
            self.token_review.then_some(json!(true)),
        );
        Value::Object(top)
    }
}

impl SidecarArgs {
    fn overrides(&self, cli: &Cli) -> Value {
        let mut top = global_overrides(cli);
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
        Command::Agent(args) => args.overrides(&cli),
        Command::Sidecar(args) => args.overrides(&cli),
        Command::Webhook(args) => args.overrides(&cli),
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
            Command::Agent(_) => lanyard::agent::run(config).await,
            Command::Sidecar(_) => lanyard::sidecar::run(config).await,
            Command::Webhook(_) => lanyard::webhook::server::run(config).await,
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
