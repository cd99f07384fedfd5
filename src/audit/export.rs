//! Shipping the audit file off the node, without loss: an exporter follows
//! the chained file (and its rotations) and hands each record to a
//! [`Shipper`] (syslog), advancing a cursor only once the receiver has
//! taken the records.
//!
//! Why from the file: the file is already the durable copy (a credential
//! leaves only once its record is synced there), so it is the spool too. An
//! exporter that falls behind, a receiver that is down, a Lanyard that is
//! killed: each resumes from the persisted cursor (the last sequence number
//! shipped) and sends again what was not acknowledged. Delivery is at least
//! once; every record carries a unique `id` by which a receiver drops
//! duplicates. How far an exporter may fall behind is bounded by the
//! file's retention (`audit.file_keep` × `audit.file_max_bytes`), and
//! `audit.export_max_backlog` keeps it within that: past it, issuance is
//! refused (`export_when_full: deny`) until the exporter catches up, or
//! (`drop`) retention may remove records first, which the exporter counts
//! and records as lost.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::chain;
use crate::telemetry::metrics::{Metrics, SinkResultLabels};

/// Takes records to their destination.
#[async_trait::async_trait]
pub trait Shipper: Send {
    /// A name for logs and metrics (`syslog`).
    fn name(&self) -> &'static str;

    /// Delivers `records` (each one JSON line without its newline), in
    /// order; returns once the receiver has taken all of them (or as far as
    /// the transport can tell). An error means none may be counted as
    /// delivered: they are sent again.
    async fn ship(&mut self, records: &[Vec<u8>]) -> std::io::Result<()>;
}

/// How far an exporter has delivered, shared with the sinks that bound
/// its backlog.
#[derive(Debug)]
pub struct Progress {
    /// The exporter.
    pub name: &'static str,
    /// One more than the last sequence number delivered (0: none).
    next: std::sync::atomic::AtomicU64,
}

impl Progress {
    /// An exporter's progress, before it has loaded its cursor.
    pub fn new(name: &'static str) -> Arc<Progress> {
        Arc::new(Progress {
            name,
            next: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// One more than the last sequence number delivered.
    pub fn next(&self) -> u64 {
        self.next.load(std::sync::atomic::Ordering::Acquire)
    }

    fn set_next(&self, next: u64) {
        self.next.store(next, std::sync::atomic::Ordering::Release);
    }
}

/// Where an exporter stands: the last sequence number delivered.
pub struct Cursor {
    path: PathBuf,
}

impl Cursor {
    /// The cursor kept in `path`.
    pub fn new(path: PathBuf) -> Cursor {
        Cursor { path }
    }

    /// The last delivered sequence number, if any.
    pub fn load(&self) -> Option<u64> {
        std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// Persists `seq` (write, sync, rename: never a torn cursor).
    pub fn store(&self, seq: u64) -> std::io::Result<()> {
        let tmp = self.path.with_extension("cursor.tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            writeln!(f, "{seq}")?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &self.path)
    }
}

/// The files of the chain, oldest first: rotated files, then the active one.
fn chain_files(active: &Path) -> Vec<PathBuf> {
    let mut files = super::file::rotated_files(active);
    files.push(active.to_path_buf());
    files
}

/// Follows the chain from just after a sequence number.
struct Follower {
    active: PathBuf,
    reader: Option<(BufReader<std::fs::File>, PathBuf)>,
    /// Files of the chain still to read after the current one.
    queue: Vec<PathBuf>,
    /// Records at or before this are skipped.
    after: Option<u64>,
    /// With nothing delivered yet, the first record this exporter saw: a
    /// record missing after it is lost too.
    floor: Option<u64>,
    /// A partial line read at the end of the file, kept until complete.
    partial: Vec<u8>,
    /// The current file was seen moved away and is being read to its end
    /// once more (a batch written just before the rename may have landed
    /// after the last read).
    draining: bool,
    /// Records found missing after the cursor (removed by retention before
    /// they were delivered): first and last sequence numbers.
    lost: Option<(u64, u64)>,
}

impl Follower {
    fn new(active: PathBuf, after: Option<u64>, floor: Option<u64>) -> Follower {
        let mut queue = chain_files(&active);
        queue.reverse();
        Follower {
            active,
            reader: None,
            queue,
            after,
            floor,
            partial: Vec::new(),
            draining: false,
            lost: None,
        }
    }

    /// Up to `max` complete records after the cursor, with their sequence
    /// numbers; empty when there are none yet.
    fn next_batch(&mut self, max: usize) -> std::io::Result<Vec<(u64, Vec<u8>)>> {
        let mut out = Vec::new();
        while out.len() < max {
            if self.reader.is_none() {
                let Some(path) = self.queue.pop() else {
                    // Caught up with the active file: reopen it next time.
                    self.queue = vec![self.active.clone()];
                    break;
                };
                match std::fs::File::open(&path) {
                    Ok(f) => self.reader = Some((BufReader::new(f), path)),
                    // Removed by retention (or not created yet): go on.
                    Err(_) => continue,
                }
            }
            let Some((reader, path)) = &mut self.reader else {
                break;
            };
            let mut line = std::mem::take(&mut self.partial);
            let n = reader.read_until(b'\n', &mut line)?;
            if n == 0 || !line.ends_with(b"\n") {
                // At the end of what is written.
                self.partial = line;
                let moved = is_moved(reader.get_ref(), path, &self.active);
                if !moved {
                    break;
                }
                if !self.draining {
                    self.draining = true;
                    continue;
                }
                // Rotated away and read to its end: the next file is the
                // new active one. A rotated file never ends mid-line; a
                // partial line there was torn by a crash and is dropped.
                self.partial.clear();
                self.draining = false;
                self.reader = None;
                if self.queue.is_empty() {
                    self.queue.push(self.active.clone());
                }
                continue;
            }
            line.pop();
            let Ok(read) = chain::read(&line) else {
                tracing::warn!(file = %path.display(), "an audit line that is not a chained record is not exported");
                continue;
            };
            // INVARIANT: sequence numbers only rise along the files (the
            // file sink carries them on across rotations, restarts and
            // set-aside files), so "after the cursor" is "a larger seq".
            if self.after.is_some_and(|a| read.link.seq <= a) {
                continue;
            }
            let expected = match self.after {
                Some(a) => a + 1,
                None => self.floor.unwrap_or(read.link.seq),
            };
            if read.link.seq > expected {
                let (first, _) = self.lost.unwrap_or((expected, 0));
                self.lost = Some((first, read.link.seq - 1));
            }
            self.after = Some(read.link.seq);
            out.push((read.link.seq, line));
        }
        Ok(out)
    }

    /// Goes back to just after `seq` (after a failed delivery).
    fn rewind(&mut self, seq: Option<u64>) {
        *self = Follower::new(self.active.clone(), seq, self.floor);
    }
}

/// Whether the open file is no longer the one at `active` (it is a
/// rotated file, or was the active one and has been rotated away).
fn is_moved(open: &std::fs::File, path: &Path, active: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if path != active {
        return true;
    }
    match (open.metadata(), std::fs::metadata(active)) {
        (Ok(a), Ok(b)) => a.ino() != b.ino() || a.dev() != b.dev(),
        _ => false,
    }
}

/// Most records per delivery.
const BATCH: usize = 512;
/// Longest wait between looks at the file when nothing notifies.
const POLL: Duration = Duration::from_millis(500);

/// What an exporter is given to run.
pub struct Exporter {
    /// The active audit file.
    pub active: PathBuf,
    /// Its cursor.
    pub cursor: Cursor,
    /// Where records go.
    pub shipper: Box<dyn Shipper>,
    /// Woken after each batch the file sink writes.
    pub written: Arc<Notify>,
    /// Shared with the sinks that bound the backlog.
    pub progress: Arc<Progress>,
    /// Told of records lost before delivery (first and last sequence
    /// numbers), to record it.
    pub on_lost: Box<dyn Fn(u64, u64) + Send>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
}

/// Runs an exporter until the process ends: follows the file from its
/// cursor, ships, retries with exponential backoff.
pub async fn run(exporter: Exporter) {
    let Exporter {
        active,
        cursor,
        mut shipper,
        written,
        progress,
        on_lost,
        metrics,
    } = exporter;
    let name = shipper.name();
    let mut delivered = cursor.load();
    progress.set_next(delivered.map_or(0, |d| d + 1));
    let mut lost_told: Option<u64> = None;
    let mut follower = Follower::new(active.clone(), delivered, None);
    let mut backoff = Duration::from_millis(250);
    let mut failing = false;
    loop {
        let batch = {
            // Reading is blocking I/O: the follower goes to a blocking
            // thread and comes back with the batch.
            let mut moved = follower;
            let (f, batch) = tokio::task::spawn_blocking(move || {
                let batch = moved.next_batch(BATCH);
                (moved, batch)
            })
            .await
            .unwrap_or_else(|_| {
                (
                    Follower::new(active.clone(), delivered, None),
                    Ok(Vec::new()),
                )
            });
            follower = f;
            batch
        };
        // A rewind finds a loss again: each lost record is told once.
        let lost = follower
            .lost
            .take()
            .filter(|(_, last)| lost_told.is_none_or(|t| *last > t))
            .map(|(first, last)| (lost_told.map_or(first, |t| first.max(t + 1)), last));
        if let Some((first, last)) = lost {
            lost_told = Some(last);
            let n = last - first + 1;
            tracing::error!(
                exporter = name,
                first,
                last,
                "audit records removed by retention before the exporter delivered them"
            );
            metrics
                .audit_records
                .get_or_create(&SinkResultLabels {
                    sink: name,
                    result: "lost",
                })
                .inc_by(n);
            on_lost(first, last);
        }
        let batch = match batch {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(exporter = name, error = %e, "cannot read the audit file");
                tokio::time::sleep(POLL).await;
                follower.rewind(delivered);
                continue;
            }
        };
        if batch.is_empty() {
            let _ = tokio::time::timeout(POLL, written.notified()).await;
            continue;
        }
        if delivered.is_none() && follower.floor.is_none() {
            // A new exporter: it owes everything from the first record it
            // found on.
            follower.floor = batch.first().map(|(seq, _)| *seq);
            progress.set_next(follower.floor.unwrap_or(0));
        }
        let last = batch.last().map(|(seq, _)| *seq);
        let lines: Vec<Vec<u8>> = batch.into_iter().map(|(_, l)| l).collect();
        match shipper.ship(&lines).await {
            Ok(()) => {
                if failing {
                    tracing::info!(exporter = name, "audit exporter delivering again");
                    failing = false;
                }
                backoff = Duration::from_millis(250);
                metrics
                    .audit_records
                    .get_or_create(&SinkResultLabels {
                        sink: name,
                        result: "written",
                    })
                    .inc_by(lines.len() as u64);
                delivered = last;
                progress.set_next(delivered.map_or(0, |d| d + 1));
                if let Some(seq) = delivered {
                    if let Err(e) = cursor.store(seq) {
                        tracing::warn!(exporter = name, error = %e, "cannot persist the exporter's cursor");
                    }
                }
            }
            Err(e) => {
                if !failing {
                    tracing::warn!(exporter = name, error = %e, "audit exporter cannot deliver; retrying with backoff");
                    failing = true;
                }
                metrics
                    .audit_records
                    .get_or_create(&SinkResultLabels {
                        sink: name,
                        result: "failed",
                    })
                    .inc_by(lines.len() as u64);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
                follower.rewind(delivered);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_chain(path: &Path, from: u64, n: u64, prev: Option<chain::Link>) -> chain::Link {
        let mut out = Vec::new();
        let mut link = prev;
        for i in from..from + n {
            let rec = format!("{{\"type\":\"credential\",\"n\":{i}}}");
            link = Some(chain::append(rec.as_bytes(), link.as_ref(), &mut out));
        }
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(&out).unwrap();
        link.unwrap()
    }

    #[test]
    fn the_follower_reads_across_rotation_from_its_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let active = dir.path().join("audit.jsonl");
        let link = write_chain(&active, 0, 5, None);
        let mut f = Follower::new(active.clone(), Some(1), None);
        let seqs: Vec<u64> = f.next_batch(100).unwrap().iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [2, 3, 4]);
        assert!(f.next_batch(100).unwrap().is_empty());
        // Rotated: the rest of the old file, then the new one.
        let link = write_chain(&active, 5, 2, Some(link));
        std::fs::rename(
            &active,
            dir.path().join("audit-20261203T000000.000000Z.jsonl"),
        )
        .unwrap();
        write_chain(&active, 7, 3, Some(link));
        let seqs: Vec<u64> = f.next_batch(100).unwrap().iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, [5, 6, 7, 8, 9]);
        // A new follower from the same cursor finds the same records.
        let mut again = Follower::new(active.clone(), Some(4), None);
        let seqs: Vec<u64> = again
            .next_batch(3)
            .unwrap()
            .iter()
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(seqs, [5, 6, 7]);
    }

    #[test]
    fn a_partial_line_waits_until_it_is_complete() {
        let dir = tempfile::tempdir().unwrap();
        let active = dir.path().join("audit.jsonl");
        let mut out = Vec::new();
        chain::append(b"{\"type\":\"credential\"}", None, &mut out);
        let (head, tail) = out.split_at(20);
        std::fs::write(&active, head).unwrap();
        let mut f = Follower::new(active.clone(), None, None);
        assert!(f.next_batch(10).unwrap().is_empty());
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(&active)
            .unwrap()
            .write_all(tail)
            .unwrap();
        assert_eq!(f.next_batch(10).unwrap().len(), 1);
    }

    #[test]
    fn the_cursor_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let c = Cursor::new(dir.path().join("x.cursor"));
        assert_eq!(c.load(), None);
        c.store(41).unwrap();
        c.store(42).unwrap();
        assert_eq!(Cursor::new(dir.path().join("x.cursor")).load(), Some(42));
    }
}
