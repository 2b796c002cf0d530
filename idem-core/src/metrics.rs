//! Metrics on the `metrics` facade (feature `metrics`): the application
//! installs an exporter (Prometheus, StatsD, …); idem only records.
//!
//! - `idem_calls_total{namespace, scope, outcome, store}`: one per call,
//!   `outcome` a [`CallOutcome`](crate::CallOutcome) label, `store` the
//!   backend's [`Store::name`] (`redis`, `memory`, `postgres`);
//! - `idem_store_seconds{op, store}`: each store round trip, `op` one of `claim`,
//!   `replay` (a claim that found a completed record), `complete`,
//!   `release`, `extend`;
//! - `idem_body_seconds{scope}`: how long bodies run;
//! - `idem_bodies_in_flight`: bodies running in this process now.
//!
//! Label values are bounded: scopes and namespaces are the program's own
//! names, never keys.

use crate::error::Error;
use crate::hook::CallOutcome;
use crate::store::{
    Capabilities, Claim, ClaimReply, Complete, DurableStore, Finish, StepRecord, StepStore, Store,
    WriteReply,
};
use crate::token::Token;
use async_trait::async_trait;
use metrics::{Counter, Gauge, Histogram, Recorder};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tokio::time::Instant;

/// Handles registered with the recorder in effect, kept: building a label
/// set and looking it up in the recorder's registry on every call cost a
/// replay about a quarter of its throughput. Registered again when another
/// recorder takes effect (installed later, or a thread's local one), told
/// apart by address: like the `metrics` crate's own handles, which stay
/// with the recorder they were registered with, a local recorder dropped
/// and replaced by another at the same address keeps the first's.
#[derive(Default)]
pub(crate) struct Handles {
    cache: RwLock<Cache>,
}

#[derive(Default)]
struct Cache {
    /// The recorder the handles came from (its address).
    recorder: usize,
    // Looked up on every call: SipHash of the scope was half the cost of
    // counting a call.
    calls: HashMap<Box<str>, Vec<(CallOutcome, Counter)>, foldhash::fast::RandomState>,
    bodies: HashMap<Box<str>, Histogram, foldhash::fast::RandomState>,
    in_flight: Option<Gauge>,
    store_ops: Vec<(&'static str, Histogram)>,
}

/// The recorder in effect, by address (the no-op one when none is
/// installed).
fn recorder() -> usize {
    metrics::with_recorder(|r: &dyn Recorder| std::ptr::from_ref(r).cast::<()>() as usize)
}

impl Handles {
    /// Runs `act` on the handle `find` locates, registering it with `make`
    /// when the cache does not hold it for the recorder in effect.
    fn with<H: Clone>(
        &self,
        find: impl Fn(&Cache) -> Option<&H>,
        make: impl FnOnce(&mut Cache) -> H,
        act: impl FnOnce(&H),
    ) {
        let id = recorder();
        {
            let cache = self.cache.read().unwrap_or_else(|e| e.into_inner());
            if cache.recorder == id
                && let Some(h) = find(&cache)
            {
                act(h);
                return;
            }
        }
        let mut cache = self.cache.write().unwrap_or_else(|e| e.into_inner());
        if cache.recorder != id {
            *cache = Cache {
                recorder: id,
                ..Cache::default()
            };
        }
        let h = match find(&cache) {
            Some(h) => h.clone(),
            None => make(&mut cache),
        };
        drop(cache);
        act(&h);
    }

    pub(crate) fn call(
        &self,
        namespace: &str,
        scope: &str,
        outcome: CallOutcome,
        store: &'static str,
    ) {
        self.with(
            |c| {
                let counters = c.calls.get(scope)?;
                counters.iter().find(|(o, _)| *o == outcome).map(|(_, h)| h)
            },
            |c| {
                let h = metrics::counter!(
                    "idem_calls_total",
                    "namespace" => namespace.to_owned(),
                    "scope" => scope.to_owned(),
                    "outcome" => outcome.as_str(),
                    "store" => store
                );
                c.calls
                    .entry(scope.into())
                    .or_default()
                    .push((outcome, h.clone()));
                h
            },
            |h| h.increment(1),
        );
    }

    pub(crate) fn body(&self, scope: &str, took: Duration) {
        self.with(
            |c| c.bodies.get(scope),
            |c| {
                let h = metrics::histogram!("idem_body_seconds", "scope" => scope.to_owned());
                c.bodies.insert(scope.into(), h.clone());
                h
            },
            |h| h.record(took),
        );
    }

    fn in_flight(&self, delta: f64) {
        self.with(
            |c| c.in_flight.as_ref(),
            |c| {
                let h = metrics::gauge!("idem_bodies_in_flight");
                c.in_flight = Some(h.clone());
                h
            },
            |h| h.increment(delta),
        );
    }

    fn store_op(&self, op: &'static str, store: &'static str, took: Duration) {
        self.with(
            |c| c.store_ops.iter().find(|(o, _)| *o == op).map(|(_, h)| h),
            |c| {
                let h = metrics::histogram!("idem_store_seconds", "op" => op, "store" => store);
                c.store_ops.push((op, h.clone()));
                h
            },
            |h| h.record(took),
        );
    }
}

/// Counts a body in flight until dropped (also when the call is cancelled).
pub(crate) struct InFlight<'a>(&'a Handles);

impl InFlight<'_> {
    pub(crate) fn start(handles: &Handles) -> InFlight<'_> {
        handles.in_flight(1.0);
        InFlight(handles)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight(-1.0);
    }
}

/// The runtime's store, timed: each round trip lands in `idem_store_seconds`.
pub(crate) struct Metered {
    store: Arc<dyn Store>,
    handles: Handles,
}

impl Metered {
    pub(crate) fn new(store: Arc<dyn Store>) -> Metered {
        Metered {
            store,
            handles: Handles::default(),
        }
    }

    fn record(&self, op: &'static str, since: Instant) {
        self.handles
            .store_op(op, self.store.name(), since.elapsed());
    }
}

#[async_trait]
impl Store for Metered {
    fn name(&self) -> &'static str {
        self.store.name()
    }

    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let since = Instant::now();
        let reply = self.store.claim(claim).await;
        let op = match reply {
            Ok(ClaimReply::Completed(_)) => "replay",
            _ => "claim",
        };
        self.record(op, since);
        reply
    }

    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.store.complete(complete).await;
        self.record("complete", since);
        reply
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.store.release(key, token).await;
        self.record("release", since);
        reply
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.store.extend(key, token, lease).await;
        self.record("extend", since);
        reply
    }

    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        let since = Instant::now();
        let replies = self.store.claim_batch(claims).await;
        self.record("claim_batch", since);
        replies
    }

    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        let since = Instant::now();
        let replies = self.store.finish_batch(ops).await;
        self.record("finish_batch", since);
        replies
    }

    /// The wrapped store's capabilities; the timed ones (steps, confirm)
    /// through this wrapper, which times them.
    fn capabilities(&self) -> Capabilities<'_> {
        let inner = self.store.capabilities();
        let mut caps = Capabilities::none().outbox(inner.outbox);
        if inner.steps.is_some() {
            caps = caps.steps(self);
        }
        if inner.durable.is_some() {
            caps = caps.durable(self);
        }
        if let Some(operator) = inner.operator {
            caps = caps.operator(operator);
        }
        if let Some(watch) = inner.watch {
            caps = caps.watch(watch);
        }
        if let Some(limit) = inner.max_value_size {
            caps = caps.max_value_size(limit);
        }
        caps
    }
}

#[async_trait]
impl StepStore for Metered {
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.store.save_step(key, token, name, value).await;
        self.record("save_step", since);
        reply
    }

    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let since = Instant::now();
        let reply = self.store.steps(key, token).await;
        self.record("steps", since);
        reply
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.store.suspend(key, token).await;
        self.record("suspend", since);
        reply
    }
}

#[async_trait]
impl DurableStore for Metered {
    fn check_durability(&self, durability: crate::Durability) -> Result<(), Error> {
        self.store.check_durability(durability)
    }

    async fn confirm(&self, key: &str, durability: crate::Durability) -> Result<(), Error> {
        let since = Instant::now();
        let reply = self.store.confirm(key, durability).await;
        self.record("confirm", since);
        reply
    }
}
