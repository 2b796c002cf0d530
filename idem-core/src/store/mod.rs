//! For store authors: the [`Store`] trait, the one state machine every
//! backend implements, and the types of its requests and replies
//! ([`Claim`], [`ClaimReply`], [`WriteReply`], [`Completed`], [`ValueKind`],
//! [`Token`], [`KeyWatch`], …). An application needs none of them: it builds
//! a store ([`MemoryStore`], idem-redis's `RedisStore`, idem-postgres's
//! `PgStore`) and hands it to `Idempotency::builder`; the crate root has
//! what it writes.
//!
//! A key is absent, pending (claimed by one owner token until a lease
//! deadline) or completed (holding a stored value until its TTL). `claim`
//! moves absent → pending, expired pending → pending (a takeover), and
//! reports the rest; `complete`, `release` and `extend` act only for the
//! token that holds the pending record. `lua/README.md` gives the Redis
//! encoding; [`MemoryStore`] keeps the same machine in process memory.
//!
//! Besides the contract, this module has the pieces every store shares, so
//! that a store in a crate of its own (idem-redis, idem-postgres) behaves
//! as [`MemoryStore`] does without copying them:
//!
//! - how leases and TTLs are counted: [`millis`], [`store_duration`],
//!   [`store_lease`], [`record_ttl`] and [`MAX_STORE_MS`];
//! - how waiters are woken without polling: [`Hub`] (with [`OnLast`]), which
//!   hands out [`KeyWatch`]es and feeds [`InvalidationSink`]s, and
//!   [`namespace_prefix`], the part of a key a forget is announced under;
//! - how a batch is answered key by key: [`key_waves`], [`in_waves`] and
//!   [`Finish::run_on`].
//!
//! A complete store of your own, written against this module (and the
//! crate's [`Error`] and [`Fingerprint`]), is in the [`Store`] trait's
//! documentation.

mod info;
mod memory;
mod rider;
mod watch;

pub use self::info::{KeyState, RecordInfo, ScanPage};
pub use self::memory::MemoryStore;
pub use self::rider::{Rider, RiderReply};
pub use self::watch::{Hub, Invalidation, InvalidationSink, KeyWatch, OnLast, namespace_prefix};
pub use crate::key::failure_key;
pub use crate::token::Token;

use crate::durability::Durability;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use async_trait::async_trait;
use bytes::Bytes;
use std::time::Duration;

/// One claim request.
///
/// ```
/// use idem_core::store::{Claim, Token};
/// use std::time::Duration;
/// let token = Token::random();
/// let c = Claim { key: "idem:charge:42", token: &token, lease: Duration::from_secs(30), ttl: Duration::from_secs(86_400), fingerprint: None, want_ttl_left: false };
/// assert!(c.lease <= c.ttl);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    /// The full stored key (`namespace:scope:key`).
    pub key: &'a str,
    /// The caller's owner token; re-sending the same token is safe.
    pub token: &'a Token,
    /// How long the claim holds without renewal.
    pub lease: Duration,
    /// How long the record is kept, counted from the claim: the result TTL.
    /// Stores keep it at least two leases, so an expired lease is seen as a
    /// takeover rather than a fresh key.
    pub ttl: Duration,
    /// The payload's fingerprint, if the caller gave one.
    pub fingerprint: Option<&'a Fingerprint>,
    /// Whether a completed record's remaining TTL is wanted
    /// ([`Completed::ttl_left`]); Redis answers it with one more command,
    /// so it is asked for only when something (the local cache) uses it.
    pub want_ttl_left: bool,
}

/// How a completed record's value is stored.
///
/// ```
/// use idem_core::store::ValueKind;
/// assert_eq!(ValueKind::from_tag(ValueKind::Json.tag()), Some(ValueKind::Json));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ValueKind {
    /// serde_json bytes.
    Json,
    /// serde_json bytes, LZ4-compressed with the size prepended.
    Lz4Json,
    /// The body succeeded but its result was over the size limit: the value
    /// holds `size limit` as text and replays answer `Error::TooLarge`.
    TooLarge,
    /// The body succeeded but its result could not be serialized: the value
    /// holds the codec's message and replays answer `Error::Codec`.
    Unstorable,
}

impl ValueKind {
    /// The one-byte tag in the stored record.
    ///
    /// ```
    /// assert_eq!(idem_core::store::ValueKind::Json.tag(), b'C');
    /// ```
    pub fn tag(self) -> u8 {
        match self {
            ValueKind::Json => b'C',
            ValueKind::Lz4Json => b'Z',
            ValueKind::TooLarge => b'L',
            ValueKind::Unstorable => b'U',
        }
    }

    /// The kind for a stored tag, `None` for an unknown one.
    ///
    /// ```
    /// assert_eq!(idem_core::store::ValueKind::from_tag(b'?'), None);
    /// ```
    pub fn from_tag(tag: u8) -> Option<ValueKind> {
        Some(match tag {
            b'C' => ValueKind::Json,
            b'Z' => ValueKind::Lz4Json,
            b'L' => ValueKind::TooLarge,
            b'U' => ValueKind::Unstorable,
            _ => return None,
        })
    }
}

/// A completed record, as a claim finds it.
///
/// ```
/// use idem_core::store::{Completed, ValueKind};
/// let c = Completed { kind: ValueKind::Json, value: bytes::Bytes::from_static(b"42"), fingerprint: None, ttl_left: None };
/// assert_eq!(&c.value[..], b"42");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completed {
    /// How `value` is encoded.
    pub kind: ValueKind,
    /// The stored bytes.
    pub value: Bytes,
    /// The fingerprint stored with the record.
    pub fingerprint: Option<Fingerprint>,
    /// How long the record has left, when the store knows.
    pub ttl_left: Option<Duration>,
}

/// What a claim found.
///
/// ```
/// use idem_core::store::ClaimReply;
/// let r = ClaimReply::Acquired { attempt: 2 };
/// assert!(matches!(r, ClaimReply::Acquired { attempt } if attempt > 1)); // a takeover
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClaimReply {
    /// The caller now holds the key. `attempt` is 1 for a fresh key and
    /// counts up with each takeover of an expired lease.
    Acquired {
        /// 1 for a fresh key, n+1 after the n-th holder's lease expired.
        attempt: u32,
    },
    /// The key was completed earlier: here is its value.
    Completed(Completed),
    /// Another owner holds a live lease.
    InProgress {
        /// How long that lease has left.
        retry_after: Duration,
    },
    /// The record (pending or completed) carries a different fingerprint.
    Mismatch,
}

/// What a `complete`, `release` or `extend` did.
///
/// ```
/// use idem_core::store::WriteReply;
/// assert!(WriteReply::Done.is_done());
/// assert!(!WriteReply::Missing.is_done());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteReply {
    /// The caller owned the pending record and the write happened; for a
    /// `complete`, also a record already completed with exactly this
    /// result (same kind, same bytes): a stored result keeps no owner
    /// token, so it is taken for this same complete re-sent after its
    /// reply was lost (docs/semantics.md, "old holder finishes after a
    /// takeover").
    Done,
    /// No record: it expired or was released.
    Missing,
    /// Another owner took the record over; nothing changed.
    OtherOwner,
    /// The record is already completed (for a `complete`: with another
    /// result); nothing changed.
    AlreadyCompleted,
}

impl WriteReply {
    /// True when the write happened.
    ///
    /// ```
    /// assert!(idem_core::store::WriteReply::Done.is_done());
    /// ```
    pub fn is_done(self) -> bool {
        self == WriteReply::Done
    }
}

/// One write that ends a claim, as an item of [`Store::finish_batch`]:
/// the arguments of [`Store::complete_claim`] or of [`Store::release`].
///
/// ```
/// use idem_core::store::{Finish, Token};
/// let token = Token::random();
/// let op = Finish::Release { key: "idem:charge:42", token: &token };
/// assert_eq!(op.key(), "idem:charge:42");
/// ```
#[derive(Debug, Clone, Copy)]
pub enum Finish<'a> {
    /// [`Store::complete_claim`] of `claim`: the claim this complete ends,
    /// as it was sent (its key, owner token, fingerprint, lease and TTL).
    Complete {
        /// The claim that took the key.
        claim: Claim<'a>,
        /// How `value` is encoded.
        kind: ValueKind,
        /// The bytes to store.
        value: &'a [u8],
    },
    /// [`Store::release`] of `key` for `token`.
    Release {
        /// The full stored key.
        key: &'a str,
        /// The owner token that holds the pending record.
        token: &'a Token,
    },
}

impl<'a> Finish<'a> {
    /// The stored key this write acts on.
    ///
    /// ```
    /// use idem_core::store::{Claim, Finish, Token, ValueKind};
    /// use std::time::Duration;
    /// let token = Token::random();
    /// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// let op = Finish::Complete { claim, kind: ValueKind::Json, value: b"1" };
    /// assert_eq!(op.key(), "k");
    /// ```
    pub fn key(&self) -> &'a str {
        match self {
            Finish::Complete { claim, .. } => claim.key,
            Finish::Release { key, .. } => key,
        }
    }

    /// The owner token this write acts for.
    pub fn token(&self) -> &'a Token {
        match self {
            Finish::Complete { claim, .. } => claim.token,
            Finish::Release { token, .. } => token,
        }
    }

    /// Runs this write through the single-key methods of `store`: what the
    /// default [`Store::finish_batch`] does per item.
    pub async fn run_on<S: Store + ?Sized>(&self, store: &S) -> Result<WriteReply, Error> {
        match *self {
            Finish::Complete { claim, kind, value } => {
                store
                    .complete_claim(&claim, kind, value, Durability::Async)
                    .await
            }
            Finish::Release { key, token } => store.release(key, token).await,
        }
    }
}

/// The positions of a batch's items in waves, for a store that sends a
/// batch as one statement or pipeline: the n-th occurrence of a key goes to
/// the n-th wave, so no wave holds a key twice, and running the waves in
/// order answers a key's items in batch order. A batch of distinct keys is
/// one wave.
///
/// ```
/// use idem_core::store::key_waves;
/// let waves = key_waves(["a", "b", "a", "c", "a"]);
/// assert_eq!(waves, vec![vec![0, 1, 3], vec![2], vec![4]]);
/// ```
pub fn key_waves<'k>(keys: impl IntoIterator<Item = &'k str>) -> Vec<Vec<usize>> {
    let keys = keys.into_iter();
    // Sized once, and a fast hash: this runs twice per batch (claims,
    // finishes) over every key of it.
    let mut seen: std::collections::HashMap<&str, usize, foldhash::fast::RandomState> =
        std::collections::HashMap::with_capacity_and_hasher(
            keys.size_hint().0,
            foldhash::fast::RandomState::default(),
        );
    let mut waves: Vec<Vec<usize>> = Vec::new();
    for (i, key) in keys.enumerate() {
        let n = seen.entry(key).or_insert(0);
        match waves.get_mut(*n) {
            Some(wave) => wave.push(i),
            None => waves.push(vec![i]),
        }
        *n += 1;
    }
    waves
}

/// Answers a batch wave by wave ([`key_waves`]), for a store that sends
/// each wave as one statement or pipeline: `send` gets one wave's items (no
/// key twice, in batch order) and returns their replies in that order. An
/// item its wave left unanswered gets `missing()`.
///
/// ```
/// use idem_core::{Error, store::in_waves};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let items = ["a", "b", "a"];
/// let replies = in_waves(&items, |k| *k, |wave: Vec<&&str>| async move {
///     wave.iter().map(|k| Ok::<_, Error>(k.len())).collect()
/// }, || Error::corrupt("no reply")).await;
/// assert_eq!(replies.len(), 3);
/// # });
/// ```
pub async fn in_waves<'i, I, R, F, Fut>(
    items: &'i [I],
    key: impl Fn(&'i I) -> &'i str,
    mut send: F,
    missing: impl Fn() -> Error,
) -> Vec<Result<R, Error>>
where
    F: FnMut(Vec<&'i I>) -> Fut,
    Fut: std::future::Future<Output = Vec<Result<R, Error>>>,
{
    let mut out: Vec<Option<Result<R, Error>>> = (0..items.len()).map(|_| None).collect();
    for wave in key_waves(items.iter().map(&key)) {
        let batch: Vec<&I> = wave.iter().filter_map(|&i| items.get(i)).collect();
        for (i, reply) in wave.into_iter().zip(send(batch).await) {
            if let Some(slot) = out.get_mut(i) {
                *slot = Some(reply);
            }
        }
    }
    out.into_iter()
        .map(|r| r.unwrap_or_else(|| Err(missing())))
        .collect()
}

/// One finished step of a `run_steps` call, as the pending record keeps it.
///
/// ```
/// let s = idem_core::store::StepRecord { name: "charge".into(), value: bytes::Bytes::from_static(b"\"ch_1\"") };
/// assert_eq!(s.name, "charge");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepRecord {
    /// The step's name, unique in its call.
    pub name: String,
    /// The step's `Ok` value, serde_json bytes.
    pub value: Bytes,
}

/// A backend that keeps idempotency records.
///
/// Implementations must be atomic per key: each method is one indivisible
/// step of the state machine described in this module. idem-redis's
/// `RedisStore` does it with one Lua script per method; [`MemoryStore`]
/// under a mutex.
///
/// ```
/// use idem_core::store::{Claim, ClaimReply, MemoryStore, Store, Token, WriteReply};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let store = MemoryStore::new();
/// let token = Token::random();
/// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
/// assert_eq!(store.claim(claim).await?, ClaimReply::Acquired { attempt: 1 });
/// assert_eq!(store.release("k", &token).await?, WriteReply::Done);
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
///
/// # A store of your own
///
/// A store implements the four required methods, `claim`, `complete`,
/// `release` and `extend`; every other method has a default (answering
/// [`Error::Unsupported`], no steps, no notifications) that a store
/// overrides to offer more. The runtime stores a result through
/// [`complete_claim`](Store::complete_claim), whose default is `complete`:
/// a store that wraps another forwards it too, or the inner store never
/// hears which claim it completes (and forwards
/// [`finish_batch_riding`](Store::finish_batch_riding), or the inner
/// store never carries a [`Rider`]). It counts leases and TTLs as every store does
/// ([`store_lease`], [`record_ttl`]), and is written with
/// `#[idem_core::async_trait]` (`#[idem::async_trait]` through the facade):
/// no dependency of its own. This one keeps its records in a map under one
/// lock, which makes each method one atomic step:
///
/// ```
/// use idem_core::store::{
///     Claim, ClaimReply, Completed, Store, Token, ValueKind, WriteReply, record_ttl, store_lease,
/// };
/// use idem_core::{Error, Fingerprint, Idempotency, Outcome};
/// use std::collections::HashMap;
/// use std::sync::{Mutex, MutexGuard};
/// use std::time::{Duration, Instant};
///
/// enum State {
///     /// Claimed by `token` until `lease_end`; `attempt` counts takeovers.
///     Pending { token: Token, lease_end: Instant, attempt: u32 },
///     /// The body's stored result.
///     Completed { kind: ValueKind, value: bytes::Bytes },
/// }
///
/// struct Record {
///     state: State,
///     fingerprint: Option<Fingerprint>,
///     /// The record is gone after this (the result TTL, counted from the claim).
///     expires: Instant,
/// }
///
/// /// Records in a map, one lock for every step.
/// #[derive(Default)]
/// struct MapStore {
///     records: Mutex<HashMap<String, Record>>,
/// }
///
/// impl MapStore {
///     /// The live records (expired ones dropped first).
///     fn records(&self, now: Instant) -> MutexGuard<'_, HashMap<String, Record>> {
///         let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
///         records.retain(|_, r| r.expires > now);
///         records
///     }
///
///     /// The owner check of `complete`, `release` and `extend`: the record
///     /// must be pending and held by `token`.
///     fn owned<'r>(records: &'r mut HashMap<String, Record>, key: &str, token: &Token)
///         -> Result<&'r mut Record, WriteReply>
///     {
///         match records.get_mut(key) {
///             None => Err(WriteReply::Missing),
///             Some(Record { state: State::Completed { .. }, .. }) => Err(WriteReply::AlreadyCompleted),
///             Some(r) => match r.state {
///                 State::Pending { token: holder, .. } if holder == *token => Ok(r),
///                 _ => Err(WriteReply::OtherOwner),
///             },
///         }
///     }
/// }
///
/// #[idem_core::async_trait]
/// impl Store for MapStore {
///     async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
///         let now = Instant::now();
///         let lease_end = now + store_lease(c.lease);
///         let mut records = self.records(now);
///         let attempt = match records.get(c.key) {
///             None => 1,
///             Some(r) => {
///                 if matches!((c.fingerprint, &r.fingerprint), (Some(a), Some(b)) if a != b) {
///                     return Ok(ClaimReply::Mismatch);
///                 }
///                 match &r.state {
///                     State::Completed { kind, value } => {
///                         return Ok(ClaimReply::Completed(Completed {
///                             kind: *kind,
///                             value: value.clone(),
///                             fingerprint: r.fingerprint,
///                             ttl_left: Some(r.expires - now),
///                         }));
///                     }
///                     // Our own claim, re-sent after its reply was lost.
///                     State::Pending { token, attempt, .. } if token == c.token => *attempt,
///                     State::Pending { lease_end, .. } if *lease_end > now => {
///                         return Ok(ClaimReply::InProgress { retry_after: *lease_end - now });
///                     }
///                     // The holder's lease ran out: take the key over.
///                     State::Pending { attempt, .. } => attempt + 1,
///                 }
///             }
///         };
///         let fingerprint = c.fingerprint.copied().or(records.get(c.key).and_then(|r| r.fingerprint));
///         let state = State::Pending { token: *c.token, lease_end, attempt };
///         let expires = now + record_ttl(c.ttl, c.lease);
///         records.insert(c.key.to_owned(), Record { state, fingerprint, expires });
///         Ok(ClaimReply::Acquired { attempt })
///     }
///
///     async fn complete(
///         &self,
///         key: &str,
///         token: &Token,
///         _fingerprint: Option<&Fingerprint>,
///         kind: ValueKind,
///         value: &[u8],
///     ) -> Result<WriteReply, Error> {
///         let mut records = self.records(Instant::now());
///         Ok(match Self::owned(&mut records, key, token) {
///             Ok(r) => {
///                 // The expiry stays: the result TTL counts from the claim.
///                 r.state = State::Completed { kind, value: bytes::Bytes::copy_from_slice(value) };
///                 WriteReply::Done
///             }
///             Err(reply) => reply,
///         })
///     }
///
///     async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
///         let mut records = self.records(Instant::now());
///         Ok(match Self::owned(&mut records, key, token) {
///             Ok(_) => {
///                 records.remove(key);
///                 WriteReply::Done
///             }
///             Err(reply) => reply,
///         })
///     }
///
///     async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
///         let now = Instant::now();
///         let mut records = self.records(now);
///         Ok(match Self::owned(&mut records, key, token) {
///             Ok(r) => {
///                 if let State::Pending { lease_end, .. } = &mut r.state {
///                     *lease_end = now + store_lease(lease);
///                 }
///                 WriteReply::Done
///             }
///             Err(reply) => reply,
///         })
///     }
///
///     fn name(&self) -> &'static str {
///         "map"
///     }
/// }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MapStore::default()).namespace("shop").build();
/// let charge = || async { Ok::<_, Error>("receipt-7".to_owned()) };
/// let first = idem.call("charge", "order-7").run_outcome(charge).await?;
/// let again = idem.call("charge", "order-7").run_outcome(charge).await?;
/// assert_eq!(first, ("receipt-7".to_owned(), Outcome::Executed));
/// assert_eq!(again, ("receipt-7".to_owned(), Outcome::Replayed));
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the key for `claim.token`, or reports what holds it.
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error>;

    /// Replaces the caller's pending record by a completed one. The record
    /// keeps its expiry: the result TTL counts from the claim. It keeps the
    /// claim's fingerprint too; `fingerprint` is the caller's, which lets a
    /// store write the record in one step when the two agree.
    async fn complete(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error>;

    /// [`complete`](Store::complete) (or, for a `durability` other than
    /// [`Durability::Async`], [`complete_durable`](Store::complete_durable))
    /// of the key `claim` took, told the claim as it was sent: what the
    /// runtime calls. With its lease and TTL, the claim says what the
    /// pending record it wrote holds, which lets a store compare that
    /// record's exact bytes instead of reading it (RedisStore on Valkey 8.1+
    /// and Redis 8.4+: one plain `SET … IFEQ`, no script), without keeping
    /// anything per call between the claim and its complete. A record that
    /// changed since (a waiter marked it, the lease was extended, steps
    /// were saved, another owner took it over) must still get the answer
    /// `complete` gives. The default is `complete` (or `complete_durable`).
    /// The runtime completes this way (here, or as a batch's
    /// [`Finish::Complete`]) only a call that sent no renewal and saved no
    /// steps, whose record it knows unchanged but for a waiter's mark; the
    /// others get `complete`.
    ///
    /// ```
    /// use idem_core::{Durability, store::{Claim, MemoryStore, Store, Token, ValueKind, WriteReply}};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// store.claim(claim).await?;
    /// let done = store.complete_claim(&claim, ValueKind::Json, b"7", Durability::Async).await?;
    /// assert_eq!(done, WriteReply::Done);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn complete_claim(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
        durability: Durability,
    ) -> Result<WriteReply, Error> {
        if durability.is_async() {
            self.complete(claim.key, claim.token, claim.fingerprint, kind, value)
                .await
        } else {
            self.complete_durable(
                claim.key,
                claim.token,
                claim.fingerprint,
                kind,
                value,
                durability,
            )
            .await
        }
    }

    /// Whether this store can give `durability`: `Ok` for
    /// [`Durability::Async`], else [`Error::DurabilityUnsupported`] saying
    /// what is missing. Checked (without a round trip: a store learns what
    /// its server can do when it connects) by
    /// [`IdempotencyBuilder::try_build`](crate::IdempotencyBuilder::try_build)
    /// and before every call that asks for durability. The default gives
    /// only `Async`; a store that overrides it overrides
    /// [`confirm`](Store::confirm) too.
    ///
    /// ```
    /// use idem_core::{Durability, store::{MemoryStore, Store}};
    /// let memory = MemoryStore::new();
    /// assert!(memory.check_durability(Durability::Async).is_ok());
    /// let d = Durability::replicated(1, std::time::Duration::from_secs(1));
    /// assert!(matches!(memory.check_durability(d), Err(idem_core::Error::DurabilityUnsupported { .. })));
    /// ```
    fn check_durability(&self, durability: Durability) -> Result<(), Error> {
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

    /// Waits until every write the store has applied to `key`'s primary so
    /// far is as durable as `durability` asks: a fence that proves the copy
    /// of a record this caller only **read** (a replay, a takeover), since
    /// a replication stream is ordered. `Err(`[`Error::NotConfirmed`]`)`
    /// when the copies did not confirm within the timeout. Called only
    /// with a durability [`check_durability`](Store::check_durability)
    /// accepted; the default refuses every durability but `Async`.
    async fn confirm(&self, key: &str, durability: Durability) -> Result<(), Error> {
        let _ = key;
        self.check_durability(durability)
    }

    /// [`claim`](Store::claim), not answering `Acquired` or `Completed`
    /// before the claim written (or the record read) is as durable as
    /// `durability` asks; `InProgress` and `Mismatch` report and are not
    /// confirmed. Unconfirmed, it fails with [`Error::NotConfirmed`] (the
    /// caller then releases its claim, by token). The default is `claim`
    /// then [`confirm`](Store::confirm): two round trips, which a store
    /// overrides to pipeline them (RedisStore: one).
    async fn claim_durable(
        &self,
        claim: Claim<'_>,
        durability: Durability,
    ) -> Result<ClaimReply, Error> {
        let reply = self.claim(claim).await?;
        if !durability.is_async()
            && matches!(
                reply,
                ClaimReply::Acquired { .. } | ClaimReply::Completed(_)
            )
        {
            self.confirm(claim.key, durability).await?;
        }
        Ok(reply)
    }

    /// [`complete`](Store::complete), confirmed as `durability` asks.
    /// A `Done` write whose copies were not confirmed in time is
    /// `Err(`[`Error::NotConfirmed`]`)`: the result **is** on the primary
    /// (the caller reports [`Outcome::NotConfirmed`](crate::Outcome::NotConfirmed)
    /// and does not re-send). The default is `complete` then
    /// [`confirm`](Store::confirm).
    async fn complete_durable(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
        durability: Durability,
    ) -> Result<WriteReply, Error> {
        let reply = self.complete(key, token, fingerprint, kind, value).await?;
        if !durability.is_async() && reply.is_done() {
            self.confirm(key, durability).await?;
        }
        Ok(reply)
    }

    /// Whether [`complete_with_outbox`](Store::complete_with_outbox) writes
    /// outgoing messages with the result. Read before a body runs, so that
    /// [`outbox::stage`](crate::outbox::stage) fails at once (and the body
    /// with it) on a store that could not store what it stages. The
    /// default is `false`.
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store};
    /// assert!(!MemoryStore::new().has_outbox());
    /// ```
    fn has_outbox(&self) -> bool {
        false
    }

    /// [`complete`](Store::complete), and in the same atomic step the
    /// outgoing `messages` (staged by the body, ids made from the record
    /// key) appended to the store's outbox, in order: both are written, or
    /// neither. A re-sent complete that finds its own result stored is
    /// `Done` and appends nothing again. Called only with messages, and
    /// only on a store whose [`has_outbox`](Store::has_outbox) is true.
    ///
    /// The default answers [`Error::Unsupported`].
    #[allow(clippy::too_many_arguments)]
    async fn complete_with_outbox(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
        messages: &[crate::outbox::message::OutboxMessage],
    ) -> Result<WriteReply, Error> {
        let _ = (key, token, fingerprint, kind, value, messages);
        Err(Error::Unsupported {
            op: "complete_with_outbox",
        })
    }

    /// Deletes the caller's pending record so the next call runs the body.
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error>;

    /// Moves the caller's lease deadline to now + `lease`.
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error>;

    /// Claims several keys at once: one reply per item, in order, each the
    /// reply [`claim`](Store::claim) would give for it. A batch is a
    /// transport, never a transaction across keys: each key keeps exactly
    /// the single call's semantics, an item that fails answers its own
    /// error while the others are answered normally, and a key that comes
    /// twice is answered as two single calls in that order would be.
    ///
    /// The default calls `claim` per item; stores override it to save
    /// round trips (Redis: one pipeline; MemoryStore: one lock).
    ///
    /// ```
    /// use idem_core::store::{Claim, ClaimReply, MemoryStore, Store, Token};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let (a, b) = (Token::random(), Token::random());
    /// let claim = |key, token| Claim { key, token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// let replies = store.claim_batch(&[claim("k1", &a), claim("k1", &b)]).await;
    /// assert_eq!(replies[0].as_ref().ok(), Some(&ClaimReply::Acquired { attempt: 1 }));
    /// assert!(matches!(replies[1], Ok(ClaimReply::InProgress { .. })));
    /// # });
    /// ```
    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        let mut replies = Vec::with_capacity(claims.len());
        for claim in claims {
            replies.push(self.claim(*claim).await);
        }
        replies
    }

    /// Completes and releases several keys at once: one reply per item, in
    /// order, each the reply [`complete_claim`](Store::complete_claim) or
    /// [`release`](Store::release) would give for it, with the same
    /// per-key guarantees as [`claim_batch`](Store::claim_batch).
    ///
    /// The default runs each item through the single methods.
    ///
    /// ```
    /// use idem_core::store::{Claim, Finish, MemoryStore, Store, Token, ValueKind, WriteReply};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// store.claim(claim).await?;
    /// let done = Finish::Complete { claim, kind: ValueKind::Json, value: b"7" };
    /// let again = Finish::Release { key: "k", token: &token };
    /// let replies = store.finish_batch(&[done, again]).await;
    /// assert_eq!(replies[0].as_ref().ok(), Some(&WriteReply::Done));
    /// assert_eq!(replies[1].as_ref().ok(), Some(&WriteReply::AlreadyCompleted));
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        let mut replies = Vec::with_capacity(ops.len());
        for op in ops {
            replies.push(op.run_on(self).await);
        }
        replies
    }

    /// [`finish_batch`](Store::finish_batch), with `rider`'s commands sent
    /// in the same round trip after every write of `ops`, if this store
    /// can carry them ([`Rider`]): it then calls [`Rider::land`] with
    /// their reply. A store that carries them runs them only if every
    /// complete of `ops` is stored by then, and withholds them otherwise. The default carries nothing: it drops `rider`, whose
    /// maker then sends its commands itself.
    ///
    /// A store that wraps another forwards this method, or its riders are
    /// never carried (nothing is lost: they go in a round trip of their own).
    ///
    /// ```
    /// use idem_core::store::{Claim, Finish, MemoryStore, Rider, Store, Token, ValueKind};
    /// use std::sync::Arc;
    /// use std::sync::atomic::{AtomicBool, Ordering};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// store.claim(claim).await?;
    /// let landed = Arc::new(AtomicBool::new(false));
    /// let l = Arc::clone(&landed);
    /// let rider = Rider::new((), move |_| l.store(true, Ordering::SeqCst));
    /// let done = Finish::Complete { claim, kind: ValueKind::Json, value: b"7" };
    /// store.finish_batch_riding(&[done], rider).await;
    /// // MemoryStore has no round trip to share: the rider's maker sends its own.
    /// assert!(!landed.load(Ordering::SeqCst));
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn finish_batch_riding(
        &self,
        ops: &[Finish<'_>],
        rider: Rider,
    ) -> Vec<Result<WriteReply, Error>> {
        drop(rider);
        self.finish_batch(ops).await
    }

    /// Records one finished step of a [`run_steps`](crate::Call::run_steps)
    /// call in the caller's pending record: `value` (serde_json bytes)
    /// under `name`, by the owner only (the same owner-token check as
    /// [`complete`](Store::complete)). The record keeps its expiry. A step
    /// already recorded under `name` is left as it is and answers
    /// [`WriteReply::Done`]: it is this same write re-sent after its reply
    /// was lost. A completed record replaces the steps (completion drops
    /// them); [`release`](Store::release) deletes them with the record.
    ///
    /// The default answers [`Error::Unsupported`]: `run_steps` then fails
    /// at its first step, before anything is recorded.
    ///
    /// ```
    /// use idem_core::store::{Claim, MemoryStore, Store, Token, WriteReply};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim { key: "k", token: &token, lease: Duration::from_secs(5), ttl: Duration::from_secs(60), fingerprint: None, want_ttl_left: false };
    /// store.claim(claim).await?;
    /// assert_eq!(store.save_step("k", &token, "reserve", b"7").await?, WriteReply::Done);
    /// let steps = store.steps("k", &token).await?.unwrap_or_default();
    /// assert_eq!((steps[0].name.as_str(), &steps[0].value[..]), ("reserve", &b"7"[..]));
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let _ = (key, token, name, value);
        Err(Error::Unsupported { op: "save_step" })
    }

    /// The steps recorded in the caller's pending record, in the order they
    /// were recorded; `None` when the caller does not hold the pending
    /// record (another owner, completed, or no record). Read by a call that
    /// took the key over (attempt > 1), before its body runs.
    ///
    /// The default answers no steps: a store that cannot record steps has
    /// none to give back.
    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let _ = (key, token);
        Ok(Some(Vec::new()))
    }

    /// Ends the caller's lease at once but keeps the recorded steps, so the
    /// next call takes the key over (attempt + 1, `Outcome::Recovered`) and
    /// resumes after them: what a failed `run_steps` body does. A record
    /// without steps is deleted, exactly as [`release`](Store::release)
    /// does. Wakes waiters as `release` does.
    ///
    /// The default is `release`.
    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.release(key, token).await
    }

    /// The backend's short name, the `store` label of idem's metrics
    /// (`redis`, `memory`, `postgres`). A bounded set: never a key or URL.
    /// The default is `custom`.
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store};
    /// assert_eq!(MemoryStore::new().name(), "memory");
    /// ```
    fn name(&self) -> &'static str {
        "custom"
    }

    /// Reads the record of `key` for an operator, writing nothing; `None`
    /// when there is none. The value is included only when `with_value`.
    /// A record that cannot be read is [`Error::Corrupt`].
    ///
    /// The default answers [`Error::Unsupported`], so stores written before
    /// this method keep compiling.
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        let _ = (key, with_value);
        Err(Error::Unsupported { op: "inspect" })
    }

    /// Deletes the record of `key` in one atomic step and returns what it
    /// was (without its value); `None` when there was none. A pending
    /// record whose lease is live is refused with [`Error::LeaseHeld`]
    /// unless `force`; an unreadable one is refused with
    /// [`Error::Corrupt`] (it may be another program's key).
    ///
    /// The default answers [`Error::Unsupported`].
    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        let _ = (key, force);
        Err(Error::Unsupported { op: "forget" })
    }

    /// Subscribes to changes of `key` (its completion, release or
    /// forgetting), for a caller about to wait on a pending record. Returns
    /// once the subscription is active, so a change after this returns is
    /// seen by [`KeyWatch::changed`]: read the record again after it.
    /// `None` when the store cannot notify (the caller polls).
    ///
    /// The default answers `None`: waiters poll.
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        let _ = key;
        None
    }

    /// Registers `sink` to hear of keys under `prefix` (a namespace, with
    /// its `:`) that are forgotten anywhere, for a local replay cache. True
    /// when the store delivers them; false when it cannot (copies then
    /// replay until their TTL, as documented on `local_cache`). The sink
    /// is told [`Invalidation::All`] when messages may have been lost. The
    /// store keeps it weakly: it is heard while the caller holds it.
    ///
    /// Called again with the same sink every few seconds while it answers
    /// true (so a subscriber that stopped is started again), and every few
    /// seconds while it answers false: register a sink once, however often
    /// it is passed, and make a call that finds everything in place cheap.
    ///
    /// The default answers false.
    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        let _ = (prefix, sink);
        false
    }

    /// Adds one to the count of failed runs kept beside the record of
    /// `key` (a counter of its own, stored under
    /// [`failure_key`], which survives the record's
    /// release), sets the counter to expire `ttl` from now, and returns the
    /// count after the addition. Atomic: N concurrent calls return 1..=N,
    /// each once. An expired counter starts again at 1. [`forget`] resets
    /// it; [`scan`] never lists it.
    ///
    /// The default answers [`Error::Unsupported`].
    ///
    /// [`forget`]: Store::forget
    /// [`scan`]: Store::scan
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// assert_eq!(store.count_failure("ns:charge:42", Duration::from_secs(60)).await?, 1);
    /// assert_eq!(store.count_failure("ns:charge:42", Duration::from_secs(60)).await?, 2);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let _ = (key, ttl);
        Err(Error::Unsupported {
            op: "count_failure",
        })
    }

    /// One page of the records whose stored key starts with `prefix`,
    /// about `count` keys, from `cursor` (`None` for the first page). Never
    /// blocks the store for long (Redis: `SCAN`, never `KEYS`).
    ///
    /// The default answers [`Error::Unsupported`].
    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        let _ = (prefix, cursor, count);
        Err(Error::Unsupported { op: "scan" })
    }
}

/// The longest lease or TTL a store keeps, in ms (about 317 years). The
/// builder caps TTLs at a year; longer durations given to a `Store`
/// directly are clamped to this, so that a store never overflows an
/// `Instant` or a timestamp, and Lua (whose numbers print as integers only
/// below 1e14) never writes an unusable one. A store author clamps through
/// [`millis`] rather than reading this.
///
/// ```
/// use idem_core::store::{MAX_STORE_MS, millis};
/// assert_eq!(millis(std::time::Duration::MAX), MAX_STORE_MS);
/// ```
pub const MAX_STORE_MS: u64 = 10_000_000_000_000;

/// A duration as every store counts it: whole milliseconds, at least 1, at
/// most [`MAX_STORE_MS`]. A store that sends leases and TTLs to its
/// backend in ms (Redis `PX`, a PostgreSQL interval) converts them here, so
/// that every store rounds and clamps alike and a call behaves the same on
/// each.
///
/// ```
/// use idem_core::store::millis;
/// use std::time::Duration;
/// assert_eq!(millis(Duration::from_micros(1500)), 1); // whole ms, rounded down
/// assert_eq!(millis(Duration::ZERO), 1);               // never 0: "no expiry" to a backend
/// ```
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis())
        .unwrap_or(u64::MAX)
        .clamp(1, MAX_STORE_MS)
}

/// How long a claimed record is kept: the result TTL, and at least two
/// leases, so that a lease that runs out leaves a record behind and the
/// next claim counts a takeover (`Outcome::Recovered`) instead of finding a
/// fresh key. A result whose TTL is under two leases is kept that long. A
/// store sets its records' expiry at a claim ([`Claim::ttl`],
/// [`Claim::lease`]) from this.
///
/// ```
/// use idem_core::store::record_ttl;
/// use std::time::Duration;
/// let s = Duration::from_secs;
/// assert_eq!(record_ttl(s(86_400), s(30)), s(86_400));
/// assert_eq!(record_ttl(s(10), s(30)), s(60)); // two leases
/// ```
pub fn record_ttl(ttl: Duration, lease: Duration) -> Duration {
    store_duration(ttl).max(store_lease(lease) * 2)
}

/// A lease as every store counts it: as [`store_duration`], and at most
/// half of [`MAX_STORE_MS`], so that the two leases of [`record_ttl`]
/// always fit. A store computes a lease deadline (at a claim, in
/// [`Store::extend`]) from this.
///
/// ```
/// use idem_core::store::{MAX_STORE_MS, store_lease};
/// use std::time::Duration;
/// assert_eq!(store_lease(Duration::MAX), Duration::from_millis(MAX_STORE_MS / 2));
/// ```
pub fn store_lease(lease: Duration) -> Duration {
    store_duration(lease).min(Duration::from_millis(MAX_STORE_MS / 2))
}

/// `d` as every store counts it ([`millis`]), as a `Duration`: for a store
/// that keeps time itself (an `Instant` deadline, as [`MemoryStore`] does),
/// so that it agrees with the stores that count in ms.
///
/// ```
/// use idem_core::store::store_duration;
/// use std::time::Duration;
/// assert_eq!(store_duration(Duration::from_micros(2_700)), Duration::from_millis(2));
/// ```
pub fn store_duration(d: Duration) -> Duration {
    Duration::from_millis(millis(d))
}
