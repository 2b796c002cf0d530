//! The optional in-process replay cache of completed results.

use crate::store::{Completed, Invalidation, InvalidationSink};
use quick_cache::sync::Cache;
use std::sync::Arc;
use tokio::time::Instant;

/// A cached record and the moment its record expires in the store.
#[derive(Clone)]
struct Entry {
    record: Completed,
    expires: Instant,
}

/// Completed records by stored key, bounded by entry count (S3-FIFO
/// eviction). In-flight records are never cached: only a `Completed` with a
/// known remaining TTL gets in, and an entry is never served past that TTL
/// counted from the request that read it. A key forgotten in any process
/// is dropped when the store says so ([`ReplayCache::sink`]); a record
/// lost otherwise (a fail-over, a restart) is not seen: its copy replays
/// until the TTL.
#[derive(Clone)]
pub(crate) struct ReplayCache {
    cache: std::sync::Arc<Cache<String, Entry>>,
}

impl ReplayCache {
    pub(crate) fn new(max_entries: u64) -> ReplayCache {
        let capacity = usize::try_from(max_entries).unwrap_or(usize::MAX).max(1);
        ReplayCache {
            cache: std::sync::Arc::new(Cache::new(capacity)),
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

    /// Drops the copy of `key` (after `forget`): this process stops
    /// replaying it at once; other processes hear of it from the store
    /// ([`sink`](ReplayCache::sink)).
    pub(crate) fn remove(&self, key: &str) {
        self.cache.remove(key);
    }

    /// Drops every copy (invalidations may have been lost).
    pub(crate) fn clear(&self) {
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
    /// than the record, whatever the round trip took.
    pub(crate) fn insert(&self, key: &str, record: Completed, measured_from: Instant) {
        let expires = record
            .ttl_left
            .filter(|t| !t.is_zero())
            .and_then(|t| measured_from.checked_add(t))
            .filter(|at| *at > Instant::now());
        if let Some(expires) = expires {
            self.cache.insert(key.to_owned(), Entry { record, expires });
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
        cache.insert("k", record(Some(Duration::from_secs(5))), now);
        cache.insert("no-ttl", record(None), now);
        cache.insert("huge", record(Some(Duration::MAX)), now);
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
        cache.insert("k", record(Some(Duration::from_secs(5))), sent);
        tokio::time::advance(Duration::from_millis(2_999)).await;
        assert!(cache.get("k").is_some());
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(cache.get("k").is_none(), "served past the record's expiry");
        // Already expired on arrival: never cached.
        let sent = Instant::now();
        tokio::time::advance(Duration::from_secs(6)).await;
        cache.insert("late", record(Some(Duration::from_secs(5))), sent);
        assert!(cache.get("late").is_none());
    }
}
