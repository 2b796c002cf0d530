//! A crash loop: two worker processes (this test binary re-executed with
//! `IDEM_LAMBDA_WORKER=1`) each play a Lambda execution environment on one
//! SQS queue of the local endpoint — receive a batch, run it through the
//! handler on a `RedisStore`, apply its `batchItemFailures` as the event
//! source mapping does — while the parent SIGKILLs one of them about every
//! half second and starts a fresh one, until the queue drains.
//!
//! The store is a private redis-server that outlives the workers. The
//! ground truth is outside it:
//! - a payment provider on the same server that honours idempotency keys
//!   (charges once per key, in a script): every order is charged **exactly
//!   once**;
//! - a file every body appends `order pid ms` to when it starts
//!   (`FileLedger`): a key's body runs again only after a run in a process
//!   that was killed (idem's takeover of a dead invocation's key, once its
//!   lease lapses); no body that finished ever runs again;
//! - every batch's `batchItemFailures` lists exactly the records the
//!   handler reports failed (a worker writes a violation down for the
//!   parent to find).

use crate::support::{Queue, event};
use aws_lambda_events::sqs::SqsMessage;
use idem_core::Idempotency;
use idem_lambda::SqsBatchHandler;
use idem_redis::RedisStore;
use idem_testkit::{FileLedger, RedisServer, Rng, unix_ms};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

const ORDERS: u32 = 80;
const WORKERS: usize = 2;

use idem_testkit::worker_env as env;

/// The worker process: runs only when re-executed by the test below.
#[test]
fn worker() {
    if std::env::var_os("IDEM_LAMBDA_WORKER").is_none() {
        return;
    }
    idem_testkit::run_worker(work());
    std::process::exit(0);
}

use idem_testkit::CHARGE_ONCE_SCRIPT as CHARGE;

async fn work() {
    let url = env("IDEM_URL");
    let ledger = FileLedger::at(PathBuf::from(env("IDEM_LEDGER")));
    let dir = PathBuf::from(env("IDEM_DIR"));
    let store = RedisStore::connect(&url).await.unwrap();
    let idem = Idempotency::builder(store)
        .namespace("lambda-crash")
        .lease(Duration::from_secs(1))
        .build();
    // Two records at a time: a batch of ten takes about a second, so most
    // kills land in the middle of one.
    let handler = SqsBatchHandler::new(idem, "orders.charge").concurrency(2);
    let pay = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let queue = Queue::attach(env("IDEM_QUEUE_URL"), env("IDEM_QUEUE_NAME")).await;
    let charge = |m: SqsMessage| {
        let (ledger, mut pay) = (ledger.clone(), pay.clone());
        async move {
            let order = m.body.clone().unwrap();
            ledger.record(&order);
            // A kill can land before, during or after the charge.
            tokio::time::sleep(Duration::from_millis(100)).await;
            let id: String = redis::Script::new(CHARGE)
                .key(format!("charge:{order}"))
                .arg(&order)
                .arg(format!("ch-{order}-{}", std::process::id()))
                .invoke_async(&mut pay)
                .await
                .map_err(|e| e.to_string())?;
            tokio::time::sleep(Duration::from_millis(100)).await;
            Ok::<_, String>(id)
        }
    };
    std::fs::write(PathBuf::from(env("IDEM_READY")), b"").unwrap();
    loop {
        let records = queue.receive(1).await;
        if records.is_empty() {
            continue;
        }
        // Each batch is an invocation with 20 s ahead of it.
        let deadline = SystemTime::now() + Duration::from_secs(20);
        let report = handler
            .run(event(records.clone()), Some(deadline), &charge)
            .await
            .unwrap();
        // `batchItemFailures` lists exactly the records reported failed;
        // a violation is written down for the parent (a panic here would
        // only stop this worker).
        let listed: BTreeSet<String> = crate::support::failures(&report.response)
            .into_iter()
            .collect();
        let failed: BTreeSet<String> = report
            .records
            .iter()
            .filter(|r| r.is_failure())
            .map(|r| r.message_id.clone())
            .collect();
        if listed != failed {
            let why = format!("listed {listed:?}, failed {failed:?}");
            std::fs::write(dir.join(format!("violation-{}", std::process::id())), why).unwrap();
            std::process::exit(1);
        }
        queue.apply(&records, &report.response).await;
    }
}

struct Rig {
    dir: PathBuf,
    url: String,
    queue_url: String,
    queue_name: String,
    workers: BTreeMap<usize, Child>,
    killed: BTreeSet<u32>,
    next: usize,
}

impl Rig {
    fn spawn(&mut self) {
        let n = self.next;
        self.next += 1;
        let log = std::fs::File::create(self.dir.join(format!("log-{n}"))).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "crash_loop::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_LAMBDA_WORKER", "1")
            .env("IDEM_URL", &self.url)
            .env("IDEM_LEDGER", self.dir.join("ledger"))
            .env("IDEM_DIR", &self.dir)
            .env("IDEM_READY", self.dir.join(format!("ready-{n}")))
            .env("IDEM_QUEUE_URL", &self.queue_url)
            .env("IDEM_QUEUE_NAME", &self.queue_name)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("re-execute the test binary as a worker");
        self.workers.insert(n, child);
    }

    fn kill(&mut self, n: usize) {
        let mut child = self.workers.remove(&n).unwrap();
        self.killed.insert(child.id());
        let _ = child.kill();
        let _ = child.wait();
    }

    fn logs(&self) -> String {
        (0..self.next)
            .map(|n| {
                let log =
                    std::fs::read_to_string(self.dir.join(format!("log-{n}"))).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(10).collect();
                format!(
                    "worker {n}:\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for child in self.workers.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Workers SIGKILLed about every half second while the queue drains: every
/// order charged exactly once, every extra run of a body explained by a
/// kill, and no body that finished run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_killed_while_the_queue_drains_charge_each_order_once() {
    let server = RedisServer::start();
    let queue = Queue::create("idem-lambda-crash", false, 2).await;
    let dir = std::env::temp_dir().join(format!(
        "idem-lambda-crash-{}-{}",
        std::process::id(),
        unix_ms()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rig = Rig {
        dir,
        url: server.url(),
        queue_url: queue.url.clone(),
        queue_name: queue.name.clone(),
        workers: BTreeMap::new(),
        killed: BTreeSet::new(),
        next: 0,
    };
    for o in 0..ORDERS {
        queue.send(&format!("o{o}"), None).await;
    }
    for _ in 0..WORKERS {
        rig.spawn();
    }
    let mut rng = Rng::new(unix_ms() as u64);
    let mut pay = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let end = Instant::now() + Duration::from_secs(150);
    let mut kills = 0;
    loop {
        assert!(
            Instant::now() < end,
            "the queue did not drain\n{}",
            rig.logs()
        );
        tokio::time::sleep(Duration::from_millis(300 + rng.below(400))).await;
        let charged: BTreeMap<String, u32> = redis::cmd("HGETALL")
            .arg("charges")
            .query_async(&mut pay)
            .await
            .unwrap();
        if charged.len() == ORDERS as usize && queue.depth().await == 0 {
            break;
        }
        // Kill one worker that has started, and start a fresh one.
        let ready: Vec<usize> = rig
            .workers
            .keys()
            .copied()
            .filter(|n| rig.dir.join(format!("ready-{n}")).exists())
            .collect();
        if let Some(&n) = ready.get(rng.below(ready.len().max(1) as u64) as usize) {
            rig.kill(n);
            kills += 1;
            rig.spawn();
        }
    }
    let violations: Vec<String> = std::fs::read_dir(&rig.dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("violation-"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    assert!(
        violations.is_empty(),
        "batchItemFailures not the failed records: {violations:?}"
    );
    let charged: BTreeMap<String, u32> = redis::cmd("HGETALL")
        .arg("charges")
        .query_async(&mut pay)
        .await
        .unwrap();
    assert_eq!(charged.len(), ORDERS as usize);
    assert!(
        charged.values().all(|&n| n == 1),
        "charges per order: {charged:?}"
    );

    // Every run of an order but its last is one a killed process made.
    let mut runs: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for r in FileLedger::at(rig.dir.join("ledger")).runs() {
        runs.entry(r.key).or_default().push(r.pid);
    }
    assert_eq!(runs.len(), ORDERS as usize);
    for (order, pids) in &runs {
        for pid in &pids[..pids.len() - 1] {
            assert!(
                rig.killed.contains(pid),
                "{order} ran again after a run by live process {pid} (runs {pids:?})"
            );
        }
    }
    let extra: usize = runs.values().map(|p| p.len() - 1).sum();
    println!("crash loop: {kills} kills, {extra} bodies run again after a kill");
    assert!(kills >= 1, "no worker was killed while the queue drained");
    drop(rig);
    queue.delete().await;
}
