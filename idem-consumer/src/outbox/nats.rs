//! [`NatsSink`]: JetStream publishes, their acks awaited together.

use super::{OutboxMessage, Sink, SinkError, has_control};
use async_nats::HeaderMap;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::{self, ErrorCode};
use async_trait::async_trait;
use std::fmt;

const BROKER: &str = "nats";

/// The header carrying the message's ordering key, for readers that want it.
const KEY_HEADER: &str = "Idem-Outbox-Key";

/// Publishes outbox messages through JetStream to the subject `topic`,
/// with `Nats-Msg-Id: <id>` (the id a
/// [`NatsConsumer`](crate::nats::NatsConsumer) reads by default, and the
/// one JetStream's own duplicate window drops re-sends by) and
/// `Idem-Outbox-Key: <key>`, and the message's own
/// [`headers`](OutboxMessage::headers) (the W3C trace context:
/// `traceparent`, `tracestate`) under their names as given: NATS header
/// names are case-sensitive. A stored header named like one of the sink's
/// two is replaced by it; NATS clients trim the spaces around a value.
/// The whole batch is published at once, then every publish ack awaited
/// together: `Ok` once the stream stored it.
///
/// | what happened | result |
/// | --- | --- |
/// | the stream acked it (or dropped it as a duplicate of a stored one) | `Ok` |
/// | no stream captures the subject (no responders) | `Refused` |
/// | over the server's `max_payload` or the stream's `max_msg_size` | `Refused` |
/// | id or key with a control character, an invalid subject | `Refused` |
/// | a header name that is not printable ASCII or has a colon, a header value with a line break | `Refused` |
/// | no ack within the context's timeout, connection lost | `Unavailable` |
/// | any other JetStream error (storage full, no leader…) | `Unavailable` |
///
/// The ack timeout is the JetStream context's (5 s by default; set it with
/// `async_nats::jetstream::context::ContextBuilder::timeout`).
///
/// ```no_run
/// use idem_consumer::nats::async_nats;
/// use idem_consumer::outbox::NatsSink;
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let sink = NatsSink::new(js); // a stream must capture the topics, e.g. `ORDERS.>`
/// # let _ = sink;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct NatsSink {
    js: jetstream::Context,
}

impl fmt::Debug for NatsSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsSink").finish_non_exhaustive()
    }
}

impl NatsSink {
    /// Publishes through `js`.
    ///
    /// ```no_run
    /// use idem_consumer::nats::async_nats;
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = async_nats::connect("127.0.0.1:4222").await?;
    /// let js = async_nats::jetstream::context::ContextBuilder::new()
    ///     .timeout(std::time::Duration::from_secs(2))
    ///     .build(client);
    /// let sink = idem_consumer::outbox::NatsSink::new(js);
    /// # let _ = sink;
    /// # Ok(()) }
    /// ```
    pub fn new(js: jetstream::Context) -> Self {
        NatsSink { js }
    }

    /// Refuses up front what would otherwise break the connection or wait
    /// for an ack that never comes: the server closes a connection that
    /// sends more than `max_payload`, headers included.
    fn check(&self, m: &OutboxMessage, max_payload: usize) -> Result<HeaderMap, SinkError> {
        if has_control(&m.id) || has_control(&m.key) {
            return Err(SinkError::refused(
                "the id or key contains a control character, which a NATS header cannot carry",
            ));
        }
        if m.topic.is_empty() || m.topic.contains(char::is_whitespace) || has_control(&m.topic) {
            return Err(SinkError::refused(format!(
                "`{}` is not a NATS subject to publish to (empty, or with whitespace)",
                m.topic
            )));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &m.headers {
            if let Some(why) = unpublishable_header(name, value) {
                return Err(SinkError::refused(format!(
                    "the message's header `{}` cannot be a NATS header: {why}",
                    name.escape_debug()
                )));
            }
            // Appended: a repeated header keeps every value, in order.
            headers.append(name.as_str(), value.as_str());
        }
        // The sink's own last, replacing a stored header of either name:
        // JetStream de-duplicates by this id, and the consumer reads it.
        headers.insert("Nats-Msg-Id", m.id.as_str());
        headers.insert(KEY_HEADER, m.key.as_str());
        // NATS/1.0\r\n, each `Name: value\r\n`, then \r\n.
        let header_len = 12
            + headers
                .iter()
                .map(|(name, values)| {
                    let name: &str = name.as_ref();
                    values
                        .iter()
                        .map(|v| name.len() + 2 + v.as_str().len() + 2)
                        .sum::<usize>()
                })
                .sum::<usize>();
        let size = m.payload.len() + header_len;
        if max_payload > 0 && size > max_payload {
            return Err(SinkError::refused(format!(
                "the message is {size} bytes with its headers, over the NATS server's max_payload \
                 of {max_payload}; raise max_payload or make the message smaller"
            )));
        }
        Ok(headers)
    }
}

/// Why a stored header cannot go out as a NATS header unchanged, if it
/// cannot: a name outside printable ASCII or with a colon, or a value with
/// a line break, would corrupt the message's header block (and a client
/// that cannot parse a delivered header block drops its connection).
fn unpublishable_header(name: &str, value: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("its name is empty");
    }
    if !name.bytes().all(|b| b.is_ascii_graphic() && b != b':') {
        return Some("a NATS header name is printable ASCII without spaces or colons");
    }
    if value.contains(['\r', '\n']) {
        return Some("its value has a line break");
    }
    None
}

/// What a failed publish means for its message.
fn judge(m: &OutboxMessage, e: PublishError) -> SinkError {
    match e.kind() {
        PublishErrorKind::StreamNotFound => SinkError::refused(format!(
            "no JetStream stream captures the subject `{}` (no responders); create one, or \
             publish to a subject a stream captures",
            m.topic
        ))
        .with_source(e),
        PublishErrorKind::Other => match jetstream_code(&e) {
            Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => SinkError::refused(format!(
                "the stream capturing `{}` refuses the message ({} bytes of payload, plus \
                 headers) as over its max_msg_size",
                m.topic,
                m.payload.len()
            ))
            .with_source(e),
            Some(ErrorCode::STREAM_NOT_FOUND) => SinkError::refused(format!(
                "no JetStream stream captures the subject `{}`",
                m.topic
            ))
            .with_source(e),
            _ => {
                SinkError::unavailable(format!("publishing to `{}` failed", m.topic)).with_source(e)
            }
        },
        kind => {
            SinkError::unavailable(format!("publishing to `{}`: {kind}", m.topic)).with_source(e)
        }
    }
}

/// The JetStream error code of a refused publish, when the server sent one.
fn jetstream_code(e: &PublishError) -> Option<ErrorCode> {
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<jetstream::Error>())
        .map(jetstream::Error::error_code)
}

#[async_trait]
impl Sink for NatsSink {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let max_payload = self.js.client().server_info().max_payload;
        // Each publish, not only each ack, runs at once: while the client
        // is cut off its outgoing queue fills and a publish waits up to the
        // context's timeout, which one after the other would add up.
        let acks = batch.iter().map(|m| async move {
            let headers = self.check(m, max_payload)?;
            let ack = self
                .js
                .publish_with_headers(m.topic.clone(), headers, m.payload.clone())
                .await
                .map_err(|e| judge(m, e))?;
            ack.await.map(drop).map_err(|e| judge(m, e))
        });
        let results = futures_util::future::join_all(acks).await;
        let failed = results.iter().filter(|r| r.is_err()).count();
        if failed > 0 {
            tracing::debug!(
                sink = BROKER,
                messages = batch.len(),
                failed,
                "JetStream publish"
            );
        }
        results
    }

    fn describe(&self) -> String {
        let info = self.js.client().server_info();
        format!("{BROKER} {}:{}", info.host, info.port)
    }

    fn system(&self) -> &'static str {
        BROKER
    }
}
