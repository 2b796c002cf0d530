//! Sharing store round trips between the calls of a [`Batch`](super::Batch):
//! each call's first claim, and its first complete or release, wait for the
//! other calls of the batch and go to the store together, as one
//! [`Store::claim_batch`] or [`Store::finish_batch`].
//!
//! Every call holds one ticket per phase. A call that submits an operation
//! spends its ticket; a call that will not (a cache hit, a refusal, a body
//! that failed before the phase) drops it. Once no ticket is left open, the
//! queued operations are sent at once. Otherwise they are sent at the end
//! of the poll pass in which they were queued (a [`Batch`](super::Batch)
//! is one future: after each time it is polled), or, for a group of calls
//! polled apart, one scheduler turn after the first was queued. The calls
//! ready together (bodies that finished together) go together, and a result
//! is never held back for a slower sibling body, so a crash between a
//! body's end and its stored result costs no more runs than it does for a
//! single call.
//!
//! The send itself runs in a task of its own: a call dropped while its
//! operation is queued or in flight (the batch cancelled at shutdown) still
//! has it sent, as a single call's detached completion would be.

use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::store::{Claim, ClaimReply, Finish, Store, ValueKind, WriteReply};
use crate::token::Token;
use bytes::Bytes;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::oneshot;
use tracing::Instrument;

/// One kind of batched store operation, owned so that it can be sent from
/// a task of its own.
pub(super) trait BatchOp: Send + Sized + 'static {
    type Reply: Send + 'static;

    /// Sends `ops` as one batch; one reply per op, in order.
    fn send(
        store: Arc<dyn Store>,
        ops: Vec<Self>,
    ) -> Pin<Box<dyn Future<Output = Vec<Self::Reply>> + Send>>;
}

/// A call's first claim.
pub(super) struct ClaimOp {
    pub(super) key: String,
    pub(super) token: Token,
    pub(super) lease: Duration,
    pub(super) ttl: Duration,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) want_ttl_left: bool,
}

impl BatchOp for ClaimOp {
    type Reply = Result<ClaimReply, Error>;

    fn send(
        store: Arc<dyn Store>,
        ops: Vec<Self>,
    ) -> Pin<Box<dyn Future<Output = Vec<Self::Reply>> + Send>> {
        Box::pin(async move {
            let claims: Vec<Claim<'_>> = ops
                .iter()
                .map(|op| Claim {
                    key: &op.key,
                    token: &op.token,
                    lease: op.lease,
                    ttl: op.ttl,
                    fingerprint: op.fingerprint.as_ref(),
                    want_ttl_left: op.want_ttl_left,
                })
                .collect();
            store.claim_batch(&claims).await
        })
    }
}

/// A call's first complete (its body succeeded) or release (it failed).
pub(super) enum FinishOp {
    Complete {
        key: String,
        token: Token,
        fingerprint: Option<Fingerprint>,
        kind: ValueKind,
        value: Bytes,
    },
    Release {
        key: String,
        token: Token,
    },
}

impl BatchOp for FinishOp {
    type Reply = Result<WriteReply, Error>;

    fn send(
        store: Arc<dyn Store>,
        ops: Vec<Self>,
    ) -> Pin<Box<dyn Future<Output = Vec<Self::Reply>> + Send>> {
        Box::pin(async move {
            let finishes: Vec<Finish<'_>> = ops
                .iter()
                .map(|op| match op {
                    FinishOp::Complete {
                        key,
                        token,
                        fingerprint,
                        kind,
                        value,
                    } => Finish::Complete {
                        key,
                        token,
                        fingerprint: fingerprint.as_ref(),
                        kind: *kind,
                        value,
                    },
                    FinishOp::Release { key, token } => Finish::Release { key, token },
                })
                .collect();
            store.finish_batch(&finishes).await
        })
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
    queued: Vec<(Op, oneshot::Sender<Op::Reply>)>,
    /// A send of what is queued is due at the next scheduler turn.
    due: bool,
    /// Whether a queued op schedules that send itself; off when the
    /// group's driver sends after each of its poll passes.
    self_timed: bool,
}

impl<Op: BatchOp> Gather<Op> {
    pub(super) fn new(store: Arc<dyn Store>, tickets: usize, self_timed: bool) -> Gather<Op> {
        Gather {
            store,
            state: Mutex::new(State {
                open: tickets,
                queued: Vec::new(),
                due: false,
                self_timed,
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
        let (ops, replies): (Vec<Op>, Vec<oneshot::Sender<Op::Reply>>) = queued.into_iter().unzip();
        let send = Op::send(Arc::clone(&self.store), ops);
        let deliver = async move {
            // An op left without a reply drops its sender: its call then
            // sends it again on its own.
            for (reply, to) in send.await.into_iter().zip(replies) {
                let _ = to.send(reply);
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(deliver.instrument(tracing::Span::current()));
            }
            // Only when the last ticket is dropped outside a runtime: the
            // queued calls were dropped too, and their keys free themselves
            // when their leases run out.
            Err(_) => tracing::warn!(
                "a batch was dropped outside a Tokio runtime with store writes queued: they are not sent; those keys free themselves when their leases run out"
            ),
        }
    }
}

/// One call's right to a place in a phase of its batch. Dropped unspent,
/// the call leaves the phase (it has nothing to send).
pub(super) struct Ticket<Op: BatchOp> {
    gather: Arc<Gather<Op>>,
    spent: bool,
}

impl<Op: BatchOp> Ticket<Op> {
    /// Queues `op` and waits for its reply: sent once every call of the
    /// group has queued or left, or at the next scheduler turn, whichever
    /// is first. `None` when the group could not answer it (the call then
    /// sends it on its own).
    pub(super) async fn submit(mut self, op: Op) -> Option<Op::Reply> {
        self.spent = true;
        let (to, reply) = oneshot::channel();
        let (last, first) = {
            let mut state = self.gather.lock();
            state.queued.push((op, to));
            state.open = state.open.saturating_sub(1);
            let first = state.self_timed && !state.due;
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
        reply.await.ok()
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
            key: key.to_owned(),
            token: Token::random(),
        }
    }

    #[tokio::test]
    async fn sends_once_every_ticket_is_spent_or_dropped() {
        let gather: Arc<Gather<FinishOp>> =
            Arc::new(Gather::new(Arc::new(MemoryStore::new()), 3, true));
        let (a, b, c) = (gather.ticket(), gather.ticket(), gather.ticket());
        drop(c);
        let (ra, rb) = tokio::join!(a.submit(release("a")), b.submit(release("b")));
        assert!(matches!(ra, Some(Ok(WriteReply::Missing))));
        assert!(matches!(rb, Some(Ok(WriteReply::Missing))));
    }

    #[tokio::test]
    async fn a_queued_call_never_waits_for_a_ticket_still_held() {
        let gather: Arc<Gather<FinishOp>> =
            Arc::new(Gather::new(Arc::new(MemoryStore::new()), 2, true));
        let (a, _held) = (gather.ticket(), gather.ticket());
        let r = a.submit(release("a")).await;
        assert!(matches!(r, Some(Ok(WriteReply::Missing))));
    }
}
