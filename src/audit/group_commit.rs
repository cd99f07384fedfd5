//! The hand-off between requests and the audit file's writer thread.
//!
//! Requests append their records to the open batch (one buffer, under a
//! short lock) and wait on that batch; the writer takes the whole batch at
//! once, writes and syncs it, and answers every record in it at once (one
//! outcome, set once, and every waiting request woken in one pass). Per
//! record that is one copy and one waiter registration.
//!
//! Why not a channel of records, each with its own reply channel (what
//! this replaced): every record then cost two allocations made on a
//! request's thread and freed on the writer's (glibc's arena lock taken
//! across threads), and a queue slot and a reply channel of its own.

use std::pin::pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

use tokio::sync::Notify;

/// What the writer answers for a batch: written (and synced), or why not.
pub(super) type Outcome = Result<(), String>;

/// What a request is told once the writer has gone (it stopped or failed).
const STOPPED: &str = "the audit file writer has stopped";

/// Most records waiting at once (one batch's worth): past it, requests wait
/// for the writer to take the batch.
const MAX_RECORDS: usize = 4096;

/// One batch's outcome, shared by the requests whose records it holds.
struct Batch {
    outcome: OnceLock<Outcome>,
    done: Notify,
}

impl Batch {
    fn new() -> Arc<Batch> {
        Arc::new(Batch {
            outcome: OnceLock::new(),
            done: Notify::new(),
        })
    }

    async fn wait(&self) -> Outcome {
        loop {
            let mut done = pin!(self.done.notified());
            // INVARIANT: registered before the outcome is read, so a
            // `finish` between the read and the await still wakes us.
            done.as_mut().enable();
            if let Some(outcome) = self.outcome.get() {
                return outcome.clone();
            }
            done.await;
        }
    }

    fn finish(&self, outcome: Outcome) {
        // Only the first outcome counts: a batch is finished once.
        let _ = self.outcome.set(outcome);
        self.done.notify_waiters();
    }
}

/// The records waiting for the writer.
struct Waiting {
    /// Their bytes, back to back.
    bytes: Vec<u8>,
    /// Where each ends in `bytes`.
    ends: Vec<usize>,
    /// The batch they will be written in.
    batch: Arc<Batch>,
    /// The file is to be reopened before the next write (SIGHUP).
    reopen: bool,
    /// The writer sleeps on `records_waiting`.
    writer_asleep: bool,
    /// A request waits on `space`.
    space_wanted: bool,
    /// Every handle is gone: the writer ends once nothing waits.
    closed: bool,
    /// The writer has gone: nothing more is written.
    stopped: bool,
}

/// The queue between requests and the writer.
pub(super) struct Queue {
    waiting: Mutex<Waiting>,
    /// The writer waits here for records.
    records_waiting: Condvar,
    /// Requests wait here while `MAX_RECORDS` wait.
    space: Notify,
}

/// A batch the writer took: its records and whom to answer.
pub(super) struct Taken {
    bytes: Vec<u8>,
    ends: Vec<usize>,
    batch: Option<Arc<Batch>>,
    /// Reopen the file before writing.
    pub(super) reopen: bool,
}

impl Taken {
    /// An empty batch to take into (its buffers are reused batch after
    /// batch).
    pub(super) fn new() -> Taken {
        Taken {
            bytes: Vec::new(),
            ends: Vec::new(),
            batch: None,
            reopen: false,
        }
    }

    /// The records, in the order they were queued.
    pub(super) fn records(&self) -> impl Iterator<Item = &[u8]> {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts.zip(&self.ends).map(|(s, &e)| &self.bytes[s..e])
    }

    /// How many records.
    pub(super) fn len(&self) -> usize {
        self.ends.len()
    }

    /// Answers every request of the batch, and empties it for the next,
    /// keeping a buffer up to `keep_bytes`.
    pub(super) fn answer(&mut self, outcome: Outcome, keep_bytes: usize) {
        if let Some(batch) = self.batch.take() {
            batch.finish(outcome);
        }
        self.bytes.clear();
        self.ends.clear();
        self.reopen = false;
        if self.bytes.capacity() > keep_bytes {
            self.bytes = Vec::new();
        }
    }
}

impl Drop for Taken {
    /// A batch dropped unanswered (the writer panicked while writing it)
    /// is answered as failed, so that no request waits forever.
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            batch.finish(Err(STOPPED.to_string()));
        }
    }
}

impl Queue {
    pub(super) fn new() -> Arc<Queue> {
        Arc::new(Queue {
            waiting: Mutex::new(Waiting {
                bytes: Vec::new(),
                ends: Vec::new(),
                batch: Batch::new(),
                reopen: false,
                writer_asleep: false,
                space_wanted: false,
                closed: false,
                stopped: false,
            }),
            records_waiting: Condvar::new(),
            space: Notify::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Waiting> {
        // The state stays consistent at every unlock; a panic elsewhere
        // while holding the lock leaves nothing half done.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `record` and returns once the writer has written it (or
    /// failed to).
    pub(super) async fn write(&self, record: &[u8]) -> Outcome {
        loop {
            if let Some(batch) = self.try_queue(record)? {
                return batch.wait().await;
            }
            let mut space = pin!(self.space.notified());
            // INVARIANT: registered before looking again, so the writer's
            // taking of the batch between the two cannot be missed.
            space.as_mut().enable();
            if let Some(batch) = self.try_queue(record)? {
                return batch.wait().await;
            }
            space.await;
        }
    }

    /// Appends `record` to the open batch, or `None` when it is full.
    fn try_queue(&self, record: &[u8]) -> Result<Option<Arc<Batch>>, String> {
        let mut w = self.lock();
        if w.stopped {
            return Err(STOPPED.to_string());
        }
        if w.ends.len() >= MAX_RECORDS {
            w.space_wanted = true;
            return Ok(None);
        }
        w.bytes.extend_from_slice(record);
        let end = w.bytes.len();
        w.ends.push(end);
        let batch = w.batch.clone();
        self.wake_writer(w);
        Ok(Some(batch))
    }

    /// Asks the writer to reopen the file before its next write.
    pub(super) fn reopen(&self) {
        let mut w = self.lock();
        w.reopen = true;
        self.wake_writer(w);
    }

    /// Unlocks `w` and wakes the writer if it sleeps: a writer at work
    /// looks for more before it sleeps, so it needs no system call.
    fn wake_writer(&self, mut w: MutexGuard<'_, Waiting>) {
        let wake = std::mem::take(&mut w.writer_asleep);
        drop(w);
        if wake {
            self.records_waiting.notify_one();
        }
    }

    /// No handle is left: the writer ends once it has written what waits.
    pub(super) fn close(&self) {
        let mut w = self.lock();
        w.closed = true;
        drop(w);
        self.records_waiting.notify_one();
    }

    /// The writer's side: waits for records (or a reopen) and moves them
    /// into `into`, which must be empty; returns with `into` still empty
    /// at `until`, when given. `false` once closed and empty.
    pub(super) fn take(&self, into: &mut Taken, until: Option<std::time::Instant>) -> bool {
        let mut w = self.lock();
        while w.ends.is_empty() && !w.reopen {
            if w.closed {
                return false;
            }
            w.writer_asleep = true;
            w = match until {
                None => self
                    .records_waiting
                    .wait(w)
                    .unwrap_or_else(|p| p.into_inner()),
                Some(until) => {
                    let left = until.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        w.writer_asleep = false;
                        return true;
                    }
                    self.records_waiting
                        .wait_timeout(w, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        w.writer_asleep = false;
        std::mem::swap(&mut w.bytes, &mut into.bytes);
        std::mem::swap(&mut w.ends, &mut into.ends);
        into.reopen = std::mem::take(&mut w.reopen);
        if !into.ends.is_empty() {
            into.batch = Some(std::mem::replace(&mut w.batch, Batch::new()));
        }
        let space = std::mem::take(&mut w.space_wanted);
        drop(w);
        if space {
            self.space.notify_waiters();
        }
        true
    }

    /// The writer has gone: what waits, and whatever comes, fails.
    pub(super) fn stop(&self) {
        let mut w = self.lock();
        w.stopped = true;
        w.bytes = Vec::new();
        w.ends = Vec::new();
        let batch = std::mem::replace(&mut w.batch, Batch::new());
        drop(w);
        batch.finish(Err(STOPPED.to_string()));
        self.space.notify_waiters();
    }
}

/// Stops the queue when the writer ends, by return or by panic.
pub(super) struct StopOnDrop(pub(super) Arc<Queue>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A writer thread that answers each batch with `outcome(batch number)`
    /// and reports the batches' records.
    fn writer(
        queue: Arc<Queue>,
        outcome: impl Fn(usize) -> Outcome + Send + 'static,
    ) -> std::thread::JoinHandle<Vec<Vec<Vec<u8>>>> {
        std::thread::spawn(move || {
            let _stop = StopOnDrop(queue.clone());
            let mut taken = Taken::new();
            let mut batches = Vec::new();
            while queue.take(&mut taken, None) {
                if taken.len() == 0 {
                    taken.answer(Ok(()), usize::MAX);
                    continue;
                }
                batches.push(taken.records().map(<[u8]>::to_vec).collect());
                taken.answer(outcome(batches.len() - 1), usize::MAX);
            }
            batches
        })
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_record_is_written_once_in_order_and_answered() {
        let queue = Queue::new();
        let thread = writer(queue.clone(), |_| Ok(()));
        let tasks: Vec<_> = (0..500)
            .map(|i| {
                let queue = queue.clone();
                tokio::spawn(async move {
                    for j in 0..4 {
                        let record = format!("{i}.{j}");
                        queue.write(record.as_bytes()).await.unwrap();
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        queue.close();
        let batches = thread.join().unwrap();
        let records: Vec<String> = batches
            .iter()
            .flatten()
            .map(|r| String::from_utf8(r.clone()).unwrap())
            .collect();
        assert_eq!(records.len(), 2000);
        // Each task's records come in its order: the next is queued only
        // once the one before was answered.
        for i in 0..500 {
            let mine: Vec<&String> = records
                .iter()
                .filter(|r| r.split('.').next() == Some(&i.to_string()))
                .collect();
            let expected: Vec<String> = (0..4).map(|j| format!("{i}.{j}")).collect();
            assert_eq!(mine, expected.iter().collect::<Vec<_>>());
        }
        assert!(
            batches.len() < 2000,
            "concurrent records share batches: {} batches",
            batches.len()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_batch_fails_exactly_its_own_records() {
        let queue = Queue::new();
        // The writer fails every other batch.
        let thread = writer(queue.clone(), |n| match n % 2 {
            0 => Ok(()),
            _ => Err(format!("batch {n} failed")),
        });
        let tasks: Vec<_> = (0..200)
            .map(|i| {
                let queue = queue.clone();
                tokio::spawn(async move {
                    let record = format!("r{i}");
                    (record.clone(), queue.write(record.as_bytes()).await)
                })
            })
            .collect();
        let mut answers = std::collections::HashMap::new();
        for task in tasks {
            let (record, outcome) = task.await.unwrap();
            answers.insert(record, outcome);
        }
        queue.close();
        let batches = thread.join().unwrap();
        for (n, batch) in batches.iter().enumerate() {
            for record in batch {
                let outcome = &answers[std::str::from_utf8(record).unwrap()];
                match n % 2 {
                    0 => assert_eq!(outcome, &Ok(())),
                    _ => assert_eq!(outcome, &Err(format!("batch {n} failed"))),
                }
            }
        }
        assert_eq!(batches.iter().map(Vec::len).sum::<usize>(), 200);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_makes_requests_wait_until_the_writer_takes_it() {
        let queue = Queue::new();
        let tasks: Vec<_> = (0..MAX_RECORDS + 10)
            .map(|i| {
                let queue = queue.clone();
                tokio::spawn(async move { queue.write(format!("{i}").as_bytes()).await })
            })
            .collect();
        // No writer yet: the queue fills to its bound and the rest wait.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while queue.lock().ends.len() < MAX_RECORDS {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue never filled"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(queue.lock().ends.len(), MAX_RECORDS);
        assert!(queue.lock().space_wanted);
        let thread = writer(queue.clone(), |_| Ok(()));
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        queue.close();
        let batches = thread.join().unwrap();
        assert!(batches.iter().all(|b| b.len() <= MAX_RECORDS));
        assert_eq!(
            batches.iter().map(Vec::len).sum::<usize>(),
            MAX_RECORDS + 10
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_that_dies_fails_its_batch_and_every_later_record() {
        let queue = Queue::new();
        let q = queue.clone();
        let thread = std::thread::spawn(move || {
            let _stop = StopOnDrop(q.clone());
            let mut taken = Taken::new();
            assert!(q.take(&mut taken, None));
            panic!("the writer fails while writing");
        });
        let outcome = queue.write(b"first").await;
        assert_eq!(outcome, Err(STOPPED.to_string()));
        assert!(thread.join().is_err());
        assert_eq!(queue.write(b"later").await, Err(STOPPED.to_string()));
    }

    #[test]
    fn a_reopen_wakes_the_writer_with_no_record() {
        let queue = Queue::new();
        let q = queue.clone();
        let thread = std::thread::spawn(move || {
            let mut taken = Taken::new();
            let woke = q.take(&mut taken, None);
            (woke, taken.reopen, taken.len())
        });
        std::thread::sleep(Duration::from_millis(20));
        queue.reopen();
        assert_eq!(thread.join().unwrap(), (true, true, 0));
    }
}
