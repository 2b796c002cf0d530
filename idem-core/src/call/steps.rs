//! Durable steps: a [`run_steps`](super::Call::run_steps) body records
//! each finished step's result in the key's pending record, so a call that
//! takes the key over after a crash (or resumes after a failed step)
//! replays the finished steps instead of running them again.

use super::backoff::{resend, store_backoff};
use crate::error::Error;
use crate::lease::Lease;
use crate::settings::Inner;
use crate::store::{StepRecord, Store, WriteReply};
use crate::token::Token;
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sha2::{Digest, Sha256};
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};

/// The longest step name, in bytes.
pub const MAX_STEP_NAME: usize = 128;

/// What [`Steps::begin_step`] found for a step.
///
/// ```
/// use idem_core::{Error, Idempotency, MemoryStore, StepStart};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let r: Result<String, Error> = idem.call("orders", "o-1").run_steps(async |s| {
///     Ok(match s.begin_step("charge")? {
///         StepStart::Recorded(v) => serde_json::from_slice(&v).unwrap(), // replayed
///         StepStart::Run { key, .. } => {
///             // … run the effect and record its value under `key`, then:
///             s.step_recorded("charge");
///             format!("ran for {key}")
///         }
///         _ => "ran unrecorded".to_owned(), // FailMode::Open
///     })
/// }).await;
/// assert!(r.unwrap().ends_with(":orders:o-1"));
/// # });
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StepStart {
    /// An earlier holder finished the step: its recorded value (serde_json
    /// bytes). Do not run it.
    Recorded(Bytes),
    /// Run the step and record its value in the pending record of `key`
    /// for owner `token` (the store's `save_step`, or its equivalent in the
    /// same transaction as the step's effects).
    Run {
        /// The stored key.
        key: String,
        /// The owner token of this call.
        token: Token,
        /// The largest value to record, in bytes (`max_value_size`).
        max_value_size: usize,
    },
    /// The call runs unprotected (`FailMode::Open`): run the step, record
    /// nothing.
    Unrecorded,
}

/// The steps of one [`run_steps`](super::Call::run_steps) call: run each
/// side effect of the body through [`step`](Steps::step), and its `Ok`
/// value is recorded under the key before the next step starts.
///
/// A call that takes the key over after its holder died (or after a step
/// failed) gets each recorded step's value back without running it, and
/// runs the rest: only the step that was running when the holder died can
/// run twice, and not even that one when it passes
/// [`key`](Steps::key) to a downstream service that honours idempotency
/// keys.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore, Error};
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let total: Result<u32, Error> = idem
///     .call("orders.place", "order-1")
///     .run_steps(async |s| {
///         let hold = s.step("reserve", async || Ok::<_, Error>(3)).await?;
///         let charged = s.step("charge", async || Ok::<_, Error>(hold * 10)).await?;
///         Ok(charged)
///     })
///     .await;
/// assert_eq!(total.unwrap(), 30);
/// # });
/// ```
#[derive(Clone)]
pub struct Steps {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Steps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.lock();
        f.debug_struct("Steps")
            .field("recorded", &state.recorded)
            .field("replayed", &state.replayed)
            .field("abandoned", &state.abandon)
            .finish_non_exhaustive()
    }
}

struct Shared {
    /// `namespace:scope:key` as stored (or the refusal, reported by the
    /// call before any step runs): the base of [`Steps::key`].
    stored_key: String,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    scope: String,
    max_value_size: usize,
    store_retries: usize,
    state: Mutex<State>,
}

/// Where the steps are recorded.
#[derive(Clone)]
enum Mode {
    /// The body has not started (or never will: a replay).
    Waiting,
    /// The call holds the key: steps are recorded in its pending record.
    Held(Arc<Holder>),
    /// The store was unreachable and `FailMode::Open` runs the body
    /// without protection: steps run, nothing is recorded.
    Unprotected,
    /// The body has returned: no more steps.
    Closed,
}

struct Holder {
    store: Arc<dyn Store>,
    key: String,
    token: Token,
    /// The call's lease, flagged lost by its keep-alive.
    lease: Lease,
}

impl Holder {
    fn refuse_if_lost(&self, name: &str) -> Result<(), Error> {
        if self.lease.is_lost() {
            tracing::warn!(
                step = name,
                "the lease was lost before this step began: it does not run here (the new holder runs it)"
            );
            return Err(Error::StepLeaseLost {
                name: name.to_owned(),
            });
        }
        Ok(())
    }
}

struct State {
    mode: Mode,
    /// Steps recorded by earlier holders, by name.
    stored: HashMap<String, Bytes>,
    /// Names used in this run.
    used: HashSet<String>,
    /// Steps in the record: earlier holders' and this run's.
    recorded: usize,
    /// Steps answered from the record without running.
    replayed: usize,
    /// Set by [`Steps::abandon`].
    abandon: bool,
}

impl Steps {
    pub(super) fn new(inner: &Inner, scope: &str, stored_key: Option<&str>) -> Steps {
        Steps {
            shared: Arc::new(Shared {
                stored_key: stored_key.unwrap_or_default().to_owned(),
                scope: scope.to_owned(),
                max_value_size: inner.max_value_size,
                store_retries: inner.store_retries,
                state: Mutex::new(State {
                    mode: Mode::Waiting,
                    stored: HashMap::new(),
                    used: HashSet::new(),
                    recorded: 0,
                    replayed: 0,
                    abandon: false,
                }),
            }),
        }
    }

    /// Whether the key's pending record holds steps (earlier holders' or
    /// this run's): it is then no longer the record the claim wrote.
    pub(super) fn in_record(&self) -> bool {
        self.lock().recorded > 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock; recover anyway.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `effect` once for this call's key and returns its value, or
    /// the value recorded when an earlier holder of the key ran it.
    ///
    /// `Ok(v)` is recorded in the key's pending record (by this call's
    /// owner token only) before this returns, so the next step starts
    /// only once this one is durable. `Err(e)` records nothing and is
    /// returned as it is: let the body return it (`?`), and the call
    /// keeps the finished steps, frees the key at once, and the next call
    /// resumes at this step.
    ///
    /// Errors of idem's own arrive as `E::from(Error)`:
    /// [`Error::DuplicateStep`] and [`Error::InvalidStepName`] (the step
    /// did not run), [`Error::StepLeaseLost`] (another call now holds the
    /// key: stop; the step did not start if the loss was known before it,
    /// as it is once the keep-alive has heard it), [`Error::Codec`] / [`Error::TooLarge`] (its
    /// value cannot be recorded), [`Error::Unavailable`] (the store did not
    /// answer: not recorded, the next holder runs it again).
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore, Error};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let twice: Result<(), Error> = idem.call("s", "k").run_steps(async |s| {
    ///     s.step("a", async || Ok::<_, Error>(1)).await?;
    ///     s.step("a", async || Ok::<_, Error>(2)).await?;
    ///     Ok(())
    /// }).await;
    /// assert!(matches!(twice, Err(Error::DuplicateStep { .. })));
    /// # });
    /// ```
    pub async fn step<V, E, F>(&self, name: &str, effect: F) -> Result<V, E>
    where
        F: AsyncFnOnce() -> Result<V, E>,
        V: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let (mode, stored) = self.begin(name).map_err(E::from)?;
        if let Some(bytes) = stored {
            self.note_replay(name);
            return serde_json::from_slice(&bytes).map_err(|e| {
                E::from(
                    Error::codec(format!(
                        "the recorded value of step `{name}` does not deserialize into the type \
                         asked for (did the step's type change?); forget the key to start over"
                    ))
                    .with_source(e),
                )
            });
        }
        // The keep-alive heard the key is someone else's: its holder runs
        // this step, so starting it here would run it twice.
        if let Mode::Held(holder) = &mode {
            holder.refuse_if_lost(name).map_err(E::from)?;
        }
        let value = effect().await?;
        if let Mode::Held(holder) = mode {
            self.record(&holder, name, &value).await.map_err(E::from)?;
        }
        Ok(value)
    }

    /// Checks the name and claims it for this run; answers where to record
    /// and the value an earlier holder recorded, if any.
    fn begin(&self, name: &str) -> Result<(Mode, Option<Bytes>), Error> {
        if name.is_empty() || name.len() > MAX_STEP_NAME || name.chars().any(char::is_control) {
            return Err(Error::InvalidStepName {
                name: name.chars().take(MAX_STEP_NAME).collect(),
            });
        }
        let mut state = self.lock();
        if matches!(state.mode, Mode::Closed | Mode::Waiting) {
            return Err(Error::StepOutsideRun {
                name: name.to_owned(),
            });
        }
        if !state.used.insert(name.to_owned()) {
            return Err(Error::DuplicateStep {
                name: name.to_owned(),
            });
        }
        let stored = state.stored.get(name).cloned();
        if stored.is_some() {
            state.replayed += 1;
        }
        Ok((state.mode.clone(), stored))
    }

    async fn record<V: Serialize>(
        &self,
        holder: &Holder,
        name: &str,
        value: &V,
    ) -> Result<(), Error> {
        let bytes = serde_json::to_vec(value).map_err(|e| {
            Error::codec(format!(
                "the value of step `{name}` cannot be serialized, so it was not recorded"
            ))
            .with_source(e)
        })?;
        if bytes.len() > self.shared.max_value_size {
            return Err(Error::TooLarge {
                size: bytes.len(),
                limit: self.shared.max_value_size,
            });
        }
        let reply = resend(store_backoff(self.shared.store_retries), "step", || {
            holder
                .store
                .save_step(&holder.key, &holder.token, name, &bytes)
        })
        .await?;
        match reply {
            WriteReply::Done => {
                self.lock().recorded += 1;
                tracing::debug!(step = name, "step recorded");
                Ok(())
            }
            other => {
                tracing::warn!(
                    step = name,
                    ?other,
                    "step ran but this call no longer holds the key: not recorded"
                );
                Err(Error::StepLeaseLost {
                    name: name.to_owned(),
                })
            }
        }
    }

    /// A step found recorded: logged and counted once, whichever API met it.
    fn note_replay(&self, name: &str) {
        tracing::info!(
            step = name,
            "step finished before: its recorded value is returned, it does not run again"
        );
        #[cfg(feature = "metrics")]
        metrics::counter!("idem_step_replays_total", "scope" => self.shared.scope.clone())
            .increment(1);
    }

    /// For a store crate whose steps record together with their effects
    /// (idem-postgres's `step_in_tx`, which records a step in the body's
    /// own transaction): checks and claims `name` for this run, as
    /// [`step`](Steps::step) does first, and says what to do. After a
    /// [`StepStart::Run`] whose record committed, call
    /// [`step_recorded`](Steps::step_recorded).
    ///
    /// ```
    /// use idem_core::{Error, Idempotency, MemoryStore, StepStart};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let r: Result<bool, Error> = idem.call("s", "k").run_steps(async |s| {
    ///     Ok(matches!(s.begin_step("x")?, StepStart::Run { .. }))
    /// }).await;
    /// assert!(r.unwrap());
    /// # });
    /// ```
    pub fn begin_step(&self, name: &str) -> Result<StepStart, Error> {
        let (mode, stored) = self.begin(name)?;
        if let Some(bytes) = stored {
            self.note_replay(name);
            return Ok(StepStart::Recorded(bytes));
        }
        Ok(match mode {
            Mode::Held(h) => {
                h.refuse_if_lost(name)?;
                StepStart::Run {
                    key: h.key.clone(),
                    token: h.token,
                    max_value_size: self.shared.max_value_size,
                }
            }
            _ => StepStart::Unrecorded,
        })
    }

    /// Counts a step that a store crate recorded itself after
    /// [`begin_step`](Steps::begin_step) answered [`StepStart::Run`].
    pub fn step_recorded(&self, name: &str) {
        tracing::debug!(step = name, "step recorded");
        self.lock().recorded += 1;
    }

    /// A stable idempotency key for step `name` of this call, derived from
    /// (namespace, scope, key, step): the same in every process and every
    /// attempt. Pass it to a downstream service that honours idempotency
    /// keys (a payment provider's `Idempotency-Key`), and a step that was
    /// interrupted after the service acted but before its result was
    /// recorded is answered by the service's replay when it runs again:
    /// exactly once across the crash.
    ///
    /// `idem-step-` and 32 hex digits (128 bits of SHA-256), so it fits any
    /// provider's key limit and reveals nothing of the key.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore, Error};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).namespace("shop").build();
    /// let k: Result<String, Error> = idem.call("orders", "o-1").run_steps(async |s| Ok(s.key("charge"))).await;
    /// let k = k.unwrap();
    /// assert!(k.starts_with("idem-step-") && k.len() == 42);
    /// # });
    /// ```
    pub fn key(&self, name: &str) -> String {
        let mut h = Sha256::new();
        h.update(b"idem-step\0");
        h.update(self.shared.stored_key.as_bytes());
        h.update(b"\0");
        h.update(name.as_bytes());
        let digest = h.finalize();
        format!("idem-step-{}", hex::encode(&digest[..16]))
    }

    /// Gives up on this key for good if the body returns `Err`: the
    /// recorded steps are forgotten with the key (a plain release), so the
    /// next call starts over from the first step as a fresh call, instead
    /// of resuming. For a permanent failure (the card was declined, the
    /// order is invalid) whose retry must not reuse the earlier steps'
    /// results. It changes nothing when the body returns `Ok`.
    ///
    /// idem forgets rather than storing the error as the key's result:
    /// `run` never stores errors (a body's `Err` always frees the key), and
    /// an error type need not be serializable; a caller that wants a
    /// permanent answer returns it as an `Ok` value instead.
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore, Error};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let r: Result<(), Error> = idem.call("s", "k").run_steps(async |s| {
    ///     s.step("reserve", async || Ok::<_, Error>(1)).await?;
    ///     s.abandon();
    ///     Err(Error::codec("declined"))
    /// }).await;
    /// assert!(r.is_err());
    /// # });
    /// ```
    pub fn abandon(&self) {
        self.lock().abandon = true;
    }

    /// How many steps of this run were answered from the record instead of
    /// running (0 on a first attempt).
    ///
    /// ```
    /// use idem_core::{Idempotency, MemoryStore, Error};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = Idempotency::builder(MemoryStore::new()).build();
    /// let n: Result<usize, Error> = idem.call("s", "k").run_steps(async |s| Ok(s.replayed())).await;
    /// assert_eq!(n.unwrap(), 0);
    /// # });
    /// ```
    pub fn replayed(&self) -> usize {
        self.lock().replayed
    }

    /// Called by the call once it holds the key, before the body: loads
    /// what earlier holders recorded when this is a takeover.
    pub(super) async fn attach(
        &self,
        store: &Arc<dyn Store>,
        key: &str,
        token: Token,
        attempt: u32,
        lease: Lease,
    ) -> Result<(), Error> {
        let loaded = if attempt > 1 {
            let found = resend(
                store_backoff(self.shared.store_retries),
                "steps read",
                || store.steps(key, &token),
            )
            .await?;
            match found {
                Some(steps) => steps,
                // Taken over again between the claim and this read.
                None => return Err(Error::LeaseLost),
            }
        } else {
            Vec::new()
        };
        let mut state = self.lock();
        state.recorded = loaded.len();
        state.stored = loaded
            .into_iter()
            .map(|StepRecord { name, value }| (name, value))
            .collect();
        if !state.stored.is_empty() {
            tracing::info!(
                recorded = state.stored.len(),
                "resuming a run_steps call: finished steps are replayed, not run again"
            );
        }
        state.mode = Mode::Held(Arc::new(Holder {
            store: Arc::clone(store),
            key: key.to_owned(),
            token,
            lease,
        }));
        Ok(())
    }

    /// The store is unreachable and `FailMode::Open` runs the body: steps
    /// run without being recorded.
    pub(super) fn unprotected(&self) {
        self.lock().mode = Mode::Unprotected;
    }

    /// The body returned: no more steps.
    pub(super) fn close(&self) {
        self.lock().mode = Mode::Closed;
    }

    /// After a failed body: true when the key should keep its steps
    /// (suspend) rather than be released.
    pub(super) fn keep_on_failure(&self) -> bool {
        let state = self.lock();
        state.recorded > 0 && !state.abandon
    }
}
