//! The control: DynamoDB's promise this store is built on, checked on the
//! endpoint itself with the SDK alone. Of many conditional `PutItem`s of
//! one item sent at once (`attribute_not_exists`), exactly one succeeds
//! and every other fails its condition. If the emulator broke this, every
//! other test here would prove nothing.

use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_testkit::DynamoTestTable;
use std::sync::{Arc, Barrier};

const WRITERS: usize = 64;
const ROUNDS: usize = 5;

/// 64 conditional puts of one item from tasks on a multi-thread runtime,
/// released together by a barrier: exactly one wins, the other 63 fail
/// their condition (none errs otherwise), round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_64_concurrent_conditional_puts_wins() {
    let (table, _store) = DynamoTestTable::create().await;
    for round in 0..ROUNDS {
        let key = format!("control-{round}");
        let barrier = Arc::new(tokio::sync::Barrier::new(WRITERS));
        let mut tasks = Vec::new();
        for writer in 0..WRITERS {
            let (client, table, key, barrier) = (
                table.client().clone(),
                table.name.clone(),
                key.clone(),
                barrier.clone(),
            );
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                let r = client
                    .put_item()
                    .table_name(table)
                    .item("pk", AttributeValue::S(key))
                    .item("writer", AttributeValue::N(writer.to_string()))
                    .condition_expression("attribute_not_exists(pk)")
                    .send()
                    .await;
                match r {
                    Ok(_) => Ok(true),
                    Err(e) => match e.as_service_error() {
                        Some(PutItemError::ConditionalCheckFailedException(_)) => Ok(false),
                        _ => Err(format!("{e:?}")),
                    },
                }
            }));
        }
        let mut wins = 0;
        for t in tasks {
            if t.await.unwrap().expect("only the condition may fail") {
                wins += 1;
            }
        }
        assert_eq!(
            wins, 1,
            "round {round}: {wins} conditional puts of one item succeeded"
        );
    }
}

/// The same race from OS threads, each with a runtime and a client of its
/// own (no shared connection pool): exactly one wins.
#[test]
fn one_of_64_puts_from_separate_runtimes_wins() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (table, _store) = rt.block_on(DynamoTestTable::create());
    let barrier = Arc::new(Barrier::new(WRITERS));
    let threads: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let (name, barrier) = (table.name.clone(), barrier.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async {
                    let client = idem_testkit::dynamodb_client().await;
                    barrier.wait();
                    let r = client
                        .put_item()
                        .table_name(name)
                        .item("pk", AttributeValue::S("one".into()))
                        .item("writer", AttributeValue::N(writer.to_string()))
                        .condition_expression("attribute_not_exists(pk)")
                        .send()
                        .await;
                    match r {
                        Ok(_) => true,
                        Err(e) => {
                            assert!(
                                matches!(
                                    e.as_service_error(),
                                    Some(PutItemError::ConditionalCheckFailedException(_))
                                ),
                                "only the condition may fail: {e:?}"
                            );
                            false
                        }
                    }
                })
            })
        })
        .collect();
    let wins = threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .filter(|w| *w)
        .count();
    assert_eq!(wins, 1);
    drop(table);
}
