//! How many copies of a claim and a result the store must confirm before a
//! call reports it: [`Durability`].

use crate::error::Error;
use std::fmt;
use std::time::Duration;

/// The longest confirmation wait a [`Durability`] may ask for. A store
/// holds the connection (Redis: `WAIT`/`WAITAOF` block it) for that long
/// when copies are missing, so it is bounded; a minute is far past any
/// healthy replica's lag.
pub const MAX_DURABILITY_TIMEOUT: Duration = Duration::from_secs(60);

/// How durable a claim and a result must be before the call reports them.
///
/// With anything but [`Async`](Durability::Async), a claim is not reported
/// won (the body does not start), a replay is not returned, and a result
/// is not reported final, until the store has confirmed the copies asked
/// for. On Redis that is `WAIT` (replicas) or `WAITAOF` (fsynced to the
/// append-only file), pipelined with the write; a store that cannot give
/// the guarantee refuses it with [`Error::DurabilityUnsupported`] rather
/// than silently giving less.
///
/// When the confirmation does not come in time, an unconfirmed claim or
/// replay fails with [`Error::NotConfirmed`] (body not run, claim
/// released). An unconfirmed result is stored on the primary only:
/// [`Call::run_outcome`](crate::Call::run_outcome) returns it with
/// [`Outcome::NotConfirmed`](crate::Outcome::NotConfirmed), and
/// [`Call::run`](crate::Call::run) answers [`Error::NotConfirmed`] for it
/// when the builder's `require_final` is on (its default once the builder
/// has a durability other than `Async`), `Ok(v)` otherwise. Details:
/// docs/semantics.md, "Durability".
///
/// **What survives what.** A result survives a failover only with
/// `replicas` ≥ 1 ([`Replicated`](Durability::Replicated), or
/// [`Fsynced`](Durability::Fsynced) with replicas): the promoted replica
/// must be one that confirmed it. `Fsynced { local: true, replicas: 0 }`
/// covers a restart of the same server on its own append-only file, not a
/// failover.
///
/// **Timeouts.** `WAITAOF` with replicas waits for the replica's
/// acknowledgement of its fsync, which the replica sends once a second:
/// measured on Valkey 8.1, a lone caller waited 390–556 ms per call with
/// `WAITAOF 1 1`, against 1–9 ms with `WAIT 1`, so a timeout of 1 s or
/// less often ends unconfirmed. Give `Fsynced` with replicas a timeout of
/// at least 2 s. On Redis the store bounds each durable round trip (the
/// write, the fence and the wait) by its response timeout
/// (`RedisStoreConfig::response_timeout`, 1 s by default) plus this
/// timeout; past that the round trip counts as unanswered
/// ([`Error::Unavailable`]: a claim is re-sent, a result's complete
/// retried, as for any unreachable store).
///
/// ```
/// use idem_core::Durability;
/// use std::time::Duration;
/// let d = Durability::replicated(1, Duration::from_millis(500));
/// assert_eq!(d, Durability::Replicated { replicas: 1, timeout: Duration::from_millis(500) });
/// assert!(!d.is_async());
/// assert!(Durability::default().is_async());
/// assert!(Durability::replicated(0, Duration::from_secs(1)).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Durability {
    /// Reported as soon as the store's primary has it (the default): a
    /// primary that crashes before replicating or persisting may forget
    /// it.
    #[default]
    Async,
    /// Reported once at least `replicas` replicas have it in memory
    /// (Redis `WAIT`): survives a failover to one of them, not the loss of
    /// the primary and those replicas together.
    Replicated {
        /// How many replicas must confirm, at least 1.
        replicas: u32,
        /// How long to wait for them, 1 ms to [`MAX_DURABILITY_TIMEOUT`].
        timeout: Duration,
    },
    /// Reported once it is fsynced to the append-only file of the primary
    /// (`local`) and of at least `replicas` replicas (Redis `WAITAOF`,
    /// Redis 7.2+ / Valkey 7.2+, `appendonly yes`; an older server is
    /// refused with [`Error::DurabilityUnsupported`]). With replicas, a
    /// timeout of at least 2 s (see "Timeouts" above).
    Fsynced {
        /// Whether the primary's own append-only file must have it.
        local: bool,
        /// How many replicas' append-only files must have it (may be 0
        /// when `local` is true).
        replicas: u32,
        /// How long to wait, 1 ms to [`MAX_DURABILITY_TIMEOUT`]; at least
        /// 2 s when `replicas` is not 0.
        timeout: Duration,
    },
}

impl Durability {
    /// [`Durability::Replicated`]: confirmed by `replicas` replicas within `timeout`.
    ///
    /// ```
    /// let d = idem_core::Durability::replicated(1, std::time::Duration::from_secs(1));
    /// assert!(d.validate().is_ok());
    /// ```
    pub fn replicated(replicas: u32, timeout: Duration) -> Durability {
        Durability::Replicated { replicas, timeout }
    }

    /// [`Durability::Fsynced`]: fsynced on the primary (`local`) and on
    /// `replicas` replicas within `timeout`.
    ///
    /// ```
    /// // The primary's own append-only file, no replica (appendfsync always or everysec).
    /// let d = idem_core::Durability::fsynced(true, 0, std::time::Duration::from_secs(1));
    /// assert!(d.validate().is_ok());
    /// ```
    pub fn fsynced(local: bool, replicas: u32, timeout: Duration) -> Durability {
        Durability::Fsynced {
            local,
            replicas,
            timeout,
        }
    }

    /// True for [`Durability::Async`]: nothing to confirm.
    ///
    /// ```
    /// assert!(idem_core::Durability::Async.is_async());
    /// ```
    pub fn is_async(&self) -> bool {
        matches!(self, Durability::Async)
    }

    /// How long the store may wait for the confirmation (zero for `Async`).
    ///
    /// ```
    /// let d = idem_core::Durability::replicated(1, std::time::Duration::from_millis(250));
    /// assert_eq!(d.timeout().as_millis(), 250);
    /// ```
    pub fn timeout(&self) -> Duration {
        match *self {
            Durability::Async => Duration::ZERO,
            Durability::Replicated { timeout, .. } | Durability::Fsynced { timeout, .. } => timeout,
        }
    }

    /// Checks the setting itself (not whether a store can give it):
    /// [`Error::InvalidConfig`] naming what to change.
    ///
    /// ```
    /// use idem_core::Durability;
    /// use std::time::Duration;
    /// assert!(Durability::fsynced(false, 0, Duration::from_secs(1)).validate().is_err());
    /// assert!(Durability::replicated(1, Duration::ZERO).validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |what: String| Err(Error::InvalidConfig(what));
        let timeout = self.timeout();
        if !self.is_async()
            && (timeout < Duration::from_millis(1) || timeout > MAX_DURABILITY_TIMEOUT)
        {
            // Redis reads a WAIT timeout of 0 as "forever": never send one.
            return invalid(format!(
                "durability timeout is {timeout:?}; use 1 ms to {MAX_DURABILITY_TIMEOUT:?} (typically a few hundred ms)"
            ));
        }
        match *self {
            Durability::Replicated { replicas: 0, .. } => invalid(
                "Durability::Replicated with 0 replicas confirms nothing; ask for at least 1, or use Durability::Async".to_owned(),
            ),
            Durability::Fsynced {
                local: false,
                replicas: 0,
                ..
            } => invalid(
                "Durability::Fsynced with local = false and 0 replicas confirms nothing; set local = true or ask for replicas".to_owned(),
            ),
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Durability {
    /// ```
    /// let d = idem_core::Durability::fsynced(true, 1, std::time::Duration::from_secs(1));
    /// assert_eq!(d.to_string(), "fsynced on the primary and 1 replica(s) within 1s");
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Durability::Async => f.write_str("async"),
            Durability::Replicated { replicas, timeout } => {
                write!(f, "replicated to {replicas} replica(s) within {timeout:?}")
            }
            Durability::Fsynced {
                local,
                replicas,
                timeout,
            } => {
                let on = if local { "the primary and " } else { "" };
                write!(f, "fsynced on {on}{replicas} replica(s) within {timeout:?}")
            }
        }
    }
}
