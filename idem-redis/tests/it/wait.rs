//! Waiting without polling (`Call::wait`): a duplicate waits for the
//! holder's complete or release to be *told* to it (Redis: sharded pub/sub
//! on the key's channel; MemoryStore: an in-process watch), not by reading
//! the record again and again. Proved by counting claims through the
//! store: a notified waiter claims three times (the first `InProgress`,
//! the re-read after subscribing, the read after the wake-up), a polling
//! one about seven times over the same hold.

use crate::shared_store::Shared;
use async_trait::async_trait;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, Hub, InvalidationSink, KeyWatch, Store, Token,
    WatchStore, WriteReply,
};
use idem_core::{Error, Idempotency, MemoryStore, Outcome};
use idem_redis::RedisStore;
use idem_testkit::{Ledger, TestContext};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};

/// A store that counts the claims it forwards.
struct Counting<S> {
    inner: S,
    claims: Arc<AtomicUsize>,
}

#[async_trait]
impl<S: Store> Store for Counting<S> {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim(claim).await
    }
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        self.inner.complete(complete).await
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.inner.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.inner.extend(key, token, lease).await
    }
    /// What it forwarded before: the operator calls and notifications.
    fn capabilities(&self) -> Capabilities<'_> {
        let inner = self.inner.capabilities();
        let mut caps = Capabilities::none();
        caps.operator = inner.operator;
        caps.watch = inner.watch;
        caps
    }
}

/// The stores under test: memory, and Redis standalone and cluster, each
/// wrapped to count claims. The contexts keep their servers alive.
async fn stores() -> Vec<(TestContext, Arc<AtomicUsize>, Idempotency)> {
    let mut out = Vec::new();
    for ctx in [
        TestContext::memory(),
        TestContext::redis().await,
        TestContext::redis_cluster().await,
    ] {
        let claims = Arc::new(AtomicUsize::new(0));
        let idem = match ctx.name() {
            "memory" => Idempotency::builder(Counting {
                inner: MemoryStore::new(),
                claims: Arc::clone(&claims),
            }),
            _ => Idempotency::builder(Counting {
                inner: ctx.connect().await,
                claims: Arc::clone(&claims),
            }),
        }
        .namespace("wait")
        .build();
        out.push((ctx, claims, idem));
    }
    out
}

const HOLD: Duration = Duration::from_millis(300);

/// Starts a holder that runs its body (`ok` or failing) once every waiter
/// has made its first claim, holding the key `HOLD` longer.
async fn waiters_on(
    idem: &Idempotency,
    key: &str,
    waiters: usize,
    ok: bool,
    ledger: &Ledger,
) -> Vec<Result<(u64, Outcome), Error>> {
    let started = Arc::new(Semaphore::new(0));
    let gate = Arc::clone(&started);
    let holder = {
        let idem = idem.clone();
        let key = key.to_owned();
        let ledger = ledger.clone();
        tokio::spawn(async move {
            idem.call("op", &key)
                .run_outcome(|| async move {
                    ledger.record(&key);
                    gate.add_permits(1);
                    tokio::time::sleep(HOLD).await;
                    if ok {
                        Ok(7_u64)
                    } else {
                        Err(Error::InvalidConfig("the holder's body failed".into()))
                    }
                })
                .await
        })
    };
    let _ = started.acquire().await.unwrap();
    let mut tasks = Vec::new();
    for _ in 0..waiters {
        let idem = idem.clone();
        let key = key.to_owned();
        let ledger = ledger.clone();
        tasks.push(tokio::spawn(async move {
            idem.call("op", &key)
                .wait(Duration::from_secs(30))
                .run_outcome(|| async move {
                    ledger.record(&key);
                    Ok::<_, Error>(8_u64)
                })
                .await
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    let _ = holder.await.unwrap();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_wake_on_complete_without_polling() {
    for (ctx, claims, idem) in stores().await {
        let ledger = Ledger::new();
        let n = 50;
        let results = waiters_on(&idem, "done", n, true, &ledger).await;
        for r in &results {
            assert_eq!(
                r.as_ref().unwrap(),
                &(7, Outcome::Replayed),
                "{}",
                ctx.name()
            );
        }
        assert_eq!(ledger.count("done"), 1, "{}: the body ran once", ctx.name());
        // The holder's claim, then three per waiter (four if a loaded
        // machine lets the 500 ms safety poll fire first); polling over
        // HOLD (5, 10, 20, 40, 80, 160 ms …) takes about seven each.
        let claims = claims.load(Ordering::SeqCst);
        assert!(
            claims <= 1 + 4 * n,
            "{}: {claims} claims for {n} waiters: they polled instead of being notified",
            ctx.name()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiters_wake_on_release_and_one_of_them_runs() {
    for (ctx, claims, idem) in stores().await {
        let ledger = Ledger::new();
        let n = 20;
        let results = waiters_on(&idem, "failed", n, false, &ledger).await;
        let executed = results
            .iter()
            .filter(|r| matches!(r, Ok((8, Outcome::Executed))))
            .count();
        let replayed = results
            .iter()
            .filter(|r| matches!(r, Ok((8, Outcome::Replayed))))
            .count();
        assert_eq!(
            (executed, replayed),
            (1, n - 1),
            "{}: {results:?}",
            ctx.name()
        );
        assert_eq!(
            ledger.count("failed"),
            2,
            "{}: holder + one waiter",
            ctx.name()
        );
        let claims = claims.load(Ordering::SeqCst);
        // Four each (the last waits once more, for the new holder), one
        // more on a loaded machine; polling takes seven or more.
        assert!(claims <= 1 + 5 * n, "{}: {claims} claims", ctx.name());
    }
}

/// Many waiters on several runtimes at once (one store, so one subscriber
/// connection, subscribed while any of them waits): every one gets the
/// result, the body runs once per round, and the claims stay those of
/// notified waiters (polling would cost about seven each).
#[test]
fn no_missed_wake_ups_across_runtimes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    for (ctx, claims, idem) in rt.block_on(stores()) {
        for round in 0..5 {
            let key = format!("round-{round}");
            let ledger = Ledger::new();
            let before = claims.load(Ordering::SeqCst);
            let waiters_per_runtime = 30;
            let runtimes = 3;
            let started = Arc::new(std::sync::Barrier::new(runtimes + 1));
            let handles: Vec<_> = (0..runtimes)
                .map(|_| {
                    let idem = idem.clone();
                    let key = key.clone();
                    let ledger = ledger.clone();
                    let started = Arc::clone(&started);
                    std::thread::spawn(move || {
                        let rt = tokio::runtime::Builder::new_multi_thread()
                            .worker_threads(2)
                            .enable_all()
                            .build()
                            .unwrap();
                        started.wait();
                        rt.block_on(async {
                            let tasks: Vec<_> = (0..waiters_per_runtime)
                                .map(|_| {
                                    let idem = idem.clone();
                                    let key = key.clone();
                                    let ledger = ledger.clone();
                                    tokio::spawn(async move {
                                        idem.call("op", &key)
                                            .wait(Duration::from_secs(30))
                                            .run_outcome(|| async move {
                                                ledger.record(&key);
                                                tokio::time::sleep(Duration::from_millis(100))
                                                    .await;
                                                Ok::<_, Error>(1_u8)
                                            })
                                            .await
                                    })
                                })
                                .collect();
                            let mut outcomes = Vec::new();
                            for t in tasks {
                                outcomes.push(t.await.unwrap().unwrap().1);
                            }
                            outcomes
                        })
                    })
                })
                .collect();
            started.wait();
            let outcomes: Vec<Outcome> = handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect();
            let total = runtimes * waiters_per_runtime;
            assert_eq!(
                outcomes.iter().filter(|o| **o == Outcome::Executed).count(),
                1,
                "{} round {round}",
                ctx.name()
            );
            assert_eq!(outcomes.len(), total);
            assert_eq!(ledger.count(&key), 1, "{} round {round}", ctx.name());
            let used = claims.load(Ordering::SeqCst) - before;
            assert!(
                used <= 4 * total,
                "{} round {round}: {used} claims for {total} callers",
                ctx.name()
            );
        }
    }
}

/// The subscription lives while someone waits and goes with the last
/// waiter: Redis shows no shard channel left once every waiter is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_waiter_unsubscribes() {
    let ctx = TestContext::redis().await;
    let idem = Idempotency::builder(ctx.connect().await)
        .namespace("wait")
        .build();
    let ledger = Ledger::new();
    let results = waiters_on(&idem, "gone", 5, true, &ledger).await;
    assert!(results.iter().all(|r| r.is_ok()));
    // SUNSUBSCRIBE is sent by the subscriber task right after the last
    // waiter leaves; give it its round trip.
    let mut channels = String::new();
    for _ in 0..100 {
        channels = ctx.server().cli(&["PUBSUB", "SHARDCHANNELS"]);
        if channels.trim().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(channels.trim(), "", "subscriptions left behind");
}

/// The subscriber connection cut while callers wait: they are woken to
/// read again, poll while it is down, and every one still gets the
/// holder's result; the body runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_survive_a_cut_subscriber() {
    let ctx = TestContext::redis().await;
    let idem = Idempotency::builder(ctx.connect().await)
        .namespace("wait")
        .build();
    let ledger = Ledger::new();
    let cut = {
        let server_url = ctx.server().url();
        tokio::spawn(async move {
            let mut con = redis::Client::open(server_url)
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap();
            // Cut it once the waiters are subscribed (mid-hold).
            for _ in 0..100 {
                let chans: Vec<String> = redis::cmd("PUBSUB")
                    .arg("SHARDCHANNELS")
                    .query_async(&mut con)
                    .await
                    .unwrap();
                if !chans.is_empty() {
                    let killed: i64 = redis::cmd("CLIENT")
                        .arg("KILL")
                        .arg("TYPE")
                        .arg("pubsub")
                        .query_async(&mut con)
                        .await
                        .unwrap();
                    return killed;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            0
        })
    };
    let results = waiters_on(&idem, "cut", 20, true, &ledger).await;
    assert!(cut.await.unwrap() >= 1, "no subscriber was cut");
    for r in &results {
        assert_eq!(r.as_ref().unwrap(), &(7, Outcome::Replayed));
    }
    assert_eq!(ledger.count("cut"), 1);
}

/// A waiter's store that tells whether a publish reached it: its watches
/// are its own hub's, fed by a task that waits on the inner store's watch
/// and records each notification before it passes it on. It also records
/// whether a claim it forwarded while subscribed (the claim that marks the
/// record) answered `InProgress`, i.e. whether the caller then depended on
/// being woken.
struct Told<S> {
    inner: S,
    hub: Arc<Hub>,
    /// The forwarders' stop signals, by key, fired when the last watch of
    /// the key goes.
    stops: Arc<std::sync::Mutex<HashMap<String, oneshot::Sender<()>>>>,
    /// A claim made while subscribed answered `InProgress`.
    must_be_woken: AtomicBool,
    /// A notification came from the inner store.
    woken: Arc<AtomicBool>,
}

impl<S> Told<S> {
    fn new(inner: S) -> Told<S> {
        let stops: Arc<std::sync::Mutex<HashMap<String, oneshot::Sender<()>>>> = Arc::default();
        let on_last = {
            let stops = Arc::clone(&stops);
            Box::new(move |key: &str| {
                if let Some(stop) = stops.lock().unwrap().remove(key) {
                    let _ = stop.send(());
                }
            })
        };
        Told {
            inner,
            hub: Arc::new(Hub::new(true, Some(on_last))),
            stops,
            must_be_woken: AtomicBool::new(false),
            woken: Arc::new(AtomicBool::new(false)),
        }
    }
}

#[async_trait]
impl<S: Store> Store for Told<S> {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let subscribed = self.hub.is_watched(claim.key);
        let reply = self.inner.claim(claim).await;
        if subscribed && matches!(reply, Ok(ClaimReply::InProgress { .. })) {
            self.must_be_woken.store(true, Ordering::SeqCst);
        }
        reply
    }
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        self.inner.complete(complete).await
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.inner.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.inner.extend(key, token, lease).await
    }
    /// Its own notifications only, as before (no forget feed).
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none().watch(self)
    }
}

#[async_trait]
impl<S: Store> WatchStore for Told<S> {
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        let (outer, first) = self.hub.join(key);
        if first {
            // The inner subscription is active when this returns, and the
            // forwarder holds it until the last outer watch goes.
            let mut inner = self.inner.capabilities().watch?.watch(key).await?;
            let (stop, mut stopped) = oneshot::channel();
            self.stops.lock().unwrap().insert(key.to_owned(), stop);
            let (hub, woken, key) = (
                Arc::clone(&self.hub),
                Arc::clone(&self.woken),
                key.to_owned(),
            );
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = inner.changed() => {
                            woken.store(true, Ordering::SeqCst);
                            hub.notify(&key);
                        }
                        _ = &mut stopped => return,
                    }
                }
            });
        }
        Some(outer)
    }

    async fn watch_forgotten(&self, _prefix: &str, _sink: InvalidationSink) -> bool {
        false
    }
}

/// The race of publish-on-mark: the holder's complete
/// and the waiters' first claims, subscription and marking claim start at
/// the same moment, round after round, with the holder's complete moved a
/// little later each round so that every interleaving comes up. Every
/// waiter gets the holder's result, and every waiter whose claim after
/// subscribing found the key still in progress (so it depended on being
/// told) was told by a publish: none was left to the safety poll. No
/// timing is asserted: the poll would still answer in time, the record of
/// who was woken is what fails. The holder uses a store of its own (on
/// Valkey 8.1+ its completes are plain `SET … IFEQ`s, which send no
/// publish). Redis 7 here; Valkey with `IDEM_REDIS_SERVER`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_complete_racing_the_waiters_wakes_every_one_that_waits() {
    let ctx = TestContext::redis().await;
    let holder = Idempotency::builder(ctx.connect().await)
        .namespace("race")
        .build();
    let waiting_store = ctx.connect().await;
    let (waiters, rounds) = (4, 120);
    let (mut told, mut replayed_at_once) = (0, 0);
    for round in 0..rounds {
        let key = format!("r{round}");
        let go = Arc::new(tokio::sync::Barrier::new(waiters + 1));
        let stores: Vec<Arc<Told<RedisStore>>> = (0..waiters)
            .map(|_| Arc::new(Told::new(waiting_store.clone())))
            .collect();
        let tasks: Vec<_> = stores
            .iter()
            .map(|store| {
                let idem = Idempotency::builder(Shared(Arc::clone(store)))
                    .namespace("race")
                    .build();
                let (go, key) = (Arc::clone(&go), key.clone());
                tokio::spawn(async move {
                    go.wait().await;
                    idem.call("op", &key)
                        .wait(Duration::from_secs(30))
                        .run_outcome(|| async { Ok::<_, Error>(0_u64) })
                        .await
                })
            })
            .collect();
        // The holder's complete, from 0 to 4.5 ms after the waiters start.
        let delay = Duration::from_micros(500 * (round % 10));
        let held = holder
            .call("op", &key)
            .run_outcome(|| async {
                go.wait().await;
                tokio::time::sleep(delay).await;
                Ok::<_, Error>(round)
            })
            .await
            .unwrap();
        assert_eq!(held, (round, Outcome::Executed));
        for (task, store) in tasks.into_iter().zip(&stores) {
            let got = task.await.unwrap();
            assert_eq!(got.unwrap(), (round, Outcome::Replayed), "round {round}");
            if store.must_be_woken.load(Ordering::SeqCst) {
                assert!(
                    store.woken.load(Ordering::SeqCst),
                    "round {round}: a waiter marked the record, found it in progress, and was never told of the complete"
                );
                told += 1;
            } else {
                replayed_at_once += 1;
            }
        }
    }
    eprintln!(
        "{rounds} rounds × {waiters} waiters: {told} waited and were told, {replayed_at_once} found the result without waiting"
    );
}
