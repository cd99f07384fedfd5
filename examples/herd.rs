//! `herd`: a load generator for Lanyard's token endpoints.
//!
//! Cold-herd mode (the default): `--concurrency C` workers each open their
//! own TCP connection, wait at a barrier until every connection is
//! established (or has failed), then all send their request at once, as a
//! node's pods do when they start together against a cold cache. Every
//! request goes on a connection of its own (`Connection: close`).
//!
//! ```sh
//! cargo build --release --example herd
//! ulimit -n 65536   # one descriptor per connection, plus the server's
//! target/release/examples/herd --concurrency 1000 \
//!     --url 'http://127.0.0.1:8642/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https%3A%2F%2Fstorage.azure.com%2F' \
//!     --header 'Metadata: true'
//! ```
//!
//! Prints one JSON line on stdout:
//! `{requests, ok, errors, distinct_tokens, p50_ms, p99_ms, max_ms, wall_ms, ...}`.
//! `ok` counts 200 responses whose JSON body carries a string `access_token`;
//! everything else (connect failures and timeouts, read errors, other
//! statuses, 200s without a token) is an error, broken down in
//! `error_kinds`. `distinct_tokens` counts distinct `access_token` values
//! among the `ok` responses (tokens are kept only as SHA-256 digests).
//!
//! Latency is measured from the moment a request is written on an
//! established connection to the end of its response, for every request
//! that got a connection (so timeouts count at the timeout, and failures
//! count too); connect times are reported apart (`connect_p99_ms`,
//! `connect_max_ms`). `wall_ms` runs from the barrier's release to the last
//! response.
//!
//! With `--requests R` larger than `C`, each worker sends its share in
//! sequence, each on a new connection; only the first waits at the barrier.
//!
//! Pool mode (`--connections K`): the workers share a pool of at most `K`
//! keep-alive connections, opened as needed, as an HTTP client's pool does;
//! latency then also includes waiting for a free connection and, for the
//! first use of each, connecting.
//!
//! Only plain `http://` to loopback addresses is accepted unless
//! `--allow-non-loopback` is given.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{Barrier, Mutex, Semaphore};

/// Largest response head and body herd will buffer.
const MAX_HEAD: usize = 64 * 1024;
const MAX_BODY: usize = 16 * 1024 * 1024;

#[derive(Parser, Debug)]
#[command(
    name = "herd",
    about = "Fires a herd of concurrent HTTP GETs at one URL and reports latency, errors and distinct access tokens as one JSON line."
)]
struct Args {
    /// Target URL (http:// only).
    #[arg(long)]
    url: String,
    /// Extra request header, `Name: value`; repeatable.
    #[arg(long = "header", value_name = "NAME: VALUE", value_parser = parse_header)]
    headers: Vec<(String, String)>,
    /// Workers released together by the barrier.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    concurrency: u32,
    /// Total requests (default: one per worker).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=100_000_000))]
    requests: Option<u32>,
    /// Share a pool of at most this many keep-alive connections instead of
    /// one new connection per request.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    connections: Option<u32>,
    /// Per-request timeout (write + full response), milliseconds.
    #[arg(long, default_value_t = 30_000)]
    timeout_ms: u64,
    /// Connect timeout, milliseconds.
    #[arg(long, default_value_t = 10_000)]
    connect_timeout_ms: u64,
    /// Allow targets that do not resolve to a loopback address.
    #[arg(long)]
    allow_non_loopback: bool,
}

fn parse_header(raw: &str) -> Result<(String, String), String> {
    let (name, value) = raw
        .split_once(':')
        .ok_or_else(|| format!("header {raw:?} is not `Name: value`"))?;
    let name = name.trim();
    let value = value.trim();
    let token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token_char) {
        return Err(format!("header name {name:?} is not a valid HTTP token"));
    }
    if value.chars().any(|c| c == '\r' || c == '\n' || c == '\0') {
        return Err(format!(
            "header {name} has a control character in its value"
        ));
    }
    let lower = name.to_ascii_lowercase();
    if matches!(
        lower.as_str(),
        "host" | "connection" | "content-length" | "transfer-encoding"
    ) {
        return Err(format!("header {name} is set by herd itself"));
    }
    Ok((name.to_string(), value.to_string()))
}

/// Where to connect and what to send.
struct Target {
    addr: SocketAddr,
    /// Request bytes with `Connection: close`.
    close: Vec<u8>,
    /// Request bytes for a keep-alive connection.
    keep_alive: Vec<u8>,
}

async fn target(args: &Args) -> Result<Target, String> {
    let url = url::Url::parse(&args.url).map_err(|e| format!("--url {:?}: {e}", args.url))?;
    if url.scheme() != "http" {
        return Err(format!(
            "--url {:?}: only http:// is supported (herd measures a loopback endpoint)",
            args.url
        ));
    }
    let host = url
        .host_str()
        .ok_or_else(|| format!("--url {:?} has no host", args.url))?;
    let port = url.port_or_known_default().unwrap_or(80);
    let addr = tokio::net::lookup_host((host.trim_matches(['[', ']']), port))
        .await
        .map_err(|e| format!("cannot resolve {host}: {e}"))?
        .next()
        .ok_or_else(|| format!("{host} resolves to no address"))?;
    if !addr.ip().is_loopback() && !args.allow_non_loopback {
        return Err(format!(
            "{host} resolves to {}, which is not loopback; pass --allow-non-loopback to load it anyway",
            addr.ip()
        ));
    }
    let mut path = url.path().to_string();
    if let Some(q) = url.query() {
        path.push('?');
        path.push_str(q);
    }
    let host_header = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_string(),
    };
    let mut head = format!(
        "GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: lanyard-herd\r\nAccept: */*\r\n"
    );
    for (name, value) in &args.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    Ok(Target {
        addr,
        close: format!("{head}Connection: close\r\n\r\n").into_bytes(),
        keep_alive: format!("{head}\r\n").into_bytes(),
    })
}

/// Why a request did not count as `ok`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Failure {
    Connect,
    ConnectTimeout,
    Timeout,
    Io,
    Status(u16),
    /// 200 without a string `access_token` in a JSON body.
    NoToken,
}

impl Failure {
    fn kind(&self) -> String {
        match self {
            Failure::Connect => "connect".into(),
            Failure::ConnectTimeout => "connect_timeout".into(),
            Failure::Timeout => "timeout".into(),
            Failure::Io => "io".into(),
            Failure::Status(s) => format!("status_{s}"),
            Failure::NoToken => "no_token".into(),
        }
    }
}

/// One request's record.
struct Sample {
    /// Time to connect, if this request opened a connection.
    connect_ms: Option<f64>,
    /// Request latency, if the request got a connection.
    latency_ms: Option<f64>,
    /// SHA-256 of the access token, or why there is none.
    result: Result<[u8; 32], (Failure, String)>,
    /// When the request started (after the barrier) and ended.
    start: Instant,
    end: Instant,
}

struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
}

struct Response {
    status: u16,
    body: Vec<u8>,
    reusable: bool,
}

async fn connect(addr: SocketAddr, limit: Duration) -> Result<(Conn, f64), (Failure, String)> {
    let start = Instant::now();
    match tokio::time::timeout(limit, TcpStream::connect(addr)).await {
        Err(_) => Err((
            Failure::ConnectTimeout,
            format!("connect to {addr} timed out after {limit:?}"),
        )),
        Ok(Err(e)) => Err((Failure::Connect, format!("connect to {addr}: {e}"))),
        Ok(Ok(stream)) => {
            let _ = stream.set_nodelay(true);
            Ok((
                Conn {
                    stream,
                    buf: Vec::with_capacity(4096),
                },
                ms(start.elapsed()),
            ))
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

impl Conn {
    /// Reads until `buf` holds at least `len` bytes.
    async fn fill(&mut self, len: usize) -> std::io::Result<()> {
        while self.buf.len() < len {
            if self.read_more().await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "connection closed mid-response",
                ));
            }
        }
        Ok(())
    }

    async fn read_more(&mut self) -> std::io::Result<usize> {
        let mut chunk = [0u8; 16 * 1024];
        let n = self.stream.read(&mut chunk).await?;
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(n)
    }

    /// Reads a CRLF-terminated line, returned without its CRLF.
    async fn line(&mut self) -> std::io::Result<Vec<u8>> {
        loop {
            if let Some(at) = find(&self.buf, b"\r\n") {
                let line = self.buf[..at].to_vec();
                self.buf.drain(..at + 2);
                return Ok(line);
            }
            if self.buf.len() > MAX_HEAD {
                return Err(invalid("line too long"));
            }
            self.fill(self.buf.len() + 1).await?;
        }
    }

    async fn exchange(&mut self, request: &[u8]) -> std::io::Result<Response> {
        self.stream.write_all(request).await?;
        // Head.
        let head_end = loop {
            if let Some(at) = find(&self.buf, b"\r\n\r\n") {
                break at;
            }
            if self.buf.len() > MAX_HEAD {
                return Err(invalid("response head too large"));
            }
            if self.read_more().await? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    if self.buf.is_empty() {
                        "connection closed before any response"
                    } else {
                        "connection closed mid-head"
                    },
                ));
            }
        };
        let head = String::from_utf8_lossy(&self.buf[..head_end]).into_owned();
        self.buf.drain(..head_end + 4);
        let mut lines = head.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let mut parts = status_line.split_whitespace();
        let version = parts.next().unwrap_or_default();
        let status: u16 = parts
            .next()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| invalid(&format!("bad status line {status_line:?}")))?;
        let mut content_length = None;
        let mut chunked = false;
        let mut close = version != "HTTP/1.1";
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match name.trim().to_ascii_lowercase().as_str() {
                "content-length" => {
                    content_length = Some(
                        value
                            .parse::<usize>()
                            .map_err(|_| invalid("bad content-length"))?,
                    )
                }
                "transfer-encoding" => {
                    chunked = value.to_ascii_lowercase().contains("chunked");
                }
                "connection" => {
                    let v = value.to_ascii_lowercase();
                    if v.contains("close") {
                        close = true;
                    } else if v.contains("keep-alive") {
                        close = false;
                    }
                }
                _ => {}
            }
        }
        // Body.
        let body = if chunked {
            let mut body = Vec::new();
            loop {
                let size_line = self.line().await?;
                let size_text = String::from_utf8_lossy(&size_line);
                let size_hex = size_text.split(';').next().unwrap_or_default().trim();
                let size =
                    usize::from_str_radix(size_hex, 16).map_err(|_| invalid("bad chunk size"))?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    while !self.line().await?.is_empty() {}
                    break;
                }
                if body.len() + size > MAX_BODY {
                    return Err(invalid("response body too large"));
                }
                self.fill(size + 2).await?;
                body.extend_from_slice(&self.buf[..size]);
                self.buf.drain(..size + 2);
            }
            body
        } else if let Some(len) = content_length {
            if len > MAX_BODY {
                return Err(invalid("response body too large"));
            }
            self.fill(len).await?;
            self.buf.drain(..len).collect()
        } else if status == 204 || status == 304 || (100..200).contains(&status) {
            Vec::new()
        } else {
            // Delimited by the end of the connection.
            close = true;
            while self.read_more().await? > 0 {
                if self.buf.len() > MAX_BODY {
                    return Err(invalid("response body too large"));
                }
            }
            std::mem::take(&mut self.buf)
        };
        Ok(Response {
            status,
            body,
            reusable: !close && self.buf.is_empty(),
        })
    }
}

fn invalid(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

/// Judges a response: the digest of its access token, or why it has none.
fn judge(resp: &Response) -> Result<[u8; 32], (Failure, String)> {
    if resp.status != 200 {
        let snippet: String = String::from_utf8_lossy(&resp.body)
            .chars()
            .take(200)
            .collect();
        return Err((
            Failure::Status(resp.status),
            format!("HTTP {}: {snippet}", resp.status),
        ));
    }
    let body: Value = serde_json::from_slice(&resp.body).map_err(|e| {
        (
            Failure::NoToken,
            format!("200 with a body that is not JSON: {e}"),
        )
    })?;
    let token = body
        .get("access_token")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            (
                Failure::NoToken,
                "200 without a string access_token".to_string(),
            )
        })?;
    Ok(Sha256::digest(token.as_bytes()).into())
}

/// Sends one request on `conn` within `limit`.
async fn timed_exchange(
    conn: &mut Conn,
    request: &[u8],
    limit: Duration,
) -> (f64, Result<Response, (Failure, String)>) {
    let start = Instant::now();
    let result = match tokio::time::timeout(limit, conn.exchange(request)).await {
        Err(_) => Err((
            Failure::Timeout,
            format!("no complete response within {limit:?}"),
        )),
        Ok(Err(e)) => Err((Failure::Io, e.to_string())),
        Ok(Ok(resp)) => Ok(resp),
    };
    (ms(start.elapsed()), result)
}

struct Settings {
    target: Target,
    timeout: Duration,
    connect_timeout: Duration,
}

/// Cold-herd worker: a new connection per request; the first request waits
/// at the barrier once its connection is up (or has failed).
async fn cold_worker(settings: Arc<Settings>, barrier: Arc<Barrier>, count: u32) -> Vec<Sample> {
    let mut samples = Vec::with_capacity(count as usize);
    for k in 0..count {
        let conn = connect(settings.target.addr, settings.connect_timeout).await;
        if k == 0 {
            barrier.wait().await;
        }
        let start = Instant::now();
        let sample = match conn {
            Err(failure) => Sample {
                connect_ms: None,
                latency_ms: None,
                result: Err(failure),
                start,
                end: Instant::now(),
            },
            Ok((mut conn, connect_ms)) => {
                let (latency, resp) =
                    timed_exchange(&mut conn, &settings.target.close, settings.timeout).await;
                Sample {
                    connect_ms: Some(connect_ms),
                    latency_ms: Some(latency),
                    result: resp.and_then(|r| judge(&r)),
                    start,
                    end: Instant::now(),
                }
            }
        };
        samples.push(sample);
    }
    if count == 0 {
        barrier.wait().await;
    }
    samples
}

/// A client-side pool of at most `permits` keep-alive connections.
struct Pool {
    permits: Semaphore,
    idle: Mutex<Vec<Conn>>,
    opened: AtomicUsize,
}

async fn pooled_worker(
    settings: Arc<Settings>,
    barrier: Arc<Barrier>,
    pool: Arc<Pool>,
    count: u32,
) -> Vec<Sample> {
    barrier.wait().await;
    let mut samples = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let start = Instant::now();
        let Ok(_permit) = pool.permits.acquire().await else {
            break;
        };
        let reused = pool.idle.lock().await.pop();
        let (mut conn, connect_ms) = match reused {
            Some(conn) => (conn, None),
            None => match connect(settings.target.addr, settings.connect_timeout).await {
                Ok((conn, t)) => {
                    pool.opened.fetch_add(1, Ordering::Relaxed);
                    (conn, Some(t))
                }
                Err(failure) => {
                    samples.push(Sample {
                        connect_ms: None,
                        latency_ms: None,
                        result: Err(failure),
                        start,
                        end: Instant::now(),
                    });
                    continue;
                }
            },
        };
        let (_, resp) =
            timed_exchange(&mut conn, &settings.target.keep_alive, settings.timeout).await;
        if matches!(&resp, Ok(r) if r.reusable) {
            pool.idle.lock().await.push(conn);
        }
        samples.push(Sample {
            connect_ms,
            latency_ms: Some(ms(start.elapsed())),
            result: resp.and_then(|r| judge(&r)),
            start,
            end: Instant::now(),
        });
    }
    samples
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted.get(rank.clamp(1, sorted.len()) - 1).copied()
}

fn round2(v: Option<f64>) -> Value {
    match v {
        Some(v) => json!((v * 100.0).round() / 100.0),
        None => Value::Null,
    }
}

/// The soft open-files limit, from /proc (Linux).
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn summarize(
    samples: &[Sample],
    released: Instant,
    connections_opened: usize,
    args: &Args,
) -> Value {
    let requests = samples.len();
    let mut tokens = HashSet::new();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    let mut first_error: BTreeMap<String, String> = BTreeMap::new();
    let mut ok = 0usize;
    for s in samples {
        match &s.result {
            Ok(digest) => {
                ok += 1;
                tokens.insert(*digest);
            }
            Err((failure, message)) => {
                *kinds.entry(failure.kind()).or_default() += 1;
                first_error
                    .entry(failure.kind())
                    .or_insert_with(|| message.clone());
            }
        }
    }
    let mut latencies: Vec<f64> = samples.iter().filter_map(|s| s.latency_ms).collect();
    latencies.sort_by(f64::total_cmp);
    let mut connects: Vec<f64> = samples.iter().filter_map(|s| s.connect_ms).collect();
    connects.sort_by(f64::total_cmp);
    // The barrier releases every task at once, but they are scheduled one
    // after another; the wall clock runs from the first start.
    let first = samples
        .iter()
        .map(|s| s.start)
        .min()
        .map_or(released, |s| s.min(released));
    let last = samples.iter().map(|s| s.end).max().unwrap_or(first);
    json!({
        "requests": requests,
        "ok": ok,
        "errors": requests - ok,
        "distinct_tokens": tokens.len(),
        "p50_ms": round2(percentile(&latencies, 50.0)),
        "p99_ms": round2(percentile(&latencies, 99.0)),
        "max_ms": round2(latencies.last().copied()),
        "wall_ms": round2(Some(ms(last.saturating_duration_since(first)))),
        "concurrency": args.concurrency,
        "mode": if args.connections.is_some() { "pool" } else { "cold" },
        "connections_opened": connections_opened,
        "connect_p99_ms": round2(percentile(&connects, 99.0)),
        "connect_max_ms": round2(connects.last().copied()),
        "error_kinds": kinds,
        "first_errors": first_error,
    })
}

async fn run(args: Args) -> Result<Value, String> {
    let settings = Arc::new(Settings {
        target: target(&args).await?,
        timeout: Duration::from_millis(args.timeout_ms),
        connect_timeout: Duration::from_millis(args.connect_timeout_ms),
    });
    let workers = args.concurrency;
    let requests = args.requests.unwrap_or(workers);
    let needed = u64::from(args.connections.unwrap_or(workers).min(workers)) + 32;
    if let Some(limit) = open_files_limit() {
        if limit < needed {
            eprintln!(
                "herd: warning: the open-files limit is {limit} but this run needs about {needed} descriptors; \
                 connections beyond it will fail and count as errors (raise it with `ulimit -n`)"
            );
        }
    }
    // Every worker plus this task, so the release instant is known here.
    let barrier = Arc::new(Barrier::new(workers as usize + 1));
    let pool = args.connections.map(|k| {
        Arc::new(Pool {
            permits: Semaphore::new(k as usize),
            idle: Mutex::new(Vec::new()),
            opened: AtomicUsize::new(0),
        })
    });
    let mut handles = Vec::with_capacity(workers as usize);
    for w in 0..workers {
        // Worker w sends requests w, w + C, w + 2C, ...
        let count = requests / workers + u32::from(w < requests % workers);
        let settings = settings.clone();
        let barrier = barrier.clone();
        handles.push(match &pool {
            Some(pool) => tokio::spawn(pooled_worker(settings, barrier, pool.clone(), count)),
            None => tokio::spawn(cold_worker(settings, barrier, count)),
        });
    }
    barrier.wait().await;
    let released = Instant::now();
    let mut samples = Vec::with_capacity(requests as usize);
    for handle in handles {
        samples.extend(
            handle
                .await
                .map_err(|e| format!("a worker task failed: {e}"))?,
        );
    }
    let opened = match &pool {
        Some(pool) => pool.opened.load(Ordering::Relaxed),
        None => samples.iter().filter(|s| s.connect_ms.is_some()).count(),
    };
    Ok(summarize(&samples, released, opened, &args))
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("herd: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(summary) => {
            println!("{summary}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("herd: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn headers_parse_and_refuse_injection() {
        assert_eq!(
            parse_header("Metadata: true").unwrap(),
            ("Metadata".to_string(), "true".to_string())
        );
        assert!(parse_header("Metadata true").is_err());
        assert!(parse_header("Bad Name: x").is_err());
        assert!(parse_header("X: a\r\nEvil: 1").is_err());
        assert!(parse_header("Host: elsewhere").is_err());
    }

    async fn serve_once(response: &'static [u8]) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = sock.read(&mut buf).await;
            sock.write_all(response).await.unwrap();
        });
        addr
    }

    async fn fetch(response: &'static [u8]) -> Response {
        let addr = serve_once(response).await;
        let (mut conn, _) = connect(addr, Duration::from_secs(5)).await.unwrap();
        conn.exchange(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn reads_content_length_and_chunked_bodies() {
        let r =
            fetch(b"HTTP/1.1 200 OK\r\nContent-Length: 22\r\n\r\n{\"access_token\":\"abc\"}").await;
        assert_eq!(r.status, 200);
        assert!(r.reusable);
        assert!(judge(&r).is_ok());

        let r = fetch(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"acc\r\n11\r\ness_token\":\"abc\"}\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(r.body, b"{\"access_token\":\"abc\"}");
        assert!(judge(&r).is_ok());

        let r = fetch(
            b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}",
        )
        .await;
        assert!(!r.reusable);
        assert_eq!(judge(&r).unwrap_err().0, Failure::Status(503));

        let r = fetch(b"HTTP/1.0 200 OK\r\n\r\n{\"token\":1}").await;
        assert!(!r.reusable);
        assert_eq!(judge(&r).unwrap_err().0, Failure::NoToken);
    }
}
