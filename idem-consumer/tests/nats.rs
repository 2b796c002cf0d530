//! NATS JetStream adapter against real servers: the machine's NATS on
//! 127.0.0.1:4222 (or `NATS_URL`) with a unique stream per test, deleted
//! after; the restart test spawns a private `nats-server -js`. The shared
//! scenarios are in `support`; progress acks and late acks are NATS's own.
//! Ground truth is an external ledger of side effects.

mod support;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, stream};
use idem_consumer::nats::{NatsConfig, NatsConsumer, pull_config};
use idem_consumer::{Adapter, PollReport};
use idem_consumer::{Consumer, KeyDeriver, KeySource, Message};
use idem_testkit::{Ledger, NatsServer, RedisServer};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use support::{DeadLetter, Place, idem_on};

// ------------------------------------------------------------------ the place

fn shared_url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// Connects, or fails the test saying why (never passes silently).
async fn js_at(url: &str) -> jetstream::Context {
    let client = tokio::time::timeout(Duration::from_secs(5), async_nats::connect(url))
        .await
        .unwrap_or_else(|_| panic!("NATS at {url} did not answer within 5 s: start `nats-server -js` (or run .ci/run, which does), or set NATS_URL"))
        .unwrap_or_else(|e| panic!("cannot connect to NATS at {url}: {e}; start `nats-server -js` (or run .ci/run), or set NATS_URL"));
    jetstream::new(client)
}

fn unique(prefix: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        idem_testkit::unix_ms() % 1_000_000_000,
        N.fetch_add(1, Ordering::SeqCst)
    )
}

fn cfg() -> NatsConfig {
    NatsConfig::new()
        .block(Duration::from_millis(200))
        .batch(16)
}

/// A stream named uniquely for one test, capturing `<name>.>` (messages on
/// `<name>.in`, dead letters on `<name>.dead`), with one durable pull
/// consumer `c`; deleted on drop by the process that created it.
struct TestStream {
    url: String,
    name: String,
    js: jetstream::Context,
    window: Duration,
    owned: bool,
}

impl TestStream {
    async fn create(url: &str, prefix: &str, duplicate_window: Duration) -> TestStream {
        let js = js_at(url).await;
        let name = unique(prefix);
        js.create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![format!("{name}.>")],
            duplicate_window,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("cannot create stream {name} at {url} (is JetStream enabled? run nats-server with -js): {e}"));
        TestStream {
            url: url.to_owned(),
            name,
            js,
            window: duplicate_window,
            owned: true,
        }
    }

    fn subject(&self, leaf: &str) -> String {
        format!("{}.{leaf}", self.name)
    }

    async fn pull(&self, durable: &str, ack_wait: Duration) -> PullConsumer {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut cfg = pull_config(durable, ack_wait);
        cfg.filter_subject = self.subject("in");
        stream.get_or_create_consumer(durable, cfg).await.unwrap()
    }

    async fn consumer_info(&self, durable: &str) -> jetstream::consumer::Info {
        let stream = self.js.get_stream(&self.name).await.unwrap();
        stream.consumer_info(durable).await.unwrap()
    }

    /// Nothing left to deliver and nothing waiting for an ack.
    async fn drained_of(&self, durable: &str) -> bool {
        let info = self.consumer_info(durable).await;
        info.num_pending == 0 && info.num_ack_pending == 0
    }
}

impl Place for TestStream {
    type Adapter = NatsConsumer;
    const WORKER_ENV: &'static str = "IDEM_NATS";

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        let mut headers = HeaderMap::new();
        if let Some(id) = id {
            headers.insert("Nats-Msg-Id", id);
        }
        self.js
            .publish_with_headers(self.subject("in"), headers, payload.to_vec().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    /// On the durable `c`, whose `ack_wait` is `redeliver_after` (set by
    /// the first adapter of the test).
    async fn adapter(&self, _: &str, redeliver_after: Duration) -> NatsConsumer {
        let pull = self.pull("c", redeliver_after).await;
        NatsConsumer::new(pull, cfg().dead_letter_subject(self.subject("dead")))
            .await
            .unwrap()
    }

    async fn drained(&self) -> bool {
        let stream = match self.js.get_stream(&self.name).await {
            Ok(s) => s,
            Err(_) => return false,
        };
        match stream.consumer_info("c").await {
            Ok(info) => info.num_pending == 0 && info.num_ack_pending == 0,
            Err(_) => false,
        }
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        use futures_util::StreamExt;
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut cfg = pull_config(&unique("dl"), Duration::from_secs(30));
        cfg.filter_subject = self.subject("dead");
        let c: PullConsumer = stream.create_consumer(cfg).await.unwrap();
        let mut out = Vec::new();
        let mut msgs = c
            .fetch()
            .max_messages(100)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        while let Some(Ok(m)) = msgs.next().await {
            let h: BTreeMap<String, String> = m
                .headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| {
                            let v = v.first().map(|x| x.to_string()).unwrap_or_default();
                            (k.to_string(), v)
                        })
                        .collect()
                })
                .unwrap_or_default();
            out.push(DeadLetter {
                id: h.get("Idem-Original-Id").cloned(),
                kind: h.get("Idem-Dead-Kind").cloned(),
                reason: h.get("Idem-Dead-Reason").cloned(),
                deliveries: h.get("Idem-Deliveries").and_then(|d| d.parse().ok()),
                payload: m.payload.to_vec(),
            });
        }
        out
    }

    /// JetStream drops a re-published `Nats-Msg-Id` inside the window.
    fn duplicate_gap(&self) -> Duration {
        self.window + Duration::from_millis(100)
    }

    fn to_env(&self) -> Vec<(String, String)> {
        vec![
            ("IDEM_NATS_URL".into(), self.url.clone()),
            ("IDEM_NATS_STREAM".into(), self.name.clone()),
        ]
    }

    async fn from_env() -> TestStream {
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
        let url = env("IDEM_NATS_URL");
        TestStream {
            js: js_at(&url).await,
            url,
            name: env("IDEM_NATS_STREAM"),
            window: Duration::ZERO,
            owned: false,
        }
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let (url, name) = (self.url.clone(), self.name.clone());
        support::clean_up_aside(async move {
            if let Ok(Ok(c)) =
                tokio::time::timeout(Duration::from_secs(2), async_nats::connect(url)).await
            {
                let _ = jetstream::new(c).delete_stream(&name).await;
            }
        });
    }
}

async fn on_shared(prefix: &str) -> TestStream {
    TestStream::create(&shared_url(), prefix, Duration::from_millis(200)).await
}

// ------------------------------------------------------------------- shared

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    support::four_tasks_run_each_order_once(on_shared("idem_once").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_terminated_and_dead_lettered_the_rest_acked() {
    support::poison_messages_are_dead_lettered_the_rest_acked(on_shared("idem_poison").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    support::store_down_nothing_runs_then_everything_once(on_shared("idem_store_down").await).await;
}

#[test]
fn worker() {
    support::worker::<TestStream>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    support::two_processes_run_every_order_once(on_shared("idem_procs").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let place = on_shared("idem_crash").await;
    support::killed_before_the_ack_the_redelivery_replays(place, Duration::from_millis(800)).await;
}

/// The dead holder's lease (1.5 s) outlives `ack_wait`: the first
/// redeliveries get `InProgress` and are nacked, then one takes over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let place = on_shared("idem_mid").await;
    support::killed_mid_handler_one_extra_run_after_the_lease(place, Duration::from_millis(500))
        .await;
}

/// A private nats-server with its store on disk: the stream and its
/// consumer survive the restart, and async-nats reconnects by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_a_broker_restart_and_processes_everything_once() {
    let mut server = NatsServer::start();
    let place = TestStream::create(&server.url(), "idem_restart", Duration::from_secs(60)).await;
    support::run_survives_a_broker_restart(&place, || {
        server.kill();
        std::thread::sleep(Duration::from_millis(500));
        server.restart();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    // Payload-derived keys: a payload that is not JSON, an empty one.
    let by_payload = on_shared("idem_bad_payload").await;
    by_payload.publish(None, b"\xff not json").await;
    by_payload.publish(None, b"").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_payload,
        KeySource::Payload(KeyDeriver::new()),
        &["not valid JSON", "not valid JSON"],
    )
    .await;
    // Id keys: no id, a 10 KB id.
    let by_id = on_shared("idem_bad_id").await;
    by_id.publish(None, b"{}").await;
    by_id.publish(Some(&"x".repeat(10 * 1024)), b"{}").await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_id,
        KeySource::MessageId,
        &["no message id", "10240 bytes"],
    )
    .await;
}

// ------------------------------------------------------------- NATS's own

/// A handler slower than `ack_wait`: progress acks keep the message from
/// being redelivered; without them, the redelivery gets `InProgress`, is
/// nacked with a delay, and the late ack of the first delivery (after
/// `ack_wait`) still settles the message. The side effect runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handlers_send_progress_or_the_redelivery_is_nacked_and_the_late_ack_settles_it() {
    let redis = RedisServer::start();
    for progress in [true, false] {
        let s = TestStream::create(&shared_url(), "idem_slow", Duration::from_secs(60)).await;
        s.publish(Some("s-1"), br#"{"n":1}"#).await;
        let consumer = Consumer::new(
            idem_on(&redis.url(), Duration::from_secs(6)).await,
            &unique("slow"),
        )
        .backoff(Duration::from_millis(100), Duration::from_millis(300));
        let ack_wait = Duration::from_millis(900);
        let a = NatsConsumer::new(s.pull("slow", ack_wait).await, cfg().progress(progress))
            .await
            .unwrap();
        let b = NatsConsumer::new(s.pull("slow", ack_wait).await, cfg().progress(progress))
            .await
            .unwrap();
        let ledger = Ledger::new();
        let ledger_ref = &ledger;
        let slow = |m: Message| async move {
            ledger_ref.record(m.id().unwrap_or("?"));
            tokio::time::sleep(Duration::from_millis(2500)).await;
            Ok::<_, String>(())
        };
        let (ra, rb) = tokio::join!(async { a.poll(&consumer, &slow).await.unwrap() }, async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut total = PollReport::default();
            let end = Instant::now() + Duration::from_secs(8);
            while Instant::now() < end {
                total.add(b.poll(&consumer, &slow).await.unwrap());
                if s.drained_of("slow").await {
                    break;
                }
            }
            total
        });
        assert_eq!(
            ledger.count("s-1"),
            1,
            "progress={progress}: a {ra:?} b {rb:?}"
        );
        assert!(s.drained_of("slow").await, "progress={progress}: settled");
        if progress {
            assert_eq!(
                (s.consumer_info("slow").await.num_redelivered, rb.fetched),
                (0, 0),
                "no redelivery: b {rb:?}"
            );
        } else {
            assert!(
                rb.nacked >= 1,
                "the redelivery was nacked while the first ran: {rb:?}"
            );
        }
    }
}
