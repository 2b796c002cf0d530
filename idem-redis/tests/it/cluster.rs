//! `RedisStore::connect_cluster` against a real three-master Redis Cluster:
//! exactly-once under concurrency with keys on every master, replays of every
//! value, release on error, takeover after a lost lease, fingerprints, hash
//! tags, `NOSCRIPT` after `SCRIPT FLUSH`, resharding and a node restart under
//! load. Every assertion on executions is exact, from a ledger the bodies
//! write to.

use idem_core::store::ValueKind;
use idem_core::{Error, Idempotency, Outcome};
use idem_redis::RedisStore;
use idem_testkit::{
    BodyError, Ledger, RecordState, RedisCluster, Rng, TestContext, eventually, is_unavailable,
    key_slot, record_state,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Debug;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

async fn connect(urls: &[String]) -> RedisStore {
    let refs: Vec<&str> = urls.iter().map(String::as_str).collect();
    RedisStore::connect_cluster(&refs)
        .await
        .expect("connect_cluster to a healthy cluster")
}

/// The stored key for a namespace and scope free of `:` and `%`.
fn stored_key(namespace: &str, scope: &str, key: &str) -> String {
    format!("{namespace}:{scope}:{key}")
}

const PENDING: Option<RecordState> = Some(RecordState::Pending);
const COMPLETED: Option<RecordState> = Some(RecordState::Completed(ValueKind::Json));

/// The state of the record of `key`, read on the node that owns its slot.
fn state_of(cluster: &RedisCluster, key: &str) -> Option<RecordState> {
    record_state(cluster.record(key).as_deref())
}

fn owners(cluster: &RedisCluster, keys: &[String]) -> BTreeSet<usize> {
    keys.iter().map(|k| cluster.slot_owner(k)).collect()
}

/// Keys `prefix-0..n` whose stored keys land on every master.
fn spread_keys(
    cluster: &RedisCluster,
    ns: &str,
    scope: &str,
    prefix: &str,
    n: usize,
) -> Vec<String> {
    let keys: Vec<String> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    let stored: Vec<String> = keys.iter().map(|k| stored_key(ns, scope, k)).collect();
    assert_eq!(
        owners(cluster, &stored),
        BTreeSet::from([0, 1, 2]),
        "the test keys must be spread over all three masters"
    );
    keys
}

/// A private cluster, idem over it in namespace `ns`, and the keys of
/// [`spread_keys`].
async fn spread_over_a_cluster(
    ns: &str,
    scope: &str,
    prefix: &str,
    n: usize,
) -> (TestContext, Idempotency, Vec<String>) {
    let ctx = TestContext::redis_cluster().await.with_namespace(ns);
    let idem = ctx.idem();
    let keys = spread_keys(ctx.cluster(), ns, scope, prefix, n);
    (ctx, idem, keys)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_under_concurrency_on_every_master() {
    let ctx = TestContext::redis_cluster().await.with_namespace("once");
    let cluster = ctx.cluster();
    let idem = ctx.builder().lease(Duration::from_secs(10)).build();
    let keys = spread_keys(cluster, "once", "charge", "order", 120);
    let ledger = Ledger::new();
    const TASKS: usize = 64;

    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (idem, ledger, mut keys) = (idem.clone(), ledger.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(t as u64 + 1);
            rng.shuffle(&mut keys);
            let mut seen = Vec::new();
            for key in keys {
                let pause = rng.below(3);
                let (ledger, k) = (ledger.clone(), key.clone());
                let r = idem
                    .call("charge", &key)
                    .wait(Duration::from_secs(30))
                    .run_outcome(|| async move {
                        ledger.record(&k);
                        tokio::time::sleep(Duration::from_millis(pause)).await;
                        Ok::<_, Error>(format!("receipt-{k}"))
                    })
                    .await;
                seen.push((key, r));
            }
            seen
        }));
    }
    let mut outcomes: HashMap<String, Vec<Outcome>> = HashMap::new();
    for task in tasks {
        for (key, r) in task.await.unwrap() {
            let (value, outcome) = r.unwrap_or_else(|e| panic!("{key}: {e}"));
            assert_eq!(value, format!("receipt-{key}"));
            outcomes.entry(key).or_default().push(outcome);
        }
    }
    for key in &keys {
        assert_eq!(
            ledger.count(key),
            1,
            "{key} ran {} times",
            ledger.count(key)
        );
        let o = &outcomes[key];
        assert_eq!(o.len(), TASKS);
        assert_eq!(
            o.iter().filter(|&&o| o == Outcome::Executed).count(),
            1,
            "{key}: {o:?}"
        );
        assert_eq!(
            o.iter().filter(|&&o| o == Outcome::Replayed).count(),
            TASKS - 1,
            "{key}: {o:?}"
        );
        let rec = cluster.record(&stored_key("once", "charge", key));
        assert_eq!(
            record_state(rec.as_deref()),
            COMPLETED,
            "{key} is stored as completed on its master"
        );
    }
    assert_eq!(ledger.total(), keys.len());
}

async fn replay_case<T>(idem: &Idempotency, ledger: &Ledger, key: &str, first: T, other: T)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug + Clone + Send + 'static,
{
    // The first call runs and stores `first`; two more replay it.
    let calls = [
        (first.clone(), Outcome::Executed),
        (other.clone(), Outcome::Replayed),
        (other, Outcome::Replayed),
    ];
    for (v, expected) in calls {
        let l = ledger.clone();
        let k = key.to_owned();
        let r = idem
            .call("replay", key)
            .run_outcome(|| async move {
                l.record(&k);
                Ok::<_, Error>(v)
            })
            .await
            .unwrap();
        assert_eq!(r, (first.clone(), expected), "{key}");
    }
    assert_eq!(ledger.count(key), 1, "{key}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_every_value_including_zero_false_unit_none_and_empty() {
    let ctx = TestContext::redis_cluster().await.with_namespace("replay");
    let idem = ctx.idem();
    let ledger = Ledger::new();
    // Several keys per value, so every value is replayed from every master.
    for round in 0..6 {
        let k = |name: &str| format!("{name}-{round}");
        replay_case(&idem, &ledger, &k("zero"), 0u64, 7).await;
        replay_case(&idem, &ledger, &k("false"), false, true).await;
        replay_case(&idem, &ledger, &k("unit"), (), ()).await;
        replay_case(&idem, &ledger, &k("none"), None::<u32>, Some(3)).await;
        replay_case(&idem, &ledger, &k("some-zero"), Some(0i32), None).await;
        replay_case(
            &idem,
            &ledger,
            &k("empty-string"),
            String::new(),
            "x".to_owned(),
        )
        .await;
        replay_case(&idem, &ledger, &k("empty-vec"), Vec::<u8>::new(), vec![1]).await;
        replay_case(
            &idem,
            &ledger,
            &k("empty-map"),
            BTreeMap::<String, u8>::new(),
            BTreeMap::from([("a".to_owned(), 1)]),
        )
        .await;
        replay_case(
            &idem,
            &ledger,
            &k("nested-empty"),
            (Vec::<()>::new(), None::<bool>),
            (vec![()], Some(true)),
        )
        .await;
    }
    let stored: Vec<String> = (0..6)
        .flat_map(|r| {
            ["zero", "false", "unit", "none", "empty-vec"]
                .map(move |n| format!("replay:replay:{n}-{r}"))
        })
        .collect();
    assert_eq!(owners(ctx.cluster(), &stored), BTreeSet::from([0, 1, 2]));
    assert_eq!(ledger.total(), 6 * 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_releases_the_key_on_every_master() {
    let (ctx, idem, keys) = spread_over_a_cluster("err", "pay", "k", 24).await;
    let cluster = ctx.cluster();
    let ledger = Ledger::new();
    for key in &keys {
        let (l, k) = (ledger.clone(), key.clone());
        let r: Result<u32, BodyError> = idem
            .call("pay", key)
            .run(|| async move {
                l.record(&k);
                Err(BodyError::Boom(format!("declined {k}")))
            })
            .await;
        assert!(
            matches!(&r, Err(BodyError::Boom(m)) if *m == format!("declined {key}")),
            "{r:?}"
        );
        // Released at once (not left to the lease): nothing is stored.
        assert_eq!(
            cluster.record(&stored_key("err", "pay", key)),
            None,
            "{key}"
        );
    }
    for key in &keys {
        let (l, k) = (ledger.clone(), key.clone());
        let r = idem
            .call("pay", key)
            .run_outcome(|| async move {
                l.record(&k);
                Ok::<_, BodyError>(1u32)
            })
            .await
            .unwrap();
        assert_eq!(r, (1, Outcome::Executed), "{key}");
        let r = idem
            .call("pay", key)
            .run_outcome(|| async { Ok::<_, BodyError>(2u32) })
            .await
            .unwrap();
        assert_eq!(r, (1, Outcome::Replayed), "{key}");
        assert_eq!(
            ledger.count(key),
            2,
            "{key}: one failed run, one successful run"
        );
    }
}

/// Holder A's thread, the switch that unfreezes it, and when it claimed.
type FrozenHolder = (
    std::thread::JoinHandle<Result<(String, Outcome), Error>>,
    std::sync::mpsc::Sender<()>,
    Instant,
);

/// Holder A claims `key` on its own thread and then freezes (its thread is
/// blocked, so nothing renews its lease) until `go` is sent; it then returns
/// `"A"`. Returns A's join handle once A's body has started.
fn frozen_holder(
    urls: Vec<String>,
    ns: &'static str,
    key: &'static str,
    lease: Duration,
    ledger: Ledger,
) -> FrozenHolder {
    let (claimed_tx, claimed_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let a = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let idem = Idempotency::builder(connect(&urls).await)
                .namespace(ns)
                .lease(lease)
                .build();
            idem.call("takeover", key)
                .run_outcome(|| async move {
                    ledger.record(key);
                    claimed_tx.send(Instant::now()).unwrap();
                    // Frozen: the whole runtime of A is blocked here.
                    go_rx.recv().unwrap();
                    Ok::<_, Error>("A".to_owned())
                })
                .await
        })
    });
    let claimed_at = claimed_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("holder A claimed the key");
    (a, go_tx, claimed_at)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_a_lost_lease_and_the_late_complete_is_refused() {
    const NS: &str = "takeover";
    let lease = Duration::from_secs(1);
    let ctx = TestContext::redis_cluster().await.with_namespace(NS);
    let cluster = ctx.cluster();
    let urls = cluster.urls();
    let idem = ctx.builder().lease(lease).build();

    // Case 1: A's late complete arrives while B (the new holder) is running.
    let ledger = Ledger::new();
    let key = "while-b-runs";
    let stored = stored_key(NS, "takeover", key);
    let (a, go, a_claimed_at) = frozen_holder(urls.clone(), NS, key, lease, ledger.clone());
    assert_eq!(state_of(cluster, &stored), PENDING);
    let r: Result<String, Error> = idem
        .call("takeover", key)
        .run(|| async { Ok("C".to_owned()) })
        .await;
    assert!(
        matches!(r, Err(Error::InProgress { .. })),
        "A holds a live lease: {r:?}"
    );

    let (b_running_tx, b_running_rx) = tokio::sync::oneshot::channel();
    let (b_finish_tx, b_finish_rx) = tokio::sync::oneshot::channel::<()>();
    let b = {
        let (idem, ledger) = (idem.clone(), ledger.clone());
        tokio::spawn(async move {
            idem.call("takeover", key)
                .wait(Duration::from_secs(30))
                .run_outcome(|| async move {
                    ledger.record(key);
                    b_running_tx.send(Instant::now()).unwrap();
                    b_finish_rx.await.unwrap();
                    Ok::<_, Error>("B".to_owned())
                })
                .await
        })
    };
    let b_started_at = b_running_rx.await.expect("B takes over");
    assert!(
        b_started_at.duration_since(a_claimed_at) >= lease - Duration::from_millis(50),
        "B may only take over once A's lease has run out"
    );
    go.send(()).unwrap();
    let a_result = tokio::task::spawn_blocking(move || a.join().unwrap())
        .await
        .unwrap();
    // A's work happened: it gets its own value back, stores nothing, and
    // its outcome says so.
    assert_eq!(a_result.unwrap(), ("A".to_owned(), Outcome::LeaseLost));
    assert_eq!(state_of(cluster, &stored), PENDING, "B still holds the key");
    b_finish_tx.send(()).unwrap();
    assert_eq!(
        b.await.unwrap().unwrap(),
        ("B".to_owned(), Outcome::Recovered)
    );
    let r = idem
        .call("takeover", key)
        .run_outcome(|| async { Ok::<_, Error>("D".to_owned()) })
        .await;
    assert_eq!(r.unwrap(), ("B".to_owned(), Outcome::Replayed));
    assert_eq!(ledger.count(key), 2, "A once, B once");

    // Case 2: A's late complete arrives after B stored its result.
    let key = "after-b-completed";
    let stored = stored_key(NS, "takeover", key);
    let (a, go, a_claimed_at) = frozen_holder(urls.clone(), NS, key, lease, ledger.clone());
    let l = ledger.clone();
    let (value, outcome) = idem
        .call("takeover", key)
        .wait(Duration::from_secs(30))
        .run_outcome(|| async move {
            l.record(key);
            Ok::<_, Error>("B".to_owned())
        })
        .await
        .unwrap();
    assert!(a_claimed_at.elapsed() >= lease - Duration::from_millis(50));
    assert_eq!((value.as_str(), outcome), ("B", Outcome::Recovered));
    let before = cluster.record(&stored);
    assert_eq!(record_state(before.as_deref()), COMPLETED);
    go.send(()).unwrap();
    let a_result = tokio::task::spawn_blocking(move || a.join().unwrap())
        .await
        .unwrap();
    assert_eq!(a_result.unwrap(), ("A".to_owned(), Outcome::LeaseLost));
    assert_eq!(
        cluster.record(&stored),
        before,
        "A's late complete changed nothing"
    );
    let r = idem
        .call("takeover", key)
        .run_outcome(|| async { Ok::<_, Error>("D".to_owned()) })
        .await;
    assert_eq!(r.unwrap(), ("B".to_owned(), Outcome::Replayed));
    assert_eq!(ledger.count(key), 2, "A once, B once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fingerprint_mismatch_is_refused_pending_or_completed() {
    let (_ctx, idem, keys) = spread_over_a_cluster("fp", "refund", "r", 12).await;
    let ledger = Ledger::new();
    for key in &keys {
        let req = (key.as_str(), 500u64, "EUR");
        let other = (key.as_str(), 501u64, "EUR");
        // While pending: another payload is a mismatch, the same one is in progress.
        let (started_tx, started_rx) = tokio::sync::oneshot::channel();
        let (finish_tx, finish_rx) = tokio::sync::oneshot::channel::<()>();
        let holder = {
            let (idem, l, k) = (idem.clone(), ledger.clone(), key.clone());
            tokio::spawn(async move {
                idem.call("refund", &k)
                    .fingerprint(&(k.as_str(), 500u64, "EUR"))
                    .run_outcome(|| async {
                        l.record(&k);
                        started_tx.send(()).unwrap();
                        finish_rx.await.unwrap();
                        Ok::<_, Error>(500u64)
                    })
                    .await
            })
        };
        started_rx.await.unwrap();
        let r: Result<u64, Error> = idem
            .call("refund", key)
            .fingerprint(&other)
            .run(|| async { Ok(1) })
            .await;
        assert!(
            matches!(r, Err(Error::FingerprintMismatch)),
            "{key} pending: {r:?}"
        );
        let r: Result<u64, Error> = idem
            .call("refund", key)
            .fingerprint(&req)
            .run(|| async { Ok(1) })
            .await;
        assert!(
            matches!(r, Err(Error::InProgress { .. })),
            "{key} pending: {r:?}"
        );
        finish_tx.send(()).unwrap();
        assert_eq!(holder.await.unwrap().unwrap(), (500, Outcome::Executed));
        // Completed: another payload is a mismatch; the same one or none replays.
        let r: Result<u64, Error> = idem
            .call("refund", key)
            .fingerprint(&other)
            .run(|| async { Ok(1) })
            .await;
        assert!(
            matches!(r, Err(Error::FingerprintMismatch)),
            "{key} completed: {r:?}"
        );
        let r = idem
            .call("refund", key)
            .fingerprint(&req)
            .run_outcome(|| async { Ok::<_, Error>(2) })
            .await;
        assert_eq!(r.unwrap(), (500, Outcome::Replayed));
        let r = idem
            .call("refund", key)
            .run_outcome(|| async { Ok::<_, Error>(3) })
            .await;
        assert_eq!(r.unwrap(), (500, Outcome::Replayed));
        assert_eq!(ledger.count(key), 1, "{key}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hash_tag_in_the_namespace_or_the_key_co_locates_records() {
    let ns = "{tenant-7}";
    let ctx = TestContext::redis_cluster().await.with_namespace(ns);
    let cluster = ctx.cluster();
    let idem = ctx.idem();
    let keys: Vec<String> = (0..40).map(|i| format!("order-{i}")).collect();
    let stored: Vec<String> = keys
        .iter()
        .flat_map(|k| [stored_key(ns, "charge", k), stored_key(ns, "refund", k)])
        .collect();
    let slot = key_slot("tenant-7");
    for s in &stored {
        assert_eq!(key_slot(s), slot, "{s}");
    }
    // The server agrees on the slot.
    let server_slot = cluster.nodes()[0].cli(&["CLUSTER", "KEYSLOT", &stored[0]]);
    assert_eq!(server_slot, slot.to_string());
    let owner = cluster.slot_owner(&stored[0]);
    let ledger = Ledger::new();
    for key in &keys {
        for scope in ["charge", "refund"] {
            let (l, k) = (ledger.clone(), format!("{scope}/{key}"));
            let r = idem
                .call(scope, key)
                .run_outcome(|| async move {
                    l.record(&k);
                    Ok::<_, Error>(k)
                })
                .await
                .unwrap();
            assert_eq!(r, (format!("{scope}/{key}"), Outcome::Executed));
        }
    }
    // Every record is on the one master of that slot.
    let mut con = cluster.nodes()[owner].connection();
    let n: usize = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query(&mut con)
        .unwrap();
    assert_eq!(n, stored.len());
    for s in &stored {
        assert_eq!(
            record_state(cluster.record_on(owner, s).unwrap().as_deref()),
            COMPLETED,
            "{s}"
        );
    }
    assert_eq!(ledger.total(), stored.len());

    // A hash tag in the key itself co-locates one customer's keys, across
    // scopes, under a plain namespace.
    let idem = Idempotency::builder(ctx.connect().await)
        .namespace("plain")
        .build();
    let tagged: Vec<(&str, String)> = ["charge", "refund", "notify"]
        .into_iter()
        .flat_map(|scope| (0..5).map(move |i| (scope, format!("{{cust-9}}-{i}"))))
        .collect();
    let slot = key_slot("cust-9");
    for (scope, key) in &tagged {
        let s = stored_key("plain", scope, key);
        assert_eq!(key_slot(&s), slot, "{s}");
        let r = idem
            .call(scope, key)
            .run_outcome(|| async { Ok::<_, Error>(1u8) })
            .await
            .unwrap();
        assert_eq!(r, (1, Outcome::Executed));
        assert_eq!(
            record_state(
                cluster
                    .record_on(cluster.slot_owner_of(slot), &s)
                    .unwrap()
                    .as_deref()
            ),
            COMPLETED,
            "{s}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noscript_after_script_flush_on_every_node_is_recovered() {
    let ctx = TestContext::redis_cluster()
        .await
        .with_namespace("noscript");
    let cluster = ctx.cluster();
    let idem = ctx.builder().lease(Duration::from_secs(3)).build();
    let keys = spread_keys(cluster, "noscript", "op", "k", 30);
    let ledger = Ledger::new();
    let run = |key: String, value: u32| {
        let (idem, l) = (idem.clone(), ledger.clone());
        async move {
            idem.call("op", &key)
                .run_outcome(|| async move {
                    l.record(&key);
                    Ok::<_, Error>(value)
                })
                .await
        }
    };
    // Load every script on every node (claim, complete; release; extend).
    assert_eq!(run("warm".into(), 0).await.unwrap().1, Outcome::Executed);
    let r: Result<(), BodyError> = idem
        .call("op", "warm-err")
        .run(|| async { Err(BodyError::Boom("x".into())) })
        .await;
    assert!(matches!(r, Err(BodyError::Boom(_))));

    let flush_all = || {
        for node in cluster.nodes() {
            assert_eq!(node.cli(&["SCRIPT", "FLUSH"]), "OK");
        }
        noscript_errors(cluster)
    };
    let before = flush_all();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(
            run(key.clone(), i as u32).await.unwrap(),
            (i as u32, Outcome::Executed),
            "{key}"
        );
    }
    // NOSCRIPT really happened, for complete on every master (a fresh
    // claim is a plain SET NX GET: no script), unless the complete is a
    // plain SET … IFEQ too (Valkey 8.1+): then no script at all.
    if ctx.redis_store().complete_path() == "script" {
        assert!(noscript_errors(cluster) >= before + 2);
    } else {
        assert_eq!(noscript_errors(cluster), before);
    }
    let before = flush_all();
    for (i, key) in keys.iter().enumerate() {
        assert_eq!(
            run(key.clone(), 999).await.unwrap(),
            (i as u32, Outcome::Replayed),
            "{key}"
        );
    }
    // Replays are plain SET NX GET: no script, so no NOSCRIPT at all.
    assert_eq!(noscript_errors(cluster), before);
    // Release and extend after a flush: an erroring body (release) and a body
    // that outlives a third of its lease (extend) on every master.
    let before = flush_all();
    for key in &keys {
        let k = format!("{key}-err");
        let r: Result<(), BodyError> = idem
            .call("op", &k)
            .run(|| async { Err(BodyError::Boom("no".into())) })
            .await;
        assert!(matches!(r, Err(BodyError::Boom(_))));
        assert_eq!(
            cluster.record(&stored_key("noscript", "op", &k)),
            None,
            "{k} released"
        );
    }
    assert!(noscript_errors(cluster) >= before + 2);
    let before = flush_all();
    let slow: Vec<_> = keys
        .iter()
        .take(6)
        .map(|key| {
            let idem = idem.clone();
            let key = format!("{key}-slow");
            tokio::spawn(async move {
                idem.call("op", &key)
                    .run_outcome(|| async {
                        tokio::time::sleep(Duration::from_millis(2500)).await;
                        Ok::<_, Error>(1u8)
                    })
                    .await
            })
        })
        .collect();
    // The holders renewed (extend after NOSCRIPT): nobody can take over.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for key in keys.iter().take(6) {
        let r: Result<u8, Error> = idem
            .call("op", format!("{key}-slow"))
            .run(|| async { Ok(2) })
            .await;
        assert!(matches!(r, Err(Error::InProgress { .. })), "{key}: {r:?}");
    }
    for s in slow {
        assert_eq!(s.await.unwrap().unwrap(), (1, Outcome::Executed));
    }
    // extend and complete each met NOSCRIPT (the claims are plain SETs).
    assert!(noscript_errors(cluster) >= before + 2);
    for key in &keys {
        assert_eq!(ledger.count(key), 1, "{key}");
    }
}

/// `NOSCRIPT` error replies sent so far, summed over the nodes.
fn noscript_errors(cluster: &RedisCluster) -> u64 {
    cluster
        .nodes()
        .iter()
        .map(|n| {
            n.cli(&["INFO", "errorstats"])
                .lines()
                .find_map(|l| l.trim().strip_prefix("errorstat_NOSCRIPT:count="))
                .map_or(0, |c| c.trim().parse().unwrap())
        })
        .sum()
}

/// Calls in a load: key, result, when the call began and when it ended.
type Calls = Vec<(String, Result<(String, Outcome), Error>, Instant, Instant)>;

/// Runs load on `keys`, one after the other: each key gets a burst of
/// `burst` concurrent calls. Returns every call's result and timing.
async fn burst_load(
    idem: &Idempotency,
    ledger: &Ledger,
    keys: &[String],
    burst: usize,
    wait: Option<Duration>,
    stop: Arc<AtomicBool>,
) -> Calls {
    let mut results = Vec::new();
    for key in keys {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let mut calls = Vec::new();
        for _ in 0..burst {
            let (idem, l, k) = (idem.clone(), ledger.clone(), key.clone());
            calls.push(tokio::spawn(async move {
                let began = Instant::now();
                let mut call = idem.call("load", &k);
                if let Some(w) = wait {
                    call = call.wait(w);
                }
                let r = call
                    .run_outcome(|| async {
                        l.record(&k);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        Ok::<_, Error>(format!("v-{k}"))
                    })
                    .await;
                (k, r, began, Instant::now())
            }));
        }
        for c in calls {
            results.push(c.await.unwrap());
        }
    }
    results
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load_never_runs_a_body_twice() {
    let cluster = Arc::new(RedisCluster::start());
    let idem = Idempotency::builder(connect(&cluster.urls()).await)
        .namespace("reshard")
        .lease(Duration::from_secs(5))
        .build();
    let keys = spread_keys(&cluster, "reshard", "load", "k", 240);
    // Slots of many keys, moved (with their records) while the keys are hit.
    let slots: Vec<u16> = keys
        .iter()
        .step_by(4)
        .map(|k| key_slot(stored_key("reshard", "load", k)))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let ledger = Ledger::new();
    let stop = Arc::new(AtomicBool::new(false));
    let migrator = {
        let (cluster, slots, stop) = (cluster.clone(), slots.clone(), stop.clone());
        tokio::task::spawn_blocking(move || {
            let mut moved = 0;
            'outer: for pass in 0..3 {
                for &slot in &slots {
                    if stop.load(Ordering::SeqCst) {
                        break 'outer;
                    }
                    let to = (cluster.slot_owner_of(slot) + 1 + pass % 2) % 3;
                    cluster.migrate_slot(slot, to);
                    moved += 1;
                }
            }
            moved
        })
    };
    // Four loaders walk the keys in different orders, each key a burst of 4.
    let mut loaders = Vec::new();
    for t in 0..4u64 {
        let (idem, ledger, stop) = (idem.clone(), ledger.clone(), stop.clone());
        let mut order = keys.clone();
        Rng::new(t + 100).shuffle(&mut order);
        loaders.push(tokio::spawn(async move {
            burst_load(
                &idem,
                &ledger,
                &order,
                4,
                Some(Duration::from_secs(20)),
                stop,
            )
            .await
        }));
    }
    let mut unavailable = 0;
    let mut ok: BTreeMap<String, Vec<(String, Outcome)>> = BTreeMap::new();
    for l in loaders {
        for (key, r, _, _) in l.await.unwrap() {
            match r {
                Ok(v) => ok.entry(key).or_default().push(v),
                Err(e) if is_unavailable(&e) => unavailable += 1,
                Err(e) => panic!("{key}: untyped failure during resharding: {e:?}"),
            }
        }
    }
    stop.store(true, Ordering::SeqCst);
    let moved = migrator.await.unwrap();
    assert!(moved > 0, "no slot was moved during the load");
    // Every key once more, after the moves: replays, never a second run.
    for key in &keys {
        let l = ledger.clone();
        let k = key.clone();
        let (v, o) = idem
            .call("load", key)
            .wait(Duration::from_secs(20))
            .run_outcome(|| async move {
                l.record(&k);
                Ok::<_, Error>(format!("v-{k}"))
            })
            .await
            .unwrap_or_else(|e| panic!("{key} after resharding: {e}"));
        assert_eq!(v, format!("v-{key}"));
        if ledger.count(key) == 1 && ok.contains_key(key) {
            assert_eq!(o, Outcome::Replayed, "{key}");
        }
    }
    for key in &keys {
        assert_eq!(
            ledger.count(key),
            1,
            "{key} ran {} times",
            ledger.count(key)
        );
        for (v, _) in ok.get(key).into_iter().flatten() {
            assert_eq!(*v, format!("v-{key}"));
        }
        let executed = ok
            .get(key)
            .into_iter()
            .flatten()
            .filter(|(_, o)| o.ran_body())
            .count();
        assert!(
            executed <= 1,
            "{key}: {executed} callers say they ran the body"
        );
    }
    eprintln!(
        "resharding: {moved} slot moves over {} slots, {} calls ok, {unavailable} Unavailable",
        slots.len(),
        ok.values().map(Vec::len).sum::<usize>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_restart_under_load_gives_unavailable_or_success_never_a_duplicate() {
    let cluster = Arc::new(std::sync::Mutex::new(RedisCluster::start()));
    let (urls, victim_node) = {
        let c = cluster.lock().unwrap();
        (c.urls(), 1usize)
    };
    let idem = Idempotency::builder(connect(&urls).await)
        .namespace("restart")
        .lease(Duration::from_secs(5))
        .build();
    let keys = spread_keys(&cluster.lock().unwrap(), "restart", "load", "k", 900);
    let owner_of: HashMap<String, usize> = {
        let c = cluster.lock().unwrap();
        keys.iter()
            .map(|k| (k.clone(), c.slot_owner(&stored_key("restart", "load", k))))
            .collect()
    };
    let ledger = Ledger::new();
    let stop = Arc::new(AtomicBool::new(false));
    // Each key gets one burst of 3 concurrent calls and is never called
    // again during the load: a restarted master (no persistence, no
    // replica) loses its records, so re-calling a key it held would rightly
    // run the body again.
    let chunks: Vec<Vec<String>> = keys
        .chunks(keys.len() / 6)
        .map(<[String]>::to_vec)
        .collect();
    let mut loaders = Vec::new();
    for chunk in chunks {
        let (idem, ledger, stop) = (idem.clone(), ledger.clone(), stop.clone());
        loaders.push(tokio::spawn(async move {
            burst_load(&idem, &ledger, &chunk, 3, None, stop).await
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let restart_began = Instant::now();
    let restarter = {
        let cluster = cluster.clone();
        tokio::task::spawn_blocking(move || cluster.lock().unwrap().restart_node(victim_node))
    };
    restarter.await.unwrap();
    let restart_ended = Instant::now();
    let mut results = Vec::new();
    for l in loaders {
        results.extend(l.await.unwrap());
    }
    stop.store(true, Ordering::SeqCst);

    let mut unavailable = 0;
    let mut succeeded = 0;
    let mut ran: BTreeMap<String, usize> = BTreeMap::new();
    let (mut hit, mut after) = (0, 0);
    for (key, r, began, ended) in &results {
        if owner_of[key] == victim_node && *began < restart_ended && *ended > restart_began {
            hit += 1;
        }
        if *began > restart_ended {
            after += 1;
        }
        match r {
            Ok((v, o)) => {
                assert_eq!(*v, format!("v-{key}"));
                succeeded += 1;
                if o.ran_body() {
                    *ran.entry(key.clone()).or_default() += 1;
                }
            }
            Err(Error::InProgress { .. }) => {}
            Err(e) if is_unavailable(e) => unavailable += 1,
            Err(e) => panic!("{key}: untyped failure during a node restart: {e:?}"),
        }
    }
    let mut explained = Vec::new();
    for (key, n) in ledger.duplicates() {
        let runs = ledger.runs(&key);
        // The only acceptable second run: the key's master was the one
        // restarted (its record was lost), the first run began before the
        // restart was over and the second after it began.
        let lost_record = owner_of[&key] == victim_node
            && n == 2
            && runs[0] < restart_ended
            && runs[1] > restart_began;
        assert!(
            lost_record,
            "{key} ran {n} times and its record was not lost: {runs:?}"
        );
        explained.push(key);
    }
    for (key, n) in &ran {
        assert!(
            *n == 1 || explained.contains(key),
            "{key}: {n} callers ran the body"
        );
    }
    eprintln!(
        "node restart: {} calls, {succeeded} ok, {unavailable} Unavailable; {hit} calls on the \
         restarted master overlapped its restart, {after} calls began after it; {} keys ran again \
         because the restarted master lost their record: {explained:?}",
        results.len(),
        explained.len()
    );
    assert!(succeeded > 0);
    assert!(hit > 0 && after > 0, "the load did not span the restart");

    // The cluster works again on every master, NOSCRIPT on the fresh node included.
    let fresh = spread_keys(&cluster.lock().unwrap(), "restart", "load", "after", 30);
    for key in &fresh {
        let l = ledger.clone();
        let k = key.clone();
        let r = eventually(
            &format!("{key} works after the restart"),
            Duration::from_secs(30),
            || {
                let (idem, l, k) = (idem.clone(), l.clone(), k.clone());
                async move {
                    let r = idem
                        .call("load", &k)
                        .run_outcome(|| async {
                            l.record(&k);
                            Ok::<_, Error>(1u8)
                        })
                        .await;
                    match r {
                        Ok(v) => Some(v),
                        Err(e) if is_unavailable(&e) => None,
                        Err(e) => panic!("{k}: {e}"),
                    }
                }
            },
        )
        .await;
        assert_eq!(r, (1, Outcome::Executed));
        let r = idem
            .call("load", key)
            .run_outcome(|| async { Ok::<_, Error>(2u8) })
            .await;
        assert_eq!(r.unwrap(), (1, Outcome::Replayed));
        assert_eq!(ledger.count(key), 1, "{key}");
    }
}
