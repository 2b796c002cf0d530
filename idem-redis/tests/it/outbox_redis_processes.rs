//! The Redis outbox across real processes that are SIGKILLed: three worker
//! processes (this test binary re-executed with `IDEM_WORKER=worker`) race
//! through the same 40 orders, each a call that stages `created` and `paid`
//! for its order, while two relay processes (`IDEM_WORKER=relay`) publish
//! the outbox to a second Redis (the next system) through the Redis Streams
//! sink. The parent kills a random worker or relay every few tens of
//! milliseconds and starts a fresh one in its place.
//!
//! The ground truth is outside idem's store: a file every body appends to
//! when it runs, and the downstream stream. Each order's two messages are
//! there (nothing lost), under exactly the two ids its call derives (a body
//! run again after a crash adds no third), `created` first; and every body
//! run but the last was in a process that was killed.

use idem_consumer::outbox::RedisStreamsSink;
use idem_core::outbox::{self, message_id};
use idem_core::{Error, Idempotency};
use idem_redis::RedisStore;
use idem_redis::outbox::RedisRelay;
use idem_testkit::{FileLedger, RedisServer, Rng, unix_ms};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ORDERS: usize = 60;
const WORKERS: usize = 3;
const RELAYS: usize = 2;
const KILLS: usize = 24;

use idem_testkit::worker_env as env;

/// The worker and relay processes: run only when re-executed below.
#[test]
fn worker() {
    let Some(role) = std::env::var_os("IDEM_WORKER") else {
        return;
    };
    match role.to_str() {
        Some("worker") => idem_testkit::run_worker(work()),
        Some("relay") => idem_testkit::run_worker(relay()),
        other => panic!("unknown role {other:?}"),
    }
    std::process::exit(0);
}

async fn work() {
    let dir = PathBuf::from(env("IDEM_DIR"));
    let name = env("IDEM_NAME");
    let store = RedisStore::connect(&env("IDEM_URL"))
        .await
        .expect("connect");
    let idem = Idempotency::builder(store)
        .namespace("outbox-procs")
        .lease(Duration::from_millis(400))
        .build();
    let ledger = FileLedger::at(dir.join("ledger"));
    let mut rng = Rng::new(env("IDEM_SEED").parse().unwrap());
    let mut orders: Vec<String> = (0..ORDERS).map(|i| format!("order-{i}")).collect();
    rng.shuffle(&mut orders);
    std::fs::write(dir.join(format!("ready-{name}")), b"").unwrap();
    for order in orders {
        let pause = 10 + rng.below(50);
        let r: Result<String, Error> = idem
            .call("orders.create", &order)
            .wait(Duration::from_secs(60))
            .run(|| async {
                ledger.record(&order);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                outbox::stage("orders", &order, &format!("{order}:created"))?;
                outbox::stage("orders", &order, &format!("{order}:paid"))?;
                Ok(order.clone())
            })
            .await;
        if let Err(e) = r {
            panic!("worker {name}: {order}: {e:?}");
        }
    }
    std::fs::write(dir.join(format!("done-{name}")), b"").unwrap();
}

async fn relay() {
    let dir = PathBuf::from(env("IDEM_DIR"));
    let name = env("IDEM_NAME");
    let store = RedisStore::connect(&env("IDEM_URL"))
        .await
        .expect("connect");
    let sink = RedisStreamsSink::connect(&env("IDEM_NEXT_URL"))
        .await
        .expect("connect to the next system");
    std::fs::write(dir.join(format!("ready-{name}")), b"").unwrap();
    let relay = RedisRelay::new(&store, sink)
        .batch_size(8)
        .poll_interval(Duration::from_millis(10));
    relay.run(std::future::pending()).await;
}

struct Rig {
    dir: PathBuf,
    url: String,
    next_url: String,
    children: BTreeMap<String, Child>,
    killed: BTreeSet<u32>,
}

impl Rig {
    fn spawn(&mut self, role: &str, name: &str, seed: u64) {
        let log = std::fs::File::create(self.dir.join(format!("log-{name}"))).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "outbox_redis_processes::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_WORKER", role)
            .env("IDEM_URL", &self.url)
            .env("IDEM_NEXT_URL", &self.next_url)
            .env("IDEM_DIR", &self.dir)
            .env("IDEM_NAME", name)
            .env("IDEM_SEED", seed.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("re-execute the test binary");
        self.children.insert(name.to_owned(), child);
    }

    fn ready(&self, prefix: &str) -> Vec<String> {
        self.children
            .keys()
            .filter(|n| n.starts_with(prefix) && self.dir.join(format!("ready-{n}")).exists())
            .cloned()
            .collect()
    }

    fn kill(&mut self, name: &str) {
        let mut child = self.children.remove(name).unwrap();
        self.killed.insert(child.id());
        let _ = child.kill();
        let _ = child.wait();
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("log-{name}"))).unwrap_or_default()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for child in self.children.values_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn killed_workers_and_relays_lose_nothing_and_add_nothing() {
    let server = RedisServer::start();
    let next = RedisServer::start();
    let dir = std::env::temp_dir().join(format!(
        "idem-outbox-procs-{}-{}",
        std::process::id(),
        unix_ms()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rig = Rig {
        dir,
        url: server.url(),
        next_url: next.url(),
        children: BTreeMap::new(),
        killed: BTreeSet::new(),
    };
    let mut rng = Rng::new(unix_ms() as u64);
    let mut n = 0u64;
    for _ in 0..WORKERS {
        n += 1;
        rig.spawn("worker", &format!("w{n}"), n);
    }
    for _ in 0..RELAYS {
        n += 1;
        rig.spawn("relay", &format!("r{n}"), n);
    }
    let ready_by = Instant::now() + Duration::from_secs(60);
    while rig.ready("w").is_empty() && Instant::now() < ready_by {
        std::thread::sleep(Duration::from_millis(5));
    }
    for _ in 0..KILLS {
        std::thread::sleep(Duration::from_millis(20 + rng.below(80)));
        let role = if rng.below(3) == 0 { "r" } else { "w" };
        let names = rig.ready(role);
        if names.is_empty() {
            continue;
        }
        let victim = names[rng.below(names.len() as u64) as usize].clone();
        rig.kill(&victim);
        n += 1;
        let (kind, name) = if role == "r" {
            ("relay", format!("r{n}"))
        } else {
            ("worker", format!("w{n}"))
        };
        rig.spawn(kind, &name, n);
    }
    // The workers finish every order.
    let end = Instant::now() + Duration::from_secs(120);
    loop {
        let workers: Vec<String> = rig
            .children
            .keys()
            .filter(|k| k.starts_with('w'))
            .cloned()
            .collect();
        if workers.is_empty() {
            break;
        }
        for name in workers {
            if let Some(status) = rig.children.get_mut(&name).unwrap().try_wait().unwrap() {
                assert!(
                    status.success(),
                    "worker {name} failed: {status}\n{}",
                    rig.log(&name)
                );
                rig.children.remove(&name);
            }
        }
        assert!(Instant::now() < end, "the workers did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The relays drain the outbox.
    let end = Instant::now() + Duration::from_secs(60);
    while server.cli(&["XLEN", "idem-outbox"]).trim() != "0" {
        assert!(
            Instant::now() < end,
            "the outbox was not drained: {} left",
            server.cli(&["XLEN", "idem-outbox"])
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(server.cli(&["HLEN", "idem-outbox.parked"]).trim(), "0");

    // Downstream: each entry's id and payload, in stream order.
    let raw = next.cli(&["--raw", "XRANGE", "orders", "-", "+"]);
    let lines: Vec<&str> = raw.lines().collect();
    let mut firsts: Vec<(String, String)> = Vec::new(); // (id, payload), first copies
    let mut seen = BTreeSet::new();
    let mut i = 0;
    while i < lines.len() {
        // entry id, then field/value pairs: id, payload, key
        if lines.get(i + 1) == Some(&"id") {
            let id = lines[i + 2].to_owned();
            let payload = lines[i + 4].to_owned();
            if seen.insert(id.clone()) {
                firsts.push((id, payload));
            }
            i += 7;
        } else {
            i += 1;
        }
    }
    assert_eq!(
        firsts.len(),
        2 * ORDERS,
        "distinct ids downstream: {firsts:?}"
    );
    for o in 0..ORDERS {
        let order = format!("order-{o}");
        let record_key = format!("outbox-procs:orders.create:{order}");
        let created = message_id(&record_key, "orders");
        let paid = message_id(&record_key, "orders#1");
        let at = |id: &str| firsts.iter().position(|(i, _)| i == id);
        let (c, p) = (at(&created), at(&paid));
        assert!(c.is_some() && p.is_some(), "{order}: a message was lost");
        assert!(c < p, "{order}: paid went out before created");
        assert_eq!(firsts[c.unwrap()].1, format!("\"{order}:created\""));
    }
    // Every body run but the last was in a killed process.
    let mut runs: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for run in FileLedger::at(rig.dir.join("ledger")).runs() {
        runs.entry(run.key.clone()).or_default().push(run.pid);
    }
    assert_eq!(runs.len(), ORDERS);
    let total: usize = runs.values().map(Vec::len).sum();
    eprintln!(
        "{} processes killed; {total} body runs for {ORDERS} orders; {} entries downstream for {} messages",
        rig.killed.len(),
        lines.len() / 7,
        2 * ORDERS
    );
    for (order, pids) in &runs {
        for pid in &pids[..pids.len() - 1] {
            assert!(
                rig.killed.contains(pid),
                "{order} ran again after a run by {pid}, which was not killed: {pids:?}"
            );
        }
    }
}
