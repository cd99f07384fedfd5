//! Lanyard processes started by a test: killed when dropped, their stderr
//! copied (as it is written) to a log the test can read, and the addresses
//! they bound learned from that log. They are started on port 0, so no
//! port is ever picked by the test and released for another process to take.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a process may take to report an address.
const REPORT_TIMEOUT: Duration = Duration::from_secs(30);

/// A child process whose stderr is teed to [`Proc::log`].
pub struct Proc {
    child: Child,
    log: Arc<Mutex<String>>,
    reader: Option<JoinHandle<()>>,
}

impl Proc {
    /// Spawns `cmd` with stdout discarded and stderr collected.
    pub fn spawn(cmd: &mut Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the process starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let reader = std::thread::spawn({
            let log = log.clone();
            move || {
                let mut stderr = BufReader::new(stderr);
                let mut line = Vec::new();
                // Lines, lossily decoded: the copy ends only at EOF.
                while matches!(stderr.read_until(b'\n', &mut line), Ok(n) if n > 0) {
                    log.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&line));
                    line.clear();
                }
            }
        });
        Proc {
            child,
            log,
            reader: Some(reader),
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process wrote to stderr so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The address in field `key` of the first log line containing
    /// `message`, if the process logged one yet.
    pub fn reported(&self, message: &str, key: &str) -> Option<SocketAddr> {
        let log = self.log();
        log.lines()
            .map(strip_ansi)
            .find(|line| line.contains(message))
            .map(|line| {
                field(&line, key)
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("no address in {key}= of {line:?}"))
            })
    }

    /// Waits until the process logs a line containing `message` and returns
    /// the address in its field `key` (as in `lanyard agent serving api=…`).
    /// Panics if the process exits or stays silent for 30 s.
    pub async fn addr(&mut self, message: &str, key: &str) -> SocketAddr {
        let deadline = Instant::now() + REPORT_TIMEOUT;
        loop {
            if let Some(addr) = self.reported(message, key) {
                return addr;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the reader catch up with what was written before exit.
                if let Some(reader) = self.reader.take() {
                    let _ = reader.join();
                }
                if let Some(addr) = self.reported(message, key) {
                    return addr;
                }
                panic!(
                    "exited ({status}) before logging {message:?}:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "never logged {message:?} with {key}=:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The address of the listener `bind` opened for `what` (its
    /// `listening for the {what}` line), once the process has bound it.
    pub async fn listening(&mut self, what: &str) -> SocketAddr {
        self.addr(&format!("listening for the {what}"), "addr")
            .await
    }

    /// SIGTERM, wait for the process to exit, and return its stderr.
    pub fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join();
        }
        self.log()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `line` without terminal colour codes (`ESC [ … letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The value of `key=value` in a text log line, or of `"key":"value"` in a
/// JSON one.
fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let text = format!(" {key}=");
    let json = format!("\"{key}\":\"");
    if let Some(at) = line.find(&text) {
        let rest = &line[at + text.len()..];
        return Some(rest.split_whitespace().next().unwrap_or(""));
    }
    let at = line.find(&json)?;
    let rest = &line[at + json.len()..];
    rest.split('"').next()
}

/// The slim `lanyard-sidecar` binary, which the `lanyard-sidecar` crate
/// builds next to `lanyard` (`cargo build -p lanyard-sidecar`; the test
/// command and a workspace test run build it).
pub fn slim_sidecar() -> std::path::PathBuf {
    let lanyard = std::path::Path::new(env!("CARGO_BIN_EXE_lanyard"));
    let sidecar = lanyard.with_file_name("lanyard-sidecar");
    assert!(
        sidecar.is_file(),
        "{} is missing: build it with `cargo build -p lanyard-sidecar`",
        sidecar.display()
    );
    sidecar
}
