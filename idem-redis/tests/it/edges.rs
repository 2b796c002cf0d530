//! Exactly-once at the edges of the runtime: a caller that gives up after
//! its body succeeded, a body that blocks past its lease, records the
//! scripts must never write or misread, a re-sent complete, scripts gone from a node while another is
//! down, and a TTL shorter than the default lease. Real redis-server
//! processes throughout; exact run counts.

use idem_core::store::{Claim, ClaimReply, Complete, Store, Token, ValueKind, WriteReply};
use idem_core::{Error, Idempotency, MemoryStore, Outcome};
use idem_redis::{RedisStore, RedisStoreConfig};
use idem_testkit::{FaultProxy, RedisCluster, RedisServer};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[allow(non_snake_case)]
fn MS(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Short timeouts, so injected faults are noticed fast.
async fn fast_store(url: &str) -> RedisStore {
    let cfg = RedisStoreConfig::default()
        .response_timeout(MS(200))
        .connection_timeout(MS(200))
        .reconnect_retries(1);
    RedisStore::connect_with(url, cfg)
        .await
        .expect("connect to the test redis-server")
}

async fn get(server: &RedisServer, key: &str) -> Option<Vec<u8>> {
    let mut con = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut con)
        .await
        .expect("GET")
}

fn claim<'a>(key: &'a str, token: &'a Token, lease: Duration, ttl: Duration) -> Claim<'a> {
    Claim::new(key, token, lease, ttl)
}

/// A caller that drops its call while the result is being stored (here:
/// the store unreachable, `complete` in its retry backoff) must neither
/// release the key nor leave it to run again: the completion finishes on
/// its own and the retry replays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_call_after_the_body_succeeded_never_runs_it_again() {
    let server = RedisServer::start();
    let proxy = FaultProxy::start(server.addr());
    let lease = Duration::from_secs(4);
    let idem = Idempotency::builder(fast_store(&proxy.url()).await)
        .namespace("edge")
        .lease(lease)
        .build();
    let runs = Arc::new(AtomicUsize::new(0));

    let (r, p) = (Arc::clone(&runs), &proxy);
    let call = idem.call("op", "k").run_outcome(|| async move {
        r.fetch_add(1, Ordering::SeqCst);
        // The store goes away as the body returns: complete cannot land.
        p.refuse(true);
        p.drop_connections();
        Ok::<_, Error>("first".to_owned())
    });
    // The caller gives up (an HTTP client disconnecting, a timeout) while
    // complete is re-sent.
    let gave_up = tokio::time::timeout(MS(700), call).await;
    assert!(
        gave_up.is_err(),
        "the call should still be storing: {gave_up:?}"
    );
    proxy.refuse(false);

    let (again, o) = idem
        .call("op", "k")
        .wait(lease * 3)
        .run_outcome(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>("second".to_owned())
        })
        .await
        .expect("the retry gets the stored result");
    assert_eq!((again.as_str(), o), ("first", Outcome::Replayed));
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the body ran twice");
}

/// A body that blocks its thread past its lease cannot renew it; another
/// caller (another runtime, as in another process) takes over and stores
/// its result. The first must not report `Executed` as if its result were
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_blocking_past_its_lease_reports_the_lease_lost() {
    let server = RedisServer::start();
    let lease = MS(400);
    let runs = Arc::new(AtomicUsize::new(0));

    let (r, url) = (Arc::clone(&runs), server.url());
    let first = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let blocked = Idempotency::builder(fast_store(&url).await)
                .namespace("edge")
                .lease(lease)
                .build();
            blocked
                .call("op", "k")
                .run_outcome(|| async move {
                    r.fetch_add(1, Ordering::SeqCst);
                    // Blocks this runtime's only thread: no renewal runs.
                    std::thread::sleep(lease * 4);
                    Ok::<_, Error>("blocked".to_owned())
                })
                .await
        })
    });
    let taker = Idempotency::builder(fast_store(&server.url()).await)
        .namespace("edge")
        .lease(lease)
        .build();
    tokio::time::sleep(lease * 2).await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the first body is running");
    let r = Arc::clone(&runs);
    let (v, o) = taker
        .call("op", "k")
        .run_outcome(|| async move {
            r.fetch_add(1, Ordering::SeqCst);
            Ok::<_, Error>("taker".to_owned())
        })
        .await
        .expect("the taker runs");
    assert_eq!((v.as_str(), o), ("taker", Outcome::Recovered));

    let (v, o) = tokio::task::spawn_blocking(move || first.join())
        .await
        .expect("join")
        .expect("the blocked thread")
        .expect("its value is returned");
    assert_eq!((v.as_str(), o), ("blocked", Outcome::LeaseLost));
    assert!(o.result_not_stored());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    // The stored answer is the taker's, and it replays.
    let (v, o) = taker
        .call("op", "k")
        .run_outcome(|| async { Ok::<_, Error>("never".to_owned()) })
        .await
        .expect("replay");
    assert_eq!((v.as_str(), o), ("taker", Outcome::Replayed));
}

/// `claim` checks the whole client-built record: one with a bad lease end,
/// token or attempt is refused and nothing is written (before, a record
/// with a non-numeric lease end was written, and every later claim of the
/// key answered "corrupt").
#[tokio::test]
async fn claim_refuses_malformed_pending_records_and_writes_nothing() {
    let server = RedisServer::start();
    let mut con = server.connection();
    // Assembled as idem-redis assembles it: the shared prelude and record
    // operations, then the body.
    let script = redis::Script::new(concat!(
        "#!lua\n",
        include_str!("../../lua/prelude.lua"),
        include_str!("../../lua/record_ops.lua"),
        include_str!("../../lua/claim.lua")
    ));
    let token = "0123456789abcdef0123456789abcdef";
    let cases: [(&str, String); 6] = [
        ("non-numeric lease end", format!("1P\x00{token}abc:1")),
        ("empty lease end", format!("1P\x00{token}:1")),
        ("lease end of 0", format!("1P\x00{token}0:1")),
        ("lease end at the ttl", format!("1P\x00{token}60000:1")),
        ("token not hex", format!("1P\x00{}5000:1", "z".repeat(32))),
        ("attempt not 1", format!("1P\x00{token}5000:7")),
    ];
    for (case, record) in cases {
        let r: redis::RedisResult<redis::Value> = script
            .key("idem:bad")
            .arg(record.as_bytes())
            .arg(60_000)
            .arg("0")
            .invoke(&mut con);
        let e = r.expect_err(case);
        assert!(e.to_string().contains("idem claim"), "{case}: {e}");
        assert_eq!(server.cli(&["EXISTS", "idem:bad"]), "0", "{case}: written");
    }
    // The well-formed record is accepted.
    let ok: (i64, i64) = script
        .key("idem:bad")
        .arg(format!("1P\x00{token}5000:1").as_bytes())
        .arg(60_000)
        .arg("0")
        .invoke(&mut con)
        .expect("a valid record");
    assert_eq!(ok, (1, 1), "acquired, attempt 1");
}

/// With `lease == ttl` the record used to expire with the lease, so a dead
/// holder's key looked fresh (attempt 1, `Executed`): a takeover must be
/// counted, on both stores alike.
#[tokio::test]
async fn a_lease_as_long_as_the_ttl_still_counts_the_takeover() {
    let server = RedisServer::start();
    let redis = fast_store(&server.url()).await;
    let memory = MemoryStore::new();
    let stores: [(&str, &dyn Store); 2] = [("redis", &redis), ("memory", &memory)];
    for (name, store) in stores {
        let (a, b) = (Token::from_u128(1), Token::from_u128(2));
        let span = MS(300);
        let first = store.claim(claim("idem:eq", &a, span, span)).await;
        assert_eq!(
            first.unwrap(),
            ClaimReply::Acquired { attempt: 1 },
            "{name}"
        );
        // The holder dies: no renewal, no complete.
        tokio::time::sleep(span + MS(150)).await;
        let next = store.claim(claim("idem:eq", &b, span, span)).await;
        assert_eq!(next.unwrap(), ClaimReply::Acquired { attempt: 2 }, "{name}");
    }
}

/// Through the runtime: the next caller after a dead holder is told it
/// recovered, with a TTL no longer than the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_takeover_with_a_short_ttl_is_reported_as_recovered() {
    let server = RedisServer::start();
    let idem = Idempotency::builder(fast_store(&server.url()).await)
        .namespace("edge")
        .build();
    let token = Token::random();
    // A holder that claimed (ttl = lease = 300 ms) and died.
    let store = fast_store(&server.url()).await;
    let key = "edge:op:k";
    let held = store.claim(claim(key, &token, MS(300), MS(300))).await;
    assert_eq!(held.unwrap(), ClaimReply::Acquired { attempt: 1 });
    tokio::time::sleep(MS(450)).await;
    let (_, o) = idem
        .call("op", "k")
        .ttl(MS(300))
        .run_outcome(|| async { Ok::<_, Error>(1) })
        .await
        .expect("takes over");
    assert_eq!(o, Outcome::Recovered);
}

/// The attempt counter is written as an integer however large it gets
/// (Lua printed 10^14 as "1e+14", which every later claim read as corrupt),
/// and saturates where the client's counter does.
#[tokio::test]
async fn a_huge_attempt_counter_stays_an_integer() {
    let server = RedisServer::start();
    let store = fast_store(&server.url()).await;
    let (dead, next, last) = (
        "0123456789abcdef0123456789abcdef",
        Token::from_u128(7),
        Token::from_u128(8),
    );
    // A dead holder on its 99,999,999,999,999th attempt whose lease is
    // over (it ended when the key's PTTL fell to 90,000; it is 60,000).
    let planted = format!("1P\x00{dead}90000:99999999999999");
    redis::cmd("SET")
        .arg("idem:att")
        .arg(planted.as_bytes())
        .arg("PX")
        .arg(60_000)
        .exec(&mut server.connection())
        .expect("plant the record");
    let r = store
        .claim(claim("idem:att", &next, MS(200), Duration::from_secs(60)))
        .await;
    assert_eq!(r.unwrap(), ClaimReply::Acquired { attempt: u32::MAX });
    let rec = get(&server, "idem:att").await.expect("record");
    assert!(
        rec.ends_with(b":4294967295"),
        "{:?}",
        String::from_utf8_lossy(&rec)
    );
    // And it stays readable for the next takeover.
    tokio::time::sleep(MS(300)).await;
    let r = store
        .claim(claim("idem:att", &last, MS(200), Duration::from_secs(60)))
        .await;
    assert_eq!(r.unwrap(), ClaimReply::Acquired { attempt: u32::MAX });
}

/// A `complete` by a token that does not own the record writes nothing:
/// a `WATCH` on the key survives it (before, the script wrote the new record
/// and then restored the old one, which breaks `WATCH`, fires keyspace
/// events and writes past `maxmemory`).
#[tokio::test]
async fn a_refused_complete_writes_nothing() {
    let server = RedisServer::start();
    let store = fast_store(&server.url()).await;
    let (owner, intruder) = (Token::from_u128(1), Token::from_u128(2));
    let lease = Duration::from_secs(30);
    let r = store.claim(claim("idem:w", &owner, lease, lease * 2)).await;
    assert_eq!(r.unwrap(), ClaimReply::Acquired { attempt: 1 });

    let mut watcher = server.connection();
    redis::cmd("WATCH")
        .arg("idem:w")
        .exec(&mut watcher)
        .expect("WATCH");
    let refused = store
        .complete(Complete::new(
            "idem:w",
            &intruder,
            ValueKind::Json,
            b"\"x\"",
        ))
        .await;
    assert_eq!(refused.unwrap(), WriteReply::OtherOwner);
    let exec: Option<(String,)> = redis::pipe()
        .atomic()
        .cmd("PING")
        .query(&mut watcher)
        .expect("EXEC");
    assert_eq!(
        exec,
        Some(("PONG".to_owned(),)),
        "the refused complete touched the key (WATCH broken)"
    );
}

/// A complete sent again with the same token and result (its first reply
/// lost; the cluster client re-sends after an I/O error by itself) finds
/// its own result stored: `Done`, not the "lease lost" answer. Another
/// result is still refused. Standalone, cluster and memory alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resent_complete_finds_its_own_result_stored() {
    let server = RedisServer::start();
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let standalone = fast_store(&server.url()).await;
    let clustered = RedisStore::connect_cluster(&urls)
        .await
        .expect("connect to the test cluster");
    let memory = MemoryStore::new();
    let stores: [(&str, &dyn Store); 3] = [
        ("redis", &standalone),
        ("cluster", &clustered),
        ("memory", &memory),
    ];
    for (name, store) in stores {
        let token = Token::from_u128(3);
        let lease = Duration::from_secs(30);
        let r = store
            .claim(claim("idem:re", &token, lease, lease * 2))
            .await;
        assert_eq!(r.unwrap(), ClaimReply::Acquired { attempt: 1 }, "{name}");
        for _ in 0..2 {
            let done = store
                .complete(Complete::new("idem:re", &token, ValueKind::Json, b"42"))
                .await;
            assert_eq!(done.unwrap(), WriteReply::Done, "{name}");
        }
        let other = store
            .complete(Complete::new("idem:re", &token, ValueKind::Json, b"43"))
            .await;
        assert_eq!(other.unwrap(), WriteReply::AlreadyCompleted, "{name}");
    }
}

/// Scripts flushed from a healthy node while another primary hangs: the
/// healthy node's keys still work at the first attempt (the script is
/// loaded on the key's own node; a `SCRIPT LOAD` to every primary waits for
/// the hung one and fails).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noscript_is_recovered_on_healthy_nodes_while_one_hangs() {
    let cluster = RedisCluster::start();
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let cfg = RedisStoreConfig::default()
        .response_timeout(MS(500))
        .connection_timeout(MS(500));
    let store = RedisStore::connect_cluster_with(&urls, cfg)
        .await
        .expect("connect to the test cluster");
    // No re-sends: the first attempt after the flush must recover by itself
    // (release and extend are never re-sent; a failed release strands the
    // key for a lease).
    // Valkey 8.1+ completes with a plain SET: there a failing body's
    // release is the script that meets the flushed cache.
    let complete_is_a_script = store.complete_path() == "script";
    let idem = Idempotency::builder(store)
        .namespace("ns")
        .store_retries(0)
        .build();
    // Warm every node's script cache, then take node 2 down.
    for i in 0..30 {
        let r: Result<u32, Error> = idem
            .call("op", format!("warm-{i}"))
            .run(|| async { Ok(i) })
            .await;
        r.expect("warm-up call");
    }
    // Hung, not dead (a frozen VM, a stuck disk): connections to it stay
    // open and nothing answers, so a request to every primary waits for
    // it and times out.
    let hung = cluster.nodes()[2].pid().expect("node 2 runs");
    signal(hung, "-STOP");
    let healthy: Vec<String> = (0..200)
        .map(|i| format!("k{i}"))
        .filter(|k| cluster.slot_owner(&format!("ns:op:{k}")) != 2)
        .take(10)
        .collect();
    for node in 0..2 {
        assert_eq!(cluster.nodes()[node].cli(&["SCRIPT", "FLUSH"]), "OK");
    }
    let runs = AtomicUsize::new(0);
    for key in &healthy {
        if !complete_is_a_script {
            let failed: Result<u32, Error> = idem
                .call("op", key)
                .run(|| async { Err(Error::InvalidConfig("the body fails".into())) })
                .await;
            assert!(
                matches!(failed, Err(Error::InvalidConfig(_))),
                "{key}: {failed:?}"
            );
        }
        let r: Result<(u32, Outcome), Error> = idem
            .call("op", key)
            .run_outcome(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(1)
            })
            .await;
        assert_eq!(r.expect(key), (1, Outcome::Executed), "{key}");
        let again: Result<(u32, Outcome), Error> =
            idem.call("op", key).run_outcome(|| async { Ok(2) }).await;
        assert_eq!(again.expect(key), (1, Outcome::Replayed), "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), healthy.len());
    // The path under test was taken: the healthy nodes answered NOSCRIPT.
    let noscript: u64 = (0..2)
        .filter_map(|node| {
            cluster.nodes()[node]
                .cli(&["INFO", "errorstats"])
                .lines()
                .find_map(|l| l.trim().strip_prefix("errorstat_NOSCRIPT:count="))
                .and_then(|c| c.trim().parse::<u64>().ok())
        })
        .sum();
    assert!(noscript >= 1, "no NOSCRIPT was answered");
    signal(hung, "-CONT");
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}");
}

/// `.ttl(1s)` alone, with the builder's default 30 s lease, used to fail
/// every call with InvalidConfig. A TTL set alone now caps the lease;
/// a lease set explicitly over it is still refused.
#[tokio::test]
async fn a_short_ttl_alone_works_and_an_explicit_contradiction_is_refused() {
    let server = RedisServer::start();
    let redis = Idempotency::builder(fast_store(&server.url()).await).build();
    let memory = Idempotency::builder(MemoryStore::new()).build();
    for (name, idem) in [("redis", redis), ("memory", memory)] {
        let (v, o) = idem
            .call("op", "short")
            .ttl(Duration::from_secs(1))
            .run_outcome(|| async { Ok::<_, Error>(5) })
            .await
            .expect(name);
        assert_eq!((v, o), (5, Outcome::Executed), "{name}");
        let r: Result<u8, Error> = idem
            .call("op", "contradiction")
            .ttl(Duration::from_secs(1))
            .lease(Duration::from_secs(30))
            .run(|| async { Ok(1) })
            .await;
        assert!(
            matches!(&r, Err(Error::InvalidConfig(m)) if m.contains("longer than the result TTL")),
            "{name}: {r:?}"
        );
    }
}
