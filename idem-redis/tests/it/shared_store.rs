//! A store shared by reference: the test keeps a handle (`Arc`) on the
//! store it hands to a builder, to read or steer it while calls run.

use async_trait::async_trait;
use idem_core::store::{
    Claim, ClaimReply, InvalidationSink, KeyWatch, Store, Token, ValueKind, WriteReply,
};
use idem_core::{Durability, Error, Fingerprint, RecordInfo};
use std::sync::Arc;
use std::time::Duration;

/// `Arc<S>` as a store: every call goes to the shared `S`.
pub(crate) struct Shared<S>(pub(crate) Arc<S>);

#[async_trait]
impl<S: Store> Store for Shared<S> {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        self.0.claim(claim).await
    }
    async fn complete(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        self.0.complete(key, token, fingerprint, kind, value).await
    }
    async fn complete_claim(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
        durability: Durability,
    ) -> Result<WriteReply, Error> {
        self.0.complete_claim(claim, kind, value, durability).await
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.0.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.0.extend(key, token, lease).await
    }
    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        self.0.forget(key, force).await
    }
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.0.watch(key).await
    }
    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        self.0.watch_forgotten(prefix, sink).await
    }
}
