//! Storing a finished body's result, even when the call is dropped
//! meanwhile.

use super::backoff::resend;
use super::guard::detach;
use crate::durability::Durability;
use crate::fingerprint::Fingerprint;
use crate::outbox::message::OutboxMessage;
use crate::store::{AsClaimed, Complete, Store, ValueKind, WriteReply};
use crate::token::Token;
use backon::ExponentialBuilder;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;

/// Whether a finished body's result made it into the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stored {
    Yes,
    /// The record was no longer ours: taken over, or expired.
    LeaseLost,
    /// The store could not be reached within the retry window.
    No,
    /// Stored on the primary, but the copies the call's durability asks
    /// for were not confirmed in time.
    Unconfirmed,
}

/// Everything a `complete` needs, borrowed from the call; `to_owned` for a
/// completion that outlives it.
pub(super) struct Completion<'a> {
    pub(super) store: &'a Arc<dyn Store>,
    pub(super) key: &'a str,
    pub(super) token: Token,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) kind: ValueKind,
    pub(super) value: &'a Bytes,
    pub(super) lease: Duration,
    /// The claim's TTL: with the lease, what its pending record holds.
    pub(super) ttl: Duration,
    /// Whether the pending record is still the one the claim wrote, as far
    /// as the call knows (no steps recorded in it, no renewal sent): the
    /// store is then told the claim ([`Complete::as_claimed`]), else it
    /// reads the record.
    pub(super) as_claimed: bool,
    /// Outgoing messages written with the result (`outbox::stage`).
    pub(super) messages: &'a [OutboxMessage],
    /// The copies to confirm before the result counts as stored.
    pub(super) durability: Durability,
}

impl Completion<'_> {
    /// [`run`](Completion::run), going on in a task of its own if this
    /// future is dropped meanwhile: the body has succeeded, so dropping the
    /// caller must neither release the key nor leave it to run again.
    pub(super) async fn run_to_the_end(&self) -> Stored {
        let mut detach = DetachOnDrop(Some(self));
        let stored = self.run().await;
        detach.0 = None;
        stored
    }

    /// Sends `complete`, re-sending while the store is unreachable, for at
    /// most half a lease: past the lease the key may be taken over anyway.
    /// A re-sent complete that finds its own result stored is `Done`.
    async fn run(&self) -> Stored {
        let retries = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(20))
            .with_max_delay(self.lease / 4)
            .with_total_delay(Some(self.lease / 2))
            .without_max_times();
        let as_claimed = (self.messages.is_empty() && self.as_claimed).then_some(AsClaimed {
            lease: self.lease,
            ttl: self.ttl,
        });
        let complete = Complete::new(self.key, &self.token, self.kind, self.value)
            .fingerprint(self.fingerprint.as_ref())
            .durability(self.durability)
            .outbox(self.messages)
            .as_claimed(as_claimed);
        let result = resend(retries, "complete", || self.store.complete(complete)).await;
        Completion::judge(result)
    }

    /// What a `complete`'s reply means for the call.
    pub(super) fn judge(result: Result<WriteReply, crate::error::Error>) -> Stored {
        match result {
            Ok(WriteReply::Done) => Stored::Yes,
            // Written on the primary (a store answers NotConfirmed only for
            // a write that happened): not re-sent, the durability timeout
            // was the caller's budget.
            Err(crate::error::Error::NotConfirmed { reason, .. }) => {
                tracing::warn!(
                    %reason,
                    "the result is stored on the primary but its copies were not confirmed in time: it may not survive a failover (Outcome::NotConfirmed)"
                );
                Stored::Unconfirmed
            }
            Ok(other) => {
                tracing::error!(
                    ?other,
                    "the body finished after its lease was lost: it blocked or was not polled for longer than the lease, or the store failed over to a replica that had not received the claim (a Durability that waits for a replica narrows that); another caller may have run it too; this result was NOT stored"
                );
                Stored::LeaseLost
            }
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "the result could not be stored; the key stays in flight until its lease expires, then the next call runs the body again"
                );
                Stored::No
            }
        }
    }
}

/// Finishes a [`Completion`] in a task of its own when the call's future
/// is dropped while it runs: the body has succeeded, so dropping the
/// caller must neither release the key nor leave it to run again.
struct DetachOnDrop<'a>(Option<&'a Completion<'a>>);

impl Drop for DetachOnDrop<'_> {
    fn drop(&mut self) {
        let Some(c) = self.0.take() else {
            return;
        };
        Detached {
            store: Arc::clone(c.store),
            key: Arc::from(c.key),
            token: c.token,
            fingerprint: c.fingerprint,
            kind: c.kind,
            value: c.value.clone(),
            lease: c.lease,
            ttl: c.ttl,
            as_claimed: c.as_claimed,
            messages: c.messages.to_vec(),
            durability: c.durability,
        }
        .spawn();
    }
}

/// A completion that owns what it stores, for a call that is gone: a
/// single call dropped mid-complete, or a batch dropped with its finish
/// round trip in flight.
pub(super) struct Detached {
    pub(super) store: Arc<dyn Store>,
    pub(super) key: Arc<str>,
    pub(super) token: Token,
    pub(super) fingerprint: Option<Fingerprint>,
    pub(super) kind: ValueKind,
    pub(super) value: Bytes,
    pub(super) lease: Duration,
    pub(super) ttl: Duration,
    pub(super) as_claimed: bool,
    pub(super) messages: Vec<OutboxMessage>,
    pub(super) durability: Durability,
}

impl Detached {
    /// Stores the result in a task of its own, re-sending while the store
    /// is unreachable, as [`Completion::run_to_the_end`] does.
    pub(super) fn spawn(self) {
        detach("a call dropped after its body succeeded", async move {
            let completion = Completion {
                store: &self.store,
                key: &self.key,
                token: self.token,
                fingerprint: self.fingerprint,
                kind: self.kind,
                value: &self.value,
                lease: self.lease,
                ttl: self.ttl,
                as_claimed: self.as_claimed,
                messages: &self.messages,
                durability: self.durability,
            };
            if completion.run().await == Stored::Yes {
                tracing::debug!(
                    "call dropped after its body succeeded: result stored by a detached completion"
                );
            }
        });
    }
}
