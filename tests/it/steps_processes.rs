//! Durable steps across real processes that are SIGKILLed between steps and
//! in the middle of steps: four worker processes (this test binary
//! re-executed with `IDEM_WORKER=1`) race through the same orders, each a
//! `run_steps` call of three steps (reserve, charge, e-mail), while the
//! parent kills a random worker every few tens of milliseconds and starts a
//! fresh one in its place.
//!
//! Two ledgers outside idem's store are the ground truth:
//! - a file every step appends `order:step pid ms` to when its effect
//!   starts (`FileLedger`): every run of a step but the last must be one a
//!   killed process died in (the interrupted step, at most once more per
//!   kill), and no step that finished ever runs again;
//! - a payment provider that honours idempotency keys, on a Redis server of
//!   its own: the charge step passes `s.key("charge")`, the provider charges
//!   (counts) once per key, so every order is charged **exactly once**
//!   across all the crashes, and every process gets the same charge id.
//!
//! Run against a Redis server, a Redis Cluster and PostgreSQL.

use idem::{Error, Idempotency, RedisStore, Steps};
use idem_testkit::{FileLedger, RedisCluster, RedisServer, Rng, unix_ms};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ORDERS: usize = 40;
const WORKERS: usize = 4;
const KILLS: usize = 16;
const STEPS: [&str; 3] = ["reserve", "charge", "email"];

// ---------------------------------------------------------------- worker side

use idem_testkit::worker_env as env;

/// The worker process: runs only when re-executed by a test below.
#[test]
fn worker() {
    if std::env::var_os("IDEM_WORKER").is_none() {
        return;
    }
    idem_testkit::run_worker(work());
    std::process::exit(0);
}

use idem_testkit::CHARGE_ONCE_SCRIPT as CHARGE;

fn build(store: impl idem::store::Store) -> Idempotency {
    Idempotency::builder(store)
        .namespace("steps-procs")
        .lease(Duration::from_millis(400))
        .build()
}

async fn work() {
    let dir = PathBuf::from(env("IDEM_DIR"));
    let name = env("IDEM_NAME");
    let url = env("IDEM_URL");
    let idem = match env("IDEM_STORE").as_str() {
        "redis" => build(RedisStore::connect(&url).await.expect("connect")),
        "cluster" => {
            let urls: Vec<&str> = url.split(' ').collect();
            build(
                RedisStore::connect_cluster(&urls)
                    .await
                    .expect("connect cluster"),
            )
        }
        "postgres" => build(
            idem_postgres::PgStore::connect(&url)
                .await
                .expect("connect postgres"),
        ),
        other => panic!("worker: unknown store {other}"),
    };
    let pay = redis::Client::open(env("IDEM_PAY_URL"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the payment provider");
    let ledger = FileLedger::at(dir.join("ledger"));
    let mut rng = Rng::new(env("IDEM_SEED").parse().unwrap());
    let mut orders: Vec<String> = (0..ORDERS).map(|i| format!("order-{i}")).collect();
    rng.shuffle(&mut orders);
    std::fs::write(dir.join(format!("ready-{name}")), b"").unwrap();
    let mut out = String::new();
    for order in orders {
        let pauses: Vec<u64> = (0..6).map(|_| rng.below(12)).collect();
        let r: Result<String, Error> = idem
            .call("checkout", &order)
            .wait(Duration::from_secs(60))
            .run_steps(async |s| checkout(s, &order, &ledger, pay.clone(), &pauses).await)
            .await;
        match r {
            Ok(charge) => out.push_str(&format!("{order} {charge}\n")),
            Err(e) => panic!("worker {name}: {order}: {e:?}"),
        }
    }
    std::fs::write(dir.join(format!("results-{name}")), out).unwrap();
}

/// One order: each step records its effect in the ledger when it starts,
/// then takes a few ms (a kill can land mid-step), with a pause between
/// steps (a kill can land between them).
async fn checkout(
    s: &Steps,
    order: &str,
    ledger: &FileLedger,
    mut pay: redis::aio::MultiplexedConnection,
    pauses: &[u64],
) -> Result<String, Error> {
    let nap = |i: usize| tokio::time::sleep(Duration::from_millis(pauses[i]));
    let hold = s
        .step("reserve", async || {
            ledger.record(&format!("{order}:reserve"));
            nap(0).await;
            Ok::<_, Error>(format!("hold-{}", std::process::id()))
        })
        .await?;
    nap(1).await;
    let key = s.key("charge");
    let charge = s
        .step("charge", async || {
            ledger.record(&format!("{order}:charge"));
            nap(2).await;
            let id: String = redis::Script::new(CHARGE)
                .key(format!("pay:{key}"))
                .arg(order)
                .arg(format!("ch-{}-{hold}", std::process::id()))
                .invoke_async(&mut pay)
                .await
                .map_err(|e| Error::unavailable("claim", format!("payment provider: {e}")))?;
            nap(3).await;
            Ok::<_, Error>(id)
        })
        .await?;
    nap(4).await;
    s.step("email", async || {
        ledger.record(&format!("{order}:email"));
        nap(5).await;
        Ok::<_, Error>(())
    })
    .await?;
    Ok(charge)
}

// ---------------------------------------------------------------- parent side

struct Rig {
    dir: PathBuf,
    store: &'static str,
    url: String,
    pay_url: String,
    workers: BTreeMap<String, Child>,
    pids: BTreeMap<u32, String>,
    killed: BTreeSet<u32>,
}

impl Rig {
    fn new(store: &'static str, url: String, pay_url: String) -> Rig {
        let dir = std::env::temp_dir().join(format!(
            "idem-steps-{store}-{}-{}",
            std::process::id(),
            unix_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Rig {
            dir,
            store,
            url,
            pay_url,
            workers: BTreeMap::new(),
            pids: BTreeMap::new(),
            killed: BTreeSet::new(),
        }
    }

    fn spawn(&mut self, name: &str, seed: u64) {
        let log = std::fs::File::create(self.dir.join(format!("log-{name}"))).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "steps_processes::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_WORKER", "1")
            .env("IDEM_STORE", self.store)
            .env("IDEM_URL", &self.url)
            .env("IDEM_PAY_URL", &self.pay_url)
            .env("IDEM_DIR", &self.dir)
            .env("IDEM_NAME", name)
            .env("IDEM_SEED", seed.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("re-execute the test binary as a worker");
        self.pids.insert(child.id(), name.to_owned());
        self.workers.insert(name.to_owned(), child);
    }

    /// The live workers that have started on their orders.
    fn ready(&self) -> Vec<String> {
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            let ready: Vec<String> = self
                .workers
                .keys()
                .filter(|n| self.dir.join(format!("ready-{n}")).exists())
                .cloned()
                .collect();
            if !ready.is_empty() || Instant::now() > end {
                return ready;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn kill(&mut self, name: &str) {
        let mut child = self.workers.remove(name).unwrap();
        self.killed.insert(child.id());
        let _ = child.kill();
        let _ = child.wait();
    }

    fn join_all(&mut self) {
        let end = Instant::now() + Duration::from_secs(180);
        let names: Vec<String> = self.workers.keys().cloned().collect();
        for name in names {
            loop {
                let child = self.workers.get_mut(&name).unwrap();
                if let Some(status) = child.try_wait().unwrap() {
                    assert!(
                        status.success(),
                        "worker {name} failed: {status}\n{}",
                        self.log(&name)
                    );
                    self.workers.remove(&name);
                    break;
                }
                assert!(
                    Instant::now() < end,
                    "worker {name} did not finish\n{}",
                    self.log(&name)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn log(&self, name: &str) -> String {
        let log = std::fs::read_to_string(self.dir.join(format!("log-{name}"))).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }

    fn ledger(&self) -> FileLedger {
        FileLedger::at(self.dir.join("ledger"))
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

/// Four workers race, a random one is killed and replaced `KILLS` times,
/// then the survivors finish every order; the ledgers are checked.
fn crash_and_resume(store: &'static str, url: String) {
    let pay = RedisServer::start();
    let mut rig = Rig::new(store, url, pay.url());
    let mut rng = Rng::new(unix_ms() as u64);
    let mut next = 0u64;
    for _ in 0..WORKERS {
        next += 1;
        rig.spawn(&format!("w{next}"), next);
    }
    let started = Instant::now();
    for _ in 0..KILLS {
        std::thread::sleep(Duration::from_millis(20 + rng.below(80)));
        // Only a worker that is at work (connected, through its orders).
        let names = rig.ready();
        if names.is_empty() {
            continue;
        }
        let victim = names[rng.below(names.len() as u64) as usize].clone();
        rig.kill(&victim);
        next += 1;
        rig.spawn(&format!("w{next}"), next);
    }
    rig.join_all();

    // Group the ledger: runs of each (order, step), in file order.
    let runs = rig.ledger().runs();
    let mut by_step: BTreeMap<(String, String), Vec<u32>> = BTreeMap::new();
    // The last ledger line of each process for each order: where it was.
    let mut last: BTreeMap<(u32, String), usize> = BTreeMap::new();
    for (i, run) in runs.iter().enumerate() {
        let (order, step) = run.key.split_once(':').expect("order:step");
        by_step
            .entry((order.to_owned(), step.to_owned()))
            .or_default()
            .push(run.pid);
        last.insert((run.pid, order.to_owned()), i);
    }
    let mut extra = 0;
    for order in (0..ORDERS).map(|i| format!("order-{i}")) {
        for step in STEPS {
            let pids = by_step
                .get(&(order.clone(), step.to_owned()))
                .unwrap_or_else(|| panic!("{order}:{step} never ran"));
            // Every run but the last was interrupted: by a process that was
            // killed, and that did nothing more for this order afterwards.
            for pid in &pids[..pids.len() - 1] {
                assert!(
                    rig.killed.contains(pid),
                    "{order}:{step} ran again after a run by {pid}, which was not killed: {pids:?}"
                );
                let at = last[&(*pid, order.clone())];
                assert_eq!(
                    runs[at].key,
                    format!("{order}:{step}"),
                    "{order}:{step}: {pid} went on after it, yet the step ran again"
                );
            }
            extra += pids.len() - 1;
        }
    }
    assert!(
        extra <= rig.killed.len(),
        "{extra} re-runs for {} kills: each kill interrupts one step at most",
        rig.killed.len()
    );

    // The provider's ledger: one charge per order, whatever the crashes.
    let mut con = pay.connection();
    let charges: BTreeMap<String, i64> = redis::cmd("HGETALL")
        .arg("charges")
        .query(&mut con)
        .unwrap();
    assert_eq!(charges.len(), ORDERS, "every order charged: {charges:?}");
    assert!(
        charges.values().all(|&n| n == 1),
        "an order charged twice: {charges:?}"
    );
    // Every finishing worker got the same charge id for an order.
    let mut ids: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for entry in std::fs::read_dir(&rig.dir).unwrap() {
        let path = entry.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("results-")
        {
            for line in std::fs::read_to_string(&path).unwrap().lines() {
                let (order, id) = line.split_once(' ').unwrap();
                ids.entry(order.to_owned())
                    .or_default()
                    .insert(id.to_owned());
            }
        }
    }
    assert_eq!(ids.len(), ORDERS);
    assert!(ids.values().all(|set| set.len() == 1), "{ids:?}");
    let charge_reruns: usize = by_step
        .iter()
        .filter(|((_, step), _)| step == "charge")
        .map(|(_, pids)| pids.len() - 1)
        .sum();
    eprintln!(
        "{store}: {ORDERS} orders, {WORKERS} workers, {} kills in {:?}: {} steps ran again \
         (interrupted mid-step), 0 finished steps re-ran; the charge step ran again {} times \
         and the provider charged {} times (1 per order)",
        rig.killed.len(),
        started.elapsed(),
        extra,
        charge_reruns,
        charges.values().sum::<i64>(),
    );
}

#[test]
fn sigkill_between_and_inside_steps_on_redis() {
    let server = RedisServer::start();
    crash_and_resume("redis", server.url());
}

#[test]
fn sigkill_between_and_inside_steps_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    crash_and_resume("cluster", cluster.urls().join(" "));
}

#[test]
fn sigkill_between_and_inside_steps_on_postgres() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let db = rt.block_on(async {
        let db = idem_testkit::PgTestDb::new().await;
        idem_postgres::PgStore::from_pool(db.pool.clone())
            .migrate()
            .await
            .unwrap();
        db
    });
    crash_and_resume("postgres", db.url.clone());
    drop(rt);
}
