//! [`RedisRelay`]: the relay ([`OutboxRelay`]) over a Redis outbox: at least
//! once, in order per key.
//!
//! One relay drains a stream at a time (a lock with a lease, renewed while
//! it works), so a key's messages go out in stream order; any number of
//! relays may run, the others stand by (and, on a cluster, share the
//! streams). A pass reads the stream from its start, skips the keys held
//! back by a parked or backing-off message, sends the rest in waves, and
//! deletes what the broker confirmed. A relay killed mid-pass deletes
//! nothing: the next holder sends those messages again, with the same ids.
//!
//! Redis keeps no attempts or retry times beside an entry, so
//! [`RedisSource`] keeps them (per entry, in memory): a relay that takes a
//! stream over starts a backing-off message afresh.

use super::{Entry, Listed, ParkedMark, RedisOutbox, SCRIPTS, now_ms};
use crate::store::outbox::{StreamKeys, index_key, outbox_error};
use idem_core::Error;
use idem_core::outbox::{Failed, OutboxMessage, OutboxRelay, RelayReport, RelaySource};
use idem_core::store::Token;
use redis::Value;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

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

/// Publishes a [`RedisOutbox`] through a [`Sink`](idem_core::outbox::Sink):
/// the relay over a [`RedisSource`]. It polls (default every 100 ms), and
/// `run` frees its streams' locks when it stops.
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
pub type RedisRelay<K> = OutboxRelay<RedisSource, K>;

/// A Redis outbox as a relay drains it: its streams, each under a lock
/// with a lease, and what this relay keeps between passes (the entries
/// backing off, the locks it took, where a pass may resume). Made from a
/// [`RedisStore`](crate::RedisStore) or a [`RedisOutbox`] by
/// [`RedisRelay::new`]; one a relay.
///
/// ```no_run
/// # fn demo(store: idem_redis::RedisStore) {
/// let source = idem_redis::outbox::RedisSource::from(&store);
/// # }
/// ```
pub struct RedisSource {
    outbox: RedisOutbox,
    /// This relay's name in the streams' locks.
    holder: Token,
    retries: Mutex<HashMap<String, Retry>>,
    /// The locks this relay took, freed when `run` stops.
    held: Mutex<HashSet<String>>,
    /// Per stream, where the next pass may resume past a long run of
    /// held-back entries.
    cursors: Mutex<HashMap<String, Cursor>>,
}

/// A failed message's next try.
#[derive(Debug, Clone, Copy)]
struct Retry {
    attempts: u32,
    due: Instant,
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

/// One outbox stream, as a relay's shard: the stream on a standalone
/// Redis, one per slot on a cluster.
pub struct RedisStream(Listed);

impl fmt::Display for RedisStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.keys.stream)
    }
}

/// A stream this relay holds for a pass: what the pass's first round trip
/// read under the lock, and where the pass started.
pub struct RedisHold {
    marks: HashMap<String, ParkedMark>,
    first: Option<Vec<Entry>>,
    resume: Option<Cursor>,
    start: String,
    page: usize,
}

/// From a [`RedisStore`](crate::RedisStore) (its outbox) or a [`RedisOutbox`].
impl<O: Into<RedisOutbox>> From<O> for RedisSource {
    fn from(outbox: O) -> RedisSource {
        RedisSource {
            outbox: outbox.into(),
            holder: Token::random(),
            retries: Mutex::default(),
            held: Mutex::default(),
            cursors: Mutex::default(),
        }
    }
}

impl fmt::Debug for RedisSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSource")
            .field("prefix", &self.outbox.store.outbox_prefix())
            .finish_non_exhaustive()
    }
}

impl RelaySource for RedisSource {
    type Shard = RedisStream;
    type Hold = RedisHold;
    type At = String;
    type Wake = ();

    const POLL: Duration = Duration::from_millis(100);
    const MIN_POLL: Duration = Duration::from_millis(1);

    /// The one stream standalone; the index's on a cluster.
    async fn shards(&self) -> Result<Vec<RedisStream>, Error> {
        Ok(self
            .outbox
            .streams()
            .await?
            .into_iter()
            .map(RedisStream)
            .collect())
    }

    /// Takes or renews the stream's lock and reads the parked marks and the
    /// first page, in one round trip; from where the last pass stopped if
    /// it left a cursor.
    async fn lock(&self, stream: &RedisStream, batch: usize) -> Result<Option<RedisHold>, Error> {
        let keys = &stream.0.keys;
        let page = batch.max(64);
        let lease_ms = u64::try_from(LOCK_LEASE.as_millis()).unwrap_or(u64::MAX);
        let resume = locked(&self.cursors)
            .get(&keys.stream)
            .filter(|c| c.set_at.elapsed() < RESCAN)
            .cloned();
        let start = resume.as_ref().map_or("-", |c| c.after.as_str()).to_owned();
        let Some(opened) = self
            .outbox
            .open(keys, self.holder.as_bytes(), lease_ms, &start, page)
            .await?
        else {
            return Ok(None);
        };
        locked(&self.held).insert(keys.lock.clone());
        Ok(Some(RedisHold {
            marks: opened.marks,
            first: Some(opened.first),
            resume,
            start,
            page,
        }))
    }

    /// Renews the lock every third of its lease; returns once it is lost.
    async fn keep(&self, stream: &RedisStream) {
        let keys = &stream.0.keys;
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(LOCK_LEASE / 3).await;
            match self.renew(keys).await {
                Ok(true) => since = Instant::now(),
                Ok(false) => break,
                // Unrenewed for a whole lease: another relay may hold it.
                Err(_) if since.elapsed() >= LOCK_LEASE => break,
                Err(_) => {}
            }
        }
        tracing::warn!(stream = %keys.stream, "outbox relay lost its hold on the stream mid-pass (Redis unreachable, or this process stalled for the lock's lease); another relay goes on");
    }

    /// Reads the stream from the start (or the cursor) until a batch is
    /// found, skipping the keys held back by a parked or backing-off entry;
    /// leaves a cursor when it stopped at its limit, prunes an empty
    /// cluster stream, and parks the entries it cannot read.
    async fn read(
        &self,
        stream: &RedisStream,
        hold: &mut RedisHold,
        batch: usize,
    ) -> Result<Vec<(String, OutboxMessage)>, Error> {
        let keys = &stream.0.keys;
        let RedisHold {
            marks,
            first,
            resume,
            start,
            page,
        } = hold;
        let page = *page;
        let retries = locked(&self.retries).clone();
        let now = Instant::now();
        let mut blocked: HashSet<String> = resume
            .as_ref()
            .map(|c| c.blocked.clone())
            .unwrap_or_default();
        let mut selected: Vec<(String, OutboxMessage)> = Vec::new();
        let mut unreadable: Vec<(String, String)> = Vec::new();
        // Past this many entries of held-back keys a pass sends what it
        // found: a pass never walks an unbounded stream.
        let limit = (batch * 8).max(4096);
        let mut after = start.clone();
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
                if selected.len() >= batch {
                    break 'read;
                }
            }
            if n < page {
                break;
            }
        }
        // Stopped by the limit, not by a full batch: the next passes start
        // here (whatever this pass fails to send is held back too).
        let stopped_early = scanned >= limit && selected.len() < batch;
        {
            let mut cursors = locked(&self.cursors);
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
            self.prune(&stream.0).await;
        }
        for (id, why) in unreadable {
            let reason = format!("unreadable outbox entry (not written by idem?): {why}");
            tracing::warn!(stream = %keys.stream, entry = %id, %reason, "outbox entry parked");
            self.park_entry(keys, &id, 1, &reason).await?;
        }
        Ok(selected)
    }

    /// `XDEL`s the confirmed entries, and forgets their retries.
    async fn delete(
        &self,
        stream: &RedisStream,
        _hold: &mut RedisHold,
        sent: &[String],
    ) -> Result<(), Error> {
        let mut xdel = redis::cmd("XDEL");
        xdel.arg(&stream.0.keys.stream).arg(sent);
        // Failing here after the broker confirmed: the entries stay and
        // are sent again, with the same ids.
        self.outbox.store.outbox_cmd(&xdel).await.map_err(|e| {
            let e = outbox_error("outbox relay delete", e);
            tracing::warn!(error = %e, sent = sent.len(), "the relay could not delete what the broker confirmed; those messages will be sent again (same ids)");
            e
        })?;
        let mut retries = locked(&self.retries);
        for id in sent {
            retries.remove(id);
        }
        Ok(())
    }

    /// Marks the refused entries parked where they stand; keeps the others'
    /// attempts and retry times (here: Redis keeps none beside an entry).
    async fn park(
        &self,
        stream: &RedisStream,
        _hold: &mut RedisHold,
        failed: Vec<Failed<String>>,
    ) -> Result<(), Error> {
        let mut parks = Vec::new();
        {
            let mut retries = locked(&self.retries);
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
            self.park_entry(&stream.0.keys, &id, attempts, &reason)
                .await?;
        }
        Ok(())
    }

    /// Nothing to end: each write went as it was made, and the lock stays
    /// for the next pass (it lapses with its lease, or `run` frees it).
    async fn commit(&self, _: &RedisStream, _: RedisHold, _: &RelayReport) -> Result<(), Error> {
        Ok(())
    }

    fn start(&self, sink: &str) {
        tracing::info!(prefix = %self.outbox.store.outbox_prefix(), sink = %sink, "outbox relay started");
    }

    /// Frees the streams' locks this relay took, so a peer takes over at
    /// once rather than after the lease.
    async fn stop(&self, (): ()) {
        let held: Vec<String> = locked(&self.held).drain().collect();
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

impl RedisSource {
    /// Renews the stream's lock: `true` when this relay still holds it.
    async fn renew(&self, keys: &StreamKeys) -> Result<bool, Error> {
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
            locked(&self.held).insert(keys.lock.clone());
        }
        Ok(held)
    }

    /// Marks an entry parked, where it stands.
    async fn park_entry(
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
}

/// A relay's own state, whatever a panicking holder left in it.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
