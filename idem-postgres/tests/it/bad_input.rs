//! Bad input: table names that are not plain identifiers, rows that idem
//! did not write, keys that look like SQL. Typed errors, nothing overwritten.

use crate::support::{DbStore, TestDb};
use idem_core::Error;
use idem_core::store::{Claim, ClaimReply, Complete, Store, Token, ValueKind, WriteReply};
use idem_postgres::{PgStore, PgStoreConfig};
use std::time::Duration;

fn claim<'a>(key: &'a str, token: &'a Token) -> Claim<'a> {
    Claim::new(key, token, Duration::from_secs(10), Duration::from_secs(60))
}

#[tokio::test]
async fn table_names_with_quotes_or_semicolons_are_refused() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id int)").await;
    for bad in [
        "x\"; DROP TABLE orders; --",
        "idem;keys",
        "idem'keys",
        "a.b.c",
        "",
        "idem keys",
        "\"idem\"",
    ] {
        let e = PgStore::from_pool_with(db.pool.clone(), PgStoreConfig::table(bad)).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidConfig(m) if m.contains("PgStoreConfig::table")),
            "{bad:?}: {e}"
        );
        // refused before any connection is made
        let e = PgStore::connect_with("postgres://nobody@127.0.0.1:1/x", PgStoreConfig::table(bad))
            .await
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig(_)), "{bad:?}: {e}");
    }
    assert_eq!(db.count("SELECT count(*) FROM orders").await, 0); // still there
}

#[tokio::test]
async fn keys_that_look_like_sql_are_just_keys() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let t = Token::random();
    for key in ["'; DROP TABLE idem_keys; --", "a\"b", "ключ", "x%_\\"] {
        assert_eq!(
            s.claim(claim(key, &t)).await.unwrap(),
            ClaimReply::Acquired { attempt: 1 }
        );
        assert_eq!(
            s.complete(Complete::new(key, &t, ValueKind::Json, b"1"))
                .await
                .unwrap(),
            WriteReply::Done
        );
    }
    assert_eq!(
        db.count("SELECT count(*) FROM idem_keys WHERE state = 'C'")
            .await,
        4
    );
}

#[tokio::test]
async fn corrupt_rows_are_reported_and_left_alone() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let future = "clock_timestamp() + interval '1 hour'";
    let rows = [
        (
            "unknown_state",
            format!("'X', 1, {future}, '\\x00112233445566778899aabbccddeeff', NULL, NULL"),
        ),
        (
            "short_token",
            format!("'P', 1, {future}, '\\x0011', NULL, NULL"),
        ),
        (
            "zero_attempt",
            format!("'P', 0, {future}, '\\x00112233445566778899aabbccddeeff', NULL, NULL"),
        ),
        (
            "no_lease",
            "'P', 1, NULL, '\\x00112233445566778899aabbccddeeff', NULL, NULL".to_owned(),
        ),
        (
            "long_fingerprint",
            format!("'P', 1, {future}, '\\x00112233445566778899aabbccddeeff', '\\x001122', NULL"),
        ),
        (
            "completed_without_value",
            "'C', NULL, NULL, NULL, NULL, NULL".to_owned(),
        ),
        (
            "completed_bad_fingerprint",
            "'C', NULL, NULL, NULL, '\\x01', '\\x32'".to_owned(),
        ),
    ];
    for (key, values) in &rows {
        db.exec(&format!(
            "INSERT INTO idem_keys (key, state, attempt, lease_until, token, fingerprint, value, expires_at) \
             VALUES ('{key}', {values}, clock_timestamp() + interval '1 hour')"
        ))
        .await;
    }
    let snapshot = "SELECT string_agg(t::text, '|' ORDER BY key) FROM idem_keys t";
    let (before,): (String,) = sqlx::query_as(snapshot).fetch_one(&db.pool).await.unwrap();
    let t = Token::random();
    for (key, _) in &rows {
        let e = s.claim(claim(key, &t)).await.unwrap_err();
        assert!(
            matches!(&e, Error::Corrupt { reason: m, .. } if m.contains("left")),
            "{key}: {e}"
        );
    }
    // writes by a stranger: refused (corrupt or another owner), nothing written
    for (key, _) in &rows {
        for r in [
            s.complete(Complete::new(key, &t, ValueKind::Json, b"1"))
                .await,
            s.release(key, &t).await,
            s.extend(key, &t, Duration::from_secs(1)).await,
        ] {
            assert!(
                matches!(
                    r,
                    Err(Error::Corrupt { .. })
                        | Ok(WriteReply::OtherOwner | WriteReply::AlreadyCompleted)
                ),
                "{key}: {r:?}"
            );
        }
    }
    // through idem: a typed error, and the body does not run
    let idem = idem_core::Idempotency::builder(s.clone())
        .namespace("n")
        .build();
    db.exec("INSERT INTO idem_keys (key, state, expires_at) VALUES ('n:s:k', '?', clock_timestamp() + interval '1 hour')").await;
    let r: Result<u32, Error> = idem
        .call("s", "k")
        .run(|| async { panic!("must not run") })
        .await;
    assert!(matches!(r, Err(Error::Corrupt { .. })), "{r:?}");
    db.exec("DELETE FROM idem_keys WHERE key = 'n:s:k'").await;
    let (after,): (String,) = sqlx::query_as(snapshot).fetch_one(&db.pool).await.unwrap();
    assert_eq!(before, after, "a corrupt row was modified");
}

#[tokio::test]
async fn a_table_of_another_shape_is_a_config_error() {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE idem_keys (key text PRIMARY KEY, v int)")
        .await;
    let s = PgStore::from_pool(db.pool.clone());
    // IF NOT EXISTS leaves the user's table alone, and the index says why it cannot work
    let e = s.migrate().await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("PgStoreConfig::table")),
        "{e}"
    );
    let t = Token::random();
    let e = s.claim(claim("k", &t)).await.unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("PgStoreConfig::table")),
        "{e}"
    );
}
