//! `lanyard sidecar`: every SDK surface on loopback inside the pod, backed
//! by the node agent. Reads the pod's projected tokens from a directory the
//! kubelet keeps fresh (one file per cloud audience: `azure`, `gcp`, `aws`,
//! plus `app`, the app-facing token that authorizes the AWS container
//! endpoint).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;

use crate::broker::remote::RemoteBroker;
use crate::broker::reuse::ReusingBroker;
use crate::cloud::Cloud;
use crate::config::Config;
use crate::http::{
    bind, drain, spawn_server, spawn_server_with, wait_for_signal, Limits, Shutdown, DRAIN_TIMEOUT,
};
use crate::secret::{random_token, SecretString};
use crate::serve::container_token::ContainerToken;
use crate::serve::token_shelf::TokenShelf;
use crate::serve::{self, SubjectTokens, Surfaces};

/// Connections the SDK endpoints keep open at once: one pod's SDK clients,
/// a connection or two per process (a Ray pod on a large node runs one
/// worker per CPU). Each open connection costs the sidecar about 30 KB
/// (hyper's read buffers, its task), which glibc's malloc keeps after a
/// burst: at 1,024, bursts of 1,000 grew a sidecar to 54 MiB, close to its
/// 64 MiB limit; at 512 they stop near 33 MiB. At the bound the
/// longest-idle connection is closed to make room (`http::server`).
const SDK_CONNECTIONS: usize = 512;

/// How long a read token file is trusted before it is read again. The
/// kubelet rotates at 80% of a token's life (minutes at the least), so a
/// few seconds of staleness never serves an expired token.
const REREAD_AFTER: Duration = Duration::from_secs(5);

/// The file that holds the projected token for `cloud`.
pub fn token_file(dir: &Path, cloud: Cloud) -> PathBuf {
    dir.join(cloud.to_string())
}

/// Projected tokens from files, re-read as the kubelet rotates them.
pub struct FileTokens {
    dir: PathBuf,
    shelf: TokenShelf,
}

impl FileTokens {
    /// Tokens from the files in `dir`, one per cloud ([`token_file`]). Nothing
    /// is read until a token is asked for; a token read more than five seconds
    /// ago is read again, so a rotation by the kubelet is picked up promptly.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        FileTokens {
            dir: dir.into(),
            shelf: TokenShelf::new(REREAD_AFTER),
        }
    }

    /// Whether at least one cloud's token file is readable.
    pub async fn any_readable(&self) -> bool {
        for cloud in Cloud::ALL {
            if tokio::fs::metadata(token_file(&self.dir, cloud))
                .await
                .is_ok()
            {
                return true;
            }
        }
        false
    }

    /// Reads `cloud`'s token file.
    async fn read(&self, cloud: Cloud) -> Result<SecretString, String> {
        let path = token_file(&self.dir, cloud);
        let contents = tokio::fs::read_to_string(&path).await.map_err(|e| {
            format!(
                "cannot read the {cloud} projected token {}: {e}",
                path.display()
            )
        })?;
        let token = contents.trim();
        if token.is_empty() {
            return Err(format!(
                "the {cloud} projected token {} is empty",
                path.display()
            ));
        }
        Ok(SecretString::from(token.to_string()))
    }
}

#[async_trait::async_trait]
impl SubjectTokens for FileTokens {
    async fn token(&self, cloud: Cloud) -> Result<Arc<SecretString>, String> {
        self.shelf.get(cloud, || self.read(cloud)).await
    }
}

/// A running sidecar.
pub struct Sidecar {
    /// The address the SDK endpoints are bound to (the actual port when the
    /// configuration asked for port 0).
    pub addr: std::net::SocketAddr,
    /// The same endpoints on the IPv6 loopback, when `addr` is the IPv4
    /// one and the pod has IPv6.
    pub addr_v6: Option<std::net::SocketAddr>,
    trigger: crate::http::ShutdownTrigger,
    servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// Reads the container authorization token on a timer.
    observer: tokio::task::JoinHandle<()>,
}

impl Sidecar {
    /// Checks the configuration, binds and serves.
    pub async fn start(config: &Config) -> anyhow::Result<Sidecar> {
        let remote = match (&config.sidecar.agent_url, config.sidecar.standalone) {
            (Some(url), false) => Some(Arc::new(RemoteBroker::new(url)?)),
            (None, false) => anyhow::bail!(
                "no node agent: set --agent URL or LANYARD_AGENT_URL (or --standalone to exchange directly)"
            ),
            (_, true) => None,
        };
        let dir = config.sidecar.token_dir.clone().ok_or_else(|| {
            anyhow::anyhow!("no token directory: set --token-dir DIR or LANYARD_TOKEN_DIR")
        })?;
        let entries = std::fs::read_dir(&dir).map_err(|e| {
            anyhow::anyhow!(
                "token directory {} is not readable: {e} (mount the projected token volume there)",
                dir.display()
            )
        })?;
        drop(entries);
        let tokens = Arc::new(FileTokens::new(&dir));
        let broker: Arc<dyn crate::broker::TokenBroker> = match &remote {
            Some(remote) => Arc::new(ReusingBroker::new(
                remote.clone(),
                Duration::from_secs(config.sidecar.grant_reuse_seconds),
            )),
            None => Arc::new(standalone_broker(config)?),
        };
        let app_token = config
            .sidecar
            .app_token_file
            .clone()
            .unwrap_or_else(|| dir.join("app"));
        let identity_header = config
            .sidecar
            .identity_header
            .clone()
            .unwrap_or_else(|| random_token(32));
        let surfaces = Arc::new(Surfaces::new(
            broker.clone(),
            tokens.clone(),
            SecretString::from(identity_header),
            Some(ContainerToken::new(app_token)),
            config.clouds().sdk_defaults(),
        ));
        // Notice rotations of the container authorization token while no
        // one calls, so the token a rotation replaces is known when a
        // client that read it just before arrives after.
        let observed = surfaces.clone();
        let observe = async move {
            let mut every = tokio::time::interval(serve::container_token::OBSERVE_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                if let Some(token) = &observed.app_token {
                    // Unreadable until the kubelet writes it: the next tick
                    // tries again, and requests say so themselves.
                    let _ = token.observe().await;
                }
            }
        };
        let ready_tokens = tokens.clone();
        let ready_remote = remote.clone();
        let probes = axum::Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/readyz",
                get(move || {
                    let (tokens, remote) = (ready_tokens.clone(), ready_remote.clone());
                    async move {
                        if !tokens.any_readable().await {
                            return (
                                StatusCode::SERVICE_UNAVAILABLE,
                                "projected tokens not readable",
                            );
                        }
                        if let Some(remote) = remote {
                            if !remote.agent_healthy().await {
                                return (StatusCode::SERVICE_UNAVAILABLE, "node agent unreachable");
                            }
                        }
                        (StatusCode::OK, "ready")
                    }
                }),
            );
        let router = serve::router(surfaces).with_probes(probes.clone());
        let (trigger, shutdown) = Shutdown::new();
        let listener = bind(config.listen, "sidecar SDK endpoints").await?;
        let addr = listener.local_addr()?;
        let mut servers = Vec::new();
        // An SDK that resolves `localhost` may try `::1` first: serve there
        // too, on the same port, where the pod has IPv6. The exported URLs
        // stay on 127.0.0.1 (some SDKs refuse bracketed IPv6 hosts).
        let addr_v6 = match addr {
            std::net::SocketAddr::V4(v4) if v4.ip().is_loopback() => {
                let v6 = std::net::SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, addr.port()));
                match bind(v6, "sidecar SDK endpoints (IPv6)").await {
                    Ok(listener) => {
                        servers.push(spawn_server_with(
                            listener,
                            router.clone(),
                            shutdown.clone(),
                            Limits::api(SDK_CONNECTIONS),
                        ));
                        Some(v6)
                    }
                    Err(e) => {
                        tracing::info!(error = %e, "no IPv6 loopback in this pod: serving on {addr} only");
                        None
                    }
                }
            }
            _ => None,
        };
        servers.push(spawn_server_with(
            listener,
            router,
            shutdown.clone(),
            Limits::api(SDK_CONNECTIONS),
        ));
        if let Some(probe_addr) = config.sidecar.probe_listen {
            let listener = bind(probe_addr, "sidecar probes").await?;
            servers.push(spawn_server(listener, probes, shutdown));
        }
        tracing::info!(%addr, ?addr_v6, agent = ?config.sidecar.agent_url, standalone = config.sidecar.standalone, token_dir = %dir.display(), "lanyard sidecar serving");
        Ok(Sidecar {
            addr,
            addr_v6,
            trigger,
            servers,
            observer: tokio::spawn(observe),
        })
    }

    /// Stops accepting requests and waits for in-flight ones to finish, up to
    /// [`crate::http::DRAIN_TIMEOUT`].
    pub async fn stop(self) {
        self.trigger.trigger();
        self.observer.abort();
        drain(self.servers, DRAIN_TIMEOUT).await;
    }
}

/// The standalone sidecar's broker: the pod's own bindings, its own token
/// files, direct exchanges with the clouds.
fn standalone_broker(config: &Config) -> anyhow::Result<crate::broker::Broker> {
    let bindings = crate::cloud::Bindings::from_annotations(&config.sidecar.annotations);
    let audiences = config.audiences();
    let implicit = Cloud::ALL
        .into_iter()
        .any(|c| c.implicit_identity() && audiences[c].is_some());
    if bindings.is_empty() && !implicit {
        anyhow::bail!(
            "standalone sidecar without bindings: pass --annotation {}",
            Cloud::binding_annotations("=...")
        );
    }
    let parts = crate::broker::assemble::Parts::new(
        config,
        "sidecar",
        crate::token::Verifier::local_files(),
        Arc::new(crate::directory::file::FixedDirectory(Arc::new(bindings))),
    )?;
    crate::broker::assemble::broker(config, parts, crate::http::client())
}

/// Runs the sidecar until SIGINT/SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let sidecar = Sidecar::start(&config).await?;
    let _ = wait_for_signal().await;
    tracing::info!("shutting down");
    sidecar.stop().await;
    Ok(())
}

/// One `GET /readyz` to this pod's sidecar on `127.0.0.1:port`, as the
/// kubelet's probe asks it: `Ok` for a 200, else what was wrong. Plain
/// blocking I/O with short timeouts, for `lanyard-sidecar wait-ready`.
pub fn probe_ready(port: u16) -> Result<(), String> {
    use std::io::{Read, Write};
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let timeout = Duration::from_millis(500);
    let mut stream = std::net::TcpStream::connect_timeout(&addr, timeout)
        .map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .and_then(|()| {
            stream
                .write_all(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        })
        .map_err(|e| format!("cannot ask {addr}: {e}"))?;
    // The status line is all that matters: "HTTP/1.1 200 ...".
    let mut head = [0u8; 64];
    let mut read = 0;
    while read < head.len() {
        match stream.read(&mut head[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) => return Err(format!("no answer from {addr}: {e}")),
        }
        if head[..read].contains(&b'\n') {
            break;
        }
    }
    let line = String::from_utf8_lossy(&head[..read]);
    let status = line.split_whitespace().nth(1).unwrap_or("");
    if status == "200" {
        Ok(())
    } else {
        Err(format!(
            "{addr} answered {:?}",
            line.lines().next().unwrap_or_default()
        ))
    }
}
