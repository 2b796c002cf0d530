//! The consumer's side of one trace across the outbox (feature `otel`):
//! the conventions' names for each broker, and the trace headers an
//! adapter copies from a delivery onto its [`Message`].

use crate::message::Message;
use idem_core::outbox::TRACE_HEADERS;

/// `messaging.system` of an adapter, as the OpenTelemetry messaging
/// conventions name it (`nats` and `redis` are custom: they name none).
pub(crate) fn system(broker: &str) -> &'static str {
    match broker {
        "kafka" => "kafka",
        "rabbitmq" => "rabbitmq",
        "sqs" => "aws_sqs",
        "nats" => "nats",
        "redis-streams" => "redis",
        _ => "custom",
    }
}

/// `msg` with the trace headers `get` finds on its delivery (by exact
/// name; `get` returns the last value of a repeated header).
#[cfg_attr(
    not(any(
        feature = "nats",
        feature = "redis-streams",
        feature = "kafka",
        feature = "rabbitmq",
        feature = "sqs"
    )),
    allow(dead_code, reason = "only the adapters use it")
)]
pub(crate) fn with_trace_headers(
    mut msg: Message,
    get: impl Fn(&str) -> Option<String>,
) -> Message {
    for name in TRACE_HEADERS {
        if let Some(value) = get(name) {
            msg = msg.with_trace_header(name, value);
        }
    }
    msg
}
