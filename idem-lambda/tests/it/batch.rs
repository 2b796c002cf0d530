//! The SQS batch handler on hand-made events over a `MemoryStore`: what
//! each of idem's answers puts in `batchItemFailures`.

use crate::support::{event, failures, record};
use aws_lambda_events::sqs::SqsMessage;
use idem_consumer::{ByTrait, ClassifyError, Consumer, DeadLetterReason, ErrorClass};
use idem_core::{Idempotency, MemoryStore, Outcome};
use idem_lambda::{LeaseSource, RecordStatus, Redeliver, SqsBatchError, SqsBatchHandler, SqsKey};
use idem_testkit::{Ledger, LogCapture};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tracing::instrument::WithSubscriber;

fn idem() -> Idempotency {
    Idempotency::builder(MemoryStore::new())
        .namespace("lambda")
        .build()
}

/// A handler error that says whether it is worth another delivery.
#[derive(Debug)]
enum ShipError {
    Transient,
    Invalid,
}

impl std::fmt::Display for ShipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

impl ClassifyError for ShipError {
    fn class(&self) -> ErrorClass {
        match self {
            ShipError::Transient => ErrorClass::Retryable,
            ShipError::Invalid => ErrorClass::Permanent,
        }
    }
}

/// Runs the body named by the record's body, counting runs per message id.
fn shipper(
    ledger: &Ledger,
) -> impl Fn(SqsMessage) -> std::pin::Pin<Box<dyn Future<Output = Result<String, ShipError>> + Send>>
+ use<> {
    let ledger = ledger.clone();
    move |m: SqsMessage| {
        let ledger = ledger.clone();
        Box::pin(async move {
            let id = m.message_id.clone().unwrap_or_default();
            ledger.record(&id);
            match m.body.as_deref() {
                Some("transient") => Err(ShipError::Transient),
                Some("invalid") => Err(ShipError::Invalid),
                Some("slow") => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Ok(id)
                }
                _ => Ok(format!("shipped {id}")),
            }
        })
    }
}

/// Executed and replayed records are deleted (not listed); a retryable
/// error is listed and its key released, so its redelivery runs again;
/// a redelivery of a done record replays without running the body.
#[tokio::test]
async fn done_records_are_deleted_and_retryable_errors_redelivered() {
    let handler = SqsBatchHandler::from_consumer(Consumer::new(idem(), "ship").classify(ByTrait));
    let ledger = Ledger::new();
    let ship = shipper(&ledger);
    let batch = event(vec![
        record("m-1", "{}"),
        record("m-2", "transient"),
        record("m-3", "{}"),
    ]);
    let report = handler.run(batch.clone(), None, &ship).await.unwrap();
    assert_eq!(failures(&report.response), ["m-2"]);
    assert_eq!(report.records[0].outcome, Some(Outcome::Executed));
    assert_eq!(
        report.records[1].status,
        RecordStatus::Redeliver(Redeliver::Nack)
    );

    // Lambda redelivers the whole batch (say, a timeout after the answer
    // was lost): the done records replay, m-2 runs again.
    let again = handler.run(batch, None, &ship).await.unwrap();
    assert_eq!(failures(&again.response), ["m-2"]);
    assert_eq!(again.records[0].outcome, Some(Outcome::Replayed));
    assert_eq!(again.records[0].value.as_deref(), Some("shipped m-1"));
    assert_eq!(
        (
            ledger.count("m-1"),
            ledger.count("m-2"),
            ledger.count("m-3")
        ),
        (1, 2, 1)
    );
}

/// A permanent error without a dead-letter hook is listed, left to the
/// queue's redrive policy, with the reason in the report.
#[tokio::test]
async fn a_permanent_error_without_a_hook_is_left_to_the_redrive_policy() {
    let handler = SqsBatchHandler::from_consumer(Consumer::new(idem(), "ship").classify(ByTrait));
    let ledger = Ledger::new();
    let report = handler
        .run(
            event(vec![record("m-1", "invalid"), record("m-2", "{}")]),
            None,
            &shipper(&ledger),
        )
        .await
        .unwrap();
    assert_eq!(failures(&report.response), ["m-1"]);
    assert!(matches!(
        &report.records[0].status,
        RecordStatus::Redeliver(Redeliver::DeadLetter(DeadLetterReason::Permanent(e))) if e == "Invalid"
    ));
}

/// With a dead-letter hook, a permanent error goes to the hook and the
/// record is deleted; a hook that fails leaves it listed.
#[tokio::test]
async fn a_permanent_error_with_a_hook_is_dead_lettered_and_deleted() {
    let taken: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let t = Arc::clone(&taken);
    let handler = SqsBatchHandler::from_consumer(Consumer::new(idem(), "ship").classify(ByTrait))
        .on_dead_letter(move |m: SqsMessage, reason: DeadLetterReason| {
            let t = Arc::clone(&t);
            async move {
                let id = m.message_id.unwrap_or_default();
                if id == "m-3" {
                    return Err("dead-letter queue unavailable");
                }
                t.lock().unwrap().push((id, reason.kind().to_owned()));
                Ok(())
            }
        });
    let ledger = Ledger::new();
    let report = handler
        .run(
            event(vec![
                record("m-1", "invalid"),
                record("m-2", "{}"),
                record("m-3", "invalid"),
            ]),
            None,
            &shipper(&ledger),
        )
        .await
        .unwrap();
    assert_eq!(failures(&report.response), ["m-3"]);
    assert_eq!(report.records[0].status, RecordStatus::DeadLettered);
    assert!(matches!(
        report.records[2].status,
        RecordStatus::Redeliver(Redeliver::DeadLetterHookFailed(_))
    ));
    assert_eq!(
        *taken.lock().unwrap(),
        [("m-1".to_owned(), "permanent".to_owned())]
    );
}

/// A duplicate in flight (another invocation holds the key) is listed, and
/// its body does not run; once the holder is done, the redelivery replays.
#[tokio::test]
async fn a_duplicate_in_flight_is_redelivered_then_replays() {
    let idem = idem();
    let handler = SqsBatchHandler::new(idem.clone(), "ship");
    let ledger = Ledger::new();
    let ship = shipper(&ledger);
    // Another invocation's claim on m-1's key, held while this batch runs.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let holder = {
        let idem = idem.clone();
        tokio::spawn(async move {
            idem.call("ship", "m-1")
                .fingerprint_raw(idem_core::Fingerprint::from_sha256(
                    idem_core::KeyDeriver::new().digest(b"{}").unwrap(),
                ))
                .run(|| async {
                    rx.await.ok();
                    Ok::<_, idem_core::Error>("shipped m-1".to_owned())
                })
                .await
        })
    };
    idem_testkit::eventually("the holder's claim", Duration::from_secs(5), || async {
        let info = idem.inspect("ship", "m-1").await.unwrap();
        info.filter(|i| i.state == idem_core::KeyState::Pending)
    })
    .await;
    let batch = event(vec![record("m-1", "{}"), record("m-2", "{}")]);
    let report = handler.run(batch.clone(), None, &ship).await.unwrap();
    assert_eq!(failures(&report.response), ["m-1"]);
    assert_eq!(
        report.records[0].status,
        RecordStatus::Redeliver(Redeliver::Nack)
    );
    assert_eq!(ledger.count("m-1"), 0);

    tx.send(()).unwrap();
    holder.await.unwrap().unwrap();
    let again = handler.run(batch, None, &ship).await.unwrap();
    assert!(failures(&again.response).is_empty());
    assert_eq!(again.records[0].outcome, Some(Outcome::Replayed));
    assert_eq!(ledger.count("m-1"), 0);
}

/// Copies of one message in a batch (the same message id received twice,
/// or two records with the same key and body) run once and share the
/// first copy's fate; a failing message is listed once.
#[tokio::test]
async fn copies_in_a_batch_run_once() {
    let handler = SqsBatchHandler::new(idem(), "ship");
    let ledger = Ledger::new();
    let batch = event(vec![
        record("m-1", "{}"),
        record("m-2", "transient"),
        record("m-1", "{}"),
        record("m-2", "transient"),
    ]);
    let report = handler.run(batch, None, &shipper(&ledger)).await.unwrap();
    assert_eq!(failures(&report.response), ["m-2"]);
    assert_eq!((ledger.count("m-1"), ledger.count("m-2")), (1, 1));
    assert_eq!(report.records[2].copy_of, Some(0));
    assert_eq!(report.records[2].status, RecordStatus::Done);
    assert!(report.records[3].is_failure());

    // Two sends of one order (FIFO-style deduplication id as the key): one run.
    let handler = SqsBatchHandler::new(idem(), "ship").keys(SqsKey::custom(|m: &SqsMessage| {
        Ok(m.body.clone().unwrap_or_default())
    }));
    let ledger = Ledger::new();
    let report = handler
        .run(
            event(vec![record("a", "order-7"), record("b", "order-7")]),
            None,
            &shipper(&ledger),
        )
        .await
        .unwrap();
    assert!(failures(&report.response).is_empty());
    assert_eq!(ledger.count("a") + ledger.count("b"), 1);
}

/// A record without a message id fails the invocation with a typed error
/// before anything runs: no empty `itemIdentifier` is ever sent.
#[tokio::test]
async fn a_record_without_a_message_id_is_a_typed_error() {
    let handler = SqsBatchHandler::new(idem(), "ship");
    let ledger = Ledger::new();
    let mut no_id = record("x", "{}");
    no_id.message_id = None;
    let mut empty_id = record("x", "{}");
    empty_id.message_id = Some(String::new());
    for bad in [no_id, empty_id] {
        let err = handler
            .run(
                event(vec![record("m-1", "{}"), bad]),
                None,
                &shipper(&ledger),
            )
            .await
            .unwrap_err();
        assert_eq!(err, SqsBatchError::MissingMessageId { index: 1 });
        assert!(err.to_string().contains("messageId"));
    }
    assert_eq!(ledger.total(), 0);
}

/// FIFO: once a record of a message group is listed, the later records of
/// that group in the batch are listed too and not run; other groups go on.
#[tokio::test]
async fn fifo_a_failed_record_blocks_the_rest_of_its_group() {
    let handler = SqsBatchHandler::new(idem(), "ship");
    let ledger = Ledger::new();
    let fifo = |id: &str, group: &str, body: &str| {
        let mut r = record(id, body);
        r.attributes.insert("MessageGroupId".into(), group.into());
        r.attributes
            .insert("MessageDeduplicationId".into(), format!("dedup-{id}"));
        r
    };
    let batch = event(vec![
        fifo("a1", "A", "{}"),
        fifo("b1", "B", "{}"),
        fifo("a2", "A", "transient"),
        fifo("b2", "B", "{}"),
        fifo("a3", "A", "{}"),
        fifo("a4", "A", "{}"),
    ]);
    let report = handler
        .run(batch.clone(), None, &shipper(&ledger))
        .await
        .unwrap();
    assert_eq!(failures(&report.response), ["a2", "a3", "a4"]);
    assert_eq!(
        report.records[4].status,
        RecordStatus::Redeliver(Redeliver::GroupBlocked)
    );
    assert_eq!(
        report.records[5].status,
        RecordStatus::Redeliver(Redeliver::GroupBlocked)
    );
    assert_eq!((ledger.count("a3"), ledger.count("a4")), (0, 0));
    assert_eq!((ledger.count("b1"), ledger.count("b2")), (1, 1));
    // Keys are the deduplication ids.
    assert_eq!(report.records[0].outcome, Some(Outcome::Executed));
}

/// The deadline rule: an absent or past deadline (cargo-lambda's 1970)
/// falls back to the configured lease, with a warning, and stops nothing.
#[tokio::test]
async fn an_absent_or_past_deadline_falls_back_to_the_configured_lease() {
    let idem = Idempotency::builder(MemoryStore::new())
        .lease(Duration::from_secs(7))
        .build();
    let handler = SqsBatchHandler::new(idem, "ship");
    let ledger = Ledger::new();
    for (deadline, past) in [(None, false), (Some(SystemTime::UNIX_EPOCH), true)] {
        let logs = LogCapture::new();
        let report = handler
            .run(
                event(vec![record("m-1", "{}")]),
                deadline,
                &shipper(&ledger),
            )
            .with_subscriber(logs.subscriber())
            .await
            .unwrap();
        assert_eq!(report.plan.lease, Duration::from_secs(7));
        assert_eq!(report.plan.stop_after, None);
        assert_eq!(
            matches!(report.plan.source, LeaseSource::PastDeadline { .. }),
            past
        );
        assert!(failures(&report.response).is_empty());
        let text = logs.contents();
        assert!(text.contains("WARN"), "{text}");
        assert!(
            text.contains(if past {
                "has passed already"
            } else {
                "no deadline"
            }),
            "{text}"
        );
    }
}

/// The deadline rule: a deadline closer than the configured lease bounds
/// every call's lease; the batch stops before it, the finished records
/// are deleted and the unfinished one is listed.
#[tokio::test(start_paused = true)]
async fn a_near_deadline_bounds_the_lease_and_stops_the_batch() {
    let store = MemoryStore::new();
    let idem = Idempotency::builder(store)
        .lease(Duration::from_secs(30))
        .build();
    let handler = SqsBatchHandler::new(idem.clone(), "ship");
    let ledger = Ledger::new();
    let deadline = SystemTime::now() + Duration::from_secs(5);
    let batch = event(vec![
        record("m-1", "{}"),
        record("m-2", "slow"),
        record("m-3", "{}"),
    ]);
    let report = handler
        .run(batch, Some(deadline), &shipper(&ledger))
        .await
        .unwrap();
    assert!(report.plan.lease <= Duration::from_secs(5));
    assert!(report.plan.lease > Duration::from_secs(4));
    assert!(matches!(report.plan.source, LeaseSource::Deadline { .. }));
    assert_eq!(failures(&report.response), ["m-2"]);
    assert_eq!(
        report.records[1].status,
        RecordStatus::Redeliver(Redeliver::Deadline)
    );
    // The stopped record's claim was made with the bounded lease: it is
    // held no longer than the time the invocation had left.
    let info = idem.inspect("ship", "m-2").await.unwrap().unwrap();
    assert_eq!(info.state, idem_core::KeyState::Pending);
    assert!(
        info.lease_left.unwrap() <= Duration::from_secs(5),
        "{info:?}"
    );
}
