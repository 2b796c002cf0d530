//! The batch driver: a [`Batch`](super::Batch) run as one object rather
//! than as N single calls gathered.
//!
//! Its claims are built straight from the prepared calls and go to the
//! store as one round trip; the bodies that won their key are polled by
//! the batch's own future; the results of the bodies that finish in one
//! poll pass go to the store as one more. Every decision is the single
//! call's ([`Exec::decide`], [`Exec::run_body`], [`Exec::settled`],
//! [`Completion::judge`]): only the driving differs. A call that must wait
//! for another holder, re-send to an unreachable store, run unprotected
//! or store staged outbox messages goes on as a single call from its batch
//! claim's reply, so those rules stay defined once.
//!
//! The round trips are polled by the batch's future too (no task, no
//! wake-up passed on). What a dropped batch leaves behind is what dropped
//! single calls leave: round trips in flight go on in a task of their own
//! and act on their replies for the calls that no longer wait ([`BatchOp::orphaned`]:
//! a won claim is released, a result is still stored); a body dropped
//! mid-run keeps its key until its lease ends, unless it releases on
//! cancel.
//!
//! [`BatchOp::orphaned`]: super::gather::BatchOp::orphaned

use super::Call;
use super::completion::Completion;
use super::exec::{Exec, FirstClaim, Next, Panic, Running};
use super::gather::{Answered, ClaimOp, FinishOp, send_finish_wave, send_wave};
use super::guard::{Turn, detach, free, log_release, release};
use super::is_unavailable;
use super::round_trip::MakeRoundTrip;
use crate::cache::Generation;
use crate::error::Error;
use crate::hook::CallOutcome;
use crate::lease::{Lease, Staged};
use crate::outbox::message::OutboxMessage;
use crate::outcome::Outcome;
use crate::store::{ClaimReply, Store, WriteReply};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tracing::Instrument;

/// A prepared call of the batch.
struct Slot<'a> {
    /// Its place in the batch's replies.
    index: usize,
    exec: Exec<'a>,
    span: tracing::Span,
    /// The cache generation read before its claim.
    seen: Generation,
}

/// A body's result on its way to the store.
struct Storing<T> {
    value: T,
    ran: Outcome,
}

const RELEASE_WHY: &str = "the body returned an error";

/// Where a batch's results go: `each(i, result)` once per call, as soon
/// as the call's result is known (stored, released or refused).
struct Answers<F> {
    each: F,
    answered: Vec<bool>,
}

impl<F> Answers<F> {
    fn give<T, E>(&mut self, index: usize, result: Result<(T, Outcome), E>)
    where
        F: FnMut(usize, Result<(T, Outcome), E>),
    {
        if let Some(answered) = self.answered.get_mut(index) {
            *answered = true;
        }
        (self.each)(index, result);
    }
}

/// Runs `calls`, `body(i)` being the body of the `i`-th, and hands each
/// call's result to `each(i, result)` as soon as it is known, each what the
/// call alone would answer: a slower body never holds back another's.
pub(super) async fn drive<'a, F, Fut, T, E>(
    calls: Vec<Call<'a>>,
    concurrency: Option<usize>,
    round_trips: Option<MakeRoundTrip<'a>>,
    body: F,
    each: impl FnMut(usize, Result<(T, Outcome), E>),
) where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    T: Serialize + DeserializeOwned,
    E: From<Error>,
{
    let Some(first) = calls.first() else {
        return;
    };
    let store = Arc::clone(&first.inner.store);
    let n = calls.len();
    let mut results = Answers {
        each,
        answered: vec![false; n],
    };
    let mut slots: Vec<Slot<'a>> = Vec::with_capacity(n);
    for (index, call) in calls.into_iter().enumerate() {
        match call.open() {
            (span, Ok(exec)) => slots.push(Slot {
                index,
                exec,
                span,
                seen: Generation::default(),
            }),
            (_, Err(refused)) => results.give(index, Err(E::from(refused))),
        }
    }

    // No gate where it could never close: each permit is a budgeted
    // (and so sometimes pending) poll of tokio's.
    let gate = concurrency
        .filter(|&n| n < slots.len())
        .map(|n| Semaphore::new(n.max(1)));
    if gate.is_some() {
        for slot in &mut slots {
            slot.exec.turn = Some(Turn::default());
        }
    }

    // The claims, built straight from the calls: one round trip.
    let sent = Instant::now();
    let mut claims: Vec<ClaimOp> = Vec::with_capacity(slots.len());
    let mut claimed: Vec<usize> = Vec::with_capacity(slots.len());
    let mut alone: Vec<usize> = Vec::new();
    for (k, slot) in slots.iter_mut().enumerate() {
        let exec = &slot.exec;
        if let Some(hit) = &exec.cached {
            results.give(
                slot.index,
                in_scope(&slot.span, || exec.replay(hit)).map_err(E::from),
            );
            continue;
        }
        // A call of a runtime over another store goes on its own.
        // A durable call too: the batch's pipelines confirm nothing.
        if !Arc::ptr_eq(exec.store, &store) || !exec.durability.is_async() {
            alone.push(k);
            continue;
        }
        slot.seen = exec.before_read().await;
        claims.push(ClaimOp {
            key: exec.key.clone(),
            token: exec.token,
            lease: exec.lease,
            ttl: exec.ttl,
            fingerprint: exec.fingerprint,
            want_ttl_left: exec.inner.cache.is_some(),
            keep_steps: false,
        });
        claimed.push(k);
    }
    let replies = if claims.is_empty() {
        Some(Answered::default())
    } else {
        send_wave(Arc::clone(&store), claims).await
    };

    let slots = &slots;
    let (body, gate) = (&body, gate.as_ref());
    let gated = move |k: usize| {
        let slot = &slots[k];
        async move {
            // A free permit is taken without `acquire`, whose poll spends
            // the task's budget and so can leave a body that would end at
            // once pending. Closed only if dropped, which it is not while
            // in use.
            let _permit = match gate {
                Some(g) => match g.try_acquire() {
                    Ok(permit) => Some(permit),
                    Err(_) => g.acquire().await.ok(),
                },
                None => None,
            };
            if let Some(turn) = &slot.exec.turn {
                turn.take();
            }
            body(slot.index).await
        }
    };
    // Anything else goes on as a single call from the batch's reply.
    // `unsent`: the batch's claim may have landed unanswered, and the call
    // claims again on its own; dropped before it does (a sibling's panic
    // unwinds the batch), it frees the key by token, as a single call
    // dropped with its claim in flight does.
    let go_on = |k: usize, first: Option<FirstClaim>, unprotected: Option<Error>, unsent: bool| {
        let slot = &slots[k];
        let exec = &slot.exec;
        let unsent = unsent.then(|| exec.guard());
        async move {
            if let Some(mut unsent) = unsent {
                // From here the call's own claim guards the key.
                unsent.armed = false;
            }
            let result = match unprotected {
                Some(cause) => exec.run_unprotected(|| gated(k), cause).await,
                None => exec.run_from(first, || gated(k)).await,
            };
            (k, result)
        }
        .instrument(slot.span.clone())
    };
    // A result stored on its own: with outbox messages, after its lease
    // was renewed (the finish round trip completes with the claim's bytes,
    // which its record no longer holds), or re-sent after the batch's
    // round trip did not reach the store.
    let store_alone = |k: usize, value: T, messages: Vec<OutboxMessage>, ran: Outcome, renewed| {
        let slot = &slots[k];
        let exec = &slot.exec;
        async move {
            let stored = exec.complete(&value, &messages, slot.seen, renewed).await;
            (k, value, ran, stored)
        }
        .instrument(slot.span.clone())
    };

    let mut bodies = FuturesUnordered::new();
    let mut rest = FuturesUnordered::new();
    let mut ended_early = Vec::new();
    let mut spare = None;
    let mut spare_lease = None;
    // The first polls are this task's: a body that wakes it from one is
    // polled again in `bodies`, with a waker of its own.
    let waker = poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
    match replies {
        Some(replies) => {
            let mut replies = replies.into_iter();
            for &k in &claimed {
                let slot = &slots[k];
                let reply = match replies.next() {
                    Some((_, reply)) => reply,
                    None => {
                        rest.push(go_on(k, None, None, true));
                        continue;
                    }
                };
                let reply = match reply {
                    // Not reached: on its own, with the same token, as a
                    // single call re-sends.
                    Err(e) if is_unavailable(&e) => {
                        rest.push(go_on(k, None, None, true));
                        continue;
                    }
                    reply => reply,
                };
                let next = in_scope(&slot.span, || slot.exec.decide::<T>(reply, sent, slot.seen));
                match next {
                    Next::Execute { attempt } => {
                        // Polled once here, where most bodies end: no task
                        // node, timer or wrapper future for those, and the
                        // box of one that ended holds the next body.
                        let _enter = enter(&slot.span);
                        let (ran, lease) = slot.exec.begin_reusing(attempt, spare_lease.take());
                        let running = slot.exec.body_starts();
                        let body = gated(k);
                        let mut boxed = match spare.take() {
                            Some(mut boxed) => {
                                Pin::set(&mut boxed, body);
                                boxed
                            }
                            None => Box::pin(body),
                        };
                        let cx = &mut Context::from_waker(&waker);
                        match slot.exec.poll_body(boxed.as_mut(), &lease, cx) {
                            Poll::Ready(ended) => {
                                slot.exec.body_ended(running);
                                spare = Some(boxed);
                                ended_early.push((
                                    k,
                                    ran,
                                    lease.take_staged(),
                                    lease.was_extended(),
                                    ended,
                                ));
                                spare_lease = Some(lease);
                            }
                            Poll::Pending => {
                                let rest =
                                    body_goes_on(&slot.exec, k, ran, lease, boxed, running, sent);
                                bodies.push(rest.instrument(slot.span.clone()));
                            }
                        }
                    }
                    Next::Answer(result) => results.give(slot.index, result.map_err(E::from)),
                    Next::Unprotected(cause) => rest.push(go_on(k, None, Some(cause), false)),
                    Next::InProgress { retry_after } => {
                        let first = FirstClaim {
                            sent,
                            seen: slot.seen,
                            reply: Ok(ClaimReply::InProgress { retry_after }),
                        };
                        rest.push(go_on(k, Some(first), None, false));
                    }
                }
            }
        }
        // The round trip's task is gone (no runtime to run it): each call
        // claims on its own.
        None => {
            for &k in &claimed {
                rest.push(go_on(k, None, None, true));
            }
        }
    }
    for k in alone {
        rest.push(go_on(k, None, None, false));
    }

    // Bodies polled here; what finished in one pass goes in one round trip.
    let mut storing: Vec<Option<Storing<T>>> = (0..slots.len()).map(|_| None).collect();
    // A failed body's error, answered once its release is back, as a
    // single call answers: a retry of the key then finds it free.
    let mut failing: Vec<Option<E>> = (0..slots.len()).map(|_| None).collect();
    let mut finishing: Vec<FinishOp> = Vec::new();
    let mut finishing_of: Vec<usize> = Vec::new();
    let mut waves = FuturesUnordered::new();
    let mut alone_stores = FuturesUnordered::new();
    drop(spare);
    let mut ended_early = ended_early.into_iter();
    let mut first_panic: Option<(usize, Panic)> = None;
    let panicked = poll_fn(|cx| {
        loop {
            loop {
                let (k, ran, staged, renewed, ended) = match ended_early.next() {
                    Some(ended) => ended,
                    None if first_panic.is_some() => break,
                    None => match bodies.poll_next_unpin(cx) {
                        Poll::Ready(Some(ended)) => ended,
                        _ => break,
                    },
                };
                let slot: &Slot<'_> = &slots[k];
                let exec = &slot.exec;
                let _enter = enter(&slot.span);
                match ended {
                    Err(panic) => {
                        // Freed by token, as a single call does before the
                        // panic goes on up.
                        detach(
                            "a batch whose body panicked",
                            free(Arc::clone(exec.store), exec.key.clone(), exec.token, false),
                        );
                        exec.report.outcome(CallOutcome::BodyError);
                        // The batch unwinds with its first panic, once the
                        // bodies that had already ended are dealt with.
                        first_panic.get_or_insert((k, panic));
                        continue;
                    }
                    Ok(Err(e)) => {
                        exec.body_failed();
                        finishing.push(FinishOp::Release {
                            key: exec.key.clone(),
                            token: exec.token,
                        });
                        finishing_of.push(k);
                        failing[k] = Some(e);
                    }
                    Ok(Ok(value)) => {
                        let messages = exec.outgoing(staged);
                        if !messages.is_empty() || !exec.as_claimed(renewed) {
                            // The finish round trip carries no messages,
                            // and completes with the claim's bytes.
                            alone_stores.push(store_alone(k, value, messages, ran, renewed));
                            continue;
                        }
                        let (kind, bytes) = exec.encoded(&value);
                        finishing.push(FinishOp::Complete {
                            key: exec.key.clone(),
                            token: exec.token,
                            fingerprint: exec.fingerprint,
                            kind,
                            value: bytes,
                            lease: exec.lease,
                            ttl: exec.ttl,
                        });
                        finishing_of.push(k);
                        storing[k] = Some(Storing { value, ran });
                    }
                }
            }
            if first_panic.is_some() {
                if !finishing.is_empty() {
                    // Sent and not awaited: dropped, the round trip goes
                    // on in a task and stores these results for calls
                    // that no longer wait.
                    drop(send_wave(
                        Arc::clone(&store),
                        std::mem::take(&mut finishing),
                    ));
                }
                // Results stored on their own start before the batch
                // unwinds: once started, a completion dropped with its
                // call goes on in a task of its own, as a single call's
                // does. Unstarted, it would be lost, and the body run
                // again after its lease.
                while let Poll::Ready(Some((k, value, ran, stored))) =
                    alone_stores.poll_next_unpin(cx)
                {
                    let slot = &slots[k];
                    let outcome = in_scope(&slot.span, || slot.exec.settled(ran, stored));
                    results.give(slot.index, Ok((value, outcome)));
                }
                return Poll::Ready(first_panic.take());
            }
            if !finishing.is_empty() {
                let ops = std::mem::take(&mut finishing);
                let of = std::mem::take(&mut finishing_of);
                let round_trip = round_trips.as_ref().and_then(|make| {
                    let done: Vec<usize> = ops
                        .iter()
                        .zip(&of)
                        .filter(|(op, _)| matches!(op, FinishOp::Complete { .. }))
                        .map(|(_, &k)| slots[k].index)
                        .collect();
                    if done.is_empty() { None } else { make(&done) }
                });
                let wave = send_finish_wave(Arc::clone(&store), ops, round_trip);
                waves.push(async move { (of, wave.await) });
            }
            let mut more = false;
            while let Poll::Ready(Some((of, replies))) = waves.poll_next_unpin(cx) {
                let mut replies = replies.unwrap_or_default().into_iter();
                for k in of {
                    let slot = &slots[k];
                    let reply = replies.next();
                    let _enter = enter(&slot.span);
                    match storing[k].take() {
                        Some(done) => match reply {
                            // Not answered, or the store was not reached:
                            // on its own, with re-sends (a re-sent complete
                            // that finds its result is `Done`).
                            None => {
                                alone_stores.push(store_alone(
                                    k,
                                    done.value,
                                    Vec::new(),
                                    done.ran,
                                    false,
                                ));
                                more = true;
                            }
                            Some((_, Err(e))) if is_unavailable(&e) => {
                                alone_stores.push(store_alone(
                                    k,
                                    done.value,
                                    Vec::new(),
                                    done.ran,
                                    false,
                                ));
                                more = true;
                            }
                            Some((op, reply)) => {
                                let exec = &slot.exec;
                                let stored = Completion::judge(reply);
                                // The op came back with the bytes it stored:
                                // they were never copied for the cache.
                                if let FinishOp::Complete { kind, value, .. } = &op {
                                    exec.remember(stored, *kind, value, slot.seen);
                                }
                                let outcome = exec.settled(done.ran, stored);
                                results.give(slot.index, Ok((done.value, outcome)));
                            }
                        },
                        None => {
                            released(&store, &slot.exec, reply.map(|(_, reply)| reply));
                            if let Some(e) = failing[k].take() {
                                results.give(slot.index, Err(e));
                            }
                        }
                    }
                }
            }
            while let Poll::Ready(Some((k, value, ran, stored))) = alone_stores.poll_next_unpin(cx)
            {
                let slot = &slots[k];
                let outcome = in_scope(&slot.span, || slot.exec.settled(ran, stored));
                results.give(slot.index, Ok((value, outcome)));
            }
            while let Poll::Ready(Some((k, result))) = rest.poll_next_unpin(cx) {
                results.give(slots[k].index, result);
            }
            if more || !finishing.is_empty() {
                continue;
            }
            if bodies.is_empty() && waves.is_empty() && alone_stores.is_empty() && rest.is_empty() {
                return Poll::Ready(None);
            }
            return Poll::Pending;
        }
    })
    .await;
    if let Some((k, panic)) = panicked {
        slots[k].exec.report();
        std::panic::resume_unwind(panic);
    }
    for slot in slots {
        slot.exec.report();
    }
    // Every call is answered above; were one not, in flight is the answer
    // that loses nothing (a retry asks the store).
    for index in 0..n {
        if !results.answered[index] {
            tracing::error!(
                "a call of a batch was left unanswered (a defect of idem's batch driver); answered InProgress"
            );
            results.give(
                index,
                Err(E::from(Error::InProgress {
                    retry_after: std::time::Duration::from_secs(1),
                })),
            );
        }
    }
}

/// Enters `span` unless no subscriber takes it: entering a disabled span
/// changes nothing a subscriber sees (`Span::current()` stays the one
/// around it) and costs a message's worth of work.
fn enter(span: &tracing::Span) -> Option<tracing::span::Entered<'_>> {
    (!span.is_disabled()).then(|| span.enter())
}

/// `f` in `span`, entered as [`enter`] enters it.
fn in_scope<R>(span: &tracing::Span, f: impl FnOnce() -> R) -> R {
    let _enter = enter(span);
    f()
}

/// The rest of a body that did not end at its first poll, under its
/// kept-alive lease.
async fn body_goes_on<G: Future>(
    exec: &Exec<'_>,
    k: usize,
    ran: Outcome,
    lease: Lease,
    mut body: Pin<Box<G>>,
    running: Running<'_>,
    sent: Instant,
) -> (usize, Outcome, Vec<Staged>, bool, Result<G::Output, Panic>) {
    let ended = exec
        .body_goes_on(body.as_mut(), &lease, sent, running)
        .await;
    (k, ran, lease.take_staged(), lease.was_extended(), ended)
}

/// A failed body's release came back: tried once more on its own when the
/// store was not reached, as a single call does.
fn released(store: &Arc<dyn Store>, exec: &Exec<'_>, reply: Option<Result<WriteReply, Error>>) {
    match reply {
        Some(Err(e)) if is_unavailable(&e) => resend_release(store, exec),
        None => resend_release(store, exec),
        Some(reply) => log_release(RELEASE_WHY, reply),
    }
}

fn resend_release(store: &Arc<dyn Store>, exec: &Exec<'_>) {
    let (store, key, token) = (Arc::clone(store), exec.key.clone(), exec.token);
    detach("a batch whose body failed", async move {
        release(store.as_ref(), &key, &token, RELEASE_WHY).await;
    });
}
