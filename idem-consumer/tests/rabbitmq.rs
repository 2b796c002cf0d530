//! RabbitMQ adapter against the broker on 127.0.0.1:5672 (guest/guest, or
//! `AMQP_URL`), with unique queue and exchange names per test, deleted
//! after; the restart test spawns a private node. The shared scenarios are in `support`. Ground truth is an
//! external ledger of side effects.

mod support;

use idem_consumer::Consumer;
use idem_consumer::rabbitmq::{RabbitConfig, RabbitConsumer, declare_queue};
use idem_consumer::{KeyDeriver, KeySource, Message};
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

    /// RabbitMQ keeps the message id and payload; idem's reason is in the
    /// log and the decision (the broker adds only `x-death`).
    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let mut out = Vec::new();
        let dead = format!("{}.dead", self.queue);
        let channel = self.channel().await;
        while let Some(m) = channel
            .basic_get(dead.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
        {
            let props = &m.delivery.properties;
            out.push(DeadLetter {
                id: props.message_id().as_ref().map(|i| i.to_string()),
                kind: None,
                reason: None,
                deliveries: None,
                payload: m.delivery.data.clone(),
            });
        }
        out
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
        TestQueue {
            link: tokio::sync::Mutex::new(Link::open(&url).await),
            url,
            queue: env("IDEM_RABBIT_QUEUE"),
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
