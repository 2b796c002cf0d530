//! [`KafkaSink`]: an idempotent producer, a batch sent at once and its
//! delivery reports awaited together.

use super::{OutboxMessage, Sink, SinkError};
use crate::error::ConsumerError;
use crate::kafka::header_names::IDEMPOTENCY_KEY;
use async_trait::async_trait;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::util::Timeout;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

const BROKER: &str = "kafka";

/// Publishes outbox messages as Kafka records to the topic `topic`, with
/// record key `key` (so one key's messages stay in one partition, in
/// order) and header `idempotency-key = id` (the key a
/// [`KafkaConsumer`](crate::kafka::KafkaConsumer) reads by default), after
/// the message's own [`headers`](OutboxMessage::headers), published as
/// they are (the W3C trace context: `traceparent`, `tracestate`). The
/// producer is idempotent (`enable.idempotence=true`, `acks=all`): its own
/// retries neither duplicate nor reorder a partition's records. `Ok` once
/// the delivery report says every in-sync replica has the record.
///
/// | what happened | result |
/// | --- | --- |
/// | delivered | `Ok` |
/// | `MessageSizeTooLarge` (over the producer's `message.max.bytes` or the topic's limit) | `Refused` |
/// | `UnknownTopicOrPartition`, `InvalidTopic`, `TopicAuthorizationFailed` (and librdkafka's local unknown topic or partition) | `Refused` |
/// | anything else: `message.timeout.ms` ran out with the broker down, the local queue full for longer than [`queue_timeout`](Self::queue_timeout), a broker error | `Unavailable` |
///
/// How long an unreachable broker takes to become `Unavailable` is
/// librdkafka's `message.timeout.ms` (30 s from
/// [`from_brokers`](Self::from_brokers); librdkafka's own default is
/// 300 s); an unknown topic is `Refused` once librdkafka gives up waiting
/// for it to appear, `topic.metadata.propagation.max.ms` (30 s by default):
/// keep that below `message.timeout.ms`, or the record times out as
/// `Unavailable` first. A producer that hit a fatal error (possible with idempotence,
/// say a broker that lost acknowledged records) is made again from the same
/// configuration on the next `send`.
///
/// ```no_run
/// use idem_consumer::outbox::KafkaSink;
/// # fn demo() -> Result<(), idem_consumer::ConsumerError> {
/// let sink = KafkaSink::from_brokers("127.0.0.1:9092")?;
/// # let _ = sink;
/// # Ok(()) }
/// ```
pub struct KafkaSink {
    config: ClientConfig,
    producer: Mutex<FutureProducer>,
    queue_timeout: Duration,
}

impl fmt::Debug for KafkaSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaSink")
            .field("brokers", &self.config.get("bootstrap.servers"))
            .field("queue_timeout", &self.queue_timeout)
            .finish_non_exhaustive()
    }
}

impl KafkaSink {
    /// A producer from `config` (it must set `bootstrap.servers`), with
    /// `enable.idempotence=true` and `acks=all` whatever it says: without
    /// them a retried send may duplicate or reorder a key's records.
    ///
    /// ```no_run
    /// use idem_consumer::kafka::rdkafka::ClientConfig;
    /// # fn demo() -> Result<(), idem_consumer::ConsumerError> {
    /// let sink = idem_consumer::outbox::KafkaSink::new(
    ///     ClientConfig::new()
    ///         .set("bootstrap.servers", "127.0.0.1:9092")
    ///         .set("message.timeout.ms", "10000")
    ///         .set("compression.type", "lz4"),
    /// )?;
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn new(config: &ClientConfig) -> Result<Self, ConsumerError> {
        if config.get("bootstrap.servers").is_none_or(str::is_empty) {
            return Err(ConsumerError::Config(
                "the Kafka producer's configuration has no `bootstrap.servers`; set it to the \
                 brokers' `host:port,…` (or use KafkaSink::from_brokers)"
                    .into(),
            ));
        }
        let mut config = config.clone();
        config.set("enable.idempotence", "true").set("acks", "all");
        let producer = create(&config)?;
        Ok(KafkaSink {
            config,
            producer: Mutex::new(producer),
            queue_timeout: Duration::from_secs(5),
        })
    }

    /// A producer for the brokers `brokers` (`host:port,…`), giving up on
    /// a record after 30 s (`message.timeout.ms`), on a topic that does
    /// not exist after 10 s (`topic.metadata.propagation.max.ms`), and
    /// batching for 5 ms (`linger.ms`).
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), idem_consumer::ConsumerError> {
    /// let sink = idem_consumer::outbox::KafkaSink::from_brokers("kafka-1:9092,kafka-2:9092")?;
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn from_brokers(brokers: &str) -> Result<Self, ConsumerError> {
        KafkaSink::new(
            ClientConfig::new()
                .set("bootstrap.servers", brokers)
                .set("message.timeout.ms", "30000")
                .set("topic.metadata.propagation.max.ms", "10000")
                .set("linger.ms", "5"),
        )
    }

    /// How long a send waits for room in librdkafka's local queue
    /// (`queue.buffering.max.messages`) before the message is
    /// `Unavailable` (default 5 s).
    ///
    /// ```no_run
    /// # fn demo() -> Result<(), idem_consumer::ConsumerError> {
    /// use std::time::Duration;
    /// let sink = idem_consumer::outbox::KafkaSink::from_brokers("127.0.0.1:9092")?
    ///     .queue_timeout(Duration::from_secs(1));
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn queue_timeout(mut self, d: Duration) -> Self {
        self.queue_timeout = d;
        self
    }

    /// The producer, made again if the current one hit a fatal error (an
    /// idempotent producer then refuses every send for good).
    fn producer(&self) -> FutureProducer {
        let mut producer = self.producer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((code, reason)) = producer.client().fatal_error() {
            match create(&self.config) {
                Ok(fresh) => {
                    tracing::warn!(
                        sink = BROKER,
                        ?code,
                        reason,
                        "the Kafka producer hit a fatal error; made a new one"
                    );
                    *producer = fresh;
                }
                Err(e) => {
                    tracing::error!(sink = BROKER, ?code, reason, error = %e, "the Kafka producer hit a fatal error and cannot be made again");
                }
            }
        }
        producer.clone()
    }
}

fn create(config: &ClientConfig) -> Result<FutureProducer, ConsumerError> {
    config.create().map_err(|e| {
        ConsumerError::Config(format!(
            "cannot create the Kafka producer: {e}; check the ClientConfig's properties"
        ))
    })
}

/// What a failed delivery means for its message.
fn judge(m: &OutboxMessage, e: KafkaError) -> SinkError {
    use RDKafkaErrorCode as C;
    let reason = match e.rdkafka_error_code() {
        Some(C::MessageSizeTooLarge) => format!(
            "the record ({} bytes) is larger than the producer's message.max.bytes or the topic \
             `{}`'s max.message.bytes",
            m.payload.len(),
            m.topic
        ),
        Some(C::UnknownTopicOrPartition | C::UnknownTopic | C::UnknownPartition) => format!(
            "the topic `{}` does not exist; create it (or let the brokers auto-create topics)",
            m.topic
        ),
        Some(C::InvalidTopic) => format!("`{}` is not a valid topic name", m.topic),
        Some(C::TopicAuthorizationFailed) => format!(
            "the producer may not write to the topic `{}`; grant it WRITE on the topic",
            m.topic
        ),
        _ => {
            return SinkError::unavailable(format!("producing to `{}` failed", m.topic))
                .with_source(e);
        }
    };
    SinkError::refused(reason).with_source(e)
}

#[async_trait]
impl Sink for KafkaSink {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        if batch.is_empty() {
            return Vec::new();
        }
        let producer = self.producer();
        let queue_timeout = Timeout::After(self.queue_timeout);
        let sends = batch.iter().map(|m| {
            let producer = &producer;
            async move {
                let headers = headers_of(m);
                let record = FutureRecord::to(&m.topic)
                    .key(m.key.as_str())
                    .payload(m.payload.as_ref())
                    .headers(headers);
                producer
                    .send(record, queue_timeout)
                    .await
                    .map(drop)
                    .map_err(|(e, _)| judge(m, e))
            }
        });
        futures_util::future::join_all(sends).await
    }

    fn describe(&self) -> String {
        format!(
            "{BROKER} {}",
            self.config.get("bootstrap.servers").unwrap_or_default()
        )
    }

    fn system(&self) -> &'static str {
        BROKER
    }
}

/// The record's headers: the message's own, in order and unchanged (the
/// trace context its producer stored, whatever this build's features),
/// then `idempotency-key`. Last, because a reader of a repeated header
/// takes its last value (as [`KafkaConsumer`](crate::kafka::KafkaConsumer)
/// does): a stored header of that name cannot stand in for the id.
fn headers_of(m: &OutboxMessage) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(m.headers.len() + 1);
    for (name, value) in &m.headers {
        headers = headers.insert(Header {
            key: name.as_str(),
            value: Some(value.as_str()),
        });
    }
    headers.insert(Header {
        key: IDEMPOTENCY_KEY,
        value: Some(m.id.as_str()),
    })
}
