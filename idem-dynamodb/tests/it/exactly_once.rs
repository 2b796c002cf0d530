//! Exactly once on DynamoStore: 64 calls of one key at once, from four OS
//! threads each with a runtime, a client and a store of its own, run the
//! body once; every other call gets `InProgress` or the first call's value
//! replayed. Body runs are counted in a ledger outside the store.

use idem_core::{Error, Idempotency, Outcome};
use idem_dynamodb::DynamoStore;
use idem_testkit::{DynamoTestTable, Ledger};
use std::sync::{Arc, Barrier};
use std::time::Duration;

const THREADS: usize = 4;
const PER_THREAD: usize = 16;
const KEYS: usize = 3;

#[derive(Debug)]
enum Seen {
    Executed(u64),
    Replayed(u64),
    InProgress,
}

#[test]
fn sixty_four_calls_of_one_key_run_the_body_once() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (table, _store) = rt.block_on(DynamoTestTable::create());
    let ledger = Ledger::new();
    for k in 0..KEYS {
        let key = format!("order-{k}");
        let barrier = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|t| {
                let (name, barrier, ledger, key) = (
                    table.name.clone(),
                    barrier.clone(),
                    ledger.clone(),
                    key.clone(),
                );
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_multi_thread()
                        .worker_threads(2)
                        .enable_all()
                        .build()
                        .unwrap();
                    rt.block_on(async move {
                        let client = idem_testkit::dynamodb_client().await;
                        let store = DynamoStore::new(client, name).unwrap();
                        let idem = Idempotency::builder(store)
                            .namespace("once")
                            .lease(Duration::from_secs(10))
                            .build();
                        barrier.wait();
                        let calls: Vec<_> = (0..PER_THREAD)
                            .map(|i| {
                                let (idem, ledger, key) =
                                    (idem.clone(), ledger.clone(), key.clone());
                                tokio::spawn(async move {
                                    let mine = (t * PER_THREAD + i) as u64;
                                    idem.call("charge", &key)
                                        .run_outcome(|| async move {
                                            ledger.record(&key);
                                            tokio::time::sleep(Duration::from_millis(300)).await;
                                            Ok::<_, Error>(mine)
                                        })
                                        .await
                                })
                            })
                            .collect();
                        let mut seen = Vec::new();
                        for c in calls {
                            seen.push(match c.await.unwrap() {
                                Ok((v, Outcome::Executed)) => Seen::Executed(v),
                                Ok((v, Outcome::Replayed)) => Seen::Replayed(v),
                                Err(Error::InProgress { .. }) => Seen::InProgress,
                                other => panic!("an untyped or unexpected answer: {other:?}"),
                            });
                        }
                        seen
                    })
                })
            })
            .collect();
        let seen: Vec<Seen> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        assert_eq!(
            ledger.count(&key),
            1,
            "{key}: the body ran {} times",
            ledger.count(&key)
        );
        let executed: Vec<u64> = seen
            .iter()
            .filter_map(|s| match s {
                Seen::Executed(v) => Some(*v),
                _ => None,
            })
            .collect();
        assert_eq!(executed.len(), 1, "{key}: {seen:?}");
        for s in &seen {
            if let Seen::Replayed(v) = s {
                assert_eq!(*v, executed[0], "{key}: a replay of another value");
            }
        }
        assert_eq!(seen.len(), THREADS * PER_THREAD);
    }
    drop(table);
}
