//! Durable steps (`Call::run_steps`): each row of docs/steps.md's semantics table,
//! against a real redis-server, a Redis Cluster, PostgreSQL and
//! MemoryStore. Side effects are counted in a ledger outside the store
//! (atomic counters), and counted exactly.

use idem::store::{Complete, Token, WriteReply};
use idem::{CallOutcome, Error, Idempotency, KeyState, Outcome, Steps};
use idem_testkit::{TestContext, claim};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};

idem_testkit::every_store!(
    namespace = "steps", stores = [redis, cluster, postgres, postgres_partitioned, dynamodb, memory];
    steps_run_once_then_the_result_replays,
    a_crash_between_steps_resumes_after_the_finished_ones,
    a_failed_step_resumes_at_that_step,
    a_failure_before_any_step_releases,
    abandon_forgets_the_steps,
    duplicate_and_invalid_names_are_typed_errors,
    old_owner_cannot_record_a_step,
    store_records_steps_for_the_owner_only,
    racing_calls_run_each_step_once,
    fingerprint_mismatch_keeps_its_meaning,
    a_consumer_redelivery_resumes_after_the_finished_steps,
    a_cancelled_call_with_release_on_cancel_keeps_its_steps,
    a_step_does_not_start_once_the_lease_is_known_lost,
);

type Res<T> = Result<T, Error>;

/// An external ledger: how many times each named effect happened.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, usize>>>);

impl Ledger {
    fn hit(&self, what: &str) {
        *self.0.lock().unwrap().entry(what.to_owned()).or_default() += 1;
    }
    fn count(&self, what: &str) -> usize {
        self.0.lock().unwrap().get(what).copied().unwrap_or(0)
    }
}

/// The checkout: reserve, charge, e-mail, each an effect in the ledger.
async fn checkout(s: &Steps, ledger: &Ledger) -> Res<(u32, String)> {
    let hold = s
        .step("reserve", async || {
            ledger.hit("reserve");
            Res::Ok(7u32)
        })
        .await?;
    let charge = s
        .step("charge", async || {
            ledger.hit("charge");
            Res::Ok(format!("ch_{hold}"))
        })
        .await?;
    s.step("email", async || {
        ledger.hit("email");
        Res::Ok(())
    })
    .await?;
    Ok((hold, charge))
}

async fn steps_run_once_then_the_result_replays(b: TestContext) {
    let idem = b.idem();
    let ledger = Ledger::default();
    let (v, o) = idem
        .call("orders", "once")
        .run_steps_outcome(async |s| checkout(s, &ledger).await)
        .await
        .unwrap();
    assert_eq!((v, o), ((7, "ch_7".to_owned()), Outcome::Executed));
    let (v, o) = idem
        .call("orders", "once")
        .run_steps_outcome(async |s| checkout(s, &ledger).await)
        .await
        .unwrap();
    assert_eq!((v, o), ((7, "ch_7".to_owned()), Outcome::Replayed));
    for e in ["reserve", "charge", "email"] {
        assert_eq!(ledger.count(e), 1, "{e}");
    }
    // Completion dropped the steps: the record is a plain completed one.
    let info = idem.inspect("orders", "once").await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::Completed);
    assert!(info.steps.is_empty());
}

/// A holder dies (its task is aborted: no complete, no release) after its
/// second step was recorded; the next call takes over when the lease runs
/// out, replays the two finished steps and runs only the third.
async fn a_crash_between_steps_resumes_after_the_finished_ones(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let ledger = Ledger::default();
    let (at_crash, crashed) = oneshot::channel();
    let (i2, l2) = (idem.clone(), ledger.clone());
    let first = tokio::spawn(async move {
        let mut at_crash = Some(at_crash);
        i2.call("orders", "crash")
            .run_steps(async |s| {
                s.step("reserve", async || {
                    l2.hit("reserve");
                    Res::Ok(7u32)
                })
                .await?;
                s.step("charge", async || {
                    l2.hit("charge");
                    Res::Ok("ch_7".to_owned())
                })
                .await?;
                if let Some(tx) = at_crash.take() {
                    let _ = tx.send(());
                }
                std::future::pending::<Res<(u32, String)>>().await
            })
            .await
    });
    crashed.await.unwrap();
    first.abort();
    let _ = first.await;
    let info = idem.inspect("orders", "crash").await.unwrap().unwrap();
    assert_eq!(info.steps, ["reserve", "charge"]);

    let (v, o) = idem
        .call("orders", "crash")
        .wait(Duration::from_secs(30))
        .run_steps_outcome(async |s| {
            let v = checkout(s, &ledger).await?;
            assert_eq!(s.replayed(), 2);
            Res::Ok(v)
        })
        .await
        .unwrap();
    assert_eq!((v, o), ((7, "ch_7".to_owned()), Outcome::Recovered));
    assert_eq!(
        (
            ledger.count("reserve"),
            ledger.count("charge"),
            ledger.count("email")
        ),
        (1, 1, 1)
    );
}

async fn a_failed_step_resumes_at_that_step(b: TestContext) {
    // The hook hears how many steps each call replayed.
    let replays = Arc::new(Mutex::new(Vec::new()));
    let heard = replays.clone();
    let idem = b.idem_with(|x| {
        x.on_outcome(move |e| heard.lock().unwrap().push((e.outcome, e.steps_replayed)))
    });
    let ledger = Ledger::default();
    let smtp_up = AtomicUsize::new(0);
    let attempt = async || {
        idem.call("orders", "fail")
            .run_steps_outcome(async |s| {
                let hold = s
                    .step("reserve", async || {
                        ledger.hit("reserve");
                        Res::Ok(7u32)
                    })
                    .await?;
                s.step("email", async || {
                    ledger.hit("email");
                    if smtp_up.fetch_add(1, Ordering::SeqCst) == 0 {
                        Err(Error::codec("smtp down"))
                    } else {
                        Ok(())
                    }
                })
                .await?;
                Res::Ok(hold)
            })
            .await
    };
    let first = attempt().await;
    assert!(matches!(first, Err(Error::Codec { .. })), "{first:?}");
    // The lease was freed at once, the finished step kept.
    let info = idem.inspect("orders", "fail").await.unwrap().unwrap();
    assert_eq!(info.steps, ["reserve"]);
    assert!(!info.is_held());
    let (v, o) = attempt().await.unwrap();
    assert_eq!((v, o), (7, Outcome::Recovered));
    assert_eq!((ledger.count("reserve"), ledger.count("email")), (1, 2));
    assert_eq!(
        *replays.lock().unwrap(),
        [(CallOutcome::BodyError, 0), (CallOutcome::Recovered, 1)]
    );
}

async fn a_failure_before_any_step_releases(b: TestContext) {
    let idem = b.idem();
    let r: Res<u8> = idem
        .call("orders", "early")
        .run_steps(async |_s| Err(Error::codec("invalid order")))
        .await;
    assert!(r.is_err());
    assert!(idem.inspect("orders", "early").await.unwrap().is_none());
    let (_, o) = idem
        .call("orders", "early")
        .run_steps_outcome(async |_s| Res::Ok(1u8))
        .await
        .unwrap();
    assert_eq!(o, Outcome::Executed);
}

async fn abandon_forgets_the_steps(b: TestContext) {
    let idem = b.idem();
    let ledger = Ledger::default();
    let r: Res<u8> = idem
        .call("orders", "declined")
        .run_steps(async |s| {
            s.step("reserve", async || {
                ledger.hit("reserve");
                Res::Ok(1u8)
            })
            .await?;
            s.abandon();
            Err(Error::codec("card declined"))
        })
        .await;
    assert!(r.is_err());
    assert!(idem.inspect("orders", "declined").await.unwrap().is_none());
    let (_, o) = idem
        .call("orders", "declined")
        .run_steps_outcome(async |s| {
            s.step("reserve", async || {
                ledger.hit("reserve");
                Res::Ok(1u8)
            })
            .await
        })
        .await
        .unwrap();
    assert_eq!((o, ledger.count("reserve")), (Outcome::Executed, 2));
}

async fn duplicate_and_invalid_names_are_typed_errors(b: TestContext) {
    let idem = b.idem();
    let ran = AtomicUsize::new(0);
    let r: Res<()> = idem
        .call("orders", "dup")
        .run_steps(async |s| {
            s.step("a", async || Res::Ok(ran.fetch_add(1, Ordering::SeqCst)))
                .await?;
            s.step("a", async || Res::Ok(ran.fetch_add(1, Ordering::SeqCst)))
                .await?;
            Ok(())
        })
        .await;
    assert!(
        matches!(r, Err(Error::DuplicateStep { ref name }) if name == "a"),
        "{r:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    for bad in ["", "new\nline", &"x".repeat(129)] {
        let r: Res<()> = idem
            .call("orders", "badname")
            .run_steps(async |s| s.step(bad, async || Res::Ok(())).await)
            .await;
        assert!(matches!(r, Err(Error::InvalidStepName { .. })), "{r:?}");
    }
    // s.key: stable across calls and attempts, distinct per step and key.
    let k1: String = idem
        .call("orders", "keys")
        .run_steps(async |s| Res::Ok(s.key("charge")))
        .await
        .unwrap();
    let k2: (String, String) = idem
        .call("orders", "keys2")
        .run_steps(async |s| Res::Ok((s.key("charge"), s.key("email"))))
        .await
        .unwrap();
    let k3: (String, String) = idem
        .call("orders", "keys2")
        .ttl(Duration::from_secs(1))
        .run_steps(async |s| Res::Ok((s.key("x"), s.key("y"))))
        .await
        .unwrap();
    assert_ne!(k1, k2.0);
    assert_ne!(k2.0, k2.1);
    assert_eq!(k2, k3, "a replay returns the first run's keys");
}

/// A frozen holder (not renewing) loses the key to a takeover; when it
/// wakes up, its step still runs (the effect is in the ledger) but it
/// cannot record it: `StepLeaseLost`, and the new holder's record stands.
async fn old_owner_cannot_record_a_step(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let ledger = Ledger::default();
    let gate = Arc::new(Notify::new());
    let mut old = Box::pin(idem.call("orders", "frozen").run_steps(async |s| {
        gate.notified().await;
        s.step("charge", async || {
            ledger.hit("old charge");
            Res::Ok(1u8)
        })
        .await
    }));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut old)
            .await
            .is_err()
    );
    tokio::time::sleep(lease * 2).await;
    let (v, o) = idem
        .call("orders", "frozen")
        .run_steps_outcome(async |s| {
            s.step("charge", async || {
                ledger.hit("new charge");
                Res::Ok(2u8)
            })
            .await
        })
        .await
        .unwrap();
    assert_eq!((v, o), (2, Outcome::Recovered));
    gate.notify_one();
    let late = old.await;
    assert!(matches!(late, Err(Error::StepLeaseLost { .. })), "{late:?}");
    let (v, o) = idem
        .call("orders", "frozen")
        .run_steps_outcome(async |_s| Res::Ok(3u8))
        .await
        .unwrap();
    assert_eq!((v, o), (2, Outcome::Replayed));
    assert_eq!(
        (ledger.count("old charge"), ledger.count("new charge")),
        (1, 1)
    );
}

/// The store methods themselves: only the owner records; a re-sent step
/// is answered `Done` and stored once; a takeover reads the steps; suspend
/// frees the lease but keeps them; release and complete drop them.
async fn store_records_steps_for_the_owner_only(b: TestContext) {
    let store = b.store();
    let key = "steps:store:k1";
    let (a, c) = (Token::random(), Token::random());
    store
        .claim(claim(key, &a, 60_000, 120_000, None))
        .await
        .unwrap();
    assert_eq!(
        store.save_step(key, &a, "one", b"1").await.unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store.save_step(key, &a, "one", b"9").await.unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store.save_step(key, &a, "two", b"\"x|1:y\"").await.unwrap(),
        WriteReply::Done
    );
    assert_eq!(
        store.save_step(key, &c, "three", b"3").await.unwrap(),
        WriteReply::OtherOwner
    );
    let steps = store.steps(key, &a).await.unwrap().unwrap();
    let got: Vec<(&str, &[u8])> = steps
        .iter()
        .map(|s| (s.name.as_str(), &s.value[..]))
        .collect();
    assert_eq!(got, [("one", &b"1"[..]), ("two", &b"\"x|1:y\""[..])]);
    assert_eq!(store.steps(key, &c).await.unwrap(), None);
    // A lease renewal keeps the steps.
    assert_eq!(
        store
            .extend(key, &a, Duration::from_secs(60))
            .await
            .unwrap(),
        WriteReply::Done
    );
    assert_eq!(store.steps(key, &a).await.unwrap().unwrap().len(), 2);
    // Suspended: the lease is over at once, the steps stay; a takeover gets them.
    assert_eq!(store.suspend(key, &a).await.unwrap(), WriteReply::Done);
    let took = store
        .claim(claim(key, &c, 60_000, 120_000, None))
        .await
        .unwrap();
    assert_eq!(took, idem::store::ClaimReply::Acquired { attempt: 2 });
    assert_eq!(store.steps(key, &c).await.unwrap().unwrap().len(), 2);
    assert_eq!(
        store.save_step(key, &a, "late", b"0").await.unwrap(),
        WriteReply::OtherOwner
    );
    // The same token re-sending its claim keeps them too.
    store
        .claim(claim(key, &c, 60_000, 120_000, None))
        .await
        .unwrap();
    assert_eq!(store.steps(key, &c).await.unwrap().unwrap().len(), 2);
    let done = store
        .complete(Complete::new(key, &c, idem::store::ValueKind::Json, b"42"))
        .await
        .unwrap();
    assert_eq!(done, WriteReply::Done);
    assert_eq!(store.steps(key, &c).await.unwrap(), None);
    assert_eq!(
        store.save_step(key, &c, "after", b"0").await.unwrap(),
        WriteReply::AlreadyCompleted
    );

    // Suspend without steps is a release: the key is gone.
    let key2 = "steps:store:k2";
    store
        .claim(claim(key2, &a, 60_000, 120_000, None))
        .await
        .unwrap();
    assert_eq!(store.suspend(key2, &a).await.unwrap(), WriteReply::Done);
    assert!(store.inspect(key2, false).await.unwrap().is_none());
    // Release drops steps with the record.
    store
        .claim(claim(key2, &a, 60_000, 120_000, None))
        .await
        .unwrap();
    store.save_step(key2, &a, "one", b"1").await.unwrap();
    let info = store.inspect(key2, false).await.unwrap().unwrap();
    assert_eq!(info.steps, ["one"]);
    assert_eq!(store.release(key2, &a).await.unwrap(), WriteReply::Done);
    assert!(store.inspect(key2, false).await.unwrap().is_none());
}

/// 12 calls race on one key, some of them failing at the e-mail step the
/// first two times: every finished step happens exactly once, and all that
/// succeed agree on the result.
async fn racing_calls_run_each_step_once(b: TestContext) {
    let idem = b.idem();
    let ledger = Ledger::default();
    let email_failures = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..12 {
        let (idem, ledger, fails): (Idempotency, Ledger, _) =
            (idem.clone(), ledger.clone(), email_failures.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let r = idem
                    .call("orders", "race")
                    .wait(Duration::from_secs(30))
                    .run_steps(async |s| {
                        let (hold, charge) = (
                            s.step("reserve", async || {
                                ledger.hit("reserve");
                                Res::Ok(7u32)
                            })
                            .await?,
                            s.step("charge", async || {
                                ledger.hit("charge");
                                Res::Ok("ch_7".to_owned())
                            })
                            .await?,
                        );
                        s.step("email", async || {
                            ledger.hit("email");
                            if fails.fetch_add(1, Ordering::SeqCst) < 2 {
                                Err(Error::codec("smtp down"))
                            } else {
                                Ok(())
                            }
                        })
                        .await?;
                        Res::Ok((hold, charge))
                    })
                    .await;
                match r {
                    Ok(v) => return v,
                    Err(Error::Codec { .. }) => continue,
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), (7, "ch_7".to_owned()));
    }
    assert_eq!(
        (
            ledger.count("reserve"),
            ledger.count("charge"),
            ledger.count("email")
        ),
        (1, 1, 3)
    );
}

async fn fingerprint_mismatch_keeps_its_meaning(b: TestContext) {
    let idem = b.idem();
    let r: Res<u8> = idem
        .call("orders", "fp")
        .fingerprint(&1)
        .run_steps(async |s| {
            s.step("reserve", async || Res::Ok(1u8)).await?;
            Err(Error::codec("later"))
        })
        .await;
    assert!(r.is_err());
    let other: Res<u8> = idem
        .call("orders", "fp")
        .fingerprint(&2)
        .run_steps(async |s| s.step("reserve", async || Res::Ok(2u8)).await)
        .await;
    assert!(
        matches!(other, Err(Error::FingerprintMismatch)),
        "{other:?}"
    );
    let same: Res<u8> = idem
        .call("orders", "fp")
        .fingerprint(&1)
        .run_steps(async |s| s.step("reserve", async || Res::Ok(3u8)).await)
        .await;
    assert_eq!(same.unwrap(), 1);
}

/// A consumer handler made of steps: the first delivery fails at its
/// second step (retryable: nacked), the redelivery replays the first step
/// and runs the second; a duplicate after that is acked from the stored
/// result. The decision table is the one `handle` uses.
async fn a_consumer_redelivery_resumes_after_the_finished_steps(b: TestContext) {
    use idem::consumer::{Consumer, Message};
    let consumer = Consumer::new(b.idem(), "orders.ship");
    let ledger = Ledger::default();
    let label_down = AtomicUsize::new(1);
    let handler = async |m: Message, s: &Steps| -> Res<String> {
        let parcel = s
            .step("parcel", async || {
                ledger.hit("parcel");
                Res::Ok(format!("parcel-{}", m.id().unwrap_or("?")))
            })
            .await?;
        s.step("label", async || {
            ledger.hit("label");
            if label_down.fetch_sub(1, Ordering::SeqCst) > 0 {
                Err(Error::unavailable("claim", "label printer offline"))
            } else {
                Ok(())
            }
        })
        .await?;
        Ok(parcel)
    };
    let msg = Message::new("{}").with_id("m-1");
    let first = consumer.handle_steps(&msg, &handler).await;
    assert!(first.decision.is_nack(), "{:?}", first.decision);
    let again = consumer.handle_steps(&msg, &handler).await;
    assert!(again.decision.is_ack(), "{:?}", again.decision);
    assert_eq!(again.outcome, Some(Outcome::Recovered));
    assert_eq!(again.value.as_deref(), Some("parcel-m-1"));
    let dup = consumer.handle_steps(&msg, &handler).await;
    assert_eq!(dup.outcome, Some(Outcome::Replayed));
    assert_eq!((ledger.count("parcel"), ledger.count("label")), (1, 2));
}

/// PostgreSQL's `step_in_tx`: a step's rows and its recorded value commit
/// together. A resumed call replays the step (no second row); a step whose
/// body fails rolls its rows back and records nothing; a step of a call
/// that lost its lease rolls back too (`StepLeaseLost`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn step_in_tx_commits_the_rows_with_the_step() {
    use idem_postgres::StepInTx;
    let b = TestContext::postgres().await.with_namespace("steps");
    let db = b.pg_db();
    db.exec("CREATE TABLE shipments (id bigserial PRIMARY KEY, tag text NOT NULL)")
        .await;
    let store = b.pg_store().clone();
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let insert = async |tx: &mut idem_postgres::sqlx::PgConnection, tag: &str| {
        idem_postgres::sqlx::query_scalar::<_, i64>(
            "INSERT INTO shipments (tag) VALUES ($1) RETURNING id",
        )
        .bind(tag)
        .fetch_one(&mut *tx)
        .await
        .map_err(|e| Error::unavailable("claim", e.to_string()))
    };
    let email_up = AtomicUsize::new(0);
    let place = async || {
        idem.call("ship", "o-1")
            .run_steps_outcome(async |s| {
                let id = s
                    .step_in_tx(&store, "insert", async |tx| insert(tx, "o-1").await)
                    .await?;
                s.step("email", async || {
                    if email_up.fetch_add(1, Ordering::SeqCst) == 0 {
                        Err(Error::codec("smtp down"))
                    } else {
                        Ok(())
                    }
                })
                .await?;
                Res::Ok(id)
            })
            .await
    };
    assert!(place().await.is_err());
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 1);
    let info = idem.inspect("ship", "o-1").await.unwrap().unwrap();
    assert_eq!(info.steps, ["insert"]);
    let (id, o) = place().await.unwrap();
    assert_eq!(o, Outcome::Recovered);
    assert_eq!(db.count("SELECT count(*) FROM shipments").await, 1);
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM shipments WHERE id = {id}"))
            .await,
        1
    );

    // A step whose body fails after its INSERT: rolled back, not recorded.
    let r: Res<i64> = idem
        .call("ship", "o-2")
        .run_steps(async |s| {
            s.step_in_tx(&store, "insert", async |tx| {
                insert(tx, "o-2").await?;
                Res::<i64>::Err(Error::codec("invalid address"))
            })
            .await
        })
        .await;
    assert!(r.is_err());
    assert_eq!(
        db.count("SELECT count(*) FROM shipments WHERE tag = 'o-2'")
            .await,
        0
    );
    assert!(idem.inspect("ship", "o-2").await.unwrap().is_none());

    // A frozen holder that lost the key: its step's rows roll back.
    let gate = Arc::new(Notify::new());
    let mut old = Box::pin(idem.call("ship", "o-3").run_steps(async |s| {
        gate.notified().await;
        s.step_in_tx(&store, "insert", async |tx| insert(tx, "o-3 old").await)
            .await
    }));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), &mut old)
            .await
            .is_err()
    );
    tokio::time::sleep(lease * 2).await;
    let (_, o) = idem
        .call("ship", "o-3")
        .run_steps_outcome(async |s| {
            s.step_in_tx(&store, "insert", async |tx| insert(tx, "o-3 new").await)
                .await
        })
        .await
        .unwrap();
    assert_eq!(o, Outcome::Recovered);
    gate.notify_one();
    let late = old.await;
    assert!(matches!(late, Err(Error::StepLeaseLost { .. })), "{late:?}");
    assert_eq!(
        db.count("SELECT count(*) FROM shipments WHERE tag LIKE 'o-3%'")
            .await,
        1
    );
}

/// `release_on_cancel` frees the key at once when the call is dropped, but
/// a `run_steps` call keeps the steps it recorded (a suspend, not a
/// release): the next call resumes at once, without waiting for a lease.
async fn a_cancelled_call_with_release_on_cancel_keeps_its_steps(b: TestContext) {
    let idem = b.idem_with(|x| x.lease(Duration::from_secs(60)));
    let ledger = Ledger::default();
    let (recorded, seen) = oneshot::channel();
    let (i2, l2) = (idem.clone(), ledger.clone());
    let task = tokio::spawn(async move {
        let mut recorded = Some(recorded);
        i2.call("orders", "cancel")
            .release_on_cancel()
            .run_steps(async |s| {
                s.step("reserve", async || {
                    l2.hit("reserve");
                    Res::Ok(1u8)
                })
                .await?;
                if let Some(tx) = recorded.take() {
                    let _ = tx.send(());
                }
                std::future::pending::<Res<u8>>().await
            })
            .await
    });
    seen.await.unwrap();
    task.abort();
    let _ = task.await;
    // The suspend runs in a task of its own: wait for the lease to be free.
    idem_testkit::eventually(
        "the cancelled call's suspend",
        Duration::from_secs(10),
        || async {
            idem.inspect("orders", "cancel")
                .await
                .unwrap()
                .filter(|i| !i.is_held() && i.steps == ["reserve"])
        },
    )
    .await;
    let (v, o) = idem
        .call("orders", "cancel")
        .run_steps_outcome(async |s| {
            s.step("reserve", async || {
                ledger.hit("reserve");
                Res::Ok(2u8)
            })
            .await
        })
        .await
        .unwrap();
    assert_eq!((v, o, ledger.count("reserve")), (1, Outcome::Recovered, 1));
}

/// The key is taken from a running body (here forced out
/// by an operator's `forget`); once its keep-alive has flagged the lease
/// lost, the body's next step must not run its effect (the new holder
/// runs it): `StepLeaseLost` before the effect, and the ledger shows it.
async fn a_step_does_not_start_once_the_lease_is_known_lost(b: TestContext) {
    let lease = Duration::from_millis(300);
    let idem = b.idem_with(|x| x.lease(lease));
    let ledger = Ledger::default();
    let (started_tx, started) = oneshot::channel::<()>();
    let started_tx = Mutex::new(Some(started_tx));
    let body = idem.call("orders", "lost").run_steps(async |s| {
        s.step("reserve", async || {
            ledger.hit("reserve");
            Res::Ok(1u8)
        })
        .await?;
        if let Some(tx) = started_tx.lock().unwrap().take() {
            let _ = tx.send(());
        }
        let lease = idem::lease().expect("a running body has a lease");
        tokio::time::timeout(Duration::from_secs(10), lease.lost())
            .await
            .expect("the keep-alive never flagged the lease lost after a forced forget");
        s.step("charge", async || {
            ledger.hit("charge");
            Res::Ok(2u8)
        })
        .await
    });
    let operator = async {
        started.await.unwrap();
        idem.forget("orders", "lost").force().await.unwrap();
    };
    let (result, ()) = tokio::join!(body, operator);
    assert!(
        matches!(&result, Err(Error::StepLeaseLost { name }) if name == "charge"),
        "{result:?}"
    );
    assert_eq!(ledger.count("reserve"), 1);
    assert_eq!(
        ledger.count("charge"),
        0,
        "the step ran after its lease was known lost: the new holder runs it too"
    );
}
