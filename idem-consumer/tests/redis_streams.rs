//! Redis Streams adapter against real redis-server processes (spawned by
//! idem-testkit): the shared scenarios of `support` (exactly once under
//! duplicates, tasks and processes, crashes, poison messages, a store
//! outage, bad input, a broker restart) and what is Redis's own (re-claims
//! while a slow handler runs). Ground truth is an external ledger.

mod support;

use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem_consumer::{Adapter, PollReport};
use idem_consumer::{Consumer, KeyDeriver, KeySource, Message};
use idem_testkit::{Ledger, RedisServer};
use redis::Value;
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use support::{DeadLetter, Place, idem_on};

// ------------------------------------------------------------------ the place

/// One stream (consumer group `g`) on a Redis; dead letters to `<stream>:dead`.
struct Stream {
    url: String,
    name: String,
    conn: ConnectionManager,
}

impl Stream {
    async fn on(url: &str, name: &str) -> Stream {
        let client = redis::Client::open(url).unwrap();
        let conn = ConnectionManager::new(client).await.unwrap();
        Stream {
            url: url.to_owned(),
            name: name.to_owned(),
            conn,
        }
    }

    fn cfg(&self, consumer: &str) -> StreamsConfig {
        StreamsConfig::new(&self.name, "g", consumer)
            .block(Duration::from_millis(100))
            .batch(16)
    }

    /// Adds an entry with exactly these fields (retrying while the
    /// connection comes back after a restart).
    async fn xadd(&self, fields: &[(&str, &[u8])]) {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&self.name).arg("*");
        for (k, v) in fields {
            cmd.arg(*k).arg(*v);
        }
        let mut tries = 0;
        while let Err(e) = cmd.query_async::<String>(&mut self.conn.clone()).await {
            tries += 1;
            assert!(tries < 50, "XADD to {} failed: {e}", self.name);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Place for Stream {
    type Adapter = RedisStreamsConsumer;
    const WORKER_ENV: &'static str = "IDEM_STREAMS";

    async fn publish(&self, id: Option<&str>, payload: &[u8]) {
        match id {
            Some(id) => {
                self.xadd(&[("payload", payload), ("id", id.as_bytes())])
                    .await
            }
            None => self.xadd(&[("payload", payload)]).await,
        }
    }

    async fn adapter(&self, name: &str, redeliver_after: Duration) -> RedisStreamsConsumer {
        let s =
            RedisStreamsConsumer::connect(&self.url, self.cfg(name).claim_idle(redeliver_after))
                .await
                .unwrap();
        s.ensure_group().await.unwrap();
        s
    }

    /// Nothing pending and nothing unread in the group (false while the
    /// stream or group does not exist, as after a restart).
    async fn drained(&self) -> bool {
        let groups: redis::RedisResult<Vec<HashMap<String, Value>>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.name)
            .query_async(&mut self.conn.clone())
            .await;
        groups.unwrap_or_default().iter().any(|g| {
            matches!(g.get("name"), Some(Value::BulkString(b)) if b == b"g")
                && matches!(g.get("pending"), Some(Value::Int(0)))
                && matches!(g.get("lag"), Some(Value::Int(0)))
        })
    }

    async fn dead_letters(&self) -> Vec<DeadLetter> {
        let entries: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(format!("{}:dead", self.name))
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        let text = |f: &HashMap<String, Vec<u8>>, k: &str| {
            f.get(k).map(|v| String::from_utf8_lossy(v).into_owned())
        };
        entries
            .into_iter()
            .map(|(_, f)| DeadLetter {
                id: text(&f, "id"),
                kind: text(&f, "kind"),
                reason: text(&f, "reason"),
                deliveries: text(&f, "deliveries").and_then(|d| d.parse().ok()),
                payload: f.get("payload").cloned().unwrap_or_default(),
            })
            .collect()
    }

    fn to_env(&self) -> Vec<(String, String)> {
        vec![
            ("IDEM_STREAMS_URL".into(), self.url.clone()),
            ("IDEM_STREAMS_NAME".into(), self.name.clone()),
        ]
    }

    async fn from_env() -> Stream {
        let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("worker: {k} not set"));
        Stream::on(&env("IDEM_STREAMS_URL"), &env("IDEM_STREAMS_NAME")).await
    }
}

// ------------------------------------------------------------------- shared

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_tasks_duplicates_and_republishes_run_each_order_once_and_ack_everything() {
    let server = RedisServer::start();
    support::four_tasks_run_each_order_once(Stream::on(&server.url(), "orders").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_and_the_rest_of_the_batch_is_acked() {
    let server = RedisServer::start();
    support::poison_messages_are_dead_lettered_the_rest_acked(
        Stream::on(&server.url(), "jobs").await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_nothing_runs_everything_nacked_then_processed_exactly_once() {
    let server = RedisServer::start();
    support::store_down_nothing_runs_then_everything_once(Stream::on(&server.url(), "s").await)
        .await;
}

#[test]
fn worker() {
    support::worker::<Stream>();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_of_two_consumers_each_run_every_order_once() {
    let server = RedisServer::start();
    support::two_processes_run_every_order_once(Stream::on(&server.url(), "orders").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_the_side_effect_before_the_ack_the_redelivery_replays_and_acks() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "orders").await;
    support::killed_before_the_ack_the_redelivery_replays(place, Duration::from_millis(200)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_handler_the_redelivery_takes_over_after_the_lease_with_one_extra_run() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "orders").await;
    support::killed_mid_handler_one_extra_run_after_the_lease(place, Duration::from_millis(200))
        .await;
}

/// The restarted Redis has no stream and no group (no persistence): `run`
/// recreates its group and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_survives_a_broker_restart_and_recreates_its_group() {
    let mut broker = RedisServer::start();
    let place = Stream::on(&broker.url(), "r").await;
    support::run_survives_a_broker_restart(&place, || {
        broker.kill();
        std::thread::sleep(Duration::from_millis(300));
        broker.restart();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_dead_lettered_with_its_reason_and_runs_nothing() {
    let server = RedisServer::start();
    // Payload-derived keys: a payload that is not JSON, an entry without payload.
    let by_payload = Stream::on(&server.url(), "in").await;
    by_payload.publish(None, b"\xff not json").await;
    by_payload.xadd(&[("body", b"x")]).await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_payload,
        KeySource::Payload(KeyDeriver::new()),
        &["not valid JSON", "no `payload` field"],
    )
    .await;
    // Id keys: empty, 10 KB and non-UTF-8 ids.
    let by_id = Stream::on(&server.url(), "ids").await;
    by_id.publish(Some(""), b"{}").await;
    by_id.publish(Some(&"x".repeat(10 * 1024)), b"{}").await;
    by_id.xadd(&[("payload", b"{}"), ("id", b"\xff\xfe")]).await;
    support::bad_input_is_dead_lettered_and_runs_nothing(
        &by_id,
        KeySource::MessageId,
        &["empty", "10240 bytes", "not UTF-8"],
    )
    .await;
}

// ------------------------------------------------------------ Redis's own

/// A handler slower than the idle time: with the owner re-claiming its
/// entry nobody else gets it; without, the other consumer takes it over,
/// gets `InProgress` and nacks until the first finishes and acks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_handlers_keep_their_entries_or_the_duplicate_waits_for_a_replay() {
    for keep in [true, false] {
        let server = RedisServer::start();
        let url = server.url();
        let place = Stream::on(&url, "slow").await;
        place.publish(Some("s-1"), br#"{"n":1}"#).await;
        let idem = idem_on(&url, Duration::from_secs(3)).await;
        let consumer = Consumer::new(idem, "slow")
            .backoff(Duration::from_millis(20), Duration::from_millis(50));
        let config = |name: &str| {
            place
                .cfg(name)
                .claim_idle(Duration::from_millis(200))
                .keep_claimed(keep)
        };
        let a = RedisStreamsConsumer::connect(&url, config("a"))
            .await
            .unwrap();
        let b = RedisStreamsConsumer::connect(&url, config("b"))
            .await
            .unwrap();
        a.ensure_group().await.unwrap();
        let ledger = Ledger::new();
        let b_runs = AtomicUsize::new(0);
        let slow = async |m: Message| -> Result<(), String> {
            ledger.record(m.id().unwrap_or("?"));
            tokio::time::sleep(Duration::from_millis(1200)).await;
            Ok(())
        };
        let counting = async |m: Message| -> Result<(), String> {
            b_runs.fetch_add(1, Ordering::SeqCst);
            ledger.record(m.id().unwrap_or("?"));
            Ok(())
        };
        let stop = AtomicBool::new(false);
        let (ra, rb) = tokio::join!(
            async {
                let r = a.poll(&consumer, &slow).await.unwrap();
                // Keep polling so a's own nacked entry can come back to it.
                tokio::time::sleep(Duration::from_millis(100)).await;
                r
            },
            async {
                // Let a take the entry first.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let mut total = PollReport::default();
                let end = std::time::Instant::now() + Duration::from_secs(4);
                while std::time::Instant::now() < end && !stop.load(Ordering::SeqCst) {
                    let r = b.poll(&consumer, &counting).await.unwrap();
                    total.redelivered += r.redelivered;
                    total.acked += r.acked;
                    total.nacked += r.nacked;
                    if place.drained().await {
                        break;
                    }
                }
                total
            }
        );
        // a's XACK settles the entry whoever holds it now. Without the
        // owner's re-claims, b may also get its nacked copy back after a
        // completed and ack it as a replay (XACK is idempotent): the side
        // effect still ran once (ledger, below).
        assert_eq!(ra.acked, 1, "keep={keep}: a {ra:?} b {rb:?}");
        let b_acks = if keep { 0..=0 } else { 0..=1 };
        assert!(b_acks.contains(&rb.acked), "keep={keep}: a {ra:?} b {rb:?}");
        if keep {
            assert_eq!(
                rb.redelivered, 0,
                "the owner's re-claims kept b off its entry"
            );
        } else {
            assert!(
                rb.redelivered >= 1 && rb.nacked >= 1,
                "b took over, got InProgress, nacked: {rb:?}"
            );
        }
        assert!(place.drained().await);
        assert_eq!(ledger.count("s-1"), 1, "keep={keep}");
        assert_eq!(b_runs.load(Ordering::SeqCst), 0);
    }
}
