//! The outbox's `headers` column: what a message carries besides its
//! payload (the W3C trace context, feature `otel`) is stored with it in the
//! caller's transaction and published by the relay unchanged; a message
//! without headers stores NULL; a table made before the column existed is
//! upgraded by `migrate` and its rows still relay. The sink records what
//! it was sent, outside the store.

use crate::support::{DbStore, TestDb};
use async_trait::async_trait;
use idem_core::outbox::{OutboxMessage, Sink, SinkError};
use idem_core::{Error, Idempotency};
use idem_postgres::outbox::{self, PgRelay};
use idem_postgres::{PgStore, RunInTx};
use std::sync::{Arc, Mutex};

/// Records every message it confirms, whole (headers included).
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<OutboxMessage>>,
}

#[async_trait]
impl Sink for Recorder {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        self.sent.lock().unwrap().extend(batch.iter().cloned());
        batch.iter().map(|_| Ok(())).collect()
    }

    fn describe(&self) -> String {
        "recorder".into()
    }
}

/// Relays until a pass sends nothing; what the sink was sent, in order.
async fn relay_all(store: &PgStore) -> Vec<OutboxMessage> {
    let sink = Arc::new(Recorder::default());
    let relay = PgRelay::new(store, Arc::clone(&sink));
    for _ in 0..100 {
        if relay.drain_once().await.unwrap().sent == 0 {
            break;
        }
    }
    sink.sent.lock().unwrap().clone()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect()
}

async fn headers_column(db: &TestDb) -> Vec<Option<String>> {
    sqlx::query_scalar("SELECT headers::text FROM idem_keys_outbox ORDER BY seq")
        .fetch_all(&db.pool)
        .await
        .unwrap()
}

/// A message published without a trace to carry (no OpenTelemetry layer,
/// or no `otel` feature) stores NULL headers and is sent without headers.
#[tokio::test]
async fn a_message_without_headers_stores_null_and_is_sent_without() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let idem = Idempotency::builder(store.clone()).namespace("h").build();
    idem.call("orders.create", "r1")
        .run_in_tx(&db.pool, async |tx| {
            outbox::publish(tx, "orders.created", "o-1", &"created").await?;
            Ok::<_, Error>(())
        })
        .await
        .unwrap();
    assert_eq!(headers_column(&db).await, vec![None]);
    let sent = relay_all(&store).await;
    assert_eq!(sent.len(), 1);
    assert!(sent[0].headers.is_empty(), "{:?}", sent[0].headers);
}

/// The relay publishes a row's headers exactly as they were stored: in
/// their order, a repeated name kept, characters JSON escapes intact. A
/// `headers` value that is not an object of strings (written by hand)
/// sends its message without headers instead of holding it back.
#[tokio::test]
async fn stored_headers_are_sent_unchanged_and_an_unreadable_value_sends_none() {
    let db = TestDb::new().await;
    let store = db.store().await;
    let ob = store.outbox();
    for (key, id) in [("k1", "m1"), ("k2", "m2"), ("k3", "m3")] {
        let mut tx = db.pool.begin().await.unwrap();
        ob.publish_with_id(&mut tx, "t", key, id, &id)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let written = r#"{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01","tracestate":"b=2,a=1","x":"first","x":"\"quoted\"\n\u0000é"}"#;
    sqlx::query("UPDATE idem_keys_outbox SET headers = $1::json WHERE id = 'm1'")
        .bind(written)
        .execute(&db.pool)
        .await
        .unwrap();
    db.exec(r#"UPDATE idem_keys_outbox SET headers = '[["traceparent","x"]]' WHERE id = 'm2'"#)
        .await;
    db.exec("UPDATE idem_keys_outbox SET headers = 'null' WHERE id = 'm3'")
        .await;
    // `json` keeps the text as written (jsonb would reorder and dedupe).
    assert_eq!(headers_column(&db).await[0].as_deref(), Some(written));

    let sent = relay_all(&store).await;
    let by_id = |id: &str| sent.iter().find(|m| m.id == id).unwrap().clone();
    assert_eq!(
        by_id("m1").headers,
        pairs(&[
            (
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            ),
            ("tracestate", "b=2,a=1"),
            ("x", "first"),
            ("x", "\"quoted\"\n\u{0}é"),
        ])
    );
    assert_eq!(by_id("m1").header("x"), Some("\"quoted\"\n\u{0}é"));
    assert!(by_id("m2").headers.is_empty());
    assert!(by_id("m3").headers.is_empty());
    assert_eq!(sent.len(), 3);
}

/// The outbox table as the schema before headers created it.
const OUTBOX_BEFORE_HEADERS: &str = "CREATE TABLE idem_keys_outbox (
    seq        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id         text        COLLATE \"C\" NOT NULL,
    topic      text        NOT NULL,
    msg_key    text        COLLATE \"C\" NOT NULL,
    payload    bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    attempts   integer     NOT NULL DEFAULT 0,
    last_error text,
    retry_at   timestamptz,
    parked_at  timestamptz
)";

/// A table made before the `headers` column gains it at `migrate`; the
/// rows written before (by the old insert, which names no `headers`) relay
/// as messages without headers, in order, and a process still running the
/// old insert keeps working against the upgraded table.
#[tokio::test]
async fn a_table_from_before_headers_is_upgraded_and_its_rows_still_relay() {
    let db = TestDb::new().await;
    db.exec(OUTBOX_BEFORE_HEADERS).await;
    let old_insert = "INSERT INTO idem_keys_outbox (id, topic, msg_key, payload) \
                      VALUES ($1, 't', 'k', $2) ON CONFLICT DO NOTHING";
    sqlx::query(old_insert)
        .bind("old-1")
        .bind(&b"\"one\""[..])
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(
        db.count(
            "SELECT count(*) FROM information_schema.columns \
             WHERE table_name = 'idem_keys_outbox' AND column_name = 'headers'"
        )
        .await,
        0
    );

    let store = db.store().await;
    assert_eq!(
        db.count(
            "SELECT count(*) FROM information_schema.columns \
             WHERE table_name = 'idem_keys_outbox' AND column_name = 'headers'"
        )
        .await,
        1
    );
    // An old process's insert, after the upgrade.
    sqlx::query(old_insert)
        .bind("old-2")
        .bind(&b"\"two\""[..])
        .execute(&db.pool)
        .await
        .unwrap();
    let sent = relay_all(&store).await;
    let got: Vec<(&str, &[u8], usize)> = sent
        .iter()
        .map(|m| (m.id.as_str(), m.payload.as_ref(), m.headers.len()))
        .collect();
    assert_eq!(
        got,
        vec![("old-1", &b"\"one\""[..], 0), ("old-2", &b"\"two\""[..], 0)]
    );
    assert_eq!(db.count("SELECT count(*) FROM idem_keys_outbox").await, 0);
}

/// With the `otel` feature and an OpenTelemetry layer, `publish` inside
/// `run_in_tx` opens the message's `create` span in the call's trace and
/// stores its W3C context with the row; the relay hands the sink exactly
/// those headers. The span is the message's own, not the request's.
#[cfg(feature = "otel")]
#[tokio::test]
async fn publish_stores_the_create_spans_context_and_the_relay_sends_it() {
    use opentelemetry::trace::{TraceContextExt, TracerProvider};
    use tracing::Instrument;
    use tracing::instrument::WithSubscriber;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    use tracing_subscriber::layer::SubscriberExt;

    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-postgres-test")));
    let dispatch = tracing::Dispatch::new(subscriber);

    let db = TestDb::new().await;
    let store = db.store().await;
    let idem = Idempotency::builder(store.clone()).namespace("h").build();
    let request = tracing::dispatcher::with_default(&dispatch, || tracing::info_span!("request"));
    let sc = request.context().span().span_context().clone();
    let (trace_id, request_span) = (sc.trace_id(), sc.span_id());
    assert!(sc.is_valid());
    let call = idem
        .call("orders.create", "r1")
        .run_in_tx(&db.pool, async |tx| {
            outbox::publish(tx, "orders.created", "o-1", &"created").await?;
            Ok::<_, Error>(())
        })
        .instrument(request.clone());
    call.with_subscriber(dispatch.clone()).await.unwrap();

    let stored = headers_column(&db).await;
    let json = stored[0].clone().expect("a traced publish stores headers");
    let sent = relay_all(&store).await;
    assert_eq!(sent.len(), 1);
    let traceparent = sent[0].header("traceparent").expect("traceparent sent");
    // The sink gets what was stored, as stored.
    assert_eq!(
        json,
        format!(r#"{{"traceparent":"{traceparent}"}}"#),
        "{:?}",
        sent[0].headers
    );
    let carried = idem_core::otel::remote_context(|n| sent[0].header(n)).unwrap();
    assert_eq!(carried.trace_id(), trace_id);
    assert_ne!(carried.span_id(), request_span);
    drop(provider);
}
