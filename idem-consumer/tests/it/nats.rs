//! NATS JetStream adapter against real servers: the machine's NATS on
//! 127.0.0.1:4222 (or `NATS_URL`) with a unique stream per test, deleted
//! after; the restart test spawns a private `nats-server -js`. The shared
//! scenarios are in `support`; progress acks and late acks are NATS's own.
//! Ground truth is an external ledger of side effects.

use crate::support;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, stream};
use idem_consumer::nats::{NatsConfig, NatsConsumer, NatsDelivery, pull_config};
use idem_consumer::{Adapter, ConsumerError, Decision, PollReport, dead_letter_field};
use idem_consumer::{Consumer, ErrorClass, KeyDeriver, KeySource, Message};
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

    /// Every dead letter on `<name>.dead` so far: its headers (first value
    /// of each) and payload.
    async fn dead_letters_with_headers(&self) -> Vec<(BTreeMap<String, String>, Vec<u8>)> {
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
            let h = m
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
            out.push((h, m.payload.to_vec()));
        }
        out
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
    const WORKER_TEST: &'static str = "nats::worker";

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
        self.dead_letters_with_headers()
            .await
            .into_iter()
            .map(|(h, payload)| DeadLetter {
                id: h.get("Idem-Original-Id").cloned(),
                kind: h.get(dead_letter_field::KIND).cloned(),
                reason: h.get(dead_letter_field::REASON).cloned(),
                deliveries: h
                    .get(dead_letter_field::DELIVERIES)
                    .and_then(|d| d.parse().ok()),
                payload,
            })
            .collect()
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

/// Idle heartbeats (off by default): the server accepts them, an idle
/// subscription keeps polling without a missed-heartbeat error for many
/// heartbeats, and the next message is handled once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_heartbeats_keep_an_idle_subscription_polling_then_a_message_runs_once() {
    let redis = RedisServer::start();
    let s = on_shared("idem_heartbeat").await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(6)).await,
        &unique("heartbeat"),
    );
    let nats = NatsConsumer::new(
        s.pull("c", Duration::from_secs(30)).await,
        cfg().idle_heartbeat(Some(Duration::from_millis(100))),
    )
    .await
    .unwrap();
    let ledger = Ledger::new();
    let ledger_ref = &ledger;
    let handler = |m: Message| async move {
        ledger_ref.record(m.id().unwrap_or("?"));
        Ok::<_, String>(())
    };
    // Ten heartbeats' worth of polls (200 ms each) with nothing to deliver.
    let idle_until = Instant::now() + Duration::from_secs(1);
    while Instant::now() < idle_until {
        let report = nats.poll(&consumer, &handler).await;
        assert_eq!(report.map(|r| r.fetched).ok(), Some(0), "an idle poll");
    }
    s.publish(Some("h-1"), br#"{"n":1}"#).await;
    let mut acked = 0;
    let end = Instant::now() + Duration::from_secs(10);
    while acked == 0 && Instant::now() < end {
        acked += nats.poll(&consumer, &handler).await.unwrap().acked;
    }
    assert_eq!((acked, ledger.count("h-1")), (1, 1));
    assert!(s.drained_of("c").await, "settled");
}

/// A consumer SIGKILLed 12 times 0.3–0.8 s apart; every
/// redelivery after `ack_wait` spends a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let place = on_shared("idem_loop").await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, Duration::from_millis(500))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_batch_in_flight_finish_and_settles_it() {
    support::shutdown_drains_the_batch_in_flight(on_shared("idem_drain").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_abandoned_at_the_drain_deadline_keeps_its_key_until_the_lease() {
    let place = on_shared("idem_abandon").await;
    support::shutdown_past_the_deadline_keeps_the_key_until_the_lease(place).await;
}

/// With a stream on `<name>.>`, a consumer without a
/// filter and dead letters to `<name>.dead`, every dead letter came back
/// as a new message (2 poison messages made 6,850 dead letters in 8 s).
/// Such a subject is refused, by both constructors; one outside the
/// consumer's filter or in another stream is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_subject_the_consumer_would_receive_is_refused() {
    let s = on_shared("idem_dl_loop").await;
    let other = on_shared("idem_dl_other").await;
    let stream = s.js.get_stream(&s.name).await.unwrap();
    let consumer = |durable: &str, filter: &str| {
        let mut cfg = pull_config(durable, Duration::from_secs(30));
        cfg.filter_subject = filter.to_owned();
        let stream = stream.clone();
        async move { stream.create_consumer(cfg).await.unwrap() as PullConsumer }
    };
    let unfiltered = consumer("all", "").await;
    let wildcard = consumer("wild", &s.subject("*")).await;
    let filtered = consumer("in", &s.subject("in")).await;
    let dead = s.subject("dead");
    let config_error = |r: Result<NatsConsumer, ConsumerError>| match r {
        Err(ConsumerError::Config(why)) => why,
        other => panic!("expected a configuration error, got {other:?}"),
    };
    for (pull, what) in [(&unfiltered, "no filter"), (&wildcard, "`*`")] {
        let why = config_error(
            NatsConsumer::with_jetstream(&s.js, pull.clone(), cfg().dead_letter_subject(&dead))
                .await,
        );
        assert!(
            why.contains("forever") && why.contains("filter_subject"),
            "{what}: {why}"
        );
        // Without the stream's subjects: refused as well, saying why.
        let why =
            config_error(NatsConsumer::new(pull.clone(), cfg().dead_letter_subject(&dead)).await);
        assert!(why.contains("filter_subject"), "{what}: {why}");
    }
    // Outside the filter, in the same stream: accepted.
    for pull in [&filtered] {
        NatsConsumer::new(pull.clone(), cfg().dead_letter_subject(&dead))
            .await
            .unwrap();
        NatsConsumer::with_jetstream(&s.js, pull.clone(), cfg().dead_letter_subject(&dead))
            .await
            .unwrap();
    }
    // In another stream: even the unfiltered consumer never sees it.
    NatsConsumer::with_jetstream(
        &s.js,
        unfiltered.clone(),
        cfg().dead_letter_subject(other.subject("dead")),
    )
    .await
    .unwrap();
    // No stream captures it: every dead letter would fail to publish.
    let nowhere = format!("{}.dead", unique("idem_nowhere"));
    let why = config_error(
        NatsConsumer::with_jetstream(&s.js, filtered.clone(), cfg().dead_letter_subject(&nowhere))
            .await,
    );
    assert!(why.contains("no JetStream stream captures"), "{why}");
    // A wildcard cannot be published to.
    let why = config_error(
        NatsConsumer::new(filtered.clone(), cfg().dead_letter_subject(s.subject(">"))).await,
    );
    assert!(why.contains("wildcard"), "{why}");
}

/// Fetches until one batch holds at least two deliveries of each of
/// `messages` stream messages: with progress acks off and a short
/// `ack_wait`, the server redelivers what sits unacked in the client's
/// buffer. A batch short of that is dropped unsettled, so it comes back.
async fn batch_with_redeliveries(a: &NatsConsumer, messages: usize) -> Vec<NatsDelivery> {
    for _ in 0..20 {
        tokio::time::sleep(a.ack_wait() * 2).await;
        let batch = a.fetch().await.unwrap();
        let mut per_sequence: BTreeMap<u64, usize> = BTreeMap::new();
        for m in &batch {
            // What the adapter read once at fetch is what the ack subject says.
            let info = m.info().unwrap();
            assert_eq!(m.stream_sequence(), Some(info.stream_sequence));
            assert_eq!(
                u64::from(m.delivered()),
                u64::try_from(info.delivered).unwrap()
            );
            *per_sequence.entry(info.stream_sequence).or_default() += 1;
        }
        if per_sequence.len() == messages && per_sequence.values().all(|&n| n >= 2) {
            return batch;
        }
    }
    panic!("no batch held two deliveries of each message in 20 tries");
}

/// A batch that outlives `ack_wait` is followed by
/// a fetch holding the first delivery of a message and its redelivery,
/// the same stream message. The core gives the copy the first's decision;
/// the adapter settles the stream sequence once. Before, a copy was acked
/// whatever the first's decision: the nacked message was removed, never
/// retried (lost), and a dead letter per delivery was published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_of_one_stream_message_in_one_batch_settle_once_neither_lost_nor_doubled() {
    let redis = RedisServer::start();
    let s = on_shared("idem_same_batch").await;
    let adapter = async || {
        NatsConsumer::new(
            s.pull("c", Duration::from_millis(300)).await,
            cfg().progress(false).dead_letter_subject(s.subject("dead")),
        )
        .await
        .unwrap()
    };
    let a = adapter().await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(6)).await,
        &unique("same_batch"),
    )
    .classify(|e: &String| ErrorClass::from_retryable(!e.starts_with("permanent")))
    .backoff(Duration::from_millis(50), Duration::from_millis(100));
    // Opens the pull subscription, so that what is published next waits
    // in the client's buffer and is redelivered there.
    assert!(a.fetch().await.unwrap().is_empty());
    s.publish(Some("flaky"), br#"{"n":1}"#).await;
    s.publish(Some("poison"), br#"{"n":2}"#).await;
    let effects = Ledger::new();
    let attempts = Ledger::new();
    let (effects_ref, attempts_ref) = (&effects, &attempts);
    let handler = |m: Message| async move {
        let id = m.id().unwrap_or("?").to_owned();
        let attempt = attempts_ref.record(&id);
        match id.as_str() {
            "poison" => Err("permanent: card declined".to_owned()),
            "flaky" if attempt == 1 => Err("payment provider timed out".to_owned()),
            _ => {
                effects_ref.record(&id);
                Ok(())
            }
        }
    };
    let batch = batch_with_redeliveries(&a, 2).await;
    // Handed back as messages fetched by other means would be.
    let batch: Vec<NatsDelivery> = batch
        .into_iter()
        .map(|d| NatsDelivery::from(d.into_message()))
        .collect();
    let decided = a.handle(&consumer, &handler, batch).await;
    let flaky_decisions: Vec<&Decision> = decided
        .iter()
        .filter(|(m, _)| a.message_of(m).unwrap().id() == Some("flaky"))
        .map(|(_, d)| d)
        .collect();
    assert!(flaky_decisions.len() >= 2, "{flaky_decisions:?}");
    a.settle(decided).await.unwrap();
    // Redeliveries sent to `a` after its fetch are stale now: with its
    // subscription gone they are never handled; what was nacked comes
    // back to `b`.
    drop(a);
    let b = adapter().await;
    let end = Instant::now() + Duration::from_secs(15);
    while !s.drained_of("c").await && Instant::now() < end {
        b.poll(&consumer, &handler).await.unwrap();
    }
    assert!(s.drained_of("c").await, "everything settled");
    assert_eq!(
        effects.count("flaky"),
        1,
        "retried once after the nack, run once"
    );
    assert_eq!(
        attempts.count("poison"),
        1,
        "dead-lettered at its first run"
    );
    let dead = s.dead_letters().await;
    assert_eq!(
        dead.len(),
        1,
        "one dead letter per stream message: {dead:?}"
    );
    assert_eq!(dead[0].id.as_deref(), Some("poison"));
    assert_eq!(dead[0].kind.as_deref(), Some("permanent"));
    // Settled on the latest delivery: the count says it was redelivered.
    assert!(dead[0].deliveries.is_some_and(|n| n >= 2), "{:?}", dead[0]);
}

/// A dead letter carries idem's fields under the names
/// every broker uses (`dead_letter_field`), plus its original id and
/// where it came from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_carry_the_shared_reason_kind_and_count_fields() {
    let redis = RedisServer::start();
    let s = on_shared("idem_dl_fields").await;
    let a = s.adapter("a", Duration::from_secs(30)).await;
    let consumer = Consumer::new(
        idem_on(&redis.url(), Duration::from_secs(6)).await,
        &unique("dl_fields"),
    )
    .max_failures(2)
    .backoff(Duration::from_millis(20), Duration::from_millis(20));
    s.publish(Some("f-1"), br#"{"n":1}"#).await;
    let runs = Ledger::new();
    let failing = |m: Message| {
        runs.record(m.id().unwrap_or("?"));
        async { Err::<(), _>("payment provider\ntimed out".to_owned()) }
    };
    let end = Instant::now() + Duration::from_secs(15);
    while !s.drained_of("c").await && Instant::now() < end {
        a.poll(&consumer, &failing).await.unwrap();
    }
    assert_eq!(runs.count("f-1"), 2);
    let dead = s.dead_letters_with_headers().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let (h, payload) = &dead[0];
    let field = |name: &str| h.get(name).map(String::as_str);
    assert_eq!(
        field(dead_letter_field::KIND),
        Some("max_failures"),
        "{h:?}"
    );
    assert_eq!(field(dead_letter_field::FAILURES), Some("2"), "{h:?}");
    assert_eq!(field(dead_letter_field::DELIVERIES), Some("2"), "{h:?}");
    let reason = field(dead_letter_field::REASON).unwrap_or_default();
    assert!(reason.contains("payment provider timed out"), "{h:?}");
    assert_eq!(field("Idem-Original-Id"), Some("f-1"), "{h:?}");
    assert_eq!(field("Idem-Source"), Some(format!("{}/c", s.name).as_str()));
    assert_eq!(payload.as_slice(), br#"{"n":1}"#);
}

/// A message whose ack subject cannot be read (none at all, as a message
/// not delivered by a JetStream consumer has): one delivery, no position,
/// its id from the header as usual; settling it fails with the broker's
/// error, not a panic, and the batch's other decisions are still sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_an_ack_subject_is_one_delivery_and_its_settling_fails_cleanly() {
    let s = TestStream::create(&shared_url(), "noreply", Duration::from_secs(120)).await;
    let a = s.adapter("a", Duration::from_secs(30)).await;
    let mut headers = HeaderMap::new();
    headers.insert(async_nats::header::NATS_MESSAGE_ID, "x-1");
    let stray = NatsDelivery::from(jetstream::Message {
        message: async_nats::Message {
            subject: s.subject("in").into(),
            reply: None,
            payload: "{}".into(),
            headers: Some(headers),
            status: None,
            description: None,
            length: 2,
        },
        context: s.js.clone(),
    });
    assert_eq!((stray.stream_sequence(), stray.delivered()), (None, 1));
    let m = a.message_of(&stray).unwrap();
    assert_eq!(
        (m.id(), m.delivery_count(), m.position()),
        (Some("x-1"), 1, None)
    );

    s.js.publish(s.subject("in"), "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let fetched = a.fetch().await.unwrap();
    assert_eq!(fetched.len(), 1);
    let mut decided: Vec<(NatsDelivery, Decision)> =
        fetched.into_iter().map(|d| (d, Decision::Ack)).collect();
    decided.insert(0, (stray, Decision::Ack));
    let e = a.apply_batch(&decided).await.unwrap_err();
    assert!(matches!(e, ConsumerError::Broker { op: "ack", .. }), "{e}");
    // The real message behind the stray one was acked all the same.
    let end = Instant::now() + Duration::from_secs(5);
    while !s.drained().await && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(s.drained().await, "the fetched message was acked");
}

// ------------------------------------------------------------ trace context

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const TRACESTATE: &str = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7";

impl TestStream {
    /// Every message on `<name>.in` so far, read by a plain JetStream
    /// consumer of its own: headers and payload.
    async fn raw_messages(&self) -> Vec<(HeaderMap, Vec<u8>)> {
        use futures_util::StreamExt;
        let stream = self.js.get_stream(&self.name).await.unwrap();
        let mut cfg = pull_config(&unique("raw"), Duration::from_secs(30));
        cfg.filter_subject = self.subject("in");
        let c: PullConsumer = stream.create_consumer(cfg).await.unwrap();
        let mut msgs = c
            .fetch()
            .max_messages(100)
            .expires(Duration::from_millis(500))
            .messages()
            .await
            .unwrap();
        let mut out = Vec::new();
        while let Some(Ok(m)) = msgs.next().await {
            out.push((m.headers.clone().unwrap_or_default(), m.payload.to_vec()));
        }
        out
    }
}

/// The values of header `name` exactly as a NATS client reads them (by
/// the parsed name: a received `Nats-Msg-Id` is a well-known one).
fn values(h: &HeaderMap, name: &str) -> Vec<String> {
    let name: async_nats::header::HeaderName = name.parse().unwrap();
    h.get_all(name).map(|v| v.as_str().to_owned()).collect()
}

/// What `NatsSink` publishes carries each stored header under its name as
/// given (lower case stays lower case, a repeated name keeps both values
/// in order), byte for byte, beside `Nats-Msg-Id` and `Idem-Outbox-Key`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_publishes_the_stored_headers_unchanged() {
    use idem_consumer::outbox::{NatsSink, OutboxMessage, Sink};
    let s = on_shared("idem_sink_headers").await;
    let sink = NatsSink::new(s.js.clone());
    assert_eq!(sink.system(), "nats");
    let stored: Vec<(String, String)> = [
        ("traceparent", TRACEPARENT),
        ("tracestate", TRACESTATE),
        ("x-hop", "first é"),
        ("x-hop", "second"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let m = OutboxMessage::new("id-h", s.subject("in"), "k-1", r#"{"n":1}"#).with_headers(stored);
    for r in sink.send(&[m]).await {
        r.unwrap();
    }
    let got = s.raw_messages().await;
    assert_eq!(got.len(), 1);
    let (h, payload) = &got[0];
    assert_eq!(payload, br#"{"n":1}"#);
    assert_eq!(values(h, "traceparent"), [TRACEPARENT]);
    assert_eq!(values(h, "tracestate"), [TRACESTATE]);
    assert_eq!(values(h, "x-hop"), ["first é", "second"]);
    assert_eq!(
        values(h, "Traceparent"),
        Vec::<String>::new(),
        "name kept lower case"
    );
    assert_eq!(values(h, "Nats-Msg-Id"), ["id-h"]);
    assert_eq!(values(h, "Idem-Outbox-Key"), ["k-1"]);
    let names: usize = h.iter().map(|(_, v)| v.len()).sum();
    assert_eq!(names, 6, "nothing else: {h:?}");
}

/// A stored header NATS cannot carry unchanged (a colon in the name, a
/// line break in the value) refuses its message alone, and the
/// connection stays usable: the others of the batch are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_sink_refuses_a_message_whose_header_nats_cannot_carry_and_only_it() {
    use idem_consumer::outbox::{NatsSink, OutboxMessage, Sink, SinkError};
    let s = on_shared("idem_sink_bad_header").await;
    let sink = NatsSink::new(s.js.clone());
    let m = |i: usize, headers: &[(&str, &str)]| {
        OutboxMessage::new(format!("id-{i}"), s.subject("in"), format!("k-{i}"), "{}").with_headers(
            headers
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    };
    let batch = [
        m(0, &[("traceparent", TRACEPARENT)]),
        m(1, &[("x:y", "v")]),
        m(2, &[("x-note", "a\r\nNats-Msg-Id: forged")]),
        m(3, &[("x note", "v")]),
        m(4, &[]),
    ];
    let results = sink.send(&batch).await;
    assert_eq!(results.len(), 5);
    for (i, r) in results.iter().enumerate() {
        if matches!(i, 1..=3) {
            assert!(matches!(r, Err(SinkError::Refused { .. })), "{i}: {r:?}");
        } else {
            assert!(r.is_ok(), "{i}: {r:?}");
        }
    }
    let mut ids: Vec<String> = s
        .raw_messages()
        .await
        .iter()
        .flat_map(|(h, _)| values(h, "Nats-Msg-Id"))
        .collect();
    ids.sort();
    assert_eq!(ids, ["id-0", "id-4"]);
}

/// With `otel`, the adapter hands the handler the message's `traceparent`
/// and `tracestate`, read by their exact (case-sensitive) names: a
/// `Traceparent` header is not one, and a message without them is handled
/// as before, with none.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handler_sees_the_traceparent_by_its_exact_name_only() {
    use idem_core::{Idempotency, MemoryStore};
    let s = on_shared("idem_trace").await;
    let publish = |id: &'static str, trace: &'static [(&'static str, &'static str)]| {
        let js = s.js.clone();
        let subject = s.subject("in");
        async move {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", id);
            for (k, v) in trace {
                headers.insert(*k, *v);
            }
            js.publish_with_headers(subject, headers, "{}".into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
    };
    publish(
        "t-1",
        &[("traceparent", TRACEPARENT), ("tracestate", TRACESTATE)],
    )
    .await;
    publish("t-2", &[("Traceparent", TRACEPARENT)]).await;
    publish("t-3", &[]).await;
    let consumer = Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "trace");
    let nats = s.adapter("c", Duration::from_secs(30)).await;
    let seen = std::sync::Mutex::new(BTreeMap::new());
    let handle = |m: Message| {
        let seen = &seen;
        async move {
            let trace = (
                m.trace_header("traceparent").map(str::to_owned),
                m.trace_header("tracestate").map(str::to_owned),
            );
            seen.lock()
                .unwrap()
                .insert(m.id().unwrap_or("?").to_owned(), trace);
            Ok::<_, String>(())
        }
    };
    let mut acked = 0;
    let end = Instant::now() + Duration::from_secs(10);
    while acked < 3 && Instant::now() < end {
        acked += nats.poll(&consumer, &handle).await.unwrap().acked;
    }
    assert_eq!(acked, 3);
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        seen.get("t-1"),
        Some(&(Some(TRACEPARENT.to_owned()), Some(TRACESTATE.to_owned())))
    );
    assert_eq!(
        seen.get("t-2"),
        Some(&(None, None)),
        "`Traceparent` is not `traceparent`"
    );
    assert_eq!(seen.get("t-3"), Some(&(None, None)));
}

/// A dead letter keeps the producer's trace context: the original's
/// `traceparent` and `tracestate` headers go with it, whatever the build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_the_originals_trace_headers() {
    use idem_core::{Idempotency, MemoryStore};
    let s = on_shared("idem_dl_trace").await;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", "d-1");
    headers.insert("traceparent", TRACEPARENT);
    headers.insert("tracestate", TRACESTATE);
    s.js.publish_with_headers(s.subject("in"), headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let consumer =
        Consumer::new(Idempotency::builder(MemoryStore::new()).build(), "dl_trace").max_failures(1);
    let a = s.adapter("c", Duration::from_secs(30)).await;
    let failing = |_: Message| async { Err::<(), _>("refused".to_owned()) };
    let end = Instant::now() + Duration::from_secs(15);
    while !s.drained_of("c").await && Instant::now() < end {
        a.poll(&consumer, &failing).await.unwrap();
    }
    let dead = s.dead_letters_with_headers().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let (h, _) = &dead[0];
    assert_eq!(
        h.get("traceparent").map(String::as_str),
        Some(TRACEPARENT),
        "{h:?}"
    );
    assert_eq!(
        h.get("tracestate").map(String::as_str),
        Some(TRACESTATE),
        "{h:?}"
    );
    assert_eq!(h.get("Idem-Original-Id").map(String::as_str), Some("d-1"));
}
