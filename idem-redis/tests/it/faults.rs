//! Faults between idem and Redis, injected with `FaultProxy` (stall,
//! blackhole) or on the server itself (kill, restart, out of memory): no
//! fault turns into a silent duplicate run or a lost answer, every caller
//! ends with its value or a typed error, and nothing is stranded beyond the
//! lease.

use idem_core::store::ValueKind;
use idem_core::{Error, FailMode, Idempotency, Outcome};
use idem_redis::{RedisStore, RedisStoreConfig};
use idem_testkit::{
    BodyError, FaultProxy, Ledger, LogCapture, RecordPeek, RecordState, RedisServer, TestContext,
    eventually, is_typed_store_error, is_unavailable, record_state,
};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tracing::instrument::WithSubscriber;

#[allow(non_snake_case)]
fn MS(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

/// Short timeouts, so faults are noticed fast.
fn fast() -> RedisStoreConfig {
    RedisStoreConfig::default()
        .response_timeout(MS(200))
        .connection_timeout(MS(200))
        .reconnect_retries(1)
}

async fn store(url: &str) -> RedisStore {
    RedisStore::connect_with(url, fast())
        .await
        .expect("connect")
}

const PENDING: Option<RecordState> = Some(RecordState::Pending);
const COMPLETED: Option<RecordState> = Some(RecordState::Completed(ValueKind::Json));

/// A store behind a `FaultProxy` and one straight to the server: returns
/// the context, `idem` through the proxy, `other` past it (both with
/// namespace `ns` and `lease`), and a peek at the records on the server.
async fn proxied(ns: &str, lease: Duration) -> (TestContext, Idempotency, Idempotency, RecordPeek) {
    let ctx = TestContext::redis_behind_proxy(RedisServer::start(), fast())
        .await
        .with_namespace(ns);
    let idem = ctx.builder().lease(lease).build();
    let other = Idempotency::builder(ctx.connect_direct().await)
        .namespace(ns)
        .lease(lease)
        .build();
    let con = ctx.peek().await;
    (ctx, idem, other, con)
}

/// Waits until `key` exists on the server (the claim has landed).
async fn landed(con: &mut RecordPeek, key: &str) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if con.exists(key).await {
            return;
        }
        assert!(Instant::now() < end, "{key} never reached Redis");
        tokio::time::sleep(MS(1)).await;
    }
}

/// Calls `key` (namespace `f`) through the proxy with 100 ms of latency and,
/// once its claim has landed on the server, applies `fault` so that no reply
/// comes back: the call fails with `Unavailable`. Returns when the fault
/// began.
async fn reply_lost(
    idem: &Idempotency,
    ledger: &Ledger,
    con: &mut RecordPeek,
    proxy: &FaultProxy,
    key: &str,
    fault: impl FnOnce(&FaultProxy),
) -> Instant {
    proxy.set_latency(MS(100));
    let a = {
        let (idem, ledger, key) = (idem.clone(), ledger.clone(), key.to_owned());
        tokio::spawn(async move { call(&idem, &ledger, &key, "A").await })
    };
    landed(con, &format!("f:op:{key}")).await;
    fault(proxy);
    let fault_at = Instant::now();
    let r = a.await.unwrap();
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    fault_at
}

/// Calls `key` until it returns a value (the key is no longer stranded),
/// within `deadline`; returns the value, outcome and when it came.
async fn until_ok(
    idem: &Idempotency,
    ledger: &Ledger,
    key: &str,
    deadline: Duration,
) -> (String, Outcome) {
    eventually(&format!("a call of {key} succeeds"), deadline, || {
        let (idem, l, k) = (idem.clone(), ledger.clone(), key.to_owned());
        async move {
            let r = idem
                .call("op", &k)
                .run_outcome(|| async {
                    l.record(&k);
                    Ok::<_, Error>(format!("later-{k}"))
                })
                .await;
            match r {
                Ok(v) => Some(v),
                Err(e) if is_typed_store_error(&e) => None,
                Err(e) => panic!("{k}: {e}"),
            }
        }
    })
    .await
}

/// A call of `key` through `idem` whose body records its run and returns
/// `value`.
async fn call(
    idem: &Idempotency,
    ledger: &Ledger,
    key: &str,
    value: &str,
) -> Result<(String, Outcome), Error> {
    let (l, k, v) = (ledger.clone(), key.to_owned(), value.to_owned());
    idem.call("op", key)
        .run_outcome(|| async move {
            l.record(&k);
            Ok::<_, Error>(v)
        })
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_reply_stalled_no_run_and_the_key_frees_itself() {
    let lease = Duration::from_secs(1);
    let (ctx, idem, other, mut con) = proxied("f", lease).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();

    // The claim reaches Redis; its reply is held by the proxy.
    let landed_at = reply_lost(&idem, &ledger, &mut con, proxy, "stalled", |p| {
        p.stall(true)
    })
    .await;
    assert_eq!(
        ledger.count("stalled"),
        0,
        "the body must not run without a claim reply"
    );

    // The proxy stays stalled (the client never learns anything more): the
    // claim holds no longer than its lease; then another caller takes over.
    let r = call(&other, &ledger, "stalled", "B").await;
    assert!(matches!(r, Err(Error::InProgress { .. })), "{r:?}");
    let (v, o) = until_ok(&other, &ledger, "stalled", lease + Duration::from_secs(10)).await;
    assert!(
        landed_at.elapsed() >= lease - MS(100),
        "taken over before the lease ran out"
    );
    assert_eq!((v.as_str(), o), ("later-stalled", Outcome::Recovered));
    // The held claims and release finally arrive: they change nothing.
    let before = con.raw("f:op:stalled").await;
    proxy.stall(false);
    proxy.set_latency(MS(0));
    tokio::time::sleep(MS(300)).await;
    assert_eq!(con.raw("f:op:stalled").await, before);
    assert_eq!(
        call(&idem, &ledger, "stalled", "C").await.unwrap(),
        ("later-stalled".to_owned(), Outcome::Replayed)
    );
    assert_eq!(ledger.count("stalled"), 1);

    // Stall lifted before the lease: the held re-sent claims and the release
    // land in order, so the key is free again at once (no takeover needed).
    reply_lost(&idem, &ledger, &mut con, proxy, "lifted", |p| p.stall(true)).await;
    proxy.stall(false);
    proxy.set_latency(MS(0));
    let (v, o) = until_ok(&idem, &ledger, "lifted", Duration::from_secs(10)).await;
    assert_eq!(v, "later-lifted");
    assert!(matches!(o, Outcome::Executed | Outcome::Recovered), "{o:?}");
    assert_eq!(ledger.count("lifted"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_reply_blackholed_no_run_and_the_key_frees_itself() {
    let lease = Duration::from_secs(1);
    let (ctx, idem, other, mut con) = proxied("f", lease).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();

    let landed_at = reply_lost(&idem, &ledger, &mut con, proxy, "lost", |p| {
        p.blackhole(true)
    })
    .await;
    assert_eq!(ledger.count("lost"), 0);
    assert_eq!(
        con.state("f:op:lost").await,
        PENDING,
        "the lost claim landed"
    );
    let (v, o) = until_ok(&other, &ledger, "lost", lease + Duration::from_secs(10)).await;
    assert!(landed_at.elapsed() >= lease - MS(100));
    assert_eq!((v.as_str(), o), ("later-lost", Outcome::Recovered));
    assert_eq!(ledger.count("lost"), 1);
    proxy.blackhole(false);
    proxy.set_latency(MS(0));
}

/// After replies were lost inside a live connection (blackhole), the
/// connection must not pair later requests with the wrong replies: calls
/// through it, racing direct callers on the same keys, run each body at most
/// once and get their own key's value; and the connection serves calls again.
#[ignore = "known bug: redis-rs pairs replies with requests by order, so a reply lost inside a live \
            connection (FaultProxy::blackhole) shifts every later reply to the wrong request; idem then \
            returns another key's value. Needs replies bound to their request (see the reliability report)."]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_replies_never_pair_a_request_with_another_reply() {
    let (ctx, idem, direct, _) = proxied("pair", Duration::from_secs(5)).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();

    // Lose one call's requests inside the open connection.
    proxy.blackhole(true);
    let r = call(&idem, &ledger, "lost", "x").await;
    assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    proxy.blackhole(false);

    // Then race proxied and direct callers on the same keys.
    let keys: Vec<String> = (0..150).map(|i| format!("k-{i}")).collect();
    let mut tasks = Vec::new();
    for t in 0..16 {
        let which = if t % 2 == 0 {
            idem.clone()
        } else {
            direct.clone()
        };
        let (ledger, keys) = (ledger.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for k in keys {
                let (l, kk) = (ledger.clone(), k.clone());
                let r = which
                    .call("op", &k)
                    .run_outcome(|| async move {
                        l.record(&kk);
                        tokio::time::sleep(MS(3)).await;
                        Ok::<_, Error>(format!("v-{kk}"))
                    })
                    .await;
                out.push((t, k, r));
            }
            out
        }));
    }
    let mut errors = BTreeMap::<String, usize>::new();
    let mut wrong = Vec::new();
    for t in tasks {
        for (t, k, r) in t.await.unwrap() {
            match r {
                Ok((v, o)) => {
                    if v != format!("v-{k}") {
                        wrong.push(format!("task {t} asked {k}, got {v} ({o})"));
                    }
                }
                Err(e) if is_typed_store_error(&e) => {
                    let kind = if is_unavailable(&e) {
                        "unavailable"
                    } else {
                        "in_progress"
                    };
                    *errors
                        .entry(format!(
                            "{}:{kind}",
                            if t % 2 == 0 { "proxied" } else { "direct" }
                        ))
                        .or_default() += 1
                }
                Err(e) => panic!("{k}: {e:?}"),
            }
        }
    }
    eprintln!(
        "after the blackhole: typed errors {errors:?}; duplicates {:?}; wrong values {wrong:?}",
        ledger.duplicates()
    );
    assert_eq!(
        wrong,
        Vec::<String>::new(),
        "answers delivered to the wrong key"
    );
    assert_eq!(ledger.duplicates(), BTreeMap::new(), "bodies ran twice");
    // And the faulted connection works again.
    let (v, _) = until_ok(&idem, &ledger, "after", Duration::from_secs(10)).await;
    assert_eq!(v, "later-after");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn complete_lost_value_returned_and_recovered_by_takeover() {
    let lease = Duration::from_secs(1);
    let logs = LogCapture::new();
    let (ctx, idem, other, mut con) = proxied("c", lease).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();

    // The complete (and its re-sends) are lost: the caller still gets its value.
    let (l, p) = (ledger.clone(), proxy);
    let started_at = Instant::now();
    let r = idem
        .call("op", "lost-complete")
        .run_outcome(|| async move {
            l.record("lost-complete");
            p.blackhole(true);
            Ok::<_, Error>("A".to_owned())
        })
        .with_subscriber(logs.subscriber())
        .await;
    // The value comes back, and the outcome says it was not stored.
    assert_eq!(r.unwrap(), ("A".to_owned(), Outcome::NotStored));
    assert!(
        logs.contents().contains("could not be stored"),
        "{}",
        logs.contents()
    );
    assert_eq!(con.state("c:op:lost-complete").await, PENDING);
    // Not stranded: the next caller takes over after the lease (and knows it).
    let (v, o) = until_ok(
        &other,
        &ledger,
        "lost-complete",
        lease + Duration::from_secs(10),
    )
    .await;
    assert!(
        started_at.elapsed() >= lease - MS(100),
        "taken over before the lease ran out"
    );
    assert_eq!((v.as_str(), o), ("later-lost-complete", Outcome::Recovered));
    assert_eq!(ledger.count("lost-complete"), 2);
    proxy.blackhole(false);

    // A complete that is only delayed (stall lifted within the lease) is
    // stored: no second run.
    let lease = Duration::from_secs(3);
    let idem = Idempotency::builder(ctx.connect().await)
        .namespace("c")
        .lease(lease)
        .build();
    let (l, p) = (ledger.clone(), proxy);
    let unstall = async {
        tokio::time::sleep(MS(400)).await;
        p.stall(false);
    };
    let run = idem.call("op", "late-complete").run_outcome(|| async move {
        l.record("late-complete");
        p.stall(true);
        Ok::<_, Error>("A".to_owned())
    });
    let (r, ()) = tokio::join!(run, unstall);
    assert_eq!(r.unwrap(), ("A".to_owned(), Outcome::Executed));
    let rec = eventually(
        "the delayed complete lands",
        Duration::from_secs(10),
        || {
            let mut con = con.clone();
            async move {
                let rec = con.raw("c:op:late-complete").await;
                (record_state(rec.as_deref()) == COMPLETED).then_some(rec)
            }
        },
    )
    .await;
    assert!(rec.is_some());
    let r = call(&other, &ledger, "late-complete", "B").await.unwrap();
    assert_eq!(r, ("A".to_owned(), Outcome::Replayed));
    assert_eq!(ledger.count("late-complete"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_lost_error_returned_and_the_key_frees_itself() {
    let lease = Duration::from_secs(1);
    let (ctx, idem, other, mut con) = proxied("r", lease).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();

    // Release lost: the body's error is returned as is; the key is free after the lease.
    let p = proxy;
    let l = ledger.clone();
    let r: Result<String, BodyError> = idem
        .call("op", "lost-release")
        .run(|| async move {
            l.record("lost-release");
            p.blackhole(true);
            Err(BodyError::Boom("declined".into()))
        })
        .await;
    let failed_at = Instant::now();
    assert!(
        matches!(&r, Err(BodyError::Boom(m)) if m == "declined"),
        "{r:?}"
    );
    assert_eq!(con.state("r:op:lost-release").await, PENDING);
    let (v, _) = until_ok(
        &other,
        &ledger,
        "lost-release",
        lease + Duration::from_secs(10),
    )
    .await;
    assert!(failed_at.elapsed() >= lease / 2);
    assert_eq!(v, "later-lost-release");
    assert_eq!(
        ledger.count("lost-release"),
        2,
        "the failed run and the successful one"
    );
    proxy.blackhole(false);

    // Release delayed (stall lifted later): it lands and frees the key.
    let idem = Idempotency::builder(ctx.connect().await)
        .namespace("r")
        .lease(Duration::from_secs(30))
        .build();
    let l = ledger.clone();
    let r: Result<String, BodyError> = idem
        .call("op", "late-release")
        .run(|| async move {
            l.record("late-release");
            p.stall(true);
            Err(BodyError::Boom("declined".into()))
        })
        .await;
    assert!(matches!(&r, Err(BodyError::Boom(_))), "{r:?}");
    proxy.stall(false);
    eventually("the delayed release lands", Duration::from_secs(10), || {
        let mut con = con.clone();
        async move { con.raw("r:op:late-release").await.is_none().then_some(()) }
    })
    .await;
    let r = call(&other, &ledger, "late-release", "B").await.unwrap();
    assert_eq!(r, ("B".to_owned(), Outcome::Executed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_while_bodies_run_never_duplicates() {
    // Durable Redis (AOF, fsync on every write): records survive the kill,
    // so exactly-once must hold for every key, across the restart.
    let mut server = RedisServer::start_with(&["--appendonly", "yes", "--appendfsync", "always"]);
    let url = server.url();
    let lease = Duration::from_secs(4);
    let idem = Idempotency::builder(store(&url).await)
        .namespace("rs")
        .lease(lease)
        .build();
    let ledger = Ledger::new();
    let keys: Vec<String> = (0..150).map(|i| format!("k-{i}")).collect();

    let mut tasks = Vec::new();
    for t in 0..6usize {
        let (idem, ledger, keys) = (idem.clone(), ledger.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for (i, k) in keys.iter().enumerate().skip(t % 3) {
                let (l, kk) = (ledger.clone(), k.clone());
                let pause = 20 + (i as u64 * 7) % 60;
                let began = Instant::now();
                let r = idem
                    .call("op", k)
                    .run_outcome(|| async move {
                        l.record(&kk);
                        tokio::time::sleep(MS(pause)).await;
                        Ok::<_, Error>(format!("v-{kk}"))
                    })
                    .await;
                out.push((k.clone(), r, began, Instant::now()));
            }
            out
        }));
    }
    tokio::time::sleep(MS(400)).await;
    let restart_began = Instant::now();
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    let restart_ended = Instant::now();
    let mut kinds = BTreeMap::<&'static str, usize>::new();
    let (mut across, mut after) = (0, 0);
    for t in tasks {
        for (k, r, began, ended) in t.await.unwrap() {
            if began < restart_began && ended > restart_ended {
                across += 1;
            }
            if began > restart_ended {
                after += 1;
            }
            match r {
                Ok((v, o)) => {
                    assert_eq!(v, format!("v-{k}"));
                    *kinds.entry(o.as_str()).or_default() += 1;
                }
                Err(Error::InProgress { .. }) => *kinds.entry("in_progress").or_default() += 1,
                Err(e) if is_unavailable(&e) => *kinds.entry("unavailable").or_default() += 1,
                Err(e) => panic!("{k}: untyped failure across a restart: {e:?}"),
            }
        }
    }
    assert!(server.is_running());
    // Every key once more, waiting out any holder: a replay or a first run,
    // never a second one.
    for k in &keys {
        let (l, kk) = (ledger.clone(), k.clone());
        let (v, _) = idem
            .call("op", k)
            .wait(Duration::from_secs(20))
            .run_outcome(|| async move {
                l.record(&kk);
                Ok::<_, Error>(format!("v-{kk}"))
            })
            .await
            .unwrap_or_else(|e| panic!("{k} after the restart: {e}"));
        assert_eq!(v, format!("v-{k}"));
    }
    assert_eq!(ledger.duplicates(), BTreeMap::new());
    for k in &keys {
        assert_eq!(ledger.count(k), 1, "{k}");
    }
    assert!(across > 0 && after > 0, "the load did not span the restart");
    eprintln!(
        "restart while bodies run: {kinds:?}; {across} calls in flight across the restart, {after} after it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_fail_closed_is_unavailable_and_works_after_restart() {
    let mut server = RedisServer::start();
    let idem = Idempotency::builder(store(&server.url()).await)
        .namespace("k")
        .build();
    let ledger = Ledger::new();
    assert_eq!(
        call(&idem, &ledger, "before", "v").await.unwrap().1,
        Outcome::Executed
    );
    server.kill();
    for i in 0..3 {
        let r = call(&idem, &ledger, &format!("down-{i}"), "v").await;
        assert!(matches!(r, Err(Error::Unavailable { .. })), "{r:?}");
    }
    assert_eq!(
        ledger.total(),
        1,
        "no body runs while Redis is down (FailMode::Closed)"
    );
    server = tokio::task::spawn_blocking(move || {
        server.restart();
        server
    })
    .await
    .unwrap();
    let (v, o) = until_ok(&idem, &ledger, "down-0", Duration::from_secs(20)).await;
    assert_eq!((v.as_str(), o), ("later-down-0", Outcome::Executed));
    assert_eq!(
        call(&idem, &ledger, "down-0", "x").await.unwrap(),
        ("later-down-0".to_owned(), Outcome::Replayed)
    );
    assert_eq!(ledger.count("down-0"), 1);
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_runs_unprotected_with_a_warning() {
    let mut ctx = TestContext::redis_with(RedisServer::start(), fast())
        .await
        .with_namespace("open");
    let idem = ctx.builder().fail_mode(FailMode::Open).build();
    let ledger = ctx.ledger().clone();
    assert_eq!(
        call(&idem, &ledger, "k", "v").await.unwrap().1,
        Outcome::Executed
    );
    ctx.server_mut().kill();
    let logs = LogCapture::new();
    let r = call(&idem, &ledger, "k2", "open")
        .with_subscriber(logs.subscriber())
        .await;
    assert_eq!(r.unwrap(), ("open".to_owned(), Outcome::Unprotected));
    assert_eq!(ledger.count("k2"), 1);
    let text = logs.contents();
    assert!(text.contains("WARN"), "{text}");
    assert!(text.contains("WITHOUT idempotency protection"), "{text}");
    // A body error is returned as is, also unprotected.
    let r: Result<u8, BodyError> = idem
        .call("op", "k3")
        .run(|| async { Err(BodyError::Boom("no".into())) })
        .await;
    assert!(matches!(r, Err(BodyError::Boom(_))), "{r:?}");
}

/// Fills the server with 64 KiB strings until it refuses with OOM, then
/// lowers `maxmemory` a little under what is used, so that every write a
/// script could make is refused, whatever client buffers come and go.
fn fill(server: &RedisServer) -> usize {
    let mut con = server.connection();
    let blob = vec![b'x'; 64 * 1024];
    let mut i = 0;
    loop {
        let r: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("fill:{i}"))
            .arg(&blob)
            .query(&mut con);
        match r {
            Ok(()) => i += 1,
            Err(e) if e.code() == Some("OOM") => break,
            Err(e) => panic!("fill: {e}"),
        }
        assert!(i < 10_000, "maxmemory is not enforced");
    }
    let info: String = redis::cmd("INFO").arg("memory").query(&mut con).unwrap();
    let used: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used - 128 * 1024)
        .query(&mut con)
        .unwrap();
    i
}

/// A server with 2 MB of memory and no eviction, for [`fill`].
fn full_server() -> RedisServer {
    RedisServer::start_with(&["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
}

fn free(server: &RedisServer, n: usize) {
    let mut con = server.connection();
    for i in 0..n {
        let () = redis::cmd("DEL")
            .arg(format!("fill:{i}"))
            .query(&mut con)
            .unwrap();
    }
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("2mb")
        .query(&mut con)
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_claims_fail_cleanly_and_running_bodies_finish() {
    let ctx = TestContext::redis_with(full_server(), fast())
        .await
        .with_namespace("oom");
    let lease = Duration::from_secs(2);
    let idem = ctx.builder().lease(lease).build();
    let mut con = ctx.peek().await;
    let ledger = ctx.ledger().clone();
    assert_eq!(
        call(&idem, &ledger, "done", "stored").await.unwrap().1,
        Outcome::Executed
    );

    // Three bodies hold their keys while Redis fills up.
    let hold = |key: &'static str, ok: bool| {
        let (idem, l) = (idem.clone(), ledger.clone());
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            idem.call("op", key)
                .run_outcome(|| async move {
                    l.record(key);
                    started_tx.send(()).unwrap();
                    finish_rx.await.unwrap();
                    if ok {
                        Ok("finished".to_owned())
                    } else {
                        Err(BodyError::Boom("declined".into()))
                    }
                })
                .await
        });
        (task, started_rx, finish_tx)
    };
    let (releasing, s1, f1) = hold("releasing", false);
    let (completing, s2, f2) = hold("completing", true);
    let (renewing, s3, f3) = hold("renewing", true);
    s1.await.unwrap();
    s2.await.unwrap();
    s3.await.unwrap();
    let filled = fill(ctx.server());

    // New claims fail cleanly: typed, saying why, nothing written.
    for i in 0..5 {
        let key = format!("new-{i}");
        let r = call(&idem, &ledger, &key, "v").await;
        match &r {
            Err(Error::Unavailable { reason, .. }) => {
                assert!(reason.contains("memory"), "{reason}")
            }
            other => panic!("{key}: expected Unavailable (out of memory), got {other:?}"),
        }
        assert_eq!(ledger.count(&key), 0);
        assert_eq!(
            con.raw(&format!("oom:op:{key}")).await,
            None,
            "nothing half-written"
        );
    }
    // A body that fails while Redis is full still releases its key.
    f1.send(()).unwrap();
    assert!(matches!(releasing.await.unwrap(), Err(BodyError::Boom(_))));
    assert_eq!(
        con.raw("oom:op:releasing").await,
        None,
        "released under OOM"
    );
    // A body that runs on while Redis is full keeps its lease (extend is
    // allow-oom), and a duplicate sees that holder: InProgress, not
    // Unavailable (which FailMode::Open would answer by running the body).
    tokio::time::sleep(lease + MS(500)).await;
    let r = call(&idem, &ledger, "renewing", "x").await;
    assert!(
        matches!(&r, Err(Error::InProgress { retry_after }) if *retry_after <= lease),
        "{r:?}"
    );
    assert_eq!(con.state("oom:op:renewing").await, PENDING);
    // A body that succeeds while Redis is full: its value comes back and is kept.
    f2.send(()).unwrap();
    assert_eq!(
        completing.await.unwrap().unwrap(),
        ("finished".to_owned(), Outcome::Executed)
    );
    f3.send(()).unwrap();
    assert_eq!(
        renewing.await.unwrap().unwrap(),
        ("finished".to_owned(), Outcome::Executed)
    );

    free(ctx.server(), filled);
    // Memory back: new keys work; the finished bodies replay, never run again.
    assert_eq!(
        call(&idem, &ledger, "new-0", "v").await.unwrap(),
        ("v".to_owned(), Outcome::Executed)
    );
    for key in ["completing", "renewing"] {
        let r = call(&idem, &ledger, key, "again").await.unwrap();
        assert_eq!(r, ("finished".to_owned(), Outcome::Replayed), "{key}");
        assert_eq!(
            ledger.count(key),
            1,
            "{key} ran twice because its result could not be stored"
        );
    }
    assert_eq!(
        call(&idem, &ledger, "done", "x").await.unwrap(),
        ("stored".to_owned(), Outcome::Replayed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn out_of_memory_still_replays_stored_results_even_in_fail_open() {
    let ctx = TestContext::redis_with(full_server(), fast())
        .await
        .with_namespace("full");
    let closed = ctx.idem();
    let open = Idempotency::builder(ctx.connect().await)
        .namespace("full")
        .fail_mode(FailMode::Open)
        .build();
    let ledger = ctx.ledger().clone();
    assert_eq!(
        call(&closed, &ledger, "paid", "receipt").await.unwrap(),
        ("receipt".to_owned(), Outcome::Executed)
    );
    let filled = fill(ctx.server());

    // A full Redis still has the answer: it is replayed, never run again.
    let r = call(&closed, &ledger, "paid", "again").await;
    assert_eq!(r.unwrap(), ("receipt".to_owned(), Outcome::Replayed));
    let logs = LogCapture::new();
    let r = call(&open, &ledger, "paid", "again")
        .with_subscriber(logs.subscriber())
        .await;
    assert_eq!(
        r.unwrap(),
        ("receipt".to_owned(), Outcome::Replayed),
        "FailMode::Open ran a completed key again because Redis was full:\n{}",
        logs.contents()
    );
    assert_eq!(ledger.count("paid"), 1);
    // A new key cannot be recorded: Closed refuses, Open runs unprotected.
    let r = call(&closed, &ledger, "new", "v").await;
    assert!(
        matches!(&r, Err(Error::Unavailable { reason, .. }) if reason.contains("memory")),
        "{r:?}"
    );
    assert_eq!(
        call(&open, &ledger, "new", "v").await.unwrap(),
        ("v".to_owned(), Outcome::Unprotected)
    );
    free(ctx.server(), filled);
    assert_eq!(
        call(&closed, &ledger, "paid", "x").await.unwrap(),
        ("receipt".to_owned(), Outcome::Replayed)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_outage_past_the_lease_tells_the_body_and_the_next_holder_recovers() {
    let lease = MS(800);
    let (ctx, idem, other, _con) = proxied("l", lease).await;
    let proxy = ctx.proxy();
    let ledger = ctx.ledger().clone();
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel();
    let l = ledger.clone();
    // A long body that watches its lease; its store goes away mid-body.
    let a = tokio::spawn(async move {
        idem.call("op", "outage")
            .run_outcome(|| async move {
                l.record("outage");
                let lease = idem_core::lease().expect("a body has a lease");
                let _ = entered_tx.send(());
                let heard = tokio::time::timeout(Duration::from_secs(10), lease.lost()).await;
                if heard.is_ok() {
                    l.record("outage:heard");
                }
                Ok::<_, Error>("A".to_owned())
            })
            .await
    });
    entered_rx.await.unwrap();
    proxy.blackhole(true);
    // Past the lease the store gives the key to the next holder (which
    // reaches it directly), and says it is a re-run.
    let (v, o) = other
        .call("op", "outage")
        .wait(Duration::from_secs(30))
        .run_outcome(|| {
            let l = ledger.clone();
            async move {
                l.record("outage");
                Ok::<_, Error>("B".to_owned())
            }
        })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("B", Outcome::Recovered));
    let (v, o) = a.await.unwrap().unwrap();
    assert_eq!(
        ledger.count("outage:heard"),
        1,
        "the first body was not told that its lease was lost"
    );
    assert_eq!(v, "A");
    assert!(
        matches!(o, Outcome::NotStored | Outcome::LeaseLost),
        "{o:?}"
    );
    proxy.blackhole(false);
    assert_eq!(ledger.count("outage"), 2);
    let r = call(&other, &ledger, "outage", "C").await.unwrap();
    assert_eq!(r, ("B".to_owned(), Outcome::Replayed));
}
