//! The outbox on Redis (`outbox::stage` + `RedisRelay`), each row of
//! docs/outbox.md's Redis table, against real redis-servers (standalone and
//! a three-master cluster). What the relay published is recorded by the
//! sink, outside the store, and counted exactly.

use async_trait::async_trait;
use idem_core::outbox::{self, OutboxMessage, Sink, SinkError, message_id};
use idem_core::store::{Complete, Store};
use idem_core::{Error, Idempotency, Outcome};
use idem_redis::RedisStore;
use idem_redis::outbox::RedisRelay;
use idem_testkit::TestContext;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Res<T> = Result<T, Error>;

/// A broker stand-in that keeps what it confirmed, in order, and checks
/// that one key is never sent twice at once. It can refuse a topic, be
/// down, or never answer.
#[derive(Default)]
struct Broker {
    confirmed: Mutex<Vec<OutboxMessage>>,
    in_flight: Mutex<HashSet<String>>,
    overlaps: AtomicUsize,
    refuse_topic: Mutex<Option<String>>,
    down: AtomicBool,
    hang: AtomicBool,
    calls: AtomicUsize,
}

#[async_trait]
impl Sink for Broker {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        {
            let mut flying = self.in_flight.lock().unwrap();
            for m in batch {
                if !flying.insert(m.key.clone()) {
                    self.overlaps.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        tokio::task::yield_now().await;
        let refuse = self.refuse_topic.lock().unwrap().clone();
        let results = batch
            .iter()
            .map(|m| {
                if self.down.load(Ordering::SeqCst) {
                    return Err(SinkError::unavailable("connection refused"));
                }
                if refuse.as_deref() == Some(m.topic.as_str()) {
                    return Err(SinkError::refused(format!("no such topic `{}`", m.topic)));
                }
                self.confirmed.lock().unwrap().push(m.clone());
                Ok(())
            })
            .collect();
        let mut flying = self.in_flight.lock().unwrap();
        for m in batch {
            flying.remove(&m.key);
        }
        results
    }

    fn describe(&self) -> String {
        "test broker".into()
    }
}

impl Broker {
    fn ids(&self) -> Vec<String> {
        self.confirmed
            .lock()
            .unwrap()
            .iter()
            .map(|m| m.id.clone())
            .collect()
    }

    /// The payloads confirmed for `key`, in the order they were confirmed.
    fn payloads_of(&self, key: &str) -> Vec<String> {
        self.confirmed
            .lock()
            .unwrap()
            .iter()
            .filter(|m| m.key == key)
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect()
    }
}

fn idem(store: &RedisStore) -> Idempotency {
    Idempotency::builder(store.clone())
        .namespace("outbox")
        .build()
}

/// An order call: stages `created` and `paid` for the order, keyed by it.
async fn place(idem: &Idempotency, request: &str, order: &str) -> Res<(String, Outcome)> {
    idem.call("orders.create", request)
        .run_outcome(|| async {
            outbox::stage("orders", order, &format!("{order}:created:{request}"))?;
            outbox::stage("orders", order, &format!("{order}:paid:{request}"))?;
            Ok(order.to_owned())
        })
        .await
}

/// Drains until a pass finds nothing to do.
async fn drain<S: Sink>(relay: &RedisRelay<S>) {
    for _ in 0..1000 {
        let pass = relay.drain_once().await.expect("relay pass");
        if pass.handled() == 0 {
            return;
        }
    }
    panic!("the relay kept finding work for 1000 passes");
}

fn stream_len(ctx: &TestContext, stream: &str) -> i64 {
    ctx.server()
        .cli(&["XLEN", stream])
        .trim()
        .parse()
        .unwrap_or(-1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_messages_are_stored_with_the_result_or_not_at_all() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);

    // Stored with the result, with ids made from the record key.
    let (_, outcome) = place(&idem, "r-1", "o-1").await.unwrap();
    assert_eq!(outcome, Outcome::Executed);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 2);
    let broker = Arc::new(Broker::default());
    let relay = RedisRelay::new(&store, Arc::clone(&broker));
    drain(&relay).await;
    let record_key = "outbox:orders.create:r-1";
    assert_eq!(
        broker.ids(),
        vec![
            message_id(record_key, "orders"),
            message_id(record_key, "orders#1")
        ]
    );

    // A replay stores nothing again.
    let (_, outcome) = place(&idem, "r-1", "o-1").await.unwrap();
    assert_eq!(outcome, Outcome::Replayed);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);

    // A body that fails after staging: nothing is stored, the key is free.
    let failed: Res<u32> = idem
        .call("orders.create", "r-2")
        .run(|| async {
            outbox::stage("orders", "o-2", &"created")?;
            Err(Error::codec("the charge was declined"))
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
    assert_eq!(ctx.record("outbox:orders.create:r-2"), None);

    // Bad input fails the body: nothing stored.
    for (topic, key) in [("", "o-3"), ("orders", "a\nb")] {
        let bad: Res<u32> = idem
            .call("orders.create", "r-3")
            .run(|| async {
                outbox::stage(topic, key, &1)?;
                Ok(1)
            })
            .await;
        assert!(matches!(bad, Err(Error::InvalidConfig(_))), "{bad:?}");
    }
    let unserializable: Res<u32> = idem
        .call("orders.create", "r-3")
        .run(|| async {
            let mut not_json = HashMap::new();
            not_json.insert((1, 2), 3); // a map with non-string keys
            outbox::stage("orders", "o-3", &not_json)?;
            Ok(1)
        })
        .await;
    assert!(
        matches!(unserializable, Err(Error::Codec { .. })),
        "{unserializable:?}"
    );
    assert_eq!(ctx.record("outbox:orders.create:r-3"), None);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);

    // Outside a body, and on a store without an outbox: typed errors.
    assert!(matches!(
        outbox::stage("orders", "o-4", &1),
        Err(Error::InvalidConfig(_))
    ));
    let memory = Idempotency::builder(idem_core::MemoryStore::new()).build();
    let runs = AtomicUsize::new(0);
    for _ in 0..2 {
        let r: Res<u32> = memory
            .call("orders.create", "r-4")
            .run(|| async {
                runs.fetch_add(1, Ordering::SeqCst);
                outbox::stage("orders", "o-4", &1)?;
                Ok(1)
            })
            .await;
        assert!(matches!(r, Err(Error::InvalidConfig(_))), "{r:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2, "nothing was stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_that_cannot_append_stores_nothing() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    // Something else under the outbox key: the script refuses before it
    // writes the result.
    ctx.server().cli(&["SET", "idem-outbox", "not a stream"]);
    let (_, outcome) = place(&idem, "r-1", "o-1").await.unwrap();
    assert_eq!(outcome, Outcome::NotStored);
    let state = ctx.record_state("outbox:orders.create:r-1");
    assert!(
        !matches!(state, Some(idem_testkit::RecordState::Completed(_))),
        "the result was stored without its messages: {state:?}"
    );
    ctx.server().cli(&["DEL", "idem-outbox"]);

    // A service user whose ACL does not grant the outbox: refused before
    // anything is written, with a message that says what to grant.
    ctx.server().cli(&[
        "ACL",
        "SETUSER",
        "svc",
        "on",
        ">pw",
        "resetkeys",
        "~outbox:*",
        "resetchannels",
        "-@all",
        "+evalsha",
        "+script|load",
        "+get",
        "+set",
        "+del",
        "+pttl",
        "+pexpire",
        "+ping",
    ]);
    let url = ctx.server().url().replace("redis://", "redis://svc:pw@");
    let svc = RedisStore::connect(&url).await.unwrap();
    let (_, outcome) = place(
        &Idempotency::builder(svc.clone())
            .namespace("outbox")
            .lease(Duration::from_secs(1))
            .build(),
        "r-2",
        "o-2",
    )
    .await
    .unwrap();
    assert_eq!(outcome, Outcome::NotStored);
    let state = ctx.record_state("outbox:orders.create:r-2");
    assert!(
        !matches!(state, Some(idem_testkit::RecordState::Completed(_))),
        "the result was stored without its messages: {state:?}"
    );
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
    let token = idem_core::store::Token::random();
    let claim = idem_testkit::claim("outbox:orders.create:r-3", &token, 30_000, 60_000, None);
    svc.claim(claim).await.unwrap();
    let m = OutboxMessage::new("m", "t", "k", bytes::Bytes::new());
    let refused = svc
        .complete(
            Complete::new(
                "outbox:orders.create:r-3",
                &token,
                idem_core::store::ValueKind::Json,
                b"1",
            )
            .outbox(&[m]),
        )
        .await;
    let e = refused.expect_err("the ACL refuses the outbox");
    assert!(e.to_string().contains("ACL"), "{e}");
    assert!(e.to_string().contains("the body has run"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_sends_in_order_per_key_and_deletes_what_was_confirmed() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    for i in 0..60 {
        place(&idem, &format!("r-{i}"), &format!("o-{}", i % 6))
            .await
            .unwrap();
    }
    assert_eq!(stream_len(&ctx, "idem-outbox"), 120);
    let broker = Arc::new(Broker::default());
    let relay = RedisRelay::new(&store, Arc::clone(&broker)).batch_size(16);
    drain(&relay).await;
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
    assert_eq!(broker.ids().len(), 120);
    assert_eq!(broker.ids().iter().collect::<HashSet<_>>().len(), 120);
    for k in 0..6 {
        let order = format!("o-{k}");
        let expected: Vec<String> = (0..60)
            .filter(|i| i % 6 == k)
            .flat_map(|i| {
                [
                    format!("\"{order}:created:r-{i}\""),
                    format!("\"{order}:paid:r-{i}\""),
                ]
            })
            .collect();
        assert_eq!(broker.payloads_of(&order), expected);
    }
    assert_eq!(broker.overlaps.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_redis_streams_sink_the_id_is_in_field_id() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    place(&idem, "r-x", "o-x").await.unwrap();
    // Scripts flushed (a restart, a fail-over): the relay loads its own.
    ctx.server().cli(&["SCRIPT", "FLUSH"]);
    let sink = idem_consumer::outbox::RedisStreamsSink::connect(&ctx.server().url())
        .await
        .unwrap();
    drain(&RedisRelay::new(&store, sink)).await;
    let published = ctx.server().cli(&["XRANGE", "orders", "-", "+"]);
    let id = message_id("outbox:orders.create:r-x", "orders");
    assert!(published.contains(&id), "{published}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_relays_never_send_one_key_at_once_and_each_message_goes() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let broker = Arc::new(Broker::default());
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut relays = Vec::new();
    for _ in 0..3 {
        let relay = RedisRelay::new(&store, Arc::clone(&broker))
            .batch_size(8)
            .poll_interval(Duration::from_millis(5));
        let mut stopped = stopped.clone();
        relays.push(tokio::spawn(async move {
            relay
                .run(async move {
                    let _ = stopped.wait_for(|s| *s).await;
                })
                .await
        }));
    }
    let mut producers = Vec::new();
    for p in 0..4 {
        let idem = idem(&store);
        producers.push(tokio::spawn(async move {
            for i in 0..50 {
                place(&idem, &format!("p{p}-{i}"), &format!("o-{}", i % 5))
                    .await
                    .unwrap();
            }
        }));
    }
    for p in producers {
        p.await.unwrap();
    }
    idem_testkit::eventually(
        "every message published",
        Duration::from_secs(60),
        || async { (broker.ids().iter().collect::<HashSet<_>>().len() == 400).then_some(()) },
    )
    .await;
    stop.send(true).unwrap();
    for r in relays {
        r.await.unwrap();
    }
    assert_eq!(broker.overlaps.load(Ordering::SeqCst), 0);
    // Per key and producer, `created` before `paid`, calls in order.
    for k in 0..5 {
        let order = format!("o-{k}");
        let mut seen: Vec<String> = Vec::new();
        for p in broker.payloads_of(&order) {
            if !seen.contains(&p) {
                seen.push(p);
            }
        }
        for p in 0..4 {
            let mine: Vec<&String> = seen
                .iter()
                .filter(|s| s.contains(&format!(":p{p}-")))
                .collect();
            let expected: Vec<String> = (0..50)
                .filter(|i| i % 5 == k)
                .flat_map(|i| {
                    [
                        format!("\"{order}:created:p{p}-{i}\""),
                        format!("\"{order}:paid:p{p}-{i}\""),
                    ]
                })
                .collect();
            assert_eq!(
                mine.into_iter().cloned().collect::<Vec<_>>(),
                expected,
                "order of key {order}, producer {p}"
            );
        }
    }
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_message_is_parked_with_its_reason_and_blocks_only_its_key() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    let broker = Arc::new(Broker::default());
    *broker.refuse_topic.lock().unwrap() = Some("audit".into());
    // o-1: a refused `audit`, then an `orders` behind it; o-2 goes on.
    let r: Res<u32> = idem
        .call("orders.create", "r-1")
        .run(|| async {
            outbox::stage("audit", "o-1", &"audit-1")?;
            Ok(1)
        })
        .await;
    r.unwrap();
    place(&idem, "r-2", "o-1").await.unwrap();
    place(&idem, "r-3", "o-2").await.unwrap();
    let relay = RedisRelay::new(&store, Arc::clone(&broker));
    drain(&relay).await;
    assert_eq!(broker.payloads_of("o-1"), Vec::<String>::new());
    assert_eq!(broker.payloads_of("o-2").len(), 2);
    let outbox = store.outbox();
    let parked = outbox.parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].topic, "audit");
    assert_eq!(parked[0].key, "o-1");
    assert!(
        parked[0]
            .reason
            .as_deref()
            .unwrap()
            .contains("no such topic")
    );
    let backlog = outbox.backlog().await.unwrap();
    assert_eq!((backlog.pending, backlog.parked), (2, 1));

    // Retried: it goes first in its key, then the rest of the key.
    *broker.refuse_topic.lock().unwrap() = None;
    assert!(outbox.retry(&parked[0].id).await.unwrap());
    assert!(!outbox.retry("no-such-id").await.unwrap());
    drain(&relay).await;
    assert_eq!(
        broker.payloads_of("o-1"),
        vec![
            "\"audit-1\"".to_owned(),
            "\"o-1:created:r-2\"".to_owned(),
            "\"o-1:paid:r-2\"".to_owned()
        ]
    );

    // Dropped: gone, and its key goes on.
    *broker.refuse_topic.lock().unwrap() = Some("audit".into());
    let r: Res<u32> = idem
        .call("orders.create", "r-4")
        .run(|| async {
            outbox::stage("audit", "o-3", &"audit-3")?;
            Ok(1)
        })
        .await;
    r.unwrap();
    place(&idem, "r-5", "o-3").await.unwrap();
    drain(&relay).await;
    let parked = outbox.parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    let dropped = outbox.drop_parked(&parked[0].id).await.unwrap().unwrap();
    assert_eq!(dropped.key, "o-3");
    drain(&relay).await;
    assert_eq!(broker.payloads_of("o-3").len(), 2);
    assert_eq!(outbox.backlog().await.unwrap(), Default::default());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unavailable_broker_keeps_the_messages_and_the_retry_has_the_same_id_and_order() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    for i in 0..4 {
        place(&idem, &format!("r-{i}"), "o-1").await.unwrap();
    }
    let broker = Arc::new(Broker::default());
    broker.down.store(true, Ordering::SeqCst);
    // A backoff long enough that the next pass, however late a loaded
    // machine runs it, falls within it.
    let relay = RedisRelay::new(&store, Arc::clone(&broker))
        .retry_backoff(Duration::from_millis(1_500), Duration::from_millis(1_500));
    let pass = relay.drain_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed), (0, 1), "the key's head only");
    assert!(pass.retry_in.is_some());
    assert_eq!(stream_len(&ctx, "idem-outbox"), 8);
    // Backing off: the key waits.
    assert_eq!(relay.drain_once().await.unwrap().handled(), 0);
    broker.down.store(false, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    drain(&relay).await;
    let expected: Vec<String> = (0..4)
        .flat_map(|i| {
            [
                format!("\"o-1:created:r-{i}\""),
                format!("\"o-1:paid:r-{i}\""),
            ]
        })
        .collect();
    assert_eq!(broker.payloads_of("o-1"), expected);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_mid_send_loses_nothing_and_a_peer_takes_over() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    for i in 0..3 {
        place(&idem, &format!("r-{i}"), &format!("o-{i}"))
            .await
            .unwrap();
    }
    let stuck = Arc::new(Broker::default());
    stuck.hang.store(true, Ordering::SeqCst);
    let first = RedisRelay::new(&store, Arc::clone(&stuck));
    // Killed while the broker has the messages and has not confirmed:
    // the future is dropped, its lock stays until its lease ends.
    let killed = tokio::time::timeout(Duration::from_millis(300), first.drain_once()).await;
    assert!(killed.is_err());
    assert!(stuck.calls.load(Ordering::SeqCst) >= 1);
    drop(first);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 6);
    let broker = Arc::new(Broker::default());
    let peer =
        RedisRelay::new(&store, Arc::clone(&broker)).poll_interval(Duration::from_millis(50));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        peer.run(async {
            let _ = stopped.await;
        })
        .await
    });
    idem_testkit::eventually("the peer took over", Duration::from_secs(30), || async {
        (broker.ids().len() == 6).then_some(())
    })
    .await;
    stop.send(()).unwrap();
    let report = running.await.unwrap();
    assert_eq!(report.sent, 6);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_each_slot_has_its_stream_and_the_relay_finds_them_all() {
    let ctx = TestContext::redis_cluster().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    // Requests on many slots.
    for i in 0..40 {
        place(&idem, &format!("r-{i}"), &format!("o-{}", i % 4))
            .await
            .unwrap();
    }
    let broker = Arc::new(Broker::default());
    let relay = RedisRelay::new(&store, Arc::clone(&broker)).batch_size(8);
    drain(&relay).await;
    assert_eq!(broker.ids().iter().collect::<HashSet<_>>().len(), 80);
    // Per call, `created` before `paid` (calls on different slots have no
    // order between them).
    for k in 0..4 {
        let order = format!("o-{k}");
        let got = broker.payloads_of(&order);
        for i in (0..40).filter(|i| i % 4 == k) {
            let c = got
                .iter()
                .position(|p| p == &format!("\"{order}:created:r-{i}\""));
            let p = got
                .iter()
                .position(|p| p == &format!("\"{order}:paid:r-{i}\""));
            assert!(c.is_some() && c < p, "{order} r-{i}: {got:?}");
        }
    }
    let backlog = store.outbox().backlog().await.unwrap();
    assert_eq!((backlog.pending, backlog.parked), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_key_with_a_long_backlog_hides_no_other_key() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    let broker = Arc::new(Broker::default());
    *broker.refuse_topic.lock().unwrap() = Some("audit".into());
    // o-1: a refused message, then 5,000 behind it (more than a pass
    // reads); then o-2's message, at the stream's far end.
    let r: Res<u32> = idem
        .call("orders.create", "r-0")
        .run(|| async {
            outbox::stage("audit", "o-1", &"refused")?;
            Ok(1)
        })
        .await;
    r.unwrap();
    for c in 0..5 {
        let r: Res<u32> = idem
            .call("orders.create", format!("bulk-{c}"))
            .run(|| async {
                for i in 0..1000 {
                    outbox::stage("orders", "o-1", &i)?;
                }
                Ok(1)
            })
            .await;
        r.unwrap();
    }
    place(&idem, "r-2", "o-2").await.unwrap();
    let relay = RedisRelay::new(&store, Arc::clone(&broker)).batch_size(16);
    for _ in 0..10 {
        relay.drain_once().await.unwrap();
    }
    assert_eq!(broker.payloads_of("o-1"), Vec::<String>::new(), "o-1 waits");
    assert_eq!(broker.payloads_of("o-2").len(), 2, "o-2 went out");
    assert_eq!(store.outbox().backlog().await.unwrap().parked, 1);
    // Retried: the whole key goes, in order.
    *broker.refuse_topic.lock().unwrap() = None;
    let parked = store.outbox().parked(1).await.unwrap();
    assert!(store.outbox().retry(&parked[0].id).await.unwrap());
    tokio::time::sleep(Duration::from_millis(1100)).await; // past a rescan
    drain(&relay).await;
    let got = broker.payloads_of("o-1");
    assert_eq!(got.len(), 5001);
    assert_eq!(got[0], "\"refused\"");
    let expected: Vec<String> = (0..5)
        .flat_map(|_| (0..1000).map(|i: u32| i.to_string()))
        .collect();
    assert_eq!(&got[1..], &expected[..]);
}

/// A relay that lost its stream while a message backed off (its lock
/// lapsed, as after a stall as long as the lease, and a peer took over and
/// sent the message) still sleeps its poll between passes: the retry it
/// scheduled falls due once, and the relay does not wait on it again. (Its
/// wake-ups come from its passes' reports; they came from its own retry
/// table, where such an entry stayed due forever and the relay passed again
/// at once, in a loop.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_backing_off_message_a_peer_sent_sleeps_between_passes() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let idem = idem(&store);
    place(&idem, "r-1", "o-1").await.unwrap();
    let down = Arc::new(Broker::default());
    down.down.store(true, Ordering::SeqCst);
    let first = RedisRelay::new(&store, Arc::clone(&down))
        .retry_backoff(Duration::from_millis(50), Duration::from_millis(50))
        .poll_interval(Duration::from_millis(100));
    assert_eq!(first.drain_once().await.unwrap().failed, 1);
    // The first relay's lock lapses; a peer takes the stream and sends it.
    ctx.server().cli(&["DEL", "idem-outbox.relay"]);
    let broker = Arc::new(Broker::default());
    let peer = RedisRelay::new(&store, Arc::clone(&broker));
    drain(&peer).await;
    assert_eq!(broker.ids().len(), 2);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
    // The first relay runs on while the peer holds the stream: each pass
    // is one lock attempt (`EVALSHA`), refused.
    ctx.server().cli(&["CONFIG", "RESETSTAT"]);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        first
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.send(()).unwrap();
    assert_eq!(running.await.unwrap().handled(), 0);
    let stats = ctx.server().cli(&["INFO", "commandstats"]);
    let lock_attempts: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_evalsha:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .expect("INFO commandstats counts EVALSHA");
    // About ten at a 100 ms poll; a relay in a loop makes thousands.
    assert!(
        (3..=40).contains(&lock_attempts),
        "{lock_attempts} lock attempts in 1 s at a 100 ms poll"
    );
}

/// The stream entries' field names and values, oldest first, as Redis
/// holds them.
async fn raw_entries(ctx: &TestContext, stream: &str) -> Vec<Vec<(String, Vec<u8>)>> {
    let client = redis::Client::open(ctx.server().url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    let bulk = |v: &redis::Value| match v {
        redis::Value::BulkString(b) => b.clone(),
        other => panic!("not a bulk string: {other:?}"),
    };
    let redis::Value::Array(entries) = reply else {
        panic!("XRANGE: {reply:?}")
    };
    entries
        .iter()
        .map(|e| {
            let redis::Value::Array(parts) = e else {
                panic!("entry: {e:?}")
            };
            let redis::Value::Array(fields) = &parts[1] else {
                panic!("fields: {parts:?}")
            };
            fields
                .chunks_exact(2)
                .map(|p| (String::from_utf8(bulk(&p[0])).unwrap(), bulk(&p[1])))
                .collect()
        })
        .collect()
}

fn names(entry: &[(String, Vec<u8>)]) -> Vec<&str> {
    entry.iter().map(|(n, _)| n.as_str()).collect()
}

/// Completes `key` (claimed first) with `messages` through the store, as a
/// call that staged them does.
async fn complete_with(store: &RedisStore, key: &str, messages: &[OutboxMessage]) {
    let token = idem_core::store::Token::random();
    let claim = idem_testkit::claim(key, &token, 30_000, 60_000, None);
    store.claim(claim).await.unwrap();
    let reply = store
        .complete(
            Complete::new(key, &token, idem_core::store::ValueKind::Json, b"1").outbox(messages),
        )
        .await
        .unwrap();
    assert!(reply.is_done(), "{reply:?}");
}

/// A message's headers are stored with it in the complete's step and the
/// relay hands the sink the message exactly as the call made it: every
/// header byte-identical, in order, a repeated name kept, whatever the
/// names and values hold. A message without headers, even beside one
/// with them, is stored as before headers existed (four fields, no
/// `headers`) and is sent without headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_stored_with_the_message_and_sent_byte_identical() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    let header = |n: &str, v: &str| (n.to_owned(), v.to_owned());
    let traced = OutboxMessage::new(
        message_id("outbox:h:1", "orders"),
        "orders",
        "o-1",
        bytes::Bytes::from_static(br#"{"order":1}"#),
    )
    .with_headers(vec![
        header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ),
        header("tracestate", "b=2,a=1"),
        header("x", "3:abc,"),
        header("x", "line\nbreak é"),
        header("empty", ""),
    ]);
    let plain = OutboxMessage::new(
        message_id("outbox:h:1", "orders#1"),
        "orders",
        "o-2",
        bytes::Bytes::from_static(br#"{"order":2}"#),
    );
    complete_with(&store, "outbox:h:1", &[traced.clone(), plain.clone()]).await;
    // A call whose messages have no headers: the layout of before.
    let untraced = OutboxMessage::new(
        message_id("outbox:h:2", "orders"),
        "orders",
        "o-3",
        bytes::Bytes::from_static(br#"{"order":3}"#),
    );
    complete_with(&store, "outbox:h:2", std::slice::from_ref(&untraced)).await;

    let entries = raw_entries(&ctx, "idem-outbox").await;
    assert_eq!(entries.len(), 3);
    assert_eq!(
        names(&entries[0]),
        ["id", "topic", "key", "payload", "headers"]
    );
    assert_eq!(names(&entries[1]), ["id", "topic", "key", "payload"]);
    assert_eq!(names(&entries[2]), ["id", "topic", "key", "payload"]);

    let broker = Arc::new(Broker::default());
    drain(&RedisRelay::new(&store, Arc::clone(&broker))).await;
    let sent = broker.confirmed.lock().unwrap().clone();
    assert_eq!(sent, vec![traced, plain, untraced]);
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
}

/// Entries written before headers existed (no `headers` field) are read
/// and sent as messages without headers. An entry whose `headers` idem
/// cannot decode (written by something else) is sent without headers
/// rather than held back: the trace link is lost, not the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_without_readable_headers_are_sent_without_headers() {
    let ctx = TestContext::redis().await;
    let store = ctx.redis_store().clone();
    ctx.server().cli(&[
        "XADD",
        "idem-outbox",
        "*",
        "id",
        "old-1",
        "topic",
        "orders",
        "key",
        "o-1",
        "payload",
        "{}",
    ]);
    ctx.server().cli(&[
        "XADD",
        "idem-outbox",
        "*",
        "id",
        "bad-1",
        "topic",
        "orders",
        "key",
        "o-2",
        "payload",
        "{}",
        "headers",
        "11:traceparent",
    ]);
    let broker = Arc::new(Broker::default());
    drain(&RedisRelay::new(&store, Arc::clone(&broker))).await;
    let sent = broker.confirmed.lock().unwrap().clone();
    assert_eq!(
        sent,
        vec![
            OutboxMessage::new("old-1", "orders", "o-1", "{}"),
            OutboxMessage::new("bad-1", "orders", "o-2", "{}"),
        ]
    );
    assert_eq!(stream_len(&ctx, "idem-outbox"), 0);
}
