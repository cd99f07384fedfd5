//! Lanyard's HTTP serving, shared by every role (agent, sidecar, webhook,
//! `lanyard dev`): binding a listener, serving a router with bounded
//! connections, request heads and a lingering close ([`server`]), one
//! listener per thread ([`per_thread`]), the process's stop signal,
//! graceful shutdown and the bounded drain of server tasks.
//!
//! A crate of its own, under every other: it knows nothing of clouds,
//! credentials or Kubernetes, and Cargo keeps it so (it depends on none
//! of Lanyard's crates).

pub mod per_thread;
pub mod server;

/// The log target of this crate's lines: the module path they had inside
/// the `lanyard` crate, so log filters (`lanyard=debug`,
/// `warn,lanyard::http=info`) select them as they always did.
// INVARIANT: every tracing event of this crate names one of these targets.
const TARGET: &str = "lanyard::http";
const TARGET_PER_THREAD: &str = "lanyard::http::per_thread";
const TARGET_SERVER: &str = "lanyard::http::server";

use std::time::Duration;

pub use server::{Limits, Respond};

use tokio::net::TcpListener;
use tokio::sync::watch;

/// The signal a role was asked to stop with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C): a person at a terminal; stop at once.
    Interrupt,
    /// SIGTERM: what the kubelet sends when it deletes the pod.
    Terminate,
}

/// SIGINT and SIGTERM listeners registered when a role starts
/// ([`listen_for_signals`]), for its first [`wait_for_signal`].
#[cfg(unix)]
struct Listeners {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

#[cfg(unix)]
static EARLY: std::sync::Mutex<Option<Listeners>> = std::sync::Mutex::new(None);

/// Starts listening for SIGINT and SIGTERM now, on the current runtime;
/// each role calls it first.
///
/// Why: a listener registered only when the role awaits its stop signal
/// (after it has bound, become ready and said so) left a window in which
/// the signal's default action still applied. A SIGTERM that arrived
/// there (the kubelet deleting a pod just started; a test done with a
/// process as soon as it answered) killed the process mid-start, with no
/// drain and exit status -15. Registered first, the signal is kept until
/// [`wait_for_signal`] takes it.
pub fn listen_for_signals() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let (Ok(interrupt), Ok(terminate)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            *EARLY.lock().unwrap_or_else(|p| p.into_inner()) = Some(Listeners {
                interrupt,
                terminate,
            });
        }
    }
}

/// Resolves on SIGINT or SIGTERM, saying which: how every role is asked to
/// stop. The first call takes the listeners [`listen_for_signals`]
/// registered, with any signal that arrived since.
pub async fn wait_for_signal() -> StopSignal {
    #[cfg(unix)]
    {
        let early = EARLY.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut early) = early {
            return tokio::select! {
                _ = early.interrupt.recv() => StopSignal::Interrupt,
                _ = early.terminate.recv() => StopSignal::Terminate,
            };
        }
    }
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
        _ = ctrl_c => StopSignal::Interrupt,
        _ = term => StopSignal::Terminate,
    }
}

/// After SIGTERM, keeps the role serving for `delay` once `not_ready` has
/// made `/readyz` say `shutting down` (a second signal, or SIGINT in the
/// first place, skips the wait).
///
/// The kubelet's SIGTERM and the endpoints' update race: for a second or
/// more after it, Services (kube-proxy's rules, the API server's webhook
/// client) still route new connections to the pod. A role that stopped
/// listening at once would refuse them: a pod created then would be
/// refused by the webhook, an SDK call on the node would find no agent.
/// Serving through the delay lets the update land first; the chart's
/// `terminationGracePeriodSeconds` covers the delay and the drain.
pub async fn shutdown_delay(signal: StopSignal, delay: Duration, not_ready: impl FnOnce()) {
    not_ready();
    if signal == StopSignal::Interrupt || delay.is_zero() {
        return;
    }
    tracing::info!(target: TARGET,
        seconds = delay.as_secs(),
        "SIGTERM: still serving while endpoints stop routing here (another signal stops at once)"
    );
    tokio::select! {
        _ = tokio::time::sleep(delay) => {}
        _ = wait_for_signal() => {}
    }
}

/// A signal that fires once when the process is asked to stop.
#[derive(Clone)]
pub struct Shutdown(watch::Receiver<bool>);

/// The sending half of [`Shutdown`].
pub struct ShutdownTrigger(watch::Sender<bool>);

impl Shutdown {
    /// A new signal, not yet fired, and its trigger. Clone the [`Shutdown`]
    /// for every task that must stop.
    pub fn new() -> (ShutdownTrigger, Shutdown) {
        let (tx, rx) = watch::channel(false);
        (ShutdownTrigger(tx), Shutdown(rx))
    }

    /// Resolves when shutdown has been triggered (or the trigger dropped).
    pub async fn wait(mut self) {
        let _ = self.0.wait_for(|stop| *stop).await;
    }
}

impl ShutdownTrigger {
    /// Fires the signal: every [`Shutdown::wait`] resolves. Firing twice is
    /// harmless.
    pub fn trigger(&self) {
        let _ = self.0.send(true);
    }
}

/// Accept queue length: a Ray cluster's workers start together, and a
/// short queue turns a herd into SYN retries a second later (the kernel
/// caps this at `net.core.somaxconn`).
const BACKLOG: u32 = 4096;

/// Binds `addr` with a deep accept queue, failing with a message that names
/// the address.
pub async fn bind(addr: std::net::SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    let fail = |e: std::io::Error| anyhow::anyhow!("cannot listen on {addr} for the {what}: {e}");
    let listener = listen(addr, false).map_err(fail)?;
    tracing::info!(target: TARGET, addr = %listener.local_addr().map_err(fail)?, "listening for the {what}");
    Ok(listener)
}

/// A listener on `addr` with `SO_REUSEADDR` and a [`BACKLOG`]-deep accept
/// queue; with `SO_REUSEPORT` too when `reuseport` (`per_thread`'s groups).
fn listen(addr: std::net::SocketAddr, reuseport: bool) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }?;
    socket.set_reuseaddr(true)?;
    if reuseport {
        socket.set_reuseport(true)?;
    }
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Serves `router` on `listener` until `shutdown` fires, then drains
/// in-flight requests; with the bounds of an admin listener
/// ([`Limits::default`]).
pub fn spawn_server(
    listener: TcpListener,
    router: impl Respond,
    shutdown: Shutdown,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    spawn_server_with(listener, router, shutdown, Limits::default())
}

/// As [`spawn_server`], within `limits` (see [`server`]).
pub fn spawn_server_with(
    listener: TcpListener,
    router: impl Respond,
    shutdown: Shutdown,
    limits: Limits,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tokio::spawn(server::serve(listener, router, shutdown, limits))
}

/// How long each server task gets to finish its in-flight requests once
/// shutdown has been triggered.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits for each server task in turn, up to `timeout` each, logging any
/// that ends with an error or does not finish in time. Call it after the
/// servers' [`ShutdownTrigger`] fired: the tasks then drain concurrently,
/// so the total wait is about one `timeout`, not one per server.
pub async fn drain(
    servers: impl IntoIterator<Item = tokio::task::JoinHandle<std::io::Result<()>>>,
    timeout: Duration,
) {
    for server in servers {
        match tokio::time::timeout(timeout, server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(target: TARGET, error = %e, "server ended with an error")
            }
            Ok(Err(e)) => tracing::warn!(target: TARGET, error = %e, "server task failed"),
            Err(_) => {
                tracing::warn!(target: TARGET, "server did not drain within {}s", timeout.as_secs())
            }
        }
    }
}
