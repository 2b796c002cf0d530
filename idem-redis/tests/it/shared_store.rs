//! A store shared by reference: the test keeps a handle (`Arc`) on the
//! store it hands to a builder, to read or steer it while calls run.

use async_trait::async_trait;
use idem_core::Error;
use idem_core::store::{Capabilities, Claim, ClaimReply, Complete, Store, Token, WriteReply};
use std::sync::Arc;
use std::time::Duration;

/// `Arc<S>` as a store: every call goes to the shared `S`.
pub(crate) struct Shared<S>(pub(crate) Arc<S>);

#[async_trait]
impl<S: Store> Store for Shared<S> {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        self.0.claim(claim).await
    }
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        self.0.complete(complete).await
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.0.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.0.extend(key, token, lease).await
    }
    /// What it forwarded before: the operator calls and notifications.
    fn capabilities(&self) -> Capabilities<'_> {
        let inner = self.0.capabilities();
        let mut caps = Capabilities::none();
        caps.operator = inner.operator;
        caps.watch = inner.watch;
        caps
    }
}
