//! `MemoryStore`: the same state machine as the Lua scripts, in process memory.

use super::watch::{Hub, Invalidation, InvalidationSink, KeyWatch, namespace_prefix};
use super::{
    Capabilities, Claim, ClaimReply, Complete, Completed, Finish, OperatorStore, RecordInfo,
    ScanPage, StepRecord, StepStore, Store, ValueKind, WatchStore, WriteReply, record_ttl,
    store_duration, store_lease,
};
use crate::durability::Durability;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::token::Token;
use async_trait::async_trait;
use bytes::Bytes;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug)]
enum State {
    Pending {
        /// The owner's 128 bits: `Token` also keeps its hex (32 bytes more
        /// per record) for stores that write text.
        token: [u8; 16],
        deadline: Instant,
        attempt: u32,
    },
    Completed {
        kind: ValueKind,
        value: Bytes,
    },
}

#[derive(Debug)]
struct Entry {
    state: State,
    /// The finished steps of a pending `run_steps` record, in order; kept
    /// across takeovers, dropped on completion.
    steps: Vec<StepRecord>,
    fingerprint: Option<Fingerprint>,
    expires_at: Instant,
}

/// A key's failure counter ([`OperatorStore::count_failure`](super::OperatorStore::count_failure)): kept apart from the
/// records, so it outlives a release and never shows in `scan` or `len`.
#[derive(Debug)]
struct Failures {
    count: u32,
    expires_at: Instant,
}

/// Keys hashed with a fast hash seeded per map (keys come from callers, so
/// not a fixed seed; SipHash was a tenth of a batched message's work), and
/// held as `Box<str>`: every byte of a slot is copied when the map grows.
type Keyed<V> = HashMap<Box<str>, V, foldhash::fast::RandomState>;

#[derive(Debug, Default)]
struct Map {
    entries: Keyed<Entry>,
    failures: Keyed<Failures>,
    writes_since_sweep: usize,
}

/// Records in this process's memory, with exactly the semantics of
/// idem-redis's `RedisStore`: leases, takeovers, owner tokens,
/// fingerprints and TTLs.
///
/// For a single process (a CLI, a worker that owns its queue, development
/// without Redis) and for tests. Time is `tokio::time::Instant`, so tests
/// can pause and advance it. Clones share the records.
///
/// Waiters ([`Call::wait`](crate::Call::wait)) are woken by the completing
/// or releasing call itself (a `tokio::sync::watch` per waited key), and
/// a `forget` drops the key from the local caches of every `Idempotency`
/// built on a clone of this store.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let v: Result<u32, idem_core::Error> = idem.call("demo", "k1").run(|| async { Ok(7) }).await;
/// assert_eq!(v.unwrap(), 7);
/// # });
/// ```
#[derive(Debug, Clone, Default)]
pub struct MemoryStore {
    map: Arc<Mutex<Map>>,
    hub: Arc<Hub>,
}

impl MemoryStore {
    /// An empty store.
    ///
    /// ```
    /// let store = idem_core::MemoryStore::new();
    /// assert_eq!(store.len(), 0);
    /// ```
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// An empty store with room for `records` records before its map
    /// grows. A map that grows moves every record into a table twice as
    /// large, under the store's lock, while every call waits: filling a
    /// store with 2 million claims, the claim that grew it past a million
    /// took 390 ms, and with the room reserved the slowest took 0.3 ms
    /// (a 2-core machine). Size it for the keys live at once (the records
    /// written within a TTL); it still grows beyond.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::with_capacity(100_000);
    /// assert!(store.is_empty());
    /// let idem = Idempotency::builder(store.clone()).build();
    /// let v: Result<u32, idem_core::Error> = idem.call("demo", "k1").run(|| async { Ok(7) }).await;
    /// assert_eq!((v.unwrap(), store.len()), (7, 1));
    /// # });
    /// ```
    pub fn with_capacity(records: usize) -> MemoryStore {
        let store = MemoryStore::default();
        store.lock().entries.reserve(records);
        store
    }

    /// Number of live (unexpired) records.
    ///
    /// ```
    /// assert!(idem_core::MemoryStore::new().is_empty());
    /// ```
    pub fn len(&self) -> usize {
        let now = Instant::now();
        self.lock()
            .entries
            .values()
            .filter(|e| e.expires_at > now)
            .count()
    }

    /// True when no live record is held.
    ///
    /// ```
    /// assert!(idem_core::MemoryStore::new().is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Wakes the waiters of `key` once a write changed it.
    fn notify_if_done(&self, key: &str, reply: WriteReply) {
        if reply.is_done() {
            self.hub.notify(key);
        }
    }

    fn lock(&self) -> MutexGuard<'_, Map> {
        // No code path panics while holding the lock; recover anyway.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Map {
    /// The live entry for `key`. An expired one is left to the next sweep
    /// or the next claim's insert: every reader skips it, and a write finds
    /// its key with one lookup.
    fn live(&mut self, key: &str, now: Instant) -> Option<&mut Entry> {
        self.entries.get_mut(key).filter(|e| e.expires_at > now)
    }

    /// Drops expired entries, amortized O(1) per write.
    fn note_write(&mut self, now: Instant) {
        self.writes_since_sweep += 1;
        if self.writes_since_sweep >= (self.entries.len() + self.failures.len()).max(1024) {
            self.entries.retain(|_, e| e.expires_at > now);
            self.failures.retain(|_, f| f.expires_at > now);
            self.writes_since_sweep = 0;
        }
    }

    /// One more failure of `key`, in a counter that expires `ttl` from now;
    /// an expired counter starts again.
    fn count_failure(&mut self, key: &str, ttl: Duration, now: Instant) -> u32 {
        let expires_at = now + ttl;
        let count = match self.failures.get_mut(key) {
            Some(f) if f.expires_at > now => {
                f.count = f.count.saturating_add(1);
                f.expires_at = expires_at;
                f.count
            }
            _ => {
                self.failures.insert(
                    key.into(),
                    Failures {
                        count: 1,
                        expires_at,
                    },
                );
                1
            }
        };
        self.note_write(now);
        count
    }

    /// `Store::claim` at `now`, under the caller's lock.
    fn claim(&mut self, c: &Claim<'_>, now: Instant) -> ClaimReply {
        let lease = store_lease(c.lease);
        let ttl = record_ttl(c.ttl, c.lease);
        let pending = |attempt| State::Pending {
            token: *c.token.as_raw(),
            deadline: now + lease,
            attempt,
        };
        let Some(entry) = self.live(c.key, now) else {
            self.entries.insert(
                c.key.into(),
                Entry {
                    state: pending(1),
                    steps: Vec::new(),
                    fingerprint: c.fingerprint.copied(),
                    expires_at: now + ttl,
                },
            );
            self.note_write(now);
            return ClaimReply::Acquired { attempt: 1 };
        };
        if mismatch(c.fingerprint, entry.fingerprint.as_ref()) {
            return ClaimReply::Mismatch;
        }
        match entry.state {
            State::Completed { kind, ref value } => ClaimReply::Completed(Completed {
                kind,
                value: value.clone(),
                fingerprint: entry.fingerprint,
                ttl_left: Some(entry.expires_at - now),
            }),
            State::Pending {
                token,
                deadline,
                attempt,
            } => {
                if token == *c.token.as_raw() {
                    // Our own claim again: its reply was lost and it was re-sent.
                    entry.state = pending(attempt);
                } else if deadline > now {
                    return ClaimReply::InProgress {
                        retry_after: deadline - now,
                    };
                } else {
                    entry.state = pending(attempt.saturating_add(1));
                    if c.fingerprint.is_some() {
                        entry.fingerprint = c.fingerprint.copied();
                    }
                }
                entry.expires_at = now + ttl;
                let attempt = match entry.state {
                    State::Pending { attempt, .. } => attempt,
                    State::Completed { .. } => 1,
                };
                ClaimReply::Acquired { attempt }
            }
        }
    }

    /// `Store::complete` at `now`, under the caller's lock.
    fn complete(
        &mut self,
        key: &str,
        token: &Token,
        kind: ValueKind,
        value: &[u8],
        now: Instant,
    ) -> WriteReply {
        let entry = match self.owned(key, token, now) {
            Ok(e) => e,
            // Already holding exactly this result: this same complete, sent
            // again after its reply was lost (as the Lua script decides).
            Err(WriteReply::AlreadyCompleted) => {
                let same = self.live(key, now).is_some_and(|e| {
                    matches!(&e.state, State::Completed { kind: k, value: v } if *k == kind && v[..] == *value)
                });
                return if same {
                    WriteReply::Done
                } else {
                    WriteReply::AlreadyCompleted
                };
            }
            Err(reply) => return reply,
        };
        entry.state = State::Completed {
            kind,
            value: crate::codec::shared_bytes(value),
        };
        entry.steps = Vec::new();
        // The expiry stays: the result TTL counts from the claim.
        self.note_write(now);
        WriteReply::Done
    }

    /// `Store::release` at `now`, under the caller's lock.
    fn release(&mut self, key: &str, token: &Token, now: Instant) -> WriteReply {
        if let Err(reply) = self.owned(key, token, now) {
            return reply;
        }
        self.entries.remove(key);
        WriteReply::Done
    }

    /// `StepStore::save_step` at `now`, under the caller's lock.
    fn save_step(
        &mut self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
        now: Instant,
    ) -> WriteReply {
        let entry = match self.owned(key, token, now) {
            Ok(e) => e,
            Err(reply) => return reply,
        };
        // Recorded already: this same write re-sent; the first one stays.
        if !entry.steps.iter().any(|s| s.name == name) {
            entry.steps.push(StepRecord {
                name: name.to_owned(),
                value: crate::codec::shared_bytes(value),
            });
        }
        self.note_write(now);
        WriteReply::Done
    }

    /// `StepStore::suspend` at `now`, under the caller's lock.
    fn suspend(&mut self, key: &str, token: &Token, now: Instant) -> WriteReply {
        let entry = match self.owned(key, token, now) {
            Ok(e) => e,
            Err(reply) => return reply,
        };
        if entry.steps.is_empty() {
            self.entries.remove(key);
        } else if let State::Pending { deadline, .. } = &mut entry.state {
            // The lease has run out: the next claim takes over and resumes.
            *deadline = now;
        }
        WriteReply::Done
    }

    /// Finds the caller's pending entry, or says why it is not there.
    fn owned(&mut self, key: &str, token: &Token, now: Instant) -> Result<&mut Entry, WriteReply> {
        match self.live(key, now) {
            None => Err(WriteReply::Missing),
            Some(Entry {
                state: State::Completed { .. },
                ..
            }) => Err(WriteReply::AlreadyCompleted),
            Some(e) => match &e.state {
                State::Pending { token: t, .. } if t == token.as_raw() => Ok(e),
                _ => Err(WriteReply::OtherOwner),
            },
        }
    }
}

impl Entry {
    /// The record as an operator sees it, at `now`.
    fn info(&self, now: Instant, with_value: bool) -> RecordInfo {
        let ttl_left = Some(self.expires_at.saturating_duration_since(now));
        match &self.state {
            State::Pending {
                deadline, attempt, ..
            } => RecordInfo::pending(
                *attempt,
                ttl_left,
                deadline.saturating_duration_since(now),
                self.fingerprint,
            )
            .with_steps(self.steps.iter().map(|s| s.name.clone()).collect()),
            State::Completed { kind, value } => {
                let mut info =
                    RecordInfo::completed(*kind, value.clone(), self.fingerprint, ttl_left, false);
                if with_value {
                    info.value = Some(value.clone());
                }
                info
            }
        }
    }
}

fn mismatch(given: Option<&Fingerprint>, stored: Option<&Fingerprint>) -> bool {
    matches!((given, stored), (Some(a), Some(b)) if a != b)
}

#[async_trait]
impl Store for MemoryStore {
    fn name(&self) -> &'static str {
        "memory"
    }

    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        let reply = self.lock().claim(&c, Instant::now());
        if matches!(
            reply,
            ClaimReply::Acquired { .. } | ClaimReply::Completed(_)
        ) {
            self.unconfirmable(c.durability)?;
        }
        Ok(reply)
    }

    async fn complete(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
        if !c.outbox.is_empty() {
            return Err(Error::Unsupported {
                op: "complete with outbox messages",
            });
        }
        let reply = self
            .lock()
            .complete(c.key, c.token, c.kind, c.value, Instant::now());
        self.notify_if_done(c.key, reply);
        if reply.is_done() {
            self.unconfirmable(c.durability)?;
        }
        Ok(reply)
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let reply = self.lock().release(key, token, Instant::now());
        self.notify_if_done(key, reply);
        Ok(reply)
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let now = Instant::now();
        let lease = store_lease(lease);
        let mut map = self.lock();
        let entry = match map.owned(key, token, now) {
            Ok(e) => e,
            Err(reply) => return Ok(reply),
        };
        if let State::Pending { deadline, .. } = &mut entry.state {
            *deadline = now + lease;
        }
        // Keep at least one more lease of record after the lease ends, so an
        // expired lease is still seen (and counted) as a takeover.
        entry.expires_at = entry.expires_at.max(now + 2 * lease);
        Ok(WriteReply::Done)
    }

    /// One lock for the whole batch, so its items are one step each of
    /// the same machine the single calls drive.
    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        let now = Instant::now();
        let mut map = self.lock();
        claims.iter().map(|c| Ok(map.claim(c, now))).collect()
    }

    /// One lock for the whole batch; waiters are woken after it is let go.
    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        let now = Instant::now();
        let replies: Vec<Result<WriteReply, Error>> = {
            let mut map = self.lock();
            ops.iter()
                .map(|op| match *op {
                    Finish::Complete(c) if !c.outbox.is_empty() => Err(Error::Unsupported {
                        op: "complete with outbox messages",
                    }),
                    Finish::Complete(c) => Ok(map.complete(c.key, c.token, c.kind, c.value, now)),
                    Finish::Release { key, token } => Ok(map.release(key, token, now)),
                })
                .collect()
        };
        ops.iter()
            .zip(replies)
            .map(|(op, reply)| {
                let reply = reply?;
                self.notify_if_done(op.key(), reply);
                if let (Finish::Complete(c), true) = (op, reply.is_done()) {
                    self.unconfirmable(c.durability)?;
                }
                Ok(reply)
            })
            .collect()
    }

    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none().steps(self).operator(self).watch(self)
    }
}

impl MemoryStore {
    /// This store keeps no copies: a write asked to be confirmed as more
    /// than [`Durability::Async`] is refused once done, as a store without
    /// the durability capability answers its confirmation.
    fn unconfirmable(&self, durability: Durability) -> Result<(), Error> {
        let this: &dyn Store = self;
        this.check_durability(durability)
    }
}

#[async_trait]
impl StepStore for MemoryStore {
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        Ok(self
            .lock()
            .save_step(key, token, name, value, Instant::now()))
    }

    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let now = Instant::now();
        Ok(self
            .lock()
            .owned(key, token, now)
            .ok()
            .map(|e| e.steps.clone()))
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let reply = self.lock().suspend(key, token, Instant::now());
        self.notify_if_done(key, reply);
        Ok(reply)
    }
}

#[async_trait]
impl OperatorStore for MemoryStore {
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        let now = Instant::now();
        Ok(self.lock().live(key, now).map(|e| e.info(now, with_value)))
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        let now = Instant::now();
        let mut map = self.lock();
        let Some(info) = map.live(key, now).map(|e| e.info(now, false)) else {
            map.failures.remove(key);
            return Ok(None);
        };
        if info.is_held() && !force {
            return Err(Error::LeaseHeld {
                lease_left: info.lease_left.unwrap_or_default(),
                attempt: info.attempt.unwrap_or(1),
            });
        }
        map.entries.remove(key);
        // An operator resetting a key resets its failures too.
        map.failures.remove(key);
        drop(map);
        self.hub.notify(key);
        self.hub
            .invalidate(namespace_prefix(key), Invalidation::Key(key));
        Ok(Some(info))
    }

    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let now = Instant::now();
        let ttl = store_duration(ttl);
        Ok(self.lock().count_failure(key, ttl, now))
    }

    /// Pages in key order; the cursor is the last key returned, so a page
    /// costs a pass over the map (this store is for one process and tests).
    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        let now = Instant::now();
        let map = self.lock();
        let mut live: Vec<(&str, &Entry)> = map
            .entries
            .iter()
            .map(|(k, e)| (&**k, e))
            .filter(|(k, e)| {
                e.expires_at > now && k.starts_with(prefix) && cursor.is_none_or(|c| *k > c)
            })
            .collect();
        live.sort_unstable_by_key(|(k, _)| *k);
        let count = count.max(1);
        let more = live.len() > count;
        live.truncate(count);
        let records: Vec<(String, Result<RecordInfo, Error>)> = live
            .into_iter()
            .map(|(k, e)| (k.to_owned(), Ok(e.info(now, false))))
            .collect();
        let cursor = if more {
            records.last().map(|(k, _)| k.clone())
        } else {
            None
        };
        Ok(ScanPage { records, cursor })
    }
}

#[async_trait]
impl WatchStore for MemoryStore {
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        Some(self.hub.join(key).0)
    }

    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        self.hub.add_feed(prefix, &sink);
        true
    }
}
