//! Several calls run together, sharing their store round trips.

use super::Call;
use super::gather::{ClaimOp, FinishOp, Gather, Tickets};
use super::round_trip::{FinishRoundTrip, MakeRoundTrip};
use crate::error::Error;
use crate::outcome::Outcome;
use crate::store::Store;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

/// Several [`Call`]s run together: their claims go to the store as one
/// batch ([`Store::claim_batch`](crate::store::Store::claim_batch): one
/// round trip on Redis, one statement on PostgreSQL), the bodies that won
/// their key run concurrently, and their results are stored as one batch
/// ([`Store::finish_batch`](crate::store::Store::finish_batch)).
///
/// A batch is a transport, never a transaction: every call keeps exactly
/// the meaning it has alone ([`Outcome`], fingerprints, waiting, leases
/// kept alive while its body runs, release on `Err`, fail-open), answers
/// its own errors, and a key that comes twice is answered as two calls in
/// that order would be. This is what `idem-consumer` does with each batch
/// a broker hands over.
///
/// Results are never held back for a slower body: those of the bodies
/// that finish together are stored together.
///
/// ```
/// use idem_core::{Batch, Idempotency, MemoryStore, Outcome};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let orders = ["o-1", "o-2", "o-1"];
/// let batch: Batch = orders.iter().map(|o| idem.call("orders.charge", o)).collect();
/// let results = batch
///     .run_outcome(|i| async move { Ok::<_, idem_core::Error>(i * 10) })
///     .await;
/// assert_eq!(results[0].as_ref().ok(), Some(&(0, Outcome::Executed)));
/// assert_eq!(results[1].as_ref().ok(), Some(&(10, Outcome::Executed)));
/// // The second "o-1" found the first one's claim: in flight, not run.
/// assert!(matches!(results[2], Err(idem_core::Error::InProgress { .. })));
/// # });
/// ```
#[must_use = "a Batch does nothing until `.run_outcome(..)` is awaited"]
#[derive(Default)]
pub struct Batch<'a> {
    calls: Vec<Call<'a>>,
    concurrency: Option<usize>,
    round_trips: Option<MakeRoundTrip<'a>>,
}

impl<'a> FromIterator<Call<'a>> for Batch<'a> {
    fn from_iter<I: IntoIterator<Item = Call<'a>>>(iter: I) -> Self {
        Batch {
            calls: iter.into_iter().collect(),
            concurrency: None,
            round_trips: None,
        }
    }
}

/// The calls of a list, in its order, taken as they are: no call is
/// moved (collecting moves each, and a call is a few hundred bytes).
///
/// ```
/// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
/// let calls: Vec<idem_core::Call> = (0..3).map(|k| idem.call("s", k)).collect();
/// let batch = idem_core::Batch::from(calls);
/// assert_eq!(batch.len(), 3);
/// ```
impl<'a> From<Vec<Call<'a>>> for Batch<'a> {
    fn from(calls: Vec<Call<'a>>) -> Self {
        Batch {
            calls,
            concurrency: None,
            round_trips: None,
        }
    }
}

impl<'a> Batch<'a> {
    /// An empty batch.
    ///
    /// ```
    /// let batch = idem_core::Batch::new();
    /// assert!(batch.is_empty());
    /// ```
    pub fn new() -> Batch<'a> {
        Batch::default()
    }

    /// Adds a call; its index in the replies is the number of calls before it.
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let mut batch = idem_core::Batch::new();
    /// batch.push(idem.call("s", "k"));
    /// assert_eq!(batch.len(), 1);
    /// ```
    pub fn push(&mut self, call: Call<'a>) {
        self.calls.push(call);
    }

    /// The number of calls.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// True when there is no call.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// At most `n` bodies run at once (at least 1); by default all of them.
    /// A body waiting for its turn holds its key, its lease kept alive.
    ///
    /// ```
    /// let batch = idem_core::Batch::new().concurrency(16);
    /// ```
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n.max(1));
        self
    }

    /// Sends each round trip that stores results with `make`'s
    /// [`FinishRoundTrip`] instead of the store's
    /// [`finish_batch`](Store::finish_batch): `make` gets the indices of
    /// the calls whose results it stores (bodies that returned `Ok`, in the
    /// order the store gets them) and returns the round trip to send them
    /// with, or `None` for the store's own. The round trip must answer what
    /// `finish_batch` of the same store would, one reply per op, in order.
    /// idem-consumer's Redis Streams adapter sends its acks in the round
    /// trip that stores their results this way (idem-redis's
    /// `RedisStore::finish_batch_then`).
    ///
    /// What a round trip carries besides the writes goes after every one
    /// of them, so a server that executes it has executed those writes
    /// first; and it should run only if every complete of the round trip
    /// is stored by then. A complete that is not (stored alone after the
    /// round trip, or refused) withholds it: the round trip's maker then
    /// sends it itself once the results are stored (idem-redis: the
    /// `rider` script answers `UNSTORED`, or `NOSCRIPT`, instead of running
    /// it). So an ack is never sent before its result is stored.
    ///
    /// ```
    /// use idem_core::store::{MemoryStore, Store};
    /// use idem_core::{Batch, Idempotency, finish_round_trip};
    /// use std::sync::Mutex;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let store = MemoryStore::new(); // a handle: its clones share the records
    /// let idem = Idempotency::builder(store.clone()).build();
    /// let batch: Batch = (0..3).map(|k| idem.call("s", k)).collect();
    /// let asked = Mutex::new(Vec::new());
    /// let values = batch
    ///     .finish_with(|done| {
    ///         asked.lock().unwrap().extend_from_slice(done);
    ///         let store = store.clone();
    ///         // The store's own round trip, and whatever else goes with it.
    ///         Some(finish_round_trip(move |ops| Box::pin(async move { store.finish_batch(ops).await })))
    ///     })
    ///     .run(|i| async move { if i == 1 { Err(idem_core::Error::corrupt("no")) } else { Ok(i) } })
    ///     .await;
    /// assert_eq!(values.len(), 3);
    /// let mut asked = asked.into_inner().unwrap();
    /// asked.sort();
    /// assert_eq!(asked, [0, 2]);
    /// # });
    /// ```
    pub fn finish_with(
        mut self,
        make: impl Fn(&[usize]) -> Option<FinishRoundTrip> + Send + Sync + 'a,
    ) -> Self {
        self.round_trips = Some(Box::new(make));
        self
    }

    /// Runs the calls, `body(i)` being the body of the `i`-th, and returns
    /// what each call's [`Call::run_outcome`] would: one result per call, in
    /// order.
    pub async fn run_outcome<F, Fut, T, E>(self, body: F) -> Vec<Result<(T, Outcome), E>>
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let mut results: Vec<Option<Result<(T, Outcome), E>>> =
            (0..self.calls.len()).map(|_| None).collect();
        self.run_each(body, |i, result| {
            if let Some(slot) = results.get_mut(i) {
                *slot = Some(result);
            }
        })
        .await;
        results
            .into_iter()
            // `run_each` answers every call once.
            .map(|r| {
                r.unwrap_or(Err(E::from(Error::InProgress {
                    retry_after: std::time::Duration::from_secs(1),
                })))
            })
            .collect()
    }

    /// Runs the calls, `body(i)` being the body of the `i`-th, and hands
    /// each call's result to `each(i, result)` as soon as it is known: what
    /// [`Call::run_outcome`] would answer alone, once per call, in the order
    /// the results come: a stored result once its round trip is back, a
    /// failed body's error once its key's release is (a retry of the key
    /// then finds it free), a refusal at once. A caller that acts per call
    /// (a Kafka offset, an ack) never waits for a slower body this way.
    ///
    /// ```
    /// use idem_core::{Batch, Idempotency, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let batch: Batch = ["slow", "fast"].iter().map(|k| idem.call("s", k)).collect();
    /// let mut order = Vec::new();
    /// batch
    ///     .run_each(
    ///         |i| async move {
    ///             if i == 0 {
    ///                 tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    ///             }
    ///             Ok::<_, idem_core::Error>(i)
    ///         },
    ///         |i, result| order.push((i, result.map(|(v, _)| v).ok())),
    ///     )
    ///     .await;
    /// assert_eq!(order, [(1, Some(1)), (0, Some(0))]);
    /// # });
    /// ```
    pub async fn run_each<F, Fut, T, E>(
        self,
        body: F,
        each: impl FnMut(usize, Result<(T, Outcome), E>),
    ) where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        super::drive::drive(self.calls, self.concurrency, self.round_trips, body, each).await
    }

    /// Like [`run_outcome`](Batch::run_outcome), without the outcomes.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let batch: idem_core::Batch = (0..3).map(|k| idem.call("s", k)).collect();
    /// let values = batch.run(|i| async move { Ok::<_, idem_core::Error>(i) }).await;
    /// assert_eq!(values.into_iter().flatten().collect::<Vec<_>>(), [0, 1, 2]);
    /// # });
    /// ```
    pub async fn run<F, Fut, T, E>(self, body: F) -> Vec<Result<T, E>>
    where
        F: Fn(usize) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        // Each call's own runtime's setting: a batch may mix runtimes.
        let require_final: Vec<bool> = self.calls.iter().map(|c| c.inner.require_final).collect();
        self.run_outcome(body)
            .await
            .into_iter()
            .zip(require_final)
            .map(|(r, require_final)| super::final_value(r, require_final))
            .collect()
    }
}

/// Calls started apart that share their store round trips, for a loop
/// that starts its calls one by one (each a future of its own) rather than
/// as a [`Batch`].
///
/// Made by [`Idempotency::group`](crate::Idempotency::group) for `n`
/// calls (or [`Idempotency::group_unbounded`](crate::Idempotency::group_unbounded));
/// each [`Call::in_group`] takes one of the places.
/// The first claims of the calls go to the store together, as one
/// [`Store::claim_batch`](crate::store::Store::claim_batch): those queued
/// by the time all `n` have claimed or given up their place, or by the next
/// scheduler turn; their first completes and releases go together the same
/// way. Places never taken
/// are given up when the group (its last clone) is dropped.
/// A call never waits for a slower one: what is queued goes at the next
/// scheduler turn, so calls ready together are sent together.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore, Outcome};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let group = idem.group(2);
/// let a = idem.call("s", "a").in_group(&group);
/// let b = idem.call("s", "b").in_group(&group);
/// drop(group);
/// // Polled apart (as a loop's FuturesUnordered would), claimed together.
/// let (a, b) = tokio::join!(
///     a.run_outcome(|| async { Ok::<_, idem_core::Error>(1) }),
///     b.run_outcome(|| async { Ok::<_, idem_core::Error>(2) }),
/// );
/// assert_eq!((a.unwrap(), b.unwrap()), ((1, Outcome::Executed), (2, Outcome::Executed)));
/// # });
/// ```
///
/// Clones are the same group: hand one to each future that makes a call.
///
/// **What it costs.** Each shared round trip is sent from a task of its
/// own, and each call gets its reply handed over from that task. Against a
/// store that answers quickly (Redis on the same host), that costs more
/// than the round trips it saves unless the calls wait for CPU: in the
/// gRPC layer's bench a group costs 10–15 % of the calls per second with
/// cores to spare and gains a few hundredths under CPU load
/// (docs/performance.md, "gRPC unary RPCs"), and `idem-grpc` does not
/// group by default. A
/// group pays off when round trips are dear (a far or loaded store); when
/// the calls are known together, a [`Batch`] shares its round trips with
/// none of this. Measure before you adopt one.
#[derive(Clone)]
pub struct CallGroup {
    inner: Arc<Places>,
}

struct Places {
    store: Arc<dyn Store>,
    claims: Arc<Gather<ClaimOp>>,
    finishes: Arc<Gather<FinishOp>>,
    /// Places not yet taken.
    left: Mutex<usize>,
}

impl std::fmt::Debug for CallGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let left = *self
            .inner
            .left
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("CallGroup")
            .field("places_left", &left)
            .finish_non_exhaustive()
    }
}

impl CallGroup {
    /// A group of calls to `store`: `n` places (`usize::MAX`: unbounded),
    /// sent at the next scheduler turn.
    pub(crate) fn for_store(store: Arc<dyn Store>, n: usize) -> CallGroup {
        CallGroup {
            inner: Arc::new(Places {
                claims: Arc::new(Gather::new(Arc::clone(&store), n)),
                finishes: Arc::new(Gather::new(Arc::clone(&store), n)),
                store,
                left: Mutex::new(n),
            }),
        }
    }

    /// A place for a call to `store`, if one is left.
    fn take(&self, store: &Arc<dyn Store>) -> Option<Tickets> {
        let places = &self.inner;
        // A call of a runtime over another store goes on its own.
        if !Arc::ptr_eq(store, &places.store) {
            return None;
        }
        let mut left = places.left.lock().unwrap_or_else(PoisonError::into_inner);
        *left = left.checked_sub(1)?;
        Some(Tickets::new(
            places.claims.ticket(),
            places.finishes.ticket(),
        ))
    }
}

impl Drop for Places {
    fn drop(&mut self) {
        let left = std::mem::take(self.left.get_mut().unwrap_or_else(PoisonError::into_inner));
        if left > usize::MAX / 2 {
            // Unbounded: nothing ever waits for its open places.
            return;
        }
        for _ in 0..left {
            self.claims.leave();
            self.finishes.leave();
        }
    }
}

impl<'a> Call<'a> {
    /// Makes this call a member of `group`: its first claim and its first
    /// complete or release go to the store with those of the group's other
    /// calls. It keeps its meaning exactly. A group with no place left, or
    /// of another store, leaves the call on its own.
    #[inline]
    pub fn in_group(mut self, group: &CallGroup) -> Call<'a> {
        if self.tickets.is_none() {
            self.tickets = group.take(&self.inner.store);
        }
        self
    }
}
