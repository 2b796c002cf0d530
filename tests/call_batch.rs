//! `idem::Batch`: several calls sharing their store round trips. Each call
//! must answer exactly as it would alone (on memory, Redis, a Redis
//! Cluster and PostgreSQL), the batch must cost two store round trips,
//! a slow body must not hold the others' results back, a cancelled batch
//! must keep the keys of bodies in flight and store the finished ones, and
//! batches racing over the same keys from several runtimes must run each
//! key's body once.

use idem::{Batch, Error, Idempotency, KeyState, MemoryStore, Outcome, RecordInfo};
use idem_testkit::{CountingStore, Ledger, TestContext};
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
