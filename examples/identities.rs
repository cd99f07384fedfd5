//! `identities`: Lanyard holding many identities, and many pods sharing one.
//!
//! Runs the product's own code (the agent's broker as `lanyard agent`
//! assembles it: token verifier, static directory, policy, cache, cloud
//! exchangers, audit) against the built-in issuer and the validating cloud
//! emulators, all on 127.0.0.1. Three measurements, one JSON line each on
//! stdout, a summary for people on stderr:
//!
//! - **rss** (`identities --count 10000 [--cloud all]`): a real agent in a
//!   child process (this binary, `--agent-child`), holding `--count`
//!   ServiceAccounts bound to distinct identities. This process runs the
//!   issuer and the emulators and asks the agent's `POST /v1/token` (the
//!   sidecar's client, `RemoteBroker`) once per ServiceAccount, with a
//!   projected token minted for one pod of it, `--concurrency` at a time.
//!   The agent's VmRSS / RssAnon are read from `/proc/PID/status` once it is
//!   ready (bindings loaded, no credential) and after every credential is
//!   cached and the request connections are closed; the difference divided
//!   by the cache's entry count is the cost of one entry. Emulators,
//!   tokens and the load generator are in this process, not in the agent's.
//!
//! - **spread** (same invocation): how refresh-ahead loads the upstreams
//!   over time. The cache refreshes each entry, from its one refresh
//!   schedule, at about half its lifetime (never later than the cloud's
//!   refresh window, never sooner than a quarter of it, spread at random
//!   over up to a tenth of the lifetime before that: `refresh_at`), behind
//!   a per-cloud token bucket. Real lifetimes (an hour) need hours, so this
//!   runs in-process on a paused Tokio clock that jumps ahead whenever
//!   every task is waiting (`start_paused`): the product's timers, token
//!   bucket and emulated upstream latency all run on it, while the HTTP
//!   exchanges with the emulators are real (loopback). Every pod asks
//!   again every `--ask-every-secs`; upstream calls are counted per
//!   simulated second as the emulators receive them, and refreshes due
//!   per second from `lanyard_cache_refreshes_total`.
//!
//! - **economy** (`identities --economy --pods 1,10,100,1000`): N pods of
//!   one ServiceAccount on one node (distinct pod names and uids, one token
//!   each), each asking every `--ask-every-ms` over `--hours` of simulated
//!   time with short credential lifetimes, on the same paused clock; a
//!   fresh agent per N. Reports upstream exchanges per refresh period
//!   (the period from the product's own `lanyard::cache::refresh_at`).
//!
//! Only loopback is used. Nothing here asserts: figures are printed.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, ValueEnum};
use futures::StreamExt;
use serde_json::{json, Value};
use tokio::time::Instant;

use lanyard::broker::remote::RemoteBroker;
use lanyard::broker::{Broker, TokenBroker};
use lanyard::cache::CacheScope;
use lanyard::cloud::{aws, azure, gcp};
use lanyard::cloud::{Cloud, Credential, Kind, PerCloud, Surface, TokenRequest};
use lanyard::config::{ClusterConfig, Config};
use lanyard::directory::file::ServiceAccountEntry;
use lanyard::http::{bind, per_thread, spawn_server, Limits, Shutdown, ShutdownTrigger};
use lanyard::secret::{ExposeSecret, SecretString};
use lanyard::telemetry::metrics::{cloud_label, Metrics, UpstreamLabel};
use lanyard::telemetry::LogFormat;
use lanyard_emulators::aws::AwsSts;
use lanyard_emulators::entra::{Entra, FEDERATION_AUDIENCE};
use lanyard_emulators::faults::Fault;
use lanyard_emulators::gcp::Gcp;
use lanyard_emulators::{
    Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, PodIdentity, SigningKey,
};

const TENANT: &str = "3b8e4f60-1c2d-4e5f-8a9b-7c6d5e4f3a2b";
const PROVIDER: &str = "//iam.googleapis.com/projects/123456789012/locations/global/workloadIdentityPools/bench/providers/cluster";
const PROJECT_ID: &str = "lanyard-bench";
const PROJECT_NUMBER: &str = "123456789012";
const AWS_ACCOUNT: &str = "111122223333";
const AWS_AUDIENCE: &str = "sts.amazonaws.com";
const NODE: &str = "node-a";
const AZURE_RESOURCE: &str = "https://storage.azure.com/";
/// What `lanyard agent` allows its API (`AGENT_CONNECTIONS` in src/agent.rs).
const AGENT_CONNECTIONS: usize = 16_384;
/// Every outcome label of `lanyard_upstream_requests_total`.
const OUTCOMES: [&str; 5] = ["ok", "rejected", "throttled", "unavailable", "protocol"];

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CloudArg {
    Azure,
    Gcp,
    Aws,
    All,
}

impl CloudArg {
    fn clouds(self) -> Vec<Cloud> {
        match self {
            CloudArg::Azure => vec![Cloud::Azure],
            CloudArg::Gcp => vec![Cloud::Gcp],
            CloudArg::Aws => vec![Cloud::Aws],
            CloudArg::All => Cloud::ALL.to_vec(),
        }
    }
    fn name(self) -> &'static str {
        match self {
            CloudArg::Azure => "azure",
            CloudArg::Gcp => "gcp",
            CloudArg::Aws => "aws",
            CloudArg::All => "all",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ScopeArg {
    /// The default: pods of one ServiceAccount share an entry.
    Serviceaccount,
    /// One entry per pod (`cache.scope: pod`).
    Pod,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Only {
    Rss,
    Spread,
}

#[derive(Parser, Debug)]
#[command(
    name = "identities",
    about = "Lanyard with many identities (RSS, refresh-ahead spread) and many pods of one identity (upstream economy); JSON lines on stdout."
)]
struct Args {
    /// ServiceAccounts, each bound to its own identity (rss, spread).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    count: u32,
    /// Which clouds the identities are in; `all` deals them out in turn.
    #[arg(long, value_enum, default_value_t = CloudArg::All)]
    cloud: CloudArg,
    /// Run only one of the two many-identities measurements.
    #[arg(long, value_enum)]
    only: Option<Only>,
    /// rss: requests in flight at once while filling the agent's cache.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    concurrency: u32,
    /// Added to every emulated upstream answer (on the simulated clock in
    /// spread and economy).
    #[arg(long, default_value_t = 50)]
    upstream_latency_ms: u64,
    /// Credential lifetime the emulators grant (AWS: the agent's
    /// `aws.session_duration`). Default: 3600 for rss and spread; for
    /// economy 600 (Azure, Google) and 1800 (AWS).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=43_200))]
    lifetime_secs: Option<u64>,
    /// spread: simulated time.
    #[arg(long, default_value_t = 2.0)]
    hours: f64,
    /// spread: each pod asks again this often (simulated).
    #[arg(long, default_value_t = 300)]
    ask_every_secs: u64,
    /// spread: pods' first requests are spread over this many seconds
    /// (0: all at once, as after an agent restart).
    #[arg(long, default_value_t = 0)]
    start_spread_secs: u64,

    /// Measure the upstream economy instead.
    #[arg(long)]
    economy: bool,
    /// economy: pods of the one ServiceAccount, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1u32, 10, 100, 1000])]
    pods: Vec<u32>,
    /// economy: simulated time per run.
    #[arg(long, default_value_t = 1.0)]
    economy_hours: f64,
    /// economy: each pod asks this often (simulated), first at a random
    /// moment within one interval.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    ask_every_ms: u64,
    /// economy: the cache scope (the agent ships with `serviceaccount`).
    #[arg(long, value_enum, default_value_t = ScopeArg::Serviceaccount)]
    scope: ScopeArg,

    /// Measure a noisy neighbour instead: one ServiceAccount sends
    /// `--flood` requests at once, each for a resource never asked before
    /// (each a cache miss), while others ask for their first credential;
    /// their latency alone and during the flood.
    #[arg(long)]
    neighbour: bool,
    /// neighbour: the flood's concurrent requests.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    flood: u32,

    /// Seed of the pods' phases.
    #[arg(long, default_value_t = 1)]
    seed: u64,

    // The agent child's side (internal).
    #[arg(long, hide = true)]
    agent_child: bool,
    #[arg(long, hide = true)]
    issuer_url: Option<String>,
    #[arg(long, hide = true)]
    entra_url: Option<String>,
    #[arg(long, hide = true)]
    gcp_url: Option<String>,
    #[arg(long, hide = true)]
    aws_url: Option<String>,
}

// ---------------------------------------------------------------------------
// Identities, bindings, tokens.

/// One ServiceAccount bound to one identity of `cloud`.
#[derive(Clone, Debug)]
struct Ident {
    index: u32,
    cloud: Cloud,
    namespace: String,
    name: String,
}

impl Ident {
    fn subject(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
    fn client_id(&self) -> String {
        format!("00000000-0000-4000-8000-{:012x}", self.index)
    }
    fn role_arn(&self) -> String {
        format!("arn:aws:iam::{AWS_ACCOUNT}:role/id-{:06}", self.index)
    }
    /// The ServiceAccount as the directory holds it: the compatible
    /// annotation of its cloud (Google: none, the federated principal).
    fn entry(&self) -> ServiceAccountEntry {
        let mut annotations = BTreeMap::new();
        match self.cloud {
            Cloud::Azure => {
                annotations.insert("azure.workload.identity/client-id".into(), self.client_id());
                annotations.insert("azure.workload.identity/tenant-id".into(), TENANT.into());
            }
            Cloud::Gcp => {}
            Cloud::Aws => {
                annotations.insert("eks.amazonaws.com/role-arn".into(), self.role_arn());
            }
        }
        ServiceAccountEntry {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            annotations,
            labels: BTreeMap::from([("app".to_string(), self.name.clone())]),
        }
    }
    fn request(&self) -> TokenRequest {
        request_for(self.cloud)
    }
}

fn request_for(cloud: Cloud) -> TokenRequest {
    match cloud {
        Cloud::Azure => {
            let mut r = TokenRequest::new(Cloud::Azure, Kind::AccessToken, Surface::AzureImds);
            r.scopes = vec![AZURE_RESOURCE.into()];
            r
        }
        Cloud::Gcp => TokenRequest::new(Cloud::Gcp, Kind::AccessToken, Surface::Gce),
        Cloud::Aws => TokenRequest::new(Cloud::Aws, Kind::AwsCredentials, Surface::AwsContainer),
    }
}

fn audience(cloud: Cloud) -> &'static str {
    match cloud {
        Cloud::Azure => FEDERATION_AUDIENCE,
        Cloud::Gcp => PROVIDER,
        Cloud::Aws => AWS_AUDIENCE,
    }
}

/// `count` ServiceAccounts in namespaces of 100, dealt out over `clouds`.
fn identities(count: u32, clouds: &[Cloud]) -> Vec<Ident> {
    (0..count)
        .map(|i| Ident {
            index: i,
            cloud: clouds[i as usize % clouds.len()],
            namespace: format!("team-{:03}", i / 100),
            name: format!("sa-{i:06}"),
        })
        .collect()
}

/// A pod of `ident` on this node, with fresh uids.
fn pod_of(ident: &Ident, pod: u32, service_account_uid: &str) -> PodIdentity {
    let mut p = PodIdentity::new(
        &ident.namespace,
        &ident.name,
        &format!("{}-{pod}", ident.name),
        NODE,
    );
    p.service_account_uid = service_account_uid.to_string();
    p
}

/// Mints one projected token (valid an hour) per pod, on every core:
/// RS256 signing is the slow part of setting up 10,000 pods.
fn mint_all(issuer: &Issuer, pods: &[(PodIdentity, Cloud)]) -> Result<Vec<SecretString>> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = pods.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = pods
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|(pod, cloud)| {
                            issuer
                                .mint(pod, &[audience(*cloud)], Duration::from_secs(3600))
                                .map(SecretString::from)
                        })
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(pods.len());
        for h in handles {
            out.extend(
                h.join()
                    .map_err(|_| anyhow!("a minting thread panicked"))??,
            );
        }
        Ok(out)
    })
}

// ---------------------------------------------------------------------------
// The upstreams: issuer and emulators, and what they received when.

/// Upstream calls as the emulators receive them: per second since
/// `origin`, per cloud, and each call's time.
struct CallLog {
    inner: Mutex<CallInner>,
}

struct CallInner {
    origin: Instant,
    per_second: Vec<[u32; 3]>,
    times: [Vec<f64>; 3],
}

impl CallLog {
    fn new() -> Self {
        CallLog {
            inner: Mutex::new(CallInner {
                origin: Instant::now(),
                per_second: Vec::new(),
                times: Default::default(),
            }),
        }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, CallInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Forgets everything and counts from `origin`.
    fn restart(&self, origin: Instant) {
        let mut inner = self.lock();
        inner.origin = origin;
        inner.per_second.clear();
        inner.times = Default::default();
    }
    fn record(&self, cloud: Cloud) {
        let mut inner = self.lock();
        let at = Instant::now().saturating_duration_since(inner.origin);
        let second = at.as_secs() as usize;
        if inner.per_second.len() <= second {
            inner.per_second.resize(second + 1, [0; 3]);
        }
        inner.per_second[second][cloud as usize] += 1;
        inner.times[cloud as usize].push(at.as_secs_f64());
    }
    fn per_second(&self, cloud: Cloud) -> Vec<u32> {
        self.lock()
            .per_second
            .iter()
            .map(|s| s[cloud as usize])
            .collect()
    }
    fn times(&self, cloud: Cloud) -> Vec<f64> {
        self.lock().times[cloud as usize].clone()
    }
}

struct Urls {
    issuer: String,
    entra: String,
    gcp: String,
    aws: String,
}

struct Upstreams {
    issuer: Arc<Issuer>,
    entra: Arc<Entra>,
    gcp: Arc<Gcp>,
    aws: Arc<AwsSts>,
    urls: Urls,
    calls: Arc<CallLog>,
    _trigger: ShutdownTrigger,
}

impl Upstreams {
    /// Exchanges each emulator's ledger has recorded, per cloud.
    fn ledger_totals(&self) -> PerCloud<u64> {
        PerCloud::from_fn(|cloud| {
            let counts = match cloud {
                Cloud::Azure => self.entra.ledger.counts(),
                Cloud::Gcp => self.gcp.ledger.counts(),
                Cloud::Aws => self.aws.ledger.counts(),
            };
            counts.values().sum()
        })
    }
    /// Principals with at least one exchange, per cloud.
    fn ledger_principals(&self) -> PerCloud<usize> {
        PerCloud::from_fn(|cloud| match cloud {
            Cloud::Azure => self.entra.ledger.counts().len(),
            Cloud::Gcp => self.gcp.ledger.counts().len(),
            Cloud::Aws => self.aws.ledger.counts().len(),
        })
    }
}

/// Counts each request an emulator receives, before its faults apply.
fn counted(router: axum::Router, calls: Arc<CallLog>, cloud: Cloud) -> axum::Router {
    router.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let calls = calls.clone();
            async move {
                calls.record(cloud);
                next.run(req).await
            }
        },
    ))
}

async fn serve(router: axum::Router, shutdown: &Shutdown, what: &str) -> Result<String> {
    let listener = bind(([127, 0, 0, 1], 0).into(), what).await?;
    let addr = listener.local_addr()?;
    spawn_server(listener, router, shutdown.clone());
    Ok(format!("http://{addr}"))
}

/// The issuer and the three emulators, each trusting exactly the
/// identities in `idents` (Entra: an app per identity federating its
/// ServiceAccount; AWS: a role per identity trusting it; Google: the
/// provider, whose federated principals need no grant to exist).
async fn upstreams(
    idents: &[Ident],
    lifetime: PerCloud<u64>,
    latency_ms: u64,
) -> Result<Upstreams> {
    let (trigger, shutdown) = Shutdown::new();
    let listener = bind(([127, 0, 0, 1], 0).into(), "issuer").await?;
    let issuer_url = format!("http://{}", listener.local_addr()?);
    let issuer = Arc::new(Issuer::new(
        issuer_url.clone(),
        SigningKey::generate_rs256()?,
    ));
    spawn_server(listener, issuer.router(), shutdown.clone());
    let calls = Arc::new(CallLog::new());

    let mut bindings: Vec<Binding> = idents
        .iter()
        .map(|i| Binding {
            subject: i.subject(),
            azure_client_id: (i.cloud == Cloud::Azure).then(|| i.client_id()),
            // Google's identities are the federated principals themselves.
            gcp_service_account: None,
            aws_role_arn: (i.cloud == Cloud::Aws).then(|| i.role_arn()),
            aws_target: None,
            azure_app: None,
        })
        .collect();
    // Entra answers "tenant not found" to a tenant without apps.
    if !idents.iter().any(|i| i.cloud == Cloud::Azure) {
        bindings.push(Binding {
            subject: "system:serviceaccount:none:none".into(),
            azure_client_id: Some("00000000-0000-4000-8000-ffffffffffff".into()),
            ..Binding::default()
        });
    }
    let EmulatorSet {
        entra, gcp, aws, ..
    } = EmulatorSet::new(
        &CloudsConfig {
            issuer: issuer_url.clone(),
            azure_tenant_id: TENANT.into(),
            azure_audience: FEDERATION_AUDIENCE.into(),
            gcp_provider: PROVIDER.into(),
            gcp_allowed_audiences: vec![],
            gcp_gke: None,
            aws_audience: AWS_AUDIENCE.into(),
            lifetimes: Lifetimes {
                azure: Duration::from_secs(lifetime[Cloud::Azure]),
                gcp: Duration::from_secs(lifetime[Cloud::Gcp]),
            },
            bindings,
            azure_identity_binding: false,
            azure_node_identities: vec![],
        },
        lanyard::http::client(),
    )?;
    if latency_ms > 0 {
        for faults in [&entra.faults, &gcp.faults, &aws.faults] {
            faults.push(Fault::Latency { ms: latency_ms }, None);
        }
    }
    let entra_url = serve(
        counted(entra.router(), calls.clone(), Cloud::Azure),
        &shutdown,
        "Entra emulator",
    )
    .await?;
    let gcp_url = serve(
        counted(gcp.router(), calls.clone(), Cloud::Gcp),
        &shutdown,
        "Google emulator",
    )
    .await?;
    let aws_url = serve(
        counted(aws.router(), calls.clone(), Cloud::Aws),
        &shutdown,
        "STS emulator",
    )
    .await?;
    Ok(Upstreams {
        issuer,
        entra,
        gcp,
        aws,
        urls: Urls {
            issuer: issuer_url,
            entra: entra_url,
            gcp: gcp_url,
            aws: aws_url,
        },
        calls,
        _trigger: trigger,
    })
}

/// The agent's configuration: its defaults, the emulators as the clouds'
/// (private) endpoints, the built-in issuer as the cluster's, and the
/// ServiceAccounts as static bindings.
fn agent_config(urls: &Urls, accounts: Vec<ServiceAccountEntry>, aws_session: u64) -> Config {
    Config {
        azure: azure::Settings {
            authority_host: Some(urls.entra.clone()),
            tenant_id: Some(TENANT.into()),
            ..Default::default()
        },
        gcp: gcp::Settings {
            workload_identity_provider: Some(PROVIDER.into()),
            project_id: Some(PROJECT_ID.into()),
            project_number: Some(PROJECT_NUMBER.into()),
            sts_endpoint: Some(urls.gcp.clone()),
            iamcredentials_endpoint: Some(urls.gcp.clone()),
            ..Default::default()
        },
        aws: aws::Settings {
            sts_endpoint: Some(urls.aws.clone()),
            session_duration: aws_session,
            ..Default::default()
        },
        cluster: ClusterConfig {
            issuer: Some(urls.issuer.clone()),
            node_name: Some(NODE.into()),
            service_accounts: accounts,
            ..Default::default()
        },
        ..Default::default()
    }
}

/// The agent's broker, assembled exactly as `lanyard agent` does.
async fn agent_broker(config: &Config) -> Result<(Arc<Broker>, Arc<Metrics>)> {
    config
        .validate()
        .map_err(|e| anyhow!("agent configuration: {e}"))?;
    let metrics = Arc::new(Metrics::new());
    let broker = lanyard::agent::broker(config, metrics.clone()).await?;
    Ok((Arc::new(broker), metrics))
}

// ---------------------------------------------------------------------------
// Small helpers.

/// SplitMix64: reproducible phases without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let f = 10f64.powi(digits);
    (v * f).round() / f
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Fields of `/proc/PID/status` (kB).
#[derive(Clone, Copy, Debug, Default)]
struct Mem {
    rss: u64,
    anon: u64,
    file: u64,
    hwm: u64,
}

impl Mem {
    fn read(pid: &str) -> Result<Mem> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .with_context(|| format!("reading /proc/{pid}/status"))?;
        let field = |name: &str| -> Result<u64> {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| anyhow!("no {name} in /proc/{pid}/status"))
        };
        Ok(Mem {
            rss: field("VmRSS:")?,
            anon: field("RssAnon:")?,
            file: field("RssFile:")?,
            hwm: field("VmHWM:")?,
        })
    }
    fn json(&self) -> Value {
        json!({"vm_rss_kib": self.rss, "rss_anon_kib": self.anon, "rss_file_kib": self.file, "vm_hwm_kib": self.hwm})
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/PID/stat`
/// (clock ticks of 1/100 s, Linux's USER_HZ).
fn cpu_seconds(pid: u32) -> Result<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name may hold spaces; the fields follow its ')'.
    let rest = text
        .rsplit_once(')')
        .map(|(_, r)| r)
        .ok_or_else(|| anyhow!("unexpected /proc/{pid}/stat"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| -> Result<f64> {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .ok_or_else(|| anyhow!("unexpected /proc/{pid}/stat"))
    };
    // utime and stime are fields 14 and 15; `rest` starts at field 3.
    Ok((ticks(11)? + ticks(12)?) / 100.0)
}

/// Sum of a Prometheus text metric's samples whose line starts with
/// `prefix` (name and, optionally, the start of its labels).
fn metric(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Counter readings of the in-process broker's metrics.
struct Counters<'a>(&'a Metrics);

impl Counters<'_> {
    fn upstream(&self, cloud: Cloud) -> u64 {
        OUTCOMES
            .iter()
            .map(|outcome| {
                self.0
                    .upstream_requests
                    .get_or_create(&UpstreamLabel {
                        cloud: cloud.name(),
                        outcome,
                    })
                    .get()
            })
            .sum()
    }
    fn refreshes(&self, cloud: Cloud) -> u64 {
        self.0
            .cache_refreshes
            .get_or_create(&cloud_label(cloud))
            .get()
    }
    fn misses(&self, cloud: Cloud) -> u64 {
        self.0.cache_misses.get_or_create(&cloud_label(cloud)).get()
    }
    fn hits(&self, cloud: Cloud) -> u64 {
        self.0.cache_hits.get_or_create(&cloud_label(cloud)).get()
    }
    fn coalesced(&self, cloud: Cloud) -> u64 {
        self.0
            .cache_coalesced
            .get_or_create(&cloud_label(cloud))
            .get()
    }
}

/// Exchanges started (by a miss or a refresh) and not yet answered, per
/// cloud: waiting for the rate limit, or in flight.
fn queued(metrics: &Metrics) -> [u64; 3] {
    let c = Counters(metrics);
    Cloud::ALL.map(|cloud| (c.misses(cloud) + c.refreshes(cloud)).saturating_sub(c.upstream(cloud)))
}

/// On the paused clock, keeps the steps the clock jumps by short while an
/// exchange is in flight: should a loopback answer be a little late, the
/// clock then moves a millisecond at a time instead of jumping to a far
/// timer (an HTTP timeout). Otherwise steps of 100 ms, which cost nothing.
/// Returns, per simulated second, the most exchanges seen queued.
fn spawn_pacer(metrics: Arc<Metrics>, until: Instant) -> Arc<Mutex<Vec<[u64; 3]>>> {
    let peaks: Arc<Mutex<Vec<[u64; 3]>>> = Default::default();
    let out = peaks.clone();
    let origin = Instant::now();
    tokio::spawn(async move {
        while Instant::now() < until {
            let q = queued(&metrics);
            let second = origin.elapsed().as_secs() as usize;
            {
                let mut peaks = peaks.lock().unwrap_or_else(|p| p.into_inner());
                if peaks.len() <= second {
                    peaks.resize(second + 1, [0; 3]);
                }
                for (peak, now) in peaks[second].iter_mut().zip(q) {
                    *peak = (*peak).max(now);
                }
            }
            let step = if q.iter().any(|n| *n > 0) { 1 } else { 100 };
            tokio::time::sleep(Duration::from_millis(step)).await;
        }
    });
    out
}

fn paused_runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .context("cannot start the paused runtime")
}

fn lifetimes(args: &Args, economy: bool) -> PerCloud<u64> {
    PerCloud::from_fn(|cloud| {
        args.lifetime_secs.unwrap_or(match (economy, cloud) {
            (false, _) => 3600,
            (true, Cloud::Aws) => 1800,
            (true, _) => 600,
        })
    })
}

fn per_cloud_json<T: serde::Serialize>(clouds: &[Cloud], f: impl Fn(Cloud) -> T) -> Value {
    Value::Object(
        clouds
            .iter()
            .map(|c| (c.name().to_string(), json!(f(*c))))
            .collect(),
    )
}

// ---------------------------------------------------------------------------
// rss: a real agent in a child process.

/// The child: `lanyard agent`'s broker over the same static bindings,
/// serving the agent API (and `/metrics`) on loopback. Prints
/// `READY <url> <VmRSS kB at start> <VmRSS kB with the bindings parsed as
/// configuration>`, then runs until its stdin closes.
fn agent_child(args: &Args) -> Result<()> {
    let start = Mem::read("self")?;
    let url = |v: &Option<String>, what: &str| {
        v.clone()
            .ok_or_else(|| anyhow!("--agent-child needs --{what}"))
    };
    let urls = Urls {
        issuer: url(&args.issuer_url, "issuer-url")?,
        entra: url(&args.entra_url, "entra-url")?,
        gcp: url(&args.gcp_url, "gcp-url")?,
        aws: url(&args.aws_url, "aws-url")?,
    };
    // As `lanyard agent` starts: its default logging (to stderr, which
    // the parent discards) and a multi-threaded runtime.
    let _log = lanyard::telemetry::init(
        LogFormat::Text,
        "info",
        lanyard::telemetry::LogWrites::Batched,
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let accounts = identities(args.count, &args.cloud.clouds())
            .iter()
            .map(Ident::entry)
            .collect();
        let config = agent_config(&urls, accounts, lifetimes(args, false)[Cloud::Aws]);
        let configured = Mem::read("self")?;
        let (broker, metrics) = agent_broker(&config).await?;
        drop(config);
        let (_trigger, shutdown) = Shutdown::new();
        let router = lanyard::serve::agent_api::router(broker).route(
            "/metrics",
            axum::routing::get(move || {
                let metrics = metrics.clone();
                async move { metrics.render() }
            }),
        );
        // As `lanyard agent` serves its API: a thread per CPU.
        let listeners = per_thread::bind(
            ([127, 0, 0, 1], 0).into(),
            "agent API",
            per_thread::default_threads(),
        )
        .await?;
        let addr = listeners.local_addr();
        per_thread::spawn(listeners, router, shutdown, Limits::api(AGENT_CONNECTIONS));
        println!("READY http://{addr} {} {}", start.rss, configured.rss);
        // Until the parent closes our stdin (or exits).
        tokio::task::spawn_blocking(|| {
            let mut sink = Vec::new();
            let _ = std::io::stdin().read_to_end(&mut sink);
        })
        .await?;
        Ok(())
    })
}

/// The agent child, killed when dropped.
struct AgentProcess {
    child: Child,
    url: String,
    start_rss: u64,
    configured_rss: u64,
}

impl AgentProcess {
    /// Starts this executable as `--agent-child` with `args` and waits
    /// (blocking) for it to serve.
    fn spawn(args: Vec<String>) -> Result<AgentProcess> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut child = Command::new(exe)
            .arg("--agent-child")
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the agent child")?;
        let stdout = child.stdout.take().context("the child's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let mut words = line.split_whitespace();
        let (Some("READY"), Some(url), Some(rss), Some(configured)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("the agent child did not start (said {line:?})");
        };
        Ok(AgentProcess {
            url: url.to_string(),
            start_rss: rss.parse().unwrap_or(0),
            configured_rss: configured.parse().unwrap_or(0),
            child,
        })
    }
    fn pid(&self) -> u32 {
        self.child.id()
    }
    fn mem(&self) -> Result<Mem> {
        Mem::read(&self.pid().to_string())
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        for _ in 0..50 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Bytes of the secret parts of a credential (what an entry stores).
fn credential_bytes(c: &Credential) -> usize {
    match (c.bearer(), c.aws()) {
        (Some(t), _) => t.token.expose_secret().len(),
        (None, Some(a)) => {
            a.access_key_id.len()
                + a.secret_access_key.expose_secret().len()
                + a.session_token.expose_secret().len()
        }
        (None, None) => 0,
    }
}

fn rss(args: &Args) -> Result<Value> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let clouds = args.cloud.clouds();
        let idents = identities(args.count, &clouds);
        let up = upstreams(&idents, lifetimes(args, false), args.upstream_latency_ms).await?;
        eprintln!(
            "identities: rss: minting {} projected tokens ...",
            idents.len()
        );
        let pods: Vec<(PodIdentity, Cloud)> = idents
            .iter()
            .map(|i| (pod_of(i, 0, &uuid::Uuid::new_v4().to_string()), i.cloud))
            .collect();
        let issuer = up.issuer.clone();
        let tokens = tokio::task::spawn_blocking(move || mint_all(&issuer, &pods)).await??;

        let mut child_args = vec![
            "--count".to_string(),
            args.count.to_string(),
            "--cloud".into(),
            args.cloud.name().into(),
            "--issuer-url".into(),
            up.urls.issuer.clone(),
            "--entra-url".into(),
            up.urls.entra.clone(),
            "--gcp-url".into(),
            up.urls.gcp.clone(),
            "--aws-url".into(),
            up.urls.aws.clone(),
        ];
        if let Some(l) = args.lifetime_secs {
            child_args.extend(["--lifetime-secs".to_string(), l.to_string()]);
        }
        // Blocking until it serves; the emulators it fetches keys from
        // keep running on the other tasks.
        let agent = tokio::task::spawn_blocking(move || AgentProcess::spawn(child_args)).await??;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let ready = agent.mem()?;
        let cpu_ready = cpu_seconds(agent.pid())?;
        eprintln!(
            "identities: rss: agent ready with {} bindings, VmRSS {} KiB; filling its cache, {} at a time ...",
            idents.len(),
            ready.rss,
            args.concurrency
        );

        // Fill: one credential per ServiceAccount, through the agent API.
        up.calls.restart(Instant::now());
        let started = Instant::now();
        let remote = Arc::new(RemoteBroker::new(&agent.url).expect("a client of the agent"));
        let results: Vec<(Cloud, f64, Result<usize, String>)> =
            futures::stream::iter(idents.iter().zip(tokens.iter()))
                .map(|(ident, token)| {
                    let remote = remote.clone();
                    let request = ident.request();
                    let token = token.clone();
                    let cloud = ident.cloud;
                    async move {
                        let t = Instant::now();
                        let r = remote.request(&token, &request).await;
                        let ms = t.elapsed().as_secs_f64() * 1e3;
                        let r = match r {
                            Ok(grant) => grant
                                .credential
                                .map(|c| credential_bytes(&c))
                                .ok_or_else(|| "a grant without a credential".to_string()),
                            Err(e) => Err(e.to_string()),
                        };
                        (cloud, ms, r)
                    }
                })
                .buffer_unordered(args.concurrency as usize)
                .collect()
                .await;
        let fill_secs = started.elapsed().as_secs_f64();
        drop(remote); // closes the pooled connections to the agent
        drop(tokens);
        tokio::time::sleep(Duration::from_secs(2)).await;
        let filled = agent.mem()?;
        let cpu_filled = cpu_seconds(agent.pid())?;

        let metrics_text = reqwest::Client::new()
            .get(format!("{}/metrics", agent.url))
            .send()
            .await?
            .text()
            .await?;
        let entries = metric(&metrics_text, "lanyard_cache_entries ") as u64;
        let evictions = metric(&metrics_text, "lanyard_cache_evictions_total") as u64;
        let agent_upstream = PerCloud::from_fn(|c| {
            metric(
                &metrics_text,
                &format!("lanyard_upstream_requests_total{{cloud=\"{}\"", c.name()),
            ) as u64
        });
        let (start_rss, configured_rss) = (agent.start_rss, agent.configured_rss);
        // Stopping it waits (briefly) for the process to exit.
        tokio::task::spawn_blocking(move || drop(agent)).await?;

        let ledger = up.ledger_totals();
        let principals = up.ledger_principals();
        let ok = results.iter().filter(|r| r.2.is_ok()).count();
        let mut errors: BTreeMap<String, usize> = BTreeMap::new();
        for (_, _, r) in &results {
            if let Err(e) = r {
                *errors.entry(e.chars().take(160).collect()).or_default() += 1;
            }
        }
        let mut lat: Vec<f64> = results.iter().map(|r| r.1).collect();
        lat.sort_by(f64::total_cmp);
        let cred_mean = |cloud: Cloud| {
            let v: Vec<usize> = results
                .iter()
                .filter(|r| r.0 == cloud)
                .filter_map(|r| r.2.as_ref().ok().copied())
                .collect();
            if v.is_empty() {
                0.0
            } else {
                round(v.iter().sum::<usize>() as f64 / v.len() as f64, 1)
            }
        };
        let delta_bytes = (filled.rss as i64 - ready.rss as i64) * 1024;
        let delta_anon_bytes = (filled.anon as i64 - ready.anon as i64) * 1024;
        let per_entry = |d: i64| {
            if entries == 0 {
                Value::Null
            } else {
                json!(round(d as f64 / entries as f64, 0))
            }
        };
        let rates = lanyard::cache::CacheConfig::default().rates;
        let fill_max =
            |cloud: Cloud| up.calls.per_second(cloud).into_iter().max().unwrap_or(0);
        let out = json!({
            "mode": "identities_rss",
            "count": args.count,
            "cloud": args.cloud.name(),
            "concurrency": args.concurrency,
            "upstream_latency_ms": args.upstream_latency_ms,
            "identities": per_cloud_json(&clouds, |c| idents.iter().filter(|i| i.cloud == c).count()),
            "agent": {
                "start": {"vm_rss_kib": start_rss},
                "configured": {"vm_rss_kib": configured_rss},
                "ready": ready.json(),
                "filled": filled.json(),
                "cpu_seconds_fill": round(cpu_filled - cpu_ready, 2),
            },
            "rss_delta_bytes": delta_bytes,
            "rss_anon_delta_bytes": delta_anon_bytes,
            "bytes_per_entry": per_entry(delta_bytes),
            "anon_bytes_per_entry": per_entry(delta_anon_bytes),
            "cache_entries": entries,
            "cache_evictions": evictions,
            "requests": results.len(),
            "ok": ok,
            "errors": results.len() - ok,
            "error_kinds": errors,
            "upstream_exchanges": per_cloud_json(&clouds, |c| ledger[c]),
            "upstream_exchanges_total": ledger.iter().map(|(_, v)| *v).sum::<u64>(),
            "distinct_principals": per_cloud_json(&clouds, |c| principals[c]),
            "agent_upstream_requests": per_cloud_json(&clouds, |c| agent_upstream[c]),
            "credential_bytes_mean": per_cloud_json(&clouds, cred_mean),
            "fill_seconds": round(fill_secs, 2),
            "fill_latency_ms": {"p50": round(percentile(&lat, 50.0), 1), "p99": round(percentile(&lat, 99.0), 1), "max": round(lat.last().copied().unwrap_or(0.0), 1)},
            "fill_max_calls_per_second": per_cloud_json(&clouds, fill_max),
            "rate_limit_per_second": per_cloud_json(&clouds, |c| rates[c]),
        });
        Ok::<Value, anyhow::Error>(out)
    })
}

// ---------------------------------------------------------------------------
// spread: refresh-ahead over simulated hours.

/// Cumulative counters at one whole simulated second.
#[derive(Clone, Copy, Default)]
struct Snapshot {
    refreshes: [u64; 3],
    misses: [u64; 3],
}

impl Snapshot {
    fn take(metrics: &Metrics) -> Snapshot {
        let c = Counters(metrics);
        Snapshot {
            refreshes: Cloud::ALL.map(|cloud| c.refreshes(cloud)),
            misses: Cloud::ALL.map(|cloud| c.misses(cloud)),
        }
    }
}

/// Records a snapshot at each whole second from `origin` until `end`.
fn spawn_sampler(
    metrics: Arc<Metrics>,
    origin: Instant,
    end: Instant,
) -> tokio::task::JoinHandle<Vec<Snapshot>> {
    tokio::spawn(async move {
        let mut out = vec![Snapshot::take(&metrics)];
        let mut second = 1u64;
        loop {
            let at = origin + Duration::from_secs(second);
            if at > end {
                return out;
            }
            tokio::time::sleep_until(at).await;
            out.push(Snapshot::take(&metrics));
            second += 1;
        }
    })
}

/// What the pods saw.
#[derive(Default)]
struct PodTally {
    requests: AtomicU64,
    served_once: [AtomicUsize; 3],
    /// Per cloud, when the last pod got its first credential (ms).
    first_served_ms: [AtomicU64; 3],
    errors: Mutex<BTreeMap<String, u64>>,
}

impl PodTally {
    fn error(&self, e: &lanyard::broker::BrokerError) {
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        *errors
            .entry(e.to_string().chars().take(160).collect())
            .or_default() += 1;
    }
    fn errors(&self) -> BTreeMap<String, u64> {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn spread(args: &Args) -> Result<Value> {
    let wall = std::time::Instant::now();
    let runtime = paused_runtime()?;
    runtime.block_on(async {
        let clouds = args.cloud.clouds();
        let idents = identities(args.count, &clouds);
        let life = lifetimes(args, false);
        let up = upstreams(&idents, life, args.upstream_latency_ms).await?;
        eprintln!(
            "identities: spread: minting {} projected tokens ...",
            idents.len()
        );
        let pods: Vec<(PodIdentity, Cloud)> = idents
            .iter()
            .map(|i| (pod_of(i, 0, &uuid::Uuid::new_v4().to_string()), i.cloud))
            .collect();
        let tokens = mint_all(&up.issuer, &pods)?;
        let accounts = idents.iter().map(Ident::entry).collect();
        let config = agent_config(&up.urls, accounts, life[Cloud::Aws]);
        let limits = config.cache.to_cache_config().rates;
        let (broker, metrics) = agent_broker(&config).await?;
        drop(config);
        eprintln!(
            "identities: spread: {} pods, {:.1} simulated hours, each asking every {} s ...",
            idents.len(),
            args.hours,
            args.ask_every_secs
        );

        let origin = Instant::now();
        let end = origin + Duration::from_secs_f64(args.hours * 3600.0);
        up.calls.restart(origin);
        let peaks = spawn_pacer(metrics.clone(), end);
        let sampler = spawn_sampler(metrics.clone(), origin, end);
        let tally = Arc::new(PodTally::default());
        let ask_every = Duration::from_secs(args.ask_every_secs.max(1));
        let mut rng = Rng(args.seed);
        let mut handles = Vec::with_capacity(idents.len());
        for (ident, token) in idents.iter().zip(tokens) {
            let phase = rng.unit() * args.start_spread_secs as f64;
            let (broker, tally) = (broker.clone(), tally.clone());
            let (request, cloud) = (ident.request(), ident.cloud);
            handles.push(tokio::spawn(async move {
                let mut next = origin + Duration::from_secs_f64(phase);
                let mut served = false;
                while next < end {
                    tokio::time::sleep_until(next).await;
                    let result = broker.request(&token, &request).await;
                    tally.requests.fetch_add(1, Ordering::Relaxed);
                    match result {
                        Ok(_) if !served => {
                            served = true;
                            let ms = origin.elapsed().as_millis() as u64;
                            tally.served_once[cloud as usize].fetch_add(1, Ordering::Relaxed);
                            tally.first_served_ms[cloud as usize].fetch_max(ms, Ordering::Relaxed);
                        }
                        Ok(_) => {}
                        Err(e) => tally.error(&e),
                    }
                    next += ask_every;
                }
            }));
        }
        for h in handles {
            h.await?;
        }
        let samples = sampler.await?;
        let c = Counters(&metrics);
        let per_cloud = per_cloud_json(&clouds, |cloud| {
            let k = cloud as usize;
            let calls = up.calls.per_second(cloud);
            let fill_end_ms = tally.first_served_ms[k].load(Ordering::Relaxed);
            // The first whole second after the last pod's first credential.
            let fill_end = (fill_end_ms as usize).div_ceil(1000).min(samples.len() - 1);
            let max_in = |range: std::ops::Range<usize>| {
                calls
                    .get(range.start.min(calls.len())..range.end.min(calls.len()))
                    .and_then(|s| s.iter().max().copied())
                    .unwrap_or(0)
            };
            let due: Vec<u64> = samples
                .windows(2)
                .map(|w| w[1].refreshes[k] - w[0].refreshes[k])
                .collect();
            let peaks = peaks.lock().unwrap_or_else(|p| p.into_inner());
            let queued_max = |range: std::ops::Range<usize>| {
                peaks
                    .get(range.start.min(peaks.len())..range.end.min(peaks.len()))
                    .and_then(|s| s.iter().map(|p| p[k]).max())
                    .unwrap_or(0)
            };
            let last = samples.last().copied().unwrap_or_default();
            let per_minute: Vec<u32> = calls.chunks(60).map(|m| m.iter().sum()).collect();
            json!({
                "identities": idents.iter().filter(|i| i.cloud == cloud).count(),
                "served": tally.served_once[k].load(Ordering::Relaxed),
                "lifetime_seconds": life[cloud],
                "rate_limit_per_second": limits[cloud],
                "fill_seconds": round(fill_end_ms as f64 / 1000.0, 1),
                "upstream_calls": calls.iter().map(|v| u64::from(*v)).sum::<u64>(),
                "refreshes": c.refreshes(cloud),
                "max_calls_per_second": max_in(0..usize::MAX),
                "max_calls_per_second_fill": max_in(0..fill_end),
                "max_calls_per_second_after_fill": max_in(fill_end..usize::MAX),
                "max_refreshes_due_per_second": due.iter().max().copied().unwrap_or(0),
                "max_queued_exchanges_fill": queued_max(0..fill_end),
                "max_queued_exchanges_after_fill": queued_max(fill_end..usize::MAX),
                "misses_after_fill": last.misses[k] - samples[fill_end].misses[k],
                "hits": c.hits(cloud),
                "misses": c.misses(cloud),
                "coalesced": c.coalesced(cloud),
                "calls_per_minute": per_minute,
            })
        });
        let errors = tally.errors();
        Ok(json!({
            "mode": "identities_spread",
            "clock": "simulated (paused tokio clock)",
            "count": args.count,
            "cloud": args.cloud.name(),
            "hours": args.hours,
            "ask_every_seconds": args.ask_every_secs,
            "start_spread_seconds": args.start_spread_secs,
            "upstream_latency_ms": args.upstream_latency_ms,
            "requests": tally.requests.load(Ordering::Relaxed),
            "errors": errors.values().sum::<u64>(),
            "error_kinds": errors,
            "cache_entries": broker.cache().len(),
            "per_cloud": per_cloud,
            "wall_seconds": round(wall.elapsed().as_secs_f64(), 1),
        }))
    })
}

// ---------------------------------------------------------------------------
// economy: N pods of one identity.

/// How the product schedules a credential of `lifetime`: the mean and the
/// shortest of its refresh-ahead delays (from `lanyard::cache::refresh_at`,
/// which adds random jitter), and whether a refresh comes before the
/// cached credential stops being served.
fn refresh_schedule(cloud: Cloud, lifetime: Duration) -> (f64, f64, &'static str) {
    let t0 = Instant::now();
    let samples: Vec<f64> = (0..1000)
        .filter_map(|_| {
            lanyard::cache::refresh_at(cloud, t0, t0 + lifetime)
                .map(|at| at.duration_since(t0).as_secs_f64())
        })
        .collect();
    // No samples (not refreshed ahead): NaN, which the JSON shows as null.
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    let min = samples.iter().copied().fold(f64::INFINITY, f64::min);
    let min_remaining = cloud.min_remaining();
    let regime = if lifetime <= min_remaining {
        "never served from the cache (lifetime <= the cloud's minimum remaining)"
    } else if samples.is_empty() {
        "not refreshed ahead (served from the cache for under lanyard::cache::MIN_REFRESH_AHEAD)"
    } else if Duration::from_secs_f64(mean) > lifetime - min_remaining {
        "refresh due after the cached credential stops being served"
    } else {
        "refreshed ahead"
    };
    (mean, min, regime)
}

/// Most of `times` (sorted) within any window shorter than `window`.
fn max_in_window(times: &[f64], window: f64) -> usize {
    let mut best = 0;
    let mut lo = 0;
    for hi in 0..times.len() {
        while times[hi] - times[lo] >= window {
            lo += 1;
        }
        best = best.max(hi - lo + 1);
    }
    best
}

async fn economy_run(args: &Args, pods_per: u32, clouds: &[Cloud]) -> Result<Value> {
    let life = lifetimes(args, true);
    let idents: Vec<Ident> = clouds
        .iter()
        .enumerate()
        .map(|(k, cloud)| Ident {
            index: k as u32,
            cloud: *cloud,
            namespace: "economy".into(),
            name: format!("app-{}", cloud.name()),
        })
        .collect();
    let up = upstreams(&idents, life, args.upstream_latency_ms).await?;
    let mut pods = Vec::new();
    for ident in &idents {
        let sa_uid = uuid::Uuid::new_v4().to_string();
        for p in 0..pods_per {
            pods.push((pod_of(ident, p, &sa_uid), ident.cloud));
        }
    }
    let tokens = mint_all(&up.issuer, &pods)?;
    let mut config = agent_config(
        &up.urls,
        idents.iter().map(Ident::entry).collect(),
        life[Cloud::Aws],
    );
    config.cache.scope = match args.scope {
        ScopeArg::Serviceaccount => CacheScope::ServiceAccount,
        ScopeArg::Pod => CacheScope::Pod,
    };
    let (broker, metrics) = agent_broker(&config).await?;

    let origin = Instant::now();
    let simulated = Duration::from_secs_f64(args.economy_hours * 3600.0);
    let end = origin + simulated;
    up.calls.restart(origin);
    let _ = spawn_pacer(metrics.clone(), end);
    let tally = Arc::new(PodTally::default());
    let distinct: Arc<Mutex<[std::collections::HashSet<String>; 3]>> = Default::default();
    let ask_every = Duration::from_millis(args.ask_every_ms);
    let mut rng = Rng(args.seed ^ u64::from(pods_per));
    let mut handles = Vec::with_capacity(pods.len());
    for ((_, cloud), token) in pods.iter().zip(tokens) {
        let phase = ask_every.mul_f64(rng.unit());
        let (broker, tally, distinct) = (broker.clone(), tally.clone(), distinct.clone());
        let (request, cloud) = (request_for(*cloud), *cloud);
        handles.push(tokio::spawn(async move {
            let mut next = origin + phase;
            let mut last: Option<Arc<Credential>> = None;
            while next < end {
                tokio::time::sleep_until(next).await;
                let result = broker.request(&token, &request).await;
                tally.requests.fetch_add(1, Ordering::Relaxed);
                match result {
                    Ok(grant) => {
                        if let Some(c) = grant.credential {
                            if !last.as_ref().is_some_and(|l| Arc::ptr_eq(l, &c)) {
                                distinct.lock().unwrap_or_else(|p| p.into_inner())[cloud as usize]
                                    .insert(c.fingerprint());
                                last = Some(c);
                            }
                        }
                    }
                    Err(e) => tally.error(&e),
                }
                next += ask_every;
            }
        }));
    }
    for h in handles {
        h.await?;
    }
    let c = Counters(&metrics);
    let ledger = up.ledger_totals();
    let distinct = distinct.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let errors = tally.errors();
    let per_cloud = per_cloud_json(clouds, |cloud| {
        let lifetime = Duration::from_secs(life[cloud]);
        let (period, shortest, regime) = refresh_schedule(cloud, lifetime);
        let times = up.calls.times(cloud);
        let exchanges = times.len();
        let refreshed_ahead = regime == "refreshed ahead";
        let periods = (simulated.as_secs_f64() / period).ceil();
        let gaps: Vec<f64> = times.windows(2).map(|w| w[1] - w[0]).collect();
        json!({
            "pods": pods_per,
            "lifetime_seconds": life[cloud],
            "regime": regime,
            "refresh_period_seconds": round(period, 1),
            "periods": periods,
            "exchanges": exchanges,
            "ledger_exchanges": ledger[cloud],
            "exchanges_per_period": if refreshed_ahead { json!(round(exchanges as f64 / periods, 3)) } else { Value::Null },
            "max_exchanges_in_any_period": if refreshed_ahead { json!(max_in_window(&times, 0.9 * shortest)) } else { Value::Null },
            "exchanges_per_hour": round(exchanges as f64 * 3600.0 / simulated.as_secs_f64(), 1),
            "min_gap_seconds": round(gaps.iter().copied().fold(f64::INFINITY, f64::min).min(1e9), 3),
            "distinct_credentials": distinct[cloud as usize].len(),
            "hits": c.hits(cloud),
            "misses": c.misses(cloud),
            "coalesced": c.coalesced(cloud),
            "refreshes": c.refreshes(cloud),
        })
    });
    Ok(json!({
        "pods": pods_per,
        "requests": tally.requests.load(Ordering::Relaxed),
        "errors": errors.values().sum::<u64>(),
        "error_kinds": errors,
        "cache_entries": broker.cache().len(),
        "per_cloud": per_cloud,
    }))
}

fn economy(args: &Args) -> Result<Value> {
    let clouds = args.cloud.clouds();
    let mut runs = Vec::new();
    for &n in &args.pods {
        let wall = std::time::Instant::now();
        eprintln!(
            "identities: economy: {n} pod(s) per identity ({}), {:.2} simulated hours ...",
            args.cloud.name(),
            args.economy_hours
        );
        let mut run = paused_runtime()?.block_on(economy_run(args, n, &clouds))?;
        run["wall_seconds"] = json!(round(wall.elapsed().as_secs_f64(), 1));
        for cloud in &clouds {
            let r = &run["per_cloud"][cloud.name()];
            eprintln!(
                "identities: economy:   {:5} {n:>5} pods: {} exchanges in {:.2} h ({} per refresh period, max {} in one), {} requests, {} errors",
                cloud.name(),
                r["exchanges"],
                args.economy_hours,
                r["exchanges_per_period"],
                r["max_exchanges_in_any_period"],
                run["requests"],
                run["errors"],
            );
        }
        runs.push(run);
    }
    let life = lifetimes(args, true);
    Ok(json!({
        "mode": "economy",
        "clock": "simulated (paused tokio clock)",
        "cloud": args.cloud.name(),
        "scope": match args.scope { ScopeArg::Serviceaccount => "serviceaccount", ScopeArg::Pod => "pod" },
        "hours": args.economy_hours,
        "ask_every_ms": args.ask_every_ms,
        "upstream_latency_ms": args.upstream_latency_ms,
        "lifetime_seconds": per_cloud_json(&clouds, |c| life[c]),
        "runs": runs,
    }))
}

// ---------------------------------------------------------------------------

fn summarize_rss(v: &Value) {
    let mib = |kib: &Value| kib.as_f64().unwrap_or(0.0) / 1024.0;
    eprintln!(
        "identities: rss: {} ServiceAccounts ({}): agent VmRSS {:.1} MiB at start, {:.1} MiB ready, {:.1} MiB with {} cached credentials (RssAnon {:.1} MiB); {} bytes per entry ({} anonymous); {} upstream exchanges, {} ok, {} errors; fill {} s, max calls/s {}",
        v["count"],
        v["cloud"],
        mib(&v["agent"]["start"]["vm_rss_kib"]),
        mib(&v["agent"]["ready"]["vm_rss_kib"]),
        mib(&v["agent"]["filled"]["vm_rss_kib"]),
        v["cache_entries"],
        mib(&v["agent"]["filled"]["rss_anon_kib"]),
        v["bytes_per_entry"],
        v["anon_bytes_per_entry"],
        v["upstream_exchanges_total"],
        v["ok"],
        v["errors"],
        v["fill_seconds"],
        v["fill_max_calls_per_second"],
    );
}

fn summarize_spread(v: &Value) {
    eprintln!(
        "identities: spread: {} requests, {} errors, {} entries at the end ({} s wall)",
        v["requests"], v["errors"], v["cache_entries"], v["wall_seconds"]
    );
    if let Some(per) = v["per_cloud"].as_object() {
        for (cloud, r) in per {
            eprintln!(
                "identities: spread:   {cloud:5}: limit {}/s; max calls/s {} (fill {}, after {}); refreshes {} (max due {}/s); misses after fill {}; fill {} s",
                r["rate_limit_per_second"],
                r["max_calls_per_second"],
                r["max_calls_per_second_fill"],
                r["max_calls_per_second_after_fill"],
                r["refreshes"],
                r["max_refreshes_due_per_second"],
                r["misses_after_fill"],
                r["fill_seconds"],
            );
        }
    }
}

/// Victims asked alone, and as many during the flood.
const VICTIMS: u32 = 10;

/// A victim's first request (a cache miss): its latency in ms and outcome.
async fn first_request(broker: &Broker, token: &SecretString) -> (f64, &'static str) {
    let started = std::time::Instant::now();
    let result = broker.request(token, &request_for(Cloud::Azure)).await;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    (ms, result.as_ref().map_or_else(|e| e.reason(), |_| "ok"))
}

async fn neighbour_run(args: &Args) -> Result<Value> {
    let life = lifetimes(args, false);
    // Ident 0 floods; 1..=VICTIMS ask alone, the next VICTIMS during it.
    let idents: Vec<Ident> = (0..=2 * VICTIMS)
        .map(|index| Ident {
            index,
            cloud: Cloud::Azure,
            namespace: "neighbours".into(),
            name: if index == 0 {
                "flood".into()
            } else {
                format!("victim-{index}")
            },
        })
        .collect();
    let up = upstreams(&idents, life, args.upstream_latency_ms).await?;
    let pods: Vec<(PodIdentity, Cloud)> = idents
        .iter()
        .map(|i| {
            (
                pod_of(i, 0, &uuid::Uuid::new_v4().to_string()),
                Cloud::Azure,
            )
        })
        .collect();
    let tokens = mint_all(&up.issuer, &pods)?;
    let config = agent_config(
        &up.urls,
        idents.iter().map(Ident::entry).collect(),
        life[Cloud::Aws],
    );
    let (broker, _metrics) = agent_broker(&config).await?;

    let mut alone = Vec::new();
    for token in &tokens[1..=VICTIMS as usize] {
        alone.push(first_request(&broker, token).await);
    }
    // The flood: every request for a resource never asked before.
    let flood_started = std::time::Instant::now();
    let mut flood = Vec::with_capacity(args.flood as usize);
    for i in 0..args.flood {
        let (broker, token) = (broker.clone(), tokens[0].clone());
        flood.push(tokio::spawn(async move {
            let mut request = request_for(Cloud::Azure);
            request.scopes = vec![format!("https://flood-{i}.example.test/")];
            let result = broker.request(&token, &request).await;
            result.as_ref().map_or_else(|e| e.reason(), |_| "ok")
        }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut during = Vec::new();
    for token in &tokens[VICTIMS as usize + 1..] {
        during.push(first_request(&broker, token).await);
    }
    let victims_done = flood_started.elapsed().as_secs_f64();
    let mut flood_outcomes: BTreeMap<&'static str, u64> = BTreeMap::new();
    for h in flood {
        *flood_outcomes.entry(h.await?).or_default() += 1;
    }
    let flood_seconds = flood_started.elapsed().as_secs_f64();
    let summary = |v: &[(f64, &'static str)]| {
        let mut ms: Vec<f64> = v.iter().map(|(ms, _)| *ms).collect();
        ms.sort_by(f64::total_cmp);
        let mut outcomes: BTreeMap<&'static str, u64> = BTreeMap::new();
        for (_, o) in v {
            *outcomes.entry(o).or_default() += 1;
        }
        json!({
            "p50_ms": round(percentile(&ms, 50.0), 1),
            "max_ms": round(ms.last().copied().unwrap_or(0.0), 1),
            "outcomes": outcomes,
        })
    };
    let (a, d) = (summary(&alone), summary(&during));
    let ratio =
        d["max_ms"].as_f64().unwrap_or(0.0) / a["max_ms"].as_f64().unwrap_or(1.0).max(0.001);
    Ok(json!({
        "mode": "neighbour",
        "upstream_latency_ms": args.upstream_latency_ms,
        "flood_requests": args.flood,
        "flood_outcomes": flood_outcomes,
        "flood_seconds": round(flood_seconds, 2),
        "victims_done_after_seconds": round(victims_done, 3),
        "victims_alone": a,
        "victims_during_flood": d,
        "victim_max_during_over_alone": round(ratio, 2),
        "upstream_exchanges": up.ledger_totals()[Cloud::Azure],
    }))
}

fn neighbour(args: &Args) -> Result<Value> {
    eprintln!(
        "identities: neighbour: {} victims alone, then a flood of {} new keys from one ServiceAccount and {} more victims ...",
        VICTIMS, args.flood, VICTIMS
    );
    let v = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(neighbour_run(args))?;
    eprintln!(
        "identities: neighbour: victims' first request alone p50 {} / max {} ms, during the flood p50 {} / max {} ms ({}x); flood {}",
        v["victims_alone"]["p50_ms"],
        v["victims_alone"]["max_ms"],
        v["victims_during_flood"]["p50_ms"],
        v["victims_during_flood"]["max_ms"],
        v["victim_max_during_over_alone"],
        v["flood_outcomes"]
    );
    Ok(v)
}

fn run(args: &Args) -> Result<()> {
    if args.neighbour {
        let v = neighbour(args)?;
        println!("{v}");
        return Ok(());
    }
    if args.economy {
        let v = economy(args)?;
        println!("{v}");
        return Ok(());
    }
    if args.only != Some(Only::Spread) {
        let v = rss(args)?;
        summarize_rss(&v);
        println!("{v}");
    }
    if args.only != Some(Only::Rss) {
        let v = spread(args)?;
        summarize_spread(&v);
        println!("{v}");
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = if args.agent_child {
        agent_child(&args)
    } else {
        run(&args)
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("identities: {e:#}");
            ExitCode::FAILURE
        }
    }
}
