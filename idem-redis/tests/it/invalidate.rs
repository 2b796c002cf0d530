//! `forget` and the local replay caches of *other* processes:
//! a forget publishes the key on its namespace's channel, and every
//! `Idempotency` with `local_cache` on drops its copy, so it stops
//! replaying the evicted value. Each `Idempotency` here has a store of its
//! own (its own connections and subscriber), as two processes would.

use idem_core::{Error, Idempotency, MemoryStore, Outcome};
use idem_testkit::TestContext;
use std::time::Duration;

/// Calls `key` on `idem` until the body runs (the copy was dropped) or
/// 10 s pass; returns the last outcome. Without the invalidation the copy
/// would replay for the whole TTL (an hour).
async fn until_executed(idem: &Idempotency, key: &str, value: u32) -> Outcome {
    let mut last = Outcome::Replayed;
    for _ in 0..500 {
        let (_, o) = idem
            .call("charge", key)
            .run_outcome(|| async move { Ok::<_, Error>(value) })
            .await
            .unwrap();
        last = o;
        if o == Outcome::Executed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}

fn cached(idem_store: impl idem_core::store::Store) -> Idempotency {
    Idempotency::builder(idem_store)
        .namespace("payments")
        .result_ttl(Duration::from_secs(3600))
        .local_cache(1_000)
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_elsewhere_drops_the_cached_copy() {
    let memory = MemoryStore::new();
    let redis = TestContext::redis().await;
    let cluster = TestContext::redis_cluster().await;
    let pairs = vec![
        ("memory", cached(memory.clone()), cached(memory)),
        (
            "redis",
            cached(redis.connect().await),
            cached(redis.connect().await),
        ),
        (
            "cluster",
            cached(cluster.connect().await),
            cached(cluster.connect().await),
        ),
    ];
    for (name, a, b) in pairs {
        for i in 0..3 {
            let key = format!("order-{i}");
            let (v, o) = a
                .call("charge", &key)
                .run_outcome(|| async { Ok::<_, Error>(1_u32) })
                .await
                .unwrap();
            assert_eq!((v, o), (1, Outcome::Executed), "{name}");
            // B reads it from the store once, then from its cache.
            for _ in 0..2 {
                let (v, o) = b
                    .call("charge", &key)
                    .run_outcome(|| async { Ok::<_, Error>(2_u32) })
                    .await
                    .unwrap();
                assert_eq!((v, o), (1, Outcome::Replayed), "{name}");
            }
            assert!(a.forget("charge", &key).await.unwrap().is_some(), "{name}");
            assert_eq!(
                until_executed(&b, &key, 3).await,
                Outcome::Executed,
                "{name}: B kept replaying the forgotten value from its local cache"
            );
        }
    }
}

/// When B's subscriber connection is back after a drop, B empties its
/// cache (a forget published in the gap would be lost), so it reads the
/// store again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnected_subscriber_empties_the_cache() {
    let ctx = TestContext::redis().await;
    let a = cached(ctx.connect().await);
    let b = cached(ctx.connect().await);
    let key = "order-x";
    let _: u32 = a
        .call("charge", key)
        .run(|| async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    let _: u32 = b
        .call("charge", key)
        .run(|| async { Ok::<_, Error>(2) })
        .await
        .unwrap();
    // Deleted behind idem's back (no publish), then the subscribers cut.
    assert_eq!(ctx.server().cli(&["DEL", "payments:charge:order-x"]), "1");
    let killed: u32 = ctx
        .server()
        .cli(&["CLIENT", "KILL", "TYPE", "pubsub"])
        .trim()
        .parse()
        .unwrap();
    assert!(killed >= 1, "no subscriber connection to cut");
    assert_eq!(until_executed(&b, key, 3).await, Outcome::Executed);
}

/// The other process of `a_forget_in_another_process_drops_the_copy`: runs
/// only when re-executed with `IDEM_CACHE_WORKER` set. It caches the key,
/// says so (`ready`), then calls it every 20 ms until its body runs (the
/// copy was dropped) and says so (`executed`).
#[test]
fn cache_worker() {
    let Some(dir) = std::env::var_os("IDEM_CACHE_WORKER") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    let url = std::env::var("IDEM_URL").expect("worker: IDEM_URL");
    idem_testkit::run_worker(async move {
        let idem = cached(
            idem_redis::RedisStore::connect(&url)
                .await
                .expect("worker: connect"),
        );
        let call = || async {
            idem.call("charge", "shared")
                .run_outcome(|| async { Ok::<_, Error>(2_u32) })
                .await
                .expect("worker: call")
        };
        assert_eq!(call().await, (1, Outcome::Replayed));
        std::fs::write(dir.join("ready"), b"").unwrap();
        for _ in 0..1_000 {
            if call().await.1 == Outcome::Executed {
                std::fs::write(dir.join("executed"), b"").unwrap();
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    std::process::exit(0);
}

/// Two OS processes: this one completes and forgets a key, the other has it
/// in its local cache and stops replaying it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_in_another_process_drops_the_copy() {
    let ctx = TestContext::redis().await;
    let here = cached(ctx.connect().await);
    let (v, _) = here
        .call("charge", "shared")
        .run_outcome(|| async { Ok::<_, Error>(1_u32) })
        .await
        .unwrap();
    assert_eq!(v, 1);
    let dir = std::env::temp_dir().join(format!("idem-invalidate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "invalidate::cache_worker",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("IDEM_CACHE_WORKER", &dir)
        .env("IDEM_URL", ctx.server().url())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("re-execute the test binary as the other process");
    let wait_for = |name: &str| {
        let path = dir.join(name);
        async move {
            for _ in 0..1_000 {
                if path.exists() {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            false
        }
    };
    assert!(
        wait_for("ready").await,
        "the other process never cached the key"
    );
    assert!(here.forget("charge", "shared").await.unwrap().is_some());
    let dropped = wait_for("executed").await;
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        dropped,
        "the other process kept replaying the forgotten key from its local cache"
    );
}

/// The point of `local_cache`: a hot completed key replays from process
/// memory, with no round trip. Counted on the server (`INFO
/// commandstats`): once the store's feed of forgotten keys is live, a
/// replay sends nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_replays_from_the_cache_without_a_round_trip() {
    let server = idem_testkit::RedisServer::start();
    let store = idem_redis::RedisStore::connect(&server.url())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", server.url()));
    let idem = cached(store);
    let call = || {
        idem.call("charge", "hot")
            .run_outcome(|| async { Ok::<_, Error>(7_u32) })
    };
    assert_eq!(call().await.unwrap(), (7, Outcome::Executed));
    let sent = |server: &idem_testkit::RedisServer| -> u64 {
        let stats = server.cli(&["INFO", "commandstats"]);
        stats
            .lines()
            .filter_map(|l| {
                l.split_once("calls=")?
                    .1
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    // The feed of forgotten keys is confirmed live asynchronously: give
    // it up to 10 s, then every replay must come from the cache.
    let mut quiet = false;
    for _ in 0..500 {
        assert_eq!(server.cli(&["CONFIG", "RESETSTAT"]), "OK");
        for _ in 0..10 {
            assert_eq!(call().await.unwrap(), (7, Outcome::Replayed));
        }
        // CONFIG RESETSTAT and INFO themselves are not counted before
        // INFO runs; anything else is a replay's round trip.
        if sent(&server) <= 1 {
            quiet = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        quiet,
        "replays of a hot key still reach Redis: {}",
        server.cli(&["INFO", "commandstats"])
    );
}
