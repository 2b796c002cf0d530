//! One idempotent call: claim, run the body under a kept-alive lease, then
//! store the result or release the key.

mod backoff;
mod batch;
mod completion;
mod drive;
mod exec;
mod gather;
mod guard;
mod keep_alive;
mod round_trip;
mod steps;

pub use batch::{Batch, CallGroup};
pub use round_trip::{FinishRoundTrip, finish_round_trip};
pub use steps::{MAX_STEP_NAME, StepStart, Steps};

use crate::durability::Durability;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::hook::{CallOutcome, OutcomeEvent, Report, fire};
use crate::outcome::Outcome;
use crate::settings::{Inner, validate_ttl_lease};
use crate::token::Token;
use crate::version::{ReadRule, VersionRule};
use exec::Exec;
use futures_util::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tracing::Instrument;
use tracing::field::Empty;

/// One call of an operation, configured then [`run`](Call::run).
///
/// Made by [`Idempotency::call`](crate::Idempotency::call). Holds no borrow
/// of the key or the fingerprint value: both are rendered at once.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use std::time::Duration;
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let request = ("refund", 500, "EUR");
/// let r: Result<u64, idem_core::Error> = idem
///     .call("payments.refund", "order-9")
///     .ttl(Duration::from_secs(3600))
///     .lease(Duration::from_secs(10))
///     .fingerprint(&request)
///     .wait(Duration::from_secs(5))
///     .run(|| async { Ok(500) })
///     .await;
/// assert_eq!(r.unwrap(), 500);
/// # });
/// ```
#[must_use = "a Call does nothing until `.run(..)` is awaited"]
pub struct Call<'a> {
    inner: &'a Inner,
    scope: &'a str,
    key: Result<Arc<str>, Error>,
    ttl: Duration,
    /// Set for this call; else the builder's, capped at the TTL.
    lease: Option<Duration>,
    wait: Option<Duration>,
    fingerprint: Result<Option<Fingerprint>, Error>,
    /// The body undoes its effects when dropped: a cancelled call releases.
    release_on_cancel: bool,
    /// The builder's, unless set for this call.
    durability: Durability,
    /// Its places in a [`CallGroup`], if it is in one.
    tickets: Option<gather::Tickets>,
    /// The result version it stores and reads as its own.
    result_version: u32,
    /// What it does with a stored result of another version.
    version_rule: ReadRule,
    /// The span its `idem.call` span opens under; else the current one.
    parent: Option<tracing::span::Id>,
}

impl<'a> Call<'a> {
    #[inline]
    pub(crate) fn new(inner: &'a Inner, scope: &'a str, key: Result<Arc<str>, Error>) -> Call<'a> {
        Call {
            inner,
            scope,
            key,
            ttl: inner.result_ttl,
            lease: None,
            wait: inner.wait,
            fingerprint: Ok(None),
            release_on_cancel: false,
            durability: inner.durability,
            tickets: None,
            result_version: 0,
            version_rule: ReadRule::Decode,
            parent: None,
        }
    }

    /// Opens the call's `idem.call` span under `span` rather than under
    /// the span current when the call runs: for calls made for one item
    /// and run together (a [`Batch`](crate::Batch) of a broker's
    /// messages, each with its own span). A disabled `span` changes
    /// nothing.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let message = tracing::info_span!("message", id = 7);
    /// let call = idem.call("s", "k").in_span(&message);
    /// # });
    /// ```
    #[inline]
    pub fn in_span(mut self, span: &tracing::Span) -> Self {
        self.parent = span.id();
        self
    }

    /// The version of this call's result type: the call stores its result
    /// with it, and reads a stored result of another version through its
    /// [`on_other_version`](Call::on_other_version) rule
    /// ([`VersionRule::Decode`] by default). Version 0, the default, stores
    /// exactly the bytes a call without versions stores, so records stored
    /// before versions read as version 0.
    ///
    /// Bump it when the result type's JSON changes in a way its serde
    /// defaults do not cover (a renamed field, a changed enum), and keep
    /// the type readable by the previous build during a rolling deploy
    /// (no `deny_unknown_fields`). A replay never runs the body again and
    /// never rewrites nor releases the record, whatever its version. The
    /// HTTP and gRPC layers store their exchanges as bytes with version 0:
    /// they need none. [`versioned`](Call::versioned) sets the version and
    /// the rule from a type's [`Versioned`](crate::Versioned) impl.
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let _: u32 = idem.call("s", "k").result_version(2).run(|| async { Ok::<_, Error>(7) }).await?;
    /// let info = idem.inspect("s", "k").await?.unwrap();
    /// assert_eq!(info.result_version, Some(2));
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    #[inline]
    pub fn result_version(mut self, version: u32) -> Self {
        self.result_version = version;
        self
    }

    /// What this call does with a stored result whose version is not its
    /// [`result_version`](Call::result_version): decode it as is
    /// ([`VersionRule::Decode`], the default), convert an older one
    /// ([`VersionRule::upgrade`]), or answer [`Error::ResultVersion`]
    /// ([`VersionRule::Reject`]). `T` is the call's result type.
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore, VersionRule};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let _: u32 = idem.call("s", "k").run(|| async { Ok::<_, Error>(7) }).await?;
    /// let r: Result<u32, Error> = idem
    ///     .call("s", "k")
    ///     .result_version(1)
    ///     .on_other_version(VersionRule::<u32>::Reject)
    ///     .run(|| async { Ok(8) })
    ///     .await;
    /// match r {
    ///     Err(Error::ResultVersion { stored, current, raw_json, .. }) => {
    ///         assert_eq!((stored, current, raw_json.as_str()), (0, 1, "7"));
    ///     }
    ///     other => panic!("{other:?}"),
    /// }
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    #[inline]
    pub fn on_other_version<T: Serialize + 'static>(mut self, rule: VersionRule<T>) -> Self {
        self.version_rule = ReadRule::of(rule);
        self
    }

    /// The result version and the rule that `T` declares
    /// ([`Versioned`](crate::Versioned)): `.result_version(T::VERSION)`
    /// and `.on_other_version(T::on_other_version())`.
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore, Versioned};
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Receipt { id: String }
    /// impl Versioned for Receipt { const VERSION: u32 = 3; }
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let _: Receipt = idem.call("s", "k").versioned::<Receipt>()
    ///     .run(|| async { Ok::<_, Error>(Receipt { id: "r-1".into() }) }).await?;
    /// assert_eq!(idem.inspect("s", "k").await?.unwrap().result_version, Some(3));
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    #[inline]
    pub fn versioned<T: crate::Versioned>(self) -> Self {
        self.result_version(T::VERSION)
            .on_other_version(T::on_other_version())
    }

    /// This call's [`Durability`] (overrides the builder's): its claim,
    /// its replay and its result are not reported before the store
    /// confirms the copies asked for. A store that cannot give it fails
    /// the call with [`Error::DurabilityUnsupported`] before anything is
    /// sent.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// use idem_core::Durability;
    /// let d = Durability::replicated(1, std::time::Duration::from_millis(500));
    /// let r: Result<u32, idem_core::Error> = idem.call("s", "k").durability(d).run(|| async { Ok(1) }).await;
    /// // The MemoryStore has no copies to confirm: refused, body not run.
    /// assert!(matches!(r, Err(idem_core::Error::DurabilityUnsupported { .. })));
    /// # });
    /// ```
    #[inline]
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// How long this call's result is replayed (overrides the builder's `result_ttl`).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").ttl(std::time::Duration::from_secs(60));
    /// ```
    #[inline]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// This call's lease (overrides the builder's `lease`). Without it, a
    /// call whose [`ttl`](Call::ttl) is shorter than the builder's lease
    /// uses the TTL as its lease; with it, a lease over the TTL is refused
    /// with [`Error::InvalidConfig`].
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").lease(std::time::Duration::from_secs(5));
    /// ```
    #[inline]
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// When another call holds the key, wait up to `wait` for its result (or
    /// take over if its holder dies) instead of failing at once with
    /// [`Error::InProgress`].
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").wait(std::time::Duration::from_secs(5));
    /// ```
    #[inline]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }

    /// The request's payload: reusing the key with a different payload fails
    /// with [`Error::FingerprintMismatch`] instead of replaying a result that
    /// belongs to another request. Hashed now (canonical JSON, SHA-256).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let a: Result<u32, idem_core::Error> = idem.call("s", "k").fingerprint(&100).run(|| async { Ok(1) }).await;
    /// let b: Result<u32, idem_core::Error> = idem.call("s", "k").fingerprint(&200).run(|| async { Ok(2) }).await;
    /// assert!(matches!(b, Err(idem_core::Error::FingerprintMismatch)));
    /// # });
    /// ```
    pub fn fingerprint<F: Serialize + ?Sized>(mut self, value: &F) -> Self {
        self.fingerprint = Fingerprint::of(value).map(Some);
        self
    }

    /// Declares that this call's body undoes its effects when it is dropped
    /// half-way (a database transaction that rolls back on drop, say), so
    /// that a cancelled call releases its key at once and the next call
    /// runs the body as [`Outcome::Executed`].
    ///
    /// Without it, a call dropped after its body started (an aborted task,
    /// a `select!` that lost, a shutdown) keeps its key: the body may have
    /// made effects, so the key stays in flight, no longer renewed, until
    /// its lease ends, and the next call then runs the body as
    /// [`Outcome::Recovered`] (attempt 2), which a body can check to
    /// reconcile. A call dropped before its body started releases either way.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").release_on_cancel();
    /// # });
    /// ```
    #[inline]
    pub fn release_on_cancel(mut self) -> Self {
        self.release_on_cancel = true;
        self
    }

    /// A fingerprint computed elsewhere (the HTTP layer hashes the request).
    ///
    /// ```
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let call = idem.call("s", "k").fingerprint_raw(idem_core::Fingerprint::of_bytes(b"body"));
    /// ```
    #[inline]
    pub fn fingerprint_raw(mut self, fingerprint: Fingerprint) -> Self {
        self.fingerprint = Ok(Some(fingerprint));
        self
    }

    /// Runs `body` at most once for this key and returns its value, or the
    /// stored value of an earlier run.
    ///
    /// `Err` from the body releases the key (the next call runs again) and
    /// is returned as is. Idempotency failures arrive as `E::from(Error)`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let first: Result<Vec<u8>, idem_core::Error> = idem.call("s", "k").run(|| async { Ok(vec![]) }).await;
    /// let again: Result<Vec<u8>, idem_core::Error> = idem.call("s", "k").run(|| async { Ok(vec![1]) }).await;
    /// assert_eq!(again.unwrap(), Vec::<u8>::new()); // empty values replay too
    /// # });
    /// ```
    pub fn run<F, Fut, T, E>(self, body: F) -> impl Future<Output = Result<T, E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        // `run_with`'s future mapped, not awaited in one of its own: an
        // async wrapper would hold it and the call beside it, and copy it
        // whole into itself when first polled.
        let require_final = self.inner.require_final;
        self.run_with(None, body)
            .map(move |result| final_value(result, require_final))
    }

    /// Like [`run`](Call::run), also saying whether the body ran.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use idem_core::Outcome;
    /// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let (_, o) = idem.call("s", "k").run_outcome(|| async { Ok::<_, idem_core::Error>(()) }).await?;
    /// assert_eq!(o, Outcome::Executed);
    /// let (_, o) = idem.call("s", "k").run_outcome(|| async { Ok::<_, idem_core::Error>(()) }).await?;
    /// assert_eq!(o, Outcome::Replayed);
    /// # Ok::<(), idem_core::Error>(()) }).unwrap();
    /// ```
    pub fn run_outcome<F, Fut, T, E>(self, body: F) -> impl Future<Output = Result<(T, Outcome), E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        // `run_with`'s future itself, not one around it: a future is
        // moved (copied whole) into each one that awaits it.
        self.run_with(None, body)
    }

    /// Runs a body made of durable steps: like [`run`](Call::run), and
    /// each [`Steps::step`] of the body records its `Ok` value under the
    /// key before the next one starts. A call that takes the key over
    /// after a crash ([`Outcome::Recovered`]) gets every finished step's
    /// value back without running it and runs the rest; a body that
    /// returns `Err` keeps its finished steps and frees the key at once,
    /// so the next call resumes at the failed step (unless the body called
    /// [`Steps::abandon`]). The final `Ok` completes the key as `run` does
    /// (the steps are dropped), and replays return it.
    ///
    /// Named beside `run` for what it takes: `run` runs one body once,
    /// `run_steps` runs a body of steps, each at most once.
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let mut fail_email = true;
    /// for _ in 0..2 {
    ///     let r: Result<String, Error> = idem.call("orders.place", "o-7").run_steps(async |s| {
    ///         let charge = s.step("charge", async || Ok::<_, Error>("ch_1".to_owned())).await?;
    ///         s.step("email", async || {
    ///             if std::mem::take(&mut fail_email) { Err(Error::codec("smtp down")) } else { Ok(()) }
    ///         }).await?;
    ///         Ok(charge)
    ///     }).await;
    ///     // First pass: the e-mail fails, the charge stays recorded. Second
    ///     // pass: the charge is replayed, the e-mail runs, the key completes.
    ///     if let Ok(charge) = r { assert_eq!(charge, "ch_1"); }
    /// }
    /// # });
    /// ```
    pub async fn run_steps<F, T, E>(self, body: F) -> Result<T, E>
    where
        F: AsyncFnOnce(&Steps) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let require_final = self.inner.require_final;
        final_value(self.run_steps_outcome(body).await, require_final)
    }

    /// Like [`run_steps`](Call::run_steps), also saying what happened
    /// ([`Outcome::Recovered`] for a call that resumed).
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore, Outcome};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let (v, o) = idem.call("s", "k").run_steps_outcome(async |s| {
    ///     s.step("one", async || Ok::<_, Error>(1)).await
    /// }).await?;
    /// assert_eq!((v, o), (1, Outcome::Executed));
    /// # Ok::<(), Error>(()) }).unwrap();
    /// ```
    pub async fn run_steps_outcome<F, T, E>(self, body: F) -> Result<(T, Outcome), E>
    where
        F: AsyncFnOnce(&Steps) -> Result<T, E>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let steps = Steps::new(self.inner, self.scope, self.key.as_deref().ok());
        let result = self.run_with(Some(steps.clone()), || body(&steps)).await;
        steps.close();
        result
    }

    async fn run_with<F, Fut, T, E>(self, steps: Option<Steps>, body: F) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let (span, exec) = self.open();
        let mut exec = match exec {
            Ok(exec) => exec,
            Err(refused) => return Err(E::from(refused)),
        };
        exec.steps = steps;
        // A local cache hit replays here: the claim loop's future, built
        // and moved into this one only to return at its first poll, was a
        // cached replay's largest copy.
        if let Some(hit) = &exec.cached {
            let _enter = exec.traced.then(|| span.enter());
            let result = exec.replay(hit).map_err(E::from);
            exec.report();
            return result;
        }
        // Boxed: the claim loop's future is most of a call's (2.5 of 2.8 KB
        // in a debug build), and a future holds room for every future it
        // awaits and is copied whole into each one that awaits it. Boxed,
        // the futures above it (the user's own too) carry and copy a
        // pointer, and a cached replay, which never builds it, no room.
        let result = if exec.traced {
            Box::pin(exec.run_from(None, body).instrument(span)).await
        } else {
            Box::pin(exec.run_from(None, body)).await
        };
        exec.report();
        result
    }

    /// The call's span and its prepared state; a call refused before it
    /// reaches the store (bad key, bad settings) is reported here and
    /// comes back as its error.
    fn open(self) -> (tracing::Span, Result<Exec<'a>, Error>) {
        // No subscriber takes INFO spans: no span at all (tracing's `log`
        // feature, which a dependency may turn on, would otherwise have
        // every call build one for the `log` crate).
        let span = if tracing::level_enabled!(tracing::Level::INFO) {
            match self.parent.clone() {
                Some(parent) => tracing::info_span!(
                    parent: parent,
                    "idem.call",
                    scope = self.scope,
                    key = Empty,
                    outcome = Empty,
                    attempt = Empty
                ),
                None => tracing::info_span!(
                    "idem.call",
                    scope = self.scope,
                    key = Empty,
                    outcome = Empty,
                    attempt = Empty
                ),
            }
        } else {
            tracing::Span::none()
        };
        // Clocks are read for the hook and metrics only: with neither,
        // a call costs what it did before they existed.
        let (inner, scope) = (self.inner, self.scope);
        let call_start = inner.observing().then(Instant::now);
        let exec = self.prepare(&span, call_start);
        if let Err(e) = &exec {
            span.record("outcome", "refused");
            #[cfg(feature = "otel")]
            crate::otel::attribute(&span, "idem.outcome", "refused");
            let _enter = span.enter();
            tracing::warn!(error = %e, "idempotent call refused before reaching the store");
            if let Some(start) = call_start {
                let refused = Observed {
                    scope,
                    key: None,
                    outcome: CallOutcome::of_error(e),
                    attempt: None,
                    start,
                    body: None,
                    steps_replayed: 0,
                };
                observe(inner, refused);
            }
        }
        (span, exec)
    }

    fn prepare(self, span: &tracing::Span, call_start: Option<Instant>) -> Result<Exec<'a>, Error> {
        let inner = self.inner;
        if let Some(msg) = &inner.config_error {
            return Err(Error::InvalidConfig(msg.clone()));
        }
        // A user who set only a TTL expects it to work: the builder's lease
        // (30 s by default) yields to it.
        let lease = self.lease.unwrap_or(inner.lease.min(self.ttl));
        validate_ttl_lease(self.ttl, lease).map_err(Error::InvalidConfig)?;
        if !self.durability.is_async() {
            self.durability.validate()?;
            inner.store.check_durability(self.durability)?;
        }
        let key = self.key?;
        let fingerprint = self.fingerprint?;
        if !span.is_disabled() && inner.keys_in_spans {
            let shown = shown_key(inner, &key);
            span.record("key", shown.as_str());
            #[cfg(feature = "otel")]
            crate::otel::attribute(span, "idem.key", shown);
        }
        // A hit in the local cache needs no owner token and no clock: look
        // first, and draw them only for a call that goes to the store.
        // A durable call confirms what it replays: never from the cache.
        let cached = match &inner.cache {
            Some(c) if self.durability.is_async() => c.get(&key),
            _ => None,
        };
        let (token, started) = match cached {
            Some(_) => (Token::UNUSED, None),
            None => (Token::random(), Some(Instant::now())),
        };
        Ok(Exec {
            inner,
            scope: self.scope,
            call_start,
            report: Report::new(),
            store: &inner.store,
            key,
            cached,
            token,
            started,
            ttl: self.ttl,
            lease,
            wait: self.wait,
            fingerprint,
            release_on_cancel: self.release_on_cancel,
            durability: self.durability,
            // A batch's pipelines confirm nothing: a durable call goes alone.
            tickets: self.tickets.filter(|_| self.durability.is_async()),
            steps: None,
            turn: None,
            traced: !span.is_disabled(),
            result_version: self.result_version,
            version_rule: self.version_rule,
        })
    }
}

/// A call's value as the value-only forms answer it: with
/// `require_final`, a value whose outcome is not final becomes the error
/// that says so.
pub(super) fn final_value<T, E: From<Error>>(
    result: Result<(T, Outcome), E>,
    require_final: bool,
) -> Result<T, E> {
    let (value, outcome) = result?;
    match outcome.not_final_error() {
        Some(e) if require_final => Err(E::from(e)),
        _ => Ok(value),
    }
}

/// The key as logs and hooks show it: in clear only with `log_keys`.
pub(crate) fn shown_key(inner: &Inner, key: &str) -> String {
    if inner.log_keys {
        key.to_owned()
    } else {
        key_digest(key)
    }
}

/// A short, stable digest that lets logs correlate a key without showing it.
fn key_digest(key: &str) -> String {
    let f = Fingerprint::of_bytes(key.as_bytes());
    let b = f.as_bytes();
    format!(
        "#{:02x}{:02x}{:02x}{:02x}{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5]
    )
}

/// A finished call, as [`observe`] reports it.
struct Observed<'a> {
    scope: &'a str,
    /// `None` for a call refused before its key was made.
    key: Option<&'a str>,
    outcome: CallOutcome,
    attempt: Option<u32>,
    /// When the call started.
    start: Instant,
    /// How long its body ran, if it ran.
    body: Option<Duration>,
    steps_replayed: usize,
}

/// Reports a finished call to the hook and the metrics.
fn observe(inner: &Inner, call: Observed<'_>) {
    let Observed {
        scope,
        key,
        outcome,
        attempt,
        start,
        body,
        steps_replayed,
    } = call;
    #[cfg(feature = "metrics")]
    inner
        .metrics
        .call(&inner.namespace, scope, outcome, inner.store.name());
    if let Some(hook) = &inner.hook {
        let shown = key.map(|k| shown_key(inner, k));
        let event = OutcomeEvent {
            namespace: &inner.namespace,
            scope,
            key: shown.as_deref(),
            outcome,
            attempt,
            elapsed: start.elapsed(),
            body,
            steps_replayed,
        };
        fire(hook, &event);
    }
}

fn is_unavailable(e: &Error) -> bool {
    matches!(e, Error::Unavailable { .. })
}
