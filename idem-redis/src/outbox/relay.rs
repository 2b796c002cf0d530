//! [`RedisRelay`]: drains a Redis outbox into a [`Sink`], at least once, in
//! order per key.
//!
//! One relay drains a stream at a time (a lock with a lease, renewed while
//! it works), so a key's messages go out in stream order; any number of
//! relays may run, the others stand by (and, on a cluster, share the
//! streams). A pass reads the stream from its start, skips the keys held
//! back by a parked or backing-off message, sends the rest in waves, and
//! deletes what the broker confirmed. A relay killed mid-pass deletes
//! nothing: the next holder sends those messages again, with the same ids.

use super::{Entry, Listed, ParkedMark, RedisOutbox, SCRIPTS, now_ms};
use crate::store::outbox::{StreamKeys, index_key, outbox_error};
use idem_core::Error;
use idem_core::outbox::OutboxMessage;
use idem_core::outbox::Sink;
use idem_core::outbox::{RelayReport, SendPolicy, Waves, send_in_waves};
use idem_core::store::Token;
use redis::Value;
use std::collections::{HashMap, HashSet};
use std::pin::pin;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Messages a pass takes by default.
const DEFAULT_BATCH: usize = 256;
/// How long a relay's hold on a stream lasts unless renewed (every third
/// of it while the relay works): a relay that dies is replaced after this.
const LOCK_LEASE: Duration = Duration::from_secs(10);
/// A cluster stream found empty is dropped from the index only when no
/// complete named it for this long (a complete names it just before its
/// script, so one under way is never missed).
const PRUNE_AFTER: Duration = Duration::from_secs(300);

/// How long a pass may resume where the previous one stopped before one
/// reads the stream from its start again.
const RESCAN: Duration = Duration::from_secs(1);

/// A failed message's next try.
#[derive(Debug, Clone, Copy)]
struct Retry {
    attempts: u32,
    due: Instant,
}

/// Publishes a [`RedisOutbox`] through a [`Sink`].
///
/// ```no_run
/// use idem_core::outbox::Sink;
/// use idem_redis::outbox::RedisRelay;
/// use std::time::Duration;
///
/// # async fn demo(store: idem_redis::RedisStore, sink: impl Sink + 'static) {
/// let relay = RedisRelay::new(&store, sink).batch_size(500).poll_interval(Duration::from_millis(50));
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let running = tokio::spawn(async move { relay.run(async { let _ = stopped.await; }).await });
/// // … at shutdown: the pass under way finishes, then `run` returns.
/// let _ = stop.send(());
/// let report = running.await.unwrap();
/// # }
/// ```
pub struct RedisRelay<S> {
    outbox: RedisOutbox,
    sink: S,
    batch: usize,
    poll: Duration,
    policy: SendPolicy,
    /// This relay's name in the streams' locks.
    holder: Token,
    retries: Mutex<HashMap<String, Retry>>,
    /// The locks this relay took, freed when `run` stops.
    held: Mutex<HashSet<String>>,
    /// Per stream, where the next pass may resume past a long run of
    /// held-back entries.
    cursors: Mutex<HashMap<String, Cursor>>,
}

/// Where a pass stopped after reading its limit of entries without filling
/// its batch (a parked or backing-off key with a long backlog). Everything
/// before `after` that was not sent belongs to a key in `blocked` (entries
/// are only ever appended), so the next pass may start there instead of
/// reading the same held-back entries again. Good for [`RESCAN`]: then a
/// pass reads from the start again, which finds keys a retry, a drop or an
/// ended backoff let go.
#[derive(Debug, Clone)]
struct Cursor {
    after: String,
    blocked: HashSet<String>,
    set_at: Instant,
}

impl<S> std::fmt::Debug for RedisRelay<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisRelay")
            .field("prefix", &self.outbox.store.outbox_prefix())
            .field("batch", &self.batch)
            .field("poll", &self.poll)
            .field("send_timeout", &self.policy.send_timeout)
            .finish_non_exhaustive()
    }
}

impl<S: Sink> RedisRelay<S> {
    /// A relay of `outbox` (a [`RedisStore`](crate::RedisStore)'s) into
    /// `sink`, with 256 messages a pass, a 100 ms poll, a 30 s send timeout
    /// and retries backing off from 200 ms to 30 s.
    ///
    /// ```no_run
    /// # fn demo(store: idem_redis::RedisStore, sink: impl idem_core::outbox::Sink) {
    /// let relay = idem_redis::outbox::RedisRelay::new(&store, sink);
    /// # }
    /// ```
    pub fn new(outbox: impl Into<RedisOutbox>, sink: S) -> RedisRelay<S> {
        RedisRelay {
            outbox: outbox.into(),
            sink,
            batch: DEFAULT_BATCH,
            poll: Duration::from_millis(100),
            policy: SendPolicy::default(),
            holder: Token::random(),
            retries: Mutex::default(),
            held: Mutex::default(),
            cursors: Mutex::default(),
        }
    }

    /// Messages a pass takes (1 to 10,000; default 256).
    ///
    /// ```no_run
    /// # fn demo(r: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.batch_size(1000);
    /// # }
    /// ```
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, 10_000);
        self
    }

    /// How long an idle relay waits before looking again (default 100 ms:
    /// one lock renewal and two reads per stream, ten times a second).
    ///
    /// ```no_run
    /// # fn demo(r: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.poll_interval(std::time::Duration::from_millis(20));
    /// # }
    /// ```
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(1));
        self
    }

    /// How long one wave of sends may wait for the broker's confirmations
    /// (default 30 s); unconfirmed messages are retried (same ids).
    ///
    /// ```no_run
    /// # fn demo(r: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.send_timeout(std::time::Duration::from_secs(5));
    /// # }
    /// ```
    pub fn send_timeout(mut self, limit: Duration) -> Self {
        self.policy.send_timeout = limit.max(Duration::from_millis(1));
        self
    }

    /// The retry delay after a failed send: `first`, doubling per attempt up
    /// to `max` (default 200 ms to 30 s). The key's later messages wait.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # fn demo(r: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.retry_backoff(Duration::from_millis(50), Duration::from_secs(5));
    /// # }
    /// ```
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.policy.first_backoff = first;
        self.policy.max_backoff = max.max(first);
        self
    }

    /// One pass over every outbox stream this relay can hold: sends up to a
    /// batch of waiting messages from each and deletes what the broker
    /// confirmed. Fails with [`Error::Unavailable`] when Redis cannot be
    /// reached and nothing was sent (nothing is lost: the entries stay);
    /// sink failures are not errors, they are counted in the report.
    ///
    /// ```no_run
    /// # async fn demo(relay: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) -> Result<(), idem_core::Error> {
    /// while relay.drain_once().await?.sent > 0 {}
    /// # Ok(()) }
    /// ```
    pub async fn drain_once(&self) -> Result<RelayReport, Error> {
        let mut report = RelayReport::default();
        let mut failed = None;
        for listed in self.outbox.streams().await? {
            match self.drain_stream(&listed).await {
                Ok(pass) => report.add(pass),
                Err(e) => {
                    tracing::debug!(stream = %listed.keys.stream, error = %e, "outbox stream pass failed");
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) if report.handled() == 0 => Err(e),
            _ => Ok(report),
        }
    }

    /// One stream's pass, under its lock, renewed while the pass runs; a
    /// pass whose lock is lost stops where it is (another relay has the
    /// stream: what this one sent and did not delete goes again, same ids).
    async fn drain_stream(&self, listed: &Listed) -> Result<RelayReport, Error> {
        let keys = &listed.keys;
        tokio::select! {
            pass = self.pass(listed) => pass,
            () = self.keep_lock(keys) => {
                tracing::warn!(stream = %keys.stream, "outbox relay lost its hold on the stream mid-pass (Redis unreachable, or this process stalled for the lock's lease); another relay goes on");
                Ok(RelayReport::default())
            }
        }
    }

    /// Takes or renews the stream's lock: `true` when this relay holds it.
    async fn lock(&self, keys: &StreamKeys) -> Result<bool, Error> {
        let ms = LOCK_LEASE.as_millis().to_string();
        let reply = self
            .outbox
            .store
            .outbox_script(
                &SCRIPTS.lock,
                &[&keys.lock],
                &[self.holder.as_bytes(), ms.as_bytes()],
            )
            .await
            .map_err(|e| outbox_error("outbox relay lock", e))?;
        let held = matches!(reply, Value::Int(1));
        if held {
            self.held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(keys.lock.clone());
        }
        Ok(held)
    }

    /// Renews the lock every third of its lease; returns once it is lost.
    async fn keep_lock(&self, keys: &StreamKeys) {
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(LOCK_LEASE / 3).await;
            match self.lock(keys).await {
                Ok(true) => since = Instant::now(),
                Ok(false) => return,
                // Unrenewed for a whole lease: another relay may hold it.
                Err(_) if since.elapsed() >= LOCK_LEASE => return,
                Err(_) => {}
            }
        }
    }

    async fn pass(&self, listed: &Listed) -> Result<RelayReport, Error> {
        let keys = &listed.keys;
        let page = self.batch.max(64);
        let lease_ms = u64::try_from(LOCK_LEASE.as_millis()).unwrap_or(u64::MAX);
        let resume = self
            .cursors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&keys.stream)
            .filter(|c| c.set_at.elapsed() < RESCAN)
            .cloned();
        let start = resume.as_ref().map_or("-", |c| c.after.as_str());
        let Some(opened) = self
            .outbox
            .open(keys, self.holder.as_bytes(), lease_ms, start, page)
            .await?
        else {
            return Ok(RelayReport::default());
        };
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(keys.lock.clone());
        let marks = opened.marks;
        let mut first = Some(opened.first);
        let retries = self
            .retries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let now = Instant::now();
        let mut blocked: HashSet<String> = resume
            .as_ref()
            .map(|c| c.blocked.clone())
            .unwrap_or_default();
        let mut selected: Vec<(String, OutboxMessage)> = Vec::new();
        let mut unreadable: Vec<(String, String)> = Vec::new();
        // Past this many entries of held-back keys a pass sends what it
        // found: a pass never walks an unbounded stream.
        let limit = (self.batch * 8).max(4096);
        let mut after = start.to_owned();
        let mut scanned = 0usize;
        let mut empty = resume.is_none();
        'read: while scanned < limit {
            let entries = match first.take() {
                Some(entries) => entries,
                None => self.outbox.read(&keys.stream, &after, page).await?,
            };
            let n = entries.len();
            let Some(last) = entries.last() else { break };
            after = last.id.clone();
            empty = false;
            for Entry { id, message } in entries {
                scanned += 1;
                let mut m = match message {
                    Ok(m) => m,
                    Err(why) => {
                        if !marks.contains_key(&id) {
                            unreadable.push((id, why));
                        }
                        continue;
                    }
                };
                if marks.contains_key(&id) || blocked.contains(&m.key) {
                    blocked.insert(m.key);
                    continue;
                }
                if let Some(r) = retries.get(&id) {
                    if r.due > now {
                        blocked.insert(m.key);
                        continue;
                    }
                    m.attempts = r.attempts;
                }
                selected.push((id, m));
                if selected.len() >= self.batch {
                    break 'read;
                }
            }
            if n < page {
                break;
            }
        }
        // Stopped by the limit, not by a full batch: the next passes start
        // here (whatever this pass fails to send is held back too).
        let stopped_early = scanned >= limit && selected.len() < self.batch;
        {
            let mut cursors = self.cursors.lock().unwrap_or_else(|p| p.into_inner());
            if stopped_early {
                let set_at = resume.as_ref().map_or_else(Instant::now, |c| c.set_at);
                let mut held_back = blocked.clone();
                held_back.extend(selected.iter().map(|(_, m)| m.key.clone()));
                cursors.insert(
                    keys.stream.clone(),
                    Cursor {
                        after: after.clone(),
                        blocked: held_back,
                        set_at,
                    },
                );
            } else if resume.is_none() {
                cursors.remove(&keys.stream);
            }
        }
        if empty && marks.is_empty() {
            self.prune(listed).await;
        }
        for (id, why) in unreadable {
            let reason = format!("unreadable outbox entry (not written by idem?): {why}");
            tracing::warn!(stream = %keys.stream, entry = %id, %reason, "outbox entry parked");
            self.park(keys, &id, 1, &reason).await?;
        }
        if selected.is_empty() {
            return Ok(RelayReport::default());
        }
        let Waves {
            sent,
            failed,
            report,
        } = send_in_waves(&self.sink, &self.policy, selected).await;
        if !sent.is_empty() {
            let mut xdel = redis::cmd("XDEL");
            xdel.arg(&keys.stream).arg(&sent);
            // Failing here after the broker confirmed: the entries stay and
            // are sent again, with the same ids.
            self.outbox.store.outbox_cmd(&xdel).await.map_err(|e| {
                let e = outbox_error("outbox relay delete", e);
                tracing::warn!(error = %e, sent = sent.len(), "the relay could not delete what the broker confirmed; those messages will be sent again (same ids)");
                e
            })?;
        }
        let mut parks = Vec::new();
        {
            let mut retries = self.retries.lock().unwrap_or_else(|p| p.into_inner());
            for id in &sent {
                retries.remove(id);
            }
            for f in failed {
                let attempts = f.message.attempts.saturating_add(1);
                if f.park {
                    retries.remove(&f.at);
                    parks.push((f.at, attempts, f.error.to_string()));
                } else {
                    retries.insert(
                        f.at,
                        Retry {
                            attempts,
                            due: Instant::now() + f.retry_in,
                        },
                    );
                }
            }
        }
        for (id, attempts, reason) in parks {
            self.park(keys, &id, attempts, &reason).await?;
        }
        Ok(report)
    }

    /// Marks an entry parked, where it stands.
    async fn park(
        &self,
        keys: &StreamKeys,
        entry: &str,
        attempts: u32,
        reason: &str,
    ) -> Result<(), Error> {
        let mark = ParkedMark {
            attempts,
            at_ms: now_ms(),
            reason: reason.to_owned(),
        }
        .render();
        self.outbox
            .store
            .outbox_script(
                &SCRIPTS.park,
                &[&keys.stream, &keys.parked],
                &[entry.as_bytes(), mark.as_bytes()],
            )
            .await
            .map_err(|e| outbox_error("outbox relay park", e))?;
        Ok(())
    }

    /// Forgets an empty cluster stream that no complete has named for a
    /// while (best effort: the next pass tries again).
    async fn prune(&self, listed: &Listed) {
        let Some(score) = &listed.score else { return };
        let named_at = score.parse::<f64>().unwrap_or(f64::MAX);
        #[allow(clippy::cast_precision_loss)]
        let cutoff =
            now_ms().saturating_sub(u64::try_from(PRUNE_AFTER.as_millis()).unwrap_or(0)) as f64;
        if named_at > cutoff {
            return;
        }
        let index = index_key(self.outbox.store.outbox_prefix());
        if let Err(e) = self
            .outbox
            .store
            .outbox_script(
                &SCRIPTS.prune,
                &[&index],
                &[listed.keys.stream.as_bytes(), score.as_bytes()],
            )
            .await
        {
            tracing::debug!(error = %e, stream = %listed.keys.stream, "could not prune the outbox index");
        }
    }

    /// When the earliest retry falls due, if any.
    fn next_retry(&self) -> Option<Duration> {
        let now = Instant::now();
        self.retries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|r| r.due.saturating_duration_since(now))
            .min()
    }

    /// Runs passes until `shutdown` completes: at once while there is work,
    /// else after the poll interval (or when a retry falls due). A pass
    /// under way when `shutdown` completes finishes first; then the relay
    /// frees its streams' locks, so a peer takes over at once. Redis or the
    /// broker being down is logged and retried, never returned.
    ///
    /// ```no_run
    /// # async fn demo(relay: idem_redis::outbox::RedisRelay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let (_stop, stopped) = tokio::sync::oneshot::channel::<()>(); // send on `_stop` at shutdown
    /// let report = relay.run(async { let _ = stopped.await; }).await;
    /// # }
    /// ```
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> RelayReport {
        let mut shutdown = pin!(shutdown);
        let mut totals = RelayReport::default();
        let mut outages = 0u32;
        tracing::info!(prefix = %self.outbox.store.outbox_prefix(), sink = %self.sink.describe(), "outbox relay started");
        loop {
            let wait = match self.drain_once().await {
                Ok(pass) => {
                    outages = 0;
                    totals.add(pass);
                    if pass.sent + pass.parked > 0 {
                        Duration::ZERO
                    } else {
                        self.next_retry().map_or(self.poll, |d| d.min(self.poll))
                    }
                }
                Err(e) => {
                    outages = outages.saturating_add(1);
                    let wait = self.policy.backoff(outages);
                    tracing::warn!(error = %e, retry_in = ?wait, "outbox relay pass failed; nothing is lost, retrying");
                    wait
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
            }
        }
        self.unlock_all().await;
        tracing::info!(
            sent = totals.sent,
            parked = totals.parked,
            failed = totals.failed,
            "outbox relay stopped"
        );
        totals
    }

    async fn unlock_all(&self) {
        let held: Vec<String> = self
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .collect();
        for lock in held {
            if let Err(e) = self
                .outbox
                .store
                .outbox_script(&SCRIPTS.unlock, &[&lock], &[self.holder.as_bytes()])
                .await
            {
                tracing::debug!(error = %e, %lock, "could not free the outbox lock; it lapses with its lease");
            }
        }
    }
}
