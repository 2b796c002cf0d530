//! A store's own value limit (`Capabilities::max_value_size`) lowers the
//! builder's `max_value_size`: a larger result is returned to its call,
//! stored as the too-large marker, and later calls get `Error::TooLarge`
//! without running the body again; a limit above the builder's changes
//! nothing.

use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, MemoryStore, Store, Token, WriteReply,
};
use idem_core::{Error, Idempotency, Outcome};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// MemoryStore with a value limit of its own.
struct Limited(MemoryStore, usize);

#[idem_core::async_trait]
impl Store for Limited {
    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        self.0.claim(c).await
    }
    async fn complete(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
        assert!(
            c.value.len() <= self.1,
            "a value over the store's limit was sent"
        );
        self.0.complete(c).await
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.0.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.0.extend(key, token, lease).await
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none().max_value_size(self.1)
    }
}

#[tokio::test]
async fn a_stores_limit_lowers_the_builders() {
    let idem = Idempotency::builder(Limited(MemoryStore::new(), 100)).build();
    assert_eq!(idem.max_value_size(), 100);
    let runs = Arc::new(AtomicUsize::new(0));
    let call = || {
        let runs = runs.clone();
        idem.call("op", "k").run_outcome(move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>("x".repeat(200))
        })
    };
    let (v, outcome) = call().await.unwrap();
    assert_eq!((v.len(), outcome), (200, Outcome::Executed));
    assert!(matches!(
        call().await,
        Err(Error::TooLarge { limit: 100, .. })
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    let idem = Idempotency::builder(Limited(MemoryStore::new(), 1 << 30))
        .max_value_size(64)
        .build();
    assert_eq!(idem.max_value_size(), 64, "the smaller of the two");
}
