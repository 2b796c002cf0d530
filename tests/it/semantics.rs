//! The core semantics, run against a real redis-server, against a real
//! PostgreSQL (PgStore, a fresh database per test), against DynamoDB
//! (DynamoStore, a table of its own per test on the local AWS endpoint) and
//! against MemoryStore: every store must behave as one state machine.

use idem::store::{Claim, ClaimReply, Complete, Token, ValueKind, WriteReply};
use idem::{Error, FailMode, Idempotency, Outcome, RedisStore};
use idem_testkit::{RedisServer, TestContext};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use std::collections::{BTreeMap, HashSet};
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

idem_testkit::every_store!(
    namespace = "test", stores = [redis, postgres, postgres_partitioned, dynamodb, memory];
    exactly_once_64_tasks,
    replays_every_value,
    err_releases,
    panic_releases,
    cancellation_mid_body_keeps_the_key_for_the_lease,
    cancellation_with_release_on_cancel_releases_at_once,
    body_learns_its_lease_is_lost_when_taken_over,
    frozen_holder_is_taken_over_and_late_complete_refused,
    a_late_holder_that_requires_final_results_gets_lease_lost,
    keep_alive_holds_the_key_past_the_lease,
    wait_gets_the_first_result,
    wait_takes_over_from_a_dead_holder,
    fingerprint_mismatch,
    ttl_expiry_runs_again,
    namespace_and_scope_isolation,
    awkward_keys_work,
    bad_keys_refused_before_the_body,
    stored_type_mismatch_is_codec,
    same_token_resend_is_acquired_again,
    late_writes_by_old_owner_are_refused,
    an_old_holders_complete_of_the_stored_result_itself_is_done,
    an_old_holder_that_returns_the_stored_result_itself_reports_executed,
);

type Res<T> = Result<T, Error>;

async fn exactly_once_64_tasks(b: TestContext) {
    let idem = b.idem();
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (idem, runs) = (idem.clone(), runs.clone());
        tasks.push(tokio::spawn(async move {
            idem.call("once", "k1")
                .wait(Duration::from_secs(10))
                .run_outcome(|| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Res::Ok(77u32)
                })
                .await
        }));
    }
    let mut outcomes = BTreeMap::new();
    for t in tasks {
        let (v, o) = t.await.unwrap().unwrap();
        assert_eq!(v, 77);
        *outcomes.entry(o.as_str()).or_insert(0) += 1;
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(outcomes.get("executed"), Some(&1));
    assert_eq!(outcomes.get("replayed"), Some(&63));

    // Without waiting, duplicates in flight get InProgress, never a second run.
    let runs = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let (idem, runs) = (idem.clone(), runs.clone());
        tasks.push(tokio::spawn(async move {
            idem.call("once", "k2")
                .run(|| async {
                    runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Res::Ok(())
                })
                .await
        }));
    }
    let (mut ok, mut busy) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(()) => ok += 1,
            Err(Error::InProgress { retry_after }) => {
                assert!(retry_after > Duration::ZERO);
                busy += 1
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(ok + busy, 64);
    assert!(ok >= 1);
}

async fn replay_one<T>(idem: &Idempotency, key: &str, value: T)
where
    T: Serialize + DeserializeOwned + Clone + PartialEq + Debug + Send + 'static,
{
    let runs = AtomicUsize::new(0);
    for expected in [Outcome::Executed, Outcome::Replayed, Outcome::Replayed] {
        let (v, o) = idem
            .call("values", key)
            .run_outcome(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Res::Ok(value.clone())
            })
            .await
            .unwrap();
        assert_eq!(v, value, "{key}");
        assert_eq!(o, expected, "{key}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1, "{key}");
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    cents: i64,
    tags: Vec<String>,
}

async fn replays_every_value(b: TestContext) {
    let idem = b.idem();
    replay_one(&idem, "zero", 0u64).await;
    replay_one(&idem, "false", false).await;
    replay_one(&idem, "unit", ()).await;
    replay_one(&idem, "none", Option::<u32>::None).await;
    replay_one(&idem, "empty-vec", Vec::<u8>::new()).await;
    replay_one(&idem, "empty-map", BTreeMap::<String, u32>::new()).await;
    replay_one(&idem, "empty-string", String::new()).await;
    replay_one(&idem, "negative", -1i32).await;
    replay_one(&idem, "float", 0.1f64).await;
    replay_one(
        &idem,
        "struct",
        Receipt {
            id: "r-1 ünï".into(),
            cents: 500,
            tags: vec![],
        },
    )
    .await;
}

async fn err_releases(b: TestContext) {
    let idem = b.idem();
    let r: Result<u32, Declined> = idem
        .call("err", "k")
        .run(|| async { Err(Declined("card declined".to_owned())) })
        .await;
    assert_eq!(r, Err(Declined("card declined".to_owned())));
    let (v, o) = idem
        .call("err", "k")
        .run_outcome(|| async { Res::Ok(5u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (5, Outcome::Executed));
}

/// A user error type: the body's own errors pass through untouched.
#[derive(Debug, PartialEq)]
struct Declined(String);

impl From<Error> for Declined {
    fn from(e: Error) -> Declined {
        Declined(e.to_string())
    }
}

async fn panic_releases(b: TestContext) {
    let idem = b.idem();
    let i2 = idem.clone();
    let joined = tokio::spawn(async move {
        i2.call("panic", "k")
            .run(|| async {
                if true {
                    panic!("body blew up");
                }
                Res::Ok(1u32)
            })
            .await
    })
    .await;
    assert!(joined.unwrap_err().is_panic());
    // Released before the panic propagated: the next call runs at once.
    let (v, o) = idem
        .call("panic", "k")
        .run_outcome(|| async { Res::Ok(2u32) })
        .await
        .unwrap();
    assert_eq!((v, o), (2, Outcome::Executed));
}

/// Starts a call of `cancel/k` whose body never ends, then aborts it
/// mid-body. Returns when the call was started: its claim reached the store
/// after that, so its lease ends no sooner than a lease later.
async fn cancel_mid_body(idem: &Idempotency, release_on_cancel: bool) -> tokio::time::Instant {
    let started = tokio::time::Instant::now();
    let (entered_tx, entered_rx) = oneshot::channel();
    let i2 = idem.clone();
    let task = tokio::spawn(async move {
        let call = i2.call("cancel", "k");
        let call = if release_on_cancel {
            call.release_on_cancel()
        } else {
            call
        };
        call.run(|| async move {
            let _ = entered_tx.send(());
            std::future::pending::<()>().await;
            Res::Ok(())
        })
        .await
    });
    entered_rx.await.unwrap();
    task.abort();
    let _ = task.await;
    started
}

async fn cancellation_mid_body_keeps_the_key_for_the_lease(b: TestContext) {
    // The body may have made effects: its key is not released, so the next
    // caller waits for the lease to end and then knows it is a re-run.
    let lease = Duration::from_secs(1);
    let idem = b.idem_with(|x| x.lease(lease));
    let started = cancel_mid_body(&idem, false).await;
    let r = idem
        .call("cancel", "k")
        .run_outcome(|| async { Res::Ok(()) })
        .await;
    // Answered within the lease (unless the machine stalled for a whole
    // lease), the key must still be held.
    if started.elapsed() < lease {
        assert!(
            matches!(r, Err(Error::InProgress { .. })),
            "released: {r:?}"
        );
    }
    let (_, o) = idem
        .call("cancel", "k")
        .wait(Duration::from_secs(20))
        .run_outcome(|| async { Res::Ok(()) })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Recovered);
}

async fn cancellation_with_release_on_cancel_releases_at_once(b: TestContext) {
    // A 60 s lease: anything that frees the key sooner is the release.
    let idem = b.idem_with(|x| x.lease(Duration::from_secs(60)));
    cancel_mid_body(&idem, true).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match idem
            .call("cancel", "k")
            .run_outcome(|| async { Res::Ok(()) })
            .await
        {
            Ok((_, o)) => {
                assert_eq!(o, Outcome::Executed);
                break;
            }
            Err(Error::InProgress { .. }) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => panic!("key not released after cancellation: {e}"),
        }
    }
}

async fn body_learns_its_lease_is_lost_when_taken_over(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let (entered_tx, entered_rx) = oneshot::channel();
    let outside = idem::lease();
    assert!(outside.is_none(), "no lease outside a body");
    // The holder's body waits for its lease to be lost; the holder is then
    // not polled (frozen) for longer than the lease.
    let mut old = Box::pin(idem.call("lost", "k").run_outcome(|| async move {
        let lease = idem::lease().expect("a body has a lease");
        assert!(!lease.is_lost());
        let _ = entered_tx.send(());
        lease.lost().await;
        Res::Ok("old".to_owned())
    }));
    tokio::select! {
        r = &mut old => panic!("the holder ended early: {r:?}"),
        r = entered_rx => r.unwrap(),
    }
    let (v, o) = idem
        .call("lost", "k")
        .wait(Duration::from_secs(20))
        .run_outcome(|| async { Res::Ok("new".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("new", Outcome::Recovered));
    // Polled again, the old body hears that its lease is gone and stops;
    // its late result is not stored.
    let (v, o) = tokio::time::timeout(Duration::from_secs(20), old)
        .await
        .expect("the old body heard that its lease was lost")
        .unwrap();
    assert_eq!((v.as_str(), o), ("old", Outcome::LeaseLost));
    let (v, o) = idem
        .call("lost", "k")
        .run_outcome(|| async { Res::Ok("third".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("new", Outcome::Replayed));
}

async fn frozen_holder_is_taken_over_and_late_complete_refused(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let mut old = Box::pin(idem.call("frozen", "k").run_outcome(move || async move {
        g2.notified().await;
        Res::Ok("old holder".to_owned())
    }));
    // Poll until the claim is held and the body waits, then stop polling:
    // a frozen holder renews nothing.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut old)
            .await
            .is_err()
    );
    let busy = idem
        .call("frozen", "k")
        .run(|| async { Res::Ok("too early".to_owned()) })
        .await;
    assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
    tokio::time::sleep(lease * 2).await;

    let (v, o) = idem
        .call("frozen", "k")
        .run_outcome(|| async { Res::Ok("new holder".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("new holder", Outcome::Recovered));

    // The old holder wakes up and finishes: it gets its own value, but its
    // complete is refused and the stored value stays the new holder's.
    gate.notify_one();
    let (v, _) = old.await.unwrap();
    assert_eq!(v, "old holder");
    let (v, o) = idem
        .call("frozen", "k")
        .run_outcome(|| async { Res::Ok("third".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("new holder", Outcome::Replayed));
}

/// Under `require_final(true)`, a holder whose lease was taken over while
/// it was frozen gets `Error::LeaseLost` from `run` (its result was not
/// stored), not `Ok` with a value later calls never replay.
async fn a_late_holder_that_requires_final_results_gets_lease_lost(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease).require_final(true));
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let mut old = Box::pin(idem.call("frozen", "k").run(move || async move {
        g2.notified().await;
        Res::Ok("old holder".to_owned())
    }));
    // Claimed, then no longer polled: a frozen holder renews nothing.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut old)
            .await
            .is_err()
    );
    tokio::time::sleep(lease * 2).await;
    let taken = idem
        .call("frozen", "k")
        .run(|| async { Res::Ok("new holder".to_owned()) })
        .await;
    assert_eq!(taken.ok().as_deref(), Some("new holder"));
    gate.notify_one();
    let late = old.await;
    assert!(
        matches!(&late, Err(e @ Error::LeaseLost) if e.is_retryable()),
        "{late:?}"
    );
}

async fn keep_alive_holds_the_key_past_the_lease(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let runs = Arc::new(AtomicUsize::new(0));
    let (i2, r2) = (idem.clone(), runs.clone());
    let first = tokio::spawn(async move {
        i2.call("long", "k")
            .run(|| async move {
                r2.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(lease * 4).await;
                Res::Ok(1u8)
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Well past the lease, the running holder still has the key.
    for _ in 0..5 {
        tokio::time::sleep(lease / 2).await;
        let r = idem
            .call("long", "k")
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Res::Ok(2u8)
            })
            .await;
        assert!(matches!(r, Err(Error::InProgress { .. }) | Ok(1)), "{r:?}");
    }
    assert_eq!(first.await.unwrap().unwrap(), 1);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn wait_gets_the_first_result(b: TestContext) {
    let idem = b.idem();
    let runs = Arc::new(AtomicUsize::new(0));
    let (i2, r2) = (idem.clone(), runs.clone());
    let first = tokio::spawn(async move {
        i2.call("wait", "k")
            .run(|| async move {
                r2.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(300)).await;
                Res::Ok("first".to_owned())
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (v, o) = idem
        .call("wait", "k")
        .wait(Duration::from_secs(5))
        .run_outcome(|| async {
            runs.fetch_add(1, Ordering::SeqCst);
            Res::Ok("second".to_owned())
        })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("first", Outcome::Replayed));
    assert_eq!(first.await.unwrap().unwrap(), "first");
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A wait shorter than the holder's body ends in InProgress.
    let i3 = idem.clone();
    let slow = tokio::spawn(async move {
        i3.call("wait", "slow")
            .run(|| async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                Res::Ok(())
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = idem
        .call("wait", "slow")
        .wait(Duration::from_millis(100))
        .run(|| async { Res::Ok(()) })
        .await;
    assert!(matches!(r, Err(Error::InProgress { .. })), "{r:?}");
    slow.await.unwrap().unwrap();
}

async fn wait_takes_over_from_a_dead_holder(b: TestContext) {
    let idem = b.idem_with(|x| x.lease(Duration::from_millis(300)));
    let mut dead = Box::pin(idem.call("dead", "k").run(|| async {
        std::future::pending::<()>().await;
        Res::Ok(0u8)
    }));
    assert!(
        tokio::time::timeout(Duration::from_millis(50), &mut dead)
            .await
            .is_err()
    );
    // The holder is never polled again (a frozen process), nor dropped.
    std::mem::forget(dead);
    let (v, o) = idem
        .call("dead", "k")
        .wait(Duration::from_secs(5))
        .run_outcome(|| async { Res::Ok(9u8) })
        .await
        .unwrap();
    assert_eq!((v, o), (9, Outcome::Recovered));
}

async fn fingerprint_mismatch(b: TestContext) {
    let idem = b.idem();
    let body = |n: u32| move || async move { Res::Ok(n) };
    assert_eq!(
        idem.call("fp", "k")
            .fingerprint(&("EUR", 5))
            .run(body(1))
            .await
            .unwrap(),
        1
    );
    // Same payload: replay. Other payload: refused. No fingerprint: replay.
    assert_eq!(
        idem.call("fp", "k")
            .fingerprint(&("EUR", 5))
            .run(body(2))
            .await
            .unwrap(),
        1
    );
    let r = idem
        .call("fp", "k")
        .fingerprint(&("USD", 5))
        .run(body(3))
        .await;
    assert!(matches!(r, Err(Error::FingerprintMismatch)), "{r:?}");
    assert_eq!(idem.call("fp", "k").run(body(4)).await.unwrap(), 1);

    // In flight with another payload is refused too.
    let i2 = idem.clone();
    let holder = tokio::spawn(async move {
        i2.call("fp", "busy")
            .fingerprint("a")
            .run(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Res::Ok(1u32)
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = idem.call("fp", "busy").fingerprint("b").run(body(2)).await;
    assert!(matches!(r, Err(Error::FingerprintMismatch)), "{r:?}");
    holder.await.unwrap().unwrap();
}

async fn ttl_expiry_runs_again(b: TestContext) {
    let idem = b.idem_with(|x| {
        x.result_ttl(Duration::from_millis(400))
            .lease(Duration::from_millis(200))
    });
    let run = |n: u32| {
        idem.call("ttl", "k")
            .run_outcome(move || async move { Res::Ok(n) })
    };
    assert_eq!(run(1).await.unwrap(), (1, Outcome::Executed));
    assert_eq!(run(2).await.unwrap(), (1, Outcome::Replayed));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(run(3).await.unwrap(), (3, Outcome::Executed));
    // A per-call TTL overrides the builder's.
    let long = |n: u32| {
        idem.call("ttl", "long")
            .ttl(Duration::from_secs(60))
            .run_outcome(move || async move { Res::Ok(n) })
    };
    assert_eq!(long(1).await.unwrap(), (1, Outcome::Executed));
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(long(2).await.unwrap(), (1, Outcome::Replayed));
}

async fn namespace_and_scope_isolation(b: TestContext) {
    let a = b.idem_with(|x| x.namespace("svc-a"));
    let other = b.idem_with(|x| x.namespace("svc-b"));
    let run = |idem: &Idempotency, scope: &'static str, n: u32| {
        let idem = idem.clone();
        async move {
            idem.call(scope, "same-key")
                .run_outcome(move || async move { Res::Ok(n) })
                .await
                .unwrap()
        }
    };
    assert_eq!(run(&a, "charge", 1).await, (1, Outcome::Executed));
    assert_eq!(run(&other, "charge", 2).await, (2, Outcome::Executed));
    assert_eq!(run(&a, "refund", 3).await, (3, Outcome::Executed));
    // A scope and key that would meet if ':' were not escaped.
    assert_eq!(run(&a, "charge:same-key", 4).await.1, Outcome::Executed);
    assert_eq!(run(&a, "charge", 5).await, (1, Outcome::Replayed));
    assert_eq!(run(&other, "charge", 6).await, (2, Outcome::Replayed));
}

async fn awkward_keys_work(b: TestContext) {
    let idem = b.idem();
    let keys = [
        "{tag}",
        "a{b}c",
        "}{",
        "a:b:c",
        "with spaces in it",
        "ünïcödé-ключ-鍵-🔑",
        "%3A",
        &"x".repeat(255),
    ];
    let mut seen = HashSet::new();
    for (i, key) in keys.iter().enumerate() {
        for expected in [Outcome::Executed, Outcome::Replayed] {
            let (v, o) = idem
                .call("awkward", key)
                .run_outcome(|| async move { Res::Ok(i) })
                .await
                .unwrap();
            assert_eq!((v, o), (i, expected), "{key}");
        }
        assert!(seen.insert(*key));
    }
}

async fn bad_keys_refused_before_the_body(b: TestContext) {
    let idem = b.idem();
    let runs = AtomicUsize::new(0);
    let long = "x".repeat(256);
    for key in ["", long.as_str(), "a\nb", "nul\0", "tab\t", "esc\u{1b}"] {
        let r = idem
            .call("bad", key)
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Res::Ok(())
            })
            .await;
        match r {
            Err(Error::InvalidKey(e)) => assert!(!e.to_string().is_empty()),
            other => panic!("{key:?}: {other:?}"),
        }
    }
    let r = idem.call("", "k").run(|| async { Res::Ok(()) }).await;
    assert!(matches!(r, Err(Error::InvalidKey(_))), "{r:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

async fn stored_type_mismatch_is_codec(b: TestContext) {
    let idem = b.idem();
    idem.call("types", "k")
        .run(|| async { Res::Ok(7u32) })
        .await
        .unwrap();
    let r = idem
        .call("types", "k")
        .run(|| async {
            Res::Ok(Receipt {
                id: String::new(),
                cents: 0,
                tags: vec![],
            })
        })
        .await;
    match r {
        Err(Error::Codec { reason: msg, .. }) => assert!(msg.contains("Receipt"), "{msg}"),
        other => panic!("{other:?}"),
    }
}

async fn same_token_resend_is_acquired_again(b: TestContext) {
    let store = b.store();
    let (a, other) = (Token::from_u128(1), Token::from_u128(2));
    let claim = |token| {
        Claim::new(
            "raw:resend",
            token,
            Duration::from_secs(10),
            Duration::from_secs(60),
        )
    };
    assert_eq!(
        store.claim(claim(&a)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert_eq!(
        store.claim(claim(&a)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    assert!(matches!(
        store.claim(claim(&other)).await.unwrap(),
        ClaimReply::InProgress { .. }
    ));
    assert_eq!(
        store.release("raw:resend", &a).await.unwrap(),
        WriteReply::Done
    );
}

async fn late_writes_by_old_owner_are_refused(b: TestContext) {
    let store = b.store();
    let (old, new) = (Token::from_u128(1), Token::from_u128(2));
    let claim = |token| {
        Claim::new(
            "raw:late",
            token,
            Duration::from_millis(100),
            Duration::from_secs(60),
        )
    };
    let ttl = Duration::from_secs(60);
    assert_eq!(
        store.claim(claim(&old)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.claim(claim(&new)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    for reply in [
        store
            .complete(Complete::new("raw:late", &old, ValueKind::Json, b"1"))
            .await,
        store.extend("raw:late", &old, ttl).await,
        store.release("raw:late", &old).await,
    ] {
        assert_eq!(reply.unwrap(), WriteReply::OtherOwner);
    }
    assert_eq!(
        store
            .complete(Complete::new("raw:late", &new, ValueKind::Json, b"2"))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store
            .complete(Complete::new("raw:late", &old, ValueKind::Json, b"1"))
            .await
            .unwrap(),
        WriteReply::AlreadyCompleted
    );
    match store.claim(claim(&old)).await.unwrap() {
        ClaimReply::Completed(c) => assert_eq!(&c.value[..], b"2"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.release("raw:none", &old).await.unwrap(),
        WriteReply::Missing
    );
}

/// A stored result keeps no owner token, so a complete that finds the
/// record completed with exactly its own result (same kind, same bytes)
/// is taken for its own complete re-sent after a lost reply: `Done`, on
/// every store and every complete path (the script, a complete told its
/// claim). So an old holder whose key was taken over gets `Done` when the
/// new holder stored that very result, and `AlreadyCompleted` for any
/// other result or kind: what it reports `Done` for is, byte for byte,
/// what the key replays.
async fn an_old_holders_complete_of_the_stored_result_itself_is_done(b: TestContext) {
    let store = b.store();
    let (old, new) = (Token::from_u128(1), Token::from_u128(2));
    let claim = |token| {
        Claim::new(
            "raw:same",
            token,
            Duration::from_millis(100),
            Duration::from_secs(60),
        )
    };
    assert_eq!(
        store.claim(claim(&old)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        store.claim(claim(&new)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );
    assert_eq!(
        store
            .complete(Complete::of_claim(&claim(&new), ValueKind::Json, b"2"))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store
            .complete(Complete::of_claim(&claim(&old), ValueKind::Json, b"2"))
            .await
            .unwrap(),
        WriteReply::Done,
        "told its claim"
    );
    assert_eq!(
        store
            .complete(Complete::new("raw:same", &old, ValueKind::Json, b"2"))
            .await
            .unwrap(),
        WriteReply::Done,
        "the script"
    );
    assert_eq!(
        store
            .complete(Complete::new("raw:same", &old, ValueKind::Json, b"1"))
            .await
            .unwrap(),
        WriteReply::AlreadyCompleted,
        "another result"
    );
    assert_eq!(
        store
            .complete(Complete::new("raw:same", &old, ValueKind::Lz4Json, b"2"))
            .await
            .unwrap(),
        WriteReply::AlreadyCompleted,
        "another kind"
    );
    match store.claim(claim(&old)).await.unwrap() {
        ClaimReply::Completed(c) => {
            assert_eq!((c.kind, &c.value[..]), (ValueKind::Json, &b"2"[..]))
        }
        other => panic!("{other:?}"),
    }
}

/// A holder taken over that finishes after the new holder stored the
/// same result (same bytes) reports `Executed`, not `LeaseLost`: its
/// complete cannot be told from its own re-sent one, and the value it
/// returns is exactly what the key replays. The takeover is reported by
/// the new holder (`Recovered`). A different result is refused
/// (`LeaseLost`, `frozen_holder_is_taken_over_and_late_complete_refused`).
async fn an_old_holder_that_returns_the_stored_result_itself_reports_executed(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let gate = Arc::new(Notify::new());
    let g2 = gate.clone();
    let mut old = Box::pin(idem.call("same", "k").run_outcome(move || async move {
        g2.notified().await;
        Res::Ok("the result".to_owned())
    }));
    // Poll until the claim is held and the body waits, then stop polling:
    // a frozen holder renews nothing.
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut old)
            .await
            .is_err()
    );
    tokio::time::sleep(lease * 2).await;
    let (v, o) = idem
        .call("same", "k")
        .run_outcome(|| async { Res::Ok("the result".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("the result", Outcome::Recovered));
    gate.notify_one();
    let (v, o) = old.await.unwrap();
    assert_eq!((v.as_str(), o), ("the result", Outcome::Executed));
    let (v, o) = idem
        .call("same", "k")
        .run_outcome(|| async { Res::Ok("third".to_owned()) })
        .await
        .unwrap();
    assert_eq!((v.as_str(), o), ("the result", Outcome::Replayed));
}

// ---- Redis-only: other processes, server faults, raw records ----

#[test]
fn exactly_once_across_16_runtimes() {
    let server = RedisServer::start();
    let url = server.url();
    let runs = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(std::sync::Barrier::new(16));
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let (url, runs, start) = (url.clone(), runs.clone(), start.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    // Each runtime has its own connection.
                    let store = RedisStore::connect(&url).await.unwrap();
                    let idem = Idempotency::builder(store).namespace("rt").build();
                    start.wait();
                    idem.call("once", "shared")
                        .wait(Duration::from_secs(10))
                        .run_outcome(|| async {
                            runs.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            Res::Ok("done".to_owned())
                        })
                        .await
                        .unwrap()
                })
            })
        })
        .collect();
    let outcomes: Vec<Outcome> = threads.into_iter().map(|t| t.join().unwrap().1).collect();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Executed).count(),
        1
    );
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Replayed).count(),
        15
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_records_and_wrong_types_are_corrupt() {
    let b = TestContext::redis().await.with_namespace("test");
    let server = b.server();
    let idem = b.idem();
    let runs = AtomicUsize::new(0);
    server.cli(&["SET", "test:raw:garbage", "not an idem record"]);
    server.cli(&["SET", "test:raw:truncated", "1C"]);
    server.cli(&["SET", "test:raw:newer", "2Cxyz"]);
    server.cli(&["HSET", "test:raw:hash", "a", "1"]);
    server.cli(&["RPUSH", "test:raw:list", "a"]);
    for key in ["garbage", "truncated", "newer", "hash", "list"] {
        let r = idem
            .call("raw", key)
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                Res::Ok(1u8)
            })
            .await;
        match r {
            Err(Error::Corrupt { reason: msg, .. }) => {
                if key == "newer" {
                    assert!(msg.contains("newer"), "{msg}");
                }
            }
            other => panic!("{key}: {other:?}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // Nothing was overwritten.
    assert_eq!(
        server.cli(&["GET", "test:raw:garbage"]),
        "not an idem record"
    );
    assert_eq!(server.cli(&["TYPE", "test:raw:hash"]), "hash");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_then_recovers() {
    let mut b = TestContext::redis().await.with_namespace("test");
    let idem = b.idem();
    let runs = Arc::new(AtomicUsize::new(0));
    let body = |runs: Arc<AtomicUsize>| {
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Res::Ok(1u8)
        }
    };
    idem.call("down", "before")
        .run(body(runs.clone()))
        .await
        .unwrap();
    b.server_mut().kill();
    let r = idem.call("down", "k").run(body(runs.clone())).await;
    match r {
        Err(Error::Unavailable { op, .. }) => assert_eq!(op, "claim"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the body must not run while Redis is down"
    );

    b.server_mut().restart();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match idem.call("down", "k").run_outcome(body(runs.clone())).await {
            Ok((_, o)) => {
                assert_eq!(o, Outcome::Executed);
                break;
            }
            Err(Error::Unavailable { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("not back after restart: {e}"),
        }
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_runs_unprotected_when_redis_is_down() {
    let mut b = TestContext::redis().await.with_namespace("test");
    let idem = b.idem_with(|x| x.fail_mode(FailMode::Open));
    b.server_mut().kill();
    let (v, o) = idem
        .call("open", "k")
        .run_outcome(|| async { Res::Ok(3u8) })
        .await
        .unwrap();
    assert_eq!((v, o), (3, Outcome::Unprotected));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survives_script_flush() {
    let b = TestContext::redis().await.with_namespace("test");
    let server = b.server();
    let idem = b.idem();
    let run = |key: &'static str, n: u8| {
        idem.call("flush", key)
            .run_outcome(move || async move { Res::Ok(n) })
    };
    assert_eq!(run("a", 1).await.unwrap(), (1, Outcome::Executed));
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    assert_eq!(run("a", 2).await.unwrap(), (1, Outcome::Replayed));
    assert_eq!(run("b", 3).await.unwrap(), (3, Outcome::Executed));
    assert_eq!(server.cli(&["SCRIPT", "FLUSH"]), "OK");
    // Each script (claim, complete, release) reloads on its own.
    let r: Result<u8, Declined> = idem
        .call("flush", "c")
        .run(|| async { Err(Declined("no".into())) })
        .await;
    assert!(r.is_err());
    assert_eq!(run("c", 4).await.unwrap(), (4, Outcome::Executed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completed_record_is_compact() {
    let b = TestContext::redis().await.with_namespace("test");
    let server = b.server();
    let idem = b.idem();
    idem.call("s", "k")
        .run(|| async { Res::Ok(12345u32) })
        .await
        .unwrap();
    let raw = b.record("test:s:k").expect("the record");
    // "1" + "C" + fingerprint length 0 + value.
    assert_eq!(raw, b"1C\x0012345");
    let ttl: i64 = server.cli(&["PTTL", "test:s:k"]).parse().unwrap();
    assert!(ttl > 23 * 3600 * 1000, "default TTL is 24 h, got {ttl} ms");
}

/// A local cache serves only while it hears forgets. With
/// Redis gone, a hot key may replay from the cache until the subscriber
/// connection's loss is heard, and from then on the cache serves nothing:
/// calls fail closed, and no body runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_cache_stops_serving_once_its_feed_of_forgets_is_lost() {
    let mut b = TestContext::redis().await.with_namespace("test");
    let idem = b.idem_with(|x| {
        x.local_cache(1000)
            .result_ttl(Duration::from_secs(60))
            .lease(Duration::from_millis(500))
    });
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |key: &'static str, n: u32| {
        let (idem, runs) = (idem.clone(), runs.clone());
        async move {
            idem.call("cached", key)
                .fingerprint(&"payload")
                .run_outcome(|| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Res::Ok(n)
                })
                .await
        }
    };
    assert_eq!(call("hot", 1).await.unwrap(), (1, Outcome::Executed));
    assert_eq!(call("hot", 2).await.unwrap(), (1, Outcome::Replayed));
    let mismatch = idem
        .call("cached", "hot")
        .fingerprint(&"another payload")
        .run(|| async { Res::Ok(3u32) })
        .await;
    assert!(
        matches!(mismatch, Err(Error::FingerprintMismatch)),
        "{mismatch:?}"
    );
    b.server_mut().kill();
    let mut last = None;
    for _ in 0..100 {
        match call("hot", 4).await {
            Ok(replayed) => assert_eq!(replayed, (1, Outcome::Replayed)),
            Err(e) => {
                last = Some(e);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        matches!(last, Some(Error::Unavailable { .. })),
        "the cache kept serving after its feed of forgets was lost: {last:?}"
    );
    // A key that is not cached needs Redis too: fail-closed.
    assert!(matches!(
        call("cold", 5).await,
        Err(Error::Unavailable { .. })
    ));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
