//! What a call did.

use crate::error::Error;
use std::fmt;

/// How a call produced its value, from [`Call::run_outcome`](crate::Call::run_outcome).
///
/// ```
/// use idem_core::Outcome;
/// assert_eq!(Outcome::Replayed.to_string(), "replayed");
/// assert!(Outcome::Recovered.ran_body());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Outcome {
    /// The body ran now, for the first time for this key.
    Executed,
    /// The body did not run: the stored result of an earlier run was returned.
    Replayed,
    /// The body ran now after taking over from a holder whose lease expired
    /// (it crashed, froze or was cut off): that holder may have done part of
    /// the work, so bodies should be safe to re-enter.
    Recovered,
    /// The store was unreachable and `FailMode::Open` ran the body without
    /// protection: a duplicate may have run too.
    Unprotected,
    /// The body ran and its value is returned, but the record was no
    /// longer its own when the result came to be stored: the result was
    /// **not stored**, and another call may have run the body too. Either
    /// its lease had run out first (the body blocked its thread, or the
    /// process froze, longer than the lease) and the record was taken over
    /// (that call reports [`Outcome::Recovered`]) or expired; or the store
    /// failed over to a replica that had not received the claim (Redis
    /// replicates asynchronously), so the new primary holds no record of
    /// it, or another call's (which reports [`Outcome::Executed`]). Bodies
    /// must not block the executor: use `spawn_blocking` for blocking work;
    /// a [`Durability`](crate::Durability) that waits for a replica narrows
    /// the failover case.
    LeaseLost,
    /// The body ran and its value is returned, but the store stayed
    /// unreachable for the whole completion retry window: the result was
    /// **not stored**, the key stays in flight until its lease runs out, and
    /// then the next call runs the body again (as [`Outcome::Recovered`]).
    NotStored,
    /// The body ran, its result is stored on the store's primary and
    /// returned, but the copies the call's
    /// [`Durability`](crate::Durability) asks for were not confirmed in
    /// time: the result **may not survive a failover** (then the next call
    /// runs the body again, as [`Outcome::Executed`]); while the primary
    /// lives, later calls replay it. Counted by the `not_confirmed` outcome
    /// label.
    NotConfirmed,
}

impl Outcome {
    /// True when the body ran in this call.
    ///
    /// ```
    /// assert!(!idem_core::Outcome::Replayed.ran_body());
    /// ```
    pub fn ran_body(self) -> bool {
        !matches!(self, Outcome::Replayed)
    }

    /// True when the body ran but its result is not in the store, so a later
    /// call with this key does not replay this value.
    ///
    /// ```
    /// assert!(idem_core::Outcome::LeaseLost.result_not_stored());
    /// assert!(!idem_core::Outcome::Executed.result_not_stored());
    /// ```
    pub fn result_not_stored(self) -> bool {
        matches!(
            self,
            Outcome::LeaseLost | Outcome::NotStored | Outcome::Unprotected
        )
    }

    /// True when the result is in the store with the copies the call's
    /// [`Durability`](crate::Durability) asks for, so later calls with this
    /// key replay it: [`Executed`](Outcome::Executed),
    /// [`Recovered`](Outcome::Recovered) and [`Replayed`](Outcome::Replayed).
    ///
    /// For any other outcome the value is returned but not final: a worker
    /// should not acknowledge its message or report success, and should call
    /// again with the same key (the retry replays the stored result, or runs
    /// the body again if none was kept). With
    /// [`IdempotencyBuilder::require_final`](crate::IdempotencyBuilder::require_final)
    /// on, [`Call::run`](crate::Call::run) and `#[idempotent]` answer such a
    /// value with an error instead of `Ok`.
    ///
    /// ```
    /// use idem_core::Outcome;
    /// assert!(Outcome::Replayed.is_final());
    /// assert!(!Outcome::NotConfirmed.is_final());
    /// ```
    pub fn is_final(self) -> bool {
        matches!(
            self,
            Outcome::Executed | Outcome::Recovered | Outcome::Replayed
        )
    }

    /// The error [`Call::run`](crate::Call::run) answers instead of a value
    /// whose outcome is not final, under `require_final`; `None` for a final
    /// outcome, and for [`Unprotected`](Outcome::Unprotected), which
    /// `FailMode::Open` asked for.
    pub(crate) fn not_final_error(self) -> Option<Error> {
        match self {
            Outcome::NotConfirmed => Some(Error::not_confirmed(
                "complete",
                "the result is stored on the primary, but its copies were not confirmed within \
                 the durability timeout",
            )),
            Outcome::NotStored => Some(Error::unavailable(
                "complete",
                "the body ran but the store stayed unreachable, so its result was not stored; \
                 the key stays in flight until its lease ends",
            )),
            Outcome::LeaseLost => Some(Error::LeaseLost),
            Outcome::Executed | Outcome::Recovered | Outcome::Replayed | Outcome::Unprotected => {
                None
            }
        }
    }

    /// A short lowercase name, as recorded in tracing spans.
    ///
    /// ```
    /// assert_eq!(idem_core::Outcome::Executed.as_str(), "executed");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Executed => "executed",
            Outcome::Replayed => "replayed",
            Outcome::Recovered => "recovered",
            Outcome::Unprotected => "unprotected",
            Outcome::LeaseLost => "lease_lost",
            Outcome::NotStored => "not_stored",
            Outcome::NotConfirmed => "not_confirmed",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
