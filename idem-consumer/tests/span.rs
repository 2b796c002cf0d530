//! The tracing span of each message. Alone in its own test binary: tracing
//! caches per-callsite interest, and tests running in parallel without a
//! subscriber can make a scoped one miss events.

use idem_consumer::{Consumer, ErrorClass, Message};
use idem_core::{Idempotency, MemoryStore};

#[derive(Debug)]
enum AppError {
    Invalid,
}

impl std::fmt::Display for AppError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            AppError::Invalid => "amount must be positive",
        })
    }
}

fn classify(_: &AppError) -> ErrorClass {
    ErrorClass::Permanent
}

fn idem() -> Idempotency {
    Idempotency::builder(MemoryStore::new())
        .namespace("t")
        .build()
}

#[tokio::test]
async fn each_message_gets_a_span_with_broker_source_position_delivery_outcome_and_decision() {
    use tracing::instrument::WithSubscriber;
    let logs = idem_testkit::LogCapture::new();
    let c = Consumer::new(idem(), "orders").classify(classify);
    let ok = |_: Message| async { Ok::<_, AppError>(()) };
    let bad = |_: Message| async { Err::<(), _>(AppError::Invalid) };
    let m = Message::new("{}")
        .with_id("o-9")
        .with_delivery_count(3)
        .with_source("nats", "ORDERS/billing")
        .with_position("1042");
    async {
        c.handle(&m, &ok).await;
        c.handle(&m.clone().with_id("o-10"), &bad).await;
    }
    .with_subscriber(logs.subscriber())
    .await;
    let text = logs.contents();
    let acked = text
        .lines()
        .find(|l| l.contains("message acked"))
        .unwrap_or_default();
    for needle in [
        "idem.consume",
        "broker=\"nats\"",
        "ORDERS/billing",
        "position=\"1042\"",
        "id=\"o-9\"",
        "delivery=3",
        "outcome=\"executed\"",
        "decision=\"ack\"",
    ] {
        assert!(acked.contains(needle), "{needle:?} not in {acked:?}");
    }
    let dead = text
        .lines()
        .find(|l| l.contains("dead-lettered"))
        .unwrap_or_default();
    assert!(
        dead.contains("decision=\"dead_letter\"") && dead.contains("amount must be positive"),
        "{dead}"
    );
}
