//! What every call of one runtime shares: its store, defaults and limits.
//! `Idempotency` builds it and `Call` reads it; neither needs the other.

use crate::cache::ReplayCache;
use crate::hook::Hook;
use crate::store::{InvalidationSink, Store};
pub use idem_key::{MAX_LEASE, MAX_TTL, MIN_DURATION};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How long after the store could not register the local cache for forget
/// invalidations (a blip, a refusal) the registration is tried again.
const HEAR_RETRY: Duration = Duration::from_secs(2);
/// How often a registration that was heard is asked again: it restarts a
/// subscriber that stopped (its runtime shut down), and costs one message
/// to the subscriber task when nothing changed.
const HEAR_RENEW: Duration = Duration::from_secs(5);

/// What to do when the store cannot be reached.
///
/// ```
/// assert_eq!(idem_core::FailMode::default(), idem_core::FailMode::Closed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Return [`Error::Unavailable`](crate::Error::Unavailable) and do not run the body (the default):
    /// no duplicate can slip through, at the price of availability.
    #[default]
    Closed,
    /// Run the body without protection and log a warning: availability
    /// first, duplicates possible while the store is down.
    Open,
}

/// The local cache's registration with the store's forget invalidations,
/// kept up by a task of its own: asked again every [`HEAR_RETRY`] while the
/// store cannot deliver them and every [`HEAR_RENEW`] while it can, whether
/// or not calls come (a cache hit makes no store call at all).
pub(crate) struct Forgets(Arc<Feed>);

struct Feed {
    store: Arc<dyn Store>,
    prefix: String,
    cache: ReplayCache,
    /// The cache's sink. Held here: the store keeps it weakly.
    sink: InvalidationSink,
    /// Whether the last registration was heard.
    heard: AtomicBool,
    /// Whether a task keeps the registration up; false again when its
    /// runtime shuts down, so the next call starts one on its own.
    kept: AtomicBool,
    /// One start at a time.
    starting: tokio::sync::Mutex<()>,
}

impl Forgets {
    pub(crate) fn new(store: Arc<dyn Store>, prefix: String, cache: &ReplayCache) -> Forgets {
        Forgets(Arc::new(Feed {
            store,
            prefix,
            sink: cache.sink(),
            cache: cache.clone(),
            heard: AtomicBool::new(false),
            kept: AtomicBool::new(false),
            starting: tokio::sync::Mutex::new(()),
        }))
    }
}

impl Feed {
    /// Registers once and tells the cache whether it is heard.
    async fn register(&self) {
        let heard = self
            .store
            .watch_forgotten(&self.prefix, Arc::clone(&self.sink))
            .await;
        let was_heard = self.heard.swap(heard, Ordering::SeqCst);
        if heard != was_heard {
            self.cache.registered(heard);
        }
        if !heard && (was_heard || !self.kept.load(Ordering::Acquire)) {
            tracing::warn!(prefix = %self.prefix, retry_in = ?HEAR_RETRY, "the store does not deliver forget invalidations now (a store that cannot, such as PostgreSQL or a RedisStore made from a manager, never does): the local cache serves nothing until it does");
        }
    }
}

/// Marks the registration unkept when its task ends (its runtime shut
/// down).
struct Unkept(Weak<Feed>);

impl Drop for Unkept {
    fn drop(&mut self) {
        if let Some(feed) = self.0.upgrade() {
            feed.kept.store(false, Ordering::Release);
        }
    }
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn Store>,
    /// The store as the builder was given it (`store` may wrap it).
    pub(crate) given: Arc<dyn std::any::Any + Send + Sync>,
    /// As the builder was given it (the prefix escapes it), for the hook
    /// and the metrics' labels.
    pub(crate) namespace: String,
    pub(crate) prefix: String,
    pub(crate) result_ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) fail_mode: FailMode,
    /// Each call's unless it sets its own.
    pub(crate) durability: crate::durability::Durability,
    /// Whether the value-only forms answer a value that is not final with
    /// an error (`IdempotencyBuilder::require_final`).
    pub(crate) require_final: bool,
    pub(crate) max_value_size: usize,
    pub(crate) compress_above: Option<usize>,
    pub(crate) store_retries: usize,
    pub(crate) log_keys: bool,
    /// Whether spans record the key (hashed unless `log_keys`).
    pub(crate) keys_in_spans: bool,
    pub(crate) cache: Option<ReplayCache>,
    /// The cache's registration with the store's forget invalidations;
    /// `None` without a cache.
    pub(crate) invalidation: Option<Forgets>,
    pub(crate) config_error: Option<String>,
    pub(crate) hook: Option<Hook>,
    #[cfg(feature = "metrics")]
    pub(crate) metrics: crate::metrics::Handles,
}

impl Inner {
    /// Makes sure the local cache's registration with the store's forget
    /// invalidations is kept up: one atomic load once it is. The call that
    /// starts it registers first, so that its own read may enter the
    /// cache; other calls meanwhile do not wait (what they read stays out
    /// of the cache: the cache goes live only for reads sent after).
    pub(crate) async fn hear_forgets(&self) {
        let Some(Forgets(feed)) = &self.invalidation else {
            return;
        };
        if feed.kept.load(Ordering::Acquire) {
            return;
        }
        let Ok(_one) = feed.starting.try_lock() else {
            return;
        };
        if feed.kept.load(Ordering::Acquire) {
            return;
        }
        feed.register().await;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        feed.kept.store(true, Ordering::Release);
        let weak = Arc::downgrade(feed);
        // Made here, not in the task: a task dropped before its first poll
        // (its runtime shut down at once) drops it all the same.
        let unkept = Unkept(weak.clone());
        runtime.spawn(async move {
            let _unkept = unkept;
            loop {
                let wait = match weak.upgrade() {
                    Some(feed) if feed.heard.load(Ordering::Acquire) => HEAR_RENEW,
                    Some(_) => HEAR_RETRY,
                    // The runtime (every `Idempotency` clone) is gone.
                    None => return,
                };
                tokio::time::sleep(wait).await;
                let Some(feed) = weak.upgrade() else {
                    return;
                };
                feed.register().await;
            }
        });
    }

    /// Whether calls are reported (hook or metrics): only then are clocks
    /// read for them.
    pub(crate) fn observing(&self) -> bool {
        self.hook.is_some() || cfg!(feature = "metrics")
    }
}

/// Checks a TTL and lease pair; the message names the setting to fix.
pub(crate) fn validate_ttl_lease(ttl: Duration, lease: Duration) -> Result<(), String> {
    if ttl < MIN_DURATION {
        return Err(format!(
            "result TTL is {ttl:?}; use at least 1 ms (typically hours)"
        ));
    }
    if ttl > MAX_TTL {
        return Err(format!("result TTL is {ttl:?}, over the one-year limit"));
    }
    if lease < MIN_DURATION {
        return Err(format!(
            "lease is {lease:?}; use at least 1 ms (typically the body's worst-case duration)"
        ));
    }
    if lease > MAX_LEASE {
        return Err(format!("lease is {lease:?}, over the one-day limit"));
    }
    if lease > ttl {
        return Err(format!(
            "lease ({lease:?}) is longer than the result TTL ({ttl:?}); the TTL must cover the lease"
        ));
    }
    Ok(())
}
