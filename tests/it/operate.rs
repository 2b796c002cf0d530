//! inspect, forget and scan on every store: MemoryStore, Redis standalone,
//! Redis Cluster and PostgreSQL (idem-postgres's PgStore); and what a
//! forget means for local replay caches.

use futures_util::StreamExt;
use idem::store::{Capabilities, Claim, ClaimReply, Complete, Store, Token, ValueKind, WriteReply};
use idem::{Error, Idempotency, KeyState, MemoryStore, Outcome, RedisStore};
use idem_testkit::{RedisCluster, RedisServer, TestContext};
use std::collections::BTreeMap;
use std::time::Duration;

const NS: &str = "ops";

fn idem<S: Store + Clone>(store: &S) -> Idempotency {
    Idempotency::builder(store.clone())
        .namespace(NS)
        .max_value_size(64)
        .compress_above(16)
        .build()
}

/// Claims `key` of scope `charge` directly, as a holder that never finishes.
async fn hold<S: Store>(store: &S, key: &str, lease: Duration) -> Token {
    let token = Token::random();
    let full = format!("{NS}:charge:{key}");
    let claim = Claim::new(&full, &token, lease, Duration::from_secs(600));
    assert_eq!(
        store.claim(claim).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    token
}

async fn run(idem: &Idempotency, key: &str, value: serde_json::Value) -> Outcome {
    idem.call("charge", key)
        .fingerprint(&"payload")
        .run_outcome(|| async { Ok::<_, Error>(value) })
        .await
        .unwrap()
        .1
}

/// Every state, every refusal, on one store.
async fn inspect_and_forget<S: Store + Clone>(store: S) {
    let idem = idem(&store);
    assert!(idem.inspect("charge", "none").await.unwrap().is_none());
    assert!(idem.forget("charge", "none").await.unwrap().is_none());

    // Completed, with its fingerprint and sizes; the value only on request.
    run(&idem, "done", serde_json::json!(42)).await;
    let info = idem.inspect("charge", "done").await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::Completed);
    assert_eq!(info.kind, Some(ValueKind::Json));
    assert_eq!(info.value_size, Some(2));
    assert!(info.value.is_none());
    assert!(info.fingerprint.is_some());
    assert!(!info.is_held() && info.attempt.is_none() && info.lease_left.is_none());
    let left = info.ttl_left.unwrap();
    assert!(left > Duration::from_secs(86_000) && left <= Duration::from_secs(86_400));
    let info = idem
        .inspect_with_value("charge", "done")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.value.as_deref(), Some(&b"42"[..]));

    // Compressed: the value comes back as JSON.
    let text = "y".repeat(40);
    run(&idem, "packed", serde_json::json!(text)).await;
    let info = idem
        .inspect_with_value("charge", "packed")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.kind, Some(ValueKind::Lz4Json));
    assert_eq!(
        info.value.as_deref(),
        Some(format!("\"{text}\"").as_bytes())
    );

    // Too large and unserializable markers.
    run(&idem, "big", serde_json::json!("z".repeat(100))).await;
    let info = idem.inspect("charge", "big").await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::TooLarge);
    let (_, o) = idem
        .call("charge", "odd")
        .run_outcome(|| async {
            Ok::<_, Error>(std::collections::HashMap::from([((1u8, 2u8), 3u8)]))
        })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
    let info = idem.inspect("charge", "odd").await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::Unserializable);

    // Pending with a live lease: refused, then forced.
    hold(&store, "held", Duration::from_secs(30)).await;
    let info = idem.inspect("charge", "held").await.unwrap().unwrap();
    assert_eq!(
        (info.state, info.attempt, info.is_held()),
        (KeyState::Pending, Some(1), true)
    );
    assert!(info.lease_left.unwrap() > Duration::from_secs(25));
    match idem.forget("charge", "held").await {
        Err(Error::LeaseHeld {
            lease_left,
            attempt: 1,
        }) => assert!(lease_left > Duration::from_secs(25), "{lease_left:?}"),
        other => panic!("a live lease must be refused, got {other:?}"),
    }
    let refused = idem.forget("charge", "held").await.unwrap_err().to_string();
    assert!(refused.contains("--force"), "{refused}");
    assert!(
        idem.inspect("charge", "held").await.unwrap().is_some(),
        "refused, so kept"
    );
    let removed = idem
        .forget("charge", "held")
        .force()
        .await
        .unwrap()
        .unwrap();
    assert_eq!(removed.state, KeyState::Pending);
    assert!(idem.inspect("charge", "held").await.unwrap().is_none());

    // Pending whose holder stopped renewing: no force needed.
    hold(&store, "dead", Duration::from_millis(30)).await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    let info = idem.inspect("charge", "dead").await.unwrap().unwrap();
    assert_eq!((info.state, info.is_held()), (KeyState::Pending, false));
    assert!(idem.forget("charge", "dead").await.unwrap().is_some());

    // A forgotten completed key runs again.
    let removed = idem.forget("charge", "done").await.unwrap().unwrap();
    assert_eq!((removed.state, removed.value), (KeyState::Completed, None));
    assert_eq!(
        run(&idem, "done", serde_json::json!(43)).await,
        Outcome::Executed
    );

    // Bad input is refused before the store.
    assert!(matches!(
        idem.inspect("charge", "").await,
        Err(Error::InvalidKey(_))
    ));
    assert!(matches!(
        idem.forget("charge", "a\nb").await,
        Err(Error::InvalidKey(_))
    ));
}

/// `scan` finds exactly the scope's keys, whatever the page size, and
/// honours its limit; glob characters in a scope match only themselves.
async fn scan_scopes<S: Store + Clone>(store: S) {
    let idem = idem(&store);
    for i in 0..120 {
        run(&idem, &format!("k{i:03}"), serde_json::json!(i)).await;
    }
    hold(&store, "stuck", Duration::from_secs(30)).await;
    for scope in ["charge*", "charges", "charge:x", "refund"] {
        let _: u8 = idem
            .call(scope, "other")
            .run(|| async { Ok::<_, Error>(1) })
            .await
            .unwrap();
    }
    let _: u8 = idem
        .call("c*", "glob")
        .run(|| async { Ok::<_, Error>(1) })
        .await
        .unwrap();

    for page in [1, 7, 1000] {
        let mut found = BTreeMap::new();
        let mut scan = idem.scan("charge").page_size(page);
        while let Some(entry) = scan.next().await {
            let entry = entry.unwrap();
            let state = entry.record.unwrap().state;
            assert!(found.insert(entry.key, state).is_none(), "a key came twice");
        }
        assert_eq!(found.len(), 121, "page size {page}");
        assert_eq!(found["stuck"], KeyState::Pending);
        assert_eq!(found["k000"], KeyState::Completed);
    }
    let limited: Vec<_> = idem.scan("charge").page_size(10).limit(25).collect().await;
    assert_eq!(limited.len(), 25);
    let glob: Vec<String> = idem.scan("c*").map(|e| e.unwrap().key).collect().await;
    assert_eq!(glob, ["glob"], "`*` in a scope is not a wildcard");
    let bad: Vec<_> = idem.scan("").collect().await;
    assert!(matches!(bad.as_slice(), [Err(Error::InvalidKey(_))]));
}

#[tokio::test]
async fn memory_store() {
    inspect_and_forget(MemoryStore::new()).await;
    scan_scopes(MemoryStore::new()).await;
}

#[tokio::test]
async fn redis_standalone() {
    let server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    inspect_and_forget(store.clone()).await;
    server.flushall();
    scan_scopes(store.clone()).await;

    // Records idem cannot read are reported, never deleted.
    server.flushall();
    let idem = idem(&store);
    let mut con = server.connection();
    let _: () = redis::cmd("SET")
        .arg("ops:charge:garbage")
        .arg("not a record")
        .query(&mut con)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg("ops:charge:hash")
        .arg("f")
        .arg("v")
        .query(&mut con)
        .unwrap();
    for key in ["garbage", "hash"] {
        let e = idem.inspect("charge", key).await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        let e = idem.forget("charge", key).force().await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    }
    assert_eq!(server.cli(&["GET", "ops:charge:garbage"]), "not a record");
    assert_eq!(server.cli(&["TYPE", "ops:charge:hash"]), "hash");
    let scanned: Vec<_> = idem.scan("charge").collect().await;
    assert_eq!(scanned.len(), 2);
    assert!(
        scanned
            .iter()
            .all(|e| matches!(e, Ok(k) if matches!(k.record, Err(Error::Corrupt { .. }))))
    );

    // forget is a script: it survives SCRIPT FLUSH like the others.
    run(&idem, "again", serde_json::json!(1)).await;
    server.cli(&["SCRIPT", "FLUSH"]);
    assert!(idem.forget("charge", "again").await.unwrap().is_some());
}

#[tokio::test]
async fn redis_cluster() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let store = RedisStore::connect_cluster(&urls).await.unwrap();
    inspect_and_forget(store.clone()).await;
    for node in cluster.nodes() {
        node.flushall();
    }
    // Keys of every master: the scan must visit all three.
    scan_scopes(store).await;
}

#[tokio::test]
async fn postgres() {
    let ctx = TestContext::postgres().await;
    let (store, db) = (ctx.pg_store().clone(), ctx.pg_db());
    inspect_and_forget(store.clone()).await;
    db.exec("DELETE FROM idem_keys").await;
    scan_scopes(store.clone()).await;

    // Rows idem cannot read are reported, never deleted.
    db.exec("DELETE FROM idem_keys").await;
    db.exec(
        "INSERT INTO idem_keys (key, state, expires_at, value) \
         VALUES ('ops:charge:garbage', 'X', now() + interval '1 hour', '\\x00')",
    )
    .await;
    db.exec(
        "INSERT INTO idem_keys (key, state, expires_at, attempt, lease_until, token) \
         VALUES ('ops:charge:short-token', 'P', now() + interval '1 hour', 1, \
                 now() + interval '1 minute', '\\x0102')",
    )
    .await;
    let idem = idem(&store);
    for key in ["garbage", "short-token"] {
        let e = idem.inspect("charge", key).await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        let e = idem.forget("charge", key).force().await.unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    }
    assert_eq!(db.count("SELECT count(*) FROM idem_keys").await, 2);
    let scanned: Vec<_> = idem.scan("charge").collect().await;
    assert_eq!(scanned.len(), 2);
    assert!(
        scanned
            .iter()
            .all(|e| matches!(e, Ok(k) if matches!(k.record, Err(Error::Corrupt { .. }))))
    );
}

/// A store that cannot deliver forget invalidations (as a `RedisStore`
/// made with `from_manager`, or a user the ACL refuses `SSUBSCRIBE`).
#[derive(Clone)]
struct Deaf(MemoryStore);

#[async_trait::async_trait]
impl Store for Deaf {
    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        self.0.claim(c).await
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
    /// Operator calls, but no notifications.
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none().operator(&self.0)
    }
}

/// A forget in one `Idempotency` drops the copy in another's local cache
/// at once when the store delivers invalidations (MemoryStore clones here;
/// Redis in `idem-redis/tests/it/invalidate.rs`).
#[tokio::test(start_paused = true)]
async fn forget_reaches_other_local_caches() {
    let store = MemoryStore::new();
    let cached = || {
        Idempotency::builder(store.clone())
            .result_ttl(Duration::from_secs(60))
            .local_cache(100)
            .build()
    };
    let (here, elsewhere) = (cached(), cached());
    assert_eq!(
        run(&here, "k", serde_json::json!(1)).await,
        Outcome::Executed
    );
    assert_eq!(
        run(&elsewhere, "k", serde_json::json!(2)).await,
        Outcome::Replayed
    );
    here.forget("charge", "k").await.unwrap().unwrap();
    assert_eq!(
        run(&elsewhere, "k", serde_json::json!(3)).await,
        Outcome::Executed
    );
}

/// A store that cannot tell local caches of forgets: nothing enters them,
/// so after a forget this process and another both run the body again at
/// once; `ttl_left` still says what the record had left.
#[tokio::test(start_paused = true)]
async fn forget_and_local_caches() {
    let store = Deaf(MemoryStore::new());
    let ttl = Duration::from_secs(60);
    let cached = |store: &Deaf| {
        Idempotency::builder(store.clone())
            .result_ttl(ttl)
            .lease(Duration::from_secs(5))
            .local_cache(100)
            .build()
    };
    let (here, elsewhere) = (cached(&store), cached(&store));
    assert_eq!(
        run(&here, "k", serde_json::json!(1)).await,
        Outcome::Executed
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    assert_eq!(
        run(&elsewhere, "k", serde_json::json!(2)).await,
        Outcome::Replayed
    );
    tokio::time::advance(Duration::from_secs(10)).await;
    let removed = here.forget("charge", "k").await.unwrap().unwrap();
    assert_eq!(removed.ttl_left, Some(Duration::from_secs(40)));
    // Elsewhere never cached it: it cannot hear forgets.
    assert_eq!(
        run(&elsewhere, "k", serde_json::json!(3)).await,
        Outcome::Executed
    );
    here.forget("charge", "k").await.unwrap();
    assert_eq!(
        run(&here, "k", serde_json::json!(4)).await,
        Outcome::Executed
    );
}
