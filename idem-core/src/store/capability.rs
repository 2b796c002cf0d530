//! What a store can do besides the state machine: durable steps, operator
//! calls, notifications, durability confirmation and an outbox. Each is a
//! trait of its own, implemented by the stores that can, and named in
//! [`Store::capabilities`]; a store that cannot leaves it out, and the
//! runtime falls back (the `impl dyn Store` methods here say how).

use super::{InvalidationSink, KeyWatch, RecordInfo, ScanPage, StepRecord, Store, WriteReply};
use crate::durability::Durability;
use crate::error::Error;
use crate::token::Token;
use async_trait::async_trait;
use std::fmt;
use std::time::Duration;

/// Durable steps: what [`Call::run_steps`](crate::Call::run_steps) needs
/// of a store. Without it, `run_steps` fails at its first step, before
/// anything is recorded.
///
/// ```
/// use idem_core::store::{Claim, MemoryStore, StepStore, Store, Token, WriteReply};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let token = Token::random();
/// store.claim(Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60))).await?;
/// assert_eq!(store.save_step("k", &token, "reserve", b"7").await?, WriteReply::Done);
/// let steps = store.steps("k", &token).await?.unwrap_or_default();
/// assert_eq!((steps[0].name.as_str(), &steps[0].value[..]), ("reserve", &b"7"[..]));
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait StepStore: Send + Sync {
    /// Records one finished step in the caller's pending record: `value`
    /// (serde_json bytes) under `name`, by the owner only (the owner-token
    /// check of [`Store::complete`]). The record keeps its expiry. A step
    /// already recorded under `name` is left as it is and answers
    /// [`WriteReply::Done`]: it is this same write re-sent after its reply
    /// was lost. A completed record replaces the steps (completion drops
    /// them); [`Store::release`] deletes them with the record.
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error>;

    /// The steps recorded in the caller's pending record, in the order they
    /// were recorded; `None` when the caller does not hold the pending
    /// record (another owner, completed, or no record). Read by a call that
    /// took the key over (attempt > 1), before its body runs.
    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error>;

    /// Ends the caller's lease at once but keeps the recorded steps, so the
    /// next call takes the key over (attempt + 1, `Outcome::Recovered`) and
    /// resumes after them: what a failed `run_steps` body does. A record
    /// without steps is deleted, exactly as [`Store::release`] does. Wakes
    /// waiters as `release` does.
    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error>;
}

/// Operator calls: `Idempotency::inspect`, `forget`, `scan` and
/// `count_failure` (the CLI's and a consumer's failure counts). Without it,
/// each answers [`Error::Unsupported`].
///
/// ```
/// use idem_core::store::{MemoryStore, OperatorStore};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// assert_eq!(store.count_failure("ns:charge:42", Duration::from_secs(60)).await?, 1);
/// assert_eq!(store.count_failure("ns:charge:42", Duration::from_secs(60)).await?, 2);
/// assert!(store.inspect("ns:charge:42", false).await?.is_none());
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait OperatorStore: Send + Sync {
    /// Reads the record of `key` for an operator, writing nothing; `None`
    /// when there is none. The value is included only when `with_value`.
    /// A record that cannot be read is [`Error::Corrupt`].
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error>;

    /// Deletes the record of `key` in one atomic step and returns what it
    /// was (without its value); `None` when there was none. A pending
    /// record whose lease is live is refused with [`Error::LeaseHeld`]
    /// unless `force`; an unreadable one is refused with
    /// [`Error::Corrupt`] (it may be another program's key). Resets the
    /// key's failure count.
    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error>;

    /// One page of the records whose stored key starts with `prefix`,
    /// about `count` keys, from `cursor` (`None` for the first page). Never
    /// blocks the store for long (Redis: `SCAN`, never `KEYS`).
    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error>;

    /// Adds one to the count of failed runs kept beside the record of
    /// `key` (a counter of its own, stored under
    /// [`failure_key`](super::failure_key), which survives the record's
    /// release), sets the counter to expire `ttl` from now, and returns the
    /// count after the addition. Atomic: N concurrent calls return 1..=N,
    /// each once. An expired counter starts again at 1.
    /// [`forget`](OperatorStore::forget) resets it;
    /// [`scan`](OperatorStore::scan) never lists it.
    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error>;
}

/// Notifications: waiters wake when a key changes instead of polling, and a
/// local replay cache hears of keys forgotten anywhere. Without it, waiters
/// poll and the local cache replays until its entries' TTL.
#[async_trait]
pub trait WatchStore: Send + Sync {
    /// Subscribes to changes of `key` (its completion, release or
    /// forgetting), for a caller about to wait on a pending record. Returns
    /// once the subscription is active, so a change after this returns is
    /// seen by [`KeyWatch::changed`]: read the record again after it.
    /// `None` when the store cannot notify now (the caller polls).
    async fn watch(&self, key: &str) -> Option<KeyWatch>;

    /// Registers `sink` to hear of keys under `prefix` (a namespace, with
    /// its `:`) that are forgotten anywhere, for a local replay cache. True
    /// when the store delivers them; false when it cannot (copies then
    /// replay until their TTL, as documented on `local_cache`). The sink
    /// is told [`Invalidation::All`](super::Invalidation::All) when
    /// messages may have been lost. The store keeps it weakly: it is heard
    /// while the caller holds it.
    ///
    /// Called again with the same sink every few seconds while it answers
    /// true (so a subscriber that stopped is started again), and every few
    /// seconds while it answers false: register a sink once, however often
    /// it is passed, and make a call that finds everything in place cheap.
    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool;
}

/// Durability confirmation: a store that can wait for copies of a write.
/// A store that names it honours [`Claim::durability`](super::Claim::durability)
/// and [`Complete::durability`](super::Complete::durability) for every
/// durability its [`check_durability`](DurableStore::check_durability)
/// accepts; a store without it is sent only [`Durability::Async`].
#[async_trait]
pub trait DurableStore: Send + Sync {
    /// Whether this store can give `durability`: `Ok` for
    /// [`Durability::Async`], else [`Error::DurabilityUnsupported`] saying
    /// what is missing. Checked (without a round trip: a store learns what
    /// its server can do when it connects) by
    /// [`IdempotencyBuilder::try_build`](crate::IdempotencyBuilder::try_build)
    /// and before every call that asks for durability.
    fn check_durability(&self, durability: Durability) -> Result<(), Error>;

    /// Waits until every write the store has applied to `key`'s primary so
    /// far is as durable as `durability` asks: a fence that proves the copy
    /// of a record this caller only **read** (a replay, a takeover), since
    /// a replication stream is ordered. `Err(`[`Error::NotConfirmed`]`)`
    /// when the copies did not confirm within the timeout. Called only
    /// with a durability `check_durability` accepted.
    async fn confirm(&self, key: &str, durability: Durability) -> Result<(), Error>;
}

/// What a store can do besides the state machine, as [`Store::capabilities`]
/// answers it: each capability it has, as the trait object that does it.
/// [`Capabilities::none`], then a setter per capability.
///
/// ```
/// use idem_core::store::{Capabilities, MemoryStore, Store};
/// let store = MemoryStore::new();
/// let caps = Capabilities::none().steps(&store);
/// assert!(caps.steps.is_some() && caps.operator.is_none() && !caps.outbox);
/// ```
#[derive(Clone, Copy, Default)]
#[non_exhaustive]
pub struct Capabilities<'a> {
    /// Durable steps (`run_steps`).
    pub steps: Option<&'a dyn StepStore>,
    /// Operator calls (`inspect`, `forget`, `scan`, `count_failure`).
    pub operator: Option<&'a dyn OperatorStore>,
    /// Notifications (`watch`, `watch_forgotten`).
    pub watch: Option<&'a dyn WatchStore>,
    /// Durability confirmation.
    pub durable: Option<&'a dyn DurableStore>,
    /// Whether [`Store::complete`] writes [`Complete::outbox`](super::Complete::outbox)
    /// messages with the result. Read before a body runs, so that
    /// [`outbox::stage`](crate::outbox::stage) fails at once (and the body
    /// with it) on a store that could not store what it stages.
    pub outbox: bool,
    /// The largest stored value the store can keep, in bytes, when it has
    /// a limit of its own (DynamoDB: an item is at most 400 KB). The
    /// runtime stores at most the smaller of this and the builder's
    /// `max_value_size`: a larger result is returned to the call that
    /// produced it and later calls get [`Error::TooLarge`], exactly as
    /// over `max_value_size`, instead of a write the store would refuse.
    /// `None`: no limit of the store's own.
    pub max_value_size: Option<usize>,
}

impl<'a> Capabilities<'a> {
    /// No capability at all.
    pub fn none() -> Capabilities<'a> {
        Capabilities::default()
    }

    /// Sets [`steps`](Capabilities::steps).
    pub fn steps(mut self, steps: &'a dyn StepStore) -> Capabilities<'a> {
        self.steps = Some(steps);
        self
    }

    /// Sets [`operator`](Capabilities::operator).
    pub fn operator(mut self, operator: &'a dyn OperatorStore) -> Capabilities<'a> {
        self.operator = Some(operator);
        self
    }

    /// Sets [`watch`](Capabilities::watch).
    pub fn watch(mut self, watch: &'a dyn WatchStore) -> Capabilities<'a> {
        self.watch = Some(watch);
        self
    }

    /// Sets [`durable`](Capabilities::durable).
    pub fn durable(mut self, durable: &'a dyn DurableStore) -> Capabilities<'a> {
        self.durable = Some(durable);
        self
    }

    /// Sets [`outbox`](Capabilities::outbox).
    pub fn outbox(mut self, outbox: bool) -> Capabilities<'a> {
        self.outbox = outbox;
        self
    }

    /// Sets [`max_value_size`](Capabilities::max_value_size).
    ///
    /// ```
    /// let caps = idem_core::store::Capabilities::none().max_value_size(400 * 1024);
    /// assert_eq!(caps.max_value_size, Some(400 * 1024));
    /// ```
    pub fn max_value_size(mut self, bytes: usize) -> Capabilities<'a> {
        self.max_value_size = Some(bytes);
        self
    }
}

impl fmt::Debug for Capabilities<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Capabilities")
            .field("steps", &self.steps.is_some())
            .field("operator", &self.operator.is_some())
            .field("watch", &self.watch.is_some())
            .field("durable", &self.durable.is_some())
            .field("outbox", &self.outbox)
            .field("max_value_size", &self.max_value_size)
            .finish()
    }
}

/// The capabilities as the runtime uses them: each through the store's
/// capability when it has it, else the fallback written here (for a store
/// in an `Arc<dyn Store>`; a concrete store calls its capability traits).
impl dyn Store + '_ {
    /// [`StepStore::save_step`]; without steps, [`Error::Unsupported`].
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store, Token};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemoryStore::new());
    /// let token = Token::random();
    /// assert!(store.save_step("k", &token, "one", b"1").await.is_ok());
    /// # });
    /// ```
    pub async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        match self.capabilities().steps {
            Some(s) => s.save_step(key, token, name, value).await,
            None => Err(Error::Unsupported { op: "save_step" }),
        }
    }

    /// [`StepStore::steps`]; without steps, none: a store that cannot
    /// record steps has none to give back.
    pub async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        match self.capabilities().steps {
            Some(s) => s.steps(key, token).await,
            None => Ok(Some(Vec::new())),
        }
    }

    /// [`StepStore::suspend`]; without steps, [`Store::release`].
    pub async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        match self.capabilities().steps {
            Some(s) => s.suspend(key, token).await,
            None => self.release(key, token).await,
        }
    }

    /// [`OperatorStore::inspect`]; without it, [`Error::Unsupported`].
    pub async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        match self.capabilities().operator {
            Some(o) => o.inspect(key, with_value).await,
            None => Err(Error::Unsupported { op: "inspect" }),
        }
    }

    /// [`OperatorStore::forget`]; without it, [`Error::Unsupported`].
    pub async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        match self.capabilities().operator {
            Some(o) => o.forget(key, force).await,
            None => Err(Error::Unsupported { op: "forget" }),
        }
    }

    /// [`OperatorStore::scan`]; without it, [`Error::Unsupported`].
    pub async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        match self.capabilities().operator {
            Some(o) => o.scan(prefix, cursor, count).await,
            None => Err(Error::Unsupported { op: "scan" }),
        }
    }

    /// [`OperatorStore::count_failure`]; without it, [`Error::Unsupported`].
    pub async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        match self.capabilities().operator {
            Some(o) => o.count_failure(key, ttl).await,
            None => Err(Error::Unsupported {
                op: "count_failure",
            }),
        }
    }

    /// [`WatchStore::watch`]; without it, `None`: waiters poll.
    pub async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.capabilities().watch?.watch(key).await
    }

    /// [`WatchStore::watch_forgotten`]; without it, false.
    pub async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        match self.capabilities().watch {
            Some(w) => w.watch_forgotten(prefix, sink).await,
            None => false,
        }
    }

    /// [`DurableStore::check_durability`]; without it, `Ok` for
    /// [`Durability::Async`] only.
    ///
    /// ```
    /// use idem_core::{Durability, store::{MemoryStore, Store}};
    /// let memory: &dyn Store = &MemoryStore::new();
    /// assert!(memory.check_durability(Durability::Async).is_ok());
    /// let d = Durability::replicated(1, std::time::Duration::from_secs(1));
    /// assert!(matches!(memory.check_durability(d), Err(idem_core::Error::DurabilityUnsupported { .. })));
    /// ```
    pub fn check_durability(&self, durability: Durability) -> Result<(), Error> {
        if let Some(d) = self.capabilities().durable {
            return d.check_durability(durability);
        }
        if durability.is_async() {
            return Ok(());
        }
        Err(Error::DurabilityUnsupported {
            reason: format!(
                "the {} store keeps no copies it could confirm ({durability} was asked); use \
                 Durability::Async with it, or RedisStore with replicas or an append-only file",
                self.name()
            ),
        })
    }

    /// [`DurableStore::confirm`]; without it, nothing to wait for with
    /// [`Durability::Async`], and the refusal of
    /// `check_durability` with any other.
    pub async fn confirm(&self, key: &str, durability: Durability) -> Result<(), Error> {
        match self.capabilities().durable {
            Some(d) => d.confirm(key, durability).await,
            None => self.check_durability(durability),
        }
    }

    /// [`Capabilities::outbox`].
    pub fn has_outbox(&self) -> bool {
        self.capabilities().outbox
    }
}
