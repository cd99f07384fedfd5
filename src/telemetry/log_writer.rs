//! The log's writer: lines gathered in memory and written to stderr in
//! batches.
//!
//! Every request that reaches the broker logs its audit line, cache hits
//! included. Written one `write(2)` per line, the write was about half of
//! what the line cost (7 % of the process's CPU under load, as much as
//! formatting it). Here a line is appended to a buffer under a mutex, and
//! the buffer is written when it holds [`FLUSH_BYTES`] (by the request
//! that filled it) or [`FLUSH_INTERVAL`] after its first line (by a flusher
//! thread that sleeps while there is nothing to write). Under load that is
//! one write per hundreds of lines; an idle process makes no wake-ups.
//!
//! Like Envoy's access log, this trades a short delay for throughput: a
//! line reaches stderr at most [`FLUSH_INTERVAL`] late, and a process
//! killed with SIGKILL loses at most that much of its log. Nothing is
//! dropped otherwise: the buffer is bounded by writing it, not by
//! discarding lines, and it is written at exit and before a panic's
//! message. The durable audit copy is the file sink, not the log.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A buffer holding this much is written by the request that filled it.
pub const FLUSH_BYTES: usize = 64 * 1024;

/// The longest a line waits in the buffer.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(10);

struct Pending {
    bytes: Vec<u8>,
    stopping: bool,
}

struct Shared<W> {
    pending: Mutex<Pending>,
    /// Signalled when the buffer gets its first line, and at stop.
    wake: Condvar,
    /// The destination.
    // INVARIANT: taken while `pending` is still held, so buffers are
    // written in the order they were filled; never taken the other way
    // round.
    out: Mutex<W>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves bytes that are still valid to
    // write.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<W: Write> Shared<W> {
    /// Writes what `pending` holds. Write errors are ignored, as a
    /// logger's are: a broken stderr must not stop the process.
    fn write_out(&self, mut pending: MutexGuard<'_, Pending>) {
        if pending.bytes.is_empty() {
            return;
        }
        let bytes = std::mem::replace(&mut pending.bytes, Vec::with_capacity(FLUSH_BYTES));
        let mut out = lock(&self.out);
        drop(pending);
        let _ = out.write_all(&bytes).and_then(|()| out.flush());
    }

    fn append(&self, line: &[u8]) {
        let mut pending = lock(&self.pending);
        let first = pending.bytes.is_empty();
        pending.bytes.extend_from_slice(line);
        if pending.bytes.len() >= FLUSH_BYTES {
            self.write_out(pending);
        } else if first {
            drop(pending);
            self.wake.notify_one();
        }
    }

    fn flush(&self) {
        self.write_out(lock(&self.pending));
    }

    /// The flusher thread: asleep while the buffer is empty; once a line
    /// arrives, writes the buffer [`FLUSH_INTERVAL`] later.
    fn run_flusher(&self) {
        let mut pending = lock(&self.pending);
        loop {
            while pending.bytes.is_empty() && !pending.stopping {
                pending = self.wake.wait(pending).unwrap_or_else(|p| p.into_inner());
            }
            let due = Instant::now() + FLUSH_INTERVAL;
            while !pending.stopping {
                let left = due.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                pending = self
                    .wake
                    .wait_timeout(pending, left)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let stopping = pending.stopping;
            self.write_out(pending);
            if stopping {
                return;
            }
            pending = lock(&self.pending);
        }
    }
}

/// The log's `MakeWriter`: each line is appended to the shared buffer.
pub struct BatchedWriter<W> {
    shared: Arc<Shared<W>>,
}

impl<W> Clone for BatchedWriter<W> {
    fn clone(&self) -> Self {
        BatchedWriter {
            shared: self.shared.clone(),
        }
    }
}

/// Stops the flusher thread and writes what is left when dropped.
#[must_use = "dropping the guard writes the buffer and stops its flusher; hold it until exit"]
pub struct FlushGuard<W: Write + Send + 'static> {
    shared: Arc<Shared<W>>,
    flusher: Option<std::thread::JoinHandle<()>>,
}

impl<W: Write + Send + 'static> BatchedWriter<W> {
    /// A writer to `out` and the guard of its flusher thread.
    pub fn new(out: W) -> std::io::Result<(Self, FlushGuard<W>)> {
        let shared = Arc::new(Shared {
            pending: Mutex::new(Pending {
                bytes: Vec::with_capacity(FLUSH_BYTES),
                stopping: false,
            }),
            wake: Condvar::new(),
            out: Mutex::new(out),
        });
        let flusher = {
            let shared = shared.clone();
            std::thread::Builder::new()
                .name("lanyard-log".into())
                .spawn(move || shared.run_flusher())?
        };
        let guard = FlushGuard {
            shared: shared.clone(),
            flusher: Some(flusher),
        };
        Ok((BatchedWriter { shared }, guard))
    }

    /// Writes what the buffer holds now.
    pub fn flush(&self) {
        self.shared.flush();
    }

    /// Adds `line` (whole lines, newline included) to the buffer, as a
    /// line the subscriber writes is added.
    pub(crate) fn append(&self, line: &[u8]) {
        self.shared.append(line);
    }
}

impl<W: Write + Send + 'static> Drop for FlushGuard<W> {
    fn drop(&mut self) {
        lock(&self.shared.pending).stopping = true;
        self.shared.wake.notify_one();
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.join();
        }
        // Lines logged after the flusher stopped.
        self.shared.flush();
    }
}

/// One line's writer: `tracing`'s formatter renders a whole line, then
/// writes it with one `write_all`.
pub struct LineWriter<'a, W> {
    shared: &'a Shared<W>,
}

impl<W: Write> Write for LineWriter<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.shared.append(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a, W: Write + 'a> tracing_subscriber::fmt::MakeWriter<'a> for BatchedWriter<W> {
    type Writer = LineWriter<'a, W>;

    fn make_writer(&'a self) -> Self::Writer {
        LineWriter {
            shared: &self.shared,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A destination that records each `write` call.
    #[derive(Clone, Default)]
    struct Recorder(Arc<Mutex<Vec<Vec<u8>>>>);

    impl Write for Recorder {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Recorder {
        fn bytes(&self) -> Vec<u8> {
            lock(&self.0).concat()
        }
        fn writes(&self) -> usize {
            lock(&self.0).len()
        }
    }

    fn line(w: &BatchedWriter<Recorder>, text: &str) {
        use tracing_subscriber::fmt::MakeWriter;
        w.make_writer().write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn lines_are_written_in_order_in_few_writes_and_none_lost_at_drop() {
        let out = Recorder::default();
        let (w, guard) = BatchedWriter::new(out.clone()).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let w = w.clone();
                std::thread::spawn(move || {
                    for i in 0..5000 {
                        line(&w, &format!("t{t} {i:05} {}\n", "x".repeat(40)));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(guard);
        let text = String::from_utf8(out.bytes()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 20_000);
        // Every line whole, and each thread's lines in the order logged.
        for t in 0..4 {
            let mine: Vec<&str> = lines
                .iter()
                .copied()
                .filter(|l| l.starts_with(&format!("t{t} ")))
                .collect();
            assert_eq!(mine.len(), 5000);
            for (i, l) in mine.iter().enumerate() {
                assert_eq!(*l, format!("t{t} {i:05} {}", "x".repeat(40)));
            }
        }
        // About 1 MB in batches of 64 KiB, not 20,000 writes.
        assert!(out.writes() < 200, "{} writes", out.writes());
    }

    #[test]
    fn a_lone_line_is_written_without_more_lines_or_a_flush() {
        let out = Recorder::default();
        let (w, _guard) = BatchedWriter::new(out.clone()).unwrap();
        line(&w, "one\n");
        let deadline = Instant::now() + Duration::from_secs(5);
        while out.bytes().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(out.bytes(), b"one\n");
        // And again after the flusher went back to sleep.
        line(&w, "two\n");
        while out.writes() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(out.bytes(), b"one\ntwo\n");
        assert_eq!(out.writes(), 2);
    }

    #[test]
    fn flush_writes_at_once() {
        let out = Recorder::default();
        let (w, _guard) = BatchedWriter::new(out.clone()).unwrap();
        line(&w, "now\n");
        w.flush();
        assert_eq!(out.bytes(), b"now\n");
    }
}
