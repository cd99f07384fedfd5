//! The `lanyard` command line: role dispatch.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use lanyard::cli::{self, GlobalArgs, Overrides, SidecarArgs, SidecarCommand};

#[derive(Parser)]
#[command(name = "lanyard", version)]
struct Cli {
    #[command(flatten)]
    global: GlobalArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run issuer, cloud emulators, broker and SDK endpoints on loopback, and
    /// print the environment an SDK needs to use them.
    #[cfg(feature = "dev")]
    Dev(DevArgs),
    /// Run the node agent (one per node): verify pods' projected tokens,
    /// decide, exchange through the cache, and answer sidecars.
    Agent(AgentArgs),
    /// Run the pod sidecar: every SDK endpoint on loopback, backed by the
    /// node agent.
    Sidecar(SidecarRole),
    /// Run the mutating admission webhook that injects the sidecar,
    /// projected tokens and SDK environment into opted-in pods.
    Webhook(WebhookArgs),
    /// Check and test Cedar policies (see docs/policy.md).
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Work with audit files (see docs/audit.md).
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Explain why a pod does (or does not) get its credentials, and the
    /// trust each cloud needs for its ServiceAccount. Read-only, with your
    /// kubeconfig; give it the agent's configuration (`--config`). Exit 1
    /// when a check fails (see docs/operations.md).
    #[command(subcommand)]
    Doctor(DoctorCommand),
}

#[derive(Subcommand)]
enum DoctorCommand {
    /// A pod (NAMESPACE/NAME): opted in, injected, its tokens'
    /// audiences, then its ServiceAccount's checks.
    Pod(DoctorArgs),
    /// A ServiceAccount (NAMESPACE/NAME): its bindings, the cluster's
    /// issuer, and what each cloud must trust.
    #[command(name = "serviceaccount", visible_alias = "sa")]
    ServiceAccount(DoctorArgs),
}

#[derive(Args)]
struct DoctorArgs {
    /// NAMESPACE/NAME.
    target: String,
    /// `table` (default) or `json` (stable fields, docs/operations.md).
    #[arg(long, short, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// The Cedar policies to evaluate (a local copy of the agent's);
    /// default: the configuration's `policy.dir`.
    #[arg(long, value_name = "DIR")]
    policy_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

/// `lanyard doctor`: the configuration from the usual sources, then one
/// diagnosis; its exit code (2 for a bad target or configuration).
fn doctor(global: &GlobalArgs, command: DoctorCommand) -> ExitCode {
    let (args, target) = match command {
        DoctorCommand::Pod(a) => {
            let t = lanyard::doctor::Target::pod(&a.target);
            (a, t)
        }
        DoctorCommand::ServiceAccount(a) => {
            let t = lanyard::doctor::Target::service_account(&a.target);
            (a, t)
        }
    };
    let target = match target {
        Ok(t) => t,
        Err(e) => {
            eprintln!("lanyard doctor: {e}");
            return ExitCode::from(2);
        }
    };
    let loaded = global
        .overrides()
        .into_value()
        .map_err(|e| e.to_string())
        .and_then(|o| {
            lanyard::config::Config::load(global.config.as_deref(), o).map_err(|e| e.to_string())
        });
    let config = match loaded {
        Ok(c) => c,
        Err(e) => {
            eprintln!("lanyard doctor: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("lanyard doctor: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(lanyard::doctor::command(
        config,
        target,
        args.policy_dir.as_deref(),
        args.output == Output::Json,
    ))
}

#[derive(Subcommand)]
enum AuditCommand {
    /// Verify the hash chain of audit files, oldest first (e.g.
    /// `audit-*.jsonl audit.jsonl`): exit 1 naming the first altered,
    /// missing, inserted, reordered or truncated record by file and line.
    Verify {
        /// The files, oldest first.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// Verify what a collector holds (rsyslog's or an HTTP collector's
    /// JSON Lines, many nodes and chains in any order): per chain, the
    /// sequence range, gaps, forks, unlinked records and stale
    /// checkpoints; exit 1 when any chain is not intact.
    VerifyCollected {
        /// A chain whose last checkpoint is older than this many seconds
        /// is stale (unless a later chain of its node replaced it).
        #[arg(long, default_value_t = 1800)]
        stale_after: u64,
        /// The report as JSON.
        #[arg(long)]
        json: bool,
        /// The collector's files.
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate the policies in DIR against Lanyard's schema (exit 1 when
    /// invalid, naming each file, line and problem).
    Check {
        /// The policy directory.
        dir: PathBuf,
    },
    /// Evaluate the example requests in CASES against the policies in DIR
    /// (exit 1 when a case gets another decision, 2 when CASES is unusable).
    Test {
        /// The policy directory.
        dir: PathBuf,
        /// The CASES file (YAML).
        cases: PathBuf,
    },
}

/// `lanyard sidecar [FLAGS]` serves; `lanyard sidecar redirect` is
/// transparent mode's init step, as in `lanyard-sidecar`.
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
struct SidecarRole {
    #[command(flatten)]
    args: SidecarArgs,
    #[command(subcommand)]
    command: Option<SidecarCommand>,
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
    fn overrides(&self, global: &GlobalArgs) -> Overrides {
        let section = Some("webhook");
        global
            .overrides()
            .set(None, "listen", self.listen.as_ref())
            .set(None, "admin_listen", self.admin_listen.as_ref())
            .set(section, "tls_cert", self.tls_cert.as_ref())
            .set(section, "tls_key", self.tls_key.as_ref())
            .set(section, "sidecar_image", self.sidecar_image.as_ref())
            .set(section, "agent_url", self.agent_url.as_ref())
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
    /// Run without a node name (unsafe: tokens are not kept to this node).
    #[arg(long)]
    insecure_no_node_name: bool,
    /// The cluster's service-account issuer URL (OIDC discovery).
    #[arg(long, value_name = "URL")]
    issuer: Option<String>,
    /// Also TokenReview each new token with the API server.
    #[arg(long)]
    token_review: bool,
}

impl AgentArgs {
    fn overrides(&self, global: &GlobalArgs) -> Overrides {
        let section = Some("cluster");
        global
            .overrides()
            .set(None, "listen", self.listen.as_ref())
            .set(None, "admin_listen", self.admin_listen.as_ref())
            .set(section, "node_name", self.node_name.as_ref())
            .set(
                section,
                "insecure_no_node_name",
                self.insecure_no_node_name.then_some(true),
            )
            .set(section, "issuer", self.issuer.as_ref())
            .set(section, "token_review", self.token_review.then_some(true))
    }
}

#[cfg(feature = "dev")]
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

#[cfg(feature = "dev")]
impl DevArgs {
    fn overrides(&self, global: &GlobalArgs) -> Overrides {
        let section = Some("dev");
        global
            .overrides()
            .set(None, "listen", self.listen.as_ref())
            .set(None, "admin_listen", self.admin_listen.as_ref())
            .set(section, "token_lifetime", self.token_lifetime)
            .set(section, "namespace", self.namespace.as_ref())
            .set(section, "service_account", self.service_account.as_ref())
    }
}

/// The command's description, naming the clouds from the cloud table.
fn about() -> String {
    let names: Vec<&str> = lanyard::cloud::Cloud::ALL
        .iter()
        .map(|c| c.upstream())
        .collect();
    let clouds = match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    };
    format!(
        "Node-local credential broker for Kubernetes: projected service-account tokens in, short-lived {clouds} credentials out, on the endpoints the cloud SDKs already speak."
    )
}

fn main() -> ExitCode {
    let matches = Cli::command().about(about()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let global = &cli.global;
    match cli.command {
        #[cfg(feature = "dev")]
        Command::Dev(args) => cli::run(global, args.overrides(global), lanyard::dev::run),
        Command::Agent(args) => cli::run(global, args.overrides(global), lanyard::agent::run),
        Command::Sidecar(SidecarRole {
            command: Some(command),
            ..
        }) => command.run(global),
        Command::Sidecar(SidecarRole { args, .. }) => {
            cli::run(global, args.overrides(global), lanyard::sidecar::run)
        }
        Command::Policy(PolicyCommand::Check { dir }) => {
            lanyard::policy::cases::check_command(&dir)
        }
        Command::Policy(PolicyCommand::Test { dir, cases }) => {
            lanyard::policy::cases::test_command(&dir, &cases)
        }
        Command::Audit(AuditCommand::Verify { files }) => lanyard::audit::verify::command(&files),
        Command::Audit(AuditCommand::VerifyCollected {
            stale_after,
            json,
            files,
        }) => lanyard::audit::collected::command(
            &files,
            std::time::Duration::from_secs(stale_after),
            json,
        ),
        Command::Doctor(command) => doctor(global, command),
        Command::Webhook(args) => cli::run(
            global,
            args.overrides(global),
            lanyard::webhook::server::run,
        ),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_description_names_each_clouds_upstream_in_one_list() {
        let about = super::about();
        for cloud in lanyard::cloud::Cloud::ALL {
            assert!(about.contains(cloud.upstream()), "{about}");
        }
        assert!(
            about.contains("short-lived Entra ID, Google and AWS STS credentials"),
            "{about}"
        );
    }
}
