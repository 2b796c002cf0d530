//! SQS adapter and sink against the local AWS endpoint (moto's server, as
//! `cargo xtask setup` starts it at 127.0.0.1:4566, or
//! `IDEM_AWS_ENDPOINT`), with unique queues per test (a queue and its
//! dead-letter queue, named by its redrive policy), deleted after. The
//! shared scenarios are in `support`; ground truth is an external ledger of
//! side effects.
//!
//! Around moto's limits, never into them: moto forgets a FIFO
//! deduplication id once its message is deleted (real SQS keeps it for 5
//! minutes whatever happens to the message), so a test that relies on SQS
//! dropping a re-send sends both copies before anything is consumed; moto
//! keeps its queues in memory, so "the broker restarts" is the endpoint
//! going away and coming back (a proxy refusing and cutting connections),
//! which is what a client of the managed SQS sees. moto's own SQS backend
//! is not safe under concurrent requests (two `ReceiveMessage` calls in
//! flight at once on one FIFO queue could both take messages of one group,
//! which real SQS never does); the server `cargo xtask setup` starts
//! (`xtask/aws/moto_server.py`) runs SQS requests one at a time, so FIFO
//! tests may have several consumers receiving at once.

use crate::support;

use idem_consumer::outbox::{OutboxMessage, Sink, SinkError, SqsSink};
use idem_consumer::sqs::aws_sdk_sqs::Client;
use idem_consumer::sqs::aws_sdk_sqs::types::{
    MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use idem_consumer::sqs::{ID_ATTRIBUTE, SqsConfig, SqsConsumer};
use idem_consumer::{
    Adapter, Consumer, ErrorClass, KeySource, Message, PollReport, dead_letter_field,
};
use idem_core::outbox::message_id;
use idem_testkit::{FaultProxy, Ledger, RedisServer, aws_config, sqs_client, unique_name};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use support::{DeadLetter, Place, idem_on, until};

// ------------------------------------------------------------------ the place

/// A client whose requests go to `endpoint` (a proxy in front of the local
/// endpoint).
async fn client_at(endpoint: &str) -> Client {
    let sdk = aws_config().await;
    let conf = idem_consumer::sqs::aws_sdk_sqs::config::Builder::from(&sdk)
        .endpoint_url(endpoint)
        .build();
    Client::from_conf(conf)
}

async fn create_queue(
    client: &Client,
    name: &str,
    attrs: Vec<(QueueAttributeName, String)>,
) -> String {
    let mut req = client.create_queue().queue_name(name);
    for (k, v) in attrs {
        req = req.attributes(k, v);
    }
    req.send()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot create queue {name}: {}",
                idem_consumer::sqs::aws_sdk_sqs::error::DisplayErrorContext(&e)
            )
        })
        .queue_url
        .unwrap()
}

async fn queue_arn(client: &Client, url: &str) -> String {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap();
    out.attributes.unwrap()[&QueueAttributeName::QueueArn].clone()
}

/// Messages in `url`: visible, in flight, delayed.
async fn counts_in(client: &Client, url: &str) -> (u64, u64, u64) {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap();
    let a = out.attributes.unwrap_or_default();
    let n = |k: QueueAttributeName| a.get(&k).and_then(|v| v.parse().ok()).unwrap_or(0);
    (
        n(QueueAttributeName::ApproximateNumberOfMessages),
        n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        n(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
    )
}

fn text(v: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(v)
        .build()
        .unwrap()
}

/// A queue (standard or FIFO) whose redrive policy names its dead-letter
/// queue (`maxReceiveCount` 1000: idem decides, SQS's redrive never does
/// here); both deleted on drop by the process that created them.
struct TestQueue {
    client: Client,
    url: String,
    dead_url: String,
    fifo: bool,
    /// Adapters go through this endpoint when set (the restart test).
    adapter_endpoint: Option<String>,
    /// FIFO: messages are spread over this many groups.
    groups: usize,
    /// The shortest visibility timeout its adapters get (see
    /// [`TestQueue::min_visibility`]).
    min_visibility: Duration,
    sent: AtomicUsize,
    owned: bool,
}

impl TestQueue {
    async fn create(prefix: &str) -> TestQueue {
        TestQueue::create_kind(prefix, false).await
    }

    async fn create_fifo(prefix: &str) -> TestQueue {
        TestQueue::create_kind(prefix, true).await
    }

    async fn create_kind(prefix: &str, fifo: bool) -> TestQueue {
        let client = sqs_client().await;
        let name = unique_name(prefix);
        let suffix = if fifo { ".fifo" } else { "" };
        let fifo_attrs = || {
            if fifo {
                vec![(QueueAttributeName::FifoQueue, "true".to_owned())]
            } else {
                Vec::new()
            }
        };
        let dead_url = create_queue(&client, &format!("{name}-dead{suffix}"), fifo_attrs()).await;
        let policy = format!(
            r#"{{"deadLetterTargetArn":"{}","maxReceiveCount":"1000"}}"#,
            queue_arn(&client, &dead_url).await
        );
        let mut attrs = fifo_attrs();
        attrs.push((QueueAttributeName::RedrivePolicy, policy));
        let url = create_queue(&client, &format!("{name}{suffix}"), attrs).await;
        TestQueue {
            client,
            url,
            dead_url,
            fifo,
            adapter_endpoint: None,
            groups: 4,
            min_visibility: Duration::from_secs(1),
            sent: AtomicUsize::new(0),
            owned: true,
        }
    }

    /// Adapters get a visibility timeout of at least `d`. For scenarios
    /// where no consumer dies: a visibility timeout of 2 s on a loaded
    /// machine (moto answering a receive or an extension late) can run out
    /// before the first extension lands, and SQS then hands the live
    /// message to another consumer. That is SQS's at-least-once right
    /// (idem replays it), but those scenarios count acks as well as
    /// effects. In production the timeout is tens of seconds.
    fn min_visibility(mut self, d: Duration) -> TestQueue {
        self.min_visibility = d;
        self
    }

    fn config(&self, redeliver_after: Duration) -> SqsConfig {
        SqsConfig::new(&self.url)
            .wait(Duration::from_secs(1))
            .visibility_timeout(redeliver_after.max(self.min_visibility))
    }

    async fn adapter_with(&self, cfg: SqsConfig) -> SqsConsumer {
        let client = match &self.adapter_endpoint {
            Some(endpoint) => client_at(endpoint).await,
            None => self.client.clone(),
        };
        SqsConsumer::new(client, cfg).await.unwrap()
    }

    /// Sends `payload` with these message attributes (FIFO: into `group`,
    /// with a deduplication id of its own, so every send is a message).
    async fn send(
        &self,
        group: Option<&str>,
        attrs: Vec<(&str, MessageAttributeValue)>,
        payload: &[u8],
    ) {
        let n = self.sent.fetch_add(1, Ordering::SeqCst);
        let mut req = self
            .client
            .send_message()
            .queue_url(&self.url)
            .message_body(String::from_utf8_lossy(payload));
        for (k, v) in attrs {
            req = req.message_attributes(k, v);
        }
        if self.fifo {
            let group = group.map_or_else(|| format!("g{}", n % self.groups), str::to_owned);
            req = req
                .message_group_id(group)
                .message_deduplication_id(format!("d-{n}"));
        }
        req.send().await.unwrap();
    }

    /// Takes every message off a queue (visible now).
    async fn take_all(&self, url: &str) -> Vec<idem_consumer::sqs::aws_sdk_sqs::types::Message> {
        let mut out = Vec::new();
        loop {
            let got = self
                .client
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .unwrap()
                .messages
                .unwrap_or_default();
            if got.is_empty() {
                return out;
            }
            for m in got {
                self.client
                    .delete_message()
                    .queue_url(url)
                    .receipt_handle(m.receipt_handle.clone().unwrap())
                    .send()
                    .await
                    .unwrap();
                out.push(m);
            }
        }
    }
}

fn attribute(m: &idem_consumer::sqs::aws_sdk_sqs::types::Message, name: &str) -> Option<String> {
    m.message_attributes
        .as_ref()?
        .get(name)?
        .string_value
        .clone()
}

fn dead_letter_of(m: &idem_consumer::sqs::aws_sdk_sqs::types::Message) -> DeadLetter {
    DeadLetter {
        id: attribute(m, ID_ATTRIBUTE),
        kind: attribute(m, dead_letter_field::KIND),
        reason: attribute(m, dead_letter_field::REASON),
        deliveries: attribute(m, dead_letter_field::DELIVERIES).map(|n| n.parse().unwrap()),
        payload: m.body.clone().unwrap_or_default().into_bytes(),
    }
}

impl Place for TestQueue {
    type Adapter = SqsConsumer;
    const WORKER_ENV: &'static str = "IDEM_SQS";
    const WORKER_TEST: &'static str = "sqs::worker";
    /// A standard queue has no position (a FIFO queue's is its sequence).
    const POSITIONED: bool = false;
    /// A standard queue may deliver a message twice, to two consumers (and
    /// moto's receives, unlocked, may too): every order still runs once.
    const COPIES: bool = true;

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        let attrs = id
            .map(|id| vec![(ID_ATTRIBUTE, text(id))])
            .unwrap_or_default();
        self.send(None, attrs, payload).await;
    }

    /// Visibility timeout `redeliver_after` (at least SQS's 1 s): a
    /// consumer that dies leaves its messages invisible that long.
    async fn adapter(&self, _: &str, redeliver_after: Duration) -> SqsConsumer {
        self.adapter_with(self.config(redeliver_after)).await
    }

    async fn drained(&self) -> bool {
        counts_in(&self.client, &self.url).await == (0, 0, 0)
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.take_all(&self.dead_url)
            .await
            .iter()
            .map(dead_letter_of)
            .collect()
    }

    fn to_env(&self) -> Vec<(String, String)> {
        vec![
            ("IDEM_SQS_URL".into(), self.url.clone()),
            ("IDEM_SQS_DEAD_URL".into(), self.dead_url.clone()),
            ("IDEM_SQS_FIFO".into(), self.fifo.to_string()),
        ]
    }

    async fn from_env() -> TestQueue {
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
        TestQueue {
            client: sqs_client().await,
            url: env("IDEM_SQS_URL"),
            dead_url: env("IDEM_SQS_DEAD_URL"),
            fifo: env("IDEM_SQS_FIFO") == "true",
            adapter_endpoint: None,
            groups: 4,
            min_visibility: Duration::from_secs(1),
            sent: AtomicUsize::new(0),
            owned: false,
        }
    }
}

impl Drop for TestQueue {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let urls = [self.url.clone(), self.dead_url.clone()];
        support::clean_up_aside(async move {
            let client = sqs_client().await;
            for url in urls {
                let _ = client.delete_queue().queue_url(url).send().await;
            }
        });
    }
}

// ------------------------------------------------------------------- shared

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let place = TestQueue::create("once")
        .await
        .min_visibility(Duration::from_secs(10));
    support::four_tasks_run_each_order_once(place).await;
}

/// The same on a FIFO queue, its messages spread over four groups, four
/// consumers receiving at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let place = TestQueue::create_fifo("once")
        .await
        .min_visibility(Duration::from_secs(10));
    support::four_tasks_run_each_order_once(place).await;
}

/// `ApproximateReceiveCount` drives the limits; dead letters go to the
/// queue named by the redrive policy, with idem's fields as attributes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_by_the_redrive_policy_the_rest_acked() {
    let place = TestQueue::create("poison")
        .await
        .min_visibility(Duration::from_secs(10));
    support::poison_messages_are_dead_lettered_the_rest_acked(place).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    let place = TestQueue::create("store-down")
        .await
        .min_visibility(Duration::from_secs(10));
    support::store_down_nothing_runs_then_everything_once(place).await;
}

#[test]
fn worker() {
    support::worker::<TestQueue>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    support::two_processes_run_every_order_once(TestQueue::create("procs").await).await;
}

/// The killed process extends nothing: its messages come back after the
/// 1 s visibility timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let place = TestQueue::create("crash").await;
    support::killed_before_the_ack_the_redelivery_replays(place, Duration::from_secs(1)).await;
}

/// The dead holder's lease (1.5 s) outlives the visibility timeout (1 s):
/// the first redelivery gets `InProgress` and is nacked, then one takes
/// over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let place = TestQueue::create("mid").await;
    support::killed_mid_handler_one_extra_run_after_the_lease(place, Duration::from_secs(1)).await;
}

/// The endpoint goes away (connections cut, new ones refused) for two
/// seconds and comes back with its queues: `run` backs off through the
/// failed receives and processes everything exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_the_endpoint_going_away_and_processes_everything_once() {
    let upstream = idem_testkit::aws_endpoint();
    let upstream = upstream
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap_or_else(|e| panic!("{upstream} is not host:port ({e})"));
    let proxy = FaultProxy::start(upstream);
    let mut place = TestQueue::create("restart").await;
    place.adapter_endpoint = Some(format!("http://127.0.0.1:{}", proxy.port()));
    support::run_survives_a_broker_restart(&place, || {
        proxy.refuse(true);
        proxy.drop_connections();
        std::thread::sleep(Duration::from_secs(2));
        proxy.refuse(false);
    })
    .await;
}

/// Bad input: a body that is not JSON under payload keys; an id attribute
/// of 10 KB, and one that is Binary, under id keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    let by_payload = TestQueue::create("bad-payload").await;
    by_payload.publish(None, b"not json").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_payload,
        KeySource::Payload(idem_consumer::KeyDeriver::new()),
        &["JSON"],
    )
    .await;
    let by_id = TestQueue::create("bad-id").await;
    by_id.publish(Some(&"x".repeat(10 * 1024)), b"{}").await;
    let binary = MessageAttributeValue::builder()
        .data_type("Binary")
        .binary_value(idem_consumer::sqs::aws_sdk_sqs::primitives::Blob::new(
            b"o-1".to_vec(),
        ))
        .build()
        .unwrap();
    by_id.send(None, vec![(ID_ATTRIBUTE, binary)], b"{}").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_id,
        KeySource::MessageId,
        &["10240 bytes", "not a String"],
    )
    .await;
}

/// A consumer SIGKILLed 12 times; each redelivery after a kill waits out
/// the 1 s visibility timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let place = TestQueue::create("loop").await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, Duration::from_secs(1))
        .await;
}

/// The crash loop on a FIFO queue: the messages waiting behind a killed
/// consumer's wave come back with it, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let place = TestQueue::create_fifo("loop").await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, Duration::from_secs(1))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_batch_in_flight_finish_and_settles_it() {
    let place = TestQueue::create("drain")
        .await
        .min_visibility(Duration::from_secs(10));
    support::shutdown_drains_the_batch_in_flight(place).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_abandoned_at_the_drain_deadline_keeps_its_key_until_the_lease() {
    let place = TestQueue::create("abandon").await;
    support::shutdown_past_the_deadline_keeps_the_key_until_the_lease(place).await;
}

// ------------------------------------------------------------- SQS's own

/// Polls until `n` deliveries were decided; returns the total.
async fn poll_until<C, H, Fut>(
    adapter: &SqsConsumer,
    consumer: &Consumer<C>,
    handler: &H,
    n: usize,
) -> PollReport
where
    C: idem_consumer::Classify<String>,
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let mut total = PollReport::default();
    until("decisions made", Duration::from_secs(30), async || {
        total.add(adapter.poll(consumer, handler).await.unwrap());
        total.acked + total.nacked + total.dead_lettered >= n
    })
    .await;
    total
}

/// FIFO order per group under concurrency: 4 groups of 8 messages, up to
/// 16 handlers at once, every receive holding several messages of each
/// group. No two messages of one group ever run at the same time, each
/// group's effects happen in send order, and a retryable failure in the
/// middle of a group (nacked, made visible again at once) holds the rest of
/// that group back until it succeeds: the messages behind it, received in
/// the same batch, go back unrun and come again after it. One consumer
/// receives, so that every wave is its own; across consumers SQS holds a
/// group while one of its messages is in flight (the four-consumer test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_runs_a_groups_messages_one_at_a_time_in_order_and_a_nack_holds_the_group_back() {
    let place = TestQueue::create_fifo("order").await;
    let (groups, per_group) = (4usize, 8usize);
    for seq in 0..per_group {
        for g in 0..groups {
            let id = format!("g{g}-{seq}");
            let body = format!(r#"{{"g":{g},"seq":{seq}}}"#);
            place
                .send(
                    Some(&format!("g{g}")),
                    vec![(ID_ATTRIBUTE, text(&id))],
                    body.as_bytes(),
                )
                .await;
        }
    }
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "fifo")
        .concurrency(16)
        .backoff(Duration::ZERO, Duration::ZERO);
    let running: Vec<AtomicUsize> = (0..groups).map(|_| AtomicUsize::new(0)).collect();
    let overlaps = AtomicUsize::new(0);
    let effects: Vec<Mutex<Vec<usize>>> = (0..groups).map(|_| Mutex::new(Vec::new())).collect();
    let failed_once = AtomicBool::new(false);
    let attempts = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        let v: serde_json::Value = m.json().map_err(|e| e.to_string())?;
        let (g, seq) = (
            v["g"].as_u64().unwrap() as usize,
            v["seq"].as_u64().unwrap() as usize,
        );
        attempts.record(m.id().unwrap());
        if running[g].fetch_add(1, Ordering::SeqCst) != 0 {
            overlaps.fetch_add(1, Ordering::SeqCst);
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
        let result = if (g, seq) == (1, 3) && !failed_once.swap(true, Ordering::SeqCst) {
            Err("transient".to_owned())
        } else {
            effects[g].lock().unwrap().push(seq);
            Ok(())
        };
        running[g].fetch_sub(1, Ordering::SeqCst);
        result
    };
    let adapter = place.adapter("a", Duration::from_secs(10)).await;
    let total = groups * per_group;
    let mut report = PollReport::default();
    let mut most_in_a_wave = 0;
    until("every message acked", Duration::from_secs(60), async || {
        let r = adapter.poll(&consumer, &handler).await.unwrap();
        most_in_a_wave = most_in_a_wave.max(r.fetched);
        report.add(r);
        report.acked >= total
    })
    .await;
    assert_eq!((report.acked, report.nacked), (total, 1), "{report:?}");
    assert!(
        most_in_a_wave <= groups,
        "a wave holds one message per group"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "two messages of one group ran at once"
    );
    for (g, effects) in effects.iter().enumerate() {
        assert_eq!(
            *effects.lock().unwrap(),
            (0..per_group).collect::<Vec<_>>(),
            "group g{g}'s effects in send order, each once"
        );
    }
    assert_eq!(attempts.count("g1-3"), 2, "the failed message ran again");
    assert_eq!(attempts.total(), total + 1, "{:?}", attempts.duplicates());
    support::assert_drained(&place).await;
}

/// A batch holding copies of one message (a producer's re-send: two SQS
/// messages with one `idem-id`) runs the handler once and deletes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_one_message_in_a_batch_run_once_and_are_all_deleted() {
    let place = TestQueue::create("copies").await;
    for _ in 0..3 {
        place.publish(Some("o-1"), br#"{"order":"o-1"}"#).await;
    }
    place.publish(Some("o-2"), br#"{"order":"o-2"}"#).await;
    let redis = RedisServer::start();
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(5)).await,
        "copies",
    );
    let adapter = place.adapter("c", Duration::from_secs(30)).await;
    let fetched = adapter.fetch().await.unwrap();
    assert_eq!(fetched.len(), 4, "one receive holds all four");
    let ledger = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        Ok(())
    };
    let decided = adapter.handle(&consumer, &handler, fetched).await;
    let report = adapter.settle(decided).await.unwrap();
    assert_eq!((report.fetched, report.acked), (4, 4), "{report:?}");
    assert_eq!((ledger.count("o-1"), ledger.count("o-2")), (1, 1));
    support::assert_drained(&place).await;
}

/// A handler running four times longer than the 1 s visibility timeout:
/// the adapter extends the visibility while it runs, so another consumer
/// polling all along receives nothing, the message is received once and
/// deleted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_handler_keeps_its_message_invisible_while_it_runs() {
    let place = TestQueue::create("slow").await;
    place
        .publish(Some("o-slow"), br#"{"order":"o-slow"}"#)
        .await;
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(2)).await, "slow");
    let (slow, other) = (
        place.adapter("slow", Duration::from_secs(1)).await,
        place.adapter("other", Duration::from_secs(1)).await,
    );
    let ledger = Ledger::new();
    let started = tokio::sync::Notify::new();
    let done = AtomicBool::new(false);
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        started.notify_one();
        tokio::time::sleep(Duration::from_secs(4)).await;
        Ok(())
    };
    let quick = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        Ok(())
    };
    let slow_side = async {
        let r = poll_until(&slow, &consumer, &handler, 1).await;
        done.store(true, Ordering::SeqCst);
        r
    };
    let other_side = async {
        started.notified().await;
        let mut seen = PollReport::default();
        while !done.load(Ordering::SeqCst) {
            seen.add(other.poll(&consumer, &quick).await.unwrap());
        }
        seen
    };
    let (slow_report, seen) = tokio::join!(slow_side, other_side);
    assert_eq!(
        (
            slow_report.fetched,
            slow_report.acked,
            slow_report.redelivered
        ),
        (1, 1, 0)
    );
    assert_eq!(
        seen.fetched, 0,
        "received by another consumer while alive: {seen:?}"
    );
    assert_eq!(ledger.count("o-slow"), 1);
    support::assert_drained(&place).await;
}

/// A retryable failure with no backoff is nacked with visibility 0: the
/// next receive gets it again (receive count 2) although the visibility
/// timeout is 30 s, and it is acked then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_nack_makes_the_message_visible_again_at_once() {
    let place = TestQueue::create("nack").await;
    place.publish(Some("o-1"), br#"{"order":"o-1"}"#).await;
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "nack")
        .backoff(Duration::ZERO, Duration::ZERO);
    let adapter = place.adapter("c", Duration::from_secs(30)).await;
    let ledger = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        let n = ledger.record(m.id().unwrap());
        if n == 1 {
            Err("transient".into())
        } else {
            Ok(())
        }
    };
    let first = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!((first.fetched, first.nacked), (1, 1), "{first:?}");
    let second = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!(
        (second.fetched, second.redelivered, second.acked),
        (1, 1, 1),
        "{second:?}"
    );
    assert_eq!(ledger.count("o-1"), 2);
    support::assert_drained(&place).await;
}

fn permanent_consumer(
    idem: idem_core::Idempotency,
) -> Consumer<impl idem_consumer::Classify<String>> {
    Consumer::new(idem, "dead")
        .keys(KeySource::MessageId)
        .classify(|_: &String| ErrorClass::Permanent)
}

/// Dead letters go to the queue the redrive policy names, with idem's
/// reason, kind and receive count, the id attribute and the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_goes_to_the_redrive_policys_queue_with_idems_fields() {
    let place = TestQueue::create("redrive").await;
    place.publish(Some("o-bad"), br#"{"order":"bad"}"#).await;
    let redis = RedisServer::start();
    let consumer = permanent_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let adapter = place.adapter("c", Duration::from_secs(30)).await;
    assert_eq!(adapter.dead_letter_queue_url(), place.dead_url);
    let ledger = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        Err("card declined".into())
    };
    let r = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!(r.dead_lettered, 1, "{r:?}");
    support::assert_drained(&place).await;
    let dead = place.dead_letters().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let d = &dead[0];
    assert_eq!(d.id.as_deref(), Some("o-bad"));
    assert_eq!(d.kind.as_deref(), Some("permanent"));
    assert!(
        d.reason.as_deref().unwrap().contains("card declined"),
        "{d:?}"
    );
    assert_eq!(
        (d.deliveries, d.payload.as_slice()),
        (Some(1), br#"{"order":"bad"}"#.as_slice())
    );
    assert_eq!(ledger.count("o-bad"), 1);
}

/// An explicit dead-letter queue wins over the redrive policy's; on a
/// FIFO queue the dead letter keeps its group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_goes_to_the_explicit_dead_letter_queue_when_one_is_given() {
    let place = TestQueue::create_fifo("explicit").await;
    let elsewhere = create_queue(
        &place.client,
        &format!("{}.fifo", unique_name("elsewhere")),
        vec![(QueueAttributeName::FifoQueue, "true".to_owned())],
    )
    .await;
    place
        .send(Some("grp"), vec![(ID_ATTRIBUTE, text("o-bad"))], b"{}")
        .await;
    let redis = RedisServer::start();
    let consumer = permanent_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let adapter = place
        .adapter_with(
            place
                .config(Duration::from_secs(30))
                .dead_letter_queue_url(&elsewhere),
        )
        .await;
    let handler = async |_: Message| -> Result<(), String> { Err("no".into()) };
    let r = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!(r.dead_lettered, 1, "{r:?}");
    support::assert_drained(&place).await;
    let moved = place.take_all(&elsewhere).await;
    let _ = place
        .client
        .delete_queue()
        .queue_url(&elsewhere)
        .send()
        .await;
    assert_eq!(moved.len(), 1);
    assert_eq!(attribute(&moved[0], ID_ATTRIBUTE).as_deref(), Some("o-bad"));
    let group = moved[0]
        .attributes
        .as_ref()
        .and_then(|a| a.get(&MessageSystemAttributeName::MessageGroupId))
        .cloned();
    assert_eq!(group.as_deref(), Some("grp"));
    assert!(
        place.dead_letters().await.is_empty(),
        "not in the redrive policy's queue"
    );
}

/// A dead letter SQS does not take (the dead-letter queue is gone) is not
/// deleted: the message stays in its queue, and once the dead-letter
/// queue exists again the next delivery is dead-lettered there. Nothing
/// lost, the handler never counted as done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_dead_letter_send_keeps_the_message() {
    let place = TestQueue::create("dlq-gone").await;
    let dead_name = unique_name("gone");
    let missing = format!("{}/{dead_name}", place.url.rsplit_once('/').unwrap().0);
    place.publish(Some("o-bad"), br#"{"order":"bad"}"#).await;
    let redis = RedisServer::start();
    let consumer = permanent_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let cfg = place
        .config(Duration::from_secs(30))
        .dead_letter_queue_url(&missing);
    let adapter = place.adapter_with(cfg).await;
    let ledger = Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        Err("card declined".into())
    };
    let r = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!(r.dead_lettered, 1, "decided: {r:?}");
    assert_eq!(
        counts_in(&place.client, &place.url).await,
        (0, 1, 0),
        "not deleted: in flight until DEAD_LETTER_RETRY"
    );
    let dead_url = create_queue(&place.client, &dead_name, Vec::new()).await;
    assert_eq!(dead_url, missing);
    let again = poll_until(&adapter, &consumer, &handler, 1).await;
    assert_eq!(
        (again.redelivered, again.dead_lettered),
        (1, 1),
        "{again:?}"
    );
    support::assert_drained(&place).await;
    let moved = place.take_all(&dead_url).await;
    let _ = place
        .client
        .delete_queue()
        .queue_url(&dead_url)
        .send()
        .await;
    assert_eq!(moved.len(), 1);
    let d = dead_letter_of(&moved[0]);
    assert_eq!(
        (d.id.as_deref(), d.deliveries),
        (Some("o-bad"), Some(2)),
        "{d:?}"
    );
    assert_eq!(
        ledger.count("o-bad"),
        2,
        "a permanent failure runs again on its redelivery"
    );
}

/// A queue with neither a redrive policy nor a dead-letter queue given is
/// refused up front, saying what to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_dead_letter_queue_is_refused_saying_what_to_set() {
    let client = sqs_client().await;
    let url = create_queue(&client, &unique_name("nodlq"), Vec::new()).await;
    let err = SqsConsumer::new(client.clone(), SqsConfig::new(&url))
        .await
        .unwrap_err();
    let _ = client.delete_queue().queue_url(&url).send().await;
    assert!(err.to_string().contains("dead_letter_queue_url"), "{err}");
}

// -------------------------------------------------------------------- sink

fn outbox_message(tag: &str, topic: &str, i: usize) -> OutboxMessage {
    OutboxMessage::new(
        message_id(&format!("idem:sqs-sink:{tag}:{i}"), topic),
        topic,
        format!("order-{i}"),
        format!(r#"{{"order":"o-{i}","tag":"{tag}"}}"#),
    )
}

/// Receives until `n` messages were decided, recording each handler run
/// by message id; returns the outcomes by id.
async fn consume_ids(
    adapter: &SqsConsumer,
    ledger: &Ledger,
    n: usize,
) -> HashMap<String, Vec<String>> {
    let consumer = Consumer::new(
        idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build(),
        "orders.ship",
    );
    let mut outcomes: HashMap<String, Vec<String>> = HashMap::new();
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap());
        Ok(())
    };
    let mut seen = 0;
    until(
        "the sent messages arrive",
        Duration::from_secs(30),
        async || {
            let fetched = adapter.fetch().await.unwrap();
            for d in fetched {
                let m = adapter.message_of(&d).unwrap();
                let handled = consumer.handle(&m, &handler).await;
                adapter.apply(&d, &handled.decision).await.unwrap();
                outcomes
                    .entry(m.id().unwrap().to_owned())
                    .or_default()
                    .push(format!("{:?}", handled.outcome));
                seen += 1;
            }
            seen >= n
        },
    )
    .await;
    outcomes
}

/// Outbox → relay → SQS → consumer: messages written with their
/// transactions in PostgreSQL, relayed by idem-postgres's relay through
/// the sink to a standard queue, then sent again as a relay does when it
/// dies between the send and the delete. Each message's effect happens
/// exactly once (the copies replay), every copy is deleted, the outbox is
/// empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_to_sqs_to_consumer_runs_each_message_once_across_a_relay_re_send() {
    use idem_postgres::PgStore;
    use idem_postgres::outbox::Relay;
    let place = TestQueue::create("outbox").await;
    let db = idem_testkit::PgTestDb::new().await;
    let store = PgStore::from_pool(db.pool.clone());
    store.migrate().await.unwrap();
    let outbox = store.outbox();
    let n = 12;
    let mut tx = db.pool.begin().await.unwrap();
    for i in 0..n {
        let v = serde_json::json!({"order": format!("o-{i}")});
        outbox
            .publish_with_id(
                &mut tx,
                &place.url,
                &format!("order-{i}"),
                &format!("m-{i}"),
                &v,
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let sink = Arc::new(SqsSink::new(place.client.clone()));
    let relay = Relay::new(&store, Arc::clone(&sink)).batch_size(32);
    let pass = relay.drain_once().await.unwrap();
    assert_eq!(
        (pass.sent, pass.parked, pass.failed),
        (n as u64, 0, 0),
        "{pass:?}"
    );
    assert_eq!(store.outbox().backlog().await.unwrap().pending, 0);
    // The relay's re-send after a crash between send and delete.
    let resent: Vec<OutboxMessage> = (0..n)
        .map(|i| {
            OutboxMessage::new(
                format!("m-{i}"),
                place.url.clone(),
                format!("order-{i}"),
                serde_json::to_vec(&serde_json::json!({"order": format!("o-{i}")})).unwrap(),
            )
            .with_attempts(1)
        })
        .collect();
    for r in sink.send(&resent).await {
        r.unwrap();
    }
    let adapter = place.adapter("c", Duration::from_secs(30)).await;
    let ledger = Ledger::new();
    let outcomes = consume_ids(&adapter, &ledger, 2 * n).await;
    assert_eq!(outcomes.len(), n, "{outcomes:?}");
    for i in 0..n {
        let id = format!("m-{i}");
        assert_eq!(ledger.count(&id), 1, "{id} ran once");
        let mut o = outcomes[&id].clone();
        o.sort();
        assert_eq!(o, ["Some(Executed)", "Some(Replayed)"], "{id}");
    }
    assert_eq!(ledger.total(), n);
    support::assert_drained(&place).await;
}

/// On a FIFO queue the sink sets the group from the key and the
/// deduplication id from the outbox id: a re-send SQS receives before the
/// first copy is consumed is dropped by SQS itself (real SQS drops it for
/// 5 minutes, consumed or not; moto only while the first copy is in the
/// queue, so both go before any receive). Each message arrives once, in
/// its key's group, with its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_sink_sets_groups_from_keys_and_sqs_drops_re_sends_by_dedup_id() {
    let place = TestQueue::create_fifo("sink").await;
    let sink = SqsSink::new(place.client.clone()).queue_url(&place.url);
    let batch: Vec<OutboxMessage> = (0..12)
        .map(|i| outbox_message("fifo", "orders", i))
        .collect();
    for r in sink.send(&batch).await {
        r.unwrap();
    }
    for r in sink.send(&batch).await {
        r.unwrap();
    }
    assert_eq!(
        counts_in(&place.client, &place.url).await,
        (12, 0, 0),
        "the re-sends dropped"
    );
    let received = place.take_all(&place.url).await;
    assert_eq!(received.len(), 12);
    for m in &received {
        let id = attribute(m, ID_ATTRIBUTE).unwrap();
        let sent = batch.iter().find(|b| b.id == id).unwrap();
        let sys = m.attributes.as_ref().unwrap();
        assert_eq!(
            sys.get(&MessageSystemAttributeName::MessageGroupId),
            Some(&sent.key)
        );
        assert_eq!(
            sys.get(&MessageSystemAttributeName::MessageDeduplicationId),
            Some(&sent.id)
        );
        assert_eq!(
            m.body.as_deref().map(str::as_bytes),
            Some(&sent.payload[..])
        );
        assert_eq!(
            attribute(m, idem_consumer::outbox::KEY_ATTRIBUTE),
            Some(sent.key.clone())
        );
    }
}

/// A batch of 25 (three requests) with an oversized message and a body
/// SQS cannot carry: those two are `Refused`, every other message is
/// sent, each result at its message's place; a queue that does not exist
/// refuses its messages only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_refuses_exactly_the_messages_sqs_would_refuse_and_sends_the_rest() {
    let place = TestQueue::create("sink-refuse").await;
    let sink = SqsSink::new(place.client.clone());
    let topic = place.url.rsplit('/').next().unwrap().to_owned();
    let mut batch: Vec<OutboxMessage> = (0..25)
        .map(|i| outbox_message("refuse", &topic, i))
        .collect();
    batch[7].payload = "x".repeat(300 * 1024).into();
    batch[13].payload = "nul \u{0} inside".into();
    batch[20].topic = unique_name("no-such-queue");
    let results = sink.send(&batch).await;
    assert_eq!(results.len(), 25);
    for (i, r) in results.iter().enumerate() {
        match i {
            7 => assert!(
                matches!(r, Err(SinkError::Refused { reason, .. }) if reason.contains("over SQS's limit")),
                "{r:?}"
            ),
            13 => assert!(
                matches!(r, Err(SinkError::Refused { reason, .. }) if reason.contains("U+0000")),
                "{r:?}"
            ),
            20 => assert!(matches!(r, Err(SinkError::Refused { .. })), "{r:?}"),
            _ => assert!(r.is_ok(), "message {i}: {r:?}"),
        }
    }
    assert_eq!(counts_in(&place.client, &place.url).await.0, 22);
}

// ------------------------------------------------------- headers and traces

/// A W3C `traceparent` for the tests (the recommendation's example).
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The sink sends a message's headers unchanged as String message
/// attributes beside its own (`idem-id`, `idem-outbox-key`), whatever the
/// build's features; an empty value, which SQS refuses, is left out (the
/// empty `tracestate` OpenTelemetry writes); a message over SQS's 10
/// attributes, or with a header named like the sink's own, is refused and
/// the rest of the batch sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_sends_a_messages_headers_unchanged_as_string_attributes() {
    let place = TestQueue::create("sink-headers").await;
    let sink = SqsSink::new(place.client.clone()).queue_url(&place.url);
    assert_eq!(sink.system(), "aws_sqs");
    let headers = vec![
        ("traceparent".to_owned(), TRACEPARENT.to_owned()),
        ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
        ("x-tenant".to_owned(), "acme".to_owned()),
    ];
    let eight: Vec<(String, String)> = (0..8).map(|i| (format!("h{i}"), "v".to_owned())).collect();
    let nine: Vec<(String, String)> = (0..9).map(|i| (format!("h{i}"), "v".to_owned())).collect();
    let batch = [
        outbox_message("headers", "orders", 0).with_headers(headers.clone()),
        outbox_message("headers", "orders", 1).with_headers(vec![
            ("traceparent".to_owned(), TRACEPARENT.to_owned()),
            ("tracestate".to_owned(), String::new()),
        ]),
        outbox_message("headers", "orders", 2).with_headers(eight.clone()),
        outbox_message("headers", "orders", 3).with_headers(nine),
        outbox_message("headers", "orders", 4)
            .with_headers(vec![(ID_ATTRIBUTE.to_owned(), "other".to_owned())]),
    ];
    let results = sink.send(&batch).await;
    for (i, r) in results.iter().enumerate() {
        if i < 3 {
            assert!(r.is_ok(), "message {i}: {r:?}");
        } else {
            assert!(
                matches!(r, Err(SinkError::Refused { .. })),
                "message {i}: {r:?}"
            );
        }
    }
    let received = place.take_all(&place.url).await;
    assert_eq!(received.len(), 3, "the refused ones were not sent");
    let attributes_of = |i: usize| {
        let m = received
            .iter()
            .find(|m| attribute(m, ID_ATTRIBUTE).as_deref() == Some(batch[i].id.as_str()))
            .unwrap_or_else(|| panic!("message {i} arrived"));
        m.message_attributes.clone().unwrap_or_default()
    };
    let string = |v: &str| text(v);
    let first = attributes_of(0);
    for (name, value) in &headers {
        assert_eq!(first.get(name), Some(&string(value)), "attribute {name}");
    }
    assert_eq!(first.len(), 2 + headers.len(), "{first:?}");
    let second = attributes_of(1);
    assert_eq!(second.get("traceparent"), Some(&string(TRACEPARENT)));
    assert_eq!(second.get("tracestate"), None, "an empty value is not sent");
    let third = attributes_of(2);
    assert_eq!(third.len(), 10, "{third:?}");
    for (name, value) in &eight {
        assert_eq!(third.get(name), Some(&string(value)), "attribute {name}");
    }
}

/// With `otel`, the trace context the sink sent reaches the handler
/// unchanged, through the adapter's receive (which already asks for every
/// attribute); a message without it is handled as before.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_context_of_a_message_reaches_the_handler() {
    let place = TestQueue::create("traced").await;
    let sink = SqsSink::new(place.client.clone()).queue_url(&place.url);
    let batch = [
        outbox_message("traced", "orders", 0).with_headers(vec![
            ("traceparent".to_owned(), TRACEPARENT.to_owned()),
            ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
        ]),
        outbox_message("traced", "orders", 1),
    ];
    for r in sink.send(&batch).await {
        r.unwrap();
    }
    let adapter = place.adapter("c", Duration::from_secs(30)).await;
    let consumer = Consumer::new(
        idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build(),
        "trace",
    );
    let seen = Mutex::new(Vec::new());
    let handler = async |m: Message| -> Result<(), String> {
        seen.lock().unwrap().push((
            m.id().unwrap_or("?").to_owned(),
            m.trace_header("traceparent").map(str::to_owned),
            m.trace_header("tracestate").map(str::to_owned),
        ));
        Ok(())
    };
    let mut acked = 0;
    until("both handled", Duration::from_secs(30), async || {
        acked += adapter.poll(&consumer, &handler).await.unwrap().acked;
        acked >= 2
    })
    .await;
    let seen: HashMap<String, (Option<String>, Option<String>)> = seen
        .into_inner()
        .unwrap()
        .into_iter()
        .map(|(id, tp, ts)| (id, (tp, ts)))
        .collect();
    assert_eq!(
        seen[&batch[0].id],
        (
            Some(TRACEPARENT.to_owned()),
            Some("congo=t61rcWkgMzE".to_owned())
        )
    );
    assert_eq!(seen[&batch[1].id], (None, None));
    assert_eq!(seen.len(), 2, "{seen:?}");
}
