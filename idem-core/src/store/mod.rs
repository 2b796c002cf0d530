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

mod capability;
mod info;
mod memory;
mod watch;

pub use self::capability::{Capabilities, DurableStore, OperatorStore, StepStore, WatchStore};
pub use self::info::{KeyState, RecordInfo, ScanPage};
pub use self::memory::MemoryStore;
pub use self::watch::{Hub, Invalidation, InvalidationSink, KeyWatch, OnLast, namespace_prefix};
pub use crate::key::failure_key;
pub use crate::token::Token;

use crate::durability::Durability;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::outbox::message::OutboxMessage;
use async_trait::async_trait;
use bytes::Bytes;
use std::time::Duration;

/// One claim request: [`Claim::new`], then the setters for what is not
/// the default.
///
/// ```
/// use idem_core::store::{Claim, Token};
/// use std::time::Duration;
/// let token = Token::random();
/// let c = Claim::new("idem:charge:42", &token, Duration::from_secs(30), Duration::from_secs(86_400))
///     .want_ttl_left(true);
/// assert!(c.lease <= c.ttl && c.want_ttl_left);
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
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
    /// The copies to confirm before answering `Acquired` or `Completed`
    /// (`InProgress` and `Mismatch` report and are not confirmed);
    /// unconfirmed, the claim fails with [`Error::NotConfirmed`] and the
    /// caller releases it by token. Anything but [`Durability::Async`] is
    /// sent only to a store whose [`DurableStore`] capability accepted it.
    pub durability: Durability,
}

impl<'a> Claim<'a> {
    /// A claim of `key` for `token`: no fingerprint, no TTL asked back,
    /// [`Durability::Async`].
    pub fn new(key: &'a str, token: &'a Token, lease: Duration, ttl: Duration) -> Claim<'a> {
        Claim {
            key,
            token,
            lease,
            ttl,
            fingerprint: None,
            want_ttl_left: false,
            durability: Durability::Async,
        }
    }

    /// Sets [`fingerprint`](Claim::fingerprint).
    pub fn fingerprint(mut self, fingerprint: Option<&'a Fingerprint>) -> Claim<'a> {
        self.fingerprint = fingerprint;
        self
    }

    /// Sets [`want_ttl_left`](Claim::want_ttl_left).
    pub fn want_ttl_left(mut self, want: bool) -> Claim<'a> {
        self.want_ttl_left = want;
        self
    }

    /// Sets [`durability`](Claim::durability).
    pub fn durability(mut self, durability: Durability) -> Claim<'a> {
        self.durability = durability;
        self
    }
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

/// The lease and TTL of the claim that wrote a pending record, told to
/// [`Store::complete`] when the record is still exactly as that claim wrote
/// it ([`Complete::as_claimed`]).
///
/// ```
/// use idem_core::store::AsClaimed;
/// use std::time::Duration;
/// let a = AsClaimed { lease: Duration::from_secs(5), ttl: Duration::from_secs(60) };
/// assert!(a.lease < a.ttl);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsClaimed {
    /// The claim's lease ([`Claim::lease`]).
    pub lease: Duration,
    /// The claim's TTL ([`Claim::ttl`]).
    pub ttl: Duration,
}

/// One complete request: replace the caller's pending record by a
/// completed one holding `value`. [`Complete::new`] (or
/// [`Complete::of_claim`]), then the setters for what is not the default.
///
/// The record keeps its expiry (the result TTL counts from the claim) and
/// the claim's fingerprint; [`fingerprint`](Complete::fingerprint) is the
/// caller's, which lets a store write the record in one step when the two
/// agree.
///
/// ```
/// use idem_core::store::{Claim, Complete, Token, ValueKind};
/// use std::time::Duration;
/// let token = Token::random();
/// let claim = Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60));
/// let done = Complete::of_claim(&claim, ValueKind::Json, b"7");
/// assert_eq!((done.key, done.as_claimed.map(|a| a.lease)), ("k", Some(claim.lease)));
/// let read_first = Complete::new("k", &token, ValueKind::Json, b"7");
/// assert!(read_first.as_claimed.is_none() && read_first.outbox.is_empty());
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Complete<'a> {
    /// The full stored key.
    pub key: &'a str,
    /// The owner token that holds the pending record.
    pub token: &'a Token,
    /// The caller's fingerprint, if it gave one.
    pub fingerprint: Option<&'a Fingerprint>,
    /// How `value` is encoded.
    pub kind: ValueKind,
    /// The bytes to store.
    pub value: &'a [u8],
    /// The copies to confirm once the result is written. A `Done` write
    /// whose copies were not confirmed in time is
    /// `Err(`[`Error::NotConfirmed`]`)`: the result **is** on the primary
    /// (the caller reports `Outcome::NotConfirmed` and does not re-send).
    /// Anything but [`Durability::Async`] is sent only to a store whose
    /// [`DurableStore`] capability accepted it.
    pub durability: Durability,
    /// Outgoing messages (staged by the body, ids made from the record
    /// key) appended to the store's outbox in the same atomic step as the
    /// result, in order: both are written, or neither. A re-sent complete
    /// that finds its own result stored is `Done` and appends nothing
    /// again. Not empty only for a store whose
    /// [`Capabilities::outbox`] is true; a store without an outbox
    /// answers [`Error::Unsupported`] to messages.
    pub outbox: &'a [OutboxMessage],
    /// How the key was claimed, when the pending record is still exactly
    /// as that claim wrote it (no renewal, no steps saved; a waiter's mark
    /// aside): a store may then compare the record's exact bytes instead of
    /// reading it (RedisStore on Valkey 8.1+ and Redis 8.4+: one plain
    /// `SET … IFEQ`, no script), without keeping anything per call between
    /// the claim and its complete. `None`: the store reads the record
    /// first. A record that changed since must get the same answer either
    /// way.
    pub as_claimed: Option<AsClaimed>,
}

impl<'a> Complete<'a> {
    /// A complete of `key` for `token` that reads the record first: no
    /// fingerprint, [`Durability::Async`], no outbox messages.
    pub fn new(key: &'a str, token: &'a Token, kind: ValueKind, value: &'a [u8]) -> Complete<'a> {
        Complete {
            key,
            token,
            fingerprint: None,
            kind,
            value,
            durability: Durability::Async,
            outbox: &[],
            as_claimed: None,
        }
    }

    /// The complete of the key `claim` took, the record as that claim
    /// wrote it: its key, token, fingerprint, durability, lease and TTL.
    pub fn of_claim(claim: &Claim<'a>, kind: ValueKind, value: &'a [u8]) -> Complete<'a> {
        Complete::new(claim.key, claim.token, kind, value)
            .fingerprint(claim.fingerprint)
            .durability(claim.durability)
            .as_claimed(Some(AsClaimed {
                lease: claim.lease,
                ttl: claim.ttl,
            }))
    }

    /// Sets [`fingerprint`](Complete::fingerprint).
    pub fn fingerprint(mut self, fingerprint: Option<&'a Fingerprint>) -> Complete<'a> {
        self.fingerprint = fingerprint;
        self
    }

    /// Sets [`durability`](Complete::durability).
    pub fn durability(mut self, durability: Durability) -> Complete<'a> {
        self.durability = durability;
        self
    }

    /// Sets [`outbox`](Complete::outbox).
    pub fn outbox(mut self, messages: &'a [OutboxMessage]) -> Complete<'a> {
        self.outbox = messages;
        self
    }

    /// Sets [`as_claimed`](Complete::as_claimed).
    pub fn as_claimed(mut self, as_claimed: Option<AsClaimed>) -> Complete<'a> {
        self.as_claimed = as_claimed;
        self
    }

    /// The claim that wrote the pending record, as it was sent, when
    /// [`as_claimed`](Complete::as_claimed) says the record is unchanged.
    pub fn claim(&self) -> Option<Claim<'a>> {
        let a = self.as_claimed?;
        Some(
            Claim::new(self.key, self.token, a.lease, a.ttl)
                .fingerprint(self.fingerprint)
                .durability(self.durability),
        )
    }
}

/// One write that ends a claim, as an item of [`Store::finish_batch`]:
/// a [`Store::complete`] or a [`Store::release`].
///
/// ```
/// use idem_core::store::{Finish, Token};
/// let token = Token::random();
/// let op = Finish::Release { key: "idem:charge:42", token: &token };
/// assert_eq!(op.key(), "idem:charge:42");
/// ```
#[derive(Debug, Clone, Copy)]
pub enum Finish<'a> {
    /// [`Store::complete`] of this request.
    Complete(Complete<'a>),
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
    /// use idem_core::store::{Claim, Complete, Finish, Token, ValueKind};
    /// use std::time::Duration;
    /// let token = Token::random();
    /// let claim = Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60));
    /// let op = Finish::Complete(Complete::of_claim(&claim, ValueKind::Json, b"1"));
    /// assert_eq!(op.key(), "k");
    /// ```
    pub fn key(&self) -> &'a str {
        match self {
            Finish::Complete(c) => c.key,
            Finish::Release { key, .. } => key,
        }
    }

    /// The owner token this write acts for.
    pub fn token(&self) -> &'a Token {
        match self {
            Finish::Complete(c) => c.token,
            Finish::Release { token, .. } => token,
        }
    }

    /// Runs this write through the single-key methods of `store`: what the
    /// default [`Store::finish_batch`] does per item.
    pub async fn run_on<S: Store + ?Sized>(&self, store: &S) -> Result<WriteReply, Error> {
        match *self {
            Finish::Complete(c) => store.complete(c).await,
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
/// let claim = Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60));
/// assert_eq!(store.claim(claim).await?, ClaimReply::Acquired { attempt: 1 });
/// assert_eq!(store.release("k", &token).await?, WriteReply::Done);
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
///
/// # A store of your own
///
/// A store implements the four required methods, [`claim`](Store::claim),
/// [`complete`](Store::complete), [`release`](Store::release) and
/// [`extend`](Store::extend). The batch methods default to the single ones,
/// and [`capabilities`](Store::capabilities) to none: a store offers durable
/// steps, operator calls, notifications, durability confirmation or an
/// outbox by implementing [`StepStore`], [`OperatorStore`], [`WatchStore`]
/// or [`DurableStore`] and naming them in its [`Capabilities`]. A store that
/// wraps another forwards `capabilities` too (or implements the
/// capabilities itself, to act on them). It counts leases and TTLs as every
/// store does ([`store_lease`], [`record_ttl`]) and is written with
/// `#[idem_core::async_trait]` (`#[idem::async_trait]` through the facade).
/// This one keeps its records in a map under one lock, which makes each
/// method one atomic step:
///
/// ```
/// use idem_core::store::*;
/// use idem_core::{Error, Fingerprint, Idempotency, Outcome};
/// use std::{collections::HashMap, sync::Mutex, time::{Duration, Instant}};
///
/// enum State { Pending { token: Token, lease_end: Instant, attempt: u32 }, Done(ValueKind, Vec<u8>) }
/// struct Record { state: State, fingerprint: Option<Fingerprint>, expires: Instant }
/// type Map = HashMap<String, Record>;
/// #[derive(Default)]
/// struct MapStore(Mutex<Map>);
///
/// impl MapStore {
///     /// The live records (expired ones dropped), and the time.
///     fn live(&self) -> (std::sync::MutexGuard<'_, Map>, Instant) {
///         let (mut map, now) = (self.0.lock().unwrap_or_else(|p| p.into_inner()), Instant::now());
///         map.retain(|_, r| r.expires > now);
///         (map, now)
///     }
///     /// Runs `write` if `token` holds `key`'s pending record, else says why not.
///     fn owned(&self, key: &str, token: &Token, write: impl FnOnce(&mut Map, Instant)) -> WriteReply {
///         let (mut map, now) = self.live();
///         match map.get(key).map(|r| &r.state) {
///             None => WriteReply::Missing,
///             Some(State::Done(..)) => WriteReply::AlreadyCompleted,
///             Some(State::Pending { token: t, .. }) if t != token => WriteReply::OtherOwner,
///             Some(_) => { write(&mut map, now); WriteReply::Done }
///         }
///     }
/// }
///
/// #[idem_core::async_trait]
/// impl Store for MapStore {
///     async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
///         let (mut map, now) = self.live();
///         let attempt = match map.get(c.key) {
///             None => 1,
///             Some(r) if c.fingerprint.zip(r.fingerprint.as_ref()).is_some_and(|(a, b)| a != b) => {
///                 return Ok(ClaimReply::Mismatch);
///             }
///             Some(Record { state: State::Done(kind, value), fingerprint, expires }) => {
///                 let (kind, value, ttl_left) = (*kind, value.clone().into(), Some(*expires - now));
///                 return Ok(ClaimReply::Completed(Completed { kind, value, fingerprint: *fingerprint, ttl_left }));
///             }
///             // Our own claim, re-sent after its reply was lost.
///             Some(Record { state: State::Pending { token, attempt, .. }, .. }) if token == c.token => *attempt,
///             Some(Record { state: State::Pending { lease_end, .. }, .. }) if *lease_end > now => {
///                 return Ok(ClaimReply::InProgress { retry_after: *lease_end - now });
///             }
///             // The holder's lease ran out: take the key over.
///             Some(Record { state: State::Pending { attempt, .. }, .. }) => attempt + 1,
///         };
///         let fingerprint = c.fingerprint.copied().or(map.get(c.key).and_then(|r| r.fingerprint));
///         let state = State::Pending { token: *c.token, lease_end: now + store_lease(c.lease), attempt };
///         let expires = now + record_ttl(c.ttl, c.lease);
///         map.insert(c.key.to_owned(), Record { state, fingerprint, expires });
///         Ok(ClaimReply::Acquired { attempt })
///     }
///     /// The expiry stays (the result TTL counts from the claim). No outbox
///     /// in its capabilities: `c.outbox` is always empty.
///     async fn complete(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
///         let done = State::Done(c.kind, c.value.to_vec());
///         Ok(self.owned(c.key, c.token, |map, _| if let Some(r) = map.get_mut(c.key) { r.state = done }))
///     }
///     async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
///         Ok(self.owned(key, token, |map, _| drop(map.remove(key))))
///     }
///     async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
///         Ok(self.owned(key, token, |map, now| {
///             if let Some(State::Pending { lease_end, .. }) = map.get_mut(key).map(|r| &mut r.state) {
///                 *lease_end = now + store_lease(lease);
///             }
///         }))
///     }
/// }
///
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MapStore::default()).namespace("shop").build();
/// let charge = || async { Ok::<_, Error>("receipt-7".to_owned()) };
/// assert_eq!(idem.call("charge", "order-7").run_outcome(charge).await?.1, Outcome::Executed);
/// assert_eq!(idem.call("charge", "order-7").run_outcome(charge).await?.1, Outcome::Replayed);
/// # Ok::<(), Error>(()) }).unwrap();
/// ```
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Claims the key for `claim.token`, or reports what holds it, as
    /// durable as [`Claim::durability`] asks.
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error>;

    /// Replaces the caller's pending record by a completed one, with what
    /// [`Complete`] says: the value, its outbox messages in the same step,
    /// confirmed as its durability asks.
    ///
    /// ```
    /// use idem_core::store::{Claim, Complete, MemoryStore, Store, Token, ValueKind, WriteReply};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60));
    /// store.claim(claim).await?;
    /// let done = store.complete(Complete::of_claim(&claim, ValueKind::Json, b"7")).await?;
    /// assert_eq!(done, WriteReply::Done);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error>;

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
    /// let claim = |key, token| Claim::new(key, token, Duration::from_secs(5), Duration::from_secs(60));
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
    /// order, each the reply [`complete`](Store::complete) or
    /// [`release`](Store::release) would give for it, with the same
    /// per-key guarantees as [`claim_batch`](Store::claim_batch).
    ///
    /// The default runs each item through the single methods.
    ///
    /// ```
    /// use idem_core::store::{Claim, Complete, Finish, MemoryStore, Store, Token, ValueKind, WriteReply};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new();
    /// let token = Token::random();
    /// let claim = Claim::new("k", &token, Duration::from_secs(5), Duration::from_secs(60));
    /// store.claim(claim).await?;
    /// let done = Finish::Complete(Complete::of_claim(&claim, ValueKind::Json, b"7"));
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

    /// What this store can do besides the state machine: see
    /// [`Capabilities`]. The default is none of it.
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store};
    /// let store = MemoryStore::new();
    /// assert!(store.capabilities().steps.is_some() && !store.capabilities().outbox);
    /// ```
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
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
