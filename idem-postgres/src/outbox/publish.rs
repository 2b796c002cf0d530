//! Writing outgoing messages in the caller's transaction: [`publish`]
//! inside `run_in_tx` (the id derived from the call), and
//! `Outbox::publish_with_id` anywhere else.

use super::table::OutboxSql;
use crate::errors;
use idem_core::Error;
use idem_core::outbox::{check_field, encode_payload, message_id};
use serde::Serialize;
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnection;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

tokio::task_local! {
    /// The `run_in_tx` body this task is running, for `publish`.
    static CONTEXT: Arc<Publishing>;
}

/// What `publish` needs from the `run_in_tx` call around it.
pub(crate) struct Publishing {
    /// The call's record key, as the store saw it in the claim.
    record_key: String,
    sql: Arc<OutboxSql>,
    /// Messages published so far per topic, for their names (`topic`,
    /// `topic#1`…): a re-run of the body publishes the same names, so the
    /// same ids.
    per_topic: Mutex<HashMap<String, u32>>,
}

impl Publishing {
    pub(crate) fn new(record_key: String, sql: Arc<OutboxSql>) -> Publishing {
        Publishing {
            record_key,
            sql,
            per_topic: Mutex::default(),
        }
    }

    /// The same call's context with its message count at zero.
    pub(crate) fn again(&self) -> Publishing {
        Publishing::new(self.record_key.clone(), Arc::clone(&self.sql))
    }

    fn next_name(&self, topic: &str) -> String {
        let mut seen = self.per_topic.lock().unwrap_or_else(|p| p.into_inner());
        let n = seen.entry(topic.to_owned()).or_insert(0);
        let name = match *n {
            0 => topic.to_owned(),
            k => format!("{topic}#{k}"),
        };
        *n += 1;
        name
    }
}

/// Runs `body` with `publishing` visible to [`publish`].
pub(crate) async fn scope<F: Future>(publishing: Arc<Publishing>, body: F) -> F::Output {
    CONTEXT.scope(publishing, body).await
}

/// Writes an outgoing message in the transaction of the `run_in_tx` body
/// that calls it: it commits with the call's stored result, or not at all,
/// and a relay ([`PgRelay`](super::PgRelay)) publishes it later.
///
/// - `topic`: where the message goes (a stream, subject, topic or routing
///   key, as the relay's sink reads it);
/// - `key`: its ordering key: one key's messages are published in order,
///   one at a time (an order id, an account);
/// - `value`: serialized to JSON. A value that cannot be serialized fails
///   here with [`Error::Codec`], so the body fails and nothing commits.
///
/// The message id is derived from the call (its record key) and the
/// message's name (the topic; `topic#1`, `topic#2`… for further messages to
/// the same topic in one body): a relay re-sending it, or a re-run of a body
/// whose first run rolled back, publishes the same id, which the consumer
/// on the other side de-duplicates. Publishing the same id twice keeps one
/// message.
///
/// With the `otel` feature, the message carries its call's trace: a
/// `create` span (the messaging conventions', a child of the call's span)
/// is opened for it and its W3C context stored in the row's `headers`;
/// the relay publishes them as the broker's headers, and its `send` span
/// and the consumer's `process` span link to it. Without a
/// `tracing-opentelemetry` layer nothing is stored.
///
/// Outside a `run_in_tx` body there is no call to derive the id from: it
/// fails with [`Error::InvalidConfig`]; use
/// [`Outbox::publish_with_id`](super::Outbox::publish_with_id) there.
///
/// ```no_run
/// use idem_core::Idempotency;
/// use idem_postgres::{PgStore, RunInTx, outbox};
///
/// #[derive(Debug, thiserror::Error)]
/// enum AppError {
///     #[error(transparent)]
///     Idem(#[from] idem_core::Error),
///     #[error("database: {0}")]
///     Db(#[from] sqlx::Error),
/// }
///
/// #[derive(serde::Serialize)]
/// struct OrderCreated { order: i64, amount: i64 }
///
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), AppError> {
/// let idem = Idempotency::builder(PgStore::from_pool(pool.clone())).namespace("shop").build();
/// let order: i64 = idem
///     .call("orders.create", "req-42")
///     .run_in_tx(&pool, async |tx| {
///         let (id,): (i64,) = sqlx::query_as("INSERT INTO orders (amount) VALUES (500) RETURNING id")
///             .fetch_one(&mut *tx)
///             .await?;
///         outbox::publish(tx, "orders.created", &id.to_string(), &OrderCreated { order: id, amount: 500 })
///             .await?;
///         Ok::<_, AppError>(id)
///     })
///     .await?;
/// # Ok(()) }
/// ```
pub async fn publish<V: Serialize + ?Sized>(
    tx: &mut PgConnection,
    topic: &str,
    key: &str,
    value: &V,
) -> Result<(), Error> {
    let Ok(publishing) = CONTEXT.try_with(Arc::clone) else {
        return Err(Error::InvalidConfig(
            "outbox::publish runs inside a `run_in_tx` body, whose call it derives the message \
             id from; this call is outside one (or runs unprotected: FailMode::Open with the \
             store down). Use `Outbox::publish_with_id` with an id of your own there"
                .to_owned(),
        ));
    };
    check_field("topic", topic)?;
    check_field("key", key)?;
    let id = message_id(&publishing.record_key, &publishing.next_name(topic));
    insert(tx, &publishing.sql, &id, topic, key, value).await
}

/// Checks, encodes and inserts one message. With the `otel` feature, it
/// first opens the message's `create` span (a child of the current span:
/// in `run_in_tx`, the call's) and stores its W3C trace context in the
/// row's `headers`, for the relay to publish with the message. Without
/// it, or with no span to carry (no `tracing-opentelemetry` layer), the
/// insert is the one without headers, as before they existed.
pub(crate) async fn insert<V: Serialize + ?Sized>(
    tx: &mut PgConnection,
    sql: &OutboxSql,
    id: &str,
    topic: &str,
    key: &str,
    value: &V,
) -> Result<(), Error> {
    let payload = encode_payload(topic, key, value)?;
    #[cfg(feature = "otel")]
    let headers = super::headers::encode(&idem_core::otel::create_span_headers(topic, id));
    #[cfg(not(feature = "otel"))]
    let headers: Option<String> = None;
    let query = match &headers {
        None => sqlx::query(AssertSqlSafe(sql.insert.as_str())),
        Some(_) => sqlx::query(AssertSqlSafe(sql.insert_with_headers.as_str())),
    };
    let mut query = query.bind(id).bind(topic).bind(key).bind(payload);
    if let Some(h) = headers {
        query = query.bind(h);
    }
    query
        .execute(tx)
        .await
        .map_err(|e| errors::map("outbox publish", &sql.table, e))?;
    Ok(())
}
