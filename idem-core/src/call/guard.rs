//! Releasing the key: on purpose after a failed body, or on drop when
//! the call's future is cancelled.

use crate::store::{Store, WriteReply};
use crate::token::Token;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing::Instrument;

impl<'a> ReleaseGuard<'a> {
    /// Armed: dropped as it is, it releases `key` for `token` (suspends it,
    /// keeping any recorded steps, when `keep_steps`: a `run_steps` call
    /// that may have taken over a record holding earlier holders' steps).
    pub(super) fn new(
        store: &'a Arc<dyn Store>,
        key: &'a str,
        token: &'a Token,
        keep_steps: bool,
    ) -> Self {
        ReleaseGuard {
            store,
            key,
            token,
            keep_steps,
            armed: true,
            turn: None,
        }
    }

    /// Also releases, whatever `armed` says, while `turn` is not yet
    /// taken: a body still waiting for its batch's concurrency turn has
    /// made no effect, so its key is freed at once rather than kept for
    /// a lease and then run again as a takeover.
    pub(super) fn until_turn(mut self, turn: Option<&'a Turn>) -> Self {
        self.turn = turn;
        self
    }
}

/// Whether a call's body has got its turn under its batch's concurrency
/// limit: before that, the call has a claim but no effect.
#[derive(Debug, Default)]
pub(super) struct Turn(AtomicBool);

impl Turn {
    /// The body starts now.
    pub(super) fn take(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether the body has started.
    pub(super) fn taken(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Whether a body waiting on `turn` (none: not gated) has started.
pub(super) fn started(turn: Option<&Turn>) -> bool {
    turn.is_none_or(Turn::taken)
}

/// Releases `key` for `token` on purpose (`why` says for the log); a key
/// that could not be released frees itself when its lease runs out.
pub(super) async fn release(store: &dyn Store, key: &str, token: &Token, why: &str) {
    log_release(why, store.release(key, token).await)
}

/// Says what a release on purpose did.
pub(super) fn log_release(why: &str, result: Result<WriteReply, crate::error::Error>) {
    match result {
        Ok(WriteReply::Done) => tracing::debug!("{why}: key released"),
        Ok(other) => tracing::warn!(?other, "{why}, but the key was no longer ours to release"),
        Err(e) => {
            tracing::warn!(error = %e, "{why}, and the key could not be released: it frees itself when the lease expires")
        }
    }
}

/// Says, when a call's future is dropped mid-body without releasing (see
/// [`Call::release_on_cancel`](super::Call::release_on_cancel)), why the key stays in flight.
pub(super) struct KeptOnDrop<'a> {
    pub(super) armed: bool,
    /// The body's concurrency turn, if it waits for one: before it is
    /// taken the key is released, not kept.
    pub(super) turn: Option<&'a Turn>,
}

impl Drop for KeptOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed && started(self.turn) {
            tracing::warn!(
                "call dropped mid-body: the body may have made effects, so the key stays in flight until its lease ends; the next call then runs the body again as Recovered"
            );
        }
    }
}

/// Releases the claim if the call's future is dropped while its claim is
/// in flight, or mid-body under [`Call::release_on_cancel`](super::Call::release_on_cancel): at once, by
/// owner token, rather than after the lease.
pub(super) struct ReleaseGuard<'a> {
    store: &'a Arc<dyn Store>,
    key: &'a str,
    token: &'a Token,
    keep_steps: bool,
    pub(super) armed: bool,
    turn: Option<&'a Turn>,
}

impl Drop for ReleaseGuard<'_> {
    fn drop(&mut self) {
        if !self.armed && started(self.turn) {
            return;
        }
        let (store, key, token) = (Arc::clone(self.store), Arc::from(self.key), *self.token);
        detach(
            "a call cancelled while it held or was claiming its key",
            free(store, key, token, self.keep_steps),
        );
    }
}

/// Frees a key this call gives up: releases it, or suspends it (keeping
/// recorded steps) for a `run_steps` call. Best effort: a key that could
/// not be freed frees itself when its lease runs out.
pub(super) async fn free(store: Arc<dyn Store>, key: Arc<str>, token: Token, keep_steps: bool) {
    let freed = if keep_steps {
        store.suspend(&key, &token).await
    } else {
        store.release(&key, &token).await
    };
    match freed {
        Ok(_) => tracing::debug!("call cancelled: key released"),
        Err(e) => {
            tracing::warn!(error = %e, "call cancelled and the key could not be released: it frees itself when the lease expires")
        }
    }
}

/// Runs `work` in a task of its own on the current runtime, in the
/// current span: what a dropped call must still get done. Outside a
/// runtime it cannot: `what` says in the log what was left to the lease.
pub(super) fn detach(what: &str, work: impl Future<Output = ()> + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => {
            handle.spawn(work.instrument(tracing::Span::current()));
        }
        Err(_) => tracing::warn!(
            "{what}, outside a Tokio runtime: its store writes are not sent; its keys free themselves when their leases run out"
        ),
    }
}
