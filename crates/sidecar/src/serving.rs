//! The sidecar serving: every SDK surface on loopback inside the pod,
//! backed by the node agent (or, standalone, by a broker the full binary
//! gives it), with the probes the kubelet asks.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use lanyard_agent_api::remote::RemoteBroker;
use lanyard_agent_api::reuse::ReusingBroker;
use lanyard_core::grant::TokenBroker;
use lanyard_core::secret::{random_token, SecretString};
use lanyard_http::{
    bind, drain, per_thread, spawn_server, spawn_server_with, wait_for_signal, Limits, Shutdown,
    ShutdownTrigger, DRAIN_TIMEOUT,
};
use lanyard_surfaces::container_token::ContainerToken;
use lanyard_surfaces::{self as serve, Surfaces};

use crate::config::Settings;
use crate::token_files::FileTokens;

/// The sidecar's lines keep the target they had in the product, so that
/// operators' filters (`lanyard=debug`) still match them.
const TARGET: &str = "lanyard::sidecar";

/// Why a standalone configuration is refused without a broker to give it.
const STANDALONE_ELSEWHERE: &str = "standalone mode exchanges with the clouds itself, which the slim lanyard-sidecar does not link: run `lanyard sidecar --standalone` (the same image has both)";

/// Connections the SDK endpoints keep open at once: one pod's SDK clients,
/// a connection or two per process (a Ray pod on a large node runs one
/// worker per CPU). Each open connection costs the sidecar about 30 KB
/// (hyper's read buffers, its task), which glibc's malloc keeps after a
/// burst: at 1,024, bursts of 1,000 grew a sidecar to 54 MiB, close to its
/// 64 MiB limit; at 512 they stop near 33 MiB. At the bound the
/// longest-idle connection is closed to make room (`http::server`).
const SDK_CONNECTIONS: usize = 512;

/// Threads serving the SDK endpoints on 127.0.0.1 (`lanyard_http::per_thread`:
/// each with a listener of one `SO_REUSEPORT` group and a runtime of its
/// own, so a connection's requests never wake another CPU), at most one
/// per CPU. Two: one pod's SDK calls need no more, and each thread costs a
/// runtime and a stack in every pod (about 0.3 MiB resident each).
///
/// Measured against the same code serving on the multi-threaded runtime
/// (`bench/compare --hop`, release, 2 cores, two A B B A rounds): with
/// grants reused, 1.07 times the requests/s at 0.94 times the CPU per
/// request; with every call reaching the agent, 1.05 times at 0.97 times,
/// once each thread had its own pool of connections to the agent (with
/// one shared pool, 0.93 times at 1.08 times). The price is the tail:
/// with grants reused, p99 rose from about 2.3 to 3.8 ms at 64
/// connections, which the kernel spreads over the two listeners unevenly.
const SDK_THREADS: usize = 2;

/// A running sidecar.
pub struct Sidecar {
    /// The address the SDK endpoints are bound to (the actual port when the
    /// configuration asked for port 0).
    pub addr: std::net::SocketAddr,
    /// The same endpoints on the IPv6 loopback, when `addr` is the IPv4
    /// one and the pod has IPv6.
    pub addr_v6: Option<std::net::SocketAddr>,
    trigger: ShutdownTrigger,
    servers: Vec<tokio::task::JoinHandle<std::io::Result<()>>>,
    /// Reads the container authorization token on a timer.
    observer: tokio::task::JoinHandle<()>,
}

impl Sidecar {
    /// Checks the configuration, binds and serves.
    ///
    /// `standalone` is the broker a standalone sidecar exchanges through
    /// (`sidecar.standalone`): the full binary builds it (it holds the
    /// exchangers, the cache and the policy); without one, a standalone
    /// configuration is refused with where to find it.
    pub async fn start(
        config: &Settings,
        standalone: Option<Arc<dyn TokenBroker>>,
    ) -> anyhow::Result<Sidecar> {
        let window = Duration::from_secs(config.sidecar.grant_reuse_seconds);
        let (broker, remote): (Arc<dyn TokenBroker>, _) = match (
            &config.sidecar.agent_url,
            config.sidecar.standalone,
            standalone,
        ) {
            (_, true, Some(standalone)) => (standalone, None),
            (_, true, None) => anyhow::bail!("{STANDALONE_ELSEWHERE}"),
            (Some(url), false, _) => {
                let remote = Arc::new(RemoteBroker::new(url)?);
                (Arc::new(ReusingBroker::new(remote.clone(), window)), Some(remote))
            }
            (None, false, _) => anyhow::bail!(
                "no node agent: set --agent URL or LANYARD_AGENT_URL (or --standalone to exchange directly)"
            ),
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
            config.sdk_defaults.clone(),
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
        let threads = per_thread::default_threads().min(SDK_THREADS);
        let listeners = per_thread::bind(config.listen, "sidecar SDK endpoints", threads).await?;
        let addr = listeners.local_addr();
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
                        tracing::info!(target: TARGET, error = %e, "no IPv6 loopback in this pod: serving on {addr} only");
                        None
                    }
                }
            }
            _ => None,
        };
        servers.push(per_thread::spawn(
            listeners,
            router,
            shutdown.clone(),
            Limits::api(SDK_CONNECTIONS),
        ));
        if let Some(probe_addr) = config.sidecar.probe_listen {
            let listener = bind(probe_addr, "sidecar probes").await?;
            servers.push(spawn_server(listener, probes, shutdown));
        }
        tracing::info!(target: TARGET, %addr, ?addr_v6, agent = ?config.sidecar.agent_url, standalone = config.sidecar.standalone, token_dir = %dir.display(), "lanyard sidecar serving");
        Ok(Sidecar {
            addr,
            addr_v6,
            trigger,
            servers,
            observer: tokio::spawn(observe),
        })
    }

    /// Stops accepting requests and waits for in-flight ones to finish, up to
    /// [`DRAIN_TIMEOUT`].
    pub async fn stop(self) {
        self.trigger.trigger();
        self.observer.abort();
        drain(self.servers, DRAIN_TIMEOUT).await;
    }
}

/// Runs the sidecar until SIGINT/SIGTERM.
pub async fn run(config: Settings, standalone: Option<Arc<dyn TokenBroker>>) -> anyhow::Result<()> {
    // Before anything binds: a stop signal from now on is kept.
    lanyard_http::listen_for_signals();

    let sidecar = Sidecar::start(&config, standalone).await?;
    let _ = wait_for_signal().await;
    tracing::info!(target: TARGET, "shutting down");
    sidecar.stop().await;
    Ok(())
}
