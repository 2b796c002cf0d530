//! The outcome hook: one event per call, after the call's store work is
//! done, for counting, alerting or auditing. A hook that panics is caught
//! and logged; it never changes what the call returns.

use crate::error::Error;
use crate::outcome::Outcome;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// What a call ended with: an [`Outcome`] when it returned a value, or the
/// kind of error it returned. Also the `outcome` label of the
/// `idem_calls_total` metric.
///
/// ```
/// use idem_core::{CallOutcome, Error, Outcome};
/// assert_eq!(CallOutcome::from(Outcome::Replayed).as_str(), "replayed");
/// assert_eq!(CallOutcome::of_error(&Error::FingerprintMismatch).as_str(), "fingerprint_mismatch");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CallOutcome {
    /// [`Outcome::Executed`].
    Executed,
    /// [`Outcome::Replayed`].
    Replayed,
    /// [`Outcome::Recovered`].
    Recovered,
    /// [`Outcome::Unprotected`].
    Unprotected,
    /// [`Outcome::LeaseLost`] (or [`Error::LeaseLost`] from a store transaction).
    LeaseLost,
    /// [`Outcome::NotStored`].
    NotStored,
    /// [`Outcome::NotConfirmed`] (the result is returned, its copies were
    /// not confirmed) or [`Error::NotConfirmed`] (a claim or replay not
    /// confirmed: the body did not run).
    NotConfirmed,
    /// [`Error::InProgress`].
    InProgress,
    /// [`Error::FingerprintMismatch`].
    FingerprintMismatch,
    /// [`Error::Unavailable`] (and [`Error::Conflict`]).
    Unavailable,
    /// [`Error::Corrupt`].
    Corrupt,
    /// [`Error::Codec`] (and [`Error::ResultVersion`]: a stored result
    /// of another version, refused by the call's rule).
    Codec,
    /// [`Error::TooLarge`].
    TooLarge,
    /// The body returned `Err` or panicked; the key was released.
    BodyError,
    /// Refused before the store: [`Error::InvalidKey`], [`Error::InvalidConfig`],
    /// [`Error::DurabilityUnsupported`].
    Invalid,
}

impl CallOutcome {
    const ALL: [CallOutcome; 15] = [
        CallOutcome::Executed,
        CallOutcome::Replayed,
        CallOutcome::Recovered,
        CallOutcome::Unprotected,
        CallOutcome::LeaseLost,
        CallOutcome::NotStored,
        CallOutcome::NotConfirmed,
        CallOutcome::InProgress,
        CallOutcome::FingerprintMismatch,
        CallOutcome::Unavailable,
        CallOutcome::Corrupt,
        CallOutcome::Codec,
        CallOutcome::TooLarge,
        CallOutcome::BodyError,
        CallOutcome::Invalid,
    ];

    /// The label value: `executed`, `replayed`, `recovered`, `unprotected`,
    /// `lease_lost`, `not_stored`, `not_confirmed`, `in_progress`, `fingerprint_mismatch`,
    /// `unavailable`, `corrupt`, `codec`, `too_large`, `body_error`, `invalid`.
    ///
    /// ```
    /// assert_eq!(idem_core::CallOutcome::BodyError.as_str(), "body_error");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            CallOutcome::Executed => "executed",
            CallOutcome::Replayed => "replayed",
            CallOutcome::Recovered => "recovered",
            CallOutcome::Unprotected => "unprotected",
            CallOutcome::LeaseLost => "lease_lost",
            CallOutcome::NotStored => "not_stored",
            CallOutcome::NotConfirmed => "not_confirmed",
            CallOutcome::InProgress => "in_progress",
            CallOutcome::FingerprintMismatch => "fingerprint_mismatch",
            CallOutcome::Unavailable => "unavailable",
            CallOutcome::Corrupt => "corrupt",
            CallOutcome::Codec => "codec",
            CallOutcome::TooLarge => "too_large",
            CallOutcome::BodyError => "body_error",
            CallOutcome::Invalid => "invalid",
        }
    }

    /// The outcome of a call that failed with `e`.
    ///
    /// ```
    /// use idem_core::{CallOutcome, Error};
    /// let e = Error::InProgress { retry_after: std::time::Duration::from_secs(1) };
    /// assert_eq!(CallOutcome::of_error(&e), CallOutcome::InProgress);
    /// ```
    pub fn of_error(e: &Error) -> CallOutcome {
        match e {
            Error::InProgress { .. } => CallOutcome::InProgress,
            Error::FingerprintMismatch => CallOutcome::FingerprintMismatch,
            Error::Corrupt { .. } => CallOutcome::Corrupt,
            Error::Codec { .. } | Error::ResultVersion { .. } => CallOutcome::Codec,
            Error::TooLarge { .. } => CallOutcome::TooLarge,
            Error::LeaseLost => CallOutcome::LeaseLost,
            Error::NotConfirmed { .. } => CallOutcome::NotConfirmed,
            Error::InvalidKey(_)
            | Error::InvalidConfig(_)
            | Error::DurabilityUnsupported { .. }
            | Error::NotInstalled => CallOutcome::Invalid,
            _ => CallOutcome::Unavailable,
        }
    }
}

impl From<Outcome> for CallOutcome {
    fn from(o: Outcome) -> CallOutcome {
        match o {
            Outcome::Executed => CallOutcome::Executed,
            Outcome::Replayed => CallOutcome::Replayed,
            Outcome::Recovered => CallOutcome::Recovered,
            Outcome::Unprotected => CallOutcome::Unprotected,
            Outcome::LeaseLost => CallOutcome::LeaseLost,
            Outcome::NotStored => CallOutcome::NotStored,
            Outcome::NotConfirmed => CallOutcome::NotConfirmed,
        }
    }
}

impl fmt::Display for CallOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One finished call, as the hook of
/// [`IdempotencyBuilder::on_outcome`](crate::IdempotencyBuilder::on_outcome) sees it.
///
/// ```
/// use idem_core::{CallOutcome, Idempotency, MemoryStore};
/// use std::sync::{Arc, Mutex};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let log = seen.clone();
/// let idem = Idempotency::builder(MemoryStore::new())
///     .on_outcome(move |e| log.lock().unwrap().push((e.scope.to_owned(), e.outcome)))
///     .build();
/// let _: u8 = idem.call("charge", "k").run(|| async { Ok::<_, idem_core::Error>(1) }).await?;
/// assert_eq!(seen.lock().unwrap()[0], ("charge".to_owned(), CallOutcome::Executed));
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OutcomeEvent<'a> {
    /// The runtime's namespace.
    pub namespace: &'a str,
    /// The call's scope.
    pub scope: &'a str,
    /// A short hash of the key (`#` and 12 hex digits), or the key in clear
    /// with `log_keys(true)`; `None` when the key itself was refused.
    pub key: Option<&'a str>,
    /// What the call ended with.
    pub outcome: CallOutcome,
    /// The attempt that ran the body (1, or more after takeovers); `None`
    /// when the body did not run under a claim.
    pub attempt: Option<u32>,
    /// From the start of `run` to its result.
    pub elapsed: Duration,
    /// How long the body ran, when it ran.
    pub body: Option<Duration>,
    /// How many steps of a `run_steps` body were answered from the record
    /// instead of running (a call that resumed after a crash or a failed
    /// step); 0 for other calls.
    pub steps_replayed: usize,
}

/// The user's hook, shared by every call of a runtime.
pub(crate) type Hook = Arc<dyn Fn(&OutcomeEvent<'_>) + Send + Sync>;

/// Calls `hook`, catching a panic so that it never reaches the caller.
pub(crate) fn fire(hook: &Hook, event: &OutcomeEvent<'_>) {
    if catch_unwind(AssertUnwindSafe(|| hook(event))).is_err() {
        tracing::error!(
            scope = event.scope,
            outcome = event.outcome.as_str(),
            "the on_outcome hook panicked; the call's result is unaffected — fix the hook"
        );
    }
}

/// What a running call has to report when it ends. Atomics rather than
/// `Cell`s: the call's future holds it across awaits and must stay `Send`;
/// relaxed stores cost what plain ones do.
#[derive(Debug, Default)]
pub(crate) struct Report {
    /// `CallOutcome` index + 1; 0 while unset.
    outcome: AtomicU8,
    /// 0 while unset.
    attempt: AtomicU32,
    /// Nanoseconds; `u64::MAX` while unset.
    body: AtomicU64,
}

impl Report {
    pub(crate) fn new() -> Report {
        Report {
            body: AtomicU64::new(u64::MAX),
            ..Report::default()
        }
    }

    pub(crate) fn outcome(&self, o: CallOutcome) {
        self.outcome.store(o as u8 + 1, Relaxed);
    }

    /// The outcome, once: a second take finds none.
    pub(crate) fn take_outcome(&self) -> Option<CallOutcome> {
        let i = self.outcome.swap(0, Relaxed);
        CallOutcome::ALL
            .get(usize::from(i).checked_sub(1)?)
            .copied()
    }

    pub(crate) fn attempt(&self, a: u32) {
        self.attempt.store(a, Relaxed);
    }

    pub(crate) fn get_attempt(&self) -> Option<u32> {
        Some(self.attempt.load(Relaxed)).filter(|a| *a != 0)
    }

    pub(crate) fn body(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX - 1);
        self.body.store(nanos, Relaxed);
    }

    pub(crate) fn get_body(&self) -> Option<Duration> {
        Some(self.body.load(Relaxed))
            .filter(|n| *n != u64::MAX)
            .map(Duration::from_nanos)
    }
}
