//! idem-testkit's per-test database, plus a migrated `PgStore` on it.
#![allow(dead_code)]

use idem_core::{Idempotency, IdempotencyBuilder};
use idem_postgres::PgStore;
pub(crate) use idem_testkit::PgTestDb as TestDb;

/// A migrated store over the test database's pool.
pub(crate) trait DbStore {
    async fn store(&self) -> PgStore;
    async fn builder(&self) -> IdempotencyBuilder;
}

impl DbStore for TestDb {
    async fn store(&self) -> PgStore {
        let store = PgStore::from_pool(self.pool.clone());
        store.migrate().await.expect("migrate");
        store
    }

    async fn builder(&self) -> IdempotencyBuilder {
        Idempotency::builder(self.store().await)
    }
}
