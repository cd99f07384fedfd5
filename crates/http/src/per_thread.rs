//! One listening address served by several threads, each with a
//! single-threaded runtime and a listener of its own.
//!
//! Why: a cached credential costs a few microseconds of CPU to serve, and
//! on the multi-threaded runtime a good part of the rest went to the
//! runtime itself. Its workers share one pool of tasks: one that finds
//! work wakes another to steal some, and each wake-up of a thread on
//! another CPU is an inter-processor interrupt and a context switch (a
//! virtual machine's exit, on most nodes). Under `wrk` on two CPUs, the
//! same binary with one worker used 5 % less CPU per request than with two
//! (but one CPU caps it), and `perf` put the difference in the scheduler's
//! context switches. nginx avoids this by design: each worker process
//! accepts its own connections and never wakes another. Served this way,
//! `lanyard dev` answered 1.16 times the cached hits per second of the
//! multi-threaded runtime, at 0.85 times the CPU per request (ABBA, six
//! rounds each).
//!
//! Here each thread owns a listener of one `SO_REUSEPORT` group on the same
//! address, and the kernel spreads new connections over the group; a
//! connection stays on the thread that accepted it, with no hand-off and
//! no stealing. What the connections share (the cache, the broker) is
//! shared as before, through its own locks.
//!
//! What it changes: a connection's requests all run on one thread, so a
//! thread stuck in a slow step (none is expected: exchanges and key fetches
//! wait on the network, not on the CPU) delays its own connections, not
//! every connection. Connection bounds apply per thread: each gets its share
//! of [`Limits::max_connections`]. Tasks a request starts run on its
//! thread, except the cache's exchanges and refresh task, which run on the
//! runtime the cache was made on (`cache.rs`): a herd's one exchange would
//! otherwise wait behind that thread's queue of the herd's requests.
//!
//! `SO_REUSEPORT` lets another socket of the same user on the same address
//! join the group, and the kernel would hand it connections. Lanyard's
//! listeners are in its own pod's network namespace (the chart uses no
//! `hostNetwork`), where no other process binds them.

use std::net::SocketAddr;

use anyhow::Context as _;
use tokio::net::TcpListener;

use super::server::{serve, Limits, Respond};
use super::{listen, Shutdown};

/// The most serving threads: beyond a few cores, a node's credential
/// traffic (each pod's SDKs ask once per token lifetime) gains nothing, and
/// every thread costs a runtime and a stack.
pub const MAX_THREADS: usize = 16;

/// Serving threads for this process: one per CPU it may use, at most
/// [`MAX_THREADS`].
pub fn default_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(MAX_THREADS)
}

/// The listeners of one address, one per serving thread, bound and
/// listening (connections queue from now on).
pub struct Listeners {
    sockets: Vec<std::net::TcpListener>,
    addr: SocketAddr,
}

impl Listeners {
    /// The address every listener is bound to (with the port the first one
    /// got, for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Binds `threads` listeners (at least one) to `addr` as one `SO_REUSEPORT`
/// group, failing with a message that names the address and `what`.
pub async fn bind(addr: SocketAddr, what: &str, threads: usize) -> anyhow::Result<Listeners> {
    let context = || format!("cannot listen on {addr} for the {what}");
    let first = listen(addr, true).with_context(context)?;
    // INVARIANT: the others bind to the first one's address, port
    // included, so that `addr` with port 0 forms one group.
    let bound = first.local_addr().with_context(context)?;
    let mut sockets = vec![first.into_std().with_context(context)?];
    for _ in 1..threads.max(1) {
        let next = listen(bound, true).with_context(context)?;
        sockets.push(next.into_std().with_context(context)?);
    }
    tracing::info!(target: crate::TARGET_PER_THREAD, addr = %bound, threads = sockets.len(), "listening for the {what}");
    Ok(Listeners {
        sockets,
        addr: bound,
    })
}

/// Serves `router` on every listener of `listeners`, each on a thread of
/// its own running a single-threaded runtime, within `limits` shared out
/// among them, until `shutdown` fires (see [`serve`]). The task resolves
/// when every thread has drained and stopped, with the first error.
pub fn spawn(
    listeners: Listeners,
    router: impl Respond,
    shutdown: Shutdown,
    limits: Limits,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let count = listeners.sockets.len();
    let share = Limits {
        max_connections: limits.max_connections.div_ceil(count).max(1),
        ..limits
    };
    let mut done = Vec::with_capacity(count);
    for (i, socket) in listeners.sockets.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (router, shutdown) = (router.clone(), shutdown.clone());
        let run = move || {
            let result = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .and_then(|runtime| {
                    runtime.block_on(async {
                        let listener = TcpListener::from_std(socket)?;
                        serve(listener, router, shutdown, share).await
                    })
                });
            let _ = tx.send(result);
        };
        match std::thread::Builder::new()
            .name(format!("lanyard-serve-{i}"))
            .spawn(run)
        {
            Ok(_) => done.push(rx),
            // The listener went with the closure: its connections are
            // refused, and the error ends the server once the others stop.
            Err(e) => {
                tracing::error!(target: crate::TARGET_PER_THREAD, error = %e, "cannot start a serving thread");
                let (tx, rx) = tokio::sync::oneshot::channel();
                let _ = tx.send(Err(e));
                done.push(rx);
            }
        }
    }
    tokio::spawn(async move {
        let mut first = Ok(());
        for rx in done {
            let result = rx.await.unwrap_or_else(|_| {
                Err(std::io::Error::other(
                    "a serving thread stopped without a result",
                ))
            });
            if first.is_ok() {
                first = result;
            }
        }
        first
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Answers with the name of the thread that served the request.
    fn thread_router() -> axum::Router {
        axum::Router::new().route(
            "/",
            axum::routing::get(|| async {
                std::thread::current()
                    .name()
                    .unwrap_or("unnamed")
                    .to_string()
            }),
        )
    }

    async fn get(addr: SocketAddr) -> String {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        response.rsplit("\r\n").next().unwrap_or("").to_string()
    }

    #[tokio::test]
    async fn connections_are_spread_over_the_threads_and_all_stop() {
        let listeners = bind(([127, 0, 0, 1], 0).into(), "test", 3).await.unwrap();
        let addr = listeners.local_addr();
        assert_ne!(addr.port(), 0);
        let (trigger, shutdown) = Shutdown::new();
        let server = spawn(listeners, thread_router(), shutdown, Limits::api(64));
        let mut threads = HashSet::new();
        for _ in 0..200 {
            threads.insert(get(addr).await);
        }
        // The kernel hashes each connection's ports over the group: 200
        // connections miss one of three listeners with odds of about 1e-35.
        let expected: HashSet<String> = (0..3).map(|i| format!("lanyard-serve-{i}")).collect();
        assert_eq!(threads, expected);
        trigger.trigger();
        let stopped = tokio::time::timeout(Duration::from_secs(10), server)
            .await
            .expect("every thread stops")
            .unwrap();
        assert!(stopped.is_ok(), "{stopped:?}");
        assert!(
            tokio::net::TcpStream::connect(addr).await.is_err(),
            "nothing listens after the stop"
        );
    }

    #[tokio::test]
    async fn an_address_in_use_is_refused_with_its_name() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let err = bind(addr, "SDK surfaces", 2).await.err().unwrap();
        let message = format!("{err:#}");
        assert!(message.contains(&addr.to_string()), "{message}");
        assert!(message.contains("SDK surfaces"), "{message}");
    }

    #[test]
    fn the_thread_count_is_bounded() {
        let n = default_threads();
        assert!((1..=MAX_THREADS).contains(&n), "{n}");
    }
}
