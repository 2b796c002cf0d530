//! The outbox: a message commits with the call's result or not at all, and
//! the relay publishes each at least once, in order per key, with any
//! number of relays, parking what the broker refuses without blocking other
//! keys. The sink here is an in-process recorder (the brokers' sinks are
//! tested against real brokers in idem-consumer); the table, locks and
//! notifications are PostgreSQL's own.

use crate::support::{DbStore, TestDb};
use async_trait::async_trait;
use idem_core::outbox::{OutboxMessage, Sink, SinkError, message_id};
use idem_core::{Error, Idempotency};
use idem_postgres::RunInTx;
use idem_postgres::outbox::{self, Relay};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Records what it is sent; refuses payloads containing "poison"; fails
/// the first `fail_first` sends as unavailable; notes any key sent by two
/// passes at once.
#[derive(Default)]
struct Recorder {
    sent: Mutex<Vec<OutboxMessage>>,
    fail_first: AtomicU32,
    delay: Option<Duration>,
    in_flight: Mutex<HashSet<String>>,
    overlaps: AtomicUsize,
    /// Signalled when a send starts.
    entered: tokio::sync::Notify,
}

#[async_trait]
impl Sink for Recorder {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        self.entered.notify_one();
        {
            let mut flying = self.in_flight.lock().unwrap();
            for m in batch {
                if !flying.insert(m.key.clone()) {
                    self.overlaps.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        if let Some(d) = self.delay {
            tokio::time::sleep(d).await;
        }
        let out = batch
            .iter()
            .map(|m| {
                if self
                    .fail_first
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok()
                {
                    return Err(SinkError::unavailable("broker restarting"));
                }
                if m.payload.windows(6).any(|w| w == b"poison") {
                    return Err(SinkError::refused("message too large for topic"));
                }
                self.sent.lock().unwrap().push(m.clone());
                Ok(())
            })
            .collect();
        let mut flying = self.in_flight.lock().unwrap();
        for m in batch {
            flying.remove(&m.key);
        }
        out
    }

    fn describe(&self) -> String {
        "recorder".into()
    }
}

impl Recorder {
    fn ids(&self) -> Vec<String> {
        self.sent
            .lock()
            .unwrap()
            .iter()
            .map(|m| m.id.clone())
            .collect()
    }
    /// Each key's payloads, in the order they were sent.
    fn by_key(&self) -> HashMap<String, Vec<String>> {
        let mut out: HashMap<String, Vec<String>> = HashMap::new();
        for m in self.sent.lock().unwrap().iter() {
            let v: String = serde_json::from_slice(&m.payload).unwrap();
            out.entry(m.key.clone()).or_default().push(v);
        }
        out
    }
}

async fn setup() -> (TestDb, Idempotency) {
    let db = TestDb::new().await;
    db.exec("CREATE TABLE orders (id bigserial PRIMARY KEY, req text NOT NULL)")
        .await;
    let idem = db.builder().await.namespace("t").build();
    (db, idem)
}

async fn outbox_rows(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM idem_keys_outbox").await
}

/// Publishes `values` under `key` in one plain transaction each, in order.
async fn publish_each(db: &TestDb, key: &str, values: &[String]) {
    let ob = db.store().await.outbox();
    for v in values {
        let mut tx = db.pool.begin().await.unwrap();
        ob.publish_with_id(&mut tx, "t.topic", key, &format!("{key}/{v}"), v)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
}

async fn drain<S: Sink>(relay: &Relay<S>) {
    for _ in 0..100 {
        if relay.drain_once().await.unwrap().sent == 0 {
            return;
        }
    }
}

#[tokio::test]
async fn the_message_commits_with_the_result_or_not_at_all() {
    let (db, idem) = setup().await;
    let pool = db.pool.clone();
    // Err after publishing: the order and the message roll back together.
    let failed: Result<i64, Error> = idem
        .call("orders.create", "r1")
        .run_in_tx(&pool, async |tx| {
            sqlx::query("INSERT INTO orders (req) VALUES ('r1')")
                .execute(&mut *tx)
                .await
                .unwrap();
            outbox::publish(tx, "orders.created", "r1", &"first try").await?;
            Err(Error::codec("card declined"))
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(outbox_rows(&db).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM orders").await, 0);
    // The retry commits both, and two messages to one topic get two names.
    let id: i64 = idem
        .call("orders.create", "r1")
        .run_in_tx(&pool, async |tx| {
            let (id,): (i64,) =
                sqlx::query_as("INSERT INTO orders (req) VALUES ('r1') RETURNING id")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
            outbox::publish(tx, "orders.created", "r1", &"created").await?;
            outbox::publish(tx, "orders.created", "r1", &"again").await?;
            outbox::publish(tx, "billing.due", "r1", &500).await?;
            Ok::<_, Error>(id)
        })
        .await
        .unwrap();
    assert!(id > 0);
    let rows: Vec<(String, String)> =
        sqlx::query_as("SELECT id, topic FROM idem_keys_outbox ORDER BY seq")
            .fetch_all(&db.pool)
            .await
            .unwrap();
    let record = "t:orders.create:r1";
    let (stored,): (String,) = sqlx::query_as("SELECT key FROM idem_keys")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(stored.ends_with(record), "record key {stored}");
    assert_eq!(
        rows,
        vec![
            (
                message_id(&stored, "orders.created"),
                "orders.created".to_owned()
            ),
            (
                message_id(&stored, "orders.created#1"),
                "orders.created".to_owned()
            ),
            (message_id(&stored, "billing.due"), "billing.due".to_owned()),
        ]
    );
    // A duplicate request replays: the body does not run, nothing more is published.
    let again: i64 = idem
        .call("orders.create", "r1")
        .run_in_tx(&pool, async |_tx| -> Result<i64, Error> {
            panic!("replayed calls do not run")
        })
        .await
        .unwrap();
    assert_eq!(again, id);
    assert_eq!(outbox_rows(&db).await, 3);
}

#[tokio::test]
async fn bad_input_fails_the_body_and_commits_nothing() {
    let (db, idem) = setup().await;
    let pool = db.pool.clone();
    // JSON has no map with non-string keys.
    let unserializable: HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    let r: Result<(), Error> = idem
        .call("orders.create", "bad")
        .run_in_tx(&pool, async |tx| {
            sqlx::query("INSERT INTO orders (req) VALUES ('bad')")
                .execute(&mut *tx)
                .await
                .unwrap();
            outbox::publish(tx, "orders.created", "bad", &unserializable).await?;
            Ok(())
        })
        .await;
    let e = r.unwrap_err();
    assert!(matches!(e, Error::Codec { .. }), "{e}");
    assert!(e.to_string().contains("cannot be serialized"), "{e}");
    for (topic, key) in [
        ("", "k"),
        ("t", ""),
        ("t\n", "k"),
        ("t", &"k".repeat(600)[..]),
    ] {
        let r: Result<(), Error> = idem
            .call("orders.create", "bad")
            .run_in_tx(&pool, async |tx| outbox::publish(tx, topic, key, &1).await)
            .await;
        assert!(
            matches!(r, Err(Error::InvalidConfig(_))),
            "{topic:?} {key:?}: {r:?}"
        );
    }
    assert_eq!(outbox_rows(&db).await, 0);
    assert_eq!(db.count("SELECT count(*) FROM orders").await, 0);
    // Outside run_in_tx there is no call to derive the id from.
    let mut tx = db.pool.begin().await.unwrap();
    let e = outbox::publish(&mut tx, "t", "k", &1).await.unwrap_err();
    assert!(e.to_string().contains("publish_with_id"), "{e}");
    // With an id of one's own, twice: one message.
    let ob = db.store().await.outbox();
    ob.publish_with_id(&mut tx, "t", "k", "id-1", &1)
        .await
        .unwrap();
    ob.publish_with_id(&mut tx, "t", "k", "id-1", &1)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(outbox_rows(&db).await, 1);
}

#[tokio::test]
async fn the_relay_sends_in_order_per_key_and_deletes_what_was_confirmed() {
    let (db, _idem) = setup().await;
    for k in ["a", "b", "c"] {
        let values: Vec<String> = (0..7).map(|i| format!("{i}")).collect();
        publish_each(&db, k, &values).await;
    }
    let sink = Arc::new(Recorder::default());
    let relay = Relay::new(&db.store().await, Arc::clone(&sink)).batch_size(4);
    drain(&relay).await;
    let by_key = sink.by_key();
    for k in ["a", "b", "c"] {
        let want: Vec<String> = (0..7).map(|i| format!("{i}")).collect();
        assert_eq!(by_key[k], want, "key {k}");
    }
    assert_eq!(sink.ids().len(), 21);
    assert_eq!(outbox_rows(&db).await, 0);
    assert_eq!(sink.overlaps.load(Ordering::SeqCst), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_relays_never_send_one_key_at_once_and_each_message_once() {
    let (db, _idem) = setup().await;
    let keys = 12;
    let per_key = 15;
    // Producers and relays at once: the relays see keys grow while they work.
    let producers: Vec<_> = (0..keys)
        .map(|k| {
            let db_pool = db.pool.clone();
            tokio::spawn(async move {
                let ob = idem_postgres::PgStore::from_pool(db_pool.clone()).outbox();
                for i in 0..per_key {
                    let mut tx = db_pool.begin().await.unwrap();
                    let key = format!("k{k}");
                    ob.publish_with_id(
                        &mut tx,
                        "t",
                        &key,
                        &format!("{key}/{i}"),
                        &format!("{i:02}"),
                    )
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                }
            })
        })
        .collect();
    let sink = Arc::new(Recorder {
        delay: Some(Duration::from_millis(2)),
        ..Recorder::default()
    });
    let store = db.store().await;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let relays: Vec<_> = (0..4)
        .map(|_| {
            let relay = Relay::new(&store, Arc::clone(&sink))
                .batch_size(5)
                .poll_interval(Duration::from_millis(50));
            let mut stopped = stopped.clone();
            tokio::spawn(async move {
                relay
                    .run(async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    })
                    .await
            })
        })
        .collect();
    for p in producers {
        p.await.unwrap();
    }
    // Wait (bounded) until everything was sent, then stop the relays.
    for _ in 0..600 {
        if outbox_rows(&db).await == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.send(true).unwrap();
    let mut total = 0;
    for r in relays {
        total += r.await.unwrap().sent;
    }
    assert_eq!(outbox_rows(&db).await, 0);
    assert_eq!(total, (keys * per_key) as u64);
    let ids = sink.ids();
    assert_eq!(ids.len(), keys * per_key, "each message sent once");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), keys * per_key);
    for (k, values) in sink.by_key() {
        let want: Vec<String> = (0..per_key).map(|i| format!("{i:02}")).collect();
        assert_eq!(values, want, "key {k} out of order");
    }
    assert_eq!(
        sink.overlaps.load(Ordering::SeqCst),
        0,
        "a key was sent by two relays at once"
    );
}

#[tokio::test]
async fn a_refused_message_is_parked_with_its_reason_and_blocks_only_its_key() {
    let (db, _idem) = setup().await;
    publish_each(&db, "a", &["1".into(), "poison".into(), "3".into()]).await;
    publish_each(&db, "b", &["1".into(), "2".into()]).await;
    let sink = Arc::new(Recorder::default());
    let store = db.store().await;
    let relay = Relay::new(&store, Arc::clone(&sink));
    let pass = relay.drain_once().await.unwrap();
    assert_eq!((pass.sent, pass.parked), (3, 1), "{pass:?}");
    drain(&relay).await;
    let by_key = sink.by_key();
    assert_eq!(by_key["a"], vec!["1"]);
    assert_eq!(by_key["b"], vec!["1", "2"]);
    let ob = store.outbox();
    let parked = ob.parked(10).await.unwrap();
    assert_eq!(parked.len(), 1);
    assert_eq!(parked[0].id, "a/poison");
    assert_eq!(parked[0].key, "a");
    assert_eq!(parked[0].attempts, 1);
    assert!(
        parked[0].reason.as_deref().unwrap().contains("too large"),
        "{parked:?}"
    );
    let backlog = ob.backlog().await.unwrap();
    assert_eq!((backlog.pending, backlog.parked), (1, 1));
    // Dropping it unblocks the key: "3" goes next.
    assert!(ob.retry("no-such-id").await.is_ok_and(|found| !found));
    let dropped = ob.drop_parked("a/poison").await.unwrap().unwrap();
    assert_eq!(dropped.topic, "t.topic");
    assert!(
        ob.drop_parked("a/3").await.unwrap().is_none(),
        "only parked messages are dropped"
    );
    drain(&relay).await;
    assert_eq!(sink.by_key()["a"], vec!["1", "3"]);
    assert_eq!(outbox_rows(&db).await, 0);
}

#[tokio::test]
async fn a_parked_message_retried_goes_first_in_its_key() {
    let (db, _idem) = setup().await;
    publish_each(&db, "a", &["poison".into(), "2".into()]).await;
    let sink = Arc::new(Recorder::default());
    let store = db.store().await;
    let relay = Relay::new(&store, Arc::clone(&sink));
    drain(&relay).await;
    assert!(sink.ids().is_empty());
    // The operator fixes the cause (here: the sink accepts it now) and retries.
    sqlx::query("UPDATE idem_keys_outbox SET payload = convert_to('\"fixed\"', 'UTF8') WHERE id = 'a/poison'")
        .execute(&db.pool)
        .await
        .unwrap();
    assert_eq!(store.outbox().retry_all().await.unwrap(), 1);
    drain(&relay).await;
    assert_eq!(sink.by_key()["a"], vec!["fixed", "2"]);
}

#[tokio::test]
async fn an_unavailable_broker_keeps_the_rows_and_the_retry_has_the_same_id_and_order() {
    let (db, _idem) = setup().await;
    publish_each(&db, "a", &["1".into(), "2".into()]).await;
    let sink = Arc::new(Recorder {
        fail_first: AtomicU32::new(1),
        ..Recorder::default()
    });
    let store = db.store().await;
    let relay = Relay::new(&store, Arc::clone(&sink))
        .retry_backoff(Duration::from_millis(300), Duration::from_secs(1));
    let pass = relay.drain_once().await.unwrap();
    assert_eq!((pass.sent, pass.failed), (0, 1), "{pass:?}");
    assert!(pass.retry_in.is_some());
    let (attempts, err): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM idem_keys_outbox WHERE id = 'a/1'")
            .fetch_one(&db.pool)
            .await
            .unwrap();
    assert_eq!(attempts, 1);
    assert!(err.contains("restarting"), "{err}");
    // The key waits for its head's retry time; "2" never overtakes "1".
    let early = relay.drain_once().await.unwrap();
    assert_eq!(early.sent, 0);
    assert!(sink.ids().is_empty());
    tokio::time::sleep(Duration::from_millis(400)).await;
    drain(&relay).await;
    assert_eq!(sink.by_key()["a"], vec!["1", "2"]);
    assert_eq!(sink.ids(), vec!["a/1", "a/2"]);
    assert_eq!(outbox_rows(&db).await, 0);
}

/// Never confirms.
struct Hangs;

#[async_trait]
impl Sink for Hangs {
    async fn send(&self, _batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        std::future::pending().await
    }
    fn describe(&self) -> String {
        "hangs".into()
    }
}

#[tokio::test]
async fn a_broker_that_never_confirms_is_cut_off_and_a_relay_killed_mid_send_loses_nothing() {
    let (db, _idem) = setup().await;
    publish_each(&db, "a", &["1".into()]).await;
    let store = db.store().await;
    let relay = Relay::new(&store, Hangs).send_timeout(Duration::from_millis(200));
    let pass = relay.drain_once().await.unwrap();
    assert_eq!(pass.failed, 1);
    let (err,): (String,) = sqlx::query_as("SELECT last_error FROM idem_keys_outbox")
        .fetch_one(&db.pool)
        .await
        .unwrap();
    assert!(err.contains("did not confirm"), "{err}");
    sqlx::query("UPDATE idem_keys_outbox SET retry_at = NULL")
        .execute(&db.pool)
        .await
        .unwrap();
    // A relay stopped mid-send (its task dropped, as a crash would): the
    // transaction aborts, the row stays, the next relay sends it.
    let hung = Relay::new(&store, Hangs);
    let killed = tokio::spawn(async move { hung.drain_once().await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    killed.abort();
    let _ = killed.await;
    let sink = Arc::new(Recorder::default());
    let relay = Relay::new(&store, Arc::clone(&sink));
    for _ in 0..50 {
        if !sink.ids().is_empty() {
            break;
        }
        relay.drain_once().await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sink.ids(), vec!["a/1"]);
    assert_eq!(outbox_rows(&db).await, 0);
}

#[tokio::test]
async fn run_wakes_on_notify_and_finishes_its_pass_on_shutdown() {
    let (db, idem) = setup().await;
    let store = db.store().await;
    let sink = Arc::new(Recorder::default());
    // A poll this long never fires in the test: only NOTIFY wakes it.
    let relay = Relay::new(&store, Arc::clone(&sink)).poll_interval(Duration::from_secs(3600));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(async move {
        relay
            .run(async {
                let _ = stopped.await;
            })
            .await
    });
    // Let the relay LISTEN (its first pass finds nothing).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pool = db.pool.clone();
    idem.call("orders.create", "n1")
        .run_in_tx(&pool, async |tx| {
            outbox::publish(tx, "orders.created", "n1", &"hello").await
        })
        .await
        .unwrap();
    for _ in 0..300 {
        if !sink.ids().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sink.ids().len(), 1, "NOTIFY did not wake the relay");
    // Asleep again, it asked inserts to notify; a second message wakes it too.
    for _ in 0..300 {
        if db
            .count("SELECT count(*) FROM idem_keys_outbox_wake WHERE idle")
            .await
            == 1
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    idem.call("orders.create", "n2")
        .run_in_tx(&pool, async |tx| {
            outbox::publish(tx, "orders.created", "n2", &"again").await
        })
        .await
        .unwrap();
    for _ in 0..300 {
        if sink.ids().len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sink.ids().len(),
        2,
        "the second NOTIFY did not wake the relay"
    );
    stop.send(()).unwrap();
    let report = running.await.unwrap();
    assert_eq!(report.sent, 2);
}

#[tokio::test]
async fn a_blocked_key_with_a_long_backlog_hides_no_other_key() {
    let (db, _idem) = setup().await;
    // Key "a": a refused head and 300 messages behind it, all older than
    // key "b"'s one message; passes of 8 messages.
    let mut values = vec!["poison".to_owned()];
    values.extend((0..300).map(|i| format!("{i}")));
    let ob = db.store().await.outbox();
    let mut tx = db.pool.begin().await.unwrap();
    for v in &values {
        ob.publish_with_id(&mut tx, "t.topic", "a", &format!("a/{v}"), v)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    publish_each(&db, "b", &["1".into()]).await;
    let sink = Arc::new(Recorder::default());
    let relay = Relay::new(&db.store().await, Arc::clone(&sink)).batch_size(8);
    for _ in 0..5 {
        relay.drain_once().await.unwrap();
    }
    let by_key = sink.by_key();
    assert_eq!(
        by_key.get("b").map(Vec::len),
        Some(1),
        "key b was starved: {by_key:?}"
    );
    assert!(!by_key.contains_key("a"));
    // And a key another relay is busy with hides none either: one relay
    // holds "c" (a long key) mid-send, another still sends "d", though all
    // of "c"'s 40 rows are older.
    let (db, _idem) = setup().await;
    let long: Vec<String> = (0..300).map(|i| format!("{i}")).collect();
    publish_each(&db, "c", &long[..40]).await;
    publish_each(&db, "d", &["1".into()]).await;
    let store = db.store().await;
    let slow = Arc::new(Recorder {
        delay: Some(Duration::from_secs(2)),
        ..Recorder::default()
    });
    // One message a pass: it takes "c" (keys go by name) and holds it.
    let busy = Relay::new(&store, Arc::clone(&slow)).batch_size(1);
    let holding = tokio::spawn(async move { busy.drain_once().await });
    slow.entered.notified().await;
    let fast = Arc::new(Recorder::default());
    let other = Relay::new(&store, Arc::clone(&fast)).batch_size(8);
    other.drain_once().await.unwrap();
    holding.await.unwrap().unwrap();
    let sent: Vec<String> = fast
        .sent
        .lock()
        .unwrap()
        .iter()
        .map(|m| m.key.clone())
        .collect();
    assert!(sent.iter().all(|k| k == "d") && sent.len() == 1, "{sent:?}");
}

#[tokio::test]
async fn a_message_committed_after_later_ones_were_relayed_is_still_sent() {
    let (db, _idem) = setup().await;
    let store = db.store().await;
    let ob = store.outbox();
    // An early insert (lower seq) whose transaction commits last.
    let mut slow = db.pool.begin().await.unwrap();
    ob.publish_with_id(&mut slow, "t.topic", "late", "late/1", &"1")
        .await
        .unwrap();
    for v in ["1", "2"] {
        let mut tx = db.pool.begin().await.unwrap();
        ob.publish_with_id(&mut tx, "t.topic", "b", &format!("b/{v}"), &v)
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let sink = Arc::new(Recorder::default());
    let relay = Relay::new(&store, Arc::clone(&sink));
    drain(&relay).await;
    assert_eq!(sink.ids(), vec!["b/1", "b/2"]);
    slow.commit().await.unwrap();
    for _ in 0..100 {
        relay.drain_once().await.unwrap();
        if sink.ids().len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sink.ids(), vec!["b/1", "b/2", "late/1"]);
    assert_eq!(outbox_rows(&db).await, 0);
}

/// A sink that holds its send until released: the pass keeps its row locks
/// meanwhile, as a pass waiting on a slow broker does.
#[derive(Default)]
struct Held {
    entered: tokio::sync::Notify,
    release: tokio::sync::Notify,
}

#[async_trait]
impl Sink for Held {
    async fn send(&self, batch: &[OutboxMessage]) -> Vec<Result<(), SinkError>> {
        self.entered.notify_one();
        self.release.notified().await;
        batch.iter().map(|_| Ok(())).collect()
    }

    fn describe(&self) -> String {
        "held".into()
    }
}

/// Every process runs `migrate()` at its start, while the others work. With
/// the schema in place it must take no table lock: it used to take ACCESS
/// EXCLUSIVE on the records table (`ALTER TABLE … ADD COLUMN IF NOT
/// EXISTS`) and on the outbox (`DROP TRIGGER`, after the SHARE lock of
/// `CREATE INDEX IF NOT EXISTS`), so it waited for a relay pass in flight
/// (up to its send timeout) while every call queued behind it, and when the
/// pass went on to delete its rows the two deadlocked (SQLSTATE 40P01; seen
/// in tests/it/orders_outbox_example.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_migrating_while_a_relay_pass_holds_its_rows_neither_waits_nor_deadlocks() {
    let (db, idem) = setup().await;
    publish_each(&db, "k", &["a".to_owned()]).await;
    let held = Arc::new(Held::default());
    let relay = Relay::new(&db.store().await, held.clone());
    let pass = tokio::spawn(async move { relay.drain_once().await });
    held.entered.notified().await;

    let starting = idem_postgres::PgStore::from_pool(db.pool.clone());
    let migrated = tokio::time::timeout(Duration::from_secs(5), starting.migrate()).await;
    // Calls go on meanwhile.
    let call = tokio::time::timeout(
        Duration::from_secs(5),
        idem.call("s", "during-migrate")
            .run_in_tx(&db.pool, async |tx| {
                outbox::publish(tx, "t.topic", "other", &1).await?;
                Ok::<_, Error>(1)
            }),
    )
    .await;
    held.release.notify_one();
    let report = pass.await.unwrap();
    assert!(
        matches!(migrated, Ok(Ok(()))),
        "migrate() with the schema in place waited behind the relay's pass: {migrated:?}"
    );
    assert!(matches!(call, Ok(Ok(1))), "{call:?}");
    assert_eq!(report.unwrap().sent, 1, "the pass was not aborted");
}

/// A key's later messages never overtake an earlier one
/// that cannot go now. Key `a`'s second message waits out a retry backoff,
/// key `b`'s second is parked; each key's head is sendable. A pass sends
/// the heads and stops each key there: neither third message goes ahead of
/// its key's second.
#[tokio::test]
async fn a_later_message_never_overtakes_one_in_backoff_or_parked() {
    let (db, _idem) = setup().await;
    let three = ["1".to_owned(), "2".to_owned(), "3".to_owned()];
    publish_each(&db, "a", &three).await;
    publish_each(&db, "b", &three).await;
    db.exec("UPDATE idem_keys_outbox SET attempts = 1, retry_at = now() + interval '1 hour' WHERE id = 'a/2'")
        .await;
    db.exec("UPDATE idem_keys_outbox SET attempts = 1, parked_at = now(), last_error = 'refused' WHERE id = 'b/2'")
        .await;
    let sink = Arc::new(Recorder::default());
    let store = db.store().await;
    let relay = Relay::new(&store, Arc::clone(&sink));
    drain(&relay).await;
    let sent = sink.by_key();
    assert_eq!(sent["a"], vec!["1"], "a message overtook one in backoff");
    assert_eq!(sent["b"], vec!["1"], "a message overtook a parked one");
    assert_eq!(outbox_rows(&db).await, 4);
    // Unblocked, the rest goes in order.
    db.exec("UPDATE idem_keys_outbox SET retry_at = NULL WHERE id = 'a/2'")
        .await;
    assert_eq!(store.outbox().retry_all().await.unwrap(), 1);
    drain(&relay).await;
    let sent = sink.by_key();
    assert_eq!(sent["a"], vec!["1", "2", "3"]);
    assert_eq!(sent["b"], vec!["1", "2", "3"]);
}
