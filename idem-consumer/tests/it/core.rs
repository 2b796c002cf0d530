//! The broker-agnostic core against MemoryStore and a real Redis: the
//! decision table row by row, batches, and bad input.

use idem_consumer::{
    Consumer, ConsumerError, DeadLetterReason, Decision, ErrorClass, KeyDeriver, KeySource, Message,
};
use idem_core::{Idempotency, MemoryStore, Outcome};
use idem_redis::RedisStore;
use idem_testkit::{Ledger, RedisServer};
use std::time::Duration;

fn idem() -> Idempotency {
    Idempotency::builder(MemoryStore::new())
        .namespace("t")
        .lease(Duration::from_millis(600))
        .build()
}

#[derive(Debug)]
enum AppError {
    Transient,
    Invalid,
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AppError::Transient => "upstream timed out",
            AppError::Invalid => "amount must be positive",
        })
    }
}

fn classify(e: &AppError) -> ErrorClass {
    ErrorClass::from_retryable(matches!(e, AppError::Transient))
}

#[tokio::test]
async fn executed_then_replayed_both_ack_and_run_once() {
    let ledger = Ledger::new();
    let c = Consumer::new(idem(), "orders");
    let h = async |m: Message| -> Result<String, AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Ok(format!("receipt-{}", m.id().unwrap_or("-")))
    };
    let m = Message::new(r#"{"amount":5}"#).with_id("o-1");
    let a = c.handle(&m, &h).await;
    let b = c.handle(&m.clone().with_delivery_count(2), &h).await;
    assert_eq!(
        (a.decision, a.outcome),
        (Decision::Ack, Some(Outcome::Executed))
    );
    assert_eq!(
        (b.decision, b.outcome),
        (Decision::Ack, Some(Outcome::Replayed))
    );
    assert_eq!(b.value.as_deref(), Some("receipt-o-1"));
    assert_eq!(ledger.count("o-1"), 1);
}

#[tokio::test]
async fn retryable_nacks_with_backoff_then_dead_letters_at_the_failure_limit() {
    let ledger = Ledger::new();
    let c = Consumer::new(idem(), "orders")
        .classify(classify)
        .max_failures(3)
        .backoff(Duration::from_millis(100), Duration::from_secs(1));
    let h = async |m: Message| -> Result<(), AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Err(AppError::Transient)
    };
    // Broker delivery counts far apart: only the handler's failures count.
    let m = Message::new("{}").with_id("p");
    let d1 = c
        .handle(&m.clone().with_delivery_count(7), &h)
        .await
        .decision;
    let d2 = c
        .handle(&m.clone().with_delivery_count(8), &h)
        .await
        .decision;
    let d3 = c
        .handle(&m.clone().with_delivery_count(30), &h)
        .await
        .decision;
    assert_eq!(
        d1,
        Decision::Nack {
            delay: Duration::from_millis(100)
        }
    );
    assert_eq!(
        d2,
        Decision::Nack {
            delay: Duration::from_millis(200)
        }
    );
    match d3 {
        Decision::DeadLetter {
            reason:
                DeadLetterReason::MaxFailures {
                    failures,
                    last_error,
                },
        } => assert_eq!((failures, last_error.as_str()), (3, "upstream timed out")),
        other => panic!("expected a dead letter, got {other}"),
    }
    assert_eq!(ledger.count("p"), 3);
}

/// Deliveries that never ran the handler (a consumer
/// killed before it, in-flight duplicates nacked) spend no failures.
#[tokio::test]
async fn deliveries_that_never_ran_the_handler_do_not_count_as_failures() {
    let ledger = Ledger::new();
    let c = Consumer::new(idem(), "orders").max_failures(2);
    let ok = async |m: Message| -> Result<u8, AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Ok(1)
    };
    // Delivered 40 times to consumers that died before running it: runs.
    let m = Message::new("{}").with_id("victim");
    let h = c.handle(&m.clone().with_delivery_count(40), &ok).await;
    assert_eq!(
        (h.decision, h.outcome),
        (Decision::Ack, Some(Outcome::Executed))
    );
    // One failure, then a success at delivery 60: never dead-lettered.
    let flaky_runs = Ledger::new();
    let flaky = async |m: Message| -> Result<u8, AppError> {
        flaky_runs.record(m.id().unwrap_or("-"));
        match flaky_runs.count("flaky") {
            1 => Err(AppError::Transient),
            _ => Ok(2),
        }
    };
    let f = Message::new("{}").with_id("flaky");
    let first = c.handle(&f.clone().with_delivery_count(59), &flaky).await;
    assert!(first.decision.is_nack(), "{}", first.decision);
    let second = c.handle(&f.clone().with_delivery_count(60), &flaky).await;
    assert_eq!(
        (second.decision, second.outcome),
        (Decision::Ack, Some(Outcome::Executed))
    );
    assert_eq!((ledger.count("victim"), flaky_runs.count("flaky")), (1, 2));
}

/// The valve: a delivery count over `max_deliveries` with the work not
/// done is dead-lettered unrun; done work is acked at any count.
#[tokio::test]
async fn over_the_delivery_valve_undone_work_is_dead_lettered_unrun_done_work_acked() {
    let ledger = Ledger::new();
    let c = Consumer::new(idem(), "orders").max_deliveries(10);
    assert_eq!(c.failure_limit(), 5);
    let ok = async |m: Message| -> Result<u8, AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Ok(1)
    };
    let looping = Message::new("{}").with_id("loop").with_delivery_count(11);
    match c.handle(&looping, &ok).await.decision {
        Decision::DeadLetter {
            reason: DeadLetterReason::MaxDeliveries { deliveries, .. },
        } => assert_eq!(deliveries, 11),
        other => panic!("expected the valve, got {other}"),
    }
    let done = Message::new("{}").with_id("done");
    assert!(c.handle(&done, &ok).await.decision.is_ack());
    let late = c.handle(&done.with_delivery_count(1000), &ok).await;
    assert_eq!(
        (late.decision, late.outcome),
        (Decision::Ack, Some(Outcome::Replayed))
    );
    assert_eq!((ledger.count("loop"), ledger.count("done")), (0, 1));
}

/// A copy inside a batch settles as its first copy did.
/// Acking it whatever the first copy's decision lost the message on
/// JetStream, where both deliveries are one stream message.
#[tokio::test]
async fn a_copy_in_a_batch_settles_with_the_first_copy_decision() {
    let runs = Ledger::new();
    let c = Consumer::new(idem(), "orders")
        .classify(classify)
        .backoff(Duration::from_millis(100), Duration::from_secs(1));
    let h = async |m: Message| -> Result<(), AppError> {
        runs.record(m.id().unwrap_or("-"));
        match &m.payload()[..] {
            b"transient" => Err(AppError::Transient),
            b"invalid" => Err(AppError::Invalid),
            _ => Ok(()),
        }
    };
    let batch = [
        Message::new("transient").with_id("a"),
        Message::new("ok").with_id("b"),
        Message::new("invalid").with_id("c"),
        Message::new("transient")
            .with_id("a")
            .with_delivery_count(2),
        Message::new("ok").with_id("b").with_delivery_count(2),
        Message::new("invalid").with_id("c").with_delivery_count(2),
    ];
    let out = c.handle_batch(&batch, &h).await;
    let decisions: Vec<&str> = out.iter().map(|h| h.decision.as_str()).collect();
    assert_eq!(
        decisions,
        ["nack", "ack", "dead_letter", "nack", "ack", "dead_letter"]
    );
    assert_eq!(out[3].decision, out[0].decision);
    assert_eq!(
        out[3..].iter().map(|h| h.duplicate_of).collect::<Vec<_>>(),
        [Some(0), Some(1), Some(2)]
    );
    assert_eq!(
        (runs.count("a"), runs.count("b"), runs.count("c")),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn permanent_errors_dead_letter_at_once_and_past_the_limit_done_work_still_acks() {
    let c = Consumer::new(idem(), "orders")
        .classify(classify)
        .max_deliveries(2);
    let bad = async |_: Message| -> Result<(), AppError> { Err(AppError::Invalid) };
    let d = c
        .handle(&Message::new("{}").with_id("x"), &bad)
        .await
        .decision;
    match d {
        Decision::DeadLetter {
            reason: DeadLetterReason::Permanent(e),
        } => {
            assert_eq!(e, "amount must be positive")
        }
        other => panic!("{other}"),
    }
    let ok = async |_: Message| -> Result<u8, AppError> { Ok(1) };
    let m = Message::new("{}").with_id("done");
    assert!(c.handle(&m, &ok).await.decision.is_ack());
    // A late redelivery over the limit of work already done: a duplicate, ack it.
    let late = c.handle(&m.with_delivery_count(9), &ok).await;
    assert_eq!(
        (late.decision, late.outcome),
        (Decision::Ack, Some(Outcome::Replayed))
    );
}

#[tokio::test]
async fn in_progress_nacks_for_the_lease_left_and_wait_acks_with_the_first_result() {
    let idem = idem();
    let c = Consumer::new(idem.clone(), "orders");
    let slow = async |_: Message| -> Result<u32, AppError> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        Ok(7)
    };
    let m = Message::new("{}").with_id("slow");
    let first = c.handle(&m, &slow);
    let second = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        c.handle(&m, &slow).await
    };
    let (a, b) = tokio::join!(first, second);
    assert!(a.decision.is_ack());
    match b.decision {
        Decision::Nack { delay } => {
            assert!(delay > Duration::ZERO && delay <= Duration::from_millis(600))
        }
        other => panic!("{other}"),
    }
    let waiting = Consumer::new(idem, "orders").wait(Duration::from_secs(2));
    let m2 = Message::new("{}").with_id("slow-2");
    let (a, b) = tokio::join!(waiting.handle(&m2, &slow), async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waiting.handle(&m2, &slow).await
    });
    assert_eq!(
        (a.outcome, b.outcome),
        (Some(Outcome::Executed), Some(Outcome::Replayed))
    );
    assert_eq!(
        (a.decision, b.decision, b.value),
        (Decision::Ack, Decision::Ack, Some(7))
    );
}

#[tokio::test]
async fn a_reused_id_with_another_payload_is_dead_lettered() {
    let c = Consumer::new(idem(), "orders");
    let h = async |_: Message| -> Result<(), AppError> { Ok(()) };
    assert!(
        c.handle(&Message::new(r#"{"amount":5}"#).with_id("id-1"), &h)
            .await
            .decision
            .is_ack()
    );
    // Same JSON, other key order and spacing: the same payload.
    let same = Message::new(r#"{ "amount" : 5 }"#).with_id("id-1");
    assert!(c.handle(&same, &h).await.decision.is_ack());
    let d = c
        .handle(&Message::new(r#"{"amount":6}"#).with_id("id-1"), &h)
        .await
        .decision;
    assert_eq!(
        d,
        Decision::DeadLetter {
            reason: DeadLetterReason::FingerprintMismatch
        }
    );
}

#[tokio::test]
async fn payload_keys_catch_a_republish_under_a_new_id() {
    let ledger = Ledger::new();
    let keys = KeySource::Payload(KeyDeriver::new().exclude("/sent_at").unwrap());
    let c = Consumer::new(idem(), "orders").keys(keys);
    let h = async |m: Message| -> Result<(), AppError> {
        let v: serde_json::Value = m.json().map_err(|_| AppError::Invalid)?;
        ledger.record(&v["order"].to_string());
        Ok(())
    };
    let a = c
        .handle(
            &Message::new(r#"{"order":1,"sent_at":"10:00"}"#).with_id("a"),
            &h,
        )
        .await;
    let b = c
        .handle(
            &Message::new(r#"{"sent_at":"10:07","order":1}"#).with_id("b"),
            &h,
        )
        .await;
    assert_eq!(
        (a.outcome, b.outcome),
        (Some(Outcome::Executed), Some(Outcome::Replayed))
    );
    assert_eq!(ledger.total(), 1);
}

#[tokio::test]
async fn bad_input_is_a_typed_dead_letter_never_a_panic() {
    let ledger = Ledger::new();
    let h = async |_: Message| -> Result<(), AppError> {
        ledger.record("ran");
        Ok(())
    };
    let by_payload = Consumer::new(idem(), "orders").keys(KeySource::Payload(KeyDeriver::new()));
    let by_id = Consumer::new(idem(), "orders").keys(KeySource::MessageId);
    let cases: Vec<(&Consumer, Message, &str)> = vec![
        (
            &by_payload,
            Message::new(&b"\xff\xfe not json"[..]),
            "not valid JSON",
        ),
        (&by_payload, Message::new(""), "not valid JSON"),
        (&by_id, Message::new("{}"), "no message id"),
        (&by_id, Message::new("{}").with_id(""), "empty"),
        (
            &by_id,
            Message::new("{}").with_id("x".repeat(10 * 1024)),
            "10240 bytes",
        ),
        (
            &by_id,
            Message::new("{}").with_id("a\nb"),
            "control character",
        ),
        (
            &by_id,
            Message::new("{}").with_unreadable_id("header is an integer"),
            "unreadable",
        ),
    ];
    for (c, m, needle) in cases {
        let h = c.handle(&m, &h).await;
        match &h.decision {
            Decision::DeadLetter {
                reason: r @ DeadLetterReason::BadMessage(text),
            } => {
                assert!(text.contains(needle), "{needle:?} not in {text:?}");
                assert_eq!(r.kind(), "bad_message");
            }
            other => panic!("{needle}: expected a bad_message dead letter, got {other}"),
        }
    }
    assert_eq!(ledger.total(), 0);
    assert!(matches!(
        by_id.key_of(&Message::new("{}")),
        Err(ConsumerError::MissingId)
    ));
}

#[tokio::test]
async fn batch_runs_copies_once_bounds_concurrency_and_fails_partially() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let ledger = Ledger::new();
    let (now, peak) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let c = Consumer::new(idem(), "orders")
        .classify(classify)
        .concurrency(3);
    let h = async |m: Message| -> Result<(), AppError> {
        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
        peak.fetch_max(n, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        now.fetch_sub(1, Ordering::SeqCst);
        ledger.record(m.id().unwrap_or("-"));
        if m.id() == Some("poison") {
            Err(AppError::Invalid)
        } else {
            Ok(())
        }
    };
    let mut batch: Vec<Message> = (0..10)
        .map(|i| Message::new(format!("{i}")).with_id(format!("m{i}")))
        .collect();
    batch.insert(4, Message::new("poison").with_id("poison"));
    batch.push(Message::new("3").with_id("m3"));
    batch.push(Message::new("3").with_id("m3"));
    let out = c.handle_batch(&batch, &h).await;
    assert_eq!(out.len(), 13);
    assert!(out[4].decision.is_dead_letter());
    assert!(
        out.iter()
            .enumerate()
            .all(|(i, h)| i == 4 || h.decision.is_ack())
    );
    assert_eq!(
        (out[11].duplicate_of, out[12].duplicate_of),
        (Some(3), Some(3))
    );
    assert_eq!(ledger.total(), 11);
    assert!(ledger.duplicates().is_empty());
    assert!(peak.load(Ordering::SeqCst) <= 3);
}

#[tokio::test]
async fn store_down_nacks_and_runs_nothing_then_the_redelivery_runs_once() {
    let mut server = RedisServer::start();
    let store = RedisStore::connect(&server.url()).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("t")
        .store_retries(0)
        .build();
    let c =
        Consumer::new(idem, "orders").backoff(Duration::from_millis(50), Duration::from_secs(1));
    let ledger = Ledger::new();
    let h = async |m: Message| -> Result<(), AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Ok(())
    };
    server.kill();
    let m = Message::new("{}").with_id("o");
    let d = c.handle(&m, &h).await.decision;
    assert_eq!(
        d,
        Decision::Nack {
            delay: Duration::from_millis(50)
        }
    );
    assert_eq!(ledger.total(), 0);
    server.restart();
    let again = idem_testkit::eventually("the store is back", Duration::from_secs(10), || async {
        let h = c.handle(&m.clone().with_delivery_count(2), &h).await;
        h.decision.is_ack().then_some(h)
    })
    .await;
    assert_eq!(again.outcome, Some(Outcome::Executed));
    assert_eq!(ledger.count("o"), 1);
}

/// A fetched batch costs idem's store one claims round
/// trip and one round trip of results, whatever its size; the redelivered
/// batch replays in one more. Handlers that finish together are stored
/// together (no handler waits here).
#[tokio::test]
async fn a_batch_costs_the_store_two_round_trips_not_two_per_message() {
    let server = RedisServer::start();
    let store = idem_testkit::CountingStore::new(RedisStore::connect(&server.url()).await.unwrap());
    let counts = store.counts();
    let idem = Idempotency::builder(store).namespace("t").build();
    let c = Consumer::new(idem, "orders").concurrency(64);
    let ledger = Ledger::new();
    let h = async |m: Message| -> Result<(), AppError> {
        ledger.record(m.id().unwrap_or("-"));
        Ok(())
    };
    let batch: Vec<Message> = (0..64)
        .map(|i| Message::new(format!("{i}")).with_id(format!("m{i}")))
        .collect();
    let out = c.handle_batch(&batch, &h).await;
    assert!(out.iter().all(|h| h.outcome == Some(Outcome::Executed)));
    assert_eq!((counts.claim_batches(), counts.finish_batches()), (1, 1));
    let again = c.handle_batch(&batch, &h).await;
    assert!(again.iter().all(|h| h.outcome == Some(Outcome::Replayed)));
    assert_eq!((counts.claim_batches(), counts.finish_batches()), (2, 1));
    assert_eq!(counts.singles(), 0);
    assert_eq!(ledger.total(), 64);
}
