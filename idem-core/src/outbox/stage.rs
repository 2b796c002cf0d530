//! Outgoing messages from a body whose store writes them with the result
//! ([`stage`]), and the checks every outbox applies to a message.

use super::message::MAX_OUTBOX_FIELD;
use crate::error::Error;
use crate::lease::Staged;
use serde::Serialize;

/// Stages an outgoing message that the store writes **in the same atomic
/// step as the call's result**: both are stored, or neither. A relay
/// (idem-redis's `RedisRelay` for a `RedisStore`) publishes it
/// afterwards, at least once, under an id derived from the call, which an
/// idem consumer on the other side de-duplicates.
///
/// Call it from the body of `run` (or `run_outcome`, `run_steps`, a
/// `#[idempotent]` function). A body that returns `Err` drops what it
/// staged; a body run again (after a crash, or a failed run) stages again
/// and gets the same ids, since the id is made from the call's record key
/// and the message's name (the topic; `topic#1`, `topic#2`… for further
/// messages to one topic in one body). In a `run_steps` body, stage outside
/// the steps: a step that is replayed does not run its code again.
///
/// - `topic`: where the relay's sink publishes it (a stream, subject, topic
///   or routing key);
/// - `key`: its ordering key (one key's messages go out one at a time, in
///   the order they were stored: an order id, an account);
/// - `value`: serialized to JSON here.
///
/// Fails, so that the body fails and nothing is stored, with
/// [`Error::Codec`] for a value that cannot be serialized, with
/// [`Error::InvalidConfig`] for an empty, oversized or control-character
/// topic or key, outside an idem body, or when the call's store has no
/// outbox of this kind (`MemoryStore`; a `PgStore` writes messages in the
/// body's transaction instead: idem-postgres's `outbox::publish` in
/// `run_in_tx`).
///
/// ```no_run
/// use idem_core::{Error, Idempotency, outbox};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Order { id: String, amount: u64 }
///
/// // `idem` is built on a store with an outbox, such as idem-redis's
/// // `RedisStore`: `Idempotency::builder(RedisStore::connect(url).await?)`.
/// # async fn demo(idem: Idempotency) -> Result<(), Error> {
/// let order: Order = idem
///     .call("orders.create", "req-42")
///     .run(|| async {
///         let order = Order { id: "o-42".into(), amount: 500 }; // … the effect …
///         outbox::stage("orders.created", &order.id, &order)?; // stored with the result
///         Ok::<_, Error>(order)
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub fn stage<V: Serialize + ?Sized>(topic: &str, key: &str, value: &V) -> Result<(), Error> {
    let Some(lease) = crate::lease::lease() else {
        return Err(Error::InvalidConfig(
            "outbox::stage runs inside an idem body (`run`, `run_steps`, an #[idempotent] \
             function), whose call it derives the message id from; this is outside one (or a \
             body run unprotected: FailMode::Open with the store down)"
                .to_owned(),
        ));
    };
    check_field("topic", topic)?;
    check_field("key", key)?;
    let payload = encode_payload(topic, key, value)?;
    let staged = Staged {
        topic: topic.to_owned(),
        key: key.to_owned(),
        payload: payload.into(),
    };
    if lease.stage(staged) {
        Ok(())
    } else {
        Err(Error::InvalidConfig(
            "the call's store has no outbox that writes messages with the result: use a \
             RedisStore, or with a PgStore publish in the body's transaction \
             (idem_postgres::outbox::publish inside run_in_tx)"
                .to_owned(),
        ))
    }
}

/// Checks a topic, key or id: every broker takes it as a name or header,
/// so it is printable text of 1 to [`MAX_OUTBOX_FIELD`] bytes. `what` names
/// it in the error.
///
/// ```
/// use idem_core::outbox::check_field;
/// assert!(check_field("topic", "orders.created").is_ok());
/// assert!(check_field("key", "").is_err());
/// assert!(check_field("key", "a\nb").is_err());
/// ```
pub fn check_field(what: &str, value: &str) -> Result<(), Error> {
    let problem = if value.is_empty() {
        "is empty".to_owned()
    } else if value.len() > MAX_OUTBOX_FIELD {
        format!(
            "is {} bytes, over the {MAX_OUTBOX_FIELD}-byte limit",
            value.len()
        )
    } else if value.chars().any(char::is_control) {
        "contains a control character".to_owned()
    } else {
        return Ok(());
    };
    Err(Error::InvalidConfig(format!(
        "the outbox message's {what} {problem}; brokers take it as a name or header, so use \
         printable text such as `orders.created` or an order id"
    )))
}

/// A message's payload: `value` as JSON, or [`Error::Codec`] saying which
/// message could not be serialized (the body then fails: nothing of it is
/// stored).
///
/// ```
/// let bytes = idem_core::outbox::encode_payload("orders.created", "o-1", &[1, 2]).unwrap();
/// assert_eq!(bytes, b"[1,2]");
/// ```
pub fn encode_payload<V: Serialize + ?Sized>(
    topic: &str,
    key: &str,
    value: &V,
) -> Result<Vec<u8>, Error> {
    serde_json::to_vec(value).map_err(|e| {
        Error::codec(format!(
            "the outbox message to {topic:?} (key {key:?}) cannot be serialized to JSON: {e}; \
             nothing of this body is stored"
        ))
        .with_source(e)
    })
}
