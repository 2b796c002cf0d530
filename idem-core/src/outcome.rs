//! What a call did.

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
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
