//! The SQS phase: the adapter against the bare `ReceiveMessage` (10 at a
//! time, SQS's most) + `DeleteMessageBatch` loop, on the local AWS
//! endpoint (moto's server, `IDEM_AWS_ENDPOINT` or 127.0.0.1:4566). Each
//! loop consumes a fresh standard queue of [`MESSAGES`] messages, sent
//! before the clock starts. moto is a Python server: its own time per
//! request dominates every loop, so the ratio says what idem adds to the
//! requests a consumer makes anyway, not what SQS would do.

use super::floor::RedisFloor;
use super::{Timer, consumer, noop, payload};
use idem_consumer::Adapter;
use idem_consumer::sqs::aws_sdk_sqs::Client;
use idem_consumer::sqs::aws_sdk_sqs::types::{
    DeleteMessageBatchRequestEntry, QueueAttributeName, SendMessageBatchRequestEntry,
};
use idem_consumer::sqs::{SqsConfig, SqsConsumer};
use std::time::Duration;

/// Messages per loop: each SQS request is a round trip through moto's
/// Python, a few milliseconds.
pub(crate) const MESSAGES: usize = 1_000;

/// A fresh queue (and its dead-letter queue) holding [`MESSAGES`]
/// messages; returns both URLs.
async fn setup(client: &Client, run: usize, tag: &str) -> (String, String) {
    let name = idem_testkit::unique_name(&format!("bench-{tag}-{run}"));
    let dead = client
        .create_queue()
        .queue_name(format!("{name}-dead"))
        .send()
        .await
        .expect("create the dead-letter queue")
        .queue_url
        .expect("queue url");
    let arn = client
        .get_queue_attributes()
        .queue_url(&dead)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .expect("queue arn")
        .attributes
        .and_then(|mut a| a.remove(&QueueAttributeName::QueueArn))
        .expect("queue arn");
    let url = client
        .create_queue()
        .queue_name(&name)
        .attributes(
            QueueAttributeName::RedrivePolicy,
            format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"1000"}}"#),
        )
        .send()
        .await
        .expect("create the queue")
        .queue_url
        .expect("queue url");
    for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(10) {
        let entries = chunk
            .iter()
            .map(|&i| {
                SendMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .message_body(payload(run, i))
                    .build()
                    .expect("entry")
            })
            .collect();
        let out = client
            .send_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await
            .expect("send");
        assert!(
            out.failed.is_empty(),
            "moto refused messages: {:?}",
            out.failed
        );
    }
    (url, dead)
}

async fn cleanup(client: &Client, urls: (String, String)) {
    for url in [urls.0, urls.1] {
        let _ = client.delete_queue().queue_url(url).send().await;
    }
}

/// The bare loop: receive up to 10, delete them in one batch request
/// (with the floor's two Redis writes per message between, when given).
pub(crate) async fn bare(client: &Client, run: usize, floor: Option<&RedisFloor>) -> f64 {
    let urls = setup(client, run, if floor.is_some() { "floor" } else { "bare" }).await;
    let url = urls.0.clone();
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        let got = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .send()
            .await
            .expect("receive")
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            continue;
        }
        if let Some(floor) = floor {
            let keys: Vec<&str> = got.iter().filter_map(|m| m.message_id.as_deref()).collect();
            floor.dedup(&keys).await;
        }
        let entries = got
            .iter()
            .enumerate()
            .map(|(i, m)| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle.clone().expect("receipt handle"))
                    .build()
                    .expect("entry")
            })
            .collect();
        let out = client
            .delete_message_batch()
            .queue_url(&url)
            .set_entries(Some(entries))
            .send()
            .await
            .expect("delete");
        assert!(out.failed.is_empty(), "{:?}", out.failed);
        done += got.len();
    }
    let rate = start.rate_of(MESSAGES);
    cleanup(client, urls).await;
    rate
}

/// Each message through [`SqsConsumer::poll`] and idem (keys: SQS's
/// message ids).
pub(crate) async fn idem(client: &Client, redis_url: &str, run: usize) -> f64 {
    let urls = setup(client, run, "idem").await;
    let consumer = consumer(redis_url, run).await;
    let sqs = SqsConsumer::new(
        client.clone(),
        SqsConfig::new(&urls.0)
            .wait(Duration::from_secs(1))
            .visibility_timeout(Duration::from_secs(30)),
    )
    .await
    .expect("sqs consumer");
    let start = Timer::start();
    let mut done = 0;
    while done < MESSAGES {
        done += sqs.poll(&consumer, &noop).await.expect("poll").acked;
    }
    let rate = start.rate_of(MESSAGES);
    cleanup(client, urls).await;
    rate
}
