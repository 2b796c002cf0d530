//! What every call of one runtime shares: its store, defaults and limits.
//! `Idempotency` builds it and `Call` reads it; neither needs the other.

use crate::cache::ReplayCache;
use crate::hook::Hook;
use crate::store::{InvalidationSink, Store};
use idem_key::{MAX_LEASE, MAX_TTL, MIN_DURATION};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::time::Instant;

/// How long after the store could not register the local cache for forget
/// invalidations (a blip, a refusal) a call asks again.
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

/// Where the local cache stands with the store's forget invalidations.
pub(crate) struct Forgets {
    /// The cache's sink, made at the first registration. Held here: the
    /// store keeps it weakly.
    sink: OnceLock<InvalidationSink>,
    /// Whether the last registration was heard.
    heard: AtomicBool,
    /// When to register again, in milliseconds since `epoch` (0: at once).
    next: AtomicU64,
    epoch: Instant,
    /// One registration at a time.
    registering: tokio::sync::Mutex<()>,
}

impl Default for Forgets {
    fn default() -> Forgets {
        Forgets {
            sink: OnceLock::new(),
            heard: AtomicBool::new(false),
            next: AtomicU64::new(0),
            epoch: Instant::now(),
            registering: tokio::sync::Mutex::new(()),
        }
    }
}

impl Forgets {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn due(&self) -> bool {
        self.now_ms() >= self.next.load(Ordering::Acquire)
    }

    fn next_in(&self, wait: Duration) {
        let wait = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        self.next
            .store(self.now_ms().saturating_add(wait), Ordering::Release);
    }
}

pub(crate) struct Inner {
    pub(crate) store: Arc<dyn Store>,
    /// As the builder was given it (the prefix escapes it), for the hook
    /// and the metrics' labels.
    pub(crate) namespace: String,
    pub(crate) prefix: String,
    pub(crate) result_ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) wait: Option<Duration>,
    pub(crate) fail_mode: FailMode,
    pub(crate) max_value_size: usize,
    pub(crate) compress_above: Option<usize>,
    pub(crate) store_retries: usize,
    pub(crate) log_keys: bool,
    pub(crate) cache: Option<ReplayCache>,
    /// The cache's registration with the store's forget invalidations.
    pub(crate) invalidation: Forgets,
    pub(crate) config_error: Option<String>,
    pub(crate) hook: Option<Hook>,
    #[cfg(feature = "metrics")]
    pub(crate) metrics: crate::metrics::Handles,
}

impl Inner {
    /// Registers the local cache with the store's forget invalidations
    /// before its first claim, so a forget after it is heard whichever
    /// process issues it; asks again at most every [`HEAR_RETRY`] while the
    /// store cannot deliver them, and every [`HEAR_RENEW`] while it can.
    /// Other calls meanwhile do not wait: what they read is kept out of
    /// the cache by the emptying that follows a registration heard again.
    pub(crate) async fn hear_forgets(&self) {
        let Some(cache) = &self.cache else {
            return;
        };
        let forgets = &self.invalidation;
        if !forgets.due() {
            return;
        }
        let Ok(_one) = forgets.registering.try_lock() else {
            return;
        };
        if !forgets.due() {
            return;
        }
        // Nothing can be cached before the first registration (every read
        // that fills the cache comes after it), so only a later one empties
        // it; emptying at the first would also drop the copy this very
        // call is about to make.
        let first = forgets.sink.get().is_none();
        let sink = forgets.sink.get_or_init(|| cache.sink());
        let heard = self
            .store
            .watch_forgotten(&self.prefix, Arc::clone(sink))
            .await;
        let was_heard = forgets.heard.swap(heard, Ordering::SeqCst);
        if heard && !was_heard && !first {
            // Copies read while not heard may be of keys forgotten
            // meanwhile.
            cache.clear();
        }
        if !heard {
            tracing::debug!(prefix = %self.prefix, retry_in = ?HEAR_RETRY, "the store does not deliver forget invalidations now: cached copies of a forgotten key replay until their TTL or until it does");
        }
        forgets.next_in(if heard { HEAR_RENEW } else { HEAR_RETRY });
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
