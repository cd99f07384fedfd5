//! The file sink: append-only JSON Lines on local disk, each record chained
//! to the one before it ([`super::chain`]), across rotations and restarts;
//! durable before the credential leaves.
//!
//! One writer thread owns the file. Requests queue their records
//! ([`super::group_commit`]); the writer takes every record waiting,
//! writes them in one `write` and makes them durable with one `fdatasync`
//! before answering each (group commit: concurrent requests share one
//! sync, and the more requests wait, the more each sync carries). A
//! failed batch is cut back off the file, so the file never holds a record
//! whose request was told it failed.
//!
//! The file rotates by size and age: the active file is renamed with a
//! UTC timestamp, the oldest rotated files beyond `keep` are removed (by a
//! thread of their own, so that no request waits on it), and the new file
//! begins with a `rotation` record naming the file before it
//! and carrying the chain on. SIGHUP (after an outside tool moved the file
//! away) reopens the path the same way. At start the chain continues from
//! the last complete record on disk; a torn last line (a crash in the
//! middle of a write, never acknowledged) is cut off.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use super::chain::{self, Link};
use super::group_commit::{Queue, StopOnDrop, Taken};
use super::record::{self, Origin, SinkFailure, Subject};
use crate::telemetry::metrics::Metrics;

/// How the file sink writes.
#[derive(Debug, Clone)]
pub struct FileOptions {
    /// The active file.
    pub path: PathBuf,
    /// Rotate once the file is this large.
    pub max_bytes: u64,
    /// Rotate once the file has been open this long.
    pub max_age: Duration,
    /// Rotated files kept; older ones are removed.
    pub keep: usize,
    /// Sync each batch to disk before answering (durable). Off, a crash may
    /// lose the last records of credentials already returned.
    pub fsync: bool,
    /// What the sink's outage record says happened to records it could not
    /// write: `refused` or `issued_unrecorded`.
    pub handling: &'static str,
    /// Write a `checkpoint` record this often, idle or not; `None`: never.
    pub checkpoint_every: Option<Duration>,
}

/// Why the sink cannot start.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The file cannot be opened, read or written.
    #[error("audit file {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What failed.
        error: std::io::Error,
    },
}

/// A batch buffer this large is kept for the next batch; a larger one (a
/// burst of thousands of records) is given back.
const KEEP_BATCH_BUFFER: usize = 1024 * 1024;

/// The file sink's handle: cheap to share and to clone.
#[derive(Clone)]
pub struct FileSink {
    queue: Arc<Handle>,
    written: Arc<tokio::sync::Notify>,
    /// One more than the sequence number of the last record written (0:
    /// none yet).
    next_seq: Arc<std::sync::atomic::AtomicU64>,
}

/// The requests' side of the writer's queue: when the last handle goes,
/// the writer writes what waits and ends.
struct Handle(Arc<Queue>);

impl Drop for Handle {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl FileSink {
    /// Opens (or creates) the file, continues its chain, and starts the
    /// writer thread. Fails when the file cannot be written now.
    pub fn open(
        options: FileOptions,
        origin: Arc<Origin>,
        metrics: Arc<Metrics>,
    ) -> Result<FileSink, FileError> {
        let written = Arc::new(tokio::sync::Notify::new());
        let next_seq = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let retention = Retention::start(options.path.clone(), options.keep).map_err(|error| {
            FileError::Io {
                path: PathBuf::new(),
                error,
            }
        })?;
        let mut writer = Writer {
            retention,
            next_seq: next_seq.clone(),
            options,
            origin,
            metrics,
            file: None,
            link: None,
            failure: None,
            written: written.clone(),
            batch: Vec::new(),
            checkpoint: Checkpoints {
                last: Instant::now(),
                records: 0,
                seq: None,
            },
        };
        writer.ensure_open().map_err(|error| FileError::Io {
            path: writer.options.path.clone(),
            error,
        })?;
        writer.publish_seq();
        let queue = Queue::new();
        let writer_queue = queue.clone();
        std::thread::Builder::new()
            .name("lanyard-audit-file".into())
            .spawn(move || writer.run(writer_queue))
            .map_err(|error| FileError::Io {
                path: PathBuf::new(),
                error,
            })?;
        Ok(FileSink {
            queue: Arc::new(Handle(queue)),
            written,
            next_seq,
        })
    }

    /// How many records the chain holds up to its last one (its last
    /// sequence number plus one; 0 before the first).
    pub fn next_seq(&self) -> u64 {
        self.next_seq.load(std::sync::atomic::Ordering::Acquire)
    }

    /// [`FileSink::next_seq`] as it moves, without holding the file open
    /// (for gauges read at scrape time).
    pub fn next_seq_watch(&self) -> Arc<std::sync::atomic::AtomicU64> {
        self.next_seq.clone()
    }

    /// Notified after each batch written: exporters following the file
    /// wake on it.
    pub fn written(&self) -> Arc<tokio::sync::Notify> {
        self.written.clone()
    }

    /// Appends `record` (one JSON object) and returns once it is on disk.
    pub async fn write(&self, record: &[u8]) -> Result<(), String> {
        self.queue.0.write(record).await
    }

    /// Reopens the path (SIGHUP): an outside tool moved the file away.
    pub fn reopen(&self) {
        self.queue.0.reopen();
    }
}

struct Open {
    file: File,
    size: u64,
    opened: Instant,
    /// Tells whether the directory changed since the path was last looked
    /// up; `None` until the first look, or where inotify is unavailable.
    watch: Option<DirWatch>,
    /// When the path was last looked up.
    looked: Instant,
}

/// Look the path up at least this often, even when the directory's watch
/// saw nothing: a directory above it renamed is not an event in it.
const LOOK_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

impl Open {
    fn new(file: File, size: u64) -> Open {
        let now = Instant::now();
        Open {
            file,
            size,
            opened: now,
            watch: None,
            looked: now,
        }
    }

    /// Whether `path` still names this file: a file removed or replaced
    /// (its directory deleted, a rotator that moved it without SIGHUP)
    /// would swallow records no reader will see.
    ///
    /// Looking the path up costs two `statx` calls. While the directory's
    /// inotify watch has seen nothing (one `read` that finds no event) and
    /// the last look is recent, nothing can have changed what the path
    /// names, so the look is skipped. Any event (ours too: a rotation, the
    /// retention thread's removals, an exporter's cursor) means a look.
    fn still_at(&mut self, path: &Path, now: Instant) -> bool {
        let quiet = self.watch.as_ref().is_some_and(DirWatch::quiet);
        if quiet && now.duration_since(self.looked) < LOOK_AT_LEAST_EVERY {
            return true;
        }
        // INVARIANT: the new watch is in place before the look, so a change
        // between the look and the next batch is an event on it.
        self.watch = path.parent().and_then(DirWatch::new);
        self.looked = now;
        self.is_at(path)
    }

    fn is_at(&self, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (self.file.metadata(), std::fs::metadata(path)) {
            (Ok(open), Ok(named)) => open.ino() == named.ino() && open.dev() == named.dev(),
            _ => false,
        }
    }
}

/// An inotify watch on the audit file's directory for the events that can
/// change what a name in it refers to.
struct DirWatch {
    inotify: std::os::fd::OwnedFd,
}

impl DirWatch {
    /// `None` when inotify cannot be had (its limits reached): the path is
    /// then looked up before every batch.
    fn new(dir: &Path) -> Option<DirWatch> {
        use rustix::fs::inotify::{self, CreateFlags, WatchFlags};
        let dir = match dir.as_os_str().is_empty() {
            true => Path::new("."),
            false => dir,
        };
        let inotify = inotify::init(CreateFlags::CLOEXEC | CreateFlags::NONBLOCK).ok()?;
        let events = WatchFlags::CREATE
            | WatchFlags::DELETE
            | WatchFlags::MOVED_FROM
            | WatchFlags::MOVED_TO
            | WatchFlags::DELETE_SELF
            | WatchFlags::MOVE_SELF
            | WatchFlags::ONLYDIR;
        inotify::add_watch(&inotify, dir, events).ok()?;
        Some(DirWatch { inotify })
    }

    /// No event since the watch began (a read that would block).
    fn quiet(&self) -> bool {
        let mut buf = [0u8; 1024];
        matches!(
            rustix::io::read(&self.inotify, &mut buf),
            Err(rustix::io::Errno::AGAIN)
        )
    }
}

struct Writer {
    options: FileOptions,
    origin: Arc<Origin>,
    metrics: Arc<Metrics>,
    file: Option<Open>,
    /// The last record durably written: what the next one follows.
    link: Option<Link>,
    /// An outage in progress: recorded once writing works again.
    failure: Option<SinkFailure>,
    /// Wakes the exporters.
    written: Arc<tokio::sync::Notify>,
    /// Shared with [`FileSink::next_seq`].
    next_seq: Arc<std::sync::atomic::AtomicU64>,
    /// The last batch's buffer, reused by the next.
    batch: Vec<u8>,
    /// Removes rotated files beyond `keep`.
    retention: Retention,
    /// The checkpoints this writer keeps.
    checkpoint: Checkpoints,
}

/// Where the writer's checkpoints stand.
struct Checkpoints {
    /// When the last was written (or the writer started).
    last: Instant,
    /// Records chained since then, checkpoints not counted.
    records: u64,
    /// The last one's `seq`.
    seq: Option<u64>,
}

/// Removes the oldest rotated files beyond `keep`, on a thread of its own.
/// Removing a file of 100 MB takes ext4 tens of milliseconds; done by the
/// writer, it held up every request waiting on a record for as long
/// (`bench/audit`: p99 from 2.5 to 7-21 ms in runs that rotated and
/// removed).
struct Retention {
    wake: std::sync::mpsc::SyncSender<()>,
}

impl Retention {
    fn start(path: PathBuf, keep: usize) -> std::io::Result<Retention> {
        // One pending wake-up is enough: a pass looks at the files as they
        // are when it runs.
        let (wake, woken) = std::sync::mpsc::sync_channel::<()>(1);
        std::thread::Builder::new()
            .name("lanyard-audit-retention".into())
            // INVARIANT: only this thread removes rotated files, so no two
            // passes race over the same file.
            .spawn(move || {
                while woken.recv().is_ok() {
                    remove_beyond(&path, keep);
                }
            })?;
        Ok(Retention { wake })
    }

    /// Asks for a pass after a rotation; returns at once.
    fn after_rotation(&self) {
        let _ = self.wake.try_send(());
    }
}

/// Removes the oldest rotated files of `path` beyond `keep`.
fn remove_beyond(path: &Path, keep: usize) {
    let rotated = rotated_files(path);
    let excess = rotated.len().saturating_sub(keep);
    for old in &rotated[..excess] {
        match std::fs::remove_file(old) {
            Ok(()) => {
                tracing::info!(file = %old.display(), "removed an old audit file (audit.file_keep)")
            }
            Err(e) => {
                tracing::warn!(file = %old.display(), error = %e, "cannot remove an old audit file")
            }
        }
    }
}

impl Writer {
    fn run(mut self, queue: Arc<Queue>) {
        let _stop = StopOnDrop(queue.clone());
        let mut taken = Taken::new();
        loop {
            let due = self
                .options
                .checkpoint_every
                .map(|every| self.checkpoint.last + every);
            if !queue.take(&mut taken, due) {
                break;
            }
            // INVARIANT: a checkpoint is written between batches, never
            // inside one, so its `prev` is the head of everything before.
            if due.is_some_and(|due| Instant::now() >= due) {
                self.write_checkpoint();
            }
            if taken.reopen {
                self.file = None;
                tracing::info!(path = %self.options.path.display(), "reopening the audit file");
            }
            if taken.len() == 0 {
                taken.answer(Ok(()), KEEP_BATCH_BUFFER);
                continue;
            }
            let result = self.write_batch(taken.records());
            let count = taken.len() as u64;
            let answer = match result {
                Ok(()) => {
                    self.count("written", count);
                    Ok(())
                }
                Err(e) => {
                    self.count("failed", count);
                    let error = format!(
                        "cannot write the audit file {}: {e}",
                        self.options.path.display()
                    );
                    match &mut self.failure {
                        Some(f) => f.records += count,
                        None => {
                            tracing::error!(error = %error, "audit file unavailable");
                            self.failure = Some(SinkFailure {
                                sink: "file",
                                error: error.clone(),
                                since: SystemTime::now(),
                                records: count,
                                handling: self.options.handling,
                            });
                        }
                    }
                    Err(error)
                }
            };
            taken.answer(answer, KEEP_BATCH_BUFFER);
        }
    }

    fn publish_seq(&self) {
        let next = self.link.as_ref().map_or(0, |l| l.seq + 1);
        self.next_seq
            .store(next, std::sync::atomic::Ordering::Release);
    }

    fn count(&self, result: &'static str, n: u64) {
        self.metrics
            .audit_records
            .get_or_create(&crate::telemetry::metrics::SinkResultLabels {
                sink: "file",
                result,
            })
            .inc_by(n);
    }

    /// Writes `records` as one batch, synced; on failure the file is cut
    /// back to where the batch began and will be reopened.
    fn write_batch<'a>(&mut self, records: impl Iterator<Item = &'a [u8]>) -> std::io::Result<()> {
        let now = Instant::now();
        if self
            .file
            .as_mut()
            .is_some_and(|o| !o.still_at(&self.options.path, now))
        {
            tracing::warn!(path = %self.options.path.display(), "the audit file was removed or replaced; reopening it");
            self.file = None;
        }
        self.ensure_open()?;
        if self.rotation_due() {
            self.rotate()?;
        }
        // The batch's bytes go into the buffer the last batch used, so a
        // steady stream of batches allocates nothing here.
        let mut buf = std::mem::take(&mut self.batch);
        buf.clear();
        let mut link = self.link.clone();
        if let Some(failure) = &self.failure {
            let mut rec = Vec::new();
            record::write(&self.origin, Subject::SinkFailure(failure), &mut rec);
            link = Some(chain::append(&rec, link.as_ref(), &mut buf));
        }
        for r in records {
            link = Some(chain::append(r, link.as_ref(), &mut buf));
        }
        let result = self.append(&buf);
        if buf.capacity() <= KEEP_BATCH_BUFFER {
            self.batch = buf;
        }
        match result {
            Ok(()) => {
                if let Some(f) = self.failure.take() {
                    tracing::warn!(
                        records = f.records,
                        "audit file writable again; the outage is recorded in it"
                    );
                }
                if let (Some(new), old) = (&link, &self.link) {
                    self.checkpoint.records += new.seq - old.as_ref().map_or(0, |l| l.seq + 1) + 1;
                }
                self.link = link;
                self.publish_seq();
                self.written.notify_waiters();
                Ok(())
            }
            Err(e) => {
                if let Some(open) = &self.file {
                    // Best effort: nothing of a failed batch stays behind.
                    let _ = open.file.set_len(open.size);
                }
                self.file = None;
                Err(e)
            }
        }
    }

    fn append(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let fsync = self.options.fsync;
        let Some(open) = &mut self.file else {
            return Err(std::io::Error::other("not open"));
        };
        let started = Instant::now();
        open.file.write_all(buf)?;
        if fsync {
            open.file.sync_data()?;
        }
        open.size += buf.len() as u64;
        self.metrics
            .audit_sync_seconds
            .observe(started.elapsed().as_secs_f64());
        Ok(())
    }

    fn rotation_due(&self) -> bool {
        self.file.as_ref().is_some_and(|o| {
            o.size > 0
                && (o.size >= self.options.max_bytes || o.opened.elapsed() >= self.options.max_age)
        })
    }

    /// Opens the active file if it is not open, continuing the chain.
    fn ensure_open(&mut self) -> std::io::Result<()> {
        if self.file.is_some() {
            return Ok(());
        }
        let path = self.options.path.clone();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)?;
        let size = cut_torn_tail(&mut file, &path)?;
        let mut open = Open::new(file, size);
        let on_disk = match size {
            0 => None,
            _ => Some(last_record(&mut open.file, size)),
        };
        match on_disk {
            Some(Ok(link)) => {
                self.link = Some(link);
                self.file = Some(open);
            }
            Some(Err(e)) => {
                // The file's end is not a record of ours (edited by hand,
                // another program's): keep it for inspection and start a
                // new file whose first record says so.
                tracing::error!(path = %path.display(), error = %e, "the audit file's last record is unreadable; it is set aside and a new file begun");
                // The chain goes on from the last record that still reads
                // (so sequence numbers keep rising for the exporters), or
                // from the newest rotated file's.
                self.link = last_readable_record(&mut open.file, size)
                    .or_else(|| self.newest_rotated_link());
                drop(open);
                let aside = self.set_aside_name();
                self.start_new_file(&aside, "previous file unreadable")?;
            }
            None => {
                sync_dir(&path);
                self.file = Some(open);
                if self.link.is_none() {
                    self.link = self.newest_rotated_link();
                }
                if self.link.is_some() {
                    self.begin(None, "reopened")?;
                }
            }
        }
        Ok(())
    }

    /// Writes a new file's first record: a rotation record that names the
    /// file before it and carries the chain on.
    fn begin(&mut self, previous: Option<&Path>, why: &str) -> std::io::Result<()> {
        let previous = previous
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned());
        let mut body = Vec::new();
        record::write(
            &self.origin,
            Subject::Rotation {
                previous_file: previous.as_deref(),
                reason: why,
            },
            &mut body,
        );
        let mut buf = Vec::new();
        let link = chain::append(&body, self.link.as_ref(), &mut buf);
        self.append(&buf)?;
        self.link = Some(link);
        self.checkpoint.records += 1;
        self.publish_seq();
        Ok(())
    }

    /// Writes a `checkpoint` record (opening or rotating the file first, as
    /// a batch would). A failure is left to the next batch to report: it
    /// finds the file closed and reopens it.
    fn write_checkpoint(&mut self) {
        let every = self.options.checkpoint_every.unwrap_or_default();
        self.checkpoint.last = Instant::now();
        let written = self.ensure_open().and_then(|()| {
            if self.rotation_due() {
                self.rotate()?;
            }
            let mut body = Vec::new();
            record::write(
                &self.origin,
                Subject::Checkpoint {
                    interval_seconds: every.as_secs(),
                    records: self.checkpoint.records,
                    previous_checkpoint_seq: self.checkpoint.seq,
                },
                &mut body,
            );
            let mut buf = Vec::new();
            let link = chain::append(&body, self.link.as_ref(), &mut buf);
            if let Err(e) = self.append(&buf) {
                if let Some(open) = &self.file {
                    let _ = open.file.set_len(open.size);
                }
                self.file = None;
                return Err(e);
            }
            Ok(link)
        });
        match written {
            Ok(link) => {
                self.checkpoint.seq = Some(link.seq);
                self.checkpoint.records = 0;
                self.link = Some(link);
                self.publish_seq();
                self.written.notify_waiters();
            }
            Err(e) => {
                tracing::warn!(error = %e, path = %self.options.path.display(), "cannot write an audit checkpoint");
            }
        }
    }

    /// Where an unreadable file is kept: outside the rotated files'
    /// pattern, so retention never removes it and no exporter follows it.
    fn set_aside_name(&self) -> PathBuf {
        let rotated = self.rotated_name();
        let name = rotated
            .file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
        let stem = self
            .options
            .path
            .file_stem()
            .map_or("audit".into(), |s| s.to_string_lossy().into_owned());
        let unreadable = name.replacen(&format!("{stem}-"), &format!("{stem}.unreadable-"), 1);
        rotated.with_file_name(unreadable)
    }

    fn rotated_name(&self) -> PathBuf {
        let path = &self.options.path;
        let stem = path
            .file_stem()
            .map_or("audit".into(), |s| s.to_string_lossy().into_owned());
        let ext = path
            .extension()
            .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
        // Two rotations within the same nanosecond would collide: the
        // later one takes the next nanosecond, so names still sort in
        // rotation order.
        let mut at = time::OffsetDateTime::now_utc();
        loop {
            let stamp = format!(
                "{:04}{:02}{:02}T{:02}{:02}{:02}.{:09}Z",
                at.year(),
                u8::from(at.month()),
                at.day(),
                at.hour(),
                at.minute(),
                at.second(),
                at.nanosecond()
            );
            let name = path.with_file_name(format!("{stem}-{stamp}{ext}"));
            if !name.exists() {
                return name;
            }
            at += time::Duration::nanoseconds(1);
        }
    }

    /// Rotated files of this path, oldest first.
    fn rotated(&self) -> Vec<PathBuf> {
        rotated_files(&self.options.path)
    }

    fn newest_rotated_link(&self) -> Option<Link> {
        let newest = self.rotated().pop()?;
        let mut file = File::open(&newest).ok()?;
        let size = file.metadata().ok()?.len();
        last_record(&mut file, size).ok()
    }

    /// Moves the active file to `aside` and begins a new one whose first
    /// record names it and says `why`.
    fn start_new_file(&mut self, aside: &Path, why: &str) -> std::io::Result<()> {
        let path = self.options.path.clone();
        std::fs::rename(&path, aside)?;
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)?;
        sync_dir(&path);
        self.file = Some(Open::new(file, 0));
        self.begin(Some(aside), why)
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let aside = self.rotated_name();
        self.start_new_file(&aside, "rotated")?;
        self.retention.after_rotation();
        tracing::info!(rotated = %aside.display(), "audit file rotated");
        Ok(())
    }
}

/// The rotated files of the active file `path` (`STEM-*.EXT` beside it),
/// oldest first: their names sort by the time of their rotation.
pub fn rotated_files(path: &Path) -> Vec<PathBuf> {
    let (Some(dir), Some(stem)) = (path.parent(), path.file_stem()) else {
        return Vec::new();
    };
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let prefix = format!("{}-", stem.to_string_lossy());
    let ext = path.extension().map(|e| e.to_os_string());
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
                && p.extension().map(|e| e.to_os_string()) == ext
                && p != path
        })
        .collect();
    found.sort();
    found
}

/// Makes a new directory entry durable.
fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
}

/// Cuts off a last line without its newline (a write a crash interrupted,
/// never acknowledged); returns the file's size after.
fn cut_torn_tail(file: &mut File, path: &Path) -> std::io::Result<u64> {
    let size = file.metadata()?.len();
    if size == 0 {
        return Ok(0);
    }
    let tail = read_tail(file, size)?;
    if tail.last() == Some(&b'\n') {
        return Ok(size);
    }
    let keep = match tail.iter().rposition(|&b| b == b'\n') {
        Some(i) => size - (tail.len() - i - 1) as u64,
        None if tail.len() as u64 == size => 0,
        // A line longer than the tail read: not ours; leave it for the
        // reader of the last record to refuse.
        None => return Ok(size),
    };
    tracing::warn!(path = %path.display(), bytes = size - keep, "cutting off a torn last audit record (a write interrupted before it was acknowledged)");
    file.set_len(keep)?;
    file.sync_all()?;
    Ok(keep)
}

/// The longest record line a reader looks back for.
const TAIL: u64 = 1 << 20;

fn read_tail(file: &mut File, size: u64) -> std::io::Result<Vec<u8>> {
    let start = size.saturating_sub(TAIL);
    file.seek(SeekFrom::Start(start))?;
    let mut tail = Vec::with_capacity((size - start) as usize);
    file.take(size - start).read_to_end(&mut tail)?;
    Ok(tail)
}

/// The link of the last record, searching back from the end, that reads as
/// a chained record.
fn last_readable_record(file: &mut File, size: u64) -> Option<Link> {
    let tail = read_tail(file, size).ok()?;
    tail.split(|&b| b == b'\n')
        .rev()
        .find_map(|line| chain::read(line).ok())
        .map(|r| r.link)
}

/// The link of the last record of a file that ends in a newline.
fn last_record(file: &mut File, size: u64) -> Result<Link, String> {
    let tail = read_tail(file, size).map_err(|e| e.to_string())?;
    let body = tail.strip_suffix(b"\n").unwrap_or(&tail);
    let line = match body.iter().rposition(|&b| b == b'\n') {
        Some(i) => &body[i + 1..],
        None => body,
    };
    chain::read(line).map(|r| r.link).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::verify;

    fn options(path: &Path) -> FileOptions {
        FileOptions {
            path: path.to_path_buf(),
            max_bytes: 1 << 30,
            max_age: Duration::from_secs(3600),
            keep: 10,
            fsync: true,
            handling: "refused",
            checkpoint_every: None,
        }
    }

    fn sink(options: FileOptions) -> FileSink {
        FileSink::open(
            options,
            Arc::new(Origin::new("c", "n", "agent")),
            Arc::new(Metrics::new()),
        )
        .unwrap()
    }

    fn record(i: usize) -> Vec<u8> {
        format!("{{\"type\":\"credential\",\"n\":{i}}}").into_bytes()
    }

    /// A file of three records, then `tail` appended, as a crash in the
    /// middle of a write or a hand would leave it.
    async fn three_records_then(path: &Path, tail: &[u8]) {
        let s = sink(options(path));
        for i in 0..3 {
            s.write(&record(i)).await.unwrap();
        }
        drop(s);
        OpenOptions::new()
            .append(true)
            .open(path)
            .unwrap()
            .write_all(tail)
            .unwrap();
    }

    fn files_of(dir: &Path) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
            .collect();
        // Rotated files (audit-STAMP.jsonl) sort before audit.jsonl? No:
        // '-' sorts before '.', so they do; the active file comes last.
        files.sort();
        files
    }

    #[tokio::test]
    async fn checkpoints_come_while_idle_and_count_the_records_between() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let every = Duration::from_millis(150);
        let s = sink(FileOptions {
            checkpoint_every: Some(every),
            ..options(&path)
        });
        for i in 0..3 {
            s.write(&record(i)).await.unwrap();
        }
        // Idle for three intervals and more: the checkpoints keep coming.
        tokio::time::sleep(every * 3 + Duration::from_millis(100)).await;
        s.write(&record(3)).await.unwrap();
        tokio::time::sleep(every + Duration::from_millis(100)).await;
        drop(s);
        let v = verify::verify(std::slice::from_ref(&path)).unwrap();
        let lines: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(v.records, lines.len() as u64);
        let checkpoints: Vec<&serde_json::Value> =
            lines.iter().filter(|r| r["type"] == "checkpoint").collect();
        assert!(checkpoints.len() >= 3, "{lines:#?}");
        // The first counts the three records before it; the idle ones none;
        // one after record 3 counts it. Each names the one before it.
        assert_eq!(checkpoints[0]["records"], 3);
        assert_eq!(checkpoints[0]["interval_seconds"], 0);
        assert!(checkpoints[0].get("previous_checkpoint_seq").is_none());
        for pair in checkpoints.windows(2) {
            assert_eq!(pair[1]["previous_checkpoint_seq"], pair[0]["seq"]);
        }
        let counted: u64 = checkpoints
            .iter()
            .map(|c| c["records"].as_u64().unwrap())
            .sum();
        let last_seq = checkpoints.last().unwrap()["seq"].as_u64().unwrap();
        let before_last = lines
            .iter()
            .filter(|r| r["type"] != "checkpoint" && r["seq"].as_u64().unwrap() < last_seq)
            .count() as u64;
        assert_eq!(counted, before_last);
        assert!(
            checkpoints.iter().skip(1).any(|c| c["records"] == 0),
            "an idle interval's checkpoint counts nothing: {checkpoints:#?}"
        );
        let record_3 = lines.iter().find(|r| r["n"] == 3).unwrap()["seq"]
            .as_u64()
            .unwrap();
        let next = checkpoints
            .iter()
            .find(|c| c["seq"].as_u64().unwrap() > record_3)
            .expect("a checkpoint after record 3");
        assert_eq!(next["records"], 1, "it counts record 3: {checkpoints:#?}");
    }

    #[tokio::test]
    async fn concurrent_records_chain_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let s = Arc::new(sink(options(&path)));
        let writes: Vec<_> = (0..200)
            .map(|i| {
                let s = s.clone();
                tokio::spawn(async move { s.write(&record(i)).await })
            })
            .collect();
        for w in writes {
            w.await.unwrap().unwrap();
        }
        drop(s);
        // A restart continues the chain (no rotation record: the same file).
        let s = sink(options(&path));
        s.write(&record(200)).await.unwrap();
        let v = verify::verify(std::slice::from_ref(&path)).unwrap();
        assert_eq!(v.records, 201);
        assert!(v.from_genesis);
    }

    #[tokio::test]
    async fn a_torn_last_line_is_cut_and_the_chain_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        three_records_then(&path, b"{\"type\":\"credential\",\"n\":3,\"se").await;
        assert!(verify::verify(std::slice::from_ref(&path)).is_err(), "torn");
        let s = sink(options(&path));
        s.write(&record(4)).await.unwrap();
        assert_eq!(
            verify::verify(std::slice::from_ref(&path)).unwrap().records,
            4
        );
    }

    #[tokio::test]
    async fn rotation_keeps_the_chain_and_retention_keeps_it_verifiable() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let mut o = options(&path);
        o.max_bytes = 300;
        o.keep = 3;
        let s = sink(o);
        for i in 0..30 {
            s.write(&record(i)).await.unwrap();
        }
        // Old files are removed on the retention thread, after the
        // rotation that made them excess.
        let mut files = files_of(dir.path());
        for _ in 0..500 {
            if files.len() <= 4 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
            files = files_of(dir.path());
        }
        assert_eq!(
            files.len(),
            4,
            "three rotated files kept and the active one: {files:?}"
        );
        assert_eq!(files.last().unwrap(), &path);
        let v = verify::verify(&files).unwrap();
        assert!(!v.from_genesis, "the oldest files are gone");
        // Each file begins with a rotation record naming the one before.
        let text = std::fs::read_to_string(&path).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["type"], "rotation");
        assert_eq!(
            first["previous_file"],
            files[2].file_name().unwrap().to_str().unwrap()
        );
    }

    #[tokio::test]
    async fn a_foreign_last_line_is_set_aside_and_the_sequence_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        three_records_then(&path, b"edited by hand\n").await;
        let s = sink(options(&path));
        s.write(&record(3)).await.unwrap();
        let aside: Vec<PathBuf> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("audit.unreadable-"))
            .collect();
        assert_eq!(aside.len(), 1, "kept for inspection");
        let text = std::fs::read_to_string(&path).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["type"], "rotation");
        assert_eq!(first["reason"], "previous file unreadable");
        assert_eq!(
            first["seq"], 3,
            "the sequence goes on from the last readable record"
        );
        // One chain rule (docs/audit.md, Restarts): it follows that record
        // and keeps the chain's name.
        let set_aside = std::fs::read_to_string(&aside[0]).unwrap();
        let last: serde_json::Value =
            serde_json::from_str(set_aside.lines().nth(2).unwrap()).unwrap();
        assert_eq!(first["prev"], last["hash"]);
        assert_eq!(first["chain"], last["chain"]);
        assert_eq!(
            verify::verify(std::slice::from_ref(&path)).unwrap().records,
            2
        );
    }

    /// The `n` of each record in `path`, in order.
    fn numbers_in(path: &Path) -> Vec<u64> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["n"].as_u64())
            .collect()
    }

    #[tokio::test]
    async fn a_file_moved_or_replaced_without_sighup_is_noticed_at_the_next_record() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let moved = dir.path().join("moved.jsonl");
        let s = sink(options(&path));
        s.write(&record(0)).await.unwrap();
        s.write(&record(1)).await.unwrap();
        // Moved away, as a rotator that sends no SIGHUP does: the very next
        // record goes to a new file at the path.
        std::fs::rename(&path, &moved).unwrap();
        s.write(&record(2)).await.unwrap();
        assert_eq!(numbers_in(&moved), [0, 1]);
        assert_eq!(numbers_in(&path), [2]);
        // Replaced by another file renamed over it: the next record goes to
        // the file the path now names.
        let other = dir.path().join("other.tmp");
        std::fs::write(&other, b"").unwrap();
        std::fs::rename(&other, &path).unwrap();
        s.write(&record(3)).await.unwrap();
        assert_eq!(numbers_in(&path), [3]);
        // Records written with nothing changed stay where they are.
        s.write(&record(4)).await.unwrap();
        assert_eq!(numbers_in(&path), [3, 4]);
    }

    #[tokio::test]
    async fn a_directory_above_moved_is_noticed_within_a_second() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a").join("b").join("audit.jsonl");
        let s = sink(options(&path));
        s.write(&record(0)).await.unwrap();
        // A rename two levels up is no event in the file's own directory;
        // the path is still looked up at least once a second.
        std::fs::rename(dir.path().join("a"), dir.path().join("a2")).unwrap();
        tokio::time::sleep(LOOK_AT_LEAST_EVERY + Duration::from_millis(100)).await;
        s.write(&record(1)).await.unwrap();
        assert_eq!(numbers_in(&path), [1]);
        assert_eq!(numbers_in(&dir.path().join("a2/b/audit.jsonl")), [0]);
    }

    #[tokio::test]
    async fn a_removed_directory_fails_then_recovers_and_records_the_outage() {
        let dir = tempfile::tempdir().unwrap();
        let logs = dir.path().join("logs");
        let path = logs.join("audit.jsonl");
        let s = sink(options(&path));
        s.write(&record(0)).await.unwrap();
        // The directory is removed and a file put in its place: nothing can
        // be written, and the writer says so rather than losing records.
        std::fs::remove_dir_all(&logs).unwrap();
        std::fs::write(&logs, b"not a directory").unwrap();
        let err = s.write(&record(1)).await.unwrap_err();
        assert!(err.contains("audit file"), "{err}");
        assert!(s.write(&record(2)).await.is_err());
        std::fs::remove_file(&logs).unwrap();
        s.write(&record(3)).await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let types: Vec<String> = text
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        assert_eq!(types, ["rotation", "sink_failure", "credential"], "{text}");
        let failure: serde_json::Value =
            serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
        assert_eq!(failure["records"], 2);
        assert_eq!(failure["handling"], "refused");
        // The new file carries the chain on from the record before.
        assert!(!text.contains("\"n\":1") && !text.contains("\"n\":2"));
        assert_eq!(verify::verify(&[path]).unwrap().records, 3);
    }
}
