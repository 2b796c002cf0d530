//! The thread that polls librdkafka, and the state it shares with the
//! handler loop: offsets taken and decided, partitions owned, handlers in
//! flight.
//!
//! Polling runs on a thread of its own because librdkafka calls the
//! rebalance callback from inside `poll`, and on a revocation that callback
//! must *wait* for in-flight handlers (up to a deadline) and commit before
//! returning: the partitions are gone once it returns. Blocking there is
//! fine on a dedicated thread, and the handlers keep running meanwhile on
//! the caller's task, whatever the Tokio runtime's flavour.

use super::KafkaConfig;
use super::headers::RecordHeaders;
use super::offsets::OffsetTracker;
use crate::message::Message;
use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::message::Message as _;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc};

/// One record taken from a partition, on its way through the handler loop.
///
/// `Clone` only for a record a `run` stops without deciding (kept for the
/// next `run`, see `KafkaConsumer::kept`): never on the per-record path.
#[derive(Debug, Clone)]
pub(super) struct Taken {
    pub(super) topic: Arc<str>,
    pub(super) partition: i32,
    pub(super) offset: i64,
    /// Arrival order over every partition (the poll thread's count): the
    /// records a `run` leaves are queued again in this order by the next.
    pub(super) seq: u64,
    /// The partition's assignment when the record was taken: a completion
    /// from an older assignment must not decide an offset of a newer one.
    pub(super) epoch: u64,
    pub(super) record_key: Option<Vec<u8>>,
    pub(super) headers: Option<RecordHeaders>,
    /// What the core sees (payload, id, delivery count, source).
    pub(super) msg: Message,
}

/// A partition this consumer owns.
#[derive(Debug)]
struct Part {
    epoch: u64,
    /// Revocation under way: start nothing more from it.
    revoking: bool,
    in_flight: usize,
}

#[derive(Debug, Default)]
struct State {
    tracker: OffsetTracker,
    parts: HashMap<(Arc<str>, i32), Part>,
    next_epoch: u64,
}

/// Shared between the poll thread, the rebalance callback and the handler loop.
#[derive(Debug)]
pub(super) struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a handler finishes (a revocation waits on it).
    finished: Condvar,
    /// Woken when a revocation or a shutdown starts, so retry pauses
    /// notice at once.
    pub(super) revoked: Notify,
    /// `run` is shutting down: records in flight may finish what they
    /// are doing, but start no further attempt.
    closing: AtomicBool,
    revoke_deadline: Duration,
    commits: AtomicU64,
    commit_failures: AtomicU64,
    given_up: AtomicU64,
    /// Commits started and not ended: each holds librdkafka's consumer
    /// (a synchronous commit on a blocking thread, which a dropped `run`
    /// leaves going), and `close` leaves the group only after them.
    commits_running: Mutex<usize>,
    commit_ended: Condvar,
}

/// A commit in progress, counted in [`Shared`] until dropped.
pub(super) struct CommitRunning(Arc<Shared>);

impl Drop for CommitRunning {
    fn drop(&mut self) {
        let mut running = self.0.commits_running();
        *running = running.saturating_sub(1);
        self.0.commit_ended.notify_all();
    }
}

impl Shared {
    pub(super) fn new(revoke_deadline: Duration) -> Shared {
        Shared {
            state: Mutex::new(State::default()),
            finished: Condvar::new(),
            revoked: Notify::new(),
            closing: AtomicBool::new(false),
            revoke_deadline,
            commits: AtomicU64::new(0),
            commit_failures: AtomicU64::new(0),
            given_up: AtomicU64::new(0),
            commits_running: Mutex::new(0),
            commit_ended: Condvar::new(),
        }
    }

    fn commits_running(&self) -> MutexGuard<'_, usize> {
        // A count, consistent whatever a panicking holder was doing.
        self.commits_running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Counts a commit as running until the returned guard is dropped
    /// (after the commit has let go of the consumer).
    pub(super) fn commit_running(self: &Arc<Self>) -> CommitRunning {
        *self.commits_running() += 1;
        CommitRunning(Arc::clone(self))
    }

    /// Blocks until no commit is running.
    pub(super) fn wait_for_commits(&self) {
        let mut running = self.commits_running();
        while *running > 0 {
            running = self
                .commit_ended
                .wait(running)
                .unwrap_or_else(|e| e.into_inner());
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panicking holder: every
        // update is a single map or set operation.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a record taken from the broker; returns its partition's epoch.
    fn take(&self, topic: &Arc<str>, partition: i32, offset: i64) -> u64 {
        let mut st = self.lock();
        let st = &mut *st;
        let key = (topic.clone(), partition);
        let epoch = match st.parts.get(&key) {
            Some(p) => p.epoch,
            None => {
                st.next_epoch += 1;
                let epoch = st.next_epoch;
                st.parts.insert(
                    key,
                    Part {
                        epoch,
                        revoking: false,
                        in_flight: 0,
                    },
                );
                epoch
            }
        };
        st.tracker.take(topic, partition, offset);
        epoch
    }

    fn part_is<'a>(st: &'a mut State, t: &Taken) -> Option<&'a mut Part> {
        st.parts
            .get_mut(&(t.topic.clone(), t.partition))
            .filter(|p| p.epoch == t.epoch)
    }

    /// Whether `t` may try again: its partition is still ours (same
    /// assignment, not being revoked) and `run` is not shutting down.
    pub(super) fn is_live(&self, t: &Taken) -> bool {
        !self.closing.load(Ordering::Relaxed) && self.owns(t)
    }

    /// Whether `t`'s partition is still ours: the same assignment, not
    /// being revoked. A record of a partition given up is the next owner's
    /// (it reads it again from the last commit).
    pub(super) fn owns(&self, t: &Taken) -> bool {
        let mut st = self.lock();
        Self::part_is(&mut st, t).is_some_and(|p| !p.revoking)
    }

    /// Starts (`true`) or ends a shutdown of `run`: paused records stop
    /// waiting and are abandoned undecided.
    pub(super) fn set_closing(&self, closing: bool) {
        self.closing.store(closing, Ordering::Relaxed);
        if closing {
            self.revoked.notify_waiters();
        }
    }

    /// `t`'s handling was dropped unfinished (its handler future dropped at
    /// the drain deadline, or with `run` itself): no longer in flight, so a
    /// revocation need not wait for it; still undecided, so the commit
    /// stays before it.
    pub(super) fn dropped(&self, t: &Taken) {
        let mut st = self.lock();
        if let Some(p) = Self::part_is(&mut st, t) {
            p.in_flight = p.in_flight.saturating_sub(1);
        }
        self.finished.notify_all();
    }

    /// Counts `t` in flight when its partition is still ours.
    pub(super) fn begin(&self, t: &Taken) -> bool {
        let mut st = self.lock();
        match Self::part_is(&mut st, t) {
            Some(p) if !p.revoking => {
                p.in_flight += 1;
                true
            }
            _ => false,
        }
    }

    /// `t` is decided (acked, or handed to a retry or dead-letter topic):
    /// its offset no longer holds the commit back. Returns false when the
    /// partition was given up meanwhile (nothing recorded).
    pub(super) fn decide(&self, t: &Taken) -> bool {
        self.finish(t, true)
    }

    /// `t` stops without a decision (its partition is being revoked): it
    /// stays undecided, so the commit stays before it.
    pub(super) fn abandon(&self, t: &Taken) {
        self.finish(t, false);
    }

    fn finish(&self, t: &Taken, decided: bool) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(p) = Self::part_is(st, t) else {
            return false;
        };
        p.in_flight = p.in_flight.saturating_sub(1);
        if decided {
            st.tracker.decide(&t.topic, t.partition, t.offset);
        }
        self.finished.notify_all();
        true
    }

    /// Offsets to commit for partitions not being revoked (the revocation
    /// commits its own).
    pub(super) fn to_commit(&self) -> Vec<(String, i32, i64)> {
        let st = self.lock();
        st.tracker
            .to_commit()
            .into_iter()
            .filter(|(t, p, _)| {
                st.parts
                    .get(&(Arc::from(t.as_str()), *p))
                    .is_some_and(|part| !part.revoking)
            })
            .collect()
    }

    /// Records a commit the broker accepted.
    pub(super) fn committed(&self, offsets: &[(String, i32, i64)]) {
        let mut st = self.lock();
        for (topic, partition, offset) in offsets {
            st.tracker.committed(topic, *partition, *offset);
        }
        self.commits.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a commit the broker refused or did not answer.
    pub(super) fn commit_failed(&self) {
        self.commit_failures.fetch_add(1, Ordering::Relaxed);
    }

    /// Commits accepted by the broker so far.
    pub(super) fn commits(&self) -> u64 {
        self.commits.load(Ordering::Relaxed)
    }

    /// The last offset committed for a partition this consumer owns.
    pub(super) fn last_committed(&self, topic: &str, partition: i32) -> Option<i64> {
        self.lock()
            .tracker
            .partition(topic, partition)
            .and_then(|p| p.last_committed())
    }

    /// Partitions given up on revocation so far.
    pub(super) fn given_up(&self) -> u64 {
        self.given_up.load(Ordering::Relaxed)
    }

    /// Undecided records over every owned partition.
    pub(super) fn undecided(&self) -> usize {
        self.lock().tracker.undecided()
    }

    /// The rebalance protocol's revocation: stop taking from `revoked`, give
    /// its handlers until the deadline, commit what is decided, forget it.
    fn revoke(&self, consumer: &BaseConsumer<Ctx>, revoked: &TopicPartitionList) {
        let parts: Vec<(Arc<str>, i32)> = revoked
            .elements()
            .iter()
            .map(|e| (Arc::from(e.topic()), e.partition()))
            .collect();
        let mut st = self.lock();
        for key in &parts {
            if let Some(p) = st.parts.get_mut(key) {
                p.revoking = true;
            }
        }
        self.revoked.notify_waiters();
        let end = Instant::now() + self.revoke_deadline;
        loop {
            let busy: usize = parts
                .iter()
                .filter_map(|k| st.parts.get(k))
                .map(|p| p.in_flight)
                .sum();
            let now = Instant::now();
            if busy == 0 {
                break;
            }
            if now >= end {
                // Their idem leases stay theirs while they run: the next
                // owner's claim waits (InProgress) and then replays, or takes
                // over if this process dies; a completion after the lease
                // was taken over is refused by owner token.
                tracing::warn!(
                    in_flight = busy,
                    deadline_ms = self.revoke_deadline.as_millis() as u64,
                    "partitions revoked with handlers still running; giving them up undecided"
                );
                break;
            }
            st = self
                .finished
                .wait_timeout(st, end - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
        let mut tpl = TopicPartitionList::new();
        for (topic, partition) in &parts {
            let to = st
                .tracker
                .partition(topic, *partition)
                .and_then(|p| p.to_commit());
            if let Some(o) = to
                && let Err(e) = tpl.add_partition_offset(topic, *partition, Offset::Offset(o))
            {
                tracing::warn!(error = %e, "cannot list an offset to commit");
            }
        }
        drop(st);
        if tpl.count() > 0 {
            match consumer.commit(&tpl, CommitMode::Sync) {
                Ok(()) => {
                    self.commits.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(offsets = ?tpl, "decided offsets committed on revocation");
                }
                Err(e) => {
                    self.commit_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(error = %e, "commit on revocation failed; the next owner re-reads from the last commit and idem replays what was done");
                }
            }
        }
        let mut st = self.lock();
        for (topic, partition) in &parts {
            st.parts.remove(&(topic.clone(), *partition));
            st.tracker.forget(topic, *partition);
        }
        drop(st);
        self.given_up
            .fetch_add(parts.len() as u64, Ordering::Relaxed);
        tracing::info!(partitions = parts.len(), "partitions given up");
    }
}

/// librdkafka's callbacks, routed to the shared state and to `tracing`.
pub(super) struct Ctx {
    pub(super) shared: Arc<Shared>,
}

impl ClientContext for Ctx {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        // librdkafka reconnects by itself: these are reports, not failures.
        tracing::warn!(error = %error, reason, "kafka client error");
    }
}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(tpl) => self.shared.revoke(consumer, tpl),
            Rebalance::Assign(tpl) => {
                tracing::info!(partitions = tpl.count(), "partitions assigned")
            }
            Rebalance::Error(e) => tracing::warn!(error = %e, "rebalance error"),
        }
    }
}

/// Polls until `stop` is set or the handler loop is gone, sending every
/// record taken into `tx`. A full channel blocks the thread (back-pressure):
/// librdkafka keeps heartbeating on its own threads meanwhile.
pub(super) fn poll_loop(
    consumer: Arc<BaseConsumer<Ctx>>,
    shared: Arc<Shared>,
    cfg: Arc<KafkaConfig>,
    tx: mpsc::Sender<Taken>,
    stop: Arc<AtomicBool>,
) {
    let mut topics: HashMap<String, Arc<str>> = HashMap::new();
    // A record's position (`partition@offset`) is written here, then
    // shared: one allocation per record.
    let mut position = String::new();
    let mut seq: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        let Some(polled) = consumer.poll(Duration::from_millis(100)) else {
            continue;
        };
        let m = match polled {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "kafka poll error");
                continue;
            }
        };
        // Looked up by `&str`: no `String` per record for a known topic.
        let topic = match topics.get(m.topic()) {
            Some(topic) => Arc::clone(topic),
            None => {
                let topic: Arc<str> = Arc::from(m.topic());
                topics.insert(m.topic().to_owned(), Arc::clone(&topic));
                topic
            }
        };
        let epoch = shared.take(&topic, m.partition(), m.offset());
        let headers = m.headers().map(RecordHeaders::of);
        if let Some(h) = headers.as_ref().filter(|h| h.unreadable() > 0) {
            tracing::warn!(
                topic = &*topic,
                partition = m.partition(),
                offset = m.offset(),
                unreadable = h.unreadable(),
                "a Kafka record has header names that are not UTF-8, which rdkafka cannot read \
                 (its panic, if printed above, was caught): the record is handled without those \
                 headers, its key, payload and other headers unchanged, and a copy to the retry \
                 or dead-letter topic keeps them byte for byte. Have its producer write UTF-8 \
                 header names"
            );
        }
        let payload = Bytes::copy_from_slice(m.payload().unwrap_or_default());
        position.clear();
        position.push_str(itoa::Buffer::new().format(m.partition()));
        position.push('@');
        position.push_str(itoa::Buffer::new().format(m.offset()));
        let msg = cfg
            .message_of(payload, m.key(), headers.as_ref(), &topic)
            .at_position(Arc::from(position.as_str()));
        let taken = Taken {
            topic,
            partition: m.partition(),
            offset: m.offset(),
            seq,
            epoch,
            record_key: m.key().map(<[u8]>::to_vec),
            headers,
            msg,
        };
        drop(m);
        seq = seq.wrapping_add(1);
        if tx.blocking_send(taken).is_err() {
            break;
        }
    }
    tracing::debug!("kafka poll thread stopped");
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc as std_mpsc;

    /// `close` waits on this before it drops the last handle: it must not
    /// return while a commit runs, and must return once the last one ends.
    #[test]
    fn waiting_for_commits_returns_when_the_last_running_commit_ends() {
        let shared = Arc::new(Shared::new(Duration::from_secs(1)));
        shared.wait_for_commits(); // none running: at once
        let (first, second) = (shared.commit_running(), shared.commit_running());
        let (tx, rx) = std_mpsc::channel();
        let waiter = {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || {
                shared.wait_for_commits();
                let _ = tx.send(());
            })
        };
        drop(first);
        assert!(
            rx.recv_timeout(Duration::from_millis(200)).is_err(),
            "returned with a commit still running"
        );
        drop(second);
        assert!(rx.recv_timeout(Duration::from_secs(30)).is_ok());
        assert!(waiter.join().is_ok());
    }
}
