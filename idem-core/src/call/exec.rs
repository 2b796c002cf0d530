//! The prepared call: claim (waiting out another holder), execute the
//! body, or replay the stored result.

use super::backoff::{resend, store_backoff};
use super::completion::{Completion, Stored};
use super::gather::Tickets;
use super::gather::{ClaimOp, FinishOp};
use super::guard::{KeptOnDrop, ReleaseGuard, Turn, log_release, release};
use super::steps::Steps;
use super::{Observed, is_unavailable, observe};
use crate::cache::Generation;
use crate::codec::{decode_versioned, encode_bytes, marker_error};
use crate::durability::Durability;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::hook::{CallOutcome, Report};
use crate::lease::{Lease, Staged};
use crate::outbox::message::{OutboxMessage, message_id};
use crate::outcome::Outcome;
use crate::settings::{FailMode, Inner};
use crate::store::{Claim, ClaimReply, Completed, KeyWatch, Store, ValueKind, WriteReply};
use crate::token::Token;
use crate::version::ReadRule;
use bytes::Bytes;
use futures_util::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::time::{Instant, sleep, timeout};

/// A prepared call: everything checked, a fresh owner token drawn.
pub(super) struct Exec<'a> {
    pub(super) inner: &'a Inner,
    pub(super) scope: &'a str,
    /// When `run` started, read only when something observes calls.
    pub(super) call_start: Option<Instant>,
    /// What the call ended with, once it has (for the hook and metrics).
    pub(super) report: Report,
    pub(super) store: &'a Arc<dyn Store>,
    pub(super) key: Arc<str>,
    pub(super) token: Token,
    pub(super) ttl: Duration,
    pub(super) lease: Duration,
    pub(super) wait: Option<Duration>,
    pub(super) fingerprint: Option<Fingerprint>,
    /// The local cache's copy of the record, when it had one.
    pub(super) cached: Option<Completed>,
    /// When the call started for the store (before its claim was sent).
    pub(super) started: Option<Instant>,
    /// Whether a call dropped mid-body releases its key (see
    /// [`Call::release_on_cancel`](super::Call::release_on_cancel)).
    pub(super) release_on_cancel: bool,
    /// The copies a won claim, a replay and a result must have before they
    /// are reported; a durable call never joins a batch (`tickets` is
    /// `None`), whose pipelines confirm nothing.
    pub(super) durability: Durability,
    /// The call's places in its [`Batch`](super::Batch), if it is in one.
    pub(super) tickets: Option<Tickets>,
    /// A `run_steps` call's steps.
    pub(super) steps: Option<Steps>,
    /// Its body's turn under its batch's concurrency limit, if it has to
    /// wait for one: dropped before the turn, the call releases its key.
    pub(super) turn: Option<Turn>,
    /// Whether the call's span records anything (a subscriber took it):
    /// without one, no span is entered or recorded into, which costs a
    /// cached replay a sixth of its instructions where tracing's `log`
    /// feature is on.
    pub(super) traced: bool,
    /// The result version the call stores and reads as its own.
    pub(super) result_version: u32,
    /// What it does with a stored result of another version.
    pub(super) version_rule: ReadRule,
}

/// A claim's reply, with when it was sent and the cache generation seen
/// before it.
pub(super) struct FirstClaim {
    pub(super) sent: Instant,
    pub(super) seen: Generation,
    pub(super) reply: Result<ClaimReply, Error>,
}

/// A panicked body's payload.
pub(super) type Panic = Box<dyn std::any::Any + Send>;

/// A body that has started: what it owes its call when it ends
/// ([`Exec::body_ended`]), or, dropped before, when it is cancelled.
pub(super) struct Running<'a> {
    guard: ReleaseGuard<'a>,
    kept: KeptOnDrop<'a>,
    body_start: Option<Instant>,
    #[cfg(feature = "metrics")]
    in_flight: crate::metrics::InFlight<'a>,
}

/// What a call does after a claim's reply ([`Exec::decide`]).
pub(super) enum Next<T> {
    /// The key is ours: run the body (`attempt` > 1 after a takeover).
    Execute { attempt: u32 },
    /// The call's answer: a replay, or an error already reported.
    Answer(Result<(T, Outcome), Error>),
    /// The store is down and the call fails open: run unprotected.
    Unprotected(Error),
    /// Another holder has the key and this call waits.
    InProgress { retry_after: Duration },
}

impl Exec<'_> {
    /// Reports the call once, after all its store work: the hook never runs
    /// inside a round trip, and a slow hook delays only this caller.
    pub(super) fn report(&self) {
        let (Some(start), Some(outcome)) = (self.call_start, self.report.take_outcome()) else {
            return;
        };
        let call = Observed {
            scope: self.scope,
            key: Some(&self.key),
            outcome,
            attempt: self.report.get_attempt(),
            start,
            body: self.report.get_body(),
            steps_replayed: self.steps.as_ref().map_or(0, Steps::replayed),
        };
        observe(self.inner, call);
    }

    /// The claim loop, from a first claim reply already in (`first`, the
    /// batch driver's) or from a claim of its own.
    pub(super) async fn run_from<F, Fut, T, E>(
        &self,
        mut first: Option<FirstClaim>,
        body: F,
    ) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        // Capped so that an absurd wait (`Duration::MAX`) waits "forever"
        // instead of overflowing the clock.
        let give_up_at = self
            .wait
            .map(|w| Instant::now() + w.min(Duration::from_secs(100 * 365 * 86_400)));
        let mut poll = Duration::from_millis(5);
        // Subscribed to the key's changes on the first InProgress, if the
        // store can notify; held (and so subscribed) until the call ends.
        let mut watch: Option<KeyWatch> = None;
        let mut asked = false;
        loop {
            let FirstClaim { sent, seen, reply } = match first.take() {
                Some(first) => first,
                None => {
                    let sent = Instant::now();
                    let seen = self.before_read().await;
                    let reply = self.claim().await;
                    FirstClaim { sent, seen, reply }
                }
            };
            let retry_after = match self.decide(reply, sent, seen) {
                Next::Execute { attempt } => return self.execute(body, attempt, sent, seen).await,
                Next::Answer(result) => return result.map_err(E::from),
                Next::Unprotected(cause) => return self.run_unprotected(body, cause).await,
                Next::InProgress { retry_after } => retry_after,
            };
            let now = Instant::now();
            match give_up_at {
                Some(end) if now < end => {
                    if !asked {
                        asked = true;
                        watch = self.store.watch(&self.key).await;
                        if watch.is_some() {
                            // Subscribed: read again, so a change
                            // between the claim and the subscription
                            // is not missed.
                            poll = NOTIFIED_POLL;
                            continue;
                        }
                    }
                    // Never past the holder's lease (it may have
                    // died, and no one will tell) or our deadline.
                    let nap = poll.min(retry_after).min(end - now);
                    match watch.as_mut().filter(|w| w.is_live()) {
                        // Woken by the holder's complete or release;
                        // the slow poll only covers a lost message.
                        Some(w) => {
                            let _ = timeout(nap, w.changed()).await;
                            poll = (poll * 2).min(NOTIFIED_POLL_MAX);
                        }
                        // Poll fast at first (most bodies are short).
                        None => {
                            sleep(nap).await;
                            poll = (poll * 2).min(Duration::from_millis(250));
                        }
                    }
                }
                _ => return Err(self.fail(Error::InProgress { retry_after })),
            }
        }
    }

    /// What a claim's reply means for this call: the one definition both
    /// drivers (a single call's loop, a batch's) act on.
    pub(super) fn decide<T: DeserializeOwned>(
        &self,
        reply: Result<ClaimReply, Error>,
        sent: Instant,
        seen: Generation,
    ) -> Next<T> {
        if !matches!(reply, Ok(ClaimReply::Acquired { .. })) {
            // Whatever comes next, this call stores nothing with its
            // batch (a later takeover completes on its own).
            self.leave_batch();
        }
        let reply = match reply {
            Ok(reply) => reply,
            Err(e) if self.inner.fail_mode == FailMode::Open && is_unavailable(&e) => {
                return Next::Unprotected(e);
            }
            Err(e) => return Next::Answer(Err(self.fail(e))),
        };
        match reply {
            ClaimReply::Acquired { attempt } => Next::Execute { attempt },
            ClaimReply::Completed(record) => {
                if let Some(cache) = &self.inner.cache {
                    cache.insert(&self.key, record.clone(), sent, seen);
                }
                Next::Answer(self.replay(&record))
            }
            ClaimReply::Mismatch => Next::Answer(Err(self.fail(Error::FingerprintMismatch))),
            // Without a wait, in flight is the answer.
            ClaimReply::InProgress { retry_after } if self.wait.is_none() => {
                Next::Answer(Err(self.fail(Error::InProgress { retry_after })))
            }
            ClaimReply::InProgress { retry_after } => Next::InProgress { retry_after },
        }
    }

    /// Records `field` in the call's span, the current one while it runs.
    pub(super) fn record(&self, field: &str, value: impl tracing::Value) {
        if self.traced {
            tracing::Span::current().record(field, value);
        }
    }

    /// Records the call's outcome; with `otel`, also as the `idem.outcome`
    /// attribute of its OpenTelemetry span.
    pub(super) fn record_outcome(&self, outcome: &'static str) {
        self.record("outcome", outcome);
        #[cfg(feature = "otel")]
        if self.traced {
            crate::otel::attribute(&tracing::Span::current(), "idem.outcome", outcome);
        }
    }

    fn fail<E: From<Error>>(&self, e: Error) -> E {
        self.report.outcome(CallOutcome::of_error(&e));
        self.record_outcome(match e {
            Error::InProgress { .. } => "in_progress",
            Error::FingerprintMismatch => "mismatch",
            _ => "error",
        });
        if !e.is_retryable() || is_unavailable(&e) {
            tracing::warn!(error = %e, "idempotent call failed");
        }
        E::from(e)
    }

    pub(super) fn replay<T: DeserializeOwned>(
        &self,
        record: &Completed,
    ) -> Result<(T, Outcome), Error> {
        if let (Some(given), Some(stored)) = (&self.fingerprint, &record.fingerprint)
            && given != stored
        {
            return Err(self.fail(Error::FingerprintMismatch));
        }
        self.record_outcome("replayed");
        self.report.outcome(CallOutcome::Replayed);
        // Reads only: a record this call cannot read (another version,
        // another shape) is neither released nor rewritten, so the build
        // that wrote it still replays it and no body runs again.
        decode_versioned(
            record,
            self.inner.max_value_size,
            self.result_version,
            &self.version_rule,
        )
        .map(|v| (v, Outcome::Replayed))
        .map_err(|e| self.fail(e))
    }

    /// Before a store read whose record may enter the local cache: the
    /// cache's feed of forgotten keys kept up (one atomic load once it is),
    /// then the invalidations the read could miss, which keep its record
    /// out of the cache if a forget is heard before it returns.
    pub(super) async fn before_read(&self) -> Generation {
        let Some(cache) = &self.inner.cache else {
            return Generation::default();
        };
        self.inner.hear_forgets().await;
        cache.generation(&self.key)
    }

    /// The call's claim request.
    fn claim_request(&self) -> Claim<'_> {
        Claim::new(&self.key, &self.token, self.lease, self.ttl)
            .fingerprint(self.fingerprint.as_ref())
            .want_ttl_left(self.inner.cache.is_some())
            .durability(self.durability)
    }

    /// Claims, re-sending with the same token when the store could not be
    /// reached: the script answers a re-sent claim as the same claim, so a
    /// claim that landed but whose reply was lost is not stranded.
    async fn claim(&self) -> Result<ClaimReply, Error> {
        // Dropped while a claim is in flight: the claim may land anyway, so
        // release by token rather than leave the key to the lease.
        let mut guard = self.guard();
        let batched = match self.tickets.as_ref().and_then(Tickets::take_claim) {
            Some(ticket) => {
                let op = ClaimOp {
                    key: self.key.clone(),
                    token: self.token,
                    lease: self.lease,
                    ttl: self.ttl,
                    fingerprint: self.fingerprint,
                    want_ttl_left: self.inner.cache.is_some(),
                    keep_steps: self.steps.is_some(),
                };
                // Dropped meanwhile, the batch frees the key itself once
                // the claim's reply is in: a release sent now could reach
                // the store ahead of the claim.
                guard.armed = false;
                let reply = ticket.submit(op).await;
                guard.armed = true;
                reply.map(|(_, reply)| reply)
            }
            None => None,
        };
        let result = match batched {
            Some(Ok(reply)) => Ok(reply),
            Some(Err(e)) if !is_unavailable(&e) => Err(e),
            // Not answered, or the store was not reached: on its own, with
            // the same token, as a single call re-sends.
            _ => {
                // The request is made per attempt, not held across the
                // awaits: this future is part of every call's box.
                resend(store_backoff(self.inner.store_retries), "claim", || {
                    self.store.claim(self.claim_request())
                })
                .await
            }
        };
        guard.armed = false;
        if result.is_err() {
            // The last attempt may have landed after all: free the key now
            // rather than leaving it to the lease. Best effort.
            // A run_steps call suspends: a takeover that landed must not
            // delete the steps earlier holders recorded.
            let _ = if self.steps.is_some() {
                self.store.suspend(&self.key, &self.token).await
            } else {
                self.store.release(&self.key, &self.token).await
            };
        }
        result
    }

    pub(super) async fn run_unprotected<F, Fut, T, E>(
        &self,
        body: F,
        cause: Error,
    ) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        tracing::warn!(error = %cause, "store unavailable and FailMode::Open: running the body WITHOUT idempotency protection");
        self.record_outcome("unprotected");
        if let Some(steps) = &self.steps {
            steps.unprotected();
        }
        let result = body().await;
        if let Some(steps) = &self.steps {
            steps.close();
        }
        self.report.outcome(match result {
            Ok(_) => CallOutcome::Unprotected,
            Err(_) => CallOutcome::BodyError,
        });
        result.map(|v| (v, Outcome::Unprotected))
    }

    /// Runs the body under the lease claimed by a claim sent at `claimed`.
    async fn execute<F, Fut, T, E>(
        &self,
        body: F,
        attempt: u32,
        claimed: Instant,
        seen: Generation,
    ) -> Result<(T, Outcome), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: From<Error>,
    {
        let (outcome, lease) = self.begin(attempt);
        if let Some(steps) = &self.steps
            && let Err(e) = steps
                .attach(self.store, &self.key, self.token, attempt, lease.clone())
                .await
        {
            self.leave_batch();
            if !matches!(e, Error::LeaseLost) {
                // Keep what earlier holders recorded for the next call.
                self.suspend("the recorded steps could not be read").await;
            }
            return Err(self.fail(e));
        }
        match self.run_body(body, &lease, claimed).await {
            Err(panic) => {
                self.release_or_suspend("the body panicked").await;
                self.report.outcome(CallOutcome::BodyError);
                self.report();
                std::panic::resume_unwind(panic)
            }
            Ok(Err(e)) => {
                self.body_failed();
                self.release_or_suspend("the body returned an error").await;
                Err(e)
            }
            Ok(Ok(value)) => {
                let messages = self.outgoing(lease.take_staged());
                let stored = self
                    .complete(&value, &messages, seen, lease.was_extended())
                    .await;
                Ok((value, self.settled(outcome, stored)))
            }
        }
    }

    /// A body starts under a won claim: what it is (`Recovered` after a
    /// takeover) and the lease its staged messages and steps go through.
    pub(super) fn begin(&self, attempt: u32) -> (Outcome, Lease) {
        self.begin_reusing(attempt, None)
    }

    /// [`begin`](Exec::begin), its lease made in `spare`'s allocation when
    /// it can be (a lease of an ended body of the same batch).
    pub(super) fn begin_reusing(&self, attempt: u32, spare: Option<Lease>) -> (Outcome, Lease) {
        self.record("attempt", attempt);
        let outcome = if attempt > 1 {
            tracing::warn!(
                attempt,
                "took over a key whose holder stopped renewing its lease; the body runs again"
            );
            Outcome::Recovered
        } else {
            Outcome::Executed
        };
        self.report.attempt(attempt);
        let outbox = self.store.has_outbox();
        let lease = match spare {
            Some(spare) => spare.renewed(outbox),
            None => Lease::with_outbox(outbox),
        };
        (outcome, lease)
    }

    /// Runs the body, its lease kept alive, and times it; a panic comes
    /// back as its payload.
    pub(super) async fn run_body<F, Fut>(
        &self,
        body: F,
        lease: &Lease,
        claimed: Instant,
    ) -> Result<Fut::Output, Panic>
    where
        F: FnOnce() -> Fut,
        Fut: Future,
    {
        let running = self.body_starts();
        let body = std::pin::pin!(body());
        self.body_goes_on(body, lease, claimed, running).await
    }

    /// A body is about to be polled for the first time: its timing, its
    /// in-flight gauge, and what dropping it mid-run does, all held by the
    /// returned [`Running`] until [`body_ended`](Exec::body_ended).
    pub(super) fn body_starts(&self) -> Running<'_> {
        // Dropped mid-body, the call keeps its key (no longer renewed) until
        // the lease ends: the body may have made effects, and releasing would
        // let a redelivery run them again as `Executed`. Only a body declared
        // undone on drop releases at once.
        // A body still waiting for its batch's concurrency turn has done
        // nothing yet: dropped then, its key is released at once.
        let mut guard = self.guard().until_turn(self.turn.as_ref());
        guard.armed = self.release_on_cancel;
        Running {
            guard,
            kept: KeptOnDrop {
                armed: !self.release_on_cancel,
                turn: self.turn.as_ref(),
            },
            body_start: self.call_start.map(|_| Instant::now()),
            #[cfg(feature = "metrics")]
            in_flight: crate::metrics::InFlight::start(&self.inner.metrics),
        }
    }

    /// Polls `body` once as its driver would, in its lease's scope and with
    /// a panic caught; for a batch, whose bodies mostly end at their first
    /// poll and then need no timer, task node or wrapper future.
    pub(super) fn poll_body<Fut: Future>(
        &self,
        body: Pin<&mut Fut>,
        lease: &Lease,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Fut::Output, Panic>> {
        let polled = std::panic::catch_unwind(AssertUnwindSafe(|| {
            crate::lease::sync_scope(lease.clone(), || body.poll(cx))
        }));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }

    /// Drives a started body to its end, its lease kept alive.
    pub(super) async fn body_goes_on<Fut: Future>(
        &self,
        body: Pin<&mut Fut>,
        lease: &Lease,
        claimed: Instant,
        running: Running<'_>,
    ) -> Result<Fut::Output, Panic> {
        let body = crate::lease::scope(lease.clone(), AssertUnwindSafe(body).catch_unwind());
        let result = self.keep_alive(body, lease, claimed).await;
        self.body_ended(running);
        result
    }

    /// The body has finished: timed, and from here on, whatever happens to
    /// its call, the key is never released on the way out.
    pub(super) fn body_ended(&self, running: Running<'_>) {
        let Running {
            mut guard,
            mut kept,
            body_start,
            #[cfg(feature = "metrics")]
            in_flight,
        } = running;
        #[cfg(feature = "metrics")]
        drop(in_flight);
        if let Some(body_start) = body_start {
            let took = body_start.elapsed();
            self.report.body(took);
            #[cfg(feature = "metrics")]
            self.inner.metrics.body(self.scope, took);
        }
        guard.armed = false;
        kept.armed = false;
        if let Some(steps) = &self.steps {
            steps.close();
        }
    }

    /// The body returned `Err`: the call's outcome, before its key is freed.
    pub(super) fn body_failed(&self) {
        self.record_outcome("released");
        self.report.outcome(CallOutcome::BodyError);
    }

    /// The body succeeded and its result was `stored` (or not): the
    /// call's outcome.
    pub(super) fn settled(&self, ran: Outcome, stored: Stored) -> Outcome {
        let outcome = match stored {
            Stored::Yes => ran,
            Stored::LeaseLost => Outcome::LeaseLost,
            Stored::No => Outcome::NotStored,
            Stored::Unconfirmed => Outcome::NotConfirmed,
        };
        self.record_outcome(outcome.as_str());
        self.report.outcome(CallOutcome::from(outcome));
        outcome
    }
}

/// How often a waiter reads the record while the store notifies it: only
/// to cover a lost message (pub/sub is at most once), so slowly; doubled
/// up to [`NOTIFIED_POLL_MAX`]. Without notifications: 5 ms doubling to
/// 250 ms, as most bodies are short.
const NOTIFIED_POLL: Duration = Duration::from_millis(500);
const NOTIFIED_POLL_MAX: Duration = Duration::from_secs(2);

impl Exec<'_> {
    /// Stores the result, re-trying within the lease. The work has happened
    /// either way, so this never turns a success into an error; and if this
    /// future is dropped meanwhile (the caller gave up), the completion
    /// goes on in a task of its own rather than leave the key to run again.
    /// `extended`: a renewal of the lease was sent, so the pending record
    /// may no longer be the one the claim wrote.
    pub(super) async fn complete<T: Serialize>(
        &self,
        value: &T,
        messages: &[OutboxMessage],
        seen: Generation,
        extended: bool,
    ) -> Stored {
        let (kind, value) = self.encoded(value);
        let completion = Completion {
            store: self.store,
            key: &self.key,
            token: self.token,
            fingerprint: self.fingerprint,
            kind,
            value: &value,
            lease: self.lease,
            ttl: self.ttl,
            as_claimed: self.as_claimed(extended),
            messages,
            durability: self.durability,
        };
        // The group's finish pipeline completes without messages, and with
        // the claim's bytes (`Complete::as_claimed`): a call with messages,
        // or whose record changed since its claim (renewed, steps in it),
        // completes on its own, where the store reads the record first.
        let alone = !messages.is_empty() || !completion.as_claimed;
        if alone {
            self.leave_batch();
        }
        let ticket = if alone {
            None
        } else {
            self.tickets.as_ref().and_then(Tickets::take_finish)
        };
        let batched = match ticket {
            Some(ticket) => {
                let op = FinishOp::Complete {
                    key: self.key.clone(),
                    token: self.token,
                    fingerprint: self.fingerprint,
                    kind,
                    value: value.clone(),
                    lease: self.lease,
                    ttl: self.ttl,
                };
                // Dropped meanwhile, the batch re-sends it if it must.
                ticket.submit(op).await.map(|(_, reply)| reply)
            }
            None => None,
        };
        let stored = match batched {
            Some(Ok(reply)) => Completion::judge(Ok(reply)),
            Some(Err(e)) if !is_unavailable(&e) => Completion::judge(Err(e)),
            // Not answered, or the store was not reached: on its own, with
            // re-sends (a re-sent complete that finds its result is `Done`).
            _ => completion.run_to_the_end().await,
        };
        self.remember(stored, kind, &value, seen);
        stored
    }

    /// Whether the call's pending record is still the one its claim wrote,
    /// as far as it knows: no renewal sent (`extended`), no steps saved in
    /// it. Only such a call completes with the claim's bytes
    /// ([`Complete::as_claimed`](crate::store::Complete::as_claimed), a
    /// batch's finish round trip).
    pub(super) fn as_claimed(&self, extended: bool) -> bool {
        !extended && self.steps.as_ref().is_none_or(|s| !s.in_record())
    }

    /// The result as the store keeps it; a result that cannot be stored
    /// (too big, say) is stored as a marker later calls answer with.
    pub(super) fn encoded<T: Serialize>(&self, value: &T) -> (ValueKind, Bytes) {
        let (kind, bytes) = encode_bytes(
            value,
            self.result_version,
            self.inner.max_value_size,
            self.inner.compress_above,
        );
        if let Some(problem) = marker_error(kind, &bytes) {
            tracing::warn!(error = %problem, "the result is returned but cannot be stored; later calls with this key get this error instead of running the body again");
        }
        (kind, bytes)
    }

    /// A result the store took enters the local cache, if there is one.
    pub(super) fn remember(
        &self,
        stored: Stored,
        kind: ValueKind,
        value: &Bytes,
        seen: Generation,
    ) {
        if stored != Stored::Yes {
            return;
        }
        if let (Some(cache), Some(started)) = (&self.inner.cache, self.started) {
            let record = Completed {
                kind,
                value: value.clone(),
                fingerprint: self.fingerprint,
                // The record's TTL runs from the claim, sent after this.
                ttl_left: Some(self.ttl),
            };
            cache.insert(&self.key, record, started, seen);
        }
    }

    /// The staged messages as the store writes them: each with its id, made
    /// from the record key and its name (`topic`, then `topic#1`…).
    pub(super) fn outgoing(&self, staged: Vec<Staged>) -> Vec<OutboxMessage> {
        if staged.is_empty() {
            return Vec::new();
        }
        let mut per_topic: HashMap<&str, u32> = HashMap::new();
        let mut names = Vec::with_capacity(staged.len());
        for m in &staged {
            let n = per_topic.entry(m.topic.as_str()).or_insert(0);
            names.push(match *n {
                0 => m.topic.clone(),
                k => format!("{}#{k}", m.topic),
            });
            *n += 1;
        }
        staged
            .into_iter()
            .zip(names)
            .map(|(m, name)| {
                let message =
                    OutboxMessage::new(message_id(&self.key, &name), m.topic, m.key, m.payload);
                #[cfg(feature = "otel")]
                let message = crate::otel::created(message);
                message
            })
            .collect()
    }

    pub(super) fn guard(&self) -> ReleaseGuard<'_> {
        ReleaseGuard::new(self.store, &self.key, &self.token, self.steps.is_some())
    }

    async fn release(&self, why: &str) {
        if let Some(ticket) = self.tickets.as_ref().and_then(Tickets::take_finish) {
            let op = FinishOp::Release {
                key: self.key.clone(),
                token: self.token,
            };
            match ticket.submit(op).await {
                Some((_, Err(e))) if is_unavailable(&e) => {}
                Some((_, result)) => return log_release(why, result),
                None => {}
            }
        }
        release(self.store.as_ref(), &self.key, &self.token, why).await
    }

    /// After a failed body: a `run_steps` call that recorded steps keeps
    /// them and frees its lease at once (the next call resumes); anything
    /// else releases.
    async fn release_or_suspend(&self, why: &str) {
        match &self.steps {
            Some(steps) if steps.keep_on_failure() => self.suspend(why).await,
            _ => self.release(why).await,
        }
    }

    /// Frees the lease at once but keeps the recorded steps.
    async fn suspend(&self, why: &str) {
        self.leave_batch();
        match self.store.suspend(&self.key, &self.token).await {
            Ok(WriteReply::Done) => {
                tracing::debug!("{why}: lease freed, finished steps kept for the next call")
            }
            Ok(other) => tracing::warn!(?other, "{why}, but the key was no longer ours"),
            Err(e) => {
                tracing::warn!(error = %e, "{why}, and the lease could not be freed: the next call resumes when it expires")
            }
        }
    }

    /// Leaves the batch's finish phase: this call will write nothing more
    /// with it.
    pub(super) fn leave_batch(&self) {
        if let Some(tickets) = &self.tickets {
            tickets.leave_finish();
        }
    }
}
