//! `startup`: how long a Lanyard process takes from `exec` to ready.
//!
//! ```sh
//! target/release/examples/startup --path /readyz --runs 5 -- \
//!     target/sidecar/lanyard-sidecar --agent http://127.0.0.1:9000 --listen 127.0.0.1:{port}
//! ```
//!
//! For each run it picks a free loopback port, substitutes it for `{port}`
//! in the command's arguments, starts the command, and polls
//! `http://127.0.0.1:PORT{path}` every 200 µs until it answers 200; then it
//! reads the process's VmRSS and stops it (SIGTERM, then SIGKILL after
//! 5 s). The clock starts just before `spawn`, so the figure includes the
//! kernel's exec and the dynamic loader, as a container start would. It
//! prints one JSON line: `{runs, ready_ms: [..], p50_ms, max_ms,
//! rss_kib: [..]}`, and exits non-zero if a run was not ready within
//! `--timeout-ms`.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::json;

#[derive(Parser, Debug)]
#[command(about = "Time from exec to a 200 on a readiness path, over several runs")]
struct Args {
    /// The readiness path polled on the substituted port.
    #[arg(long, default_value = "/readyz")]
    path: String,
    /// How many times the command is started.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Give up on a run after this long.
    #[arg(long, default_value_t = 10_000)]
    timeout_ms: u64,
    /// The command and its arguments; `{port}` is replaced by the port.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn free_port() -> std::io::Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(l.local_addr()?.port())
}

/// One GET; true on a 200 status line.
fn ready(addr: SocketAddr, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(50)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut head = [0u8; 16];
    let mut n = 0;
    while n < head.len() {
        match s.read(&mut head[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    head[..n].starts_with(b"HTTP/1.1 200")
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

fn stop(child: &mut Child) {
    // SIGTERM first, so the process shuts down as it would in a pod.
    if let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let mut ready_ms = Vec::new();
    let mut rss = Vec::new();
    for run in 0..args.runs {
        let port = match free_port() {
            Ok(p) => p,
            Err(e) => {
                eprintln!("startup: no free port: {e}");
                return std::process::ExitCode::FAILURE;
            }
        };
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let argv: Vec<String> = args
            .command
            .iter()
            .map(|a| a.replace("{port}", &port.to_string()))
            .collect();
        let start = Instant::now();
        let mut child = match Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("startup: cannot start {}: {e}", argv[0]);
                return std::process::ExitCode::FAILURE;
            }
        };
        let deadline = start + Duration::from_millis(args.timeout_ms);
        let mut elapsed = None;
        while Instant::now() < deadline {
            if ready(addr, &args.path) {
                elapsed = Some(start.elapsed());
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                eprintln!("startup: run {run}: the command exited first ({status})");
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let Some(elapsed) = elapsed else {
            stop(&mut child);
            eprintln!(
                "startup: run {run}: not ready within {} ms",
                args.timeout_ms
            );
            return std::process::ExitCode::FAILURE;
        };
        rss.push(rss_kib(child.id()).unwrap_or(0));
        stop(&mut child);
        ready_ms.push(elapsed.as_secs_f64() * 1000.0);
    }
    let mut sorted = ready_ms.clone();
    sorted.sort_by(f64::total_cmp);
    let p50 = sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN);
    let max = sorted.last().copied().unwrap_or(f64::NAN);
    let round = |v: f64| (v * 10.0).round() / 10.0;
    println!(
        "{}",
        json!({
            "runs": ready_ms.len(),
            "ready_ms": ready_ms.iter().map(|v| round(*v)).collect::<Vec<_>>(),
            "p50_ms": round(p50),
            "max_ms": round(max),
            "rss_kib": rss,
        })
    );
    std::process::ExitCode::SUCCESS
}
