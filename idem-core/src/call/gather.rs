//! Sharing store round trips between calls started apart, the members of
//! a [`CallGroup`](super::CallGroup): each call's first claim, and its
//! first complete or release, wait for the group's other calls and go to
//! the store together, as one [`Store::claim_batch`] or
//! [`Store::finish_batch`]. (A [`Batch`](super::Batch) is one object and
//! needs none of this: its driver, `drive.rs`, builds its round trips
//! itself and sends them with [`send_wave`].)
//!
//! Every call holds one ticket per phase. A call that submits an operation
//! spends its ticket; a call that will not (a cache hit, a refusal, a body
//! that failed before the phase) drops it. Once no ticket is left open, the
//! queued operations are sent at once; otherwise one scheduler turn after
//! the first was queued. The calls ready together (bodies that finished
//! together) go together, and a result is never held back for a slower
//! sibling body, so a crash between a body's end and its stored result
//! costs no more runs than it does for a single call.
//!
//! The send itself runs in a task of its own: a call dropped while its
//! operation is queued or in flight (the batch cancelled at shutdown) still
//! has it sent, and the reply it no longer waits for is acted on for it
//! ([`BatchOp::orphaned`]), after the reply: a complete that did not reach
//! the store is re-sent as a single call's detached completion is, and a
//! claim that landed is released by token, never ahead of the claim itself.

use super::completion::{Completion, Detached};
use super::guard::{detach, free, log_release};
use super::is_unavailable;
use super::round_trip::FinishRoundTrip;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::store::{AsClaimed, Claim, ClaimReply, Complete, Finish, Store, ValueKind, WriteReply};
use crate::token::Token;
use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::oneshot;

/// One kind of batched store operation, owned so that it can be sent from
/// a task of its own.
pub(super) trait BatchOp: Send + Sized + 'static {
    type Reply: Send + 'static;

    /// Sends `ops` as one batch; each op back with its reply, in order.
    fn send(store: Arc<dyn Store>, ops: Vec<Self>) -> Sent<Self>;

    /// Acts on the reply to `op` for a call that no longer waits for it
    /// (its future was dropped): what the call would have done next that
    /// must not be left undone, in a task of its own.
    fn orphaned(store: Arc<dyn Store>, op: Self, reply: Self::Reply);
}

/// A call's first claim.
pub(super) struct ClaimOp {
    pub(super) key: Arc<str>,
    pub(super) token: Token,
    pub(super) lease: Duration,
    pub(super) ttl: Duration,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) want_ttl_left: bool,
    /// A `run_steps` call: a claim it gives up is suspended, not released,
    /// so that the steps of the record it may have taken over are kept.
    pub(super) keep_steps: bool,
}

impl BatchOp for ClaimOp {
    type Reply = Result<ClaimReply, Error>;

    fn send(store: Arc<dyn Store>, ops: Vec<Self>) -> Sent<Self> {
        Box::pin(async move {
            let claims: Vec<Claim<'_>> = ops
                .iter()
                .map(|op| {
                    Claim::new(&op.key, &op.token, op.lease, op.ttl)
                        .fingerprint(op.fingerprint.as_ref())
                        .want_ttl_left(op.want_ttl_left)
                })
                .collect();
            let replies = store.claim_batch(&claims).await;
            drop(claims);
            Answered { ops, replies }
        })
    }

    /// A claim that won its key, or that may have landed unanswered, is
    /// freed by token now that its reply is in: sent after the claim's
    /// round trip, the release cannot reach the store ahead of it (on a
    /// pool of connections it could, sent at the drop).
    fn orphaned(store: Arc<dyn Store>, op: ClaimOp, reply: Self::Reply) {
        let landed = match &reply {
            Ok(ClaimReply::Acquired { .. }) => true,
            Err(e) => is_unavailable(e),
            Ok(_) => false,
        };
        if landed {
            detach(
                "a batch dropped while its claim was in flight",
                free(store, op.key, op.token, op.keep_steps),
            );
        }
    }
}

/// A call's first complete (its body succeeded) or release (it failed).
pub(super) enum FinishOp {
    Complete {
        key: Arc<str>,
        token: Token,
        fingerprint: Option<Fingerprint>,
        kind: ValueKind,
        value: Bytes,
        /// The call's lease: a re-sent complete gives up after half of it.
        lease: Duration,
        /// The claim's TTL (with the lease, what its pending record holds).
        ttl: Duration,
    },
    Release {
        key: Arc<str>,
        token: Token,
    },
}

impl BatchOp for FinishOp {
    type Reply = Result<WriteReply, Error>;

    fn send(store: Arc<dyn Store>, ops: Vec<Self>) -> Sent<Self> {
        FinishOp::send_with(store, ops, None)
    }

    /// The body has run, so its result must not be left unstored because
    /// its call was dropped: a complete that did not reach the store is
    /// re-sent as a dropped single call's is (same token: one that landed
    /// unanswered is `Done`); a release is tried once more.
    fn orphaned(store: Arc<dyn Store>, op: FinishOp, reply: Self::Reply) {
        match (op, reply) {
            (
                FinishOp::Complete {
                    key,
                    token,
                    fingerprint,
                    kind,
                    value,
                    lease,
                    ttl,
                },
                Err(e),
            ) if is_unavailable(&e) => Detached {
                store,
                key,
                token,
                fingerprint,
                kind,
                value,
                lease,
                ttl,
                as_claimed: true,
                messages: Vec::new(),
                // Durable calls never join a batch (exec.rs).
                durability: crate::durability::Durability::Async,
            }
            .spawn(),
            (FinishOp::Complete { .. }, reply) => {
                Completion::judge(reply);
            }
            (FinishOp::Release { key, token }, Err(e)) if is_unavailable(&e) => detach(
                "a batch dropped while its release was in flight",
                async move {
                    log_release(
                        "a batch was dropped after a body failed",
                        store.release(&key, &token).await,
                    );
                },
            ),
            (FinishOp::Release { .. }, reply) => {
                log_release("a batch was dropped after a body failed", reply);
            }
        }
    }
}

/// The operations of one phase of a batch, gathered until every call has
/// either queued its own or left.
pub(super) struct Gather<Op: BatchOp> {
    store: Arc<dyn Store>,
    state: Mutex<State<Op>>,
}

struct State<Op: BatchOp> {
    /// Tickets not yet spent or dropped.
    open: usize,
    queued: Vec<(Op, Reply<Op>)>,
    /// A send of what is queued is due at the next scheduler turn.
    due: bool,
}

impl<Op: BatchOp> Gather<Op> {
    pub(super) fn new(store: Arc<dyn Store>, tickets: usize) -> Gather<Op> {
        Gather {
            store,
            state: Mutex::new(State {
                open: tickets,
                queued: Vec::new(),
                due: false,
            }),
        }
    }

    /// One call's ticket for this phase. The gather counts `tickets` of
    /// them from its creation: hand out at most that many, and
    /// [`leave`](Gather::leave) for each one never handed out.
    pub(super) fn ticket(self: &Arc<Self>) -> Ticket<Op> {
        Ticket {
            gather: Arc::clone(self),
            spent: false,
        }
    }

    /// One ticket that will never be handed out leaves the phase.
    pub(super) fn leave(&self) {
        let last = {
            let mut state = self.lock();
            state.open = state.open.saturating_sub(1);
            state.open == 0 && !state.queued.is_empty()
        };
        if last {
            self.send_queued();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<Op>> {
        // A poisoned lock only means a panic elsewhere mid-update of plain
        // counters and a queue: still consistent enough to send what is queued.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends every queued operation, if any, in a task of its own.
    pub(super) fn send_queued(&self) {
        let queued = {
            let mut state = self.lock();
            state.due = false;
            std::mem::take(&mut state.queued)
        };
        if queued.is_empty() {
            return;
        }
        let (ops, replies): (Vec<Op>, Vec<Reply<Op>>) = queued.into_iter().unzip();
        let store = Arc::clone(&self.store);
        let send = Op::send(Arc::clone(&store), ops);
        // Only outside a runtime (the last ticket dropped there) is this
        // not sent: the queued calls were dropped too, and their keys free
        // themselves when their leases run out.
        detach("a batch with store writes queued", async move {
            // An op left without a reply drops its sender: its call then
            // sends it again on its own.
            for ((op, reply), to) in send.await.into_iter().zip(replies) {
                if let Err((op, reply)) = to.send((op, reply)) {
                    Op::orphaned(Arc::clone(&store), op, reply);
                }
            }
        });
    }
}

impl FinishOp {
    /// The store's view of this op.
    fn to_store(&self) -> Finish<'_> {
        match self {
            FinishOp::Complete {
                key,
                token,
                fingerprint,
                kind,
                value,
                lease,
                ttl,
            } => Finish::Complete(
                Complete::new(key, token, *kind, value)
                    .fingerprint(fingerprint.as_ref())
                    .as_claimed(Some(AsClaimed {
                        lease: *lease,
                        ttl: *ttl,
                    })),
            ),
            FinishOp::Release { key, token } => Finish::Release { key, token },
        }
    }

    /// [`send`](BatchOp::send), through `round_trip` when the batch gave
    /// one ([`Batch::finish_with`](super::Batch::finish_with)), else the
    /// store's [`Store::finish_batch`].
    pub(super) fn send_with(
        store: Arc<dyn Store>,
        ops: Vec<Self>,
        round_trip: Option<FinishRoundTrip>,
    ) -> Sent<Self> {
        Box::pin(async move {
            let finishes: Vec<Finish<'_>> = ops.iter().map(FinishOp::to_store).collect();
            let replies = match round_trip {
                Some(send) => send(&finishes).await,
                None => store.finish_batch(&finishes).await,
            };
            drop(finishes);
            Answered { ops, replies }
        })
    }
}

/// Sends `ops` as one batch (a batch's round trip, not a per-call
/// queue): the returned future, polled by the batch's driver, gives them
/// back with their replies, in order. Dropped before, it finishes in a
/// task of its own and leaves every reply to [`BatchOp::orphaned`].
pub(super) fn send_wave<Op: BatchOp>(store: Arc<dyn Store>, ops: Vec<Op>) -> Wave<Op> {
    let send = Op::send(Arc::clone(&store), ops);
    wave_of(store, send)
}

/// [`send_wave`] of a batch's results, through `round_trip` when the
/// batch gave one.
pub(super) fn send_finish_wave(
    store: Arc<dyn Store>,
    ops: Vec<FinishOp>,
    round_trip: Option<FinishRoundTrip>,
) -> Wave<FinishOp> {
    let send = FinishOp::send_with(Arc::clone(&store), ops, round_trip);
    wave_of(store, send)
}

/// `send` as a wave its driver polls itself: no task, no channel, and
/// no wake-up passed on from a task to the driver (a store that answers
/// in process, `MemoryStore`, answers on the first poll). Dropped before
/// its answer, the wave hands what is left of `send` to a task of its own,
/// which acts on the replies for the driver that is gone.
fn wave_of<Op: BatchOp>(store: Arc<dyn Store>, send: Sent<Op>) -> Wave<Op> {
    Wave {
        send: Some(send),
        store,
    }
}

/// A batch's round trip, polled by its driver.
pub(super) struct Wave<Op: BatchOp> {
    /// `None` once answered.
    send: Option<Sent<Op>>,
    store: Arc<dyn Store>,
}

impl<Op: BatchOp> Future for Wave<Op> {
    type Output = Option<Answered<Op>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(send) = self.send.as_mut() else {
            return Poll::Ready(None);
        };
        let replies = std::task::ready!(send.as_mut().poll(cx));
        self.send = None;
        Poll::Ready(Some(replies))
    }
}

impl<Op: BatchOp> Drop for Wave<Op> {
    fn drop(&mut self) {
        // As for a single op (`Submitted`): the writes go on, and the
        // replies of a driver that is gone are acted on for it.
        let Some(send) = self.send.take() else {
            return;
        };
        let store = Arc::clone(&self.store);
        detach("a batch with store writes in flight", async move {
            for (op, reply) in send.await {
                Op::orphaned(Arc::clone(&store), op, reply);
            }
        });
    }
}

/// A batch on its way: each op back with its reply, in order.
pub(super) type Sent<Op> = Pin<Box<dyn Future<Output = Answered<Op>> + Send>>;

/// A batch's ops and the store's replies, paired as they are taken out:
/// pairing them in a new list moved every op once more.
pub(super) struct Answered<Op: BatchOp> {
    ops: Vec<Op>,
    /// In the order of `ops`; an op past the last reply has none.
    replies: Vec<Op::Reply>,
}

impl<Op: BatchOp> Default for Answered<Op> {
    fn default() -> Self {
        Answered {
            ops: Vec::new(),
            replies: Vec::new(),
        }
    }
}

impl<Op: BatchOp> IntoIterator for Answered<Op> {
    type Item = (Op, Op::Reply);
    type IntoIter = std::iter::Zip<std::vec::IntoIter<Op>, std::vec::IntoIter<Op::Reply>>;

    fn into_iter(self) -> Self::IntoIter {
        self.ops.into_iter().zip(self.replies)
    }
}

/// Where an op's reply goes: back to its call, with the op.
type Reply<Op> = oneshot::Sender<(Op, <Op as BatchOp>::Reply)>;

/// One call's right to a place in a phase of its batch. Dropped unspent,
/// the call leaves the phase (it has nothing to send).
pub(super) struct Ticket<Op: BatchOp> {
    gather: Arc<Gather<Op>>,
    spent: bool,
}

impl<Op: BatchOp> Ticket<Op> {
    /// Queues `op`; the returned future waits for it back with its reply:
    /// sent once every call of the group has queued or left, or at the next
    /// scheduler turn, whichever is first. `None` when the group could not
    /// answer it (the call then sends it on its own). Dropped before the
    /// reply, it leaves the reply to [`BatchOp::orphaned`].
    pub(super) fn submit(mut self, op: Op) -> Submitted<Op> {
        self.spent = true;
        let (to, reply) = oneshot::channel();
        let (last, first) = {
            let mut state = self.gather.lock();
            state.queued.push((op, to));
            state.open = state.open.saturating_sub(1);
            let first = !state.due;
            state.due = true;
            (state.open == 0, first)
        };
        if last {
            self.gather.send_queued();
        } else if first {
            let gather = Arc::clone(&self.gather);
            tokio::spawn(async move {
                // Behind every task ready now, so that the calls ready in
                // this turn have queued theirs.
                tokio::task::yield_now().await;
                gather.send_queued();
            });
        }
        Submitted {
            reply,
            store: Arc::clone(&self.gather.store),
            answered: false,
        }
    }
}

/// A queued op's reply, awaited by its call.
pub(super) struct Submitted<Op: BatchOp> {
    reply: oneshot::Receiver<(Op, Op::Reply)>,
    store: Arc<dyn Store>,
    answered: bool,
}

impl<Op: BatchOp> Future for Submitted<Op> {
    type Output = Option<(Op, Op::Reply)>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let out = std::task::ready!(Pin::new(&mut this.reply).poll(cx)).ok();
        this.answered = true;
        Poll::Ready(out)
    }
}

impl<Op: BatchOp> Drop for Submitted<Op> {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        // Closed first: a reply sent from now on comes back to its sender,
        // which acts on it; one already here is acted on here. Exactly one
        // of the two sees it.
        self.reply.close();
        if let Ok((op, reply)) = self.reply.try_recv() {
            Op::orphaned(Arc::clone(&self.store), op, reply);
        }
    }
}

impl<Op: BatchOp> Drop for Ticket<Op> {
    fn drop(&mut self) {
        if !self.spent {
            self.gather.leave();
        }
    }
}

/// A call's places in its group's two phases.
pub(super) struct Tickets {
    claim: Mutex<Option<Ticket<ClaimOp>>>,
    finish: Mutex<Option<Ticket<FinishOp>>>,
}

impl Tickets {
    pub(super) fn new(claim: Ticket<ClaimOp>, finish: Ticket<FinishOp>) -> Self {
        Tickets {
            claim: Mutex::new(Some(claim)),
            finish: Mutex::new(Some(finish)),
        }
    }

    /// The claim ticket, the first time only.
    pub(super) fn take_claim(&self) -> Option<Ticket<ClaimOp>> {
        self.claim
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// The finish ticket, the first time only.
    pub(super) fn take_finish(&self) -> Option<Ticket<FinishOp>> {
        self.finish
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// Leaves the finish phase: this call will store nothing with its group.
    pub(super) fn leave_finish(&self) {
        drop(self.take_finish());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    fn release(key: &str) -> FinishOp {
        FinishOp::Release {
            key: Arc::from(key),
            token: Token::random(),
        }
    }

    #[tokio::test]
    async fn sends_once_every_ticket_is_spent_or_dropped() {
        let gather: Arc<Gather<FinishOp>> = Arc::new(Gather::new(Arc::new(MemoryStore::new()), 3));
        let (a, b, c) = (gather.ticket(), gather.ticket(), gather.ticket());
        drop(c);
        let (ra, rb) = tokio::join!(a.submit(release("a")), b.submit(release("b")));
        assert!(matches!(ra, Some((_, Ok(WriteReply::Missing)))));
        assert!(matches!(rb, Some((_, Ok(WriteReply::Missing)))));
    }

    #[tokio::test]
    async fn a_queued_call_never_waits_for_a_ticket_still_held() {
        let gather: Arc<Gather<FinishOp>> = Arc::new(Gather::new(Arc::new(MemoryStore::new()), 2));
        let (a, _held) = (gather.ticket(), gather.ticket());
        let r = a.submit(release("a")).await;
        assert!(matches!(r, Some((_, Ok(WriteReply::Missing)))));
    }
}
