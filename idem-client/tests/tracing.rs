//! Every attempt emits one `tracing` event with method, path, attempt,
//! status or error, and the chosen delay.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod support;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_client::{Client, Response, RetryPolicy};
use serde_json::json;
use support::{Reply, Server};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

type Events = Arc<Mutex<Vec<BTreeMap<String, String>>>>;

struct Capture(Events);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if !event.metadata().target().starts_with("idem_client") {
            return;
        }
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        self.0.lock().unwrap().push(fields);
    }
}

#[derive(serde::Deserialize)]
struct Receipt {
    #[allow(dead_code)]
    id: String,
}

#[tokio::test]
async fn one_event_per_attempt_with_delay() {
    let events: Events = Arc::default();
    let subscriber = tracing_subscriber::registry().with(Capture(events.clone()));
    let _guard = tracing::subscriber::set_default(subscriber);

    let server = Server::start(vec![
        Reply::status(503),
        Reply::status(503),
        Reply::json(201, r#"{"id":"r_1"}"#),
    ])
    .await;
    let client = Client::builder(server.url())
        .retry(
            RetryPolicy::default()
                .max_retries(3)
                .initial_backoff(Duration::from_millis(20)),
        )
        .build()
        .unwrap();
    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_eq!(r.attempts, 3);

    let events = events.lock().unwrap().clone();
    assert_eq!(events.len(), 3, "{events:#?}");
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["method"], "POST");
        assert_eq!(e["path"], "/payments");
        assert_eq!(e["key"], r.key);
        assert_eq!(e["attempt"], (i + 1).to_string());
    }
    for e in &events[..2] {
        assert_eq!(e["status"], "503");
        assert!(e.contains_key("error"));
        let delay: u64 = e["delay_ms"].parse().unwrap();
        assert!(delay >= 10, "{e:?}");
    }
    assert_eq!(events[2]["status"], "201");
}
