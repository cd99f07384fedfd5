//! The sidecar's broker: the node agent, over HTTP. Each request carries
//! the pod's projected token for the cloud asked; the agent verifies it,
//! decides, exchanges (or serves from its cache) and answers in the wire
//! format of [`super::wire`]. When the agent is unreachable or slow the
//! error is retryable, so every SDK surface answers with a status its SDK
//! retries on, never a wrong or empty credential.
//!
//! At most [`AGENT_CONCURRENCY`] requests are in flight to the agent at
//! once, over as many pooled connections per serving thread (each thread
//! has a pool of its own: [`RemoteBroker::client`]; the slim sidecar
//! serves from two); the rest wait their turn (within the same 20 s). Without the bound a burst of N SDK calls in one pod (a
//! Ray worker's processes starting together) opened N connections to the
//! agent: each costs both processes tens of KB the allocator keeps after
//! the burst (bursts of 200 grew a sidecar from 15 to 31 MiB, against a
//! 64 MiB limit), and one pod could hold thousands of the agent's
//! connections, which every pod on the node shares.
//!
//! The grants last decoded are kept with the bytes they came from
//! ([`DECODED_KEPT`]): an answer byte for byte the same as one of them (the
//! agent serves one credential's grant as the same bytes until it changes)
//! is that grant again, without decoding it, and its credential's rendered
//! body ([`lanyard_core::cloud::RenderedBody`]) with it, so the SDK surface does
//! not render the same body again either. Without it every answer became a
//! new credential with an empty body slot: decoded, then rendered, every
//! time.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::sync::Semaphore;
use tokio::time::Instant;

use crate::wire::{ErrorBody, WireGrant, TOKEN_PATH};
use lanyard_core::cloud::TokenRequest;
use lanyard_core::grant::{BrokerError, Grant, TokenBroker};
use lanyard_core::secret::{ExposeSecret, SecretString};

/// Most requests one sidecar has in flight to its agent, and most
/// connections each of its serving threads keeps open to it. A cached answer takes the agent well
/// under a millisecond, so a queue of hundreds drains in milliseconds.
pub const AGENT_CONCURRENCY: usize = 16;

/// Grants kept with the answer they were decoded from: a pod asks for a
/// handful of distinct things.
pub const DECODED_KEPT: usize = 16;

/// The longest a request to the agent takes, its wait for a turn included.
/// Longer than the agent's own upstream timeout would be pointless: the
/// SDKs retry a 503 sooner than they would wait.
const AGENT_TIMEOUT: Duration = Duration::from_secs(20);

/// The largest answer read from the agent: a grant is a few kilobytes (a
/// Google access token, an AWS session token), an error less.
const MAX_ANSWER: usize = 256 * 1024;

/// Pauses before sending again a request that never reached the agent:
/// refused while the agent restarts (a rolling update with `hostPort`, a
/// crash), or a pooled connection the agent closed as it was reused. They
/// hold such a request up to 0.7 s in all, what an agent restarting in
/// place takes to listen again (0.2 s measured in the pod harness's
/// upgrade scenario), yet under the shortest SDK read timeout (the AWS
/// SDK for JavaScript's container provider: 1 s) so the SDK gets the
/// sidecar's 503 and retries rather than a timeout of its own.
const RESEND_AFTER: [Duration; 5] = [
    Duration::from_millis(50),
    Duration::from_millis(100),
    Duration::from_millis(150),
    Duration::from_millis(200),
    Duration::from_millis(200),
];

/// hyper's pooled client, over TLS when the agent's URL is `https://`.
type AgentClient = Client<Connector, Full<Bytes>>;
/// What the clients of the agent connect with (TCP, and TLS for `https://`).
type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

/// A client of the node agent's `/v1/token`.
///
/// It speaks to the agent through hyper's pooled client rather than
/// reqwest: on the path where every SDK call reaches the agent, reqwest's
/// layers (its redirect policy and its response both parse the URL again,
/// its retry and redirect services wrap every request) were about a third
/// of the sidecar's instructions per request (callgrind, 2,000 requests).
/// The agent is one fixed address that never redirects, so none of them
/// is needed.
pub struct RemoteBroker {
    /// Builds a client with a pool of its own (see [`RemoteBroker::client`]).
    connector: Connector,
    /// Tells this broker's per-thread clients from other brokers'.
    id: u64,
    /// Parsed once, not on every request.
    token_uri: Uri,
    health_uri: Uri,
    /// [`AGENT_CONCURRENCY`] permits, one per request in flight.
    turns: Semaphore,
    /// The grants last decoded and their answers' bytes, most recent
    /// first, at most [`DECODED_KEPT`].
    decoded: std::sync::Mutex<Vec<(Bytes, Grant)>>,
}

/// Why a client of the node agent cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum AgentClientError {
    /// The agent's URL does not parse (the configuration's check refuses
    /// such a URL first).
    #[error("the node agent's URL {0:?} is not a URL: {1}")]
    Url(String, hyper::http::uri::InvalidUri),
    /// rustls refused its own default protocol versions.
    #[error("TLS for the node agent: {0}")]
    Tls(tokio_rustls::rustls::Error),
}

/// What a request to the agent came to.
enum Sent {
    /// The agent answered: its status and body.
    Answer(hyper::StatusCode, Bytes),
    /// No answer came: the connection was refused or closed before one.
    /// Safe to send again.
    Unanswered(String),
    /// The deadline passed, or the answer could not be read: final. The
    /// text is the whole message.
    Failed(String),
}

impl RemoteBroker {
    /// A client of the agent at `agent_url` (its base URL; a trailing `/` is
    /// ignored). An `http://` agent, the node-local default, is reached without
    /// loading TLS roots; an `https://` one is verified against the
    /// system's. Connections time out after 2 s and requests after 20 s, at
    /// most [`AGENT_CONCURRENCY`] are in flight, and redirects are not
    /// followed.
    pub fn new(agent_url: &str) -> Result<Self, AgentClientError> {
        let base = agent_url.trim_end_matches('/');
        let uri = |path: &str| {
            format!("{base}{path}")
                .parse::<Uri>()
                .map_err(|e| AgentClientError::Url(base.to_string(), e))
        };
        let (token_uri, health_uri) = (uri(TOKEN_PATH)?, uri("/healthz")?);
        let mut roots = tokio_rustls::rustls::RootCertStore::empty();
        if token_uri.scheme() == Some(&hyper::http::uri::Scheme::HTTPS) {
            for cert in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(cert);
            }
        }
        let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
        let tls = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(AgentClientError::Tls)?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut tcp = HttpConnector::new();
        tcp.set_connect_timeout(Some(Duration::from_secs(2)));
        tcp.set_nodelay(true);
        tcp.enforce_http(false);
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(tcp);
        static IDS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(RemoteBroker {
            connector,
            id: IDS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            token_uri,
            health_uri,
            turns: Semaphore::new(AGENT_CONCURRENCY),
            decoded: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// This thread's client of the agent, with a connection pool of its
    /// own.
    ///
    /// Why per thread: the sidecar serves its SDK endpoints from threads
    /// that each run a runtime of their own (`lanyard_http::per_thread`),
    /// and a pooled connection's task runs on the runtime that opened it.
    /// With one shared pool, a request on one thread used a connection
    /// driven by the other, and every exchange woke the other CPU. Each
    /// thread's requests now ride connections its own runtime drives.
    /// In-flight requests stay bounded by [`AGENT_CONCURRENCY`] in all;
    /// idle connections by that many per thread.
    fn client(&self) -> AgentClient {
        thread_local! {
            static CLIENTS: std::cell::RefCell<Vec<(u64, AgentClient)>> =
                const { std::cell::RefCell::new(Vec::new()) };
        }
        CLIENTS.with_borrow_mut(|clients| {
            if let Some((_, client)) = clients.iter().find(|(id, _)| *id == self.id) {
                return client.clone();
            }
            // Bounded: a thread keeps the clients of the last few brokers
            // it served (a process has one; tests make more).
            if clients.len() >= 4 {
                clients.remove(0);
            }
            let client = Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(AGENT_CONCURRENCY)
                // INVARIANT: shorter than the agent's idle timeout (10 s,
                // `http::Limits::api`), so a pooled connection is dropped
                // here before the agent closes it under a request being sent.
                .pool_idle_timeout(Duration::from_secs(5))
                .pool_timer(TokioTimer::new())
                .build(self.connector.clone());
            clients.push((self.id, client.clone()));
            client
        })
    }

    /// Whether the agent answers its health check (for the sidecar's readiness).
    pub async fn agent_healthy(&self) -> bool {
        let Ok(request) = Request::get(self.health_uri.clone()).body(Full::default()) else {
            return false;
        };
        let deadline = Instant::now() + Duration::from_secs(1);
        matches!(self.exchange(request, deadline).await, Sent::Answer(status, _) if status.is_success())
    }

    /// Sends `request` and reads the whole answer, all by `deadline`.
    async fn exchange(&self, request: Request<Full<Bytes>>, deadline: Instant) -> Sent {
        let response = match tokio::time::timeout_at(deadline, self.client().request(request)).await
        {
            Err(_) => return Sent::Failed("node agent did not answer in time".into()),
            // INVARIANT: the legacy client fails a request only before the
            // answer's head arrived (refused, reset, closed unanswered), so
            // the agent never answered it.
            Ok(Err(e)) => return Sent::Unanswered(lanyard_core::error_text::with_causes(&e)),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_ANSWER).collect();
        match tokio::time::timeout_at(deadline, body).await {
            Ok(Ok(body)) => Sent::Answer(status, body.to_bytes()),
            Ok(Err(e)) => Sent::Failed(format!("node agent's answer could not be read: {e}")),
            Err(_) => Sent::Failed("node agent's answer did not arrive in time".into()),
        }
    }

    /// Posts `request`, sending it again (after [`RESEND_AFTER`]) when it
    /// failed before any answer came: a token request is safe to repeat,
    /// since the agent decides it afresh and serves it from one exchange.
    /// An answer, even an error status, or a timeout is never repeated.
    async fn send(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
        deadline: Instant,
    ) -> Result<(hyper::StatusCode, Bytes), BrokerError> {
        let body = Bytes::from(serde_json::to_vec(request).map_err(|e| {
            BrokerError::Unavailable(format!("the request cannot be written: {e}"))
        })?);
        let mut bearer = HeaderValue::from_str(&format!("Bearer {}", subject.expose_secret()))
            .map_err(|_| {
                BrokerError::Unavailable("the projected token is not a header value".into())
            })?;
        bearer.set_sensitive(true);
        let mut pauses = RESEND_AFTER.iter();
        loop {
            let mut post = Request::new(Full::new(body.clone()));
            *post.method_mut() = Method::POST;
            *post.uri_mut() = self.token_uri.clone();
            post.headers_mut().insert(AUTHORIZATION, bearer.clone());
            post.headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let why = match self.exchange(post, deadline).await {
                Sent::Answer(status, body) => return Ok((status, body)),
                Sent::Failed(why) => return Err(BrokerError::Unavailable(why)),
                Sent::Unanswered(why) => why,
            };
            match pauses.next() {
                Some(pause) if Instant::now() + *pause < deadline => {
                    tracing::debug!(error = %why, "node agent request failed before an answer; sending again");
                    tokio::time::sleep(*pause).await;
                }
                _ => {
                    return Err(BrokerError::Unavailable(format!(
                        "node agent unreachable: {why}"
                    )))
                }
            }
        }
    }
}

impl RemoteBroker {
    /// The grant an answer's `body` holds: a kept one when the bytes are
    /// the same, else decoded and kept.
    fn grant_of(&self, body: Bytes) -> Result<Grant, BrokerError> {
        if let Ok(mut kept) = self.decoded.lock() {
            if let Some(i) = kept.iter().position(|(bytes, _)| *bytes == body) {
                let entry = kept.remove(i);
                let grant = entry.1.clone();
                kept.insert(0, entry);
                return Ok(grant);
            }
        }
        let grant = serde_json::from_slice::<WireGrant>(&body)
            .map(Grant::from)
            .map_err(|e| {
                BrokerError::Unavailable(format!("node agent answered an unreadable grant: {e}"))
            })?;
        if let Ok(mut kept) = self.decoded.lock() {
            kept.truncate(DECODED_KEPT - 1);
            kept.insert(0, (body, grant.clone()));
        }
        Ok(grant)
    }
}

#[async_trait::async_trait]
impl TokenBroker for RemoteBroker {
    async fn request(
        &self,
        subject: &SecretString,
        request: &TokenRequest,
    ) -> Result<Grant, BrokerError> {
        let deadline = Instant::now() + AGENT_TIMEOUT;
        // INVARIANT: the permit is held until the whole response is read,
        // so the connection is back in the pool before another request may
        // start, and no more than AGENT_CONCURRENCY connections are open.
        let _turn = match tokio::time::timeout_at(deadline, self.turns.acquire()).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_)) | Err(_) => {
                return Err(BrokerError::Unavailable(format!(
                "node agent busy: no turn among {AGENT_CONCURRENCY} requests in flight within {} s",
                AGENT_TIMEOUT.as_secs()
            )))
            }
        };
        let (status, body) = self.send(subject, request, deadline).await?;
        if status.is_success() {
            return self.grant_of(body);
        }
        match serde_json::from_slice::<ErrorBody>(&body) {
            Ok(err) => Err(err.error.into()),
            Err(_) => Err(BrokerError::Unavailable(format!(
                "node agent answered HTTP {status}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use axum::extract::{ConnectInfo, State};

    use super::*;
    use lanyard_core::cloud::{Cloud, Identity, Kind, Surface};

    /// What the fake agent saw.
    #[derive(Default)]
    struct Seen {
        in_flight: AtomicUsize,
        most_in_flight: AtomicUsize,
        answered: AtomicUsize,
        connections: Mutex<HashSet<SocketAddr>>,
    }

    async fn token(
        State(seen): State<Arc<Seen>>,
        ConnectInfo(peer): ConnectInfo<SocketAddr>,
    ) -> axum::Json<WireGrant> {
        seen.connections.lock().unwrap().insert(peer);
        let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        seen.most_in_flight.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        seen.in_flight.fetch_sub(1, Ordering::SeqCst);
        seen.answered.fetch_add(1, Ordering::SeqCst);
        axum::Json(WireGrant {
            identity: Identity {
                cloud: Cloud::Azure,
                id: "client".into(),
                account: "tenant".into(),
                account_number: None,
                source: lanyard_core::cloud::Source::Federation,
                via: None,
            },
            credential: None,
            listed: None,
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_burst_reaches_the_agent_a_bounded_number_at_a_time_over_few_connections() {
        let seen = Arc::new(Seen::default());
        let router = axum::Router::new()
            .route(TOKEN_PATH, axum::routing::post(token))
            .with_state(seen.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        let broker = Arc::new(RemoteBroker::new(&format!("http://{addr}/")).unwrap());
        let burst = 10 * AGENT_CONCURRENCY;
        let calls: Vec<_> = (0..burst)
            .map(|_| {
                let broker = broker.clone();
                tokio::spawn(async move {
                    let request =
                        TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::AzureImds);
                    broker
                        .request(&SecretString::from("projected".to_string()), &request)
                        .await
                })
            })
            .collect();
        for call in calls {
            let grant = call
                .await
                .unwrap()
                .expect("every call of the burst is answered");
            assert_eq!(grant.identity.id, "client");
        }
        assert_eq!(seen.answered.load(Ordering::SeqCst), burst);
        let most = seen.most_in_flight.load(Ordering::SeqCst);
        assert!(
            (2..=AGENT_CONCURRENCY).contains(&most),
            "{most} requests were in flight at once"
        );
        // Each of the runtime's two threads has a pool of its own.
        let connections = seen.connections.lock().unwrap().len();
        assert!(
            connections <= 2 * AGENT_CONCURRENCY,
            "{connections} connections for a burst of {burst}"
        );
    }

    /// An answer byte for byte the same as a kept one is its grant again:
    /// the same credential, rendered body and all; another answer is
    /// decoded; the kept ones are bounded.
    #[test]
    fn the_same_answer_is_the_same_grant_without_decoding_it_again() {
        let broker = RemoteBroker::new("http://127.0.0.1:9").unwrap();
        let body = |token: &str| {
            bytes::Bytes::from(
                serde_json::json!({
                    "identity": {"cloud": "azure", "id": "client", "account": "tenant"},
                    "credential": {"type": "token", "access_token": token,
                                   "issued_at": 1, "expires_at": 4_000_000_000u64}})
                .to_string(),
            )
        };
        let credential = |g: Grant| g.credential.expect("a credential");
        let first = credential(broker.grant_of(body("a")).unwrap());
        let again = credential(broker.grant_of(body("a")).unwrap());
        assert!(Arc::ptr_eq(&first, &again), "decoded again");
        let other = credential(broker.grant_of(body("b")).unwrap());
        assert!(!Arc::ptr_eq(&first, &other));
        for i in 0..DECODED_KEPT {
            broker.grant_of(body(&format!("t{i}"))).unwrap();
        }
        assert_eq!(broker.decoded.lock().unwrap().len(), DECODED_KEPT);
        let evicted = credential(broker.grant_of(body("a")).unwrap());
        assert!(!Arc::ptr_eq(&first, &evicted), "kept beyond the bound");
        assert!(broker.grant_of(bytes::Bytes::from_static(b"{")).is_err());
    }

    /// An agent on a raw socket: each connection reads one request head and
    /// body, then gets `answers[n]` (n counting connections), where `None`
    /// closes the connection without a word.
    async fn raw_agent(answers: Vec<Option<&'static str>>) -> (SocketAddr, Arc<AtomicUsize>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        tokio::spawn(async move {
            for answer in answers {
                let (mut conn, _) = listener.accept().await.unwrap();
                counted.fetch_add(1, Ordering::SeqCst);
                let mut buf = vec![0u8; 16 * 1024];
                let mut got = Vec::new();
                // The request is small: read until its JSON body closes.
                while !got.ends_with(b"}") {
                    let n = conn.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                if let Some(answer) = answer {
                    let reply = format!(
                        "HTTP/1.1 {answer}\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
                    );
                    conn.write_all(reply.as_bytes()).await.unwrap();
                }
            }
        });
        (addr, connections)
    }

    #[tokio::test]
    async fn an_answer_over_the_bound_is_refused_not_read_whole() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 16 * 1024];
            let _ = conn.read(&mut buf).await;
            let size = 4 * MAX_ANSWER;
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {size}\r\n\r\n"
            );
            conn.write_all(head.as_bytes()).await.unwrap();
            // The client stops reading at the bound: writing may fail.
            let _ = conn.write_all(&vec![b' '; size]).await;
        });
        let broker = RemoteBroker::new(&format!("http://{addr}")).unwrap();
        let request = TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::AzureImds);
        let err = broker
            .request(&SecretString::from("projected".to_string()), &request)
            .await
            .unwrap_err();
        assert!(matches!(err, BrokerError::Unavailable(_)), "{err}");
        assert!(err.to_string().contains("length limit exceeded"), "{err}");
    }

    #[tokio::test]
    async fn a_request_the_agent_dropped_unanswered_is_sent_again_and_an_answer_never_is() {
        let request = TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::AzureImds);
        let subject = SecretString::from("projected".to_string());
        // Closed twice without an answer, then a 503 with an unreadable body:
        // three sends, and the 503 is the result.
        let (addr, connections) =
            raw_agent(vec![None, None, Some("503 Service Unavailable")]).await;
        let broker = RemoteBroker::new(&format!("http://{addr}")).unwrap();
        let err = broker.request(&subject, &request).await.unwrap_err();
        assert_eq!(connections.load(Ordering::SeqCst), 3);
        assert!(err.to_string().contains("HTTP 503"), "{err}");
        // An answer on the first connection is final, whatever its status.
        let (addr, connections) = raw_agent(vec![Some("500 Internal Server Error"), None]).await;
        let broker = RemoteBroker::new(&format!("http://{addr}")).unwrap();
        let err = broker.request(&subject, &request).await.unwrap_err();
        assert!(err.to_string().contains("HTTP 500"), "{err}");
        assert_eq!(connections.load(Ordering::SeqCst), 1);
        // Dropped more often than it is sent again: unreachable.
        let (addr, connections) = raw_agent(vec![None; 1 + RESEND_AFTER.len() + 1]).await;
        let broker = RemoteBroker::new(&format!("http://{addr}")).unwrap();
        let err = broker.request(&subject, &request).await.unwrap_err();
        assert!(err.to_string().contains("node agent unreachable"), "{err}");
        assert_eq!(connections.load(Ordering::SeqCst), 1 + RESEND_AFTER.len());
    }

    #[tokio::test]
    async fn a_request_is_held_while_the_agent_restarts_and_served_once_it_listens() {
        let request = TokenRequest::new(Cloud::Azure, Kind::Identity, Surface::AzureImds);
        let subject = SecretString::from("projected".to_string());
        // A port nothing listens on for 300 ms: connections are refused.
        let addr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let seen = Arc::new(Seen::default());
        let router = axum::Router::new()
            .route(TOKEN_PATH, axum::routing::post(token))
            .with_state(seen.clone());
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.set_reuseaddr(true).unwrap();
            socket.bind(addr).unwrap();
            let listener = socket.listen(64).unwrap();
            axum::serve(
                listener,
                router.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        let broker = RemoteBroker::new(&format!("http://{addr}")).unwrap();
        let began = Instant::now();
        let grant = broker
            .request(&subject, &request)
            .await
            .expect("answered once the agent listens again");
        assert_eq!(grant.identity.id, "client");
        assert_eq!(seen.answered.load(Ordering::SeqCst), 1);
        assert!(began.elapsed() >= Duration::from_millis(300));
        // Nothing listening at all: unreachable once the pauses are spent.
        let refused = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        let broker = RemoteBroker::new(&format!("http://{refused}")).unwrap();
        let began = Instant::now();
        let err = broker.request(&subject, &request).await.unwrap_err();
        assert!(err.to_string().contains("node agent unreachable"), "{err}");
        let held: Duration = RESEND_AFTER.iter().sum();
        assert!(began.elapsed() >= held, "{:?}", began.elapsed());
    }
}
