//! The bounds every Lanyard listener keeps against slow, idle and hostile
//! clients (`lanyard::http::server`), driven over raw TCP: oversized
//! headers get 431, a half-sent request is cut at the header-read timeout,
//! HTTP/2 prior knowledge is not spoken, and at the connection bound the
//! longest-idle connection makes room while busy ones are never cut.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use lanyard::http::{bind, spawn_server_with, Limits, Shutdown, ShutdownTrigger};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

struct Server {
    addr: SocketAddr,
    trigger: ShutdownTrigger,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    /// `/slow` waits for a permit: tests hold requests in flight with it.
    gate: Arc<Semaphore>,
}

async fn server(limits: Limits) -> Server {
    let gate = Arc::new(Semaphore::new(0));
    let slow_gate = gate.clone();
    let router = axum::Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/slow",
            get(move || {
                let gate = slow_gate.clone();
                async move {
                    let _permit = gate.acquire().await;
                    "slow"
                }
            }),
        );
    let listener = bind("127.0.0.1:0".parse().unwrap(), "test").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (trigger, shutdown) = Shutdown::new();
    let task = spawn_server_with(listener, router, shutdown, limits);
    Server {
        addr,
        trigger,
        task,
        gate,
    }
}

fn limits(max_connections: usize) -> Limits {
    Limits {
        max_header_bytes: 16 * 1024,
        header_read_timeout: Duration::from_millis(600),
        max_connections,
    }
}

/// Sends `request` and reads until the server closes or `wait` passes.
async fn exchange(stream: &mut TcpStream, request: &[u8], wait: Duration) -> String {
    stream.write_all(request).await.unwrap();
    read_for(stream, wait).await
}

async fn read_for(stream: &mut TcpStream, wait: Duration) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Err(_) | Ok(Err(_)) => break,
            Ok(Ok(n)) => {
                out.extend_from_slice(&buf[..n]);
                if out.windows(4).any(|w| w == b"\r\n\r\n") && !out.starts_with(b"HTTP/1.1 100") {
                    // A complete head; the bodies here are tiny.
                    if let Ok(Ok(n)) =
                        tokio::time::timeout(Duration::from_millis(50), stream.read(&mut buf)).await
                    {
                        out.extend_from_slice(&buf[..n]);
                    }
                    break;
                }
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// True when the server has closed `stream` (EOF or reset) within `wait`.
async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(wait, stream.read(&mut buf)).await,
        Ok(Ok(0)) | Ok(Err(_))
    )
}

const GET: &[u8] = b"GET / HTTP/1.1\r\nHost: t\r\n\r\n";

#[tokio::test]
async fn oversized_headers_get_431_and_normal_ones_pass() {
    let s = server(limits(16)).await;
    let mut ok = TcpStream::connect(s.addr).await.unwrap();
    let big = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(12 * 1024)
    );
    let answer = exchange(&mut ok, big.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let mut huge = TcpStream::connect(s.addr).await.unwrap();
    let request = format!(
        "GET / HTTP/1.1\r\nHost: t\r\nX-Pad: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let answer = exchange(&mut huge, request.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    // Many small headers adding up past the bound count too.
    let mut many = TcpStream::connect(s.addr).await.unwrap();
    let headers: String = (0..90)
        .map(|i| format!("X-H{i}: {}\r\n", "b".repeat(200)))
        .collect();
    let request = format!("GET / HTTP/1.1\r\nHost: t\r\n{headers}\r\n");
    let answer = exchange(&mut many, request.as_bytes(), Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
}

/// A head far past the bound still reaches the client as a `431`: the
/// server stops writing, then drains what the client is still sending
/// before it closes, so no reset overtakes the answer (nginx's lingering
/// close). A client that writes its whole request before it reads (Python's
/// `http.client`, most blocking clients) shows it: with more than the
/// sockets' buffers hold still to send when the server closes (48 MB here,
/// past loopback's default maximum buffers; a 270 kB token does it on a
/// real network's smaller windows), its write fails with a broken pipe
/// unless the server drains.
#[tokio::test]
async fn a_huge_head_gets_its_431_and_not_a_reset() {
    let s = server(limits(64)).await;
    let mut request = b"GET / HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer ".to_vec();
    request.resize(request.len() + 48 * 1024 * 1024, b'a');
    request.extend_from_slice(b"\r\n\r\n");
    for attempt in 0..3 {
        let mut stream = TcpStream::connect(s.addr).await.unwrap();
        stream
            .write_all(&request)
            .await
            .unwrap_or_else(|e| panic!("attempt {attempt}: the write failed: {e}"));
        let answer = read_for(&mut stream, Duration::from_secs(5)).await;
        assert!(
            answer.starts_with("HTTP/1.1 431"),
            "attempt {attempt}: {answer:?}"
        );
    }
    // A real client with a 270 kB bearer token, as the agent API gets one.
    let client = reqwest::Client::new();
    let token = "a".repeat(270_000);
    for attempt in 0..10 {
        let answer = client
            .get(format!("http://{}/", s.addr))
            .bearer_auth(&token)
            .send()
            .await;
        match answer {
            Ok(resp) => assert_eq!(resp.status(), 431, "attempt {attempt}"),
            Err(e) => panic!("attempt {attempt}: no answer but {e:?}"),
        }
    }
    // The server still serves.
    let ok = client
        .get(format!("http://{}/", s.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}

#[tokio::test]
async fn a_half_sent_request_and_an_idle_connection_are_closed() {
    let s = server(limits(16)).await;
    let mut slow = TcpStream::connect(s.addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: t\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    assert!(closed_within(&mut slow, Duration::from_secs(5)).await);
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(400), "closed after {took:?}");

    // A keep-alive connection idle past the timeout is closed too.
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    let answer = exchange(&mut idle, GET, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
}

#[tokio::test]
async fn http2_prior_knowledge_is_not_spoken() {
    let s = server(limits(16)).await;
    let mut h2 = TcpStream::connect(s.addr).await.unwrap();
    // The client preface, then an empty SETTINGS frame.
    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]);
    let answer = exchange(&mut h2, &preface, Duration::from_secs(2)).await;
    // An HTTP/2 server answers with its own SETTINGS frame (type 4), never
    // an HTTP/1 status line; here the connection is refused as HTTP/1.
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 4"),
        "{answer:?}"
    );
    assert!(!answer.as_bytes().starts_with(&[0, 0]), "{answer:?}");
}

#[tokio::test]
async fn at_the_bound_the_longest_idle_connection_makes_room() {
    let s = server(Limits {
        header_read_timeout: Duration::from_secs(30),
        ..limits(3)
    })
    .await;
    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        let answer = exchange(&mut c, GET, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        conns.push(c);
    }
    // The second and third are used again: the first is idle longest.
    for c in &mut conns[1..] {
        let answer = exchange(c, GET, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let mut newcomer = TcpStream::connect(s.addr).await.unwrap();
    let answer = exchange(&mut newcomer, GET, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(closed_within(&mut conns[0], Duration::from_secs(2)).await);
    for c in &mut conns[1..] {
        let answer = exchange(c, GET, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}

#[tokio::test]
async fn busy_connections_are_never_cut_and_a_newcomer_is_turned_away() {
    let s = server(Limits {
        header_read_timeout: Duration::from_secs(30),
        ..limits(2)
    })
    .await;
    let mut busy = Vec::new();
    for _ in 0..2 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        busy.push(c);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Both connections have a request in flight: the newcomer is closed.
    let mut newcomer = TcpStream::connect(s.addr).await.unwrap();
    let answer = exchange(&mut newcomer, GET, Duration::from_secs(2)).await;
    assert!(answer.is_empty(), "{answer}");
    // The busy requests complete.
    s.gate.add_permits(2);
    for c in &mut busy {
        let answer = read_for(c, Duration::from_secs(2)).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("slow"), "{answer}");
    }
    // Idle now: a later connection takes the place of one of them.
    let mut later = TcpStream::connect(s.addr).await.unwrap();
    let answer = exchange(&mut later, GET, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn shutdown_lets_the_request_in_flight_finish_and_closes_idle_ones() {
    let s = server(limits(16)).await;
    let mut idle = TcpStream::connect(s.addr).await.unwrap();
    let answer = exchange(&mut idle, GET, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let mut busy = TcpStream::connect(s.addr).await.unwrap();
    busy.write_all(b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    s.trigger.trigger();
    assert!(closed_within(&mut idle, Duration::from_secs(2)).await);
    assert!(!s.task.is_finished());
    s.gate.add_permits(1);
    let answer = read_for(&mut busy, Duration::from_secs(2)).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let ended = tokio::time::timeout(Duration::from_secs(5), s.task).await;
    assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
    // No longer accepting.
    assert!(TcpStream::connect(s.addr).await.is_err());
}

/// A log writer that keeps what it is given.
#[derive(Clone, Default)]
struct Kept(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Kept {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The serving crate logs under the targets its lines had inside the
/// product (`lanyard::http…`), so operators' filters and the benchmarks'
/// `warn,lanyard::http=info` still select the line that reports an address.
#[tokio::test]
async fn serving_logs_under_the_products_own_targets() {
    let kept = Kept::default();
    let writer = kept.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "warn,lanyard::http=info",
        ))
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);
    let listener = bind("127.0.0.1:0".parse().unwrap(), "test endpoints")
        .await
        .unwrap();
    let threads =
        lanyard::http::per_thread::bind("127.0.0.1:0".parse().unwrap(), "threaded endpoints", 1)
            .await
            .unwrap();
    let text = String::from_utf8(kept.0.lock().unwrap().clone()).unwrap();
    for (what, addr) in [
        ("test endpoints", listener.local_addr().unwrap()),
        ("threaded endpoints", threads.local_addr()),
    ] {
        assert!(
            text.lines()
                .any(|l| l.contains(&format!("listening for the {what}"))
                    && l.contains("lanyard::http")
                    && l.contains(&addr.to_string())),
            "{text}"
        );
    }
}
