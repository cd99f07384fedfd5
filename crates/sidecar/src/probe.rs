//! The kubelet's readiness question, asked of this pod's sidecar by
//! `lanyard-sidecar wait-ready` (the postStart hook).

use std::time::Duration;

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
