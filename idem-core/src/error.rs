//! The one error type of idem, and the reasons a key is refused.

use std::fmt;
use std::time::Duration;

/// A driver's or decoder's error kept as the cause of an [`Error`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong around an idempotent call.
///
/// Each message says what happened and what to do about it; where a
/// driver or decoder failed, its own error is kept as the
/// [`source`](std::error::Error::source) (`redis::RedisError`,
/// `sqlx::Error`, `serde_json::Error`). Errors of the user's own body never
/// appear here: they are returned as they are.
///
/// ```
/// use idem_core::Error;
/// use std::time::Duration;
///
/// let e = Error::InProgress { retry_after: Duration::from_millis(1500) };
/// assert!(e.is_retryable());
/// assert!(e.to_string().contains("retry"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another call holds a live lease on this key and is running the body now.
    #[error(
        "another call with this idempotency key is in progress; retry after {} ms \
         (or set `.wait(..)` to wait for its result)",
        retry_after.as_millis()
    )]
    InProgress {
        /// How long the current holder's lease has left.
        retry_after: Duration,
    },

    /// The key was used before with a different payload (fingerprint).
    #[error(
        "this idempotency key was already used with a different request payload; \
         use a new key for a new operation"
    )]
    FingerprintMismatch,

    /// The key, scope or namespace cannot be used.
    #[error("invalid idempotency key: {0}")]
    InvalidKey(#[from] KeyError),

    /// The configuration (TTL, lease, namespace, limits) cannot work.
    #[error("invalid idem configuration: {0}")]
    InvalidConfig(String),

    /// The store could not be reached, timed out, or refused the command.
    /// The reason names the store (Redis, PostgreSQL) and what to check;
    /// `op` says how far the call got: with `FailMode::Closed` (the
    /// default) and `op` `connect` or `claim`, the body did not run. With
    /// `op` `complete` the body ran and its result was not stored
    /// ([`Outcome::NotStored`](crate::Outcome::NotStored)):
    /// [`Call::run`](crate::Call::run) answers this error for it, instead
    /// of `Ok(v)`, when the builder's `require_final` is on.
    ///
    /// `source` is the client's own error when there is one (a
    /// `redis::RedisError`, a `sqlx::Error`): downcast it to match on the
    /// driver's error kind. Build it with [`Error::unavailable`].
    #[error("idempotency store unavailable during {op}: {reason}; {}", unavailable_next(.op))]
    #[non_exhaustive]
    Unavailable {
        /// The store operation that failed. The stores of this workspace
        /// use these values:
        ///
        /// - a call: `connect`, `claim`, `complete` (storing the result),
        ///   `release`, `extend` (renewing the lease), `confirm` (a durable
        ///   call's fence and wait sent on their own, RedisStore);
        /// - durable steps (`run_steps`): `step` (recording one), `steps`
        ///   (reading them), `suspend`, and on PostgreSQL `save_step`;
        /// - PostgreSQL transactions (`run_in_tx`, `step_in_tx`): `begin`,
        ///   `commit`;
        /// - batches: `finish_batch` (RedisStore: the command sent after a
        ///   batch's results, `RedisStore::finish_batch_then`, a Redis
        ///   Streams consumer's acks);
        /// - operator calls: `inspect`, `forget`, `scan`, `count_failure`;
        /// - PostgreSQL upkeep: `migrate`, `maintain` (partitions), `reap`;
        /// - the outbox and its relays: `outbox publish` (PostgreSQL's
        ///   `publish`), `outbox read`, `outbox list`, `outbox backlog`,
        ///   `outbox parked`, `outbox retry`, `outbox drop`,
        ///   `outbox streams`, `outbox relay`, `outbox relay lock`,
        ///   `outbox relay park`, `outbox relay delete`,
        ///   `outbox relay commit`.
        ///
        /// A store of your own may use others.
        op: &'static str,
        /// What the store said, and what to check.
        reason: String,
        /// The driver's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// A stored record could not be read: garbage bytes, a wrong Redis type,
    /// or a format written by a newer idem. Build it with [`Error::corrupt`].
    #[error("stored idempotency record is unreadable: {reason}")]
    #[non_exhaustive]
    Corrupt {
        /// What is wrong with the record.
        reason: String,
        /// The decoder's or driver's error, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// A value could not be serialized, or a stored value does not
    /// deserialize into the type asked for. Build it with [`Error::codec`].
    #[error("idempotent result codec error: {reason}")]
    #[non_exhaustive]
    Codec {
        /// What could not be encoded or decoded, and why.
        reason: String,
        /// The `serde_json::Error`, when there is one.
        #[source]
        source: Option<BoxError>,
    },

    /// The stored result was written with another result version than the
    /// call's ([`Call::result_version`](crate::Call::result_version)), and
    /// the call's rule is [`VersionRule::Reject`](crate::VersionRule::Reject).
    /// The body was not run again and the record is kept as it is: answer
    /// from `raw_json` (the stored result, as the other version wrote it),
    /// or read it with another rule (`VersionRule::Decode`,
    /// `VersionRule::upgrade(..)`). `stored > current` is a record of a
    /// newer build (a rolling deploy or a rollback): the newer build
    /// replays it.
    #[error(
        "the stored result is result version {stored} and this call reads version {current}, \
         and its rule is Reject: the body was not run again and the record is kept; answer from \
         the stored JSON (`raw_json`), or read it with `.on_other_version(VersionRule::Decode)` or \
         `VersionRule::upgrade(..)`"
    )]
    #[non_exhaustive]
    ResultVersion {
        /// The version the record was stored with (0: stored without one).
        stored: u32,
        /// The call's own version.
        current: u32,
        /// The stored result's JSON, decompressed, without its version frame.
        raw_json: String,
    },

    /// The serialized result is larger than the configured limit.
    #[error(
        "idempotent result is {size} bytes, over the {limit}-byte limit, so it was not stored; \
         raise it with `Idempotency::builder(..).max_value_size(..)` or return something smaller"
    )]
    TooLarge {
        /// Size of the serialized value, in bytes.
        size: usize,
        /// The configured limit, in bytes.
        limit: usize,
    },

    /// The call's lease on the key was lost before its result could be
    /// stored (taken over after the lease ran out, or the record expired).
    ///
    /// - A body inside a store transaction (PostgreSQL `run_in_tx`): the
    ///   transaction was rolled back, so nothing the body wrote was
    ///   committed.
    /// - Any other body, with the builder's `require_final` on: the body
    ///   ran and its effects stand, but its result was not stored
    ///   ([`Outcome::LeaseLost`](crate::Outcome::LeaseLost));
    ///   [`Call::run`](crate::Call::run) answers this error instead of
    ///   `Ok(v)`.
    ///
    /// Either way the retry replays the new holder's result, or runs the
    /// body again.
    #[error(
        "the lease on this idempotency key ran out (or the claim was lost in a failover) before \
         the result was stored: inside a store transaction it was rolled back and nothing the \
         body wrote was committed, elsewhere the body's effects stand; retry with the same key \
         (it replays the new holder's result or runs again), and keep bodies shorter than the \
         lease or raise it with `.lease(..)`"
    )]
    LeaseLost,

    /// A store transaction conflicted with another one (PostgreSQL SQLSTATE
    /// `40001` serialization failure or `40P01` deadlock) and was rolled
    /// back: nothing was committed and the key was released.
    #[error(
        "the transaction conflicted with a concurrent one (SQLSTATE {code}: {reason}) and was \
         rolled back; nothing was committed and the key was released — retry the call with the same key"
    )]
    Conflict {
        /// The SQLSTATE, `40001` or `40P01`.
        code: String,
        /// What the database said.
        reason: String,
    },

    /// [`forget`](crate::Idempotency::forget) found the key in flight: a
    /// holder's lease is live, so deleting the record would let another
    /// call run the body beside it. Nothing was deleted.
    #[error(
        "the key is in flight (attempt {attempt}): its holder's lease has {} ms left, and \
         forgetting it now would let another call run the body beside that holder; nothing \
         was deleted — wait for the lease to run out, or force it (`.force()`, `idem forget --force`) \
         if the holder is known to be dead",
        lease_left.as_millis()
    )]
    LeaseHeld {
        /// How long the holder's lease has left.
        lease_left: Duration,
        /// The holder's attempt number (1 for the first holder).
        attempt: u32,
    },

    /// The store does not have the capability an operation needs
    /// ([`Store::capabilities`](crate::store::Store::capabilities): operator
    /// calls such as `inspect`, `forget`, `scan`, `count_failure`; durable
    /// steps' `save_step`), or does not write outbox messages with a
    /// result.
    #[error(
        "this store does not support `{op}`; upgrade the store crate, or use one that does \
         (RedisStore, MemoryStore and idem-postgres's PgStore do)"
    )]
    Unsupported {
        /// The operation: `inspect`, `forget`, `scan`, `count_failure`,
        /// `save_step`, or `complete with outbox messages`.
        op: &'static str,
    },

    /// A step name was used twice in one [`run_steps`](crate::Call::run_steps)
    /// body: a step's stored result is found by its name, so two steps of
    /// one call must be named apart. The step did not run.
    #[error(
        "step `{name}` was already run in this call; give each step of a `run_steps` body its \
         own name (add a suffix such as an index for a step run in a loop)"
    )]
    DuplicateStep {
        /// The repeated name.
        name: String,
    },

    /// A step name that cannot be stored: empty, over 128 bytes, or with
    /// control characters. The step did not run.
    #[error("invalid step name {name:?}: step names are 1 to 128 bytes without control characters")]
    InvalidStepName {
        /// The refused name.
        name: String,
    },

    /// A step was called on a [`Steps`](crate::Steps) whose
    /// [`run_steps`](crate::Call::run_steps) body has already returned (a
    /// task spawned from the body and left running, say). The step did not
    /// run.
    #[error(
        "step `{name}` was called after its `run_steps` body returned; await every step inside \
         the body"
    )]
    StepOutsideRun {
        /// The step's name.
        name: String,
    },

    /// This call no longer holds the key (its lease ran out and another
    /// call took it over, or the record expired), so a step was not
    /// recorded. When the loss was already known as the step began, its
    /// effect did not run; when it was learned only on recording, the
    /// effect ran. Either way the other call runs this step (pass
    /// [`Steps::key`](crate::Steps::key) downstream to make a repeat
    /// harmless); this body must stop, and does when it returns this error.
    #[error(
        "step `{name}` was not recorded: this call lost its lease on the key (another call took \
         it over and runs the step); stop this body, keep steps shorter than the lease or raise \
         it with `.lease(..)`"
    )]
    StepLeaseLost {
        /// The step's name.
        name: String,
    },

    /// `#[idempotent]` without `using` found no installed default.
    #[error(
        "no default Idempotency is installed; call `idem.install()` at startup \
         or pass `using = <expr>` to #[idempotent]"
    )]
    NotInstalled,

    /// `install()` was called when a default was already installed.
    #[error("a default Idempotency is already installed; install it once, at startup")]
    AlreadyInstalled,

    /// The store did not confirm the copies the call's
    /// [`Durability`](crate::Durability) asks for within its timeout
    /// (replicas behind or missing, fsync slow). `op` says which write:
    ///
    /// - `claim` or `confirm` (a claim's): the body did not run. A won
    ///   claim was released (a `run_steps` call's suspended, its steps
    ///   kept); a stored result found (a replay) was not returned, since it
    ///   may not survive a failover yet.
    /// - `complete`: the body ran and its result is stored on the primary,
    ///   unconfirmed
    ///   ([`Outcome::NotConfirmed`](crate::Outcome::NotConfirmed)).
    ///   [`Call::run`](crate::Call::run) answers this error for it when the
    ///   builder's `require_final` is on (the default with a durable
    ///   builder), instead of `Ok(v)`;
    ///   [`run_outcome`](crate::Call::run_outcome) returns the value with
    ///   its outcome.
    ///
    /// Call again with the same key: the retry replays the stored result,
    /// confirmed, while the primary lives, and runs the body again after a
    /// failover that lost it (see docs/semantics.md, "Durability").
    #[error(
        "the {op} was not confirmed durable in time: {reason}; retry with the same key (after \
         a claim the body did not run; after a complete its result is stored on the primary and \
         the retry replays it), and check the replicas (INFO replication) or raise the \
         durability timeout"
    )]
    #[non_exhaustive]
    NotConfirmed {
        /// `claim` (a fresh claim, with its fence and wait in one round
        /// trip: a won claim or a replay), `confirm` (the fence and wait
        /// sent on their own: after a takeover, a re-sent claim or a claim
        /// answered under Redis's `maxmemory`, and after a complete that
        /// stored outbox messages), or `complete` (a result stored on the
        /// primary, unconfirmed). A call turns a store's unconfirmed
        /// `complete`, or a completion's `confirm`, into
        /// [`Outcome::NotConfirmed`](crate::Outcome::NotConfirmed); with
        /// `require_final`, `Call::run` answers that outcome with this error
        /// and `op` `complete`. So a call's error has `op` `claim`,
        /// `confirm` (a claim's) or `complete`.
        op: &'static str,
        /// What the store confirmed against what was asked.
        reason: String,
    },

    /// The store cannot give the asked [`Durability`](crate::Durability):
    /// it has no replicas protocol, the server lacks `WAITAOF`, or the
    /// append-only file is off. Refused rather than silently weakened.
    #[error("the store cannot give the asked durability: {reason}")]
    DurabilityUnsupported {
        /// What is missing and how to get it.
        reason: String,
    },
}

impl Error {
    /// True for the errors after which calling again with the same key
    /// can succeed. This is the list (a worker loop retries these, with
    /// backoff, and gives up on the rest):
    ///
    /// | variant | what calling again does |
    /// | --- | --- |
    /// | [`InProgress`](Error::InProgress) | another call runs the body now: after `retry_after` (its lease left) the retry replays its result, or takes the key over if the holder died; `.wait(d)` waits for it instead |
    /// | [`Unavailable`](Error::Unavailable) | the store did not answer `op`: back off. Before the body (`connect`, `claim`) nothing ran; after it (`complete`, the result not stored) the key stays in flight until its lease ends, then the retry runs the body again (`Outcome::Recovered`) |
    /// | [`LeaseLost`](Error::LeaseLost) | the lease ran out before the result was stored: the retry replays the new holder's result, or runs the body again |
    /// | [`StepLeaseLost`](Error::StepLeaseLost) | the call lost its key, so a step was not recorded: stop the body; the retry replays, or resumes where the new holder is |
    /// | [`Conflict`](Error::Conflict) | a PostgreSQL transaction conflicted and was rolled back, key released: the retry runs again |
    /// | [`NotConfirmed`](Error::NotConfirmed) | the copies a `Durability` asks for were not confirmed in time: after a `claim` or `confirm` the body did not run and the retry claims again; after a `complete` the retry replays the stored result, confirmed, while the primary lives, and runs the body again after a failover that lost it |
    ///
    /// Every other variant fails the same way again: fix the input, the
    /// configuration, the record or the calling code.
    ///
    /// ```
    /// assert!(!idem_core::Error::FingerprintMismatch.is_retryable());
    /// ```
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::InProgress { .. }
                | Error::Unavailable { .. }
                | Error::LeaseLost
                | Error::StepLeaseLost { .. }
                | Error::Conflict { .. }
                | Error::NotConfirmed { .. }
        )
    }

    /// `op` was done on the primary but not confirmed durable in time;
    /// `reason` says what was confirmed (a store author's constructor for
    /// [`Error::NotConfirmed`], which is `#[non_exhaustive]`).
    ///
    /// ```
    /// let e = idem_core::Error::not_confirmed("complete", "0 of 1 replicas within 500ms");
    /// assert!(e.is_retryable());
    /// ```
    pub fn not_confirmed(op: &'static str, reason: impl Into<String>) -> Error {
        Error::NotConfirmed {
            op,
            reason: reason.into(),
        }
    }

    /// The store could not do `op`; `reason` says what to check. Chain
    /// the driver's error with [`with_source`](Error::with_source).
    ///
    /// ```
    /// let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    /// let e = idem_core::Error::unavailable("claim", "mystore: refused; is it up?").with_source(io);
    /// let source = std::error::Error::source(&e).unwrap();
    /// assert!(source.downcast_ref::<std::io::Error>().is_some());
    /// ```
    pub fn unavailable(op: &'static str, reason: impl Into<String>) -> Error {
        Error::Unavailable {
            op,
            reason: reason.into(),
            source: None,
        }
    }

    /// A stored record that cannot be read; `reason` says what is wrong.
    ///
    /// ```
    /// let e = idem_core::Error::corrupt("unknown value kind 'Q'");
    /// assert!(e.to_string().contains("unreadable: unknown value kind"));
    /// ```
    pub fn corrupt(reason: impl Into<String>) -> Error {
        Error::Corrupt {
            reason: reason.into(),
            source: None,
        }
    }

    /// A value that cannot be encoded or decoded; `reason` says which and why.
    ///
    /// ```
    /// let json = serde_json::from_str::<u32>("\"x\"").unwrap_err();
    /// let e = idem_core::Error::codec("stored value is not a u32").with_source(json);
    /// assert!(std::error::Error::source(&e).unwrap().is::<serde_json::Error>());
    /// ```
    pub fn codec(reason: impl Into<String>) -> Error {
        Error::Codec {
            reason: reason.into(),
            source: None,
        }
    }

    /// Keeps `source` as the cause of an [`Unavailable`](Error::Unavailable),
    /// [`Corrupt`](Error::Corrupt) or [`Codec`](Error::Codec) error, for
    /// [`std::error::Error::source`]; other errors have no cause to keep
    /// and are returned as they are.
    pub fn with_source(mut self, source: impl Into<BoxError>) -> Error {
        match &mut self {
            Error::Unavailable { source: s, .. }
            | Error::Corrupt { source: s, .. }
            | Error::Codec { source: s, .. } => *s = Some(source.into()),
            _ => {}
        }
        self
    }

    /// What the store said (`Unavailable`), or what is wrong (`Corrupt`,
    /// `Codec`): the message without idem's framing. `None` for others.
    ///
    /// ```
    /// assert_eq!(idem_core::Error::corrupt("bad tag").reason(), Some("bad tag"));
    /// ```
    pub fn reason(&self) -> Option<&str> {
        match self {
            Error::Unavailable { reason, .. }
            | Error::Corrupt { reason, .. }
            | Error::Codec { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

/// What an `Unavailable` error means for the caller: before the body
/// (a claim, a connect) nothing ran; after it (storing or releasing) the
/// body has run and the call's outcome says what became of its result.
fn unavailable_next(op: &str) -> &'static str {
    match op {
        "complete" | "release" | "extend" | "save_step" | "suspend" => {
            "the body has run; the call's outcome says whether its result was stored"
        }
        _ => "the body did not run — retry later",
    }
}

/// Which part of the stored key was refused.
///
/// ```
/// use idem_core::{Error, Idempotency, KeyError, KeyPart, MemoryStore};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let err = idem.call("charge", "").run(|| async { Ok::<u8, Error>(1) }).await.unwrap_err();
/// assert!(matches!(err, Error::InvalidKey(KeyError::Empty { part: KeyPart::Key })));
/// assert_eq!(KeyPart::Scope.to_string(), "scope");
/// # });
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyPart {
    /// The per-call idempotency key.
    Key,
    /// The operation's scope (`call(scope, ..)` or `#[idempotent(scope = ..)]`).
    Scope,
    /// The builder's namespace.
    Namespace,
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            KeyPart::Key => "key",
            KeyPart::Scope => "scope",
            KeyPart::Namespace => "namespace",
        })
    }
}

/// Why a key, scope or namespace was refused. Checked before anything
/// reaches the store, so the body never runs for a refused key.
///
/// ```
/// use idem_core::{KeyError, KeyPart};
/// let e = KeyError::TooLong { part: KeyPart::Key, len: 300, max: 255 };
/// assert!(e.to_string().contains("300"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// Nothing to key on.
    #[error("the {part} is empty; pass a non-empty value such as an order or message id")]
    Empty {
        /// Which part.
        part: KeyPart,
    },
    /// Longer than the limit, in bytes.
    #[error(
        "the {part} is {len} bytes, over the {max}-byte limit; hash long inputs (e.g. SHA-256 hex) before using them as a {part}"
    )]
    TooLong {
        /// Which part.
        part: KeyPart,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// Contains a control character (NUL, newline, escape, …).
    #[error("the {part} contains a control character at byte {at}; keys must be printable text")]
    ControlChar {
        /// Which part.
        part: KeyPart,
        /// Byte offset of the first control character.
        at: usize,
    },
}
