//! `lanyard-sidecar wait-ready`, the injected sidecar's postStart hook:
//! the process the kubelet waits on before it starts the pod's next
//! container. It must return 0 only once `/readyz` answers 200, and fail
//! (so the kubelet restarts the sidecar) when it never does.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

/// A probe listener that answers 503 to the first `not_ready` requests,
/// then 200; returns its port.
fn probe_listener(not_ready: usize) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for (n, stream) in listener.incoming().enumerate() {
            let Ok(mut stream) = stream else { continue };
            let mut buf = [0u8; 1024];
            let read = stream.read(&mut buf).unwrap_or(0);
            assert!(
                buf[..read].starts_with(b"GET /readyz HTTP/1.1\r\n"),
                "{:?}",
                String::from_utf8_lossy(&buf[..read])
            );
            let status = if n < not_ready {
                "503 Service Unavailable"
            } else {
                "200 OK"
            };
            let _ = stream.write_all(
                format!("HTTP/1.1 {status}\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .as_bytes(),
            );
        }
    });
    port
}

fn wait_ready(port: u16, timeout: u64) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lanyard-sidecar"))
        .args([
            "wait-ready",
            "--port",
            &port.to_string(),
            "--timeout",
            &timeout.to_string(),
        ])
        .output()
        .unwrap()
}

#[test]
fn returns_once_the_sidecar_answers_ready() {
    let port = probe_listener(5);
    let started = Instant::now();
    let out = wait_ready(port, 30);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Five refusals 10 ms apart, not a probe period.
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn fails_with_the_reason_when_the_sidecar_never_gets_ready() {
    let port = probe_listener(usize::MAX);
    let out = wait_ready(port, 1);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not ready on port") && err.contains("503"),
        "{err}"
    );
    // Nothing listening: the same, with the connection's error.
    let closed = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let out = wait_ready(closed, 1);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot connect"));
}
