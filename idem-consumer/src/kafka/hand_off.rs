//! Moving a record aside: to the retry topic (still failing after the
//! in-process attempts) or the dead-letter topic, with headers saying why
//! and where it came from.

use super::poller::Taken;
use crate::decision::{DeadLetterReason, dead_letter_field};
use crate::error::ConsumerError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::time::Duration;

/// Names of the headers this adapter reads and writes. Dead letters also
/// carry the fields every adapter writes,
/// [`dead_letter_field`](crate::dead_letter_field) (`idem-reason`,
/// `idem-kind`, `idem-deliveries`, `idem-failures`); the Kafka-only names
/// below stay for readers that use them.
pub mod header_names {
    /// The producer's idempotency key (the default key header).
    pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
    /// Why the record was moved (the reason's text, on one line); the same
    /// name as [`dead_letter_field::REASON`](crate::dead_letter_field::REASON).
    pub const REASON: &str = crate::dead_letter_field::REASON;
    /// The reason's stable name ([`DeadLetterReason::kind`](crate::DeadLetterReason::kind), also in
    /// [`dead_letter_field::KIND`](crate::dead_letter_field::KIND) on dead
    /// letters), or `retry` on the retry topic.
    pub const REASON_KIND: &str = "idem-reason-kind";
    /// The topic the record was first published to.
    pub const ORIGINAL_TOPIC: &str = "idem-original-topic";
    /// Its partition there.
    pub const ORIGINAL_PARTITION: &str = "idem-original-partition";
    /// Its offset there.
    pub const ORIGINAL_OFFSET: &str = "idem-original-offset";
    /// Handler runs so far, over every hop; read back as the delivery count
    /// when the record is consumed again from the retry topic.
    pub const ATTEMPTS: &str = "idem-attempts";
}

use header_names::*;

/// Where a record goes when it leaves its partition undone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Destination {
    /// The retry topic: consumed again (by this group too), attempts carried on.
    Retry(String),
    /// The dead-letter topic, with the reason.
    DeadLetter(String, DeadLetterReason),
}

/// The headers of the moved record: the original ones (minus ours), the
/// origin (kept from the first hop), the attempts and the reason; on a
/// dead letter also the fields every adapter writes.
///
/// A record with header names that are not UTF-8 keeps every original
/// header, byte for byte (rdkafka can copy them all, not write one such
/// name): ours from an earlier hop stay too, and the ones added here come
/// after them, the ones a reader of a repeated header takes.
fn headers_for(t: &Taken, dest: &Destination, attempts: u32) -> OwnedHeaders {
    let ours = [
        REASON,
        REASON_KIND,
        ORIGINAL_TOPIC,
        ORIGINAL_PARTITION,
        ORIGINAL_OFFSET,
        ATTEMPTS,
        dead_letter_field::KIND,
        dead_letter_field::DELIVERIES,
        dead_letter_field::FAILURES,
    ];
    let mut out = OwnedHeaders::new();
    if let Some(h) = &t.headers {
        if h.unreadable() > 0 {
            out = h.raw().clone();
        } else {
            for h in h.iter().filter(|h| !ours.contains(&h.key)) {
                out = out.insert(Header {
                    key: h.key,
                    value: h.value,
                });
            }
        }
    }
    let origin = |name: &str, here: String| -> String {
        t.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .and_then(|v| std::str::from_utf8(v).ok())
            .map(str::to_owned)
            .unwrap_or(here)
    };
    let topic = origin(ORIGINAL_TOPIC, t.topic.to_string());
    let partition = origin(ORIGINAL_PARTITION, t.partition.to_string());
    let offset = origin(ORIGINAL_OFFSET, t.offset.to_string());
    let (kind, mut fields) = match dest {
        Destination::Retry(_) => (
            "retry",
            vec![(
                REASON,
                "still failing after the in-process attempts".to_owned(),
            )],
        ),
        // `idem-reason` (the shared name) comes with the shared fields.
        Destination::DeadLetter(_, r) => (r.kind(), r.fields(attempts)),
    };
    fields.extend([
        (REASON_KIND, kind.to_owned()),
        (ORIGINAL_TOPIC, topic),
        (ORIGINAL_PARTITION, partition),
        (ORIGINAL_OFFSET, offset),
        (ATTEMPTS, attempts.to_string()),
    ]);
    for (k, v) in &fields {
        out = out.insert(Header {
            key: k,
            value: Some(v.as_str()),
        });
    }
    out
}

/// Publishes `t` to `dest` and waits for the broker's acknowledgement.
pub(super) async fn publish(
    producer: &FutureProducer,
    t: &Taken,
    dest: &Destination,
    attempts: u32,
    timeout: Duration,
) -> Result<(), ConsumerError> {
    let topic = match dest {
        Destination::Retry(topic) | Destination::DeadLetter(topic, _) => topic,
    };
    let headers = headers_for(t, dest, attempts);
    let mut record = FutureRecord::<[u8], [u8]>::to(topic)
        .payload(t.msg.payload().as_ref())
        .headers(headers);
    if let Some(k) = &t.record_key {
        record = record.key(k.as_slice());
    }
    producer
        .send(record, timeout)
        .await
        .map(|_| ())
        .map_err(|(e, _)| ConsumerError::broker_error(super::BROKER, "publish", e))
}
