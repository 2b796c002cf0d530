//! `idem::Batch`: several calls sharing their store round trips. Each call
//! must answer exactly as it would alone (on memory, Redis, a Redis
//! Cluster and PostgreSQL), the batch must cost two store round trips,
//! a slow body must not hold the others' results back, a cancelled batch
//! must keep the keys of bodies in flight and store the finished ones, and
//! batches racing over the same keys from several runtimes must run each
//! key's body once.

use idem::store::Store;
use idem::{
    Batch, Error, Idempotency, KeyState, MemoryStore, Outcome, RecordInfo, RedisStoreConfig,
};
use idem_testkit::{CountingStore, Ledger, RedisServer, TestContext};
use std::time::Duration;

#[derive(Debug, PartialEq)]
enum Seen {
    Ran(u32, Outcome),
    InProgress,
    Mismatch,
    InvalidKey,
    BodyFailed,
    Other(String),
}

#[derive(Debug)]
enum AppError {
    Idem(Error),
    Declined,
}

impl From<Error> for AppError {
    fn from(e: Error) -> Self {
        AppError::Idem(e)
    }
}

fn seen(r: &Result<(u32, Outcome), AppError>) -> Seen {
    match r {
        Ok((v, o)) => Seen::Ran(*v, *o),
        Err(AppError::Idem(Error::InProgress { .. })) => Seen::InProgress,
        Err(AppError::Idem(Error::FingerprintMismatch)) => Seen::Mismatch,
        Err(AppError::Idem(Error::InvalidKey(_))) => Seen::InvalidKey,
        Err(AppError::Declined) => Seen::BodyFailed,
        Err(AppError::Idem(e)) => Seen::Other(e.to_string()),
    }
}

/// One batch mixing every answer a call can get, checked against what
/// the same calls get alone, on `ctx`'s store.
async fn answers_as_single_calls(ctx: TestContext) {
    let store = ctx.name();
    let idem = ctx.idem();
    let ledger = ctx.ledger().clone();
    // Before the batch: "done" completed with 7, "other" completed under
    // payload 1.
    let _: u32 = idem
        .call("pay", "done")
        .run(|| async { Ok::<_, Error>(7) })
        .await
        .unwrap();
    let _: u32 = idem
        .call("pay", "other")
        .fingerprint(&1)
        .run(|| async { Ok::<_, Error>(8) })
        .await
        .unwrap();
    let keys = [
        "fresh-a", "done", "fresh-b", "fresh-a", "other", "", "fails",
    ];
    let batch: Batch = keys
        .iter()
        .map(|k| {
            let call = idem.call("pay", k);
            if *k == "other" {
                call.fingerprint(&2)
            } else {
                call
            }
        })
        .collect();
    let results = batch
        .run_outcome(|i| {
            let ledger = ledger.clone();
            async move {
                ledger.record(keys[i]);
                if keys[i] == "fails" {
                    return Err(AppError::Declined);
                }
                Ok(i as u32 * 10)
            }
        })
        .await;
    let got: Vec<Seen> = results.iter().map(seen).collect();
    assert_eq!(
        got,
        [
            Seen::Ran(0, Outcome::Executed),
            Seen::Ran(7, Outcome::Replayed),
            Seen::Ran(20, Outcome::Executed),
            Seen::InProgress,
            Seen::Mismatch,
            Seen::InvalidKey,
            Seen::BodyFailed,
        ],
        "on {store}"
    );
    for (key, runs) in [("fresh-a", 1), ("done", 0), ("fresh-b", 1), ("fails", 1)] {
        assert_eq!(ledger.count(key), runs, "{key} on {store}");
    }
    // The results are stored, the failed key released.
    let state = |info: Option<RecordInfo>| info.map(|i| i.state);
    for key in ["fresh-a", "fresh-b"] {
        let info = idem.inspect("pay", key).await.unwrap();
        assert_eq!(state(info), Some(KeyState::Completed), "{key} on {store}");
    }
    assert_eq!(state(idem.inspect("pay", "fails").await.unwrap()), None);
    // And a second batch replays what the first stored.
    let again: Batch = ["fresh-a", "fresh-b", "fails"]
        .iter()
        .map(|k| idem.call("pay", k))
        .collect();
    let again = again
        .run_outcome(|_| async { Ok::<u32, AppError>(99) })
        .await;
    let got: Vec<Seen> = again.iter().map(seen).collect();
    assert_eq!(
        got,
        [
            Seen::Ran(0, Outcome::Replayed),
            Seen::Ran(20, Outcome::Replayed),
            Seen::Ran(99, Outcome::Executed),
        ],
        "on {store}"
    );
}

#[tokio::test]
async fn each_call_answers_as_it_would_alone_on_memory() {
    answers_as_single_calls(TestContext::memory()).await;
}

#[tokio::test]
async fn each_call_answers_as_it_would_alone_on_redis() {
    answers_as_single_calls(TestContext::redis().await).await;
}

#[tokio::test]
async fn each_call_answers_as_it_would_alone_on_a_redis_cluster() {
    answers_as_single_calls(TestContext::redis_cluster().await).await;
}

#[tokio::test]
async fn each_call_answers_as_it_would_alone_on_postgres() {
    answers_as_single_calls(TestContext::postgres().await).await;
}

#[tokio::test]
async fn each_call_answers_as_it_would_alone_on_dynamodb() {
    answers_as_single_calls(TestContext::dynamodb().await).await;
}

#[tokio::test]
async fn a_batch_costs_one_claims_and_one_finishes_round_trip() {
    let store = CountingStore::new(MemoryStore::new());
    let counts = store.counts();
    let idem = Idempotency::builder(store).build();
    let batch: Batch = (0..64).map(|k| idem.call("orders", k)).collect();
    let results = batch
        .concurrency(8)
        .run_outcome(|i| async move {
            if i % 5 == 0 {
                Err(AppError::Declined)
            } else {
                Ok(i as u32)
            }
        })
        .await;
    assert_eq!(results.iter().filter(|r| r.is_ok()).count(), 51);
    assert_eq!(counts.claim_batches(), 1);
    assert_eq!(counts.finish_batches(), 1);
    assert_eq!(counts.singles(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_slow_body_does_not_hold_back_the_others_results() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(4))
        .build();
    let idem = &idem;
    let batch: Batch = ["quick", "slow"]
        .iter()
        .map(|k| idem.call("s", k))
        .collect();
    let results = batch
        .run_outcome(|i| async move {
            if i == 1 {
                // Ten leases: the quick one's result must be stored long
                // before, within a quarter of its lease.
                tokio::time::sleep(Duration::from_secs(40)).await;
                let quick = idem.inspect("s", "quick").await?.map(|i| i.state);
                assert_eq!(quick, Some(KeyState::Completed));
            }
            Ok::<_, Error>(i)
        })
        .await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// `run_each` hands a result over once it is stored, and a failed body's
/// error once its key is released, while a slower body of the same batch
/// still runs: the slow body waits for both to reach the caller (then finds
/// the failed key free), so a batch that held answers back would never end
/// (and the timeout fails it).
async fn each_result_comes_while_a_slower_body_runs(ctx: TestContext) {
    let store = ctx.name();
    let idem = ctx.idem();
    let (quick_seen, seen_quick) = tokio::sync::oneshot::channel::<()>();
    let (failed_seen, seen_failed) = tokio::sync::oneshot::channel::<()>();
    let mut signals = [Some(quick_seen), None, Some(failed_seen)];
    let waits = tokio::sync::Mutex::new(Some((seen_quick, seen_failed)));
    let batch: Batch = ["quick", "slow", "failing"]
        .iter()
        .map(|k| idem.call("s", k))
        .collect();
    let mut order = Vec::new();
    let run = batch.run_each(
        |i| {
            let (waits, idem) = (&waits, &idem);
            async move {
                match i {
                    1 => {
                        let waiting = waits.lock().await.take();
                        if let Some((quick, failed)) = waiting {
                            let _ = quick.await;
                            let _ = failed.await;
                        }
                        // Answered only once released: free by now.
                        let failing = idem.inspect("s", "failing").await?;
                        assert_eq!(failing, None, "{store}");
                        Ok(i)
                    }
                    2 => Err(AppError::Declined),
                    _ => Ok(i),
                }
            }
        },
        |i, result: Result<(usize, Outcome), AppError>| {
            if let Some(tx) = signals.get_mut(i).and_then(Option::take) {
                let _ = tx.send(());
            }
            order.push((i, result.is_ok()));
        },
    );
    tokio::time::timeout(Duration::from_secs(20), run)
        .await
        .unwrap_or_else(|_| panic!("{store}: an answer was held back for the slow body"));
    order.sort();
    assert_eq!(order, [(0, true), (1, true), (2, false)], "{store}");
    assert_eq!(
        idem.inspect("s", "quick").await.unwrap().map(|i| i.state),
        Some(KeyState::Completed),
        "{store}"
    );
}

#[tokio::test]
async fn each_result_comes_while_a_slower_body_runs_on_memory() {
    each_result_comes_while_a_slower_body_runs(TestContext::memory()).await;
}

#[tokio::test]
async fn each_result_comes_while_a_slower_body_runs_on_redis() {
    each_result_comes_while_a_slower_body_runs(TestContext::redis().await).await;
}

#[tokio::test]
async fn each_result_comes_while_a_slower_body_runs_on_dynamodb() {
    each_result_comes_while_a_slower_body_runs(TestContext::dynamodb().await).await;
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_batch_stores_finished_results_and_keeps_running_keys() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(4))
        .build();
    let batch: Batch = ["done", "running"]
        .iter()
        .map(|k| idem.call("s", k))
        .collect();
    let run = batch.run_outcome(|i| async move {
        if i == 1 {
            std::future::pending::<()>().await;
        }
        Ok::<_, Error>(i)
    });
    // Dropped while "done" waits for "running" to finish.
    let dropped = tokio::time::timeout(Duration::from_millis(100), run).await;
    assert!(dropped.is_err());
    tokio::time::sleep(Duration::from_millis(10)).await;
    let state = |k| {
        let idem = &idem;
        async move { idem.inspect("s", k).await.unwrap().map(|i| i.state) }
    };
    assert_eq!(state("done").await, Some(KeyState::Completed));
    // The running body may have made effects: its key stays in flight
    // until its lease ends, and the next call is a takeover.
    assert_eq!(state("running").await, Some(KeyState::Pending));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (_, o) = idem
        .call("s", "running")
        .run_outcome(|| async { Ok::<_, Error>(1) })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Recovered);
}

/// Four runtimes on four threads run overlapping batches over the same
/// 200 keys on one Redis until every key is done: each key's body runs
/// exactly once.
#[test]
fn racing_batches_run_each_key_once() {
    const KEYS: usize = 200;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ctx = rt.block_on(TestContext::redis());
    let url = ctx.server().url();
    let ledger = Ledger::new();
    std::thread::scope(|s| {
        for worker in 0..4 {
            let (url, ledger) = (url.clone(), ledger.clone());
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let store = idem::RedisStore::connect(&url).await.unwrap();
                    let idem = Idempotency::builder(store).build();
                    // Each worker walks the keys from its own offset, in
                    // batches of 32, until every key replays.
                    let mut left: Vec<usize> =
                        (0..KEYS).map(|k| (k + worker * 50) % KEYS).collect();
                    while !left.is_empty() {
                        let take: Vec<usize> = left.iter().copied().take(32).collect();
                        let batch: Batch = take.iter().map(|k| idem.call("race", k)).collect();
                        let results = batch
                            .run_outcome(|i| {
                                let (ledger, key) = (ledger.clone(), take[i]);
                                async move {
                                    ledger.record(&key.to_string());
                                    tokio::task::yield_now().await;
                                    Ok::<_, Error>(key)
                                }
                            })
                            .await;
                        let mut retry = Vec::new();
                        for (key, r) in take.iter().zip(results) {
                            match r {
                                Ok((value, _)) => assert_eq!(value, *key),
                                Err(Error::InProgress { .. }) => retry.push(*key),
                                Err(e) => panic!("key {key}: {e}"),
                            }
                        }
                        left.drain(..take.len());
                        left.extend(retry);
                        if !left.is_empty() {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    }
                });
            });
        }
    });
    assert_eq!(ledger.duplicates(), Default::default());
    assert_eq!(ledger.total(), KEYS);
    drop(ctx);
}

/// The bodies of a batch have finished and its finish
/// round trip is in flight when the batch is dropped (a consumer giving up
/// at its drain timeout); the round trip then fails (the connection is
/// cut). The results must still be stored, as a dropped single call's are,
/// so that no body runs again when the lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_whose_finish_met_a_blip_still_stores_its_results() {
    let ctx =
        TestContext::redis_behind_proxy(RedisServer::start(), RedisStoreConfig::default()).await;
    let idem = ctx.builder().lease(Duration::from_secs(6)).build();
    let ledger = Ledger::new();
    let keys = ["a", "b", "c"];
    let (go, gate) = tokio::sync::watch::channel(false);
    let batch: Batch = keys.iter().map(|k| idem.call("s", k)).collect();
    let mut run = Box::pin(batch.run_outcome(|i| {
        let (mut gate, ledger) = (gate.clone(), &ledger);
        async move {
            let _ = gate.wait_for(|go| *go).await;
            ledger.record(keys[i]);
            Ok::<_, Error>(i as u32)
        }
    }));
    // The claims went through; the bodies wait.
    assert!(
        tokio::time::timeout(Duration::from_millis(500), &mut run)
            .await
            .is_err()
    );
    // The bodies finish; their finish round trip is held on its way.
    ctx.proxy().stall(true);
    go.send(true).unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), &mut run)
            .await
            .is_err()
    );
    assert_eq!(ledger.total(), 3);
    drop(run);
    // The round trip fails: the connection is cut, the request lost.
    ctx.proxy().drop_connections();
    ctx.proxy().stall(false);
    let mut states = Vec::new();
    for _ in 0..50 {
        states.clear();
        for k in keys {
            states.push(idem.inspect("s", k).await.ok().flatten().map(|i| i.state));
        }
        if states.iter().all(|s| *s == Some(KeyState::Completed)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        states.iter().all(|s| *s == Some(KeyState::Completed)),
        "a dropped batch left its finished results unstored after a blip: {states:?}"
    );
    for (i, k) in keys.iter().enumerate() {
        let again = idem
            .call("s", k)
            .run_outcome(|| async {
                ledger.record(k);
                Ok::<_, Error>(99)
            })
            .await
            .unwrap();
        assert_eq!(again, (i as u32, Outcome::Replayed));
        assert_eq!(ledger.count(k), 1, "{k}'s body ran twice");
    }
}

/// A batch dropped while its claims are on their way to
/// the store. Its keys must be free as soon as the claims land, not after
/// a whole lease: a release sent at the drop would reach the store first
/// (as it can on a pool of connections) and find nothing, and the claims
/// would land after it.
async fn a_dropped_batch_frees_its_keys_after_its_claims_land(store: impl Store) {
    let store = CountingStore::new(store).delay_claim_batches(Duration::from_millis(300));
    let idem = Idempotency::builder(store)
        .lease(Duration::from_secs(60))
        .build();
    let ledger = Ledger::new();
    let keys = ["x", "y"];
    let batch: Batch = keys.iter().map(|k| idem.call("s", k)).collect();
    let run = batch.run_outcome(|i| {
        let ledger = &ledger;
        async move {
            ledger.record(keys[i]);
            Ok::<_, Error>(i as u32)
        }
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(50), run)
            .await
            .is_err()
    );
    // Past the claims' landing: a key read before would be free anyway.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut left = Vec::new();
    for _ in 0..50 {
        left.clear();
        for k in keys {
            if let Some(info) = idem.inspect("s", k).await.unwrap() {
                left.push((k, info.state));
            }
        }
        if left.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        left.is_empty(),
        "the dropped batch's claims landed after its release: {left:?} wait out the lease"
    );
    for k in keys {
        let (_, o) = idem
            .call("s", k)
            .run_outcome(|| async {
                ledger.record(k);
                Ok::<_, Error>(7)
            })
            .await
            .unwrap();
        assert_eq!(o, Outcome::Executed);
        assert_eq!(ledger.count(k), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_frees_its_keys_after_its_claims_land_on_redis() {
    let ctx = TestContext::redis().await;
    a_dropped_batch_frees_its_keys_after_its_claims_land(ctx.redis_store().clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_frees_its_keys_after_its_claims_land_on_postgres() {
    let ctx = TestContext::postgres().await;
    a_dropped_batch_frees_its_keys_after_its_claims_land(ctx.pg_store().clone()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_frees_its_keys_after_its_claims_land_on_dynamodb() {
    let ctx = TestContext::dynamodb().await;
    a_dropped_batch_frees_its_keys_after_its_claims_land(ctx.dynamo_store().clone()).await;
}

/// A body that panics in a batch frees its key by token, as a single call
/// does, and the panic goes on up through the batch's future.
#[tokio::test]
async fn a_panicking_body_frees_its_key_and_unwinds_the_batch() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["fine", "boom"].iter().map(|k| idem.call("s", k)).collect();
            batch
                .run_outcome(|i| async move {
                    if i == 1 {
                        panic!("the body of boom panics");
                    }
                    Ok::<_, Error>(i)
                })
                .await
        }
    });
    let joined = run.await;
    assert!(joined.is_err_and(|e| e.is_panic()));
    // Freed at once, in a task of its own: the next call runs the body.
    let ledger = Ledger::new();
    for _ in 0..50 {
        if idem.inspect("s", "boom").await.unwrap().is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (_, o) = idem
        .call("s", "boom")
        .run_outcome(|| async {
            ledger.record("boom");
            Ok::<_, Error>(7)
        })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
    assert_eq!(ledger.count("boom"), 1);
}

/// A body that ended before another one panicked keeps its result: the
/// batch unwinds after sending it, and the next call replays it instead of
/// running the body again.
#[tokio::test]
async fn a_panicking_body_leaves_the_results_of_bodies_that_ended_stored() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["boom", "fine"].iter().map(|k| idem.call("s", k)).collect();
            batch
                .run_outcome(|i| async move {
                    if i == 0 {
                        panic!("the body of boom panics");
                    }
                    Ok::<_, Error>(i)
                })
                .await
        }
    });
    assert!(run.await.is_err_and(|e| e.is_panic()));
    // Stored by the round trip's own task, which the unwinding batch
    // no longer waits for.
    for _ in 0..200 {
        let info = idem.inspect("s", "fine").await.unwrap();
        if info.is_some_and(|i| i.state == KeyState::Completed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ledger = Ledger::new();
    let (v, o) = idem
        .call("s", "fine")
        .run_outcome(|| async {
            ledger.record("fine");
            Ok::<_, Error>(7)
        })
        .await
        .unwrap();
    assert_eq!((v, o), (1, Outcome::Replayed));
    assert_eq!(ledger.count("fine"), 0);
}

/// Calls of two runtimes over two stores in one batch: each call answers
/// from its own store (the batch's round trips carry only the first
/// store's calls; the others go on their own).
#[tokio::test]
async fn a_batch_of_calls_over_two_stores_answers_each_from_its_own() {
    let (a, b) = (MemoryStore::new(), MemoryStore::new());
    let (ia, ib) = (
        Idempotency::builder(a).build(),
        Idempotency::builder(b).build(),
    );
    let first: Result<u32, Error> = ib.call("s", "k").run(|| async { Ok(99) }).await;
    assert_eq!(first.unwrap(), 99);
    let mut batch = Batch::new();
    batch.push(ia.call("s", "k"));
    batch.push(ib.call("s", "k"));
    let results = batch
        .run_outcome(|i| async move { Ok::<_, Error>(i as u32) })
        .await;
    let results: Vec<_> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(results, [(0, Outcome::Executed), (99, Outcome::Replayed)]);
}

/// Bodies waiting for their turn under `concurrency(1)` hold their keys
/// for longer than a lease: their leases are kept alive meanwhile, so a
/// racer never takes a waiting key over and each body runs once.
/// (Paused time: a busy machine cannot stretch a lease.)
#[tokio::test(start_paused = true)]
async fn bodies_waiting_for_their_turn_keep_their_keys_past_a_lease() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_millis(300))
        .build();
    let ledger = Ledger::new();
    let keys = ["a", "b", "c", "d", "e"];
    let batch: Batch = keys.iter().map(|k| idem.call("s", k)).collect();
    let run = batch.concurrency(1).run_outcome(|i| {
        let ledger = &ledger;
        async move {
            ledger.record(keys[i]);
            tokio::time::sleep(Duration::from_millis(150)).await;
            Ok::<_, Error>(i)
        }
    });
    let racer = async {
        // Past two leases of waiting for the last key: never ours.
        for _ in 0..20 {
            for k in keys {
                let r: Result<usize, Error> = idem
                    .call("s", k)
                    .run(|| async {
                        ledger.record(k);
                        Ok(100)
                    })
                    .await;
                assert!(
                    matches!(r, Err(Error::InProgress { .. })) || r.is_ok(),
                    "{r:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    };
    let (results, ()) = tokio::join!(run, racer);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    for k in keys {
        assert_eq!(ledger.count(k), 1, "{k}");
    }
}

/// A result that must be stored on its own (its body staged an outbox
/// message) is stored, with its message, even when a sibling body panics
/// in the same poll: the next call replays it and the message is in the
/// outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_sibling_leaves_a_result_with_outbox_messages_stored() {
    let ctx = TestContext::redis().await;
    let idem = ctx.builder().lease(Duration::from_secs(60)).build();
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["boom", "staged"]
                .iter()
                .map(|k| idem.call("s", k))
                .collect();
            batch
                .run_outcome(|i| async move {
                    if i == 0 {
                        panic!("the body of boom panics");
                    }
                    idem::outbox::stage("orders", "o-1", &"created")?;
                    Ok::<_, Error>(i as u32)
                })
                .await
        }
    });
    assert!(run.await.is_err_and(|e| e.is_panic()));
    idem_testkit::eventually(
        "the staged body's result stored after the batch unwound",
        Duration::from_secs(5),
        || async {
            let info = idem.inspect("s", "staged").await.ok().flatten();
            info.is_some_and(|i| i.state == KeyState::Completed)
                .then_some(())
        },
    )
    .await;
    let ledger = Ledger::new();
    let again = idem
        .call("s", "staged")
        .run_outcome(|| async {
            ledger.record("staged");
            Ok::<_, Error>(99)
        })
        .await
        .unwrap();
    assert_eq!(again, (1, Outcome::Replayed));
    assert_eq!(ledger.count("staged"), 0);
    let backlog = ctx.redis_store().outbox().backlog().await.unwrap();
    assert_eq!(backlog.pending, 1, "the staged message was lost");
}

/// A result that must be stored on its own (its body's lease was renewed)
/// is stored even when a sibling body panics in the same poll: the next
/// call replays it instead of running the body again as `Recovered`.
/// (One thread and paused time: both bodies end in one poll of the batch.)
#[tokio::test(start_paused = true)]
async fn a_panicking_sibling_leaves_a_renewed_bodys_result_stored() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_millis(300))
        .build();
    let (tx_renewed, rx_renewed) = tokio::sync::oneshot::channel::<()>();
    let (tx_boom, rx_boom) = tokio::sync::oneshot::channel::<()>();
    let waits = std::sync::Mutex::new((Some(rx_renewed), Some(rx_boom)));
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["renewed", "boom"]
                .iter()
                .map(|k| idem.call("s", k))
                .collect();
            let waits = &waits;
            batch
                .run_outcome(|i| async move {
                    let rx = {
                        let mut w = waits.lock().unwrap();
                        if i == 0 { w.0.take() } else { w.1.take() }
                    };
                    if let Some(rx) = rx {
                        let _ = rx.await;
                    }
                    if i == 1 {
                        panic!("the body of boom panics");
                    }
                    Ok::<_, Error>(7u32)
                })
                .await
        }
    });
    // Past a renewal (a third of the lease), both bodies are woken at once,
    // the renewed one first.
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx_renewed.send(()).unwrap();
    tx_boom.send(()).unwrap();
    assert!(run.await.is_err_and(|e| e.is_panic()));
    tokio::time::sleep(Duration::from_millis(10)).await;
    let info = idem.inspect("s", "renewed").await.unwrap();
    assert_eq!(
        info.map(|i| i.state),
        Some(KeyState::Completed),
        "the renewed body's result was dropped with the batch"
    );
    // Past the lease: a result that was not stored would run again here.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ledger = Ledger::new();
    let again = idem
        .call("s", "renewed")
        .run_outcome(|| async {
            ledger.record("renewed");
            Ok::<_, Error>(99)
        })
        .await
        .unwrap();
    assert_eq!(again, (7, Outcome::Replayed));
    assert_eq!(ledger.count("renewed"), 0);
}

/// A call whose batched claim landed but whose reply was lost claims again
/// on its own; when a sibling's panic unwinds the batch before it does,
/// its key is freed at once (by its token), not held for a whole lease.
#[tokio::test]
async fn a_panicking_sibling_frees_a_key_whose_claim_reply_was_lost() {
    let store = CountingStore::new(MemoryStore::new()).lose_claim_replies(":lost");
    let idem = Idempotency::builder(store)
        .lease(Duration::from_secs(60))
        .build();
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["boom", "lost"].iter().map(|k| idem.call("s", k)).collect();
            batch
                .run_outcome(|i| async move {
                    if i == 0 {
                        panic!("the body of boom panics");
                    }
                    Ok::<_, Error>(1u32)
                })
                .await
        }
    });
    assert!(run.await.is_err_and(|e| e.is_panic()));
    idem_testkit::eventually(
        "the landed claim whose reply was lost freed, not pending for the lease",
        Duration::from_secs(5),
        || async {
            idem.inspect("s", "lost")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    let ledger = Ledger::new();
    let (_, o) = idem
        .call("s", "lost")
        .run_outcome(|| async {
            ledger.record("lost");
            Ok::<_, Error>(2u32)
        })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
    assert_eq!(ledger.count("lost"), 1);
}

/// Bodies still waiting for their concurrency turn when the batch is
/// dropped never started: their keys are released at once and the next
/// call runs as `Executed` (attempt 1); the started body's key stays in
/// flight until its lease ends.
#[tokio::test(start_paused = true)]
async fn a_dropped_batch_releases_the_keys_of_bodies_waiting_for_their_turn() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(60))
        .build();
    let batch: Batch = ["started", "waiting-1", "waiting-2"]
        .iter()
        .map(|k| idem.call("s", k))
        .collect();
    let run = batch.concurrency(1).run_outcome(|_| async {
        std::future::pending::<()>().await;
        Ok::<_, Error>(0u32)
    });
    assert!(
        tokio::time::timeout(Duration::from_millis(100), run)
            .await
            .is_err()
    );
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        idem.inspect("s", "started").await.unwrap().map(|i| i.state),
        Some(KeyState::Pending)
    );
    for k in ["waiting-1", "waiting-2"] {
        assert_eq!(
            idem.inspect("s", k).await.unwrap().map(|i| i.state),
            None,
            "{k} never started, yet keeps its key"
        );
        let (_, o) = idem
            .call("s", k)
            .run_outcome(|| async { Ok::<_, Error>(1u32) })
            .await
            .unwrap();
        assert_eq!(o, Outcome::Executed, "{k}");
    }
}

/// A sibling's panic unwinds a batch whose other bodies still wait for
/// their concurrency turn: those never started, so their keys are released
/// at once and the next call runs them as `Executed`.
#[tokio::test]
async fn a_panicking_sibling_releases_the_keys_of_bodies_waiting_for_their_turn() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(60))
        .build();
    let run = tokio::spawn({
        let idem = idem.clone();
        async move {
            let batch: Batch = ["boom", "waiting"]
                .iter()
                .map(|k| idem.call("s", k))
                .collect();
            batch
                .concurrency(1)
                .run_outcome(|i| async move {
                    if i == 0 {
                        tokio::task::yield_now().await;
                        panic!("the body of boom panics");
                    }
                    Ok::<_, Error>(1u32)
                })
                .await
        }
    });
    assert!(run.await.is_err_and(|e| e.is_panic()));
    idem_testkit::eventually(
        "the key of a body that never started released, not kept for a lease",
        Duration::from_secs(5),
        || async {
            idem.inspect("s", "waiting")
                .await
                .ok()?
                .is_none()
                .then_some(())
        },
    )
    .await;
    let (_, o) = idem
        .call("s", "waiting")
        .run_outcome(|| async { Ok::<_, Error>(2u32) })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
}
