//! Lease renewal while the body runs, and noticing its loss.

use super::exec::Exec;
use crate::error::Error;
use crate::lease::Lease;
use crate::store::WriteReply;
use futures_util::future::BoxFuture;
use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::task::Poll;
use tokio::time::{Instant, Sleep, sleep, sleep_until};

impl Exec<'_> {
    /// Drives `body`, renewing the lease about every third of it from inside
    /// this future: no detached task, so a holder that is no longer polled
    /// (frozen process, forgotten future) stops renewing and loses the key.
    ///
    /// Flags `lease` lost when the store answers that the record is no
    /// longer ours, or when no renewal has been confirmed for a whole lease
    /// (counted from when the confirmed claim or renewal was sent, so never
    /// later than the store's own count): past that the store may give the
    /// key to another caller. Renewals go on after the latter, as the store
    /// may still answer that the key is ours.
    pub(super) async fn keep_alive<Fut: Future>(
        &self,
        body: Fut,
        lease: &Lease,
        claimed: Instant,
    ) -> Fut::Output {
        let period = self.lease / 3;
        let mut body = pin!(body);
        let mut tick: Option<Pin<Box<Sleep>>> = None;
        let mut renewing: Option<(Instant, BoxFuture<'_, Result<WriteReply, Error>>)> = None;
        let mut valid_until = claimed + self.lease;
        // Both timers are made on the first pending poll: most bodies are
        // done by then and never pay for them.
        let mut expiry: Option<Pin<Box<Sleep>>> = None;
        let mut refused = false;
        poll_fn(|cx| {
            if let Poll::Ready(out) = body.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            while !refused {
                if let Some((sent, renewal)) = renewing.as_mut() {
                    let sent = *sent;
                    let Poll::Ready(result) = renewal.as_mut().poll(cx) else {
                        break;
                    };
                    renewing = None;
                    let next = match result {
                        Ok(WriteReply::Done) => {
                            valid_until = sent + self.lease;
                            if let Some(e) = expiry.as_mut() {
                                e.as_mut().reset(valid_until);
                            }
                            period
                        }
                        Ok(other) => {
                            refused = true;
                            lease.mark_lost();
                            tracing::error!(
                                ?other,
                                "lease lost while the body runs: another caller may take over"
                            );
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "lease renewal failed; retrying sooner");
                            period / 3
                        }
                    };
                    if let Some(t) = tick.as_mut() {
                        t.as_mut().reset(Instant::now() + next);
                    }
                }
                let t = tick.get_or_insert_with(|| Box::pin(sleep(period)));
                if t.as_mut().poll(cx).is_pending() {
                    break;
                }
                let sent = Instant::now();
                lease.mark_extended();
                renewing = Some((sent, self.store.extend(&self.key, &self.token, self.lease)));
            }
            if !lease.is_lost() {
                let e = expiry.get_or_insert_with(|| Box::pin(sleep_until(valid_until)));
                if e.as_mut().poll(cx).is_ready() {
                    lease.mark_lost();
                    tracing::error!(
                        lease = ?self.lease,
                        "no lease renewal confirmed for a whole lease (store unreachable?): another caller may take over while the body runs"
                    );
                }
            }
            Poll::Pending
        })
        .await
    }
}
