//! `lanyard dev`: the whole system in one process on loopback. The built-in
//! issuer stands in for kube-apiserver, the emulators for the clouds, and a
//! minted projected token for the kubelet's; the broker and the surfaces
//! are the same code the agent and sidecar run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::broker::assemble::{self, Parts};
use crate::cloud::{aws, azure, gcp, Bindings, Cloud};
use crate::config::{Config, DEV_GCP_PROJECT_ID, DEV_GCP_PROJECT_NUMBER, DEV_GCP_PROVIDER};
use crate::directory::file::{ServiceAccountEntry, StaticDirectory};
use crate::http::{
    bind, drain, per_thread, spawn_server, wait_for_signal, Shutdown, ShutdownTrigger,
    DRAIN_TIMEOUT,
};
use crate::secret::{random_token, SecretString};
use crate::serve::container_token::ContainerToken;
use crate::serve::sdk_env::SdkEnv;
use crate::serve::token_shelf::TokenShelf;
use crate::serve::{self, SubjectTokens, Surfaces};
use crate::telemetry::Readiness;
use crate::token::{KeySet, KeySource, Verifier};
use lanyard_emulators::aws::AwsSts;
use lanyard_emulators::entra::Entra;
use lanyard_emulators::gcp::Gcp;
use lanyard_emulators::{
    Binding, CloudsConfig, EmulatorSet, Issuer, Lifetimes, PodIdentity, SigningKey,
};

/// Projected tokens for the dev pod, minted by the built-in issuer and
/// re-minted at 80% of their lifetime, as the kubelet rotates them.
pub struct MintedTokens {
    issuer: Arc<Issuer>,
    pod: PodIdentity,
    lifetime: Duration,
    audiences: Vec<(Cloud, String)>,
    shelf: TokenShelf,
}

impl MintedTokens {
    /// Tokens of `pod` minted by `issuer`, each valid for `lifetime`, one per
    /// cloud with the audience `audiences` gives it; asking for a cloud without
    /// one is an error.
    pub fn new(
        issuer: Arc<Issuer>,
        pod: PodIdentity,
        lifetime: Duration,
        audiences: Vec<(Cloud, String)>,
    ) -> Self {
        MintedTokens {
            issuer,
            pod,
            lifetime,
            audiences,
            shelf: TokenShelf::new(lifetime.mul_f64(0.8)),
        }
    }

    /// Mints `cloud`'s token afresh.
    fn mint(&self, cloud: Cloud) -> Result<SecretString, String> {
        let audience = self
            .audiences
            .iter()
            .find(|(c, _)| *c == cloud)
            .map(|(_, a)| a.as_str())
            .ok_or_else(|| format!("no projected token audience configured for {cloud}"))?;
        let token = self
            .issuer
            .mint(&self.pod, &[audience], self.lifetime)
            .map_err(|e| format!("minting the dev projected token failed: {e}"))?;
        Ok(SecretString::from(token))
    }
}

#[async_trait::async_trait]
impl SubjectTokens for MintedTokens {
    async fn token(&self, cloud: Cloud) -> Result<Arc<SecretString>, String> {
        self.shelf
            .get(cloud, || std::future::ready(self.mint(cloud)))
            .await
    }
}

/// A running dev stack.
pub struct DevStack {
    /// `NAME=VALUE` pairs an SDK needs to find Lanyard.
    pub exports: Vec<(String, String)>,
    /// Where the SDK-facing surfaces listen (loopback).
    pub surfaces_addr: SocketAddr,
    /// Where `/metrics`, `/healthz` and `/readyz` listen.
    pub admin_addr: SocketAddr,
    /// The built-in service-account issuer, for minting tokens of other pods.
    pub issuer: Arc<Issuer>,
    /// The dev pod's projected tokens (`azure`, `gcp`, `aws`, `app`), kept fresh.
    pub token_dir: std::path::PathBuf,
    /// Where each upstream is: the built-in issuer and the clouds' endpoints.
    pub upstreams: Vec<(String, String)>,
    /// `None` when an external authority host is configured.
    pub entra: Option<Arc<Entra>>,
    /// `None` when external Google endpoints are configured.
    pub gcp: Option<Arc<Gcp>>,
    /// `None` when an external STS endpoint is configured.
    pub aws: Option<Arc<AwsSts>>,
    /// Holds the AWS container authorization token file; removed on drop.
    _scratch: tempfile::TempDir,
    trigger: ShutdownTrigger,
    servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl DevStack {
    /// Starts issuer, emulators, broker and surfaces.
    pub async fn start(config: &Config) -> anyhow::Result<DevStack> {
        let (trigger, shutdown) = Shutdown::new();
        let dev = &config.dev;
        let http = crate::http::client();
        let mut servers = Vec::new();

        // Built-in issuer.
        let issuer_listener = bind(dev.emulator_listen, "built-in issuer").await?;
        let issuer_url = format!("http://{}", issuer_listener.local_addr()?);
        let issuer = Arc::new(Issuer::new(issuer_url, SigningKey::generate_rs256()?));
        servers.push(spawn_server(
            issuer_listener,
            issuer.router(),
            shutdown.clone(),
        ));

        let pod = PodIdentity::new(
            &dev.namespace,
            &dev.service_account,
            &dev.pod_name,
            &dev.node_name,
        );

        // Google: provider and project default to the emulated pool; a GKE
        // cluster's pool is emulated as configured.
        let gke = config.gcp.gke();
        let provider = config
            .gcp
            .workload_identity_provider
            .clone()
            .unwrap_or_else(|| DEV_GCP_PROVIDER.to_string());
        let gcp_audience = match &gke {
            Some(cluster) => cluster.pool(),
            None => config
                .gcp
                .audience
                .clone()
                .unwrap_or_else(|| provider.clone()),
        };
        let emulators =
            EmulatorSet::new(
                &CloudsConfig {
                    issuer: issuer.url().to_string(),
                    azure_tenant_id: dev.azure_tenant_id.clone(),
                    azure_audience: config.azure.audience.clone(),
                    gcp_provider: provider.clone(),
                    gcp_allowed_audiences: vec![gcp_audience.clone()],
                    gcp_gke: config.gcp.gke_cluster.clone().map(|cluster| {
                        lanyard_emulators::GkePool {
                            cluster,
                            project_number: config
                                .gcp
                                .project_number
                                .clone()
                                .unwrap_or_else(|| DEV_GCP_PROJECT_NUMBER.to_string()),
                        }
                    }),
                    aws_audience: config.aws.audience.clone(),
                    lifetimes: Lifetimes::all(Duration::from_secs(dev.token_lifetime)),
                    bindings: dev_bindings(dev, &pod.subject()),
                    azure_node_identities: node_identities(config),
                    azure_identity_binding: config.azure.identity_binding_sni.is_some()
                        && config.azure.authority_host.is_none(),
                },
                http.clone(),
            )?;
        // Each cloud is its emulator unless an endpoint is configured.
        let (authority_host, entra) = match &config.azure.authority_host {
            Some(host) => (host.clone(), None),
            None => {
                let listener = bind(dev.emulator_listen, "Entra ID emulator").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let entra = emulators.entra.clone();
                servers.push(spawn_server(listener, entra.router(), shutdown.clone()));
                (url, Some(entra))
            }
        };
        let (sts_endpoint, iam_endpoint, gcp) = match (
            &config.gcp.sts_endpoint,
            &config.gcp.iamcredentials_endpoint,
        ) {
            (Some(sts), Some(iam)) => (sts.clone(), iam.clone(), None),
            (sts, iam) => {
                let listener = bind(dev.emulator_listen, "Google emulator").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let gcp = emulators.gcp.clone();
                servers.push(spawn_server(listener, gcp.router(), shutdown.clone()));
                (
                    sts.clone().unwrap_or_else(|| url.clone()),
                    iam.clone().unwrap_or_else(|| url.clone()),
                    Some(gcp),
                )
            }
        };
        let (aws_endpoint, aws) = match &config.aws.sts_endpoint {
            Some(endpoint) => (endpoint.clone(), None),
            None => {
                let listener = bind(dev.emulator_listen, "AWS STS emulator").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let sts = emulators.aws.clone();
                servers.push(spawn_server(listener, sts.router(), shutdown.clone()));
                (url, Some(sts))
            }
        };

        // The cluster's AKS identity-binding proxy, on "the API server's
        // address" with a cluster CA of its own, when identity bindings are
        // configured and Entra is emulated; its identities' issuer
        // (ib.oic.prod-aks.azure.com) is served on loopback for Entra.
        let scratch = tempfile::Builder::new().prefix("lanyard-dev-").tempdir()?;
        let identity_binding = match (&config.azure.identity_binding_sni, &entra) {
            (Some(sni), Some(entra)) => {
                let proxy = Arc::new(lanyard_emulators::identity_binding::Proxy::new(
                    lanyard_emulators::identity_binding::ProxyConfig {
                        sni_name: sni.clone(),
                        cluster_issuer: issuer.url().to_string(),
                        entra: authority_host.clone(),
                        bindings: emulators.identity_bindings.clone(),
                    },
                    http.clone(),
                )?);
                let listener =
                    bind(dev.emulator_listen, "identity-binding issuer emulator").await?;
                entra.stand_in(
                    lanyard_emulators::identity_binding::ISSUER_ORIGIN,
                    &format!("http://{}", listener.local_addr()?),
                );
                servers.push(spawn_server(
                    listener,
                    proxy.issuer_router(),
                    shutdown.clone(),
                ));
                let pki = lanyard_emulators::pki::Pki::generate(
                    "lanyard dev cluster CA",
                    vec![sni.clone()],
                )?;
                let ca_file = scratch.path().join("cluster-ca.crt");
                std::fs::write(&ca_file, &pki.ca_pem)?;
                let (addr, server) = serve_tls(
                    dev.emulator_listen,
                    proxy.router(),
                    proxy.tls(&pki)?,
                    shutdown.clone(),
                )
                .await?;
                servers.push(server);
                Some((format!("https://{addr}"), ca_file))
            }
            _ => None,
        };

        // The node's IMDS, for the identities assigned to the node pool,
        // unless another IMDS is configured.
        let imds_endpoint = match config.azure.node_identities.is_empty()
            || config.azure.imds_endpoint != azure::DEFAULT_IMDS_ENDPOINT
        {
            true => config.azure.imds_endpoint.clone(),
            false => {
                let listener = bind(dev.emulator_listen, "node IMDS emulator").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let router = lanyard_emulators::imds::router(emulators.entra.clone());
                servers.push(spawn_server(listener, router, shutdown.clone()));
                url
            }
        };

        // The emulated services have trusted the built-in issuer all along:
        // its keys are not fetched on the first exchange, which the
        // emulated upstream latency already stands for.
        emulators.preload_keys().await.map_err(|e| {
            anyhow::anyhow!("an emulator cannot load the built-in issuer's keys: {e}")
        })?;

        // Directory: the dev ServiceAccount plus any configured ones.
        let dev_annotations: crate::cloud::Annotations = [
            (
                azure::annotations::CLIENT_ID.to_string(),
                dev.azure_client_id.clone(),
            ),
            (
                azure::annotations::TENANT_ID.to_string(),
                dev.azure_tenant_id.clone(),
            ),
            (
                gcp::annotations::SERVICE_ACCOUNT.to_string(),
                dev.gcp_service_account.clone(),
            ),
            (
                aws::annotations::ROLE_ARN.to_string(),
                dev.aws_role_arn.clone(),
            ),
        ]
        .into_iter()
        .chain(
            dev.aws_target_role_arn
                .iter()
                .map(|arn| (aws::annotations::TARGET_ROLE_ARN.to_string(), arn.clone())),
        )
        .chain(
            dev.aws_external_id
                .iter()
                .map(|id| (aws::annotations::EXTERNAL_ID.to_string(), id.clone())),
        )
        .chain(
            [
                (azure::annotations::APP_CLIENT_ID, &dev.azure_app_client_id),
                (azure::annotations::APP_TENANT_ID, &dev.azure_app_tenant_id),
            ]
            .into_iter()
            .filter_map(|(key, value)| Some((key.to_string(), value.clone()?))),
        )
        .chain(
            [
                (azure::annotations::CLIENT_IDS, &dev.azure_client_ids),
                (
                    gcp::annotations::SERVICE_ACCOUNTS,
                    &dev.gcp_service_accounts,
                ),
                (aws::annotations::ROLE_ARNS, &dev.aws_role_arns),
            ]
            .into_iter()
            .filter(|(_, listed)| !listed.is_empty())
            .map(|(key, listed)| (key.to_string(), listed.join(","))),
        )
        .collect();
        let mut entries = vec![ServiceAccountEntry {
            labels: Default::default(),
            namespace: dev.namespace.clone(),
            name: dev.service_account.clone(),
            annotations: dev_annotations.clone(),
        }];
        entries.extend(dev.service_accounts.iter().cloned());
        let directory = Arc::new(
            StaticDirectory::new(&entries)
                .with_namespaces(&config.cluster.namespaces)
                .with_pod(&dev.namespace, &dev.pod_name, &dev.pod_labels),
        );

        // Loaded before anything is served, as the agent does.
        let keys = KeySet::new(
            KeySource::Discovery {
                issuer: issuer.url().to_string(),
            },
            http.clone(),
        );
        keys.preload()
            .await
            .map_err(|e| anyhow::anyhow!("cannot load the built-in issuer's keys: {e}"))?;
        let verifier = Verifier::new(issuer.url(), keys);
        let upstreams = vec![
            ("issuer".to_string(), issuer.url().to_string()),
            ("azure".to_string(), authority_host.clone()),
            ("gcp-sts".to_string(), sts_endpoint.clone()),
            ("gcp-iamcredentials".to_string(), iam_endpoint.clone()),
            ("aws-sts".to_string(), aws_endpoint.clone()),
        ];
        // The broker is the agent's, configured for the emulators and the
        // dev identity: the same wiring, other endpoints.
        let mut wired = config.clone();
        wired.azure.authority_host = Some(authority_host);
        wired.azure.imds_endpoint = imds_endpoint;
        if let Some((proxy, ca_file)) = identity_binding {
            wired.azure.identity_binding_proxy = Some(proxy);
            wired.azure.identity_binding_ca_file = ca_file;
        }
        wired
            .azure
            .tenant_id
            .get_or_insert_with(|| dev.azure_tenant_id.clone());
        if gke.is_none() {
            wired.gcp.workload_identity_provider = Some(provider.clone());
        }
        wired.gcp.audience = Some(gcp_audience.clone());
        wired.gcp.sts_endpoint = Some(sts_endpoint);
        wired.gcp.iamcredentials_endpoint = Some(iam_endpoint);
        wired.gcp.project_id.get_or_insert_with(|| match &gke {
            Some(cluster) => cluster.project.clone(),
            None => DEV_GCP_PROJECT_ID.to_string(),
        });
        wired
            .gcp
            .project_number
            .get_or_insert_with(|| DEV_GCP_PROJECT_NUMBER.to_string());
        wired.gcp.token_lifetime = config.gcp.token_lifetime.min(dev.token_lifetime.max(300));
        wired.aws.sts_endpoint = Some(aws_endpoint.clone());
        wired.aws.session_duration = config.aws.session_duration.min(dev.token_lifetime.max(900));
        let parts = Parts::new(&wired, "dev", verifier, directory)?;
        let metrics = parts.metrics.clone();
        let broker = Arc::new(assemble::broker(&wired, parts, http.clone())?);
        let subjects = Arc::new(MintedTokens::new(
            issuer.clone(),
            pod,
            Duration::from_secs(dev.projected_token_lifetime),
            vec![
                (Cloud::Azure, config.azure.audience.clone()),
                (Cloud::Gcp, gcp_audience),
                (Cloud::Aws, config.aws.audience.clone()),
            ],
        ));
        // The app-facing token for AWS container credentials, in a file only
        // this user can read, as the kubelet would project it.
        let aws_token_file = scratch.path().join("aws-container-authorization-token");
        let app_token = random_token(32);
        write_private(&aws_token_file, &app_token)?;
        // The pod's projected token volume, as the kubelet keeps it, for
        // running a `lanyard sidecar` (or agent) against this dev stack.
        let token_dir = scratch.path().join("tokens");
        std::fs::create_dir(&token_dir)?;
        write_private(&token_dir.join("app"), &app_token)?;
        servers.push(spawn_token_writer(
            subjects.clone(),
            token_dir.clone(),
            Duration::from_secs(dev.projected_token_lifetime),
            shutdown.clone(),
        ));
        let identity_header = random_token(32);
        let surfaces = Arc::new(Surfaces::new(
            broker,
            subjects,
            SecretString::from(identity_header.clone()),
            Some(ContainerToken::new(aws_token_file.clone())),
            config.clouds().sdk_defaults(),
        ));
        let listeners =
            per_thread::bind(config.listen, "SDK surfaces", per_thread::default_threads()).await?;
        let surfaces_addr = listeners.local_addr();
        // The benchmarks' herds open 10,000 connections at once.
        servers.push(per_thread::spawn(
            listeners,
            serve::router(surfaces),
            shutdown.clone(),
            crate::http::Limits::api(65_536),
        ));

        let admin_listener = bind(config.admin_listen, "admin endpoints").await?;
        let admin_addr = admin_listener.local_addr()?;
        servers.push(spawn_server(
            admin_listener,
            // Ready at once: issuer, bindings and emulators are all in this
            // process and already serving.
            crate::telemetry::admin_router(metrics.clone(), Readiness::ready()),
            shutdown.clone(),
        ));

        let host_port = surfaces_addr.to_string();
        let aws_token_file = aws_token_file.display().to_string();
        let dev_bindings = Bindings::from_annotations(&dev_annotations);
        let defaults = wired.clouds().sdk_defaults();
        let exports = SdkEnv {
            host_port: &host_port,
            clouds: &Cloud::ALL,
            bindings: &dev_bindings,
            defaults: &defaults,
            identity_header: &identity_header,
            app_token_file: &aws_token_file,
        }
        .vars()
        .into_iter()
        .map(|(name, value)| (name.to_string(), value))
        .chain(
            // Dev only: what users type first to check an identity, `aws
            // sts get-caller-identity`, asks the dev STS emulator, which
            // knows the credentials it issued. A pod has no such variable.
            aws.as_ref()
                .map(|_| ("AWS_ENDPOINT_URL_STS".to_string(), aws_endpoint.clone())),
        )
        .collect();
        if dev.upstream_latency_ms > 0 {
            let latency = lanyard_emulators::faults::Fault::Latency {
                ms: dev.upstream_latency_ms,
            };
            let emulated = [
                entra.as_ref().map(|e| &e.faults),
                gcp.as_ref().map(|g| &g.faults),
                aws.as_ref().map(|a| &a.faults),
            ];
            for faults in emulated.into_iter().flatten() {
                faults.push(latency.clone(), None);
            }
        }
        Ok(DevStack {
            exports,
            surfaces_addr,
            admin_addr,
            issuer,
            token_dir,
            upstreams,
            entra,
            gcp,
            aws,
            _scratch: scratch,
            trigger,
            servers,
        })
    }

    /// Stops accepting, drains in-flight requests (bounded), and returns.
    pub async fn stop(self) {
        self.trigger.trigger();
        drain(self.servers, DRAIN_TIMEOUT).await;
    }
}

/// The last line `lanyard dev` prints on stdout once it serves.
pub const READY_LINE: &str = "# lanyard dev ready";

/// Runs `lanyard dev` in the foreground until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Before anything binds: a stop signal from now on is kept.
    crate::http::listen_for_signals();

    let stack = DevStack::start(&config).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for (name, value) in &stack.exports {
            writeln!(out, "export {name}={}", shell_quote(value))?;
        }
        // Shell comments, so `eval` ignores them; readers of stdout can stop
        // at the ready line.
        writeln!(out, "# lanyard admin http://{}", stack.admin_addr)?;
        writeln!(out, "# lanyard token-dir {}", stack.token_dir.display())?;
        for (name, url) in &stack.upstreams {
            writeln!(out, "# lanyard upstream {name} {url}")?;
        }
        writeln!(out, "{READY_LINE}")?;
        out.flush()?;
    }
    tracing::info!(
        surfaces = %stack.surfaces_addr,
        admin = %stack.admin_addr,
        issuer = stack.issuer.url(),
        namespace = %config.dev.namespace,
        service_account = %config.dev.service_account,
        "lanyard dev ready"
    );
    let _ = wait_for_signal().await;
    tracing::info!("shutting down");
    stack.stop().await;
    Ok(())
}

/// Keeps `dir/{azure,gcp,aws}` holding the dev pod's current projected
/// tokens, replacing each file atomically as the kubelet does.
fn spawn_token_writer(
    subjects: Arc<MintedTokens>,
    dir: std::path::PathBuf,
    lifetime: Duration,
    shutdown: Shutdown,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tokio::spawn(async move {
        let period = (lifetime / 10).clamp(Duration::from_secs(1), Duration::from_secs(60));
        let stop = shutdown.wait();
        tokio::pin!(stop);
        loop {
            for cloud in Cloud::ALL {
                match subjects.token(cloud).await {
                    Ok(token) => {
                        use secrecy::ExposeSecret;
                        let tmp = dir.join(format!(".{cloud}.tmp"));
                        let _ = std::fs::remove_file(&tmp);
                        if let Err(e) = write_private(&tmp, token.expose_secret())
                            .and_then(|()| Ok(std::fs::rename(&tmp, dir.join(cloud.to_string()))?))
                        {
                            tracing::warn!(error = %e, "cannot write the dev projected token");
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot mint the dev projected token"),
                }
            }
            tokio::select! {
                _ = &mut stop => return Ok(()),
                _ = tokio::time::sleep(period) => {}
            }
        }
    })
}

/// Writes `contents` to a new file readable only by this user.
fn write_private(path: &std::path::Path, contents: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut file = options
        .open(path)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", path.display()))?;
    file.write_all(contents.as_bytes())?;
    Ok(())
}

/// Quotes a value for POSIX shells when it holds anything but safe characters.
fn shell_quote(value: &str) -> String {
    let safe = value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"-_./:=@,+".contains(&b));
    if safe && !value.is_empty() {
        value.to_string()
    } else {
        format!("'{}'", value.replace('\'', r"'\''"))
    }
}

/// Serves `router` over TLS (`tls`) on a new listener at `addr`'s host
/// until `shutdown` fires: the address it listens on, and the server.
async fn serve_tls(
    addr: std::net::SocketAddr,
    router: axum::Router,
    tls: Arc<tokio_rustls::rustls::ServerConfig>,
    shutdown: crate::http::Shutdown,
) -> anyhow::Result<(
    std::net::SocketAddr,
    tokio::task::JoinHandle<std::io::Result<()>>,
)> {
    let listener = std::net::TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let local = listener.local_addr()?;
    let handle = axum_server::Handle::new();
    let server = axum_server::from_tcp_rustls(
        listener,
        axum_server::tls_rustls::RustlsConfig::from_config(tls),
    )?
    .handle(handle.clone());
    tokio::spawn(async move {
        shutdown.wait().await;
        handle.graceful_shutdown(Some(Duration::from_secs(5)));
    });
    let server = tokio::spawn(server.serve(router.into_make_service()));
    Ok((local, server))
}

/// The managed identities `azure.node_identities` lists, assigned to the
/// emulated node pool; the dev identity among them reaches the dev app
/// (`dev.azure_app_client_id`).
fn node_identities(config: &Config) -> Vec<lanyard_emulators::NodeIdentity> {
    let dev = &config.dev;
    config
        .azure
        .node_identities
        .iter()
        .map(|client_id| lanyard_emulators::NodeIdentity {
            client_id: client_id.clone(),
            app: dev
                .azure_app_client_id
                .as_ref()
                .filter(|_| client_id.eq_ignore_ascii_case(&dev.azure_client_id))
                .map(|app| lanyard_emulators::AzureApp {
                    client_id: app.clone(),
                    tenant_id: dev
                        .azure_app_tenant_id
                        .clone()
                        .unwrap_or_else(|| dev.azure_tenant_id.clone()),
                }),
        })
        .collect()
}

/// What the emulators trust the dev pod as: its identities, each listed
/// one of its own.
fn dev_bindings(dev: &crate::config::DevConfig, subject: &str) -> Vec<Binding> {
    let only = |azure: Option<&String>, gcp: Option<&String>, aws: Option<&String>| Binding {
        subject: subject.to_string(),
        azure_client_id: azure.cloned(),
        gcp_service_account: gcp.cloned(),
        aws_role_arn: aws.cloned(),
        aws_target: None,
        azure_app: None,
    };
    let first = Binding {
        aws_target: dev
            .aws_target_role_arn
            .as_ref()
            .map(|arn| lanyard_emulators::AwsTarget {
                role_arn: arn.clone(),
                external_id: dev.aws_external_id.clone(),
            }),
        azure_app: dev
            .azure_app_client_id
            .as_ref()
            .map(|client_id| lanyard_emulators::AzureApp {
                client_id: client_id.clone(),
                tenant_id: dev
                    .azure_app_tenant_id
                    .clone()
                    .unwrap_or_else(|| dev.azure_tenant_id.clone()),
            }),
        ..only(
            Some(&dev.azure_client_id),
            Some(&dev.gcp_service_account),
            Some(&dev.aws_role_arn),
        )
    };
    let azure = dev
        .azure_client_ids
        .iter()
        .map(|id| only(Some(id), None, None));
    let gcp = dev
        .gcp_service_accounts
        .iter()
        .map(|e| only(None, Some(e), None));
    let aws = dev
        .aws_role_arns
        .iter()
        .map(|arn| only(None, None, Some(arn)));
    std::iter::once(first)
        .chain(azure)
        .chain(gcp)
        .chain(aws)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    #[test]
    fn quoting() {
        assert_eq!(
            shell_quote("http://127.0.0.1:8642/msi/token"),
            "http://127.0.0.1:8642/msi/token"
        );
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
