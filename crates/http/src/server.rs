//! Serving a router over HTTP/1.1 with the bounds a node-wide service needs
//! against slow, idle and hostile clients.
//!
//! Every surface Lanyard serves (the SDK endpoints in the sidecar and in
//! `lanyard dev`, the agent API, the admin endpoints) is called by HTTP/1.1
//! clients: no SDK speaks HTTP/2 to a metadata endpoint. So connections are
//! served by hyper's HTTP/1 server alone, and a client that opens with the
//! HTTP/2 preface is answered as HTTP/1 (400) rather than upgraded.
//!
//! The bounds, per listener ([`Limits`]):
//! - request headers (start line included) larger than
//!   `max_header_bytes` are answered `431 Request Header Fields Too Large`;
//! - a connection that has not sent a complete request head within
//!   `header_read_timeout` is closed; hyper starts that clock whenever it
//!   waits for a head, so it is also the idle keep-alive timeout;
//! - at most `max_connections` connections are open. At the bound, the
//!   connection idle for longest (no request in flight, oldest last request)
//!   is shut down to make room; when every connection has a request in
//!   flight, the new connection is closed at once. One client holding
//!   connections open cannot lock others out, and no request in flight is
//!   cut.
//!
//! A connection ends with a lingering close, as nginx's does
//! (`lingering_close`): the server stops writing (FIN), then reads and
//! discards what the client is still sending until it closes its side, for
//! at most [`LINGER_TIME`] and [`LINGER_BYTES`], each read waiting at most
//! [`LINGER_IDLE`]. Closing a socket that still holds unread bytes makes
//! the kernel send a reset, and a client still writing a long request (an
//! oversized head answered `431` after its first 16 KiB) then loses the
//! answer: its write fails with a broken pipe before it reads. At most
//! [`LINGERING`] connections per listener linger at once, outside the
//! connection bound; beyond that, a connection closes at once, as before.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tower::ServiceExt;

use super::Shutdown;

/// What a listener answers each request with.
///
/// An axum [`axum::Router`] is one. The SDK surfaces have their own
/// (`serve::SurfaceRouter`): their handful of fixed paths are
/// matched in place, and the request's future is held in its connection's
/// task rather than boxed for every request as a router's is.
pub trait Respond: Clone + Send + Sync + 'static {
    /// The answer to `request`; the caller clones the responder for each
    /// request (an `Arc` or two), so the future owns what it needs.
    fn respond(
        self,
        request: hyper::Request<Incoming>,
    ) -> impl Future<Output = axum::response::Response> + Send + 'static;
}

impl Respond for axum::Router {
    fn respond(
        self,
        request: hyper::Request<Incoming>,
    ) -> impl Future<Output = axum::response::Response> + Send + 'static {
        let answered = self.oneshot(request);
        async move {
            match answered.await {
                Ok(response) => response,
                Err(never) => match never {},
            }
        }
    }
}

/// The longest a closing connection drains what its client still sends.
pub const LINGER_TIME: Duration = Duration::from_secs(5);
/// The longest one read of a lingering close waits for the client.
pub const LINGER_IDLE: Duration = Duration::from_secs(1);
/// The most bytes a lingering close reads and discards.
pub const LINGER_BYTES: u64 = 64 * 1024 * 1024;
/// Connections of one listener lingering at once.
pub const LINGERING: usize = 256;

/// Bounds applied to every connection of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest request head (start line and headers), in bytes.
    pub max_header_bytes: usize,
    /// Time allowed for a complete request head, counted from when the
    /// server starts waiting for one (so also the idle keep-alive time).
    pub header_read_timeout: Duration,
    /// Most connections open at once.
    pub max_connections: usize,
}

impl Limits {
    /// SDK endpoints and the agent API: 16 KiB of headers (an SDK's token
    /// request is well under 2 KiB; a projected token under 4 KiB), 10 s to
    /// send them or between requests, and room for a node's pods.
    pub const fn api(max_connections: usize) -> Limits {
        Limits {
            max_header_bytes: 16 * 1024,
            header_read_timeout: Duration::from_secs(10),
            max_connections,
        }
    }
}

impl Default for Limits {
    /// The bounds of an admin listener (metrics, health): few clients.
    fn default() -> Self {
        Limits::api(256)
    }
}

/// Connections open on one listener, for the bound and for shedding.
struct Tracker {
    max: usize,
    next_id: AtomicU64,
    /// Bumped at each request start: a connection's last value orders it
    /// by last activity without reading a clock per request.
    activity: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
    /// Signalled when the last connection closes (for the drain).
    emptied: Notify,
}

struct ConnState {
    in_flight: AtomicUsize,
    last_activity: AtomicU64,
    shed: Notify,
}

/// A connection's place in the tracker; leaving it frees the place.
struct Slot {
    id: u64,
    state: Arc<ConnState>,
    tracker: Arc<Tracker>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.tracker.lock();
        open.remove(&self.id);
        if open.is_empty() {
            self.tracker.emptied.notify_waiters();
        }
    }
}

/// Decrements its connection's in-flight count when the request ends.
struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Tracker {
    fn new(max: usize) -> Arc<Tracker> {
        Arc::new(Tracker {
            max: max.max(1),
            next_id: AtomicU64::new(0),
            activity: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
            emptied: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection: free, or made by shedding the
    /// connection idle for longest; `None` when every one is busy.
    fn admit(self: &Arc<Self>) -> Option<Slot> {
        let mut open = self.lock();
        if open.len() >= self.max {
            // INVARIANT: only a connection with no request in flight is
            // shed, so no caller loses an answer to make room for another.
            let idle = open
                .iter()
                .filter(|(_, c)| c.in_flight.load(Ordering::Acquire) == 0)
                .min_by_key(|(_, c)| c.last_activity.load(Ordering::Relaxed))
                .map(|(id, c)| (*id, c.clone()));
            let (id, victim) = idle?;
            // Out of the count at once: its graceful shutdown closes it
            // without waiting for the client.
            open.remove(&id);
            victim.shed.notify_one();
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState {
            in_flight: AtomicUsize::new(0),
            last_activity: AtomicU64::new(self.activity.fetch_add(1, Ordering::Relaxed)),
            shed: Notify::new(),
        });
        open.insert(id, state.clone());
        Some(Slot {
            id,
            state,
            tracker: self.clone(),
        })
    }

    async fn wait_empty(&self) {
        loop {
            let emptied = self.emptied.notified();
            if self.lock().is_empty() {
                return;
            }
            emptied.await;
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` fires,
/// then stops accepting and waits for the open connections: idle ones close
/// at once, in-flight requests finish.
pub async fn serve(
    listener: TcpListener,
    router: impl Respond,
    shutdown: Shutdown,
    limits: Limits,
) -> std::io::Result<()> {
    let tracker = Tracker::new(limits.max_connections);
    let lingering = Arc::new(tokio::sync::Semaphore::new(LINGERING));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes)
        .keep_alive(true);
    let stop = shutdown.clone();
    let stopped = stop.wait();
    tokio::pin!(stopped);
    loop {
        let stream = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(e) => {
                    // Out of descriptors or memory: wait rather than spin;
                    // a reset before accept is just the client's.
                    tracing::warn!(target: crate::TARGET_SERVER, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = tracker.admit() else {
            tracing::debug!(target: crate::TARGET_SERVER, "connection refused: every connection has a request in flight");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let state = slot.state.clone();
        let activity = tracker.clone();
        let router = router.clone();
        let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
            state.in_flight.fetch_add(1, Ordering::AcqRel);
            state.last_activity.store(
                activity.activity.fetch_add(1, Ordering::Relaxed),
                Ordering::Relaxed,
            );
            let guard = InFlight(state.clone());
            let answered = router.clone().respond(req);
            async move {
                let response = answered.await;
                drop(guard);
                Ok::<_, Infallible>(response)
            }
        });
        let http = http.clone();
        let shutdown = shutdown.clone();
        let lingering = lingering.clone();
        tokio::spawn(async move {
            let mut io = TokioIo::new(stream);
            let conn = http.serve_connection(&mut io, service);
            tokio::pin!(conn);
            let stopping = shutdown.wait();
            tokio::pin!(stopping);
            let mut closing = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!(target: crate::TARGET_SERVER, error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    _ = slot.state.shed.notified(), if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                    _ = &mut stopping, if !closing => {
                        closing = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(slot);
            if let Ok(_permit) = lingering.try_acquire() {
                linger(io.into_inner()).await;
            }
        });
    }
    tracker.wait_empty().await;
    Ok(())
}

/// Stops writing to `stream`, then reads and discards what its client
/// still sends, within [`LINGER_TIME`], [`LINGER_IDLE`] per read and
/// [`LINGER_BYTES`], before the socket is closed.
async fn linger(mut stream: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Already shut down when hyper ended the connection cleanly; an error
    // here (the peer is gone) ends the linger at the first read.
    let _ = stream.shutdown().await;
    let deadline = tokio::time::Instant::now() + LINGER_TIME;
    // Most clients have closed already: one small read sees their EOF.
    // The larger buffer is allocated only for a client still sending; the
    // connection's task keeps no large buffer for its whole life.
    let mut first = [0u8; 64];
    let mut rest = Vec::new();
    let mut drained = 0u64;
    while drained < LINGER_BYTES {
        let buf: &mut [u8] = if rest.is_empty() {
            &mut first
        } else {
            &mut rest
        };
        let wait = deadline.min(tokio::time::Instant::now() + LINGER_IDLE);
        match tokio::time::timeout_at(wait, stream.read(buf)).await {
            Ok(Ok(n)) if n > 0 => drained += n as u64,
            _ => break,
        }
        if rest.is_empty() {
            rest = vec![0u8; 16 * 1024];
        }
    }
}
