//! `Idempotency`: the configured runtime, its builder and the process default.

use crate::cache::ReplayCache;
use crate::call::{Call, CallGroup};
use crate::durability::Durability;
use crate::error::{Error, KeyPart};
use crate::hook::{Hook, OutcomeEvent};
use crate::key::{push_escaped, shared_storage_key, storage_key, validate_key_part};
use crate::settings::{FailMode, Forgets, Inner, validate_ttl_lease};
use crate::store::Store;
use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The idempotency runtime: a store plus the defaults of every call.
///
/// Cheap to clone (an `Arc`), `Send + Sync`. Build one at startup and share
/// it, or [`install`](Idempotency::install) it as the process default that
/// `#[idempotent]` uses.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore, Outcome};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).namespace("payments").build();
/// let (v, o) = idem.call("charge", "order-1").run_outcome(|| async { Ok::<_, idem_core::Error>(42) }).await?;
/// assert_eq!((v, o), (42, Outcome::Executed));
/// let (v, o) = idem.call("charge", "order-1").run_outcome(|| async { Ok::<_, idem_core::Error>(0) }).await?;
/// assert_eq!((v, o), (42, Outcome::Replayed)); // the body did not run again
/// # Ok::<(), idem_core::Error>(()) }).unwrap();
/// ```
#[derive(Clone)]
pub struct Idempotency {
    pub(crate) inner: Arc<Inner>,
}

impl fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("Idempotency")
            .field("prefix", &i.prefix)
            .field("result_ttl", &i.result_ttl)
            .field("lease", &i.lease)
            .field("fail_mode", &i.fail_mode)
            .field("max_value_size", &i.max_value_size)
            .field("local_cache", &i.cache.is_some())
            .finish_non_exhaustive()
    }
}

static GLOBAL: OnceLock<Idempotency> = OnceLock::new();

impl Idempotency {
    /// Starts a builder over a store.
    ///
    /// ```
    /// let b = idem_core::Idempotency::builder(idem_core::MemoryStore::new());
    /// let idem = b.build();
    /// ```
    pub fn builder<S: Store>(store: S) -> IdempotencyBuilder {
        let store = Arc::new(store);
        IdempotencyBuilder {
            given: Arc::clone(&store) as Arc<dyn Any + Send + Sync>,
            store,
            namespace: "idem".to_owned(),
            result_ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            wait: None,
            fail_mode: FailMode::Closed,
            durability: Durability::Async,
            require_final: None,
            max_value_size: 4 * 1024 * 1024,
            compress_above: None,
            store_retries: 2,
            log_keys: false,
            keys_in_spans: true,
            cache_entries: None,
            hook: None,
        }
    }

    /// The store this runtime was built over, if it is an `S`: for a
    /// crate that offers more than the [`Store`] trait on a store it knows
    /// (idem-consumer's Redis Streams adapter sends its acks in the round
    /// trip that stores results through idem-redis's `RedisStore`). The
    /// store as given to [`builder`](Idempotency::builder), not a wrapper
    /// of it.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// assert!(idem.store_as::<MemoryStore>().is_some());
    /// ```
    pub fn store_as<S: Store>(&self) -> Option<&S> {
        self.inner.given.downcast_ref::<S>()
    }

    /// Starts one call: `scope` names the operation, `key` identifies this
    /// request of it (any `Display`: an order id, a message id, a UUID).
    ///
    /// The key is rendered and checked here; an invalid one is reported by
    /// `run` before anything reaches the store.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let order_id = 1234;
    /// let r: Result<String, idem_core::Error> = idem
    ///     .call("orders.create", &order_id)
    ///     .ttl(std::time::Duration::from_secs(3600))
    ///     .run(|| async { Ok("created".to_owned()) })
    ///     .await;
    /// assert_eq!(r.unwrap(), "created");
    /// # });
    /// ```
    pub fn call<'a, K: fmt::Display>(&'a self, scope: &'a str, key: K) -> Call<'a> {
        let inner = &*self.inner;
        Call::new(
            inner,
            scope,
            shared_storage_key(&inner.prefix, scope, key).map_err(Error::from),
        )
    }

    /// A group for `n` calls started apart (each its own future) that share
    /// their store round trips: see [`CallGroup`].
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let group = idem.group(16);
    /// let call = idem.call("s", "k").in_group(&group);
    /// ```
    pub fn group(&self, n: usize) -> CallGroup {
        CallGroup::for_store(Arc::clone(&self.inner.store), n)
    }

    /// A group that any number of calls may join, for a loop that runs as
    /// long as its service: the calls ready in the same scheduler turn go
    /// to the store together ([`CallGroup`]).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let group = idem.group_unbounded();
    /// let calls = (0..3).map(|k| idem.call("s", k).in_group(&group).run(move || async move { Ok::<_, idem_core::Error>(k) }));
    /// let values = futures_util::future::join_all(calls).await;
    /// assert_eq!(values.into_iter().flatten().sum::<i32>(), 3);
    /// # });
    /// ```
    pub fn group_unbounded(&self) -> CallGroup {
        CallGroup::for_store(Arc::clone(&self.inner.store), usize::MAX)
    }

    /// Counts one more failed run of `(scope, key)` and returns the count so
    /// far: for a caller that gives up on a key after so many failures
    /// (`idem-consumer` dead-letters a message at `max_failures`). The
    /// counter is kept in the store beside the key's record, under a key
    /// of its own ([`failure_key`](crate::store::failure_key)): it survives the
    /// record's release, expires `ttl` after its last failure, is reset by
    /// [`forget`](Idempotency::forget) and never appears in
    /// [`scan`](Idempotency::scan). Concurrent counts are exact: N calls
    /// from anywhere return 1..=N, each once.
    ///
    /// `scope` and `key` are checked and namespaced as in
    /// [`call`](Idempotency::call); a store that cannot count answers
    /// [`Error::Unsupported`].
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// use std::time::Duration;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let day = Duration::from_secs(86_400);
    /// assert_eq!(idem.count_failure("charge", "order-1", day).await?, 1);
    /// assert_eq!(idem.count_failure("charge", "order-1", day).await?, 2);
    /// idem.forget("charge", "order-1").await?;
    /// assert_eq!(idem.count_failure("charge", "order-1", day).await?, 1);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub async fn count_failure<K: fmt::Display>(
        &self,
        scope: &str,
        key: K,
        ttl: Duration,
    ) -> Result<u32, Error> {
        let inner = &*self.inner;
        if let Some(e) = &inner.config_error {
            return Err(Error::InvalidConfig(e.clone()));
        }
        let key = storage_key(&inner.prefix, scope, key)?;
        inner.store.count_failure(&key, ttl).await
    }

    /// Makes this the process-wide default used by `#[idempotent]` without
    /// `using`. Once per process: a second install fails with
    /// [`Error::AlreadyInstalled`].
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// idem.install()?;
    /// assert!(idem_core::Idempotency::global().is_some());
    /// assert!(matches!(idem.install(), Err(idem_core::Error::AlreadyInstalled)));
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn install(&self) -> Result<(), Error> {
        GLOBAL
            .set(self.clone())
            .map_err(|_| Error::AlreadyInstalled)
    }

    /// The default result TTL of this runtime's calls.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// assert_eq!(idem.result_ttl().as_secs(), 86_400);
    /// ```
    pub fn result_ttl(&self) -> Duration {
        self.inner.result_ttl
    }

    /// The default lease of this runtime's calls.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// assert_eq!(idem.lease().as_secs(), 30);
    /// ```
    pub fn lease(&self) -> Duration {
        self.inner.lease
    }

    /// The largest result this runtime stores, in bytes of its serialized
    /// (JSON) form before compression: a larger one is stored as a marker
    /// and later calls get [`Error::TooLarge`]. Layers that store what they
    /// were answered check against it, so they never keep a result the
    /// runtime would refuse.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .max_value_size(64 * 1024)
    ///     .build();
    /// assert_eq!(idem.max_value_size(), 64 * 1024);
    /// ```
    pub fn max_value_size(&self) -> usize {
        self.inner.max_value_size
    }

    /// The installed default, if any.
    ///
    /// ```
    /// // Nothing installed in this doctest's process:
    /// assert!(idem_core::Idempotency::global().is_none());
    /// ```
    pub fn global() -> Option<&'static Idempotency> {
        GLOBAL.get()
    }
}

/// Configures an [`Idempotency`]. Every setting has a default; see each method.
///
/// Settings that cannot work (a zero TTL, a lease longer than the TTL, a
/// bad namespace) do not panic: every call then fails with
/// [`Error::InvalidConfig`] naming the setting.
///
/// ```
/// use idem_core::{FailMode, Idempotency, MemoryStore};
/// use std::time::Duration;
/// let idem = Idempotency::builder(MemoryStore::new())
///     .namespace("payments")
///     .result_ttl(Duration::from_secs(86_400))
///     .lease(Duration::from_secs(30))
///     .fail_mode(FailMode::Closed)
///     .build();
/// ```
#[must_use]
pub struct IdempotencyBuilder {
    store: Arc<dyn Store>,
    /// The same store as given, for [`Idempotency::store_as`].
    given: Arc<dyn Any + Send + Sync>,
    namespace: String,
    result_ttl: Duration,
    lease: Duration,
    wait: Option<Duration>,
    fail_mode: FailMode,
    durability: Durability,
    require_final: Option<bool>,
    max_value_size: usize,
    compress_above: Option<usize>,
    store_retries: usize,
    log_keys: bool,
    keys_in_spans: bool,
    cache_entries: Option<u64>,
    hook: Option<Hook>,
}

impl IdempotencyBuilder {
    /// Prefix of every stored key (default `"idem"`): one per service, so
    /// services sharing a Redis never see each other's records.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).namespace("orders").build();
    /// ```
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// How long a completed result is replayed (default 24 h, at most a year).
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .result_ttl(std::time::Duration::from_secs(3600)).build();
    /// ```
    pub fn result_ttl(mut self, ttl: Duration) -> Self {
        self.result_ttl = ttl;
        self
    }

    /// How long a claim holds without renewal (default 30 s, at most a day).
    /// While the body runs the lease is renewed about every third of it; a
    /// holder that crashes or freezes loses the key after at most this long.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .lease(std::time::Duration::from_secs(10)).build();
    /// ```
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Default for [`Call::wait`](crate::Call::wait): how long a duplicate
    /// waits for an in-flight call's result (default: not at all).
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .wait(std::time::Duration::from_secs(2)).build();
    /// ```
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// What to do when the store is unreachable (default [`FailMode::Closed`]).
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .fail_mode(idem_core::FailMode::Open).build();
    /// ```
    pub fn fail_mode(mut self, mode: FailMode) -> Self {
        self.fail_mode = mode;
        self
    }

    /// Every call's [`Durability`] (default [`Durability::Async`]; a call
    /// overrides it with [`Call::durability`]). With more than `Async`, a
    /// claim is not reported won, a replay not returned and a result not
    /// reported stored until the store confirms the copies; see
    /// docs/semantics.md ("Durability") for what happens when they do not
    /// come in time. A store that cannot give it makes every call fail with
    /// [`Error::DurabilityUnsupported`]; [`try_build`](IdempotencyBuilder::try_build)
    /// says so at startup.
    ///
    /// ```
    /// use idem_core::{Durability, Idempotency, MemoryStore};
    /// use std::time::Duration;
    /// let built = Idempotency::builder(MemoryStore::new())
    ///     .durability(Durability::replicated(1, Duration::from_millis(500)))
    ///     .try_build();
    /// // The MemoryStore keeps no copies: refused at startup, not weakened.
    /// assert!(matches!(built, Err(idem_core::Error::DurabilityUnsupported { .. })));
    /// ```
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// Whether [`Call::run`], [`Call::run_steps`], [`Batch::run`](crate::Batch::run)
    /// and `#[idempotent]` answer a value whose [`Outcome`](crate::Outcome)
    /// is not [final](crate::Outcome::is_final) with an error instead of
    /// `Ok(v)`: [`Outcome::NotConfirmed`](crate::Outcome::NotConfirmed) with
    /// [`Error::NotConfirmed`] (`op` `"complete"`),
    /// [`Outcome::NotStored`](crate::Outcome::NotStored) with
    /// [`Error::Unavailable`] (`op` `"complete"`) and
    /// [`Outcome::LeaseLost`](crate::Outcome::LeaseLost) with
    /// [`Error::LeaseLost`]. `Unprotected` stays `Ok` (`FailMode::Open` asked
    /// for it), and the `_outcome` forms always return the value with its
    /// outcome.
    ///
    /// Default: on when the builder's [`durability`](IdempotencyBuilder::durability)
    /// is not [`Durability::Async`], off otherwise. Each of these errors is
    /// retryable: call again with the same key, and the retry replays the
    /// stored result (or runs the body again if none was kept).
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// let idem = Idempotency::builder(MemoryStore::new()).require_final(true).build();
    /// # let _ = idem;
    /// ```
    pub fn require_final(mut self, on: bool) -> Self {
        self.require_final = Some(on);
        self
    }

    /// Largest serialized result stored, in bytes (default 4 MiB).
    ///
    /// A larger result is returned to the call that produced it but not
    /// stored: later calls get [`Error::TooLarge`] instead of running the
    /// body again. A store with a limit of its own
    /// ([`Capabilities::max_value_size`](crate::store::Capabilities::max_value_size):
    /// DynamoDB's 400 KB item) lowers it to that limit; the runtime's
    /// [`Idempotency::max_value_size`] says what is in force.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .max_value_size(64 * 1024).build();
    /// ```
    pub fn max_value_size(mut self, bytes: usize) -> Self {
        self.max_value_size = bytes;
        self
    }

    /// Compresses results larger than `threshold` bytes with LZ4 (default
    /// off). Pays off for large, repetitive JSON; see docs/performance.md.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new())
    ///     .compress_above(1024).build();
    /// ```
    pub fn compress_above(mut self, threshold: usize) -> Self {
        self.compress_above = Some(threshold);
        self
    }

    /// How many times a claim that failed to reach the store is re-sent
    /// (same owner token, so safe) before the call fails (default 2).
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).store_retries(4).build();
    /// ```
    pub fn store_retries(mut self, retries: usize) -> Self {
        self.store_retries = retries;
        self
    }

    /// Keeps up to `max_entries` completed results in this process, so a hot
    /// key replays with no round trip (default off). In-flight records are
    /// never cached, and an entry is never served past its record's TTL
    /// (counted from when the request that read it was sent).
    ///
    /// An [`Idempotency::forget`] in any process drops the key from every
    /// process's cache: `forget` publishes it on the namespace's channel,
    /// which each process with a cache subscribes to (Redis: one sharded
    /// channel `<namespace>::forgotten` per namespace; `MemoryStore`: every
    /// `Idempotency` on clones of the store). The cache is used only while
    /// that feed is confirmed live: nothing enters it and nothing is served
    /// from it before the subscription is heard, nor while the subscriber
    /// connection is down (calls then read the store), and it starts again
    /// empty when the connection is back. The subscription is kept up by a
    /// task of its own (retried every 2 s while it fails, renewed every
    /// 5 s), not by calls, since a cache hit makes no store call. A store
    /// that cannot deliver forgets (PostgreSQL, a store made with
    /// `RedisStore::from_manager`, a user the ACL refuses `SSUBSCRIBE`)
    /// therefore caches nothing, and says so in a warning. A record lost
    /// otherwise (a fail-over, a restart, a forget whose publish was
    /// refused) replays from a copy until the record's TTL ends at the
    /// latest.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).local_cache(10_000).build();
    /// ```
    pub fn local_cache(mut self, max_entries: u64) -> Self {
        self.cache_entries = Some(max_entries);
        self
    }

    /// Records keys in clear in tracing spans (default off: spans carry a
    /// short hash of the key, since keys may be personal data).
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).log_keys(true).build();
    /// ```
    pub fn log_keys(mut self, on: bool) -> Self {
        self.log_keys = on;
        self
    }

    /// Whether spans carry the call's key at all (default on: its short
    /// hash, or the key with [`log_keys`](Self::log_keys)). Off, neither the
    /// `key` field nor the `idem.key` OpenTelemetry attribute is recorded:
    /// the hash of a key drawn from few values (a phone number, an account
    /// number) can be reversed by trying them all.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).keys_in_spans(false).build();
    /// ```
    pub fn keys_in_spans(mut self, on: bool) -> Self {
        self.keys_in_spans = on;
        self
    }

    /// Calls `hook` once per call when it ends, with its scope, hashed key,
    /// [`CallOutcome`](crate::CallOutcome), attempt and durations: for
    /// successes and for every error (`InProgress`, mismatches, an
    /// unreachable store, a body's `Err`, …). It runs after the call's
    /// store work, on the caller's task, so keep it short (count, log,
    /// send to a channel). A hook that panics is caught and logged; the
    /// call's result is unaffected. A call whose future is dropped before
    /// it ends reports nothing.
    ///
    /// ```
    /// use idem_core::{CallOutcome, Error, Idempotency, MemoryStore};
    /// use std::sync::atomic::{AtomicUsize, Ordering};
    /// use std::sync::Arc;
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let replays = Arc::new(AtomicUsize::new(0));
    /// let count = replays.clone();
    /// let idem = Idempotency::builder(MemoryStore::new())
    ///     .on_outcome(move |e| if e.outcome == CallOutcome::Replayed { count.fetch_add(1, Ordering::Relaxed); })
    ///     .build();
    /// for _ in 0..3 {
    ///     let _: u8 = idem.call("charge", "k").run(|| async { Ok::<_, Error>(1) }).await?;
    /// }
    /// assert_eq!(replays.load(Ordering::Relaxed), 2);
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    pub fn on_outcome<F>(mut self, hook: F) -> Self
    where
        F: Fn(&OutcomeEvent<'_>) + Send + Sync + 'static,
    {
        self.hook = Some(std::sync::Arc::new(hook));
        self
    }

    /// Finishes the configuration.
    ///
    /// ```
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let again = idem.clone(); // shares the same store
    /// ```
    pub fn build(self) -> Idempotency {
        self.build_checked().0
    }

    /// [`build`](IdempotencyBuilder::build), failing at once where `build`
    /// would fail every call: [`Error::InvalidConfig`] for a bad setting,
    /// [`Error::DurabilityUnsupported`] for a durability the store cannot
    /// give (checked without a round trip: a store learns what its server
    /// can do when it connects).
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore};
    /// let idem = Idempotency::builder(MemoryStore::new()).namespace("orders").try_build()?;
    /// let bad = Idempotency::builder(MemoryStore::new()).namespace("").try_build();
    /// assert!(matches!(bad, Err(idem_core::Error::InvalidConfig(_))));
    /// # Ok::<(), idem_core::Error>(())
    /// ```
    pub fn try_build(self) -> Result<Idempotency, Error> {
        let (idem, durability) = self.build_checked();
        if let Some(msg) = &idem.inner.config_error {
            return Err(Error::InvalidConfig(msg.clone()));
        }
        durability?;
        Ok(idem)
    }

    /// The runtime, and whether its store can give its durability.
    fn build_checked(self) -> (Idempotency, Result<(), Error>) {
        let durability = self
            .durability
            .validate()
            .and_then(|()| self.store.check_durability(self.durability));
        let config_error = validate_ttl_lease(self.result_ttl, self.lease)
            .err()
            .or_else(|| {
                validate_key_part(KeyPart::Namespace, &self.namespace)
                    .err()
                    .map(|e| e.to_string())
            })
            .or_else(|| {
                (self.max_value_size == 0)
                    .then(|| "max_value_size is 0: nothing could be stored".to_owned())
            });
        // A store with a value limit of its own (DynamoDB's item size)
        // lowers the builder's: a larger result becomes the too-large
        // marker instead of a write the store refuses.
        let max_value_size = match self.store.capabilities().max_value_size {
            Some(limit) => self.max_value_size.min(limit),
            None => self.max_value_size,
        };
        let mut prefix = String::with_capacity(self.namespace.len() + 1);
        push_escaped(&mut prefix, &self.namespace);
        prefix.push(':');
        #[cfg(feature = "metrics")]
        let store: Arc<dyn Store> = Arc::new(crate::metrics::Metered::new(self.store));
        #[cfg(not(feature = "metrics"))]
        let store = self.store;
        let cache = self.cache_entries.map(ReplayCache::new);
        let invalidation = cache
            .as_ref()
            .map(|c| Forgets::new(Arc::clone(&store), prefix.clone(), c));
        let idem = Idempotency {
            inner: Arc::new(Inner {
                store,
                given: self.given,
                namespace: self.namespace,
                prefix,
                result_ttl: self.result_ttl,
                lease: self.lease,
                wait: self.wait,
                fail_mode: self.fail_mode,
                durability: self.durability,
                require_final: self.require_final.unwrap_or(!self.durability.is_async()),
                max_value_size,
                compress_above: self.compress_above,
                store_retries: self.store_retries,
                log_keys: self.log_keys,
                keys_in_spans: self.keys_in_spans,
                cache,
                invalidation,
                config_error,
                hook: self.hook,
                #[cfg(feature = "metrics")]
                metrics: crate::metrics::Handles::default(),
            }),
        };
        (idem, durability)
    }
}
