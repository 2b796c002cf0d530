//! PgStore's state machine, transition by transition, against a real
//! PostgreSQL (a fresh database per test).

use crate::support::{DbStore, TestDb};
use idem_core::store::{ClaimReply, Complete, Store, Token, ValueKind, WriteReply};
use idem_core::{Error, FailMode, Fingerprint, Idempotency, Outcome};
use idem_postgres::{PgStore, PgStoreConfig};
use idem_testkit::claim;
use std::time::Duration;

#[tokio::test]
async fn every_transition_of_the_state_machine() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let (a, b) = (Token::random(), Token::random());

    // fresh → Acquired{1}; the same token re-sent → the same claim
    assert_eq!(
        s.claim(claim("k", &a, 300, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(
        s.claim(claim("k", &a, 300, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    // another token while the lease is live → InProgress with the lease left
    match s.claim(claim("k", &b, 300, 60_000, None)).await.unwrap() {
        ClaimReply::InProgress { retry_after } => assert!(
            retry_after > Duration::ZERO && retry_after <= Duration::from_millis(300),
            "{retry_after:?}"
        ),
        other => panic!("{other:?}"),
    }
    // writes by a non-owner change nothing
    assert_eq!(
        s.complete(Complete::new("k", &b, ValueKind::Json, b"1"))
            .await
            .unwrap(),
        WriteReply::OtherOwner
    );
    assert_eq!(s.release("k", &b).await.unwrap(), WriteReply::OtherOwner);
    assert_eq!(
        s.extend("k", &b, Duration::from_secs(1)).await.unwrap(),
        WriteReply::OtherOwner
    );
    // the lease runs out (database clock) → takeover, attempt + 1
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(
        s.claim(claim("k", &b, 300, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    // the old holder is refused, the new one completes
    assert_eq!(
        s.complete(Complete::new("k", &a, ValueKind::Json, b"\"old\""))
            .await
            .unwrap(),
        WriteReply::OtherOwner
    );
    assert_eq!(
        s.extend("k", &a, Duration::from_secs(1)).await.unwrap(),
        WriteReply::OtherOwner
    );
    assert_eq!(
        s.complete(Complete::new("k", &b, ValueKind::Json, b"\"new\""))
            .await
            .unwrap(),
        WriteReply::Done
    );
    // the same complete re-sent → Done; another value → AlreadyCompleted
    assert_eq!(
        s.complete(Complete::new("k", &b, ValueKind::Json, b"\"new\""))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        s.complete(Complete::new("k", &b, ValueKind::Json, b"\"other\""))
            .await
            .unwrap(),
        WriteReply::AlreadyCompleted
    );
    assert_eq!(
        s.complete(Complete::new("k", &b, ValueKind::Lz4Json, b"\"new\""))
            .await
            .unwrap(),
        WriteReply::AlreadyCompleted
    );
    assert_eq!(
        s.release("k", &b).await.unwrap(),
        WriteReply::AlreadyCompleted
    );
    assert_eq!(
        s.extend("k", &b, Duration::from_secs(1)).await.unwrap(),
        WriteReply::AlreadyCompleted
    );
    // completed → every claim gets the record, with its TTL left
    match s
        .claim(claim("k", &Token::random(), 300, 60_000, None))
        .await
        .unwrap()
    {
        ClaimReply::Completed(c) => {
            assert_eq!((c.kind, &c.value[..]), (ValueKind::Json, &b"\"new\""[..]));
            let left = c.ttl_left.unwrap();
            assert!(
                left <= Duration::from_secs(60) && left > Duration::from_secs(55),
                "{left:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // missing keys
    assert_eq!(
        s.complete(Complete::new("nope", &a, ValueKind::Json, b"1"))
            .await
            .unwrap(),
        WriteReply::Missing
    );
    assert_eq!(s.release("nope", &a).await.unwrap(), WriteReply::Missing);
    assert_eq!(
        s.extend("nope", &a, Duration::from_secs(1)).await.unwrap(),
        WriteReply::Missing
    );
}

#[tokio::test]
async fn release_extend_and_ttl_from_the_claim() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let (a, b) = (Token::random(), Token::random());
    assert_eq!(
        s.claim(claim("r", &a, 10_000, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(s.release("r", &a).await.unwrap(), WriteReply::Done);
    assert_eq!(s.release("r", &a).await.unwrap(), WriteReply::Missing);
    assert_eq!(
        s.claim(claim("r", &b, 10_000, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );

    // extend keeps a lease alive past its first end
    assert_eq!(
        s.claim(claim("e", &a, 600, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            s.extend("e", &a, Duration::from_millis(600)).await.unwrap(),
            WriteReply::Done
        );
    }
    assert!(matches!(
        s.claim(claim("e", &b, 600, 60_000, None)).await.unwrap(),
        ClaimReply::InProgress { .. }
    ));

    // the result TTL counts from the claim (margins wide enough for a busy
    // CI machine: only the bounds matter)
    assert_eq!(
        s.claim(claim("t", &a, 100, 2_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        s.complete(Complete::new("t", &a, ValueKind::Json, b"7"))
            .await
            .unwrap(),
        WriteReply::Done
    );
    match s.claim(claim("t", &b, 100, 2_000, None)).await.unwrap() {
        ClaimReply::Completed(c) => assert!(
            c.ttl_left.unwrap() <= Duration::from_millis(1_700),
            "{:?}",
            c.ttl_left
        ),
        other => panic!("{other:?}"),
    }
    tokio::time::sleep(Duration::from_millis(1_800)).await;
    // expired: a fresh key again (attempt 1), and writes see it missing
    assert_eq!(
        s.complete(Complete::new("t", &a, ValueKind::Json, b"7"))
            .await
            .unwrap(),
        WriteReply::Missing
    );
    assert_eq!(
        s.claim(claim("t", &b, 100, 2_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );

    // a TTL under two leases is raised: the dead holder's record is a takeover
    assert_eq!(
        s.claim(claim("two", &a, 1_000, 1_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(
        s.claim(claim("two", &b, 1_000, 1_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
}

#[tokio::test]
async fn fingerprints() {
    let db = TestDb::new().await;
    let s = db.store().await;
    let (fa, fb) = (Fingerprint::of_bytes(b"a"), Fingerprint::of_bytes(b"b"));
    let (a, b) = (Token::random(), Token::random());
    assert_eq!(
        s.claim(claim("f", &a, 200, 60_000, Some(&fa)))
            .await
            .unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(
        s.claim(claim("f", &b, 200, 60_000, Some(&fb)))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
    assert!(matches!(
        s.claim(claim("f", &b, 200, 60_000, None)).await.unwrap(),
        ClaimReply::InProgress { .. }
    ));
    // takeover with a mismatching fingerprint is refused; with none it keeps the stored one
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        s.claim(claim("f", &b, 200, 60_000, Some(&fb)))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
    assert_eq!(
        s.claim(claim("f", &b, 200, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    assert_eq!(
        s.complete(Complete::new("f", &b, ValueKind::Json, b"1"))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        s.claim(claim("f", &a, 200, 60_000, Some(&fb)))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
    match s
        .claim(claim("f", &a, 200, 60_000, Some(&fa)))
        .await
        .unwrap()
    {
        ClaimReply::Completed(c) => assert_eq!(c.fingerprint, Some(fa)),
        other => panic!("{other:?}"),
    }
    // no stored fingerprint matches anything; a takeover writes the claimer's
    assert_eq!(
        s.claim(claim("g", &a, 200, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(
        s.claim(claim("g", &b, 200, 60_000, Some(&fb)))
            .await
            .unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    assert_eq!(
        s.claim(claim("g", &a, 200, 60_000, Some(&fa)))
            .await
            .unwrap(),
        ClaimReply::Mismatch
    );
}

#[tokio::test]
#[allow(unreachable_code)]
async fn through_idempotency_every_value_replays() {
    let db = TestDb::new().await;
    let idem = db.builder().await.namespace("t").build();
    #[allow(unreachable_code)]
    async fn twice<T>(idem: &Idempotency, key: &str, v: T)
    where
        T: serde::Serialize + serde::de::DeserializeOwned + Clone + PartialEq + std::fmt::Debug,
    {
        let first = v.clone();
        let (r1, o1) = idem
            .call("v", key)
            .run_outcome(|| async { Ok::<_, Error>(first) })
            .await
            .unwrap();
        let (r2, o2) = idem
            .call("v", key)
            .run_outcome(|| async { Ok::<_, Error>(panic!("ran twice")) })
            .await
            .unwrap();
        assert_eq!((r1, o1), (v.clone(), Outcome::Executed));
        assert_eq!((r2, o2), (v, Outcome::Replayed));
    }
    twice(&idem, "zero", 0u64).await;
    twice(&idem, "false", false).await;
    twice(&idem, "unit", ()).await;
    twice(&idem, "none", None::<u32>).await;
    twice(&idem, "empty", Vec::<u8>::new()).await;
    twice(&idem, "string", "ünïcødé ' \" ; --".to_owned()).await;

    // Err releases: the next call runs
    let e: Result<u32, Error> = idem
        .call("v", "err")
        .run(|| async { Err(Error::codec("boom")) })
        .await;
    assert!(e.is_err());
    let (v, o) = idem
        .call("v", "err")
        .run_outcome(|| async { Ok::<_, Error>(5u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (5, Outcome::Executed));
}

#[tokio::test]
async fn compressed_and_marker_values_round_trip() {
    let db = TestDb::new().await;
    let idem = db
        .builder()
        .await
        .compress_above(64)
        .max_value_size(10_000)
        .build();
    let big = "x".repeat(5_000);
    let (_, o) = idem
        .call("c", "big")
        .run_outcome(|| async { Ok::<_, Error>(big.clone()) })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
    let (v, o) = idem
        .call("c", "big")
        .run_outcome(|| async { Ok::<_, Error>(String::new()) })
        .await
        .unwrap();
    assert_eq!((v == big, o), (true, Outcome::Replayed));
    assert_eq!(
        db.count("SELECT count(*) FROM idem_keys WHERE state = 'Z'")
            .await,
        1
    );

    // over the limit: returned once, then replays answer TooLarge; the body never runs again
    let huge = "y".repeat(20_000);
    let v: Result<String, Error> = idem
        .call("c", "huge")
        .run(|| async { Ok(huge.clone()) })
        .await;
    assert_eq!(v.unwrap().len(), 20_000);
    let v: Result<String, Error> = idem
        .call("c", "huge")
        .run(|| async { panic!("ran twice") })
        .await;
    assert!(
        matches!(
            v,
            Err(Error::TooLarge {
                size: 20_002,
                limit: 10_000
            })
        ),
        "{v:?}"
    );
}

#[tokio::test]
async fn migrate_is_idempotent_and_concurrent() {
    let db = TestDb::new().await;
    let mut tasks = Vec::new();
    for i in 0..4 {
        let pool = db.pool.clone();
        tasks.push(tokio::spawn(async move {
            let cfg = if i % 2 == 0 {
                PgStoreConfig::default()
            } else {
                PgStoreConfig::table("public.idem_keys")
            };
            PgStore::from_pool_with(pool, cfg).unwrap().migrate().await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    db.store().await.install_schema().await.unwrap();
    // the shipped file applies cleanly on top
    sqlx::raw_sql(sqlx::AssertSqlSafe(idem_postgres::SCHEMA_SQL))
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        db.count("SELECT count(*) FROM pg_indexes WHERE tablename = 'idem_keys'")
            .await,
        2
    );

    // a schema-qualified table of another name
    db.exec("CREATE SCHEMA billing").await;
    let s =
        PgStore::from_pool_with(db.pool.clone(), PgStoreConfig::table("billing.Keys2")).unwrap();
    s.migrate().await.unwrap();
    let t = Token::random();
    assert_eq!(
        s.claim(claim("k", &t, 1000, 60_000, None)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(db.count("SELECT count(*) FROM billing.\"Keys2\"").await, 1);
    assert_eq!(db.count("SELECT count(*) FROM idem_keys").await, 0);
}

#[tokio::test]
async fn reap_deletes_only_expired_rows_in_batches() {
    let db = TestDb::new().await;
    let s = db.store().await;
    for i in 0..25 {
        let t = Token::random();
        s.claim(claim(&format!("short{i}"), &t, 50, 100, None))
            .await
            .unwrap();
    }
    let t = Token::random();
    s.claim(claim("long", &t, 10_000, 60_000, None))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(s.reap(10).await.unwrap(), 10);
    assert_eq!(s.reap(100).await.unwrap(), 15);
    assert_eq!(s.reap(100).await.unwrap(), 0);
    assert_eq!(db.count("SELECT count(*) FROM idem_keys").await, 1);

    // the background reaper
    for i in 0..5 {
        let t = Token::random();
        s.claim(claim(&format!("bg{i}"), &t, 50, 100, None))
            .await
            .unwrap();
    }
    let reaper = s.spawn_reaper(Duration::from_millis(50), 2);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while db.count("SELECT count(*) FROM idem_keys").await > 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "the reaper did not reap"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(reaper);
}

#[tokio::test]
async fn unreachable_server_is_unavailable_and_fail_open_runs_unprotected() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/x");
    let e = PgStore::connect(&url).await.unwrap_err();
    assert!(
        matches!(&e, Error::Unavailable { op: "connect", .. }),
        "{e}"
    );
    // It names PostgreSQL and says what to do, and never mentions Redis.
    let text = e.to_string();
    assert!(text.contains("PostgreSQL"), "{e}");
    assert!(text.contains("check that PostgreSQL is up"), "{e}");
    assert!(!text.contains("Redis"), "{e}");

    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_millis(500))
        .connect_lazy(&url)
        .unwrap();
    let closed = Idempotency::builder(PgStore::from_pool(pool.clone())).build();
    let r: Result<u32, Error> = closed
        .call("s", "k")
        .run(|| async { panic!("must not run") })
        .await;
    assert!(
        matches!(r, Err(Error::Unavailable { op: "claim", .. })),
        "{r:?}"
    );
    let text = r.unwrap_err().to_string();
    assert!(
        text.contains("PostgreSQL") && text.contains("check") && !text.contains("Redis"),
        "{text}"
    );
    let open = Idempotency::builder(PgStore::from_pool(pool))
        .fail_mode(FailMode::Open)
        .build();
    let (v, o) = open
        .call("s", "k")
        .run_outcome(|| async { Ok::<_, Error>(3u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (3, Outcome::Unprotected));
}

#[tokio::test]
async fn missing_table_says_to_migrate() {
    let db = TestDb::new().await;
    let s = PgStore::from_pool(db.pool.clone());
    let t = Token::random();
    let e = s
        .claim(claim("k", &t, 1000, 60_000, None))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidConfig(m) if m.contains("migrate")),
        "{e}"
    );
}
