//! Redis Streams adapter against real redis-server processes (spawned by
//! idem-testkit): the shared scenarios of `support` (exactly once under
//! duplicates, tasks and processes, crashes, poison messages, a store
//! outage, bad input, a broker restart) and what is Redis's own (re-claims
//! while a slow handler runs). Ground truth is an external ledger.

use crate::support;

use idem_consumer::redis_streams::{RedisStreamsConsumer, StreamsConfig};
use idem_consumer::{
    Adapter, DeadLetterReason, Decision, ErrorClass, PollReport, dead_letter_field,
};
use idem_consumer::{Consumer, KeyDeriver, KeySource, Message};
use idem_testkit::{Ledger, RedisServer};
use redis::Value;
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
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

    /// Entry ids pending in group `g`.
    async fn pending(&self) -> Vec<String> {
        let rows: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(&self.name)
            .arg("g")
            .arg("-")
            .arg("+")
            .arg(100)
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        rows.into_iter().map(|(id, ..)| id).collect()
    }

    /// The dead-letter stream's entries, each as its fields.
    async fn dead_entries(&self) -> Vec<HashMap<String, String>> {
        let entries: Vec<(String, HashMap<String, Vec<u8>>)> = redis::cmd("XRANGE")
            .arg(format!("{}:dead", self.name))
            .arg("-")
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await
            .unwrap();
        entries
            .into_iter()
            .map(|(_, f)| {
                f.into_iter()
                    .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
                    .collect()
            })
            .collect()
    }
}

impl Place for Stream {
    type Adapter = RedisStreamsConsumer;
    const WORKER_ENV: &'static str = "IDEM_STREAMS";
    const WORKER_TEST: &'static str = "redis_streams::worker";

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
                kind: text(&f, dead_letter_field::KIND),
                reason: text(&f, dead_letter_field::REASON),
                deliveries: text(&f, dead_letter_field::DELIVERIES).and_then(|d| d.parse().ok()),
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

/// A consumer SIGKILLed 12 times 0.3–0.8 s apart; every
/// re-claim of a dead consumer's entry spends a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_dead_letters_no_valid_order_and_loses_none() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "orders").await;
    support::a_crash_loop_dead_letters_nothing_and_loses_nothing(place, Duration::from_millis(200))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_the_batch_in_flight_finish_and_settles_it() {
    let server = RedisServer::start();
    support::shutdown_drains_the_batch_in_flight(Stream::on(&server.url(), "orders").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_abandoned_at_the_drain_deadline_keeps_its_key_until_the_lease() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "orders").await;
    support::shutdown_past_the_deadline_keeps_the_key_until_the_lease(place).await;
}

/// `EXEC` does not stop at a failed command: a dead letter that could not be
/// written (the dead-letter key holds a string) must not ack its entry. It
/// stays pending, `poll` says which stream to fix, and once fixed the entry
/// is dead-lettered exactly once, with idem's reason fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_that_cannot_be_written_leaves_its_entry_pending_until_it_can() {
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "p").await;
    let mut conn = place.conn.clone();
    let _: () = redis::cmd("SET")
        .arg("p:dead")
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    place.publish(Some("p-1"), br#"{"n":1}"#).await;
    let consumer = Consumer::new(idem_on(&url, Duration::from_secs(3)).await, "p")
        .classify(|_: &String| ErrorClass::Permanent);
    let adapter = place.adapter("a", Duration::from_millis(200)).await;
    let ledger = Ledger::new();
    let declined = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Err("card declined".into())
    };

    let failed = adapter.poll(&consumer, &declined).await;
    assert_eq!(place.pending().await.len(), 1, "not acked: still pending");
    let error = failed.expect_err("a dead letter that was not written is an error");
    assert!(
        error.to_string().contains("`p:dead`") && error.to_string().contains("WRONGTYPE"),
        "{error}"
    );
    let held: String = redis::cmd("GET")
        .arg("p:dead")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(held, "not a stream", "nothing written over it");

    let _: () = redis::cmd("DEL")
        .arg("p:dead")
        .query_async(&mut conn)
        .await
        .unwrap();
    support::until(
        "the entry is dead-lettered",
        Duration::from_secs(10),
        async || {
            adapter.poll(&consumer, &declined).await.unwrap();
            place.drained().await
        },
    )
    .await;
    let dead = place.dead_entries().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let field = |k: &str| dead[0].get(k).map(String::as_str);
    assert_eq!(field("id"), Some("p-1"));
    assert_eq!(field("payload"), Some(r#"{"n":1}"#));
    assert_eq!(field(dead_letter_field::KIND), Some("permanent"));
    assert_eq!(field(dead_letter_field::DELIVERIES), Some("2"));
    assert!(field(dead_letter_field::REASON).is_some_and(|r| r.contains("card declined")));
    assert!(field("source_id").is_some_and(|id| id.contains('-')));
    // A permanent failure stores nothing: each delivery ran the handler.
    assert_eq!(ledger.count("p-1"), 2);
}

/// An entry id twice in one batch is settled once: one dead letter, one ack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_twice_in_one_batch_is_settled_once() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "twice").await;
    place.publish(Some("t-1"), b"{}").await;
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let fetched = adapter.fetch().await.unwrap();
    assert_eq!(fetched.len(), 1);
    let dead = Decision::DeadLetter {
        reason: DeadLetterReason::Permanent("declined".into()),
    };
    let entry = fetched[0].clone();
    adapter
        .apply_batch(&[(entry.clone(), dead.clone()), (entry, dead)])
        .await
        .unwrap();
    assert_eq!(place.dead_entries().await.len(), 1);
    assert!(place.drained().await);
}

/// A stream whose id field is its payload field (the payload is the key):
/// the entry's payload and id are both that field's value, as before the
/// adapter took fields out of the entry instead of copying them; and an
/// entry with both fields keeps each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_field_can_be_both_the_payload_and_the_id() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "one-field").await;
    place.xadd(&[("payload", b"order-5")]).await;
    let cfg = place.cfg("a").id_field("payload");
    let adapter = RedisStreamsConsumer::connect(&place.url, cfg)
        .await
        .unwrap();
    adapter.ensure_group().await.unwrap();
    let fetched = adapter.fetch().await.unwrap();
    assert_eq!(fetched.len(), 1);
    let m = adapter.message_of(&fetched[0]).unwrap();
    assert_eq!(
        (m.payload().as_ref(), m.id()),
        (&b"order-5"[..], Some("order-5"))
    );
    assert_eq!(m.position(), Some(fetched[0].id.as_str()));

    place.publish(Some("o-6"), b"{}").await;
    let both = place.adapter("b", Duration::from_secs(30)).await;
    let fetched = both.fetch().await.unwrap();
    let m = both.message_of(&fetched[0]).unwrap();
    assert_eq!((m.payload().as_ref(), m.id()), (&b"{}"[..], Some("o-6")));
}

/// Two entries that are copies of one message (same id and payload) in one
/// batch: each is settled (both acked once the message is done) and the
/// handler runs once, though its first run failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_in_one_batch_are_each_settled_and_run_once() {
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "copies").await;
    place.publish(Some("c-1"), br#"{"n":1}"#).await;
    place.publish(Some("c-1"), br#"{"n":1}"#).await;
    place.publish(Some("c-2"), br#"{"n":2}"#).await;
    let consumer = Consumer::new(idem_on(&url, Duration::from_secs(3)).await, "copies")
        .backoff(Duration::from_millis(10), Duration::from_millis(10));
    let adapter = place.adapter("a", Duration::from_millis(500)).await;
    let ledger = Ledger::new();
    let failed_once = AtomicBool::new(false);
    let flaky = async |m: Message| -> Result<(), String> {
        let id = m.id().unwrap_or("?").to_owned();
        if id == "c-1" && !failed_once.swap(true, Ordering::SeqCst) {
            return Err("timeout".into());
        }
        ledger.record(&id);
        Ok(())
    };
    let mut acked = 0;
    support::until(
        "every entry is settled",
        Duration::from_secs(10),
        async || {
            acked += adapter.poll(&consumer, &flaky).await.unwrap().acked;
            place.drained().await
        },
    )
    .await;
    assert_eq!(acked, 3, "each entry acked once");
    assert_eq!((ledger.count("c-1"), ledger.count("c-2")), (1, 1));
    assert!(place.dead_entries().await.is_empty());
    assert!(place.pending().await.is_empty());
}

/// A nack's delay is honoured by the next fetch, however long it may block:
/// the entry comes back in the poll after the nack (it came only at the
/// next periodic scan, a second or a whole block time later), and never
/// before its delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nacked_entry_comes_back_in_the_next_fetch_not_before_its_delay() {
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "nack").await;
    place.publish(Some("n-1"), b"{}").await;
    let delay = Duration::from_millis(500);
    let consumer =
        Consumer::new(idem_on(&url, Duration::from_secs(3)).await, "nack").backoff(delay, delay);
    // The default claim idle time, and a block time far over the delay.
    let cfg = place
        .cfg("a")
        .claim_idle(Duration::from_secs(30))
        .block(Duration::from_secs(3));
    let adapter = RedisStreamsConsumer::connect(&url, cfg).await.unwrap();
    adapter.ensure_group().await.unwrap();
    let starts = Mutex::new(Vec::new());
    let flaky = async |_: Message| -> Result<(), String> {
        let mut starts = starts.lock().unwrap();
        starts.push(Instant::now());
        if starts.len() == 1 {
            return Err("timeout".into());
        }
        Ok(())
    };
    let first = adapter.poll(&consumer, &flaky).await.unwrap();
    assert_eq!((first.fetched, first.nacked), (1, 1));
    let second = adapter.poll(&consumer, &flaky).await.unwrap();
    assert_eq!(
        (second.fetched, second.redelivered, second.acked),
        (1, 1, 1),
        "the nacked entry came back in the next poll"
    );
    let gap = {
        let starts = starts.lock().unwrap();
        starts[1] - starts[0]
    };
    eprintln!("nack delay {delay:?}: the handler ran again after {gap:?}");
    assert!(gap >= delay, "back after {gap:?}, before its delay");
    assert!(place.drained().await);
}

// ------------------------------------------- acks riding with the results

/// With idem's store on the stream's own Redis, the acks
/// of the entries whose handlers succeeded go in the round trip that
/// stores their results. `handle` alone (no `settle`) has acked them: a
/// consumer killed between the two leaves nothing to redeliver. The
/// entries whose handlers failed stay pending for `settle`, which sends
/// only those (nack, dead letter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_ride_with_the_results_when_the_store_is_the_streams_redis() {
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "riding").await;
    for i in 0..12 {
        place
            .publish(Some(&format!("r-{i}")), format!("{{\"n\":{i}}}").as_bytes())
            .await;
    }
    let consumer = Consumer::new(idem_on(&url, Duration::from_secs(5)).await, "riding").classify(
        |e: &String| {
            if e == "declined" {
                ErrorClass::Permanent
            } else {
                ErrorClass::Retryable
            }
        },
    );
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let ledger = Ledger::new();
    // r-3 is declined (dead letter), r-7 fails for now (nack); the rest succeed.
    let handler = async |m: Message| -> Result<(), String> {
        let id = m.id().unwrap_or("?").to_owned();
        ledger.record(&id);
        match id.as_str() {
            "r-3" => Err("declined".into()),
            "r-7" => Err("try later".into()),
            _ => Ok(()),
        }
    };
    let fetched = adapter.fetch().await.unwrap();
    assert_eq!(fetched.len(), 12);
    let ids: HashMap<String, String> = fetched
        .iter()
        .map(|e| {
            (
                e.id.clone(),
                e.message.as_ref().unwrap().id().unwrap().to_owned(),
            )
        })
        .collect();
    let decided = adapter.handle(&consumer, &handler, fetched).await;
    let pending: Vec<String> = place
        .pending()
        .await
        .iter()
        .map(|e| ids[e].clone())
        .collect();
    let mut pending_sorted = pending.clone();
    pending_sorted.sort();
    assert_eq!(
        pending_sorted,
        ["r-3", "r-7"],
        "the ten successes were acked with their results"
    );

    let report = adapter.settle(decided).await.unwrap();
    assert_eq!(
        (report.acked, report.nacked, report.dead_lettered),
        (10, 1, 1),
        "{report:?}"
    );
    assert_eq!(
        place.pending().await.len(),
        1,
        "the nacked entry waits for its redelivery"
    );
    assert_eq!(place.dead_entries().await.len(), 1);
    for i in 0..12 {
        assert_eq!(ledger.count(&format!("r-{i}")), 1, "r-{i}");
    }
    // The results were stored before their acks: a copy published now replays.
    place.publish(Some("r-0"), br#"{"n":0}"#).await;
    let again = adapter.fetch().await.unwrap();
    let again: Vec<_> = again
        .into_iter()
        .filter(|e| e.message.as_ref().unwrap().id() == Some("r-0"))
        .collect();
    assert_eq!(again.len(), 1);
    let decided = adapter.handle(&consumer, &handler, again).await;
    assert!(decided[0].1.is_ack());
    assert_eq!(ledger.count("r-0"), 1, "replayed, not run again");
}

/// An entry is never acked before its result is stored. The scripts are
/// flushed while the handlers run, so the batch's completes meet
/// `NOSCRIPT` in the round trip that would carry the acks and are stored
/// alone after it: no `XACK` of the batch may reach Redis before the last
/// of those result writes (a consumer killed right after that round trip
/// would otherwise leave acked entries whose results were never stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_entry_is_acked_before_its_result_is_stored_when_the_scripts_are_gone() {
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "flushed").await;
    for i in 0..4 {
        place.publish(Some(&format!("f-{i}")), b"{}").await;
    }
    let consumer = Consumer::new(idem_on(&url, Duration::from_secs(5)).await, "flushed");
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let fetched = adapter.fetch().await.unwrap();
    assert_eq!(fetched.len(), 4);
    let monitor = idem_testkit::Monitor::start(server.addr());
    let ledger = Ledger::new();
    // Each handler flushes the scripts before it returns: its complete,
    // sent after it, finds none.
    let handler = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query(&mut server.connection())
            .unwrap();
        Ok(())
    };
    let decided = adapter.handle(&consumer, &handler, fetched).await;
    let report = adapter.settle(decided).await.unwrap();
    assert_eq!(report.acked, 4, "{report:?}");
    assert!(place.pending().await.is_empty());
    let seen = monitor.until_now();
    let is = |line: &str, what: &str| line.to_ascii_uppercase().contains(what);
    assert!(
        seen.iter().any(|l| is(l, r#""EVALSHA""#))
            && seen.iter().any(|l| is(l, r#""SCRIPT" "LOAD""#)),
        "the completes met NOSCRIPT and loaded the script again"
    );
    let writes: Vec<usize> = (0..seen.len())
        .filter(|&i| is(&seen[i], r#""KEEPTTL""#))
        .collect();
    // The command an XACK line runs (from a client or a script), not an
    // argument of another command.
    let acks: Vec<usize> = (0..seen.len())
        .filter(|&i| is(&seen[i], r#"] "XACK""#))
        .collect();
    assert_eq!(writes.len(), 4, "one result write per entry: {seen:#?}");
    assert!(!acks.is_empty(), "{seen:#?}");
    assert!(
        acks[0] > writes[3],
        "an XACK reached Redis before a result was stored: {seen:#?}"
    );
    for i in 0..4 {
        assert_eq!(ledger.count(&format!("f-{i}")), 1, "f-{i}");
    }
    // Every result is stored: copies published now replay.
    for i in 0..4 {
        place.publish(Some(&format!("f-{i}")), b"{}").await;
    }
    let again = adapter.fetch().await.unwrap();
    assert_eq!(again.len(), 4);
    adapter.handle(&consumer, &handler, again).await;
    for i in 0..4 {
        assert_eq!(
            ledger.count(&format!("f-{i}")),
            1,
            "f-{i} replayed, not run again"
        );
    }
}

/// With idem's store on another Redis, the ridden `XACK` acks nothing
/// there: riding stops, and `settle` acks every entry itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_ride_only_where_they_ack_and_otherwise_settle_acks_them() {
    let (streams, store) = (RedisServer::start(), RedisServer::start());
    let place = Stream::on(&streams.url(), "apart").await;
    for i in 0..6 {
        place.publish(Some(&format!("a-{i}")), b"{}").await;
    }
    let consumer = Consumer::new(idem_on(&store.url(), Duration::from_secs(5)).await, "apart");
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let ok = async |_: Message| -> Result<(), String> { Ok(()) };
    for _ in 0..2 {
        let fetched = adapter.fetch().await.unwrap();
        let n = fetched.len();
        let decided = adapter.handle(&consumer, &ok, fetched).await;
        assert_eq!(
            place.pending().await.len(),
            n,
            "nothing acked on the stream's Redis yet"
        );
        adapter.settle(decided).await.unwrap();
        assert!(place.pending().await.is_empty());
        for i in 6..9 {
            place.publish(Some(&format!("a-{i}")), b"{}").await;
        }
    }
}

/// The crash loop (12 SIGKILLs 0.3–0.8 s apart) with idem's store on the
/// stream's own Redis, so that acks ride with results: every order runs,
/// none is lost or dead-lettered, each kill costs at most one extra run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loop_with_acks_riding_on_the_results_loses_none() {
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "orders").await;
    support::crash_loop_with_the_store_at(place, Duration::from_millis(200), &server.url()).await;
}

/// The store's Redis user of docs/operating.md may not `XACK`: the ridden
/// ack is refused once (one ACL LOG entry), riding stops, and `settle`
/// acks every entry on the consumer's own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_user_without_xack_stops_riding_after_one_refusal() {
    let server = RedisServer::start();
    // The ACL of docs/operating.md for the store's namespace: no XACK.
    let rules = idem_testkit::store_acl("consumer-test", "s3cret-pw");
    let mut args = vec!["ACL", "SETUSER", "idem", "reset"];
    args.extend(rules.iter().map(String::as_str));
    assert_eq!(server.cli(&args), "OK");
    let store_url = server.url().replace("redis://", "redis://idem:s3cret-pw@");
    let place = Stream::on(&server.url(), "acl").await;
    let consumer = Consumer::new(idem_on(&store_url, Duration::from_secs(5)).await, "acl");
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let ledger = Ledger::new();
    let ok = async |m: Message| -> Result<(), String> {
        ledger.record(m.id().unwrap_or("?"));
        Ok(())
    };
    for round in 0..3 {
        for i in 0..4 {
            place.publish(Some(&format!("a-{round}-{i}")), b"{}").await;
        }
        let fetched = adapter.fetch().await.unwrap();
        assert_eq!(fetched.len(), 4);
        let decided = adapter.handle(&consumer, &ok, fetched).await;
        assert_eq!(place.pending().await.len(), 4, "round {round}: no ack rode");
        adapter.settle(decided).await.unwrap();
        assert!(
            place.pending().await.is_empty(),
            "round {round}: settle acked them"
        );
    }
    assert_eq!(ledger.total(), 12);
    // One ACL LOG entry for the XACK (run by the script that carries it),
    // counted once: not refused per batch.
    let log = server.cli(&["ACL", "LOG"]);
    assert!(log.contains("object\nxack\n"), "{log}");
    assert!(
        log.starts_with("count\n1\n"),
        "refused once, not per batch: {log}"
    );
}

// ------------------------------------------------------- headers and traces

/// A W3C `traceparent` for the tests (the recommendation's example).
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The sink writes a message's headers unchanged as entry fields named as
/// the headers, after its own (`id`, `payload`, `key`), whatever the build's
/// features; a message with a header named like one of its fields is
/// refused and nothing of it written, the rest of the batch is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sink_writes_a_messages_headers_unchanged_as_entry_fields() {
    use idem_consumer::outbox::{OutboxMessage, RedisStreamsSink, Sink, SinkError};
    let server = RedisServer::start();
    let place = Stream::on(&server.url(), "headers").await;
    let sink = RedisStreamsSink::connect(&server.url()).await.unwrap();
    assert_eq!(sink.system(), "redis");
    let headers = vec![
        ("traceparent".to_owned(), TRACEPARENT.to_owned()),
        ("tracestate".to_owned(), String::new()),
        ("x-tenant".to_owned(), "acme".to_owned()),
    ];
    let batch: Vec<OutboxMessage> = ["id", "payload", "key", "topic"]
        .into_iter()
        .enumerate()
        .map(|(i, own)| {
            OutboxMessage::new(format!("bad-{i}"), "headers", "k", "{}")
                .with_headers(vec![(own.to_owned(), "shadow".to_owned())])
        })
        .chain(
            [OutboxMessage::new("h-1", "headers", "order-1", "{}").with_headers(headers.clone())],
        )
        .collect();
    let results = sink.send(&batch).await;
    for (i, r) in results.iter().enumerate().take(4) {
        assert!(
            matches!(r, Err(SinkError::Refused { .. })),
            "message {i}: {r:?}"
        );
    }
    assert!(results[4].is_ok(), "{results:?}");
    type Fields = Vec<(String, Vec<u8>)>;
    let entries: Vec<(String, Fields)> = redis::cmd("XRANGE")
        .arg("headers")
        .arg("-")
        .arg("+")
        .query_async(&mut place.conn.clone())
        .await
        .unwrap();
    assert_eq!(entries.len(), 1, "only the sendable message: {entries:?}");
    let fields: Vec<(String, String)> = entries[0]
        .1
        .iter()
        .map(|(k, v)| (k.clone(), String::from_utf8(v.clone()).unwrap()))
        .collect();
    let mut want = vec![
        ("id".to_owned(), "h-1".to_owned()),
        ("payload".to_owned(), "{}".to_owned()),
        ("key".to_owned(), "order-1".to_owned()),
    ];
    want.extend(headers);
    assert_eq!(fields, want);
}

/// The trace context the sink wrote reaches the handler unchanged,
/// through the adapter, whatever the build; an entry without it is handled
/// as before, without trace context.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_context_of_an_entry_reaches_the_handler() {
    use idem_consumer::outbox::{OutboxMessage, RedisStreamsSink, Sink};
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "traced").await;
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let sink = RedisStreamsSink::connect(&url).await.unwrap();
    let batch = [
        OutboxMessage::new("traced", "traced", "k", "{}").with_headers(vec![
            ("traceparent".to_owned(), TRACEPARENT.to_owned()),
            ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
        ]),
        OutboxMessage::new("plain", "traced", "k", "{}"),
    ];
    for r in sink.send(&batch).await {
        r.unwrap();
    }
    let consumer = Consumer::new(idem_on(&url, Duration::from_secs(5)).await, "trace");
    let seen = Mutex::new(Vec::new());
    let handler = async |m: Message| -> Result<(), String> {
        seen.lock().unwrap().push((
            m.id().unwrap_or("?").to_owned(),
            m.trace_header("traceparent").map(str::to_owned),
            m.trace_header("tracestate").map(str::to_owned),
        ));
        Ok(())
    };
    support::until("both handled", Duration::from_secs(10), async || {
        adapter.poll(&consumer, &handler).await.unwrap();
        place.drained().await
    })
    .await;
    let mut seen = seen.into_inner().unwrap();
    seen.sort();
    assert_eq!(
        seen,
        [
            ("plain".to_owned(), None, None),
            (
                "traced".to_owned(),
                Some(TRACEPARENT.to_owned()),
                Some("congo=t61rcWkgMzE".to_owned())
            ),
        ]
    );
}

/// A dead letter keeps the producer's trace context: the entry's
/// `traceparent` and `tracestate` fields go with it, beside idem's fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_keeps_the_entrys_trace_fields() {
    use idem_consumer::outbox::{OutboxMessage, RedisStreamsSink, Sink};
    let server = RedisServer::start();
    let url = server.url();
    let place = Stream::on(&url, "dl_traced").await;
    let adapter = place.adapter("a", Duration::from_secs(30)).await;
    let sink = RedisStreamsSink::connect(&url).await.unwrap();
    let batch = [
        OutboxMessage::new("traced", "dl_traced", "k", "{}").with_headers(vec![
            ("traceparent".to_owned(), TRACEPARENT.to_owned()),
            ("tracestate".to_owned(), "congo=t61rcWkgMzE".to_owned()),
        ]),
    ];
    for r in sink.send(&batch).await {
        r.unwrap();
    }
    let consumer =
        Consumer::new(idem_on(&url, Duration::from_secs(5)).await, "dl_trace").max_failures(1);
    let failing = async |_: Message| -> Result<(), String> { Err("refused".to_owned()) };
    support::until("dead-lettered", Duration::from_secs(10), async || {
        adapter.poll(&consumer, &failing).await.unwrap();
        place.drained().await
    })
    .await;
    let dead = place.dead_entries().await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    let field = |name: &str| dead[0].get(name).map(String::as_str);
    assert_eq!(field("traceparent"), Some(TRACEPARENT), "{dead:?}");
    assert_eq!(field("tracestate"), Some("congo=t61rcWkgMzE"), "{dead:?}");
    assert_eq!(field("id"), Some("traced"), "{dead:?}");
    assert_eq!(
        field(dead_letter_field::KIND),
        Some("max_failures"),
        "{dead:?}"
    );
}
