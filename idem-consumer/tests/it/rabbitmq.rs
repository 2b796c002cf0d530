//! RabbitMQ adapter against the broker on 127.0.0.1:5672 (guest/guest, or
//! `AMQP_URL`), with unique queue and exchange names per test, deleted
//! after; the restart test spawns a private node. The shared scenarios are in `support`. Ground truth is an
//! external ledger of side effects.

use crate::support;

use idem_consumer::Consumer;
use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue};
use idem_consumer::{Adapter, ErrorClass, KeyDeriver, KeySource, Message, dead_letter_field};
use idem_testkit::{FaultProxy, RabbitServer, RedisServer};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ExchangeDeleteOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use support::{DeadLetter, Place, idem_on};

// ------------------------------------------------------------------ the place

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn connect(url: &str) -> Connection {
    tokio::time::timeout(Duration::from_secs(10), Connection::connect(url, Default::default()))
        .await
        .unwrap_or_else(|_| panic!("RabbitMQ at {url} did not answer within 10 s: start rabbitmq-server (or run .ci/run, which does), or set AMQP_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to RabbitMQ at {url}: {e}; start rabbitmq-server (or run .ci/run), or set AMQP_URL"))
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}.{}.{}.{}",
        std::process::id(),
        idem_testkit::unix_ms() % 1_000_000_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// The test's own connection and channel.
struct Link {
    conn: Connection,
    channel: Channel,
}

impl Link {
    async fn open(url: &str) -> Link {
        let conn = connect(url).await;
        let channel = conn.create_channel().await.unwrap();
        Link { conn, channel }
    }

    /// Opens it again after the broker went away: it may still be booting.
    async fn reopen(url: &str) -> Link {
        for _ in 0..300 {
            let attempt = tokio::time::timeout(Duration::from_secs(5), async {
                let conn = Connection::connect(url, Default::default()).await?;
                let channel = conn.create_channel().await?;
                Ok::<_, lapin::Error>(Link { conn, channel })
            });
            if let Ok(Ok(link)) = attempt.await {
                return link;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("RabbitMQ at {url} did not come back within a minute")
    }
}

/// A quorum queue with its dead-letter exchange and queue; deleted on drop
/// by the process that created it.
struct TestQueue {
    url: String,
    link: tokio::sync::Mutex<Link>,
    queue: String,
    id_header: Option<String>,
    /// Dead letters published by the adapter with idem's fields (`Some`,
    /// the default: the queue's own dead-letter exchange) or rejected to
    /// the queue's dead-letter exchange by the broker (`None`).
    dead_letter_exchange: Option<String>,
    owned: bool,
}

impl TestQueue {
    async fn create(prefix: &str) -> TestQueue {
        TestQueue::create_at(&amqp_url(), prefix).await
    }

    async fn create_at(url: &str, prefix: &str) -> TestQueue {
        let link = Link::open(url).await;
        let queue = unique(prefix);
        declare_queue(
            &link.channel,
            &queue,
            &format!("{queue}.dlx"),
            &format!("{queue}.dead"),
        )
        .await
        .unwrap();
        TestQueue {
            url: url.to_owned(),
            link: tokio::sync::Mutex::new(link),
            dead_letter_exchange: Some(format!("{queue}.dlx")),
            queue,
            id_header: None,
            owned: true,
        }
    }

    /// Keys from this header instead of `message_id`.
    fn id_header(mut self, name: &str) -> TestQueue {
        self.id_header = Some(name.to_owned());
        self
    }

    /// Dead letters rejected to the queue's dead-letter exchange, as
    /// before the adapter published them itself.
    fn rejecting_dead_letters(mut self) -> TestQueue {
        self.dead_letter_exchange = None;
        self
    }

    /// Ready messages in `queue` (the broker's count).
    async fn ready_in(&self, queue: &str) -> u32 {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        self.channel()
            .await
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    }

    /// Messages in the dead-letter queue, taken off it.
    async fn take_dead(&self) -> Vec<lapin::message::Delivery> {
        let dead = format!("{}.dead", self.queue);
        let channel = self.channel().await;
        let mut out = Vec::new();
        while let Some(m) = channel
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            out.push(m.delivery);
        }
        out
    }

    /// The connection, opened again if the broker closed it (a restart:
    /// the test's bounce, which ends when the node accepts clients again).
    async fn link(&self) -> tokio::sync::MutexGuard<'_, Link> {
        let mut link = self.link.lock().await;
        if !link.conn.status().connected() || !link.channel.status().connected() {
            *link = Link::reopen(&self.url).await;
        }
        link
    }

    async fn channel(&self) -> Channel {
        self.link().await.channel.clone()
    }

    async fn publish_with(&self, id: Option<&str>, headers: Option<FieldTable>, payload: &[u8]) {
        let mut props = BasicProperties::default();
        if let Some(id) = id {
            props = props.with_message_id(ShortString::from(id));
        }
        if let Some(h) = headers {
            props = props.with_headers(h);
        }
        self.channel()
            .await
            .basic_publish(
                "".into(),
                self.queue.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

impl Place for TestQueue {
    type Adapter = RabbitConsumer;
    const WORKER_ENV: &'static str = "IDEM_RABBIT";
    const WORKER_TEST: &'static str = "rabbitmq::worker";
    /// A queue has no position: delivery tags count per channel.
    const POSITIONED: bool = false;

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        self.publish_with(id, None, payload).await;
    }

    /// A consumer on a channel of its own (RabbitMQ has no ack wait: it
    /// redelivers when the channel closes).
    async fn adapter(&self, _: &str, _: Duration) -> RabbitConsumer {
        let mut cfg = RabbitConfig::new(&self.queue)
            .block(Duration::from_millis(200))
            .prefetch(16);
        if let Some(h) = &self.id_header {
            cfg = cfg.id_header(h);
        }
        if let Some(x) = &self.dead_letter_exchange {
            cfg = cfg.dead_letter_exchange(x);
        }
        let channel = self.link().await.conn.create_channel().await.unwrap();
        RabbitConsumer::new(channel, cfg).await.unwrap()
    }

    /// Nothing ready (the adapters' reports say what was settled; RabbitMQ
    /// only counts unacked deliveries through its management API).
    async fn drained(&self) -> bool {
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = self
            .channel()
            .await
            .queue_declare(self.queue.as_str().into(), passive, FieldTable::default())
            .await;
        declared.is_ok_and(|q| q.message_count() == 0)
    }

    /// The message id and payload, and idem's fields from the headers
    /// (`None` for dead letters the broker rejected: only `x-death`).
    async fn dead_letters(&self) -> Vec<DeadLetter> {
        self.take_dead()
            .await
            .into_iter()
            .map(|d| {
                let props = &d.properties;
                DeadLetter {
                    id: props.message_id().as_ref().map(|i| i.to_string()),
                    kind: header_text(&d, dead_letter_field::KIND),
                    reason: header_text(&d, dead_letter_field::REASON),
                    deliveries: header_text(&d, dead_letter_field::DELIVERIES)
                        .map(|n| n.parse().unwrap()),
                    payload: d.data.clone(),
                }
            })
            .collect()
    }

    fn to_env(&self) -> Vec<(String, String)> {
        vec![
            ("IDEM_RABBIT_URL".into(), self.url.clone()),
            ("IDEM_RABBIT_QUEUE".into(), self.queue.clone()),
        ]
    }

    async fn from_env() -> TestQueue {
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
        let url = env("IDEM_RABBIT_URL");
        let queue = env("IDEM_RABBIT_QUEUE");
        TestQueue {
            link: tokio::sync::Mutex::new(Link::open(&url).await),
            url,
            dead_letter_exchange: Some(format!("{queue}.dlx")),
            queue,
            id_header: None,
            owned: false,
        }
    }
}

impl Drop for TestQueue {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (url, queue) = (self.url.clone(), self.queue.clone());
        support::clean_up_aside(async move {
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(5),
                Connection::connect(&url, Default::default()),
            )
            .await
            else {
                return;
            };
            if let Ok(ch) = conn.create_channel().await {
                for q in [queue.clone(), format!("{queue}.dead")] {
                    let _ = ch
                        .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
                        .await;
                }
                let dlx = format!("{queue}.dlx");
                let _ = ch
                    .exchange_delete(dlx.as_str().into(), ExchangeDeleteOptions::default())
                    .await;
            }
            let _ = conn.close(200, "bye".into()).await;
        });
    }
}

/// A header's value as text (idem writes long strings).
fn header_text(d: &lapin::message::Delivery, name: &str) -> Option<String> {
    let h = d.properties.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

// ------------------------------------------------------------------- shared

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    support::four_tasks_run_each_order_once(TestQueue::create("idem.once").await).await;
}

/// `x-delivery-count` (quorum queues) drives the delivery limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_rejected_to_the_dead_letter_exchange_the_rest_acked() {
    support::poison_messages_are_dead_lettered_the_rest_acked(
        TestQueue::create("idem.poison").await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    support::store_down_nothing_runs_then_everything_once(
        TestQueue::create("idem.store.down").await,
    )
    .await;
}

#[test]
fn worker() {
    support::worker::<TestQueue>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    support::two_processes_run_every_order_once(TestQueue::create("idem.procs").await).await;
}

/// The killed process's channel closes: the broker requeues its deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let place = TestQueue::create("idem.crash").await;
    support::killed_before_the_ack_the_redelivery_replays(place, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let place = TestQueue::create("idem.mid").await;
    support::killed_mid_handler_one_extra_run_after_the_lease(place, Duration::ZERO).await;
}

/// A private node with its data on disk: the quorum queue and its messages
/// survive the restart; the channel does not, so `run` stops with the
/// error and a new consumer on a new connection goes on (the scenario's
/// loop), replaying what had run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_consumer_after_a_broker_restart_processes_everything_once() {
    let mut server = RabbitServer::start();
    let place = TestQueue::create_at(&server.url(), "idem.restart").await;
    support::run_survives_a_broker_restart(&place, || {
        // RabbitMQ 3.10 SIGKILLed within about 100 ms of declaring a quorum
        // queue restarts with that queue leaderless for good (every call
        // on it waits); a queue in production is older than that.
        std::thread::sleep(Duration::from_secs(1));
        server.restart();
    })
    .await;
    assert_eq!(server.boots(), 2, "the node restarted once");
}

/// A broker that never answers the consumer's set-up (here a stalled
/// network): a typed error after the set-up timeout, not a wait for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_the_broker_never_accepts_is_an_error_after_the_setup_timeout() {
    let place = TestQueue::create("idem.setup").await;
    let uri: lapin::uri::AMQPUri = amqp_url().parse().unwrap();
    let upstream = format!("{}:{}", uri.authority.host, uri.authority.port);
    let upstream = tokio::net::lookup_host(&upstream)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream);
    let through = format!("amqp://guest:guest@127.0.0.1:{}/%2f", proxy.port());
    let conn = connect(&through).await;
    let channel = conn.create_channel().await.unwrap();
    proxy.stall(true);
    let cfg = RabbitConfig::new(&place.queue).setup_timeout(Duration::from_millis(500));
    let err = RabbitConsumer::new(channel, cfg).await.unwrap_err();
    assert!(
        err.to_string().contains("did not accept a consumer"),
        "{err}"
    );
    proxy.stall(false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_with_its_reason_and_runs_nothing() {
    let header = |v: AMQPValue| {
        let mut h = FieldTable::default();
        h.insert("x-order-id".into(), v);
        Some(h)
    };
    // Payload-derived keys: not JSON.
    let by_payload = TestQueue::create("idem.bad.payload").await;
    by_payload.publish(None, b"\xff not json").await;
    let payload_keys = KeySource::Payload(KeyDeriver::new());
    support::bad_input_is_dead_lettered_and_runs_nothing(&by_payload, payload_keys, &["JSON"])
        .await;
    // message_id keys: an empty id.
    let by_id = TestQueue::create("idem.bad.id").await;
    by_id.publish(Some(""), b"{}").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(&by_id, KeySource::MessageId, &["empty"])
        .await;
    // Header keys: a 10 KB id, an integer where a string belongs.
    let by_header = TestQueue::create("idem.bad.header")
        .await
        .id_header("x-order-id");
    let long = AMQPValue::LongString("x".repeat(10 * 1024).into());
    by_header.publish_with(None, header(long), b"{}").await;
    by_header
        .publish_with(None, header(AMQPValue::LongLongInt(7)), b"{}")
        .await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_header,
        KeySource::MessageId,
        &["10240 bytes", "not a string"],
    )
    .await;
}

/// The reasons themselves (the broker only records "rejected"): what the
/// adapter makes of each bad delivery, through the core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn core_bad_input_reasons_for_amqp_messages() {
    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "bad")
        .keys(KeySource::MessageId);
    let h = |_: Message| async { Ok::<_, String>(()) };
    for (m, needle) in [
        (Message::new("{}").with_id(""), "empty"),
        (
            Message::new("{}").with_id("x".repeat(10 * 1024)),
            "10240 bytes",
        ),
        (
            Message::new("{}")
                .with_unreadable_id("header `x-order-id` is LongLongInt(7), not a string"),
            "not a string",
        ),
    ] {
        let d = consumer.handle(&m, &h).await.decision;
        assert!(d.to_string().contains(needle), "{needle:?} not in {d}");
    }
}

/// A quorum queue, a consumer SIGKILLed 12
/// times 0.3–0.8 s apart; every requeue spends a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let place = TestQueue::create("idem.loop").await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, Duration::ZERO).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_batch_in_flight_finish_and_settles_it() {
    support::shutdown_drains_the_batch_in_flight(TestQueue::create("idem.drain").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_abandoned_at_the_drain_deadline_keeps_its_key_until_the_lease() {
    let place = TestQueue::create("idem.abandon").await;
    support::shutdown_past_the_deadline_keeps_the_key_until_the_lease(place).await;
}

// ------------------------------------------------------------ dead letters

/// A consumer of `place` whose handler fails permanently on `{"fail":..}`
/// payloads and records every run.
fn failing_consumer(
    idem: idem_core::Idempotency,
) -> Consumer<impl idem_consumer::Classify<String>> {
    Consumer::new(idem, "dead")
        .keys(KeySource::MessageId)
        .backoff(Duration::from_millis(20), Duration::from_millis(50))
        .classify(|_: &String| ErrorClass::Permanent)
}

/// Polls until `n` decisions were made; returns the total.
async fn poll_until_settled<H, Fut>(
    adapter: &RabbitConsumer,
    consumer: &Consumer<impl idem_consumer::Classify<String>>,
    handler: &H,
    n: usize,
) -> idem_consumer::PollReport
where
    H: Fn(Message) -> Fut + Sync,
    Fut: Future<Output = Result<(), String>> + Send,
{
    let mut total = idem_consumer::PollReport::default();
    support::until("decisions made", Duration::from_secs(20), async || {
        total.add(adapter.poll(consumer, handler).await.unwrap());
        total.acked + total.nacked + total.dead_lettered >= n
    })
    .await;
    total
}

/// A poison message's dead letter carries idem's reason, kind and counts,
/// and keeps the original id, headers and payload; it is persistent and
/// the original is acked (gone from the queue).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_messages_dead_letter_carries_idems_reason_kind_and_counts() {
    let redis = RedisServer::start();
    let place = TestQueue::create("idem.dl.fields").await;
    let mut headers = FieldTable::default();
    headers.insert("x-tenant".into(), AMQPValue::LongString("acme".into()));
    place
        .publish_with(Some("p-1"), Some(headers), br#"{"fail":"card declined"}"#)
        .await;
    let consumer = failing_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let runs = idem_testkit::Ledger::new();
    let handler = async |m: Message| -> Result<(), String> {
        runs.record(m.id().unwrap_or("?"));
        Err("card declined".to_owned())
    };
    let adapter = place.adapter("c", Duration::ZERO).await;
    let total = poll_until_settled(&adapter, &consumer, &handler, 1).await;
    assert_eq!(total.dead_lettered, 1, "{total:?}");
    support::assert_drained(&place).await;
    let mut dead = Vec::new();
    support::until("the dead letter", Duration::from_secs(10), async || {
        dead.extend(place.take_dead().await);
        !dead.is_empty()
    })
    .await;
    assert_eq!(dead.len(), 1);
    let d = &dead[0];
    assert_eq!(d.data, br#"{"fail":"card declined"}"#);
    assert_eq!(
        d.properties.message_id().as_ref().map(|i| i.as_str()),
        Some("p-1")
    );
    assert_eq!(*d.properties.delivery_mode(), Some(2), "persistent");
    assert_eq!(header_text(d, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(
        header_text(d, dead_letter_field::KIND).as_deref(),
        Some("permanent")
    );
    assert_eq!(
        header_text(d, dead_letter_field::DELIVERIES).as_deref(),
        Some("1")
    );
    let reason = header_text(d, dead_letter_field::REASON).unwrap_or_default();
    assert!(reason.contains("card declined"), "{reason}");
    assert!(
        header_text(d, "x-death").is_none(),
        "published, not rejected"
    );
    assert_eq!(runs.count("p-1"), 1);
}

/// A dead letter no queue takes (the exchange exists, nothing is bound to
/// it) comes back to the adapter: the original is not acked, it stays in
/// the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_nothing_routes_is_not_acked_and_the_message_stays() {
    let redis = RedisServer::start();
    let mut place = TestQueue::create("idem.dl.unroutable").await;
    let nowhere = format!("{}.nowhere", place.queue);
    place
        .channel()
        .await
        .exchange_declare(
            nowhere.as_str().into(),
            lapin::ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    place.dead_letter_exchange = Some(nowhere.clone());
    place.publish(Some("u-1"), br#"{"fail":1}"#).await;
    let consumer = failing_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let handler = async |_: Message| -> Result<(), String> { Err("no".to_owned()) };
    let adapter = place.adapter("c", Duration::ZERO).await;
    let total = poll_until_settled(&adapter, &consumer, &handler, 1).await;
    assert_eq!(total.dead_lettered, 1, "{total:?}");
    // The consumer goes away: whatever it did not ack is back in the queue.
    drop(adapter);
    place
        .link()
        .await
        .conn
        .close(200, "bye".into())
        .await
        .unwrap();
    support::until(
        "the message is back in the queue",
        Duration::from_secs(10),
        async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            place.ready_in(&place.queue).await == 1
        },
    )
    .await;
    assert_eq!(place.ready_in(&format!("{}.dead", place.queue)).await, 0);
    let _ = place
        .channel()
        .await
        .exchange_delete(nowhere.as_str().into(), ExchangeDeleteOptions::default())
        .await;
}

/// The dead-letter exchange deleted under a running consumer: the publish
/// closes the channel, `poll` fails saying why, and the broker requeues the
/// message (nothing acked, nothing lost). A consumer configured with an
/// exchange that does not exist is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_exchange_that_is_gone_loses_nothing() {
    let redis = RedisServer::start();
    let mut place = TestQueue::create("idem.dl.gone").await;
    let gone = format!("{}.gone", place.queue);
    let channel = place.channel().await;
    channel
        .exchange_declare(
            gone.as_str().into(),
            lapin::ExchangeKind::Fanout,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    place.dead_letter_exchange = Some(gone.clone());
    let adapter = place.adapter("c", Duration::ZERO).await;
    channel
        .exchange_delete(gone.as_str().into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
    place.publish(Some("g-1"), br#"{"fail":1}"#).await;
    let consumer = failing_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let handler = async |_: Message| -> Result<(), String> { Err("no".to_owned()) };
    let err = loop {
        match adapter.poll(&consumer, &handler).await {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    assert!(err.to_string().contains("requeues the message"), "{err}");
    support::until(
        "the message is back in the queue",
        Duration::from_secs(10),
        async || {
            tokio::time::sleep(Duration::from_millis(50)).await;
            place.ready_in(&place.queue).await == 1
        },
    )
    .await;
    // Set-up refuses an exchange that does not exist.
    let fresh = place.link().await.conn.create_channel().await.unwrap();
    let cfg = RabbitConfig::new(&place.queue).dead_letter_exchange(&gone);
    let refused = RabbitConsumer::new(fresh, cfg).await.unwrap_err();
    assert!(refused.to_string().contains("declare it"), "{refused}");
}

/// Configuration written before dead letters were published keeps
/// working: without `dead_letter_exchange` they are rejected to the
/// queue's dead-letter exchange (RabbitMQ's `x-death`, no idem fields).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_dead_letter_exchange_dead_letters_are_rejected_to_the_queues() {
    let redis = RedisServer::start();
    let place = TestQueue::create("idem.dl.reject")
        .await
        .rejecting_dead_letters();
    place.publish(Some("r-1"), br#"{"fail":1}"#).await;
    let consumer = failing_consumer(idem_on(&redis.url(), Duration::from_secs(5)).await);
    let handler = async |_: Message| -> Result<(), String> { Err("no".to_owned()) };
    let adapter = place.adapter("c", Duration::ZERO).await;
    poll_until_settled(&adapter, &consumer, &handler, 1).await;
    let mut dead = Vec::new();
    support::until("the dead letter", Duration::from_secs(10), async || {
        dead.extend(place.take_dead().await);
        !dead.is_empty()
    })
    .await;
    assert!(header_text(&dead[0], "x-death").is_some());
    assert!(header_text(&dead[0], dead_letter_field::KIND).is_none());
}

// ---------------------------------------------------------- copies

/// Two copies of one message (same id and payload) handled in one batch,
/// the first run failing: each delivery tag is settled once (a second
/// settlement would close the channel), and the message is not lost: it
/// runs again and succeeds, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_one_batch_settle_once_each_and_a_failed_first_copy_loses_nothing() {
    let redis = RedisServer::start();
    let place = TestQueue::create("idem.copies").await;
    for _ in 0..2 {
        place.publish(Some("c-1"), br#"{"order":1}"#).await;
    }
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(5)).await,
        "copies",
    )
    .keys(KeySource::MessageId)
    .backoff(Duration::from_millis(20), Duration::from_millis(50));
    let (runs, charged) = (idem_testkit::Ledger::new(), idem_testkit::Ledger::new());
    let handler = async |m: Message| -> Result<(), String> {
        let id = m.id().unwrap_or("?");
        if runs.record(id) == 1 {
            return Err("first run fails".to_owned());
        }
        charged.record(id);
        Ok(())
    };
    let adapter = place.adapter("c", Duration::ZERO).await;
    // Both copies in one batch, whatever the broker's pace.
    let mut batch = Vec::new();
    support::until("both copies fetched", Duration::from_secs(10), async || {
        batch.extend(adapter.fetch().await.unwrap());
        batch.len() >= 2
    })
    .await;
    assert_eq!(batch.len(), 2);
    let decided = adapter.handle(&consumer, &handler, batch).await;
    assert!(decided[0].1.is_nack(), "{:?}", decided[0].1);
    adapter.settle(decided).await.unwrap();
    let mut total = idem_consumer::PollReport::default();
    support::until("everything settled", Duration::from_secs(20), async || {
        total.add(adapter.poll(&consumer, &handler).await.unwrap());
        charged.count("c-1") == 1 && place.drained().await
    })
    .await;
    support::assert_drained(&place).await;
    assert_eq!(charged.count("c-1"), 1, "charged once");
    assert_eq!(place.ready_in(&format!("{}.dead", place.queue)).await, 0);
    assert!(
        adapter.poll(&consumer, &handler).await.is_ok(),
        "the channel is alive"
    );
}

// ------------------------------------------------------- headers and traces

/// A W3C `traceparent` for the tests (the recommendation's example).
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The sink publishes a message's headers unchanged, as AMQP long strings
/// beside its own `idem-outbox-key`, whatever the build's features; a
/// message with a header named like the sink's own is refused and nothing
/// of it is published, the rest of the batch is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_publishes_a_messages_headers_unchanged_as_long_strings() {
    use idem_consumer::outbox::{OutboxMessage, RabbitSink, Sink, SinkError};
    let place = TestQueue::create("idem.sink.headers").await;
    let sink = RabbitSink::connect(&amqp_url()).await.unwrap();
    assert_eq!(sink.system(), "rabbitmq");
    let headers = vec![
        ("traceparent".to_owned(), TRACEPARENT.to_owned()),
        ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
        ("x-tenant".to_owned(), "acme".to_owned()),
    ];
    let batch = [
        OutboxMessage::new("h-1", place.queue.as_str(), "order-1", "{}")
            .with_headers(headers.clone()),
        OutboxMessage::new("h-2", place.queue.as_str(), "order-2", "{}")
            .with_headers(vec![("idem-outbox-key".to_owned(), "other".to_owned())]),
    ];
    let results = sink.send(&batch).await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(
        matches!(&results[1], Err(SinkError::Refused { reason, .. }) if reason.contains("idem-outbox-key")),
        "{results:?}"
    );
    let got = place
        .channel()
        .await
        .basic_get(
            place.queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the published message")
        .delivery;
    assert_eq!(
        got.properties.message_id().as_ref().map(|i| i.as_str()),
        Some("h-1")
    );
    let table = got.properties.headers().as_ref().unwrap().inner();
    for (name, value) in &headers {
        assert_eq!(
            table.get(name.as_str()),
            Some(&AMQPValue::LongString(value.as_str().into())),
            "header {name}"
        );
    }
    assert_eq!(
        header_text(&got, "idem-outbox-key").as_deref(),
        Some("order-1")
    );
    assert_eq!(
        place.ready_in(&place.queue).await,
        0,
        "the refused one was not published"
    );
}

/// With `otel`, a delivery's `traceparent` and `tracestate` reach the
/// handler unchanged whether the producer wrote them as long strings (idem's
/// sink, most clients) or byte arrays (Python's pika for `bytes` values); a
/// header of another type, or none, leaves the message without trace
/// context and handled as before.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deliverys_trace_context_reaches_the_handler_as_long_string_or_byte_array() {
    use idem_consumer::outbox::{OutboxMessage, RabbitSink, Sink};
    let place = TestQueue::create("idem.trace").await;
    let table = |traceparent: AMQPValue, tracestate: Option<AMQPValue>| {
        let mut h = FieldTable::default();
        h.insert("traceparent".into(), traceparent);
        if let Some(s) = tracestate {
            h.insert("tracestate".into(), s);
        }
        Some(h)
    };
    place
        .publish_with(
            Some("long"),
            table(AMQPValue::LongString(TRACEPARENT.into()), None),
            b"{}",
        )
        .await;
    place
        .publish_with(
            Some("bytes"),
            table(
                AMQPValue::ByteArray(TRACEPARENT.as_bytes().into()),
                Some(AMQPValue::ByteArray(b"congo=t61rcWkgMzE"[..].into())),
            ),
            b"{}",
        )
        .await;
    place
        .publish_with(
            Some("integer"),
            table(AMQPValue::LongLongInt(7), None),
            b"{}",
        )
        .await;
    place.publish(Some("none"), b"{}").await;
    // What idem's own sink writes: the same long strings.
    let sink = RabbitSink::connect(&amqp_url()).await.unwrap();
    let sent = OutboxMessage::new("sink", place.queue.as_str(), "k", "{}").with_headers(vec![
        ("traceparent".to_owned(), TRACEPARENT.to_owned()),
        ("tracestate".to_owned(), String::new()),
    ]);
    assert!(sink.send(&[sent]).await[0].is_ok());

    let redis = RedisServer::start();
    let consumer = Consumer::new(idem_on(&redis.url(), Duration::from_secs(5)).await, "trace")
        .keys(KeySource::MessageId);
    let seen = std::sync::Mutex::new(Vec::new());
    let handler = async |m: Message| -> Result<(), String> {
        seen.lock().unwrap().push((
            m.id().unwrap_or("?").to_owned(),
            m.trace_header("traceparent").map(str::to_owned),
            m.trace_header("tracestate").map(str::to_owned),
        ));
        Ok(())
    };
    let adapter = place.adapter("c", Duration::ZERO).await;
    let total = poll_until_settled(&adapter, &consumer, &handler, 5).await;
    assert_eq!(total.acked, 5, "{total:?}");
    let mut seen = seen.into_inner().unwrap();
    seen.sort();
    let tp = Some(TRACEPARENT.to_owned());
    assert_eq!(
        seen,
        [
            (
                "bytes".to_owned(),
                tp.clone(),
                Some("congo=t61rcWkgMzE".to_owned())
            ),
            ("integer".to_owned(), None, None),
            ("long".to_owned(), tp.clone(), None),
            ("none".to_owned(), None, None),
            ("sink".to_owned(), tp, Some(String::new())),
        ]
    );
}
