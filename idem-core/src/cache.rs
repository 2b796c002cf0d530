//! The optional in-process replay cache of completed results.

use crate::store::{Completed, Invalidation, InvalidationSink};
use quick_cache::sync::Cache;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
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
    /// Seeded per cache; no SipHash: keys crowded into one stripe on
    /// purpose would only drop more racing inserts (more misses).
    hasher: foldhash::fast::RandomState,
}

impl Generations {
    fn new() -> Generations {
        Generations {
            all: AtomicU64::new(0),
            stripes: std::array::from_fn(|_| AtomicU64::new(0)),
            hasher: foldhash::fast::RandomState::default(),
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

/// Whether the store's feed of forgotten keys reaches this cache: the
/// cache is used only while both hold.
#[derive(Default)]
struct Feed {
    /// The last registration with the store was heard.
    registered: bool,
    /// The store has not said its deliveries stopped
    /// ([`Invalidation::Paused`]).
    flowing: bool,
}

/// Completed records by stored key, bounded by entry count (S3-FIFO
/// eviction). In-flight records are never cached: only a `Completed` with a
/// known remaining TTL gets in, and an entry is never served past that TTL
/// counted from the request that read it. A key forgotten in any process
/// is dropped when the store says so ([`ReplayCache::sink`]), and a read
/// that raced the forget does not put it back ([`Generation`]). Nothing
/// enters and nothing is served while the store's feed of forgotten keys
/// is not confirmed live ([`ReplayCache::registered`], and the sink's
/// [`Invalidation::Paused`]): a forget then would go unheard. A record
/// lost otherwise (a fail-over, a restart) is not seen: its copy replays
/// until the TTL.
#[derive(Clone)]
pub(crate) struct ReplayCache {
    cache: Arc<Cache<String, Entry>>,
    generations: Arc<Generations>,
    /// `registered && flowing`, read on every hit and insert.
    live: Arc<AtomicBool>,
    feed: Arc<Mutex<Feed>>,
}

impl ReplayCache {
    pub(crate) fn new(max_entries: u64) -> ReplayCache {
        let capacity = usize::try_from(max_entries).unwrap_or(usize::MAX).max(1);
        ReplayCache {
            cache: Arc::new(Cache::new(capacity)),
            generations: Arc::new(Generations::new()),
            live: Arc::new(AtomicBool::new(false)),
            feed: Arc::new(Mutex::new(Feed {
                registered: false,
                flowing: true,
            })),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<Completed> {
        if !self.live.load(Ordering::SeqCst) {
            return None;
        }
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
            Invalidation::Paused => cache.set_feed(|f| f.flowing = false),
            Invalidation::Resumed => {
                // What was published in the gap is lost.
                cache.clear();
                cache.set_feed(|f| f.flowing = true);
            }
        })
    }

    /// Whether the last registration of [`sink`](ReplayCache::sink) with
    /// the store was heard.
    pub(crate) fn registered(&self, heard: bool) {
        self.set_feed(|f| f.registered = heard);
    }

    /// Whether copies may be served and made now.
    pub(crate) fn is_live(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }

    /// Changes what is known of the feed. Going live empties the cache and
    /// refuses every read sent before (its record may have been forgotten
    /// unheard); going deaf stops hits and inserts first, then empties.
    fn set_feed(&self, change: impl FnOnce(&mut Feed)) {
        let mut feed = self.feed.lock().unwrap_or_else(PoisonError::into_inner);
        let was = feed.registered && feed.flowing;
        change(&mut feed);
        let now = feed.registered && feed.flowing;
        if now && !was {
            self.clear();
            self.live.store(true, Ordering::SeqCst);
        } else if was && !now {
            self.live.store(false, Ordering::SeqCst);
            self.clear();
        }
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
        if !self.is_live() || self.generations.of(key) != seen {
            return;
        }
        self.cache.insert(key.to_owned(), Entry { record, expires });
        // An invalidation (or the feed going deaf) between the check and
        // the insert removed nothing (bump, then remove): look again, and
        // undo.
        if !self.is_live() || self.generations.of(key) != seen {
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

    fn live(entries: u64) -> ReplayCache {
        let cache = ReplayCache::new(entries);
        cache.registered(true);
        cache
    }

    #[tokio::test(start_paused = true)]
    async fn entries_never_outlive_their_record() {
        let cache = live(10);
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
        let cache = live(10);
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
        let cache = live(10);
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

    #[tokio::test(start_paused = true)]
    async fn nothing_enters_or_is_served_while_the_feed_is_not_live() {
        let ttl = Some(Duration::from_secs(60));
        let cache = ReplayCache::new(10);
        // Never registered: nothing enters.
        cache.insert("k", record(ttl), Instant::now(), cache.generation("k"));
        assert!(cache.get("k").is_none());
        // A read sent before the registration was heard stays out.
        let before = cache.generation("k");
        cache.registered(true);
        cache.insert("k", record(ttl), Instant::now(), before);
        assert!(cache.get("k").is_none());
        cache.insert("k", record(ttl), Instant::now(), cache.generation("k"));
        assert!(cache.get("k").is_some());
        // Deliveries paused: the copy is no longer served, and a read from
        // then does not enter; resumed, the cache starts empty.
        let paused = cache.generation("p");
        cache.sink()(Invalidation::Paused);
        assert!(cache.get("k").is_none());
        cache.insert("p", record(ttl), Instant::now(), paused);
        cache.sink()(Invalidation::Resumed);
        assert!(cache.get("k").is_none() && cache.get("p").is_none());
        cache.insert("k", record(ttl), Instant::now(), cache.generation("k"));
        assert!(cache.get("k").is_some());
        // A registration no longer heard: deaf again.
        cache.registered(false);
        assert!(cache.get("k").is_none());
    }
}
