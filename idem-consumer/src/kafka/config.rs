//! [`KafkaConfig`] and [`KafkaKey`]: what to consume and how, and the
//! core's [`Message`] built from a record under that configuration.

use super::header_names;
use super::headers::RecordHeaders;
use super::{BROKER, hex};
use crate::message::Message;
use bytes::Bytes;
use rdkafka::ClientConfig;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;

/// Where a record's idempotency key (the core's message id) comes from.
///
/// To derive keys from the payload instead, give the [`Consumer`](crate::Consumer)
/// [`KeySource::Payload`](crate::KeySource::Payload): it ignores ids.
///
/// ```
/// use idem_consumer::kafka::{KafkaConfig, KafkaKey, header_names};
///
/// assert_eq!(KafkaKey::default(), KafkaKey::Header(header_names::IDEMPOTENCY_KEY.to_owned()));
/// assert_eq!(header_names::IDEMPOTENCY_KEY, "idempotency-key");
/// // Producers that set a record key but no idempotency header:
/// let cfg = KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"]).key(KafkaKey::RecordKeyAndPayloadHash);
/// # let _ = cfg;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KafkaKey {
    /// A header set by the producer (default `idempotency-key`). A record
    /// without it falls back to the consumer's key source (by default the
    /// payload); a value that is not UTF-8 is dead-lettered.
    Header(String),
    /// The record key and a SHA-256 of the payload, `"<key>:<hash>"`: the
    /// same record re-published is one key, two records under one key are
    /// two. A record without a key falls back to the consumer's key source.
    RecordKeyAndPayloadHash,
}

impl Default for KafkaKey {
    fn default() -> Self {
        KafkaKey::Header(header_names::IDEMPOTENCY_KEY.to_owned())
    }
}

/// How to consume.
///
/// ```
/// use idem_consumer::kafka::{KafkaConfig, KafkaKey};
/// use std::time::Duration;
/// let cfg = KafkaConfig::new("127.0.0.1:9092", "billing", ["orders"])
///     .key(KafkaKey::RecordKeyAndPayloadHash)
///     .retry_topic("orders.retry")
///     .dead_letter_topic("orders.DLT")
///     .commit_interval(Duration::from_millis(200))
///     .set("session.timeout.ms", "10000");
/// assert_eq!(cfg.dead_letter_for("orders"), "orders.DLT");
/// ```
#[derive(Debug, Clone)]
pub struct KafkaConfig {
    pub(super) brokers: String,
    pub(super) group: String,
    pub(super) topics: Vec<String>,
    pub(super) key: KafkaKey,
    pub(super) client: Vec<(String, String)>,
    pub(super) attempts_in_process: u32,
    pub(super) retry_topic: Option<String>,
    pub(super) dead_letter_topic: Option<String>,
    pub(super) commit_interval: Duration,
    pub(super) revoke_deadline: Duration,
    pub(super) in_order_per_key: bool,
    pub(super) buffer: usize,
    pub(super) publish_timeout: Duration,
}

impl KafkaConfig {
    /// Consume `topics` from the brokers `brokers` (`host:port,…`) in
    /// consumer group `group`.
    ///
    /// Defaults: keys from the `idempotency-key` header, 3 runs in process
    /// before a failing record is moved, no retry topic, dead letters to
    /// `<topic>.DLT`, commits every 500 ms, 10 s for handlers to finish on
    /// a revocation, records of a partition run concurrently, 256 records
    /// buffered, a new group starts at the earliest offset.
    pub fn new<S: Into<String>>(
        brokers: impl Into<String>,
        group: impl Into<String>,
        topics: impl IntoIterator<Item = S>,
    ) -> KafkaConfig {
        KafkaConfig {
            brokers: brokers.into(),
            group: group.into(),
            topics: topics.into_iter().map(Into::into).collect(),
            key: KafkaKey::default(),
            client: Vec::new(),
            attempts_in_process: 3,
            retry_topic: None,
            dead_letter_topic: None,
            commit_interval: Duration::from_millis(500),
            revoke_deadline: Duration::from_secs(10),
            in_order_per_key: false,
            buffer: 256,
            publish_timeout: Duration::from_secs(10),
        }
    }

    /// Where keys come from (default the `idempotency-key` header).
    pub fn key(mut self, key: KafkaKey) -> Self {
        self.key = key;
        self
    }

    /// Any librdkafka consumer property (`session.timeout.ms`,
    /// `security.protocol`, …), applied after this adapter's own
    /// (`enable.auto.commit=false` is required and cannot be overridden).
    pub fn set(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.client.push((key.into(), value.into()));
        self
    }

    /// Runs of a failing handler in this process, with the consumer's
    /// backoff between them, before the record is moved to the retry or
    /// dead-letter topic (default 3, at least 1).
    pub fn attempts_in_process(mut self, n: u32) -> Self {
        self.attempts_in_process = n.max(1);
        self
    }

    /// Move records still failing after the in-process attempts to this
    /// topic, and consume it too (it is added to the subscription). The
    /// attempts carry on in the `idem-attempts` header (the delivery count
    /// when consumed back) and idem counts the handler's failures per key,
    /// so the consumer's `max_failures` still ends in the dead-letter topic.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.retry_topic = Some(topic.into());
        self
    }

    /// The dead-letter topic for every source topic (default
    /// `<topic>.DLT`, per topic).
    pub fn dead_letter_topic(mut self, topic: impl Into<String>) -> Self {
        self.dead_letter_topic = Some(topic.into());
        self
    }

    /// How often decided offsets are committed (default 500 ms).
    pub fn commit_interval(mut self, d: Duration) -> Self {
        self.commit_interval = d.max(Duration::from_millis(1));
        self
    }

    /// How long in-flight handlers of a revoked partition may run before it
    /// is given up anyway (default 10 s). Keep it below the group's
    /// rebalance timeout (`max.poll.interval.ms`). `run`'s shutdown drains
    /// for the consumer's [`drain_timeout`](crate::Consumer::drain_timeout)
    /// instead, as every adapter's does.
    pub fn revoke_deadline(mut self, d: Duration) -> Self {
        self.revoke_deadline = d;
        self
    }

    /// Run the records of one partition that share a record key one after
    /// the other, in offset order (default off: concurrently).
    pub fn in_order_per_key(mut self, on: bool) -> Self {
        self.in_order_per_key = on;
        self
    }

    /// Records taken from the broker and not yet started, at most (default
    /// 256, at least 1); polling pauses beyond it.
    pub fn buffer(mut self, n: usize) -> Self {
        self.buffer = n.max(1);
        self
    }

    /// The dead-letter topic for records of `topic`.
    pub fn dead_letter_for(&self, topic: &str) -> String {
        match &self.dead_letter_topic {
            Some(t) => t.clone(),
            None => format!("{topic}.DLT"),
        }
    }

    pub(super) fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers)
            .set("group.id", &self.group)
            .set("auto.offset.reset", "earliest");
        for (k, v) in &self.client {
            c.set(k, v);
        }
        // The whole point: offsets move only by the commit rule.
        c.set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false");
        c
    }

    /// The core's message for a record: payload, id per [`KafkaKey`],
    /// delivery count from the `idem-attempts` header; with `otel`, the
    /// producer's trace context from `traceparent` and `tracestate`.
    pub(super) fn message_of(
        &self,
        payload: Bytes,
        record_key: Option<&[u8]>,
        headers: Option<&RecordHeaders>,
        topic: &Arc<str>,
    ) -> Message {
        let header = |name: &str| headers.and_then(|h| h.get(name));
        let attempts = header(header_names::ATTEMPTS)
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        let msg = Message::new(payload.clone())
            .with_delivery_count(attempts.saturating_add(1))
            .with_source(BROKER, topic.clone());
        // Kafka headers are appended, never replaced: a record may carry a
        // trace header twice (a producer that added its own), and `header`
        // takes the last, as Kafka clients read a repeated header. Not
        // UTF-8: no trace context (a W3C one is ASCII).
        #[cfg(feature = "otel")]
        let msg = crate::otel::with_trace_headers(msg, |name| {
            header(name)
                .and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_owned)
        });
        match &self.key {
            KafkaKey::Header(name) => match header(name) {
                None => msg,
                Some(v) => match std::str::from_utf8(v) {
                    Ok(id) => msg.with_id(id),
                    Err(_) => msg.with_unreadable_id(format!("header `{name}` is not UTF-8")),
                },
            },
            KafkaKey::RecordKeyAndPayloadHash => match record_key {
                None => msg,
                Some(k) => {
                    let key = match std::str::from_utf8(k) {
                        Ok(s) => s.to_owned(),
                        Err(_) => hex(k),
                    };
                    let digest = Sha256::digest(&payload);
                    msg.with_id(format!("{key}:{}", hex(&digest[..16])))
                }
            },
        }
    }
}
