//! Typed configuration: defaults, then a YAML file, then `LANYARD_*`
//! environment variables, then command-line flags, each overriding the
//! last. Validated once at start; a bad value is refused with a message
//! naming the key and what is expected.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::cloud::trust::{Trust, Workload};
use crate::cloud::{aws, azure, gcp, Bindings, Cloud, Invalid, PerCloud, Registry, SdkDefaults};
use crate::directory::file::{NamespaceEntry, ServiceAccountEntry};
use crate::telemetry::LogFormat;
pub use lanyard_sidecar::config::SidecarConfig;

/// Credential cache settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSettings {
    /// `serviceaccount` (pods of one service account share credentials) or
    /// `pod` (per-pod credentials, for per-pod attribution upstream).
    pub scope: crate::cache::CacheScope,
    /// Most cached credentials (1–1000000); the least recently used is evicted
    /// first.
    pub max_entries: usize,
    /// Seconds after which an entry nobody asked for is dropped.
    pub idle_ttl: u64,
    /// Seconds a deterministic upstream refusal is remembered.
    pub negative_ttl: u64,
    /// Upstream exchanges in flight at once, all clouds together.
    pub upstream_concurrency: usize,
    /// Upstream exchanges per second, per cloud.
    pub rate_azure: f64,
    /// Upstream exchanges per second with Google (0.1–100000).
    pub rate_gcp: f64,
    /// Upstream exchanges per second with AWS STS (0.1–100000).
    pub rate_aws: f64,
    /// Exchanges one ServiceAccount may have in flight at once (1–10000).
    pub caller_inflight: usize,
    /// New cache keys (scopes, audiences) a second one ServiceAccount may
    /// add, sustained (0.1–100000).
    pub caller_new_keys_per_second: f64,
    /// New cache keys one ServiceAccount may add at once (1–100000).
    pub caller_new_keys_burst: f64,
    /// Cache entries one ServiceAccount may hold (1–1000000).
    pub caller_max_entries: usize,
}

impl Default for CacheSettings {
    fn default() -> Self {
        let d = crate::cache::CacheConfig::default();
        CacheSettings {
            scope: d.scope,
            max_entries: d.max_entries,
            idle_ttl: d.idle_ttl.as_secs(),
            negative_ttl: d.negative_ttl.as_secs(),
            upstream_concurrency: d.upstream_concurrency,
            rate_azure: d.rates[Cloud::Azure],
            rate_gcp: d.rates[Cloud::Gcp],
            rate_aws: d.rates[Cloud::Aws],
            caller_inflight: d.caller.inflight,
            caller_new_keys_per_second: d.caller.new_keys_per_second,
            caller_new_keys_burst: d.caller.new_keys_burst,
            caller_max_entries: d.caller.max_entries,
        }
    }
}

impl CacheSettings {
    /// Each cloud's upstream rate, with its key.
    pub fn rates(&self) -> [(&'static str, f64); Cloud::COUNT] {
        Cloud::ALL.map(|cloud| {
            let rate = match cloud {
                Cloud::Azure => self.rate_azure,
                Cloud::Gcp => self.rate_gcp,
                Cloud::Aws => self.rate_aws,
            };
            (cloud.rate_key(), rate)
        })
    }

    /// The cache's own configuration: seconds become durations, the per-cloud
    /// rates a [`PerCloud`] table, and what is not configurable (the retry
    /// backoff) keeps its default.
    pub fn to_cache_config(&self) -> crate::cache::CacheConfig {
        crate::cache::CacheConfig {
            scope: self.scope,
            max_entries: self.max_entries,
            idle_ttl: std::time::Duration::from_secs(self.idle_ttl),
            negative_ttl: std::time::Duration::from_secs(self.negative_ttl),
            upstream_concurrency: self.upstream_concurrency,
            rates: PerCloud::from_fn(|cloud| self.rates()[cloud as usize].1),
            caller: crate::cache::CallerLimits {
                inflight: self.caller_inflight,
                new_keys_per_second: self.caller_new_keys_per_second,
                new_keys_burst: self.caller_new_keys_burst,
                max_entries: self.caller_max_entries,
            },
            ..Default::default()
        }
    }
}

/// Settings of the node agent role: whose tokens it trusts and where
/// bindings come from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClusterConfig {
    /// The cluster's service-account issuer (`iss`); its keys are found by
    /// OIDC discovery unless `jwks_url` is set.
    pub issuer: Option<String>,
    /// A fixed JWKS URL for the issuer's keys.
    pub jwks_url: Option<String>,
    /// This node's name (`NODE_NAME`); tokens naming another node are refused.
    pub node_name: Option<String>,
    /// Static ServiceAccount bindings (namespace, name, annotations, labels).
    pub service_accounts: Vec<ServiceAccountEntry>,
    /// Labels of namespaces, for policies, with static bindings (with the
    /// Kubernetes API the agent watches namespaces instead).
    pub namespaces: Vec<NamespaceEntry>,
    /// TokenReview each new token with the API server (needs `create tokenreviews`).
    pub token_review: bool,
    /// Run the agent without a node name. Unsafe: tokens are then not kept
    /// to this node, and pods of other nodes are not told apart; only for
    /// a single-node test setup.
    pub insecure_no_node_name: bool,
}

/// Authorization policy settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicySettings {
    /// Directory of Cedar policy files (`*.cedar`). Unset: Lanyard allows
    /// what the ServiceAccounts' bindings allow. Set: a request is denied
    /// unless a policy permits it, and a `forbid` always wins.
    pub dir: Option<std::path::PathBuf>,
    /// Seconds between checks of the directory for changes (1–3600).
    pub reload_seconds: u64,
}

impl Default for PolicySettings {
    fn default() -> Self {
        PolicySettings {
            dir: None,
            reload_seconds: 2,
        }
    }
}

/// The audit trail (`docs/audit.md`). Flat keys, so that each has its
/// environment variable (`LANYARD_AUDIT_FILE_MAX_BYTES`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuditConfig {
    /// This cluster's name, in every record (many clusters, one collector).
    pub cluster: String,
    /// A credential whose record cannot be written: `deny` (refused,
    /// retryable) or `allow` (issued, the loss counted).
    pub on_failure: crate::audit::sinks::OnFailure,
    /// The `lanyard::audit` log record of each decision.
    pub log: bool,
    /// One JSON record per line on stdout (for node log collectors).
    pub stdout: bool,
    /// The hash-chained JSON Lines file; unset: none.
    pub file: Option<std::path::PathBuf>,
    /// Rotate the file at this size.
    pub file_max_bytes: u64,
    /// Rotate the file after this many seconds.
    pub file_max_age_seconds: u64,
    /// Rotated files kept.
    pub file_keep: usize,
    /// Sync each batch of records before the credentials leave.
    pub fsync: bool,
    /// Write a `checkpoint` record to the file this often (seconds), idle
    /// or not, so that collectors tell a quiet node from a silent one; 0:
    /// never.
    pub checkpoint_seconds: u64,
    /// Ship the file's records to syslog: `relp://HOST:PORT` (each
    /// acknowledged), `tls://HOST:PORT` (RFC 5425) or `tcp://HOST:PORT`.
    /// Needs `file`: the exporter follows it.
    pub syslog: Option<String>,
    /// CA certificates (PEM) for `tls://`; unset: the system's.
    pub syslog_ca: Option<std::path::PathBuf>,
    /// POST the file's records, in gzip JSON batches, to this collector
    /// (https, or http to loopback). Needs `file`: the exporter follows it.
    pub http: Option<String>,
    /// A file holding a bearer token for the collector (re-read per batch).
    pub http_token_file: Option<std::path::PathBuf>,
    /// How many records an exporter may fall behind the file; keep it
    /// within what retention holds (`file_keep` × `file_max_bytes`, about
    /// 1 KiB a record).
    pub export_max_backlog: u64,
    /// Past it: `deny` (refuse credentials until it catches up) or `drop`
    /// (keep issuing; records retention removes first are lost, counted
    /// and recorded).
    pub export_when_full: crate::audit::sinks::WhenFull,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            cluster: String::new(),
            on_failure: crate::audit::sinks::OnFailure::Deny,
            log: true,
            stdout: false,
            file: None,
            file_max_bytes: 100 * 1024 * 1024,
            file_max_age_seconds: 24 * 3600,
            file_keep: 10,
            fsync: true,
            checkpoint_seconds: 600,
            syslog: None,
            syslog_ca: None,
            http: None,
            http_token_file: None,
            export_max_backlog: 1_000_000,
            export_when_full: crate::audit::sinks::WhenFull::Deny,
        }
    }
}

/// Settings of the webhook role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WebhookConfig {
    /// PEM certificate chain served on `/mutate` (re-read when it changes).
    pub tls_cert: Option<std::path::PathBuf>,
    /// PEM private key of that certificate.
    pub tls_key: Option<std::path::PathBuf>,
    /// Seconds between checks for a rotated certificate.
    pub reload_seconds: u64,
    /// The image of the injected sidecar.
    pub sidecar_image: String,
    /// `imagePullPolicy` of the injected sidecar; default: Kubernetes' own
    /// (from the image's tag).
    pub image_pull_policy: Option<String>,
    /// Node agent URL as the sidecar sees it (`$(LANYARD_HOST_IP)` is the node's IP).
    pub agent_url: String,
    /// Loopback port of the SDK endpoints inside the pod.
    pub sidecar_port: u16,
    /// Port of the sidecar's probe listener.
    pub probe_port: u16,
    /// Audience of the app-facing token.
    pub app_audience: String,
    /// `requests.cpu` of the injected sidecar (`null`: none).
    pub sidecar_cpu_request: Option<String>,
    /// `requests.memory` of the injected sidecar (`null`: none).
    pub sidecar_memory_request: Option<String>,
    /// `limits.cpu` of the injected sidecar (`null`, the default: none, so
    /// that a burst of SDK calls is not throttled).
    pub sidecar_cpu_limit: Option<String>,
    /// `limits.memory` of the injected sidecar (`null`: none).
    pub sidecar_memory_limit: Option<String>,
    /// Token audiences the guard (`POST /validate`) refuses outside Lanyard's
    /// sidecar, beyond the ones Lanyard brokers (Entra's token-exchange
    /// audiences, `aws.audience`, the Google provider's): custom audiences
    /// the clouds trust this cluster's tokens for.
    pub guard_extra_audiences: Vec<String>,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        WebhookConfig {
            tls_cert: None,
            tls_key: None,
            reload_seconds: 10,
            sidecar_image: format!("lanyard:{}", env!("CARGO_PKG_VERSION")),
            image_pull_policy: None,
            agent_url: "http://$(LANYARD_HOST_IP):8700".into(),
            sidecar_port: 8642,
            probe_port: 8643,
            app_audience: "lanyard".into(),
            // Small: the sidecar idles between SDK refreshes. bench/run
            // measures the slim sidecar at about 8 MiB RSS; 16Mi leaves room
            // for connection buffers, and the 64Mi limit bounds a leak.
            sidecar_cpu_request: Some("10m".into()),
            sidecar_memory_request: Some("16Mi".into()),
            sidecar_cpu_limit: None,
            sidecar_memory_limit: Some("64Mi".into()),
            guard_extra_audiences: Vec::new(),
        }
    }
}

/// The development identity `lanyard dev` serves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DevConfig {
    /// Namespace of the dev pod and its ServiceAccount.
    pub namespace: String,
    /// Name of the dev ServiceAccount, bound to the dev identities below.
    pub service_account: String,
    /// Name of the dev pod the built-in issuer binds its tokens to.
    pub pod_name: String,
    /// Name of the node the dev pod's tokens name.
    pub node_name: String,
    /// Client id of the dev managed identity, as the
    /// `azure.workload.identity/client-id` annotation would give it.
    pub azure_client_id: String,
    /// Tenant of the dev managed identity.
    pub azure_tenant_id: String,
    /// Google service account the dev identity impersonates.
    pub gcp_service_account: String,
    /// IAM role the dev identity assumes.
    pub aws_role_arn: String,
    /// A target role the dev identity chains into from `aws_role_arn`
    /// (`lanyard.dev/aws-target-role-arn`); the emulated target trusts the
    /// dev role's sessions with session tags.
    pub aws_target_role_arn: Option<String>,
    /// The external id the emulated target role asks for
    /// (`lanyard.dev/aws-external-id`).
    pub aws_external_id: Option<String>,
    /// An app registration that trusts the dev managed identity
    /// (`lanyard.dev/azure-app-client-id`): the dev pod then gets its
    /// tokens, through the managed-identity-to-app hop.
    pub azure_app_client_id: Option<String>,
    /// The tenant the app's tokens are asked in
    /// (`lanyard.dev/azure-app-tenant-id`); unset: the identity's.
    pub azure_app_tenant_id: Option<String>,
    /// Further Azure client ids listed for the dev ServiceAccount
    /// (`lanyard.dev/azure-client-ids`), each trusted by the emulator.
    pub azure_client_ids: Vec<String>,
    /// Further Google service accounts listed for it
    /// (`lanyard.dev/gcp-service-accounts`), each granted to the dev pod.
    pub gcp_service_accounts: Vec<String>,
    /// Further IAM roles listed for it (`lanyard.dev/aws-role-arns`), each
    /// trusting the dev pod.
    pub aws_role_arns: Vec<String>,
    /// The dev pod's labels, as policies see them (`context.pod`).
    pub pod_labels: BTreeMap<String, String>,
    /// Lifetime, in seconds, of the credentials the emulators issue.
    pub token_lifetime: u64,
    /// Lifetime, in seconds, of the projected tokens the built-in issuer
    /// mints (the kubelet's default is one hour).
    pub projected_token_lifetime: u64,
    /// Milliseconds every emulated cloud waits before answering: real
    /// token services take tens of milliseconds, the emulators almost none
    /// (benchmarks of cold starts set it).
    pub upstream_latency_ms: u64,
    /// Address the built-in issuer and emulators listen on (port 0: any).
    pub emulator_listen: SocketAddr,
    /// Extra ServiceAccounts known to the dev directory.
    pub service_accounts: Vec<ServiceAccountEntry>,
}

impl DevConfig {
    /// The dev identity's names, each in the form its cloud takes, and
    /// what `clouds` must hold for them.
    pub(crate) fn check_identity(&self, clouds: CloudSettings<'_>) -> Result<(), ConfigError> {
        let invalid = |key, expected, got: &str| ConfigError::Invalid {
            key,
            expected,
            got: got.to_string(),
        };
        let client = &self.azure_client_id;
        if client.trim().is_empty() || client.contains(char::is_whitespace) {
            return Err(invalid("dev.azure_client_id", "a client id (GUID)", client));
        }
        if !azure::is_tenant(&self.azure_tenant_id) {
            return Err(invalid(
                "dev.azure_tenant_id",
                "a tenant GUID or domain name",
                &self.azure_tenant_id,
            ));
        }
        if let Some(app) = &self.azure_app_client_id {
            let on_node = clouds
                .azure
                .node_identities
                .iter()
                .any(|id| id.eq_ignore_ascii_case(client));
            if !on_node {
                return Err(invalid(
                    "dev.azure_app_client_id",
                    "an app reached through a node identity: add dev.azure_client_id to azure.node_identities (Entra refuses an identity's token obtained through its federated credential as the app's: AADSTS700231)",
                    app,
                ));
            }
        }
        let email = &self.gcp_service_account;
        if !email.contains('@') || email.contains(char::is_whitespace) {
            return Err(invalid(
                "dev.gcp_service_account",
                "a service account email",
                email,
            ));
        }
        if aws::RoleArn::parse(self.aws_role_arn.as_str()).is_err() {
            return Err(invalid(
                "dev.aws_role_arn",
                "arn:aws:iam::ACCOUNT:role/NAME",
                &self.aws_role_arn,
            ));
        }
        if let Some(target) = &self.aws_target_role_arn {
            if aws::RoleArn::parse(target.as_str()).is_err() {
                return Err(invalid(
                    "dev.aws_target_role_arn",
                    "arn:aws:iam::ACCOUNT:role/NAME",
                    target,
                ));
            }
        }
        if self.aws_external_id.is_some() && self.aws_target_role_arn.is_none() {
            return Err(invalid(
                "dev.aws_external_id",
                "unset without dev.aws_target_role_arn",
                self.aws_external_id.as_deref().unwrap_or(""),
            ));
        }
        if let Some(app) = &self.azure_app_client_id {
            if app.trim().is_empty() || app.contains(char::is_whitespace) {
                return Err(invalid(
                    "dev.azure_app_client_id",
                    "a client id (GUID)",
                    app,
                ));
            }
        }
        if let Some(tenant) = &self.azure_app_tenant_id {
            if self.azure_app_client_id.is_none() {
                return Err(invalid(
                    "dev.azure_app_tenant_id",
                    "unset without dev.azure_app_client_id",
                    tenant,
                ));
            }
            if !azure::is_tenant(tenant) {
                return Err(invalid(
                    "dev.azure_app_tenant_id",
                    "a tenant GUID or domain name",
                    tenant,
                ));
            }
        }
        const LISTED: &str = "at most 7 further identities (8 with the first)";
        for (key, listed) in [
            ("dev.azure_client_ids", &self.azure_client_ids),
            ("dev.gcp_service_accounts", &self.gcp_service_accounts),
            ("dev.aws_role_arns", &self.aws_role_arns),
        ] {
            if listed.len() >= crate::cloud::MAX_IDENTITIES {
                return Err(invalid(key, LISTED, &listed.len().to_string()));
            }
        }
        for id in &self.azure_client_ids {
            if id.trim().is_empty() || id.contains(|c: char| c.is_whitespace() || c == ',') {
                return Err(invalid("dev.azure_client_ids", "client ids (GUIDs)", id));
            }
        }
        for email in &self.gcp_service_accounts {
            if !email.contains('@') || email.contains(|c: char| c.is_whitespace() || c == ',') {
                return Err(invalid(
                    "dev.gcp_service_accounts",
                    "service account emails",
                    email,
                ));
            }
        }
        for arn in &self.aws_role_arns {
            if aws::RoleArn::parse(arn.as_str()).is_err() {
                return Err(invalid(
                    "dev.aws_role_arns",
                    "arn:aws:iam::ACCOUNT:role/NAME each",
                    arn,
                ));
            }
        }
        Ok(())
    }
}

impl Default for DevConfig {
    fn default() -> Self {
        DevConfig {
            namespace: "default".into(),
            service_account: "ray-worker".into(),
            pod_name: "ray-worker-0".into(),
            node_name: "lanyard-dev-node".into(),
            azure_client_id: "5f2c9e1a-8d4b-4c7e-9a13-0d6e2b7f4c21".into(),
            azure_tenant_id: "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b".into(),
            gcp_service_account: format!("ray-worker@{DEV_GCP_PROJECT_ID}.iam.gserviceaccount.com"),
            aws_role_arn: "arn:aws:iam::111122223333:role/ray-worker".into(),
            aws_target_role_arn: None,
            aws_external_id: None,
            azure_app_client_id: None,
            azure_app_tenant_id: None,
            azure_client_ids: Vec::new(),
            gcp_service_accounts: Vec::new(),
            aws_role_arns: Vec::new(),
            pod_labels: BTreeMap::new(),
            token_lifetime: 3600,
            projected_token_lifetime: 3600,
            upstream_latency_ms: 0,
            emulator_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            service_accounts: Vec::new(),
        }
    }
}

/// Google project of `lanyard dev`'s emulated workload identity pool.
pub const DEV_GCP_PROJECT_ID: &str = "lanyard-dev";
/// Project number of [`DEV_GCP_PROJECT_ID`].
pub const DEV_GCP_PROJECT_NUMBER: &str = "123456789012";
/// The workload identity provider `lanyard dev`'s Google emulator trusts
/// the built-in issuer through.
pub const DEV_GCP_PROVIDER: &str = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/lanyard-dev/providers/dev-cluster";

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Log line format: `text` for people, `json` for collectors.
    pub log_format: LogFormat,
    /// Default tracing filter (`RUST_LOG` overrides).
    pub log_level: String,
    /// Address of the SDK-facing surfaces.
    pub listen: SocketAddr,
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    pub admin_listen: SocketAddr,
    /// How long the agent and the webhook keep serving after SIGTERM,
    /// not ready, before they stop listening (endpoints drop the pod
    /// meanwhile; see [`crate::http::shutdown_delay`]).
    pub shutdown_delay_seconds: u64,
    /// The credential cache (`cache.*`, `LANYARD_CACHE_*`).
    pub cache: CacheSettings,
    /// The node agent's trust and bindings (`cluster.*`).
    pub cluster: ClusterConfig,
    /// Authorization policy (`policy.*`).
    pub policy: PolicySettings,
    /// The audit trail (`audit.*`).
    pub audit: AuditConfig,
    /// The pod sidecar (`sidecar.*`).
    pub sidecar: SidecarConfig,
    /// The admission webhook and what it injects (`webhook.*`).
    pub webhook: WebhookConfig,
    /// Entra ID (`azure.*`).
    pub azure: azure::Settings,
    /// Google (`gcp.*`).
    pub gcp: gcp::Settings,
    /// AWS STS (`aws.*`).
    pub aws: aws::Settings,
    /// The identity and emulators of `lanyard dev` (`dev.*`).
    pub dev: DevConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            log_format: LogFormat::Text,
            log_level: "info".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 8642)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 8643)),
            shutdown_delay_seconds: 0,
            cache: CacheSettings::default(),
            cluster: ClusterConfig::default(),
            policy: PolicySettings::default(),
            audit: AuditConfig::default(),
            sidecar: SidecarConfig::default(),
            webhook: WebhookConfig::default(),
            azure: azure::Settings::default(),
            gcp: gcp::Settings::default(),
            aws: aws::Settings::default(),
            dev: DevConfig::default(),
        }
    }
}

/// A configuration value that is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file, environment or flags could not be read or do not fit the
    /// schema (a missing file, bad YAML, an unknown key, a wrong type); the text
    /// says which and where.
    #[error("invalid configuration: {0}")]
    Load(String),
    /// A value has the right type but is not acceptable (out of range, not a
    /// URL, not a region).
    #[error("invalid configuration: {key}: {expected} (got {got:?})")]
    Invalid {
        /// The key, as `section.key`.
        key: &'static str,
        /// What the key takes.
        expected: &'static str,
        /// The value that was given.
        got: String,
    },
}

impl From<crate::cloud::Invalid> for ConfigError {
    fn from(e: crate::cloud::Invalid) -> Self {
        ConfigError::Invalid {
            key: e.key,
            expected: e.expected,
            got: e.got,
        }
    }
}

impl Config {
    /// The clouds' sections, together.
    pub fn clouds(&self) -> CloudSettings<'_> {
        CloudSettings {
            azure: &self.azure,
            gcp: &self.gcp,
            aws: &self.aws,
        }
    }

    /// What the sidecar reads of this configuration: the same values the
    /// slim `lanyard-sidecar` loads from the same sources.
    pub fn sidecar_settings(&self) -> lanyard_sidecar::config::Settings {
        lanyard_sidecar::config::Settings {
            log_format: self.log_format,
            log_level: self.log_level.clone(),
            listen: self.listen,
            sidecar: self.sidecar.clone(),
            sdk_defaults: self.clouds().sdk_defaults(),
        }
    }

    /// The audience of the projected token each cloud's exchange takes;
    /// `None` where the cloud is not configured.
    pub fn audiences(&self) -> PerCloud<Option<String>> {
        self.clouds().audiences()
    }

    /// Loads defaults < `file` < environment < `overrides` (flags, as a
    /// nested map of the same keys), then validates.
    pub fn load(file: Option<&Path>, overrides: serde_json::Value) -> Result<Config, ConfigError> {
        let config: Config =
            lanyard_startup::sources::load(file, overrides).map_err(ConfigError::Load)?;
        config.validate()?;
        Ok(config)
    }
}

mod validate;

/// Every cloud's section of the configuration, together
/// (`Config::clouds`).
#[derive(Debug, Clone, Copy)]
pub struct CloudSettings<'a> {
    /// `azure`.
    pub azure: &'a azure::Settings,
    /// `gcp`.
    pub gcp: &'a gcp::Settings,
    /// `aws`.
    pub aws: &'a aws::Settings,
}

impl CloudSettings<'_> {
    /// Each section's checks, in [`Cloud::ALL`] order.
    pub fn check(&self) -> Result<(), Invalid> {
        self.azure.check()?;
        self.gcp.check()?;
        self.aws.check()
    }

    /// The identities assigned to the node, which the node's metadata
    /// service serves (Azure's `node_identities`).
    pub fn node_identities(&self) -> Vec<String> {
        self.azure.node_identities.clone()
    }

    /// The audience of the projected token each cloud's exchange takes;
    /// `None` where the cloud is not configured (Google without a
    /// workload identity provider).
    pub fn audiences(&self) -> PerCloud<Option<String>> {
        PerCloud::from_fn(|cloud| match cloud {
            Cloud::Azure => Some(self.azure.audience.clone()),
            Cloud::Gcp => self.gcp.token_audience(),
            Cloud::Aws => Some(self.aws.audience.clone()),
        })
    }

    /// What the SDK environment takes from these sections.
    pub fn sdk_defaults(&self) -> SdkDefaults {
        SdkDefaults::of(
            self.azure.tenant_id.as_deref(),
            &self.gcp.universe_domain,
            &self.aws.region,
        )
    }

    /// What each cloud must trust for `bindings` of `workload`, every
    /// cloud's in [`Cloud::ALL`] order (`lanyard doctor`).
    pub fn trust(&self, bindings: &Bindings, workload: &Workload) -> Vec<Trust> {
        let mut out = azure::trust::trust(self.azure, &bindings.azure, workload);
        out.extend(gcp::trust::trust(self.gcp, &bindings.gcp, workload));
        out.extend(aws::trust::trust(self.aws, &bindings.aws, workload));
        out
    }

    /// Registers the exchanger of every configured cloud.
    pub fn register(
        &self,
        http: &reqwest::Client,
        registry: &mut impl Registry,
    ) -> Result<(), Invalid> {
        registry.register(self.azure.exchanger(http.clone())?);
        if let Some(google) = self.gcp.exchanger(http.clone())? {
            registry.register(google);
        }
        registry.register(self.aws.exchanger(http.clone()));
        Ok(())
    }
}

#[cfg(test)]
mod tests;
