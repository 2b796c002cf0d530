//! Local replay caches never keep a forgotten key: not when the forget
//! races the read that fills the cache, not after a blip at the first
//! call, not after the subscriber task restarted, not after a cluster
//! reconnection. Real Redis servers (private, so that
//! `PUBSUB SHARDCHANNELS` sees only this test's subscribers).

use crate::shared_store::Shared;
use async_trait::async_trait;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, Invalidation, InvalidationSink, KeyWatch, Store,
    Token, WatchStore, WriteReply,
};
use idem_core::{Error, Idempotency, Outcome};
use idem_redis::RedisStore;
use idem_testkit::TestContext;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};

const NAMESPACE: &str = "payments";
const FORGOTTEN_CHANNEL: &str = "payments::forgotten";

/// A pause armed by the test: the next reply of its kind is held until the
/// test says go, after telling it the store has answered.
type Pause = Mutex<Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>>;

/// A store that can hold a claim's or complete's reply (the store has
/// answered; the caller has not seen it yet), and reports every forget its
/// cache hears.
struct Paused {
    inner: RedisStore,
    claim: Pause,
    complete: Pause,
    heard: mpsc::UnboundedSender<String>,
    /// The sinks handed to the store, which keeps them weakly.
    sinks: Mutex<Vec<InvalidationSink>>,
}

async fn hold(pause: &Pause) {
    let armed = pause.lock().unwrap().take();
    if let Some((answered, go)) = armed {
        let _ = answered.send(());
        let _ = go.await;
    }
}

#[async_trait]
impl Store for Paused {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let reply = self.inner.claim(claim).await;
        hold(&self.claim).await;
        reply
    }
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        let reply = self.inner.complete(complete).await;
        hold(&self.complete).await;
        reply
    }
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        self.inner.release(key, token).await
    }
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        self.inner.extend(key, token, lease).await
    }
    /// The operator calls of the store; its notifications through this
    /// wrapper, which reports every forget its cache hears.
    fn capabilities(&self) -> Capabilities<'_> {
        let mut caps = Capabilities::none().watch(self);
        caps.operator = self.inner.capabilities().operator;
        caps
    }
}

#[async_trait]
impl WatchStore for Paused {
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.inner.watch(key).await
    }
    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        let heard = self.heard.clone();
        let told: InvalidationSink = Arc::new(move |what: Invalidation<'_>| {
            sink(what);
            if let Invalidation::Key(key) = what {
                let _ = heard.send(key.to_owned());
            }
        });
        self.sinks.lock().unwrap().push(Arc::clone(&told));
        self.inner.watch_forgotten(prefix, told).await
    }
}

fn cached(store: impl Store) -> Idempotency {
    Idempotency::builder(store)
        .namespace(NAMESPACE)
        .result_ttl(Duration::from_secs(3600))
        .local_cache(1_000)
        .build()
}

/// The process that forgets: no cache, so it subscribes to nothing.
fn operator(store: impl Store) -> Idempotency {
    Idempotency::builder(store)
        .namespace(NAMESPACE)
        .result_ttl(Duration::from_secs(3600))
        .build()
}

async fn call(idem: &Idempotency, key: &str, value: u32) -> (u32, Outcome) {
    idem.call("charge", key)
        .run_outcome(|| async move { Ok::<_, Error>(value) })
        .await
        .unwrap()
}

/// Calls `key` until the body runs (its copy was dropped) or 10 s pass;
/// the last outcome. A kept copy would replay for the whole TTL (an hour).
async fn until_executed(idem: &Idempotency, key: &str) -> Outcome {
    let mut last = Outcome::Replayed;
    for _ in 0..500 {
        last = call(idem, key, 3).await.1;
        if last == Outcome::Executed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}

/// Builds B (cached, paused store) and the operator A on one server.
async fn paused_pair(
    ctx: &TestContext,
) -> (
    Idempotency,
    Arc<Paused>,
    mpsc::UnboundedReceiver<String>,
    Idempotency,
) {
    let (heard, heard_rx) = mpsc::unbounded_channel();
    let paused = Arc::new(Paused {
        inner: ctx.connect().await,
        claim: Mutex::new(None),
        complete: Mutex::new(None),
        heard,
        sinks: Mutex::new(Vec::new()),
    });
    let b = cached(Shared(Arc::clone(&paused)));
    (b, paused, heard_rx, operator(ctx.connect().await))
}

/// Arms `pause`: the returned pair says when the store answered, and lets
/// the reply through.
fn arm(pause: &Pause) -> (oneshot::Receiver<()>, oneshot::Sender<()>) {
    let (answered_tx, answered) = oneshot::channel();
    let (go, go_rx) = oneshot::channel();
    *pause.lock().unwrap() = Some((answered_tx, go_rx));
    (answered, go)
}

/// Forgets `key` through `a`, and waits until B's cache has heard it.
async fn forget_heard(a: &Idempotency, key: &str, heard: &mut mpsc::UnboundedReceiver<String>) {
    assert!(a.forget("charge", key).await.unwrap().is_some());
    let stored = format!("{NAMESPACE}:charge:{key}");
    let wait = async {
        while let Some(k) = heard.recv().await {
            if k == stored {
                return;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), wait)
        .await
        .expect("B's cache never heard the forget");
}

/// At the replay: B's claim reads the completed record, the key is
/// forgotten and B's cache hears it, and only then does B see the reply.
/// The copy must not enter the cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_racing_a_replay_is_not_cached() {
    let ctx = TestContext::redis().await;
    let (b, paused, mut heard, a) = paused_pair(&ctx).await;
    assert_eq!(call(&a, "k", 1).await, (1, Outcome::Executed));
    let (answered, go) = arm(&paused.claim);
    let replay = {
        let b = b.clone();
        tokio::spawn(async move { call(&b, "k", 2).await })
    };
    answered.await.unwrap();
    forget_heard(&a, "k", &mut heard).await;
    go.send(()).unwrap();
    // Read before the forget: that one reply is the old value.
    assert_eq!(replay.await.unwrap(), (1, Outcome::Replayed));
    assert_eq!(
        call(&b, "k", 2).await,
        (2, Outcome::Executed),
        "B replayed the forgotten value from its local cache"
    );
}

/// At the completion: B's result is stored, the key is forgotten
/// and B's cache hears it, and only then does B see the complete's reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forget_racing_a_completion_is_not_cached() {
    let ctx = TestContext::redis().await;
    let (b, paused, mut heard, a) = paused_pair(&ctx).await;
    let (answered, go) = arm(&paused.complete);
    let first = {
        let b = b.clone();
        tokio::spawn(async move { call(&b, "k", 1).await })
    };
    answered.await.unwrap();
    forget_heard(&a, "k", &mut heard).await;
    go.send(()).unwrap();
    assert_eq!(first.await.unwrap(), (1, Outcome::Executed));
    assert_eq!(
        call(&b, "k", 2).await,
        (2, Outcome::Executed),
        "B replayed the forgotten value from its local cache"
    );
}

/// Whether some client of `server` subscribes the namespace's channel.
fn subscribed(ctx: &TestContext) -> bool {
    ctx.server()
        .cli(&["PUBSUB", "SHARDCHANNELS", FORGOTTEN_CHANNEL])
        .contains(FORGOTTEN_CHANNEL)
}

/// Calls a new key on `b` (a read from the store, not from the cache)
/// every 100 ms until B subscribes the namespace's channel again, or 15 s
/// pass.
async fn until_subscribed(ctx: &TestContext, b: &Idempotency) -> bool {
    for i in 0..150 {
        if subscribed(ctx) {
            return true;
        }
        let _ = b
            .call("charge", format!("warm-{i}"))
            .run(|| async { Ok::<_, Error>(0_u32) })
            .await
            .map(|_: u32| ());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    subscribed(ctx)
}

/// B caches `key`, A forgets it: B must run the body again.
async fn forget_is_heard(a: &Idempotency, b: &Idempotency, key: &str) {
    assert_eq!(call(a, key, 1).await, (1, Outcome::Executed));
    for _ in 0..2 {
        assert_eq!(call(b, key, 2).await, (1, Outcome::Replayed));
    }
    assert!(a.forget("charge", key).await.unwrap().is_some());
    assert_eq!(
        until_executed(b, key).await,
        Outcome::Executed,
        "B kept replaying the forgotten value from its local cache"
    );
}

/// The server is down at B's first call (the registration of its
/// cache fails), then back. B must register again and hear forgets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blip_at_the_first_call_does_not_deafen_the_cache() {
    let mut ctx = TestContext::redis().await;
    let b = cached(ctx.connect().await);
    let a = operator(ctx.connect().await);
    ctx.server_mut().kill();
    let down: Result<u32, Error> = b.call("charge", "k").run(|| async { Ok(0) }).await;
    assert!(down.is_err(), "the server was down: {down:?}");
    ctx.server_mut().restart();
    assert!(
        until_subscribed(&ctx, &b).await,
        "B never subscribed its cache to forgets after the blip"
    );
    forget_is_heard(&a, &b, "k").await;
}

/// B's subscriber task stops (it ran on a runtime that shut
/// down); the next one must subscribe the cache's channel again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_subscriber_resubscribes_the_cache() {
    let ctx = TestContext::redis().await;
    let b = cached(ctx.connect().await);
    let a = operator(ctx.connect().await);
    let first = b.clone();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async { call(&first, "first", 1).await });
    })
    .join()
    .unwrap();
    // That runtime, and the subscriber task it ran, are gone.
    for _ in 0..100 {
        if !subscribed(&ctx) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!subscribed(&ctx), "the old subscriber is still there");
    assert!(
        until_subscribed(&ctx, &b).await,
        "B's cache never subscribed again after its subscriber task stopped"
    );
    forget_is_heard(&a, &b, "k").await;
}

/// On a cluster, a reconnection resubscribes every channel of the
/// lost node, one confirmation each, in no set order; the cache must be
/// emptied whichever comes first. Twenty key channels share the node of
/// the namespace's channel, so before the fix the cache's channel was
/// rarely first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_reconnection_empties_the_cache() {
    let ctx = TestContext::redis_cluster().await;
    let b_store = ctx.connect().await;
    let b = cached(b_store.clone());
    let a = operator(ctx.connect().await);
    let cluster = ctx.cluster();
    let node = cluster.slot_owner(FORGOTTEN_CHANNEL);
    let mut watches = Vec::new();
    for i in 0.. {
        if watches.len() == 20 {
            break;
        }
        let channel = format!("{NAMESPACE}:charge:w-{i}");
        if cluster.slot_owner(&channel) == node {
            watches.push(b_store.watch(&channel).await.expect("cluster watch"));
        }
    }
    assert_eq!(call(&a, "k", 1).await, (1, Outcome::Executed));
    for _ in 0..2 {
        assert_eq!(call(&b, "k", 2).await, (1, Outcome::Replayed));
    }
    // Deleted behind idem's back (no forget published), then B's
    // subscriber connection to that node cut.
    let stored = format!("{NAMESPACE}:charge:k");
    let owner = &cluster.nodes()[cluster.slot_owner(&stored)];
    assert_eq!(owner.cli(&["DEL", &stored]), "1");
    let killed: u32 = cluster.nodes()[node]
        .cli(&["CLIENT", "KILL", "TYPE", "pubsub"])
        .trim()
        .parse()
        .unwrap();
    assert!(killed >= 1, "no subscriber connection to cut");
    assert_eq!(
        until_executed(&b, "k").await,
        Outcome::Executed,
        "B kept replaying a deleted record after its subscriber reconnected"
    );
    drop(watches);
}

/// The server is down at B's first call (the forget
/// subscription fails), then back; B's next call executes, and later calls
/// of that key would be cache hits, which never claim. Nothing may enter
/// or be served from the cache until the feed is heard, and the feed must
/// be retried in the background, not on the next claim: a forget more
/// than 5 s later is heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cache_registered_late_never_replays_a_forgotten_key() {
    let mut ctx = TestContext::redis().await;
    let b = cached(ctx.connect().await);
    let a = operator(ctx.connect().await);
    ctx.server_mut().kill();
    let down: Result<u32, Error> = b.call("charge", "k").run(|| async { Ok(0) }).await;
    assert!(down.is_err(), "the server was down: {down:?}");
    ctx.server_mut().restart();
    // The first call that reaches the server again executes.
    let mut first = None;
    for _ in 0..100 {
        let r: Result<(u32, Outcome), Error> =
            b.call("charge", "k").run_outcome(|| async { Ok(1) }).await;
        if let Ok(done) = r {
            first = Some(done);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(first, Some((1, Outcome::Executed)));
    assert_eq!(call(&b, "k", 2).await, (1, Outcome::Replayed));
    // Past the notifier's pause after a failed connection (5 s): only a
    // registration retried without any claim can be heard by now.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(call(&b, "k", 2).await, (1, Outcome::Replayed));
    // A's connection broke with the restart: its first command may meet it.
    let mut forgot = a.forget("charge", "k").await;
    if matches!(forgot, Err(Error::Unavailable { .. })) {
        forgot = a.forget("charge", "k").await;
    }
    assert!(forgot.unwrap().is_some());
    assert_eq!(
        until_executed(&b, "k").await,
        Outcome::Executed,
        "B replayed the forgotten value from a cache that never heard forgets"
    );
}
