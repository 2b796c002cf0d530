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
use crate::fingerprint::Fingerprint;
use crate::hook::CallOutcome;
use crate::store::{
    Claim, ClaimReply, InvalidationSink, KeyWatch, RecordInfo, ScanPage, Store, ValueKind,
    WriteReply,
};
use crate::token::Token;
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

pub(crate) fn call(namespace: &str, scope: &str, outcome: CallOutcome, store: &'static str) {
    metrics::counter!(
        "idem_calls_total",
        "namespace" => namespace.to_owned(),
        "scope" => scope.to_owned(),
        "outcome" => outcome.as_str(),
        "store" => store
    )
    .increment(1);
}

pub(crate) fn body(scope: &str, took: Duration) {
    metrics::histogram!("idem_body_seconds", "scope" => scope.to_owned()).record(took);
}

/// Counts a body in flight until dropped (also when the call is cancelled).
pub(crate) struct InFlight;

impl InFlight {
    pub(crate) fn start() -> InFlight {
        metrics::gauge!("idem_bodies_in_flight").increment(1.0);
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!("idem_bodies_in_flight").decrement(1.0);
    }
}

/// The runtime's store, timed: each round trip lands in `idem_store_seconds`.
pub(crate) struct Metered(pub(crate) Arc<dyn Store>);

impl Metered {
    fn record(&self, op: &'static str, since: Instant) {
        metrics::histogram!("idem_store_seconds", "op" => op, "store" => self.0.name())
            .record(since.elapsed());
    }
}

#[async_trait]
impl Store for Metered {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let since = Instant::now();
        let reply = self.0.claim(claim).await;
        let op = match reply {
            Ok(ClaimReply::Completed(_)) => "replay",
            _ => "claim",
        };
        self.record(op, since);
        reply
    }

    async fn complete(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.0.complete(key, token, fingerprint, kind, value).await;
        self.record("complete", since);
        reply
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.0.release(key, token).await;
        self.record("release", since);
        reply
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let since = Instant::now();
        let reply = self.0.extend(key, token, lease).await;
        self.record("extend", since);
        reply
    }

    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        self.0.inspect(key, with_value).await
    }

    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.0.watch(key).await
    }

    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        self.0.watch_forgotten(prefix, sink).await
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        self.0.forget(key, force).await
    }

    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        self.0.scan(prefix, cursor, count).await
    }
}
