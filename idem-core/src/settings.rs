//! What every call of one runtime shares: its store, defaults and limits.
//! `Idempotency` builds it and `Call` reads it; neither needs the other.

use crate::cache::ReplayCache;
use crate::hook::Hook;
use crate::store::{InvalidationSink, Store};
use idem_key::{MAX_LEASE, MAX_TTL, MIN_DURATION};
use std::sync::Arc;
use std::time::Duration;

/// What to do when the store cannot be reached.
///
/// ```
/// assert_eq!(idem_core::FailMode::default(), idem_core::FailMode::Closed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FailMode {
    /// Return [`Error::Unavailable`] and do not run the body (the default):
    /// no duplicate can slip through, at the price of availability.
    #[default]
    Closed,
    /// Run the body without protection and log a warning: availability
    /// first, duplicates possible while the store is down.
    Open,
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
    /// The cache's invalidation sink, registered with the store before the
    /// first claim (`None` inside: the store cannot deliver them). Held
    /// here: the store keeps it weakly.
    pub(crate) invalidation: tokio::sync::OnceCell<Option<InvalidationSink>>,
    pub(crate) config_error: Option<String>,
    pub(crate) hook: Option<Hook>,
    #[cfg(feature = "metrics")]
    pub(crate) metrics: crate::metrics::Handles,
}

impl Inner {
    /// Registers the local cache with the store's forget invalidations,
    /// once, before anything enters the cache: a forget after this is
    /// heard, whichever process issues it.
    pub(crate) async fn hear_forgets(&self) {
        let Some(cache) = &self.cache else {
            return;
        };
        self.invalidation
            .get_or_init(|| async {
                let sink = cache.sink();
                let heard = self
                    .store
                    .watch_forgotten(&self.prefix, Arc::clone(&sink))
                    .await;
                if !heard {
                    tracing::debug!(prefix = %self.prefix, "the store does not deliver forget invalidations: cached copies of a forgotten key replay until their TTL");
                }
                heard.then_some(sink)
            })
            .await;
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
