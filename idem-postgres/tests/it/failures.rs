//! PgStore's failure counts (`Store::count_failure`) in their own table
//! beside the records: migration, upgrades from a table without it,
//! reaping and schema-qualified tables, against a real PostgreSQL. The
//! semantics shared with every store are in the workspace's
//! `tests/it/failures.rs`.

use crate::support::{DbStore, TestDb};
use idem_core::Error;
use idem_core::store::OperatorStore;
use idem_postgres::{PgStore, PgStoreConfig};
use std::time::Duration;

const DAY: Duration = Duration::from_secs(86_400);

#[tokio::test]
async fn a_table_from_before_failure_counts_says_to_migrate_again() {
    let db = TestDb::new().await;
    let s = db.store().await;
    // What an older idem-postgres's migration left: the records only.
    db.exec("DROP TABLE idem_keys_failures").await;
    let e = s.count_failure("ns:s:k", DAY).await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("idem_keys_failures") && m.contains("migrate()` again")),
        "{e}"
    );
    let e = s.forget("ns:s:k", false).await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("migrate()` again")),
        "{e}"
    );
    s.migrate().await.unwrap();
    assert_eq!(s.count_failure("ns:s:k", DAY).await.unwrap(), 1);
    assert_eq!(s.count_failure("ns:s:k", DAY).await.unwrap(), 2);
}

#[tokio::test]
async fn expired_counts_restart_and_are_reaped() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let short = Duration::from_millis(50);
    for key in ["ns:s:a", "ns:s:b"] {
        assert_eq!(s.count_failure(key, short).await.unwrap(), 1);
        assert_eq!(s.count_failure(key, short).await.unwrap(), 2);
    }
    assert_eq!(s.count_failure("ns:s:long", DAY).await.unwrap(), 1);
    tokio::time::sleep(short * 4).await;
    // Expired but not reaped yet: counting starts again.
    assert_eq!(s.count_failure("ns:s:a", DAY).await.unwrap(), 1);
    // The reaper deletes the expired one only.
    assert_eq!(s.reap(100).await.unwrap(), 1);
    assert_eq!(db.count("SELECT count(*) FROM idem_keys_failures").await, 2);
    assert_eq!(s.reap(100).await.unwrap(), 0);
    assert_eq!(s.count_failure("ns:s:long", DAY).await.unwrap(), 2);
}

#[tokio::test]
async fn a_schema_qualified_table_keeps_its_counts_beside_it() {
    let db = TestDb::new().await;
    db.exec("CREATE SCHEMA billing").await;
    let s =
        PgStore::from_pool_with(db.pool.clone(), PgStoreConfig::table("billing.Keys2")).unwrap();
    s.migrate().await.unwrap();
    assert!(s.schema_sql().contains("\"billing\".\"Keys2_failures\""));
    assert_eq!(s.count_failure("ns:s:k", DAY).await.unwrap(), 1);
    assert_eq!(s.count_failure("ns:s:k", DAY).await.unwrap(), 2);
    assert_eq!(
        db.count("SELECT failures FROM billing.\"Keys2_failures\"")
            .await,
        2
    );
    assert!(s.forget("ns:s:k", false).await.unwrap().is_none());
    assert_eq!(
        db.count("SELECT count(*) FROM billing.\"Keys2_failures\"")
            .await,
        0
    );
    assert_eq!(s.count_failure("ns:s:k", DAY).await.unwrap(), 1);
}
