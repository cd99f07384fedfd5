//! `lanyard dev`: the whole system in one process on loopback. The built-in
//! issuer stands in for kube-apiserver, the emulators for the clouds, and a
//! minted projected token for the kubelet's; the broker and the surfaces
//! are the same code the agent and sidecar run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;

use crate::broker::{AzureSettings, Broker};
use crate::cloud::azure::{authority_for_cloud, AzureExchanger};
use crate::cloud::Cloud;
use crate::config::Config;
use crate::directory::annotations;
use crate::directory::file::{ServiceAccountEntry, StaticDirectory};
use crate::emulator::entra::{App, Entra, FederatedCredential};
use crate::emulator::{Issuer, PodIdentity, SigningKey};
use crate::http::{bind, spawn_server, Shutdown, ShutdownTrigger};
use crate::secret::{random_token, SecretString};
use crate::serve::{self, SubjectTokens, Surfaces};
use crate::token::{KeySet, KeySource, Verifier};

/// Projected tokens for the dev pod, minted by the built-in issuer and
/// re-minted at 80% of their lifetime, as the kubelet rotates them.
pub struct MintedTokens {
    issuer: Arc<Issuer>,
    pod: PodIdentity,
    lifetime: Duration,
    audiences: Vec<(Cloud, String)>,
    current: Mutex<Vec<(Cloud, SecretString, Instant)>>,
}

impl MintedTokens {
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
            current: Mutex::new(Vec::new()),
        }
    }
}

#[async_trait::async_trait]
impl SubjectTokens for MintedTokens {
    async fn token(&self, cloud: Cloud) -> Result<SecretString, String> {
        let rotate_after = self.lifetime.mul_f64(0.8);
        let mut current = self.current.lock().await;
        if let Some((_, token, minted)) = current.iter().find(|(c, _, _)| *c == cloud) {
            if minted.elapsed() < rotate_after {
                return Ok(token.clone());
            }
        }
        let audience = self
            .audiences
            .iter()
            .find(|(c, _)| *c == cloud)
            .map(|(_, a)| a.as_str())
            .ok_or_else(|| format!("no projected token audience configured for {cloud}"))?;
        let token = SecretString::from(
            self.issuer
                .mint(&self.pod, &[audience], self.lifetime)
                .map_err(|e| format!("minting the dev projected token failed: {e}"))?,
        );
        current.retain(|(c, _, _)| *c != cloud);
        current.push((cloud, token.clone(), Instant::now()));
        Ok(token)
    }
}

/// A running dev stack.
pub struct DevStack {
    /// `NAME=VALUE` pairs an SDK needs to find Lanyard.
    pub exports: Vec<(String, String)>,
    pub surfaces_addr: SocketAddr,
    pub issuer: Arc<Issuer>,
    /// `None` when an external authority host is configured.
    pub entra: Option<Arc<Entra>>,
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

        // Entra: the emulator unless an authority host is configured.
        let (authority_host, entra) = match &config.azure.authority_host {
            Some(host) => (host.clone(), None),
            None => {
                let listener = bind(dev.emulator_listen, "Entra ID emulator").await?;
                let url = format!("http://{}", listener.local_addr()?);
                let entra = Arc::new(Entra::new(
                    vec![App {
                        tenant_id: dev.azure_tenant_id.clone(),
                        client_id: dev.azure_client_id.clone(),
                        federated: vec![FederatedCredential {
                            issuer: issuer.url().to_string(),
                            subject: pod.subject(),
                            audience: config.azure.audience.clone(),
                        }],
                    }],
                    Duration::from_secs(dev.token_lifetime),
                    http.clone(),
                ));
                servers.push(spawn_server(listener, entra.router(), shutdown.clone()));
                (url, Some(entra))
            }
        };
        // Validated at load; the fallback only guards against a bypass.
        let _ = authority_for_cloud(&config.azure.cloud);

        // Directory: the dev ServiceAccount plus any configured ones.
        let mut entries = vec![ServiceAccountEntry {
            namespace: dev.namespace.clone(),
            name: dev.service_account.clone(),
            annotations: [
                (
                    annotations::AZURE_CLIENT_ID.to_string(),
                    dev.azure_client_id.clone(),
                ),
                (
                    annotations::AZURE_TENANT_ID.to_string(),
                    dev.azure_tenant_id.clone(),
                ),
            ]
            .into_iter()
            .collect(),
        }];
        entries.extend(dev.service_accounts.iter().cloned());
        let directory = Arc::new(StaticDirectory::new(&entries));

        let verifier = Verifier::new(
            issuer.url(),
            KeySet::new(
                KeySource::Discovery {
                    issuer: issuer.url().to_string(),
                },
                http.clone(),
            ),
        );
        let broker = Arc::new(Broker::new(
            verifier,
            directory,
            AzureSettings {
                exchanger: AzureExchanger::new(http.clone(), authority_host),
                default_tenant: config
                    .azure
                    .tenant_id
                    .clone()
                    .or(Some(dev.azure_tenant_id.clone())),
                audience: config.azure.audience.clone(),
            },
        ));
        let subjects = Arc::new(MintedTokens::new(
            issuer.clone(),
            pod,
            Duration::from_secs(dev.projected_token_lifetime),
            vec![(Cloud::Azure, config.azure.audience.clone())],
        ));
        let identity_header = random_token(32);
        let surfaces = Arc::new(Surfaces {
            broker,
            subjects,
            identity_header: SecretString::from(identity_header.clone()),
        });
        let listener = bind(config.listen, "SDK surfaces").await?;
        let surfaces_addr = listener.local_addr()?;
        servers.push(spawn_server(
            listener,
            serve::router(surfaces),
            shutdown.clone(),
        ));

        let base = format!("http://{surfaces_addr}");
        let exports = vec![
            (
                "AZURE_POD_IDENTITY_AUTHORITY_HOST".to_string(),
                base.clone(),
            ),
            (
                "IDENTITY_ENDPOINT".to_string(),
                format!("{base}{}", serve::APP_SERVICE_PATH),
            ),
            ("IDENTITY_HEADER".to_string(), identity_header),
            ("AZURE_CLIENT_ID".to_string(), dev.azure_client_id.clone()),
            ("AZURE_TENANT_ID".to_string(), dev.azure_tenant_id.clone()),
        ];
        Ok(DevStack {
            exports,
            surfaces_addr,
            issuer,
            entra,
            trigger,
            servers,
        })
    }

    /// Stops accepting, drains in-flight requests (bounded), and returns.
    pub async fn stop(self) {
        self.trigger.trigger();
        for server in self.servers {
            match tokio::time::timeout(Duration::from_secs(10), server).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "server ended with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "server task failed"),
                Err(_) => tracing::warn!("server did not drain within 10s"),
            }
        }
    }
}

/// Runs `lanyard dev` in the foreground until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let stack = DevStack::start(&config).await?;
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for (name, value) in &stack.exports {
            writeln!(out, "export {name}={}", shell_quote(value))?;
        }
        out.flush()?;
    }
    tracing::info!(
        surfaces = %stack.surfaces_addr,
        issuer = stack.issuer.url(),
        namespace = %config.dev.namespace,
        service_account = %config.dev.service_account,
        "lanyard dev ready"
    );
    wait_for_signal().await;
    tracing::info!("shutting down");
    stack.stop().await;
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

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
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
