//! [`SqsSink`]: `SendMessageBatch`, 10 messages (and at most one message's
//! size limit) a request, each message's result its own.

use super::{OutboxMessage, Sink, SinkError, for_all, own_name_refused};
use crate::sqs::ID_ATTRIBUTE;
use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, MessageAttributeValue, SendMessageBatchRequestEntry,
};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, PoisonError};

const BROKER: &str = "sqs";

/// The message attribute carrying the message's ordering key, for readers
/// that want it (absent when the key is empty: SQS refuses empty values).
pub const KEY_ATTRIBUTE: &str = "idem-outbox-key";

/// SQS's default (and, unless the queue's `MaximumMessageSize` says more,
/// its) largest message: 256 KiB, body and attributes together; a batch
/// request is held to it too.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 256 * 1024;

/// The most entries SQS takes in one `SendMessageBatch`.
const MAX_BATCH: usize = 10;

/// The most message attributes SQS allows on one message.
const MAX_ATTRIBUTES: usize = 10;

/// The longest message attribute name SQS allows.
const MAX_ATTRIBUTE_NAME: usize = 256;

/// The error codes of a whole request that sending again cannot fix.
const REFUSING_CODES: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
    "AccessDenied",
    "AccessDeniedException",
    "InvalidParameterValue",
    "InvalidMessageContents",
    "BatchRequestTooLong",
    "UnsupportedOperation",
    "KmsDisabled",
    "KmsNotFound",
    "KmsInvalidState",
    "KmsInvalidKeyUsage",
];

/// Publishes outbox messages to SQS with `SendMessageBatch`: each
/// message's `topic` names its queue (a queue name, looked up once with
/// `GetQueueUrl`, or a whole `https://` URL), unless
/// [`queue_url`](Self::queue_url) sends everything to one queue.
///
/// Every message carries [`OutboxMessage::id`] in the string message
/// attribute [`ID_ATTRIBUTE`] (`idem-id`, where an
/// [`SqsConsumer`](crate::sqs::SqsConsumer) reads the id by default) and
/// its key in [`KEY_ATTRIBUTE`], and each of its
/// [`headers`](OutboxMessage::headers) in a string attribute named as the
/// header (the W3C trace context: `traceparent`, `tracestate`). SQS allows
/// 10 attributes a message, so up to 8 headers (9 for an empty key), and
/// no empty value: a header with an empty value is not sent (an empty
/// `tracestate`, which OpenTelemetry writes for a trace without vendor
/// state, means the same as none), and a header named like the sink's own
/// attributes refuses the message (see the [module](super)). On a FIFO queue (a URL ending in
/// `.fifo`), `MessageGroupId` is the key (or, for an empty key, the topic),
/// so a key's messages keep their order, and `MessageDeduplicationId` is
/// the id, so SQS itself drops a re-send within its 5-minute deduplication
/// interval (a group or deduplication id SQS would refuse, over 128
/// characters or with characters outside its set, is replaced by
/// `h-<SHA-256 in hex>` of it: the same value always maps to the same
/// token). The body is the payload, which must be text SQS accepts.
///
/// `Ok` means SQS accepted the message (stored durably). The relay retries
/// only the messages that failed:
///
/// | what happened | result |
/// | --- | --- |
/// | accepted | `Ok` |
/// | over [`max_message_bytes`](Self::max_message_bytes) (body and attributes), payload not UTF-8 or with characters SQS refuses, an empty id | `Refused` (checked before sending: the batch's other messages go) |
/// | more than 10 attributes with the headers, a header name SQS refuses (other than letters, digits, `-`, `_`, `.`; `AWS.` or `Amazon.` first; over 256 characters), a header value with characters SQS refuses, a header named `idem-id` or `idem-outbox-key` | `Refused` (checked before sending, as above) |
/// | this entry failed, SQS says the sender's fault (`SenderFault`) | `Refused`, with SQS's code and message |
/// | this entry failed, SQS's fault | `Unavailable` |
/// | the queue does not exist, access denied, the request refused as invalid | `Refused`, every message of the request |
/// | throttled, timed out, connection failed, a server error, no answer for the entry | `Unavailable` |
///
/// ```no_run
/// use idem_consumer::outbox::{OutboxMessage, Sink, SqsSink};
/// # async fn demo(client: aws_sdk_sqs::Client) -> Result<(), Box<dyn std::error::Error>> {
/// let sink = SqsSink::new(client);
/// let batch = [OutboxMessage::new(
///     idem_core::outbox::message_id("idem:orders:create:o-1", "orders.fifo"),
///     "orders.fifo", // the queue's name
///     "o-1",         // its message group
///     r#"{"order":"o-1"}"#,
/// )];
/// for result in sink.send(&batch).await {
///     result?; // Refused: park it; Unavailable: try again later
/// }
/// # Ok(()) }
/// ```
pub struct SqsSink {
    client: Client,
    queue_url: Option<String>,
    urls: Mutex<HashMap<String, String>>,
    max_message_bytes: usize,
}

impl fmt::Debug for SqsSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqsSink")
            .field("queue_url", &self.queue_url)
            .field("max_message_bytes", &self.max_message_bytes)
            .finish_non_exhaustive()
    }
}

/// A message ready to send, with its size as SQS counts it.
struct Ready {
    index: usize,
    entry: SendMessageBatchRequestEntry,
    bytes: usize,
}

impl SqsSink {
    /// A sink on `client`; topics are queue names (or URLs).
    ///
    /// ```no_run
    /// # async fn demo(client: aws_sdk_sqs::Client) {
    /// let sink = idem_consumer::outbox::SqsSink::new(client);
    /// # let _ = sink;
    /// # }
    /// ```
    pub fn new(client: Client) -> SqsSink {
        SqsSink {
            client,
            queue_url: None,
            urls: Mutex::new(HashMap::new()),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        }
    }

    /// Sends every message to this queue, whatever its topic.
    ///
    /// ```no_run
    /// # async fn demo(client: aws_sdk_sqs::Client) {
    /// let sink = idem_consumer::outbox::SqsSink::new(client)
    ///     .queue_url("https://sqs.eu-west-1.amazonaws.com/123456789012/orders");
    /// # let _ = sink;
    /// # }
    /// ```
    pub fn queue_url(mut self, url: impl Into<String>) -> Self {
        self.queue_url = Some(url.into());
        self
    }

    /// The largest message (body, attribute names, types and values) and
    /// request sent (default [`DEFAULT_MAX_MESSAGE_BYTES`], 256 KiB): raise
    /// it to the queue's `MaximumMessageSize` when that is larger (SQS
    /// accepts up to 1 MiB where the queue allows it).
    ///
    /// ```no_run
    /// # async fn demo(client: aws_sdk_sqs::Client) {
    /// let sink = idem_consumer::outbox::SqsSink::new(client).max_message_bytes(1024 * 1024);
    /// # let _ = sink;
    /// # }
    /// ```
    pub fn max_message_bytes(mut self, n: usize) -> Self {
        self.max_message_bytes = n.max(1);
        self
    }

    /// The queue URL for `topic`: the fixed one, the topic itself when it
    /// is a URL, or `GetQueueUrl` (cached).
    async fn url_of(&self, topic: &str) -> Result<String, SinkError> {
        if let Some(url) = &self.queue_url {
            return Ok(url.clone());
        }
        if topic.starts_with("https://") || topic.starts_with("http://") {
            return Ok(topic.to_owned());
        }
        let cached = self
            .urls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(topic)
            .cloned();
        if let Some(url) = cached {
            return Ok(url);
        }
        let out = self
            .client
            .get_queue_url()
            .queue_name(topic)
            .send()
            .await
            .map_err(|e| request_error(e, &format!("cannot find the URL of queue `{topic}`")))?;
        let url = out.queue_url.ok_or_else(|| {
            SinkError::unavailable(format!("SQS returned no URL for queue `{topic}`"))
        })?;
        self.urls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(topic.to_owned(), url.clone());
        Ok(url)
    }

    /// The entry of `m` for a queue (`fifo` or not), or why SQS would
    /// refuse it.
    fn entry(&self, i: usize, m: &OutboxMessage, fifo: bool) -> Result<Ready, SinkError> {
        let body = std::str::from_utf8(&m.payload).map_err(|_| {
            SinkError::refused(
                "the payload is not UTF-8 text, and an SQS message body is text: encode it \
                 (base64) before publishing",
            )
        })?;
        if let Some(c) = body.chars().find(|c| !sqs_allows(*c)) {
            return Err(SinkError::refused(format!(
                "the payload holds the character U+{:04X}, which SQS does not allow in a message \
                 body: encode it (base64) before publishing",
                u32::from(c)
            )));
        }
        if m.id.is_empty() || m.id.chars().any(|c| !sqs_allows(c)) {
            return Err(SinkError::refused(
                "the message id is empty or holds characters SQS does not allow in an attribute",
            ));
        }
        let string = |v: &str| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(v)
                .build()
                .map_err(|e| {
                    SinkError::refused("a message attribute cannot be built").with_source(e)
                })
        };
        let mut bytes = body.len() + ID_ATTRIBUTE.len() + "String".len() + m.id.len();
        let mut entry = SendMessageBatchRequestEntry::builder()
            .id(i.to_string())
            .message_body(body)
            .message_attributes(ID_ATTRIBUTE, string(&m.id)?);
        let keyed = !m.key.is_empty() && m.key.chars().all(sqs_allows);
        if keyed {
            bytes += KEY_ATTRIBUTE.len() + "String".len() + m.key.len();
            entry = entry.message_attributes(KEY_ATTRIBUTE, string(&m.key)?);
        }
        let headers = sendable_headers(m)?;
        // One for the id, one for the key when it is sent.
        let attributes = 1 + usize::from(keyed) + headers.len();
        if attributes > MAX_ATTRIBUTES {
            return Err(SinkError::refused(format!(
                "the message would carry {attributes} message attributes (its {} headers with \
                 the sink's id and key), over SQS's {MAX_ATTRIBUTES}",
                headers.len()
            )));
        }
        for (name, value) in headers {
            bytes += name.len() + "String".len() + value.len();
            entry = entry.message_attributes(name, string(value)?);
        }
        if bytes > self.max_message_bytes {
            return Err(SinkError::refused(format!(
                "the message is {bytes} bytes (body and attributes), over SQS's limit of {} \
                 bytes; make it smaller (or store the payload elsewhere and send a reference), or \
                 raise the queue's MaximumMessageSize and SqsSink::max_message_bytes",
                self.max_message_bytes
            )));
        }
        if fifo {
            let group = if m.key.is_empty() { &m.topic } else { &m.key };
            entry = entry
                .message_group_id(sqs_token(group))
                .message_deduplication_id(sqs_token(&m.id));
        }
        let entry = entry
            .build()
            .map_err(|e| SinkError::refused("the SQS entry cannot be built").with_source(e))?;
        Ok(Ready {
            index: i,
            entry,
            bytes,
        })
    }

    /// Sends `ready` (entries of one queue) in requests of at most 10
    /// entries and `max_message_bytes`, setting each message's result.
    async fn send_to(
        &self,
        url: &str,
        ready: Vec<Ready>,
        results: &mut [Option<Result<(), SinkError>>],
    ) {
        let mut requests: Vec<Vec<Ready>> = Vec::new();
        let mut size = 0;
        for r in ready {
            let full = requests.last().is_none_or(|last| {
                last.len() >= MAX_BATCH || size + r.bytes > self.max_message_bytes
            });
            if full {
                requests.push(Vec::with_capacity(MAX_BATCH));
                size = 0;
            }
            size += r.bytes;
            if let Some(last) = requests.last_mut() {
                last.push(r);
            }
        }
        let sent = requests.into_iter().map(|request| async move {
            let indices: Vec<usize> = request.iter().map(|r| r.index).collect();
            let entries: Vec<SendMessageBatchRequestEntry> =
                request.into_iter().map(|r| r.entry).collect();
            let out = self
                .client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await;
            let answers = match out {
                Ok(out) => {
                    let ids: Vec<String> = indices.iter().map(usize::to_string).collect();
                    let ok: Vec<&str> = out.successful.iter().map(|s| s.id.as_str()).collect();
                    results_of(&ids, &ok, &out.failed)
                }
                Err(e) => {
                    let failed = request_error(e, &format!("SendMessageBatch to {url} failed"));
                    tracing::warn!(sink = BROKER, queue = url, error = %failed, "a batch request failed");
                    for_all(indices.len(), !failed.is_retryable(), failed.reason(), &failed)
                }
            };
            (indices, answers)
        });
        for (indices, answers) in futures_util::future::join_all(sent).await {
            for (i, answer) in indices.into_iter().zip(answers) {
                if let Some(slot) = results.get_mut(i) {
                    *slot = Some(answer);
                }
            }
        }
    }
}

/// Each entry's result from a `SendMessageBatch` answer: `ids` are the
/// entries' ids in order, `successful` the ids SQS accepted, `failed` the
/// entries it did not. An entry in neither is `Unavailable`.
fn results_of(
    ids: &[String],
    successful: &[&str],
    failed: &[BatchResultErrorEntry],
) -> Vec<Result<(), SinkError>> {
    ids.iter()
        .map(|id| {
            if successful.contains(&id.as_str()) {
                return Ok(());
            }
            match failed.iter().find(|f| f.id == *id) {
                Some(f) => {
                    let why = format!(
                        "SQS did not take the message: {} ({})",
                        f.message.as_deref().unwrap_or("no message"),
                        f.code
                    );
                    if f.sender_fault {
                        Err(SinkError::refused(why))
                    } else {
                        Err(SinkError::unavailable(why))
                    }
                }
                None => Err(SinkError::unavailable(
                    "SQS's answer did not mention the message: it may or may not be stored; \
                     sending it again is safe (the consumer replays a copy)",
                )),
            }
        })
        .collect()
}

/// A failed request as the relay should see it: refused for codes that
/// sending again cannot fix, unavailable otherwise.
fn request_error<E, R>(e: SdkError<E, R>, what: &str) -> SinkError
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
    R: fmt::Debug + Send + Sync + 'static,
{
    let refused = e.code().is_some_and(|c| REFUSING_CODES.contains(&c));
    let reason = format!("{what}: {}", DisplayErrorContext(&e));
    let err = if refused {
        SinkError::refused(reason)
    } else {
        SinkError::unavailable(reason)
    };
    err.with_source(e)
}

/// The headers `m` is sent with, each name once (its last value, as
/// [`OutboxMessage::header`] reads it), those with an empty value left out
/// (SQS refuses an empty attribute value); or why SQS would refuse them.
fn sendable_headers(m: &OutboxMessage) -> Result<Vec<(&str, &str)>, SinkError> {
    own_name_refused(m, &[ID_ATTRIBUTE, KEY_ATTRIBUTE])?;
    let mut out: Vec<(&str, &str)> = Vec::with_capacity(m.headers.len());
    for (name, value) in m.headers.iter().rev() {
        if out.iter().any(|(n, _)| n == name) {
            continue;
        }
        if !attribute_name_ok(name) {
            return Err(SinkError::refused(format!(
                "the header name `{name}` is not a name SQS takes for a message attribute (1 to \
                 {MAX_ATTRIBUTE_NAME} letters, digits, `-`, `_` and `.`, no `..`, not starting \
                 or ending with `.`, not starting with `AWS.` or `Amazon.`)"
            )));
        }
        if let Some(c) = value.chars().find(|c| !sqs_allows(*c)) {
            return Err(SinkError::refused(format!(
                "the header `{name}` holds the character U+{:04X}, which SQS does not allow in a \
                 message attribute",
                u32::from(c)
            )));
        }
        // Keeps the name taken: an earlier, non-empty value of it must not be
        // sent in its place.
        out.push((name, value));
    }
    out.retain(|(_, v)| !v.is_empty());
    Ok(out)
}

/// Whether SQS takes `name` as a message attribute's name.
fn attribute_name_ok(name: &str) -> bool {
    let reserved = |prefix: &str| {
        name.get(..prefix.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(prefix))
    };
    !name.is_empty()
        && name.len() <= MAX_ATTRIBUTE_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && !reserved("AWS.")
        && !reserved("Amazon.")
}

/// Whether SQS allows `c` in a body or attribute value
/// (`#x9 | #xA | #xD | #x20-#xD7FF | #xE000-#xFFFD | #x10000-#x10FFFF`).
fn sqs_allows(c: char) -> bool {
    matches!(c, '\u{9}' | '\u{A}' | '\u{D}' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..='\u{10FFFF}')
}

/// `s` as a FIFO group or deduplication id: itself when SQS takes it (1 to
/// 128 ASCII letters, digits and punctuation), else `h-` and the hex
/// SHA-256 of it.
fn sqs_token(s: &str) -> String {
    let usable = !s.is_empty()
        && s.len() <= 128
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b.is_ascii_punctuation());
    if usable {
        s.to_owned()
    } else {
        format!("h-{}", hex::encode(Sha256::digest(s.as_bytes())))
    }
}

#[async_trait]
impl Sink for SqsSink {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        let mut results: Vec<Option<Result<(), SinkError>>> =
            (0..batch.len()).map(|_| None).collect();
        // Grouped by queue, in the batch's order.
        let mut queues: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, m) in batch.iter().enumerate() {
            let topic = self.queue_url.as_deref().unwrap_or(&m.topic);
            match queues.iter_mut().find(|(t, _)| t == topic) {
                Some((_, members)) => members.push(i),
                None => queues.push((topic.to_owned(), vec![i])),
            }
        }
        for (topic, members) in queues {
            let url = match self.url_of(&topic).await {
                Ok(url) => url,
                Err(e) => {
                    tracing::warn!(sink = BROKER, topic = %topic, error = %e, "no queue to send to");
                    let all = for_all(members.len(), !e.is_retryable(), e.reason(), &e);
                    for (i, r) in members.into_iter().zip(all) {
                        if let Some(slot) = results.get_mut(i) {
                            *slot = Some(r);
                        }
                    }
                    continue;
                }
            };
            let fifo = url.trim_end_matches('/').ends_with(".fifo");
            let mut ready = Vec::with_capacity(members.len());
            for i in members {
                let Some(m) = batch.get(i) else { continue };
                match self.entry(i, m, fifo) {
                    Ok(r) => ready.push(r),
                    Err(e) => {
                        if let Some(slot) = results.get_mut(i) {
                            *slot = Some(Err(e));
                        }
                    }
                }
            }
            self.send_to(&url, ready, &mut results).await;
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(SinkError::unavailable("the message was not sent"))))
            .collect()
    }

    fn describe(&self) -> String {
        match &self.queue_url {
            Some(url) => format!("{BROKER} queue {url}"),
            None => format!("{BROKER} (queue per topic)"),
        }
    }

    fn system(&self) -> &'static str {
        "aws_sqs"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed(id: &str, sender_fault: bool) -> BatchResultErrorEntry {
        BatchResultErrorEntry::builder()
            .id(id)
            .sender_fault(sender_fault)
            .code("Code")
            .message("why")
            .build()
            .unwrap()
    }

    /// A partial failure reports exactly the entries that failed: the
    /// sender's fault is parked, SQS's fault and a missing answer retried,
    /// the rest acknowledged.
    #[test]
    fn a_partial_batch_failure_names_exactly_the_messages_that_failed() {
        let ids: Vec<String> = (0..4).map(|i| i.to_string()).collect();
        let results = results_of(&ids, &["0", "2"], &[failed("1", true), failed("3", false)]);
        assert!(results[0].is_ok() && results[2].is_ok());
        assert!(matches!(&results[1], Err(e) if !e.is_retryable() && e.reason().contains("why")));
        assert!(matches!(&results[3], Err(e) if e.is_retryable()));
        let unanswered = results_of(&ids[..1], &[], &[]);
        assert!(matches!(&unanswered[0], Err(e) if e.is_retryable()));
    }

    fn with_headers(headers: &[(&str, &str)]) -> OutboxMessage {
        OutboxMessage::new("id-1", "orders", "o-1", "{}").with_headers(
            headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }

    /// Headers go as they are, each name once with its last value; an
    /// empty value (SQS refuses one) is left out, never an earlier value
    /// of the same name in its place.
    #[test]
    fn headers_are_sent_once_each_with_their_last_value_and_empty_ones_left_out() {
        let m = with_headers(&[
            ("traceparent", "00-a-b-01"),
            ("tracestate", "k=1"),
            ("traceparent", "00-c-d-01"),
            ("tracestate", ""),
        ]);
        assert_eq!(
            sendable_headers(&m).unwrap(),
            [("traceparent", "00-c-d-01")]
        );
    }

    /// What SQS would refuse, or what would overwrite the sink's own
    /// attributes, refuses the message before anything is sent.
    #[test]
    fn header_names_and_values_sqs_refuses_refuse_the_message() {
        for name in [
            "",
            ".x",
            "x.",
            "a..b",
            "aws.x",
            "Amazon.trace",
            "sp ace",
            "idem-id",
            KEY_ATTRIBUTE,
        ] {
            let m = with_headers(&[(name, "v")]);
            let r = sendable_headers(&m);
            assert!(
                matches!(r, Err(SinkError::Refused { .. })),
                "{name:?}: {r:?}"
            );
        }
        assert!(attribute_name_ok(&"x".repeat(256)) && !attribute_name_ok(&"x".repeat(257)));
        assert!(attribute_name_ok("x-b3.span_id") && attribute_name_ok("AWSTraceHeader"));
        let m = with_headers(&[("tracestate", "a\u{0}")]);
        let nul = sendable_headers(&m);
        assert!(matches!(nul, Err(SinkError::Refused { .. })), "{nul:?}");
    }

    /// The id, the key and 8 headers fill SQS's 10 attributes; a 9th
    /// header (with a key) refuses the message, naming the limit.
    #[test]
    fn a_message_with_more_attributes_than_sqs_allows_is_refused() {
        let sink = SqsSink {
            client: Client::from_conf(
                aws_sdk_sqs::Config::builder()
                    .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
                    .build(),
            ),
            queue_url: None,
            urls: Mutex::new(HashMap::new()),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
        };
        let names: Vec<String> = (0..9).map(|i| format!("h{i}")).collect();
        let headers: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
        assert!(sink.entry(0, &with_headers(&headers[..8]), false).is_ok());
        let over = sink.entry(0, &with_headers(&headers), false);
        assert!(
            matches!(&over, Err(SinkError::Refused { reason, .. }) if reason.contains("11 message attributes")),
            "{:?}",
            over.err()
        );
        let mut unkeyed = with_headers(&headers);
        unkeyed.key = String::new();
        assert!(sink.entry(0, &unkeyed, false).is_ok());
    }

    #[test]
    fn tokens_sqs_refuses_are_hashed_deterministically() {
        assert_eq!(sqs_token("o-1"), "o-1");
        let long = "x".repeat(200);
        assert_eq!(sqs_token(&long), sqs_token(&long));
        assert!(sqs_token(&long).starts_with("h-") && sqs_token(&long).len() == 66);
        assert!(sqs_token("a b").starts_with("h-"));
        assert!(sqs_allows('é') && !sqs_allows('\u{0}'));
    }
}
