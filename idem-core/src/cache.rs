//! The optional in-process replay cache of completed results.

use crate::store::{Completed, Invalidation, InvalidationSink};
use quick_cache::sync::Cache;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::time::Instant;

/// How many invalidation counters keys are spread over: a forget drops the
/// racing inserts of its stripe's keys only, never its neighbours' copies.
const STRIPES: usize = 64;

/// A cached record and the moment its record expires in the store.
#[derive(Clone)]
struct Entry {
    record: Completed,
    expires: Instant,
}

/// The invalidations a key's copy could have missed: read before the
/// store read, compared at insert ([`ReplayCache::insert`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Generation {
    all: u64,
    stripe: u64,
}

/// Counts invalidations: one counter per stripe of keys, and one bumped by
/// [`Invalidation::All`].
struct Generations {
    all: AtomicU64,
    stripes: [AtomicU64; STRIPES],
    hasher: RandomState,
}

impl Generations {
    fn new() -> Generations {
        Generations {
            all: AtomicU64::new(0),
            stripes: std::array::from_fn(|_| AtomicU64::new(0)),
            hasher: RandomState::new(),
        }
    }

    fn stripe(&self, key: &str) -> &AtomicU64 {
        let at = usize::try_from(self.hasher.hash_one(key) % STRIPES as u64).unwrap_or(0);
        &self.stripes[at]
    }

    // SeqCst throughout: an insert that reads its generation unchanged
    // after inserting is ordered before the bump, hence before the removal
    // that follows the bump (see `insert`).
    fn of(&self, key: &str) -> Generation {
        Generation {
            all: self.all.load(Ordering::SeqCst),
            stripe: self.stripe(key).load(Ordering::SeqCst),
        }
    }

    fn bump(&self, key: &str) {
        self.stripe(key).fetch_add(1, Ordering::SeqCst);
    }

    fn bump_all(&self) {
        self.all.fetch_add(1, Ordering::SeqCst);
    }
}

/// Completed records by stored key, bounded by entry count (S3-FIFO
/// eviction). In-flight records are never cached: only a `Completed` with a
/// known remaining TTL gets in, and an entry is never served past that TTL
/// counted from the request that read it. A key forgotten in any process
/// is dropped when the store says so ([`ReplayCache::sink`]), and a read
/// that raced the forget does not put it back ([`Generation`]); a record
/// lost otherwise (a fail-over, a restart) is not seen: its copy replays
/// until the TTL.
#[derive(Clone)]
pub(crate) struct ReplayCache {
    cache: Arc<Cache<String, Entry>>,
    generations: Arc<Generations>,
}

impl ReplayCache {
    pub(crate) fn new(max_entries: u64) -> ReplayCache {
        let capacity = usize::try_from(max_entries).unwrap_or(usize::MAX).max(1);
        ReplayCache {
            cache: Arc::new(Cache::new(capacity)),
            generations: Arc::new(Generations::new()),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<Completed> {
        let entry = self.cache.get(key)?;
        if entry.expires <= Instant::now() {
            self.cache.remove(key);
            return None;
        }
        Some(entry.record)
    }

    /// What `key`'s copy would miss: take it before reading the record
    /// that may be inserted.
    pub(crate) fn generation(&self, key: &str) -> Generation {
        self.generations.of(key)
    }

    /// Drops the copy of `key` (after `forget`): this process stops
    /// replaying it at once; other processes hear of it from the store
    /// ([`sink`](ReplayCache::sink)). A read of `key` in flight does not
    /// put it back.
    pub(crate) fn remove(&self, key: &str) {
        self.generations.bump(key);
        self.cache.remove(key);
    }

    /// Drops every copy (invalidations may have been lost), and every
    /// insert of a read in flight.
    pub(crate) fn clear(&self) {
        self.generations.bump_all();
        self.cache.clear();
    }

    /// What a store calls when a key is forgotten anywhere: drop it here.
    pub(crate) fn sink(&self) -> InvalidationSink {
        let cache = self.clone();
        Arc::new(move |what: Invalidation<'_>| match what {
            Invalidation::Key(key) => cache.remove(key),
            Invalidation::All => cache.clear(),
        })
    }

    /// Caches `record`, whose `ttl_left` the store measured no earlier than
    /// `measured_from` (when the request that read it was sent): counting
    /// from then, not from the reply's arrival, the copy expires no later
    /// than the record, whatever the round trip took. Nothing is cached
    /// when `key` was invalidated since `seen` (taken before the read): the
    /// record read may be the one that was forgotten.
    pub(crate) fn insert(
        &self,
        key: &str,
        record: Completed,
        measured_from: Instant,
        seen: Generation,
    ) {
        let expires = record
            .ttl_left
            .filter(|t| !t.is_zero())
            .and_then(|t| measured_from.checked_add(t))
            .filter(|at| *at > Instant::now());
        let Some(expires) = expires else {
            return;
        };
        if self.generations.of(key) != seen {
            return;
        }
        self.cache.insert(key.to_owned(), Entry { record, expires });
        // An invalidation between the check and the insert removed nothing
        // (bump, then remove): look again, and undo.
        if self.generations.of(key) != seen {
            self.cache.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ValueKind;
    use std::time::Duration;

    fn record(ttl_left: Option<Duration>) -> Completed {
        Completed {
            kind: ValueKind::Json,
            value: bytes::Bytes::from_static(b"1"),
            fingerprint: None,
            ttl_left,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn entries_never_outlive_their_record() {
        let cache = ReplayCache::new(10);
        let now = Instant::now();
        cache.insert(
            "k",
            record(Some(Duration::from_secs(5))),
            now,
            cache.generation("k"),
        );
        cache.insert("no-ttl", record(None), now, cache.generation("no-ttl"));
        cache.insert(
            "huge",
            record(Some(Duration::MAX)),
            now,
            cache.generation("huge"),
        );
        assert!(cache.get("k").is_some());
        assert!(cache.get("no-ttl").is_none());
        assert!(cache.get("huge").is_none());
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(cache.get("k").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn expiry_counts_from_the_request_not_the_reply() {
        let cache = ReplayCache::new(10);
        let sent = Instant::now();
        // The reply took 2 s to arrive; the store measured 5 s left when it
        // answered, so the record is gone 5 s after the send at the latest.
        tokio::time::advance(Duration::from_secs(2)).await;
        cache.insert(
            "k",
            record(Some(Duration::from_secs(5))),
            sent,
            cache.generation("k"),
        );
        tokio::time::advance(Duration::from_millis(2_999)).await;
        assert!(cache.get("k").is_some());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.get("k").is_none(), "served past the record's expiry");
        // Already expired on arrival: never cached.
        let sent = Instant::now();
        tokio::time::advance(Duration::from_secs(6)).await;
        cache.insert(
            "late",
            record(Some(Duration::from_secs(5))),
            sent,
            cache.generation("late"),
        );
        assert!(cache.get("late").is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_read_that_raced_an_invalidation_is_not_cached() {
        let cache = ReplayCache::new(10);
        let ttl = Some(Duration::from_secs(60));
        // Read, then forgotten (here or elsewhere), then the read's insert.
        let seen = cache.generation("k");
        cache.sink()(Invalidation::Key("k"));
        cache.insert("k", record(ttl), Instant::now(), seen);
        assert!(cache.get("k").is_none(), "the forgotten record was cached");
        // Everything dropped (a reconnection): every read in flight too.
        let seen = cache.generation("other");
        cache.sink()(Invalidation::All);
        cache.insert("other", record(ttl), Instant::now(), seen);
        assert!(cache.get("other").is_none());
        // A read after the invalidation is cached.
        let seen = cache.generation("k");
        cache.insert("k", record(ttl), Instant::now(), seen);
        assert!(cache.get("k").is_some());
    }
}
