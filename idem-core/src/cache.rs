//! The optional in-process replay cache of completed results.

use crate::store::Completed;
use moka::Expiry;
use moka::sync::Cache;
use std::time::{Duration, Instant};

/// Expires each entry when its record would: a cached result never
/// outlives the record it copies.
struct RecordTtl;

impl Expiry<String, Completed> for RecordTtl {
    fn expire_after_create(
        &self,
        _key: &String,
        value: &Completed,
        _now: Instant,
    ) -> Option<Duration> {
        value.ttl_left
    }
}

/// Completed records by stored key. In-flight records are never cached:
/// only a `Completed` with a known remaining TTL gets in.
#[derive(Clone)]
pub(crate) struct ReplayCache {
    cache: Cache<String, Completed>,
}

impl ReplayCache {
    pub(crate) fn new(max_entries: u64) -> ReplayCache {
        ReplayCache {
            cache: Cache::builder()
                .max_capacity(max_entries)
                .expire_after(RecordTtl)
                .build(),
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<Completed> {
        self.cache.get(key)
    }

    pub(crate) fn insert(&self, key: &str, record: Completed) {
        if record.ttl_left.is_some_and(|t| !t.is_zero()) {
            self.cache.insert(key.to_owned(), record);
        }
    }
}
