//! Real batches from the local SQS endpoint: received with ReceiveMessage,
//! answered by the handler, the answer applied as Lambda's event source
//! mapping applies it (`support::Queue::apply`: every record not listed
//! deleted, the listed ones left to come back after the visibility
//! timeout), until the queue drains.

use crate::support::{Queue, event, failures};
use aws_lambda_events::sqs::SqsMessage;
use idem_consumer::ConsumerError;
use idem_core::{Idempotency, MemoryStore};
use idem_lambda::{SqsBatchHandler, SqsKey};
use idem_testkit::Ledger;
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

/// Receives, answers and applies batches until the queue is empty; checks
/// that every batch's `batchItemFailures` lists exactly the records the
/// handler reports as failed, that every listed record comes back and no
/// deleted one does. Returns the number of batches.
async fn drain<H, Fut>(queue: &Queue, handler: &SqsBatchHandler, body: &H) -> usize
where
    H: Fn(SqsMessage) -> Fut,
    Fut: Future<Output = Result<String, String>>,
{
    let mut batches = 0;
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    let mut awaited: BTreeSet<String> = BTreeSet::new();
    let mut empty_in_a_row = 0;
    loop {
        assert!(batches < 400, "the queue does not drain");
        let records = queue.receive(1).await;
        if records.is_empty() {
            empty_in_a_row += 1;
            if queue.depth().await == 0 && empty_in_a_row >= 2 {
                break;
            }
            continue;
        }
        empty_in_a_row = 0;
        batches += 1;
        for r in &records {
            let id = r.message_id.clone().unwrap();
            assert!(
                !deleted.contains(&id),
                "{id} was deleted, yet delivered again"
            );
            awaited.remove(&id);
        }
        // An invocation with the whole function timeout ahead of it.
        let deadline = SystemTime::now() + Duration::from_secs(60);
        let report = handler
            .run(event(records.clone()), Some(deadline), body)
            .await
            .unwrap();
        let reported: BTreeSet<String> = report
            .records
            .iter()
            .filter(|r| r.is_failure())
            .map(|r| r.message_id.clone())
            .collect();
        let listed = failures(&report.response);
        assert_eq!(listed.iter().cloned().collect::<BTreeSet<_>>(), reported);
        assert_eq!(
            listed.len(),
            reported.len(),
            "an id listed twice: {listed:?}"
        );
        assert!(listed.iter().all(|id| !id.is_empty()));
        deleted.extend(queue.apply(&records, &report.response).await);
        awaited.extend(listed);
    }
    assert!(
        awaited.is_empty(),
        "listed but never delivered again: {awaited:?}"
    );
    batches
}

/// A standard queue: 30 orders, 6 of them sent twice (two messages, one
/// order: keyed on the order, so one effect), every third order failing
/// once with a retryable error. Once the queue drains, every order's
/// effect happened exactly once and every body failed at most as planned.
#[tokio::test]
async fn a_standard_queue_drains_with_one_effect_per_key() {
    let queue = Queue::create("idem-lambda-std", false, 1).await;
    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("q")
        .build();
    let handler =
        SqsBatchHandler::new(idem, "orders.ship").keys(SqsKey::custom(|m: &SqsMessage| {
            let v: serde_json::Value = serde_json::from_str(m.body.as_deref().unwrap_or(""))
                .map_err(|e| ConsumerError::Malformed(e.to_string()))?;
            Ok(format!("order-{}", v["order"]))
        }));
    let attempts = Ledger::new();
    let effects = Ledger::new();
    let body = |m: SqsMessage| {
        let (attempts, effects) = (attempts.clone(), effects.clone());
        async move {
            let v: serde_json::Value = serde_json::from_str(m.body.as_deref().unwrap()).unwrap();
            let order = v["order"].as_u64().unwrap();
            let key = format!("order-{order}");
            let n = attempts.record(&key);
            if order.is_multiple_of(3) && n == 1 {
                return Err(format!("carrier timeout for {key}"));
            }
            effects.record(&key);
            Ok(format!("shipped {key}"))
        }
    };
    for order in 0..30u64 {
        queue.send(&format!(r#"{{"order":{order}}}"#), None).await;
        if order.is_multiple_of(5) {
            queue.send(&format!(r#"{{"order":{order}}}"#), None).await;
        }
    }
    let batches = drain(&queue, &handler, &body).await;
    let counts: BTreeMap<String, usize> = (0..30)
        .map(|o| format!("order-{o}"))
        .map(|k| (k.clone(), effects.count(&k)))
        .collect();
    assert!(
        counts.values().all(|&n| n == 1),
        "effects per order: {counts:?}"
    );
    for o in 0..30u64 {
        let runs = attempts.count(&format!("order-{o}"));
        assert_eq!(
            runs,
            if o.is_multiple_of(3) { 2 } else { 1 },
            "order-{o} ran {runs} times"
        );
    }
    assert!(batches >= 2);
    queue.delete().await;
}

/// A FIFO queue: three message groups of six messages, keyed on their
/// deduplication ids; one message of group `g1` fails once. Once the queue
/// drains, every message's effect happened exactly once and each group's
/// effects happened in the order the messages were sent: the records after
/// a failed one in its group were listed and not run.
#[tokio::test]
async fn a_fifo_queue_drains_in_group_order() {
    let queue = Queue::create("idem-lambda-fifo", true, 1).await;
    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("q")
        .build();
    let handler = SqsBatchHandler::new(idem, "orders.ship");
    let attempts = Ledger::new();
    let order: std::sync::Arc<std::sync::Mutex<BTreeMap<String, Vec<u32>>>> = Default::default();
    let effects = Ledger::new();
    let body = |m: SqsMessage| {
        let (attempts, effects, order) = (attempts.clone(), effects.clone(), order.clone());
        async move {
            let text = m.body.clone().unwrap();
            let (group, seq) = text.split_once('/').unwrap();
            let seq: u32 = seq.parse().unwrap();
            let n = attempts.record(&text);
            if group == "g1" && seq == 2 && n == 1 {
                return Err("transient".to_owned());
            }
            effects.record(&text);
            order
                .lock()
                .unwrap()
                .entry(group.to_owned())
                .or_default()
                .push(seq);
            Ok(text)
        }
    };
    for seq in 0..6u32 {
        for g in ["g0", "g1", "g2"] {
            let body = format!("{g}/{seq}");
            queue.send(&body, Some((g, &format!("d-{g}-{seq}")))).await;
        }
    }
    drain(&queue, &handler, &body).await;
    for g in ["g0", "g1", "g2"] {
        for seq in 0..6u32 {
            assert_eq!(effects.count(&format!("{g}/{seq}")), 1, "{g}/{seq}");
        }
        assert_eq!(
            order.lock().unwrap()[g],
            (0..6).collect::<Vec<u32>>(),
            "group {g}"
        );
    }
    assert_eq!(attempts.count("g1/2"), 2);
    queue.delete().await;
}
