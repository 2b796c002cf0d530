//! Many OS processes, one Redis: the test binary re-executes itself as
//! worker processes (`IDEM_WORKER=1`, running only the `worker` test) that
//! hammer overlapping keys at once. Every body appends `key pid ms` to a
//! ledger file (opened with `O_APPEND` for each line), which is the ground
//! truth: exactly one run per key, and after `SIGKILL` of holders mid-body,
//! exactly one more run for each key a dead holder had, after its lease.

use idem_core::{Error, Idempotency};
use idem_redis::RedisStore;
use idem_testkit::{FileLedger, RedisServer, Rng, unix_ms};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What a body returns: which key, and which process ran it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    pid: u32,
}

// ---------------------------------------------------------------- worker side

/// Worker settings, passed by the parent in the environment.
struct WorkerConfig {
    url: String,
    dir: PathBuf,
    name: String,
    mode: String,
    keys: usize,
    seed: u64,
    lease: Duration,
}

use idem_testkit::worker_env as env;

/// The worker process: runs only when re-executed by a test below, with
/// `IDEM_WORKER=1`; a no-op in a normal test run.
#[test]
fn worker() {
    if std::env::var_os("IDEM_WORKER").is_none() {
        return;
    }
    let cfg = WorkerConfig {
        url: env("IDEM_URL"),
        dir: PathBuf::from(env("IDEM_DIR")),
        name: env("IDEM_NAME"),
        mode: env("IDEM_MODE"),
        keys: env("IDEM_KEYS").parse().unwrap(),
        seed: env("IDEM_SEED").parse().unwrap(),
        lease: Duration::from_millis(env("IDEM_LEASE_MS").parse().unwrap()),
    };
    // Never outlive the test process that started us.
    idem_testkit::run_worker(work(cfg));
    std::process::exit(0);
}

/// The ledger every process of a test appends its runs to.
fn ledger(dir: &Path) -> FileLedger {
    FileLedger::at(dir.join("ledger"))
}

async fn work(cfg: WorkerConfig) {
    let store = RedisStore::connect(&cfg.url)
        .await
        .expect("worker: connect");
    let idem = Idempotency::builder(store)
        .namespace("procs")
        .lease(cfg.lease)
        .build();
    std::fs::write(cfg.dir.join(format!("ready-{}", cfg.name)), b"").unwrap();
    let go = cfg.dir.join(format!("go-{}", cfg.mode));
    let end = Instant::now() + Duration::from_secs(60);
    while !go.exists() {
        assert!(Instant::now() < end, "worker {}: no go signal", cfg.name);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let keys: Vec<String> = (0..cfg.keys).map(|i| format!("key-{i}")).collect();
    match cfg.mode.as_str() {
        "hammer" => hammer(&cfg, &idem, keys).await,
        "victim" => victim(&cfg, &idem, keys).await,
        other => panic!("worker: unknown mode {other}"),
    }
}

/// Calls every key once, in its own order, waiting out in-flight holders;
/// writes one result line per key: `key outcome pid` or `key error kind`.
async fn hammer(cfg: &WorkerConfig, idem: &Idempotency, mut keys: Vec<String>) {
    let mut rng = Rng::new(cfg.seed);
    rng.shuffle(&mut keys);
    let mut out = String::new();
    for key in keys {
        let pause = rng.below(3);
        let ledger = ledger(&cfg.dir);
        let k = key.clone();
        let r = idem
            .call("op", &key)
            .wait(Duration::from_secs(30))
            .run_outcome(|| async move {
                ledger.record(&k);
                tokio::time::sleep(Duration::from_millis(pause)).await;
                Ok::<_, Error>(Receipt {
                    key: k,
                    pid: std::process::id(),
                })
            })
            .await;
        match r {
            Ok((receipt, outcome)) => {
                assert_eq!(receipt.key, key, "a value for another key");
                out.push_str(&format!("{key} {outcome} {}\n", receipt.pid));
            }
            Err(Error::Unavailable { .. }) => out.push_str(&format!("{key} error unavailable\n")),
            Err(Error::InProgress { .. }) => out.push_str(&format!("{key} error in_progress\n")),
            Err(e) => panic!("worker {}: {key}: untyped failure {e:?}", cfg.name),
        }
    }
    std::fs::write(cfg.dir.join(format!("results-{}", cfg.name)), out).unwrap();
}

/// Four tasks each take keys (skipping busy and finished ones) until each
/// holds one in a body that never ends: the process is SIGKILLed mid-body.
async fn victim(cfg: &WorkerConfig, idem: &Idempotency, keys: Vec<String>) {
    let mut tasks = Vec::new();
    for t in 0..4 {
        let (idem, dir, mut keys) = (idem.clone(), cfg.dir.clone(), keys.clone());
        Rng::new(cfg.seed * 10 + t).shuffle(&mut keys);
        tasks.push(tokio::spawn(async move {
            for key in keys {
                let ledger = ledger(&dir);
                let k = key.clone();
                let _ = idem
                    .call("op", &key)
                    .run(|| async move {
                        ledger.record(&k);
                        tokio::time::sleep(Duration::from_secs(600)).await;
                        Ok::<_, Error>(Receipt {
                            key: k,
                            pid: std::process::id(),
                        })
                    })
                    .await;
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

// ---------------------------------------------------------------- parent side

/// A scratch directory and the worker processes; kills (SIGKILL) and reaps
/// every worker still running and removes the directory when dropped.
struct Rig {
    dir: PathBuf,
    url: String,
    workers: BTreeMap<String, Child>,
}

impl Rig {
    fn new(server: &RedisServer, tag: &str) -> Rig {
        let dir = std::env::temp_dir().join(format!(
            "idem-processes-{tag}-{}-{}",
            std::process::id(),
            unix_ms()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Rig {
            dir,
            url: server.url(),
            workers: BTreeMap::new(),
        }
    }

    fn spawn(&mut self, name: &str, mode: &str, keys: usize, seed: u64, lease: Duration) -> u32 {
        let log = std::fs::File::create(self.dir.join(format!("log-{name}"))).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "processes::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_WORKER", "1")
            .env("IDEM_URL", &self.url)
            .env("IDEM_DIR", &self.dir)
            .env("IDEM_NAME", name)
            .env("IDEM_MODE", mode)
            .env("IDEM_KEYS", keys.to_string())
            .env("IDEM_SEED", seed.to_string())
            .env("IDEM_LEASE_MS", lease.as_millis().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("re-execute the test binary as a worker");
        let pid = child.id();
        self.workers.insert(name.to_owned(), child);
        pid
    }

    fn wait_ready(&self, names: &[String]) {
        let end = Instant::now() + Duration::from_secs(60);
        while !names
            .iter()
            .all(|n| self.dir.join(format!("ready-{n}")).exists())
        {
            assert!(Instant::now() < end, "workers not ready\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn go(&self, mode: &str) {
        std::fs::write(self.dir.join(format!("go-{mode}")), b"").unwrap();
    }

    /// Waits for worker `name` to exit by itself, successfully.
    fn join(&mut self, name: &str) {
        let child = self.workers.get_mut(name).unwrap();
        let end = Instant::now() + Duration::from_secs(90);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(
                    status.success(),
                    "worker {name} failed: {status}\n{}",
                    self.logs()
                );
                self.workers.remove(name);
                return;
            }
            assert!(
                Instant::now() < end,
                "worker {name} did not finish\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILLs worker `name` and reaps it.
    fn kill(&mut self, name: &str) {
        let mut child = self.workers.remove(name).unwrap();
        child.kill().unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "{name} was killed");
    }

    /// Ledger lines as (key, pid, ms).
    fn ledger(&self) -> Vec<(String, u32, u128)> {
        ledger(&self.dir)
            .runs()
            .into_iter()
            .map(|r| (r.key, r.pid, r.unix_ms))
            .collect()
    }

    /// Result lines of worker `name` as (key, outcome or "error", pid or kind).
    fn results(&self, name: &str) -> Vec<(String, String, String)> {
        let text = std::fs::read_to_string(self.dir.join(format!("results-{name}"))).unwrap();
        text.lines()
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (f[0].to_owned(), f[1].to_owned(), f[2].to_owned())
            })
            .collect()
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for name in self.workers.keys() {
            let log =
                std::fs::read_to_string(self.dir.join(format!("log-{name}"))).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            s += &format!(
                "--- worker {name} ---\n{}\n",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        s
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

#[test]
fn many_processes_run_each_key_exactly_once() {
    const WORKERS: usize = 6;
    const KEYS: usize = 200;
    let server = RedisServer::start();
    let mut rig = Rig::new(&server, "once");
    let names: Vec<String> = (0..WORKERS).map(|i| format!("w{i}")).collect();
    let mut pids = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        pids.insert(
            rig.spawn(name, "hammer", KEYS, i as u64 + 1, Duration::from_secs(5)),
            name.clone(),
        );
    }
    rig.wait_ready(&names);
    rig.go("hammer");
    for name in &names {
        rig.join(name);
    }

    let ledger = rig.ledger();
    let mut ran: BTreeMap<String, Vec<u32>> = BTreeMap::new();
    for (key, pid, _) in &ledger {
        assert!(pids.contains_key(pid), "unknown pid {pid}");
        ran.entry(key.clone()).or_default().push(*pid);
    }
    assert_eq!(ran.len(), KEYS, "every key ran");
    for (key, by) in &ran {
        assert_eq!(by.len(), 1, "{key} ran {} times, by {by:?}", by.len());
    }
    assert_eq!(ledger.len(), KEYS);
    let mut executed: BTreeMap<String, usize> = BTreeMap::new();
    for name in &names {
        let results = rig.results(name);
        assert_eq!(results.len(), KEYS, "{name} answered every key");
        for (key, outcome, pid) in results {
            assert_ne!(outcome, "error", "{name}: {key}: {pid}");
            assert_eq!(
                pid,
                ran[&key][0].to_string(),
                "{name} got the value of the one run of {key}"
            );
            match outcome.as_str() {
                "executed" => *executed.entry(key).or_default() += 1,
                "replayed" => {}
                other => panic!("{name}: {key}: unexpected outcome {other}"),
            }
        }
    }
    assert_eq!(executed.len(), KEYS);
    assert!(executed.values().all(|&n| n == 1));
    let runners: BTreeSet<u32> = ledger.iter().map(|(_, pid, _)| *pid).collect();
    eprintln!(
        "{KEYS} keys, {WORKERS} processes: each key ran once; {} processes ran bodies",
        runners.len()
    );
}

#[test]
fn sigkilled_holders_lose_their_keys_after_the_lease_and_nothing_else_runs_twice() {
    const KEYS: usize = 120;
    let lease = Duration::from_secs(2);
    let server = RedisServer::start();
    let mut rig = Rig::new(&server, "kill");
    let victims = ["v0".to_owned(), "v1".to_owned()];
    let survivors: Vec<String> = (0..3).map(|i| format!("s{i}")).collect();
    let mut victim_pids = BTreeMap::new();
    for (i, name) in victims.iter().enumerate() {
        victim_pids.insert(
            rig.spawn(name, "victim", KEYS, 100 + i as u64, lease),
            name.clone(),
        );
    }
    for (i, name) in survivors.iter().enumerate() {
        rig.spawn(name, "hammer", KEYS, 200 + i as u64, lease);
    }
    let all: Vec<String> = victims.iter().chain(&survivors).cloned().collect();
    rig.wait_ready(&all);

    // The victims take four keys each and hang in their bodies, renewing.
    rig.go("victim");
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let ledger = rig.ledger();
        let held = |pid: &u32| ledger.iter().filter(|(_, p, _)| p == pid).count();
        if victim_pids.keys().all(|p| held(p) == 4) {
            break;
        }
        assert!(
            Instant::now() < end,
            "victims did not take their keys: {ledger:?}\n{}",
            rig.logs()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Survivors hammer every key, the victims' too, while the victims live...
    rig.go("hammer");
    std::thread::sleep(lease * 2);
    let alive_ledger = rig.ledger();
    // ...then the victims die mid-body.
    let killed_at = unix_ms();
    for name in &victims {
        rig.kill(name);
    }
    for name in &survivors {
        rig.join(name);
    }

    let ledger = rig.ledger();
    let mut runs: BTreeMap<String, Vec<(u32, u128)>> = BTreeMap::new();
    for (key, pid, ms) in &ledger {
        runs.entry(key.clone()).or_default().push((*pid, *ms));
    }
    let orphaned: BTreeSet<String> = ledger
        .iter()
        .filter(|(_, pid, _)| victim_pids.contains_key(pid))
        .map(|(key, _, _)| key.clone())
        .collect();
    assert_eq!(orphaned.len(), 8, "two victims, four held keys each");
    // While the victims lived (and renewed), nobody ran their keys.
    for (key, pid, _) in &alive_ledger {
        if orphaned.contains(key) {
            assert!(
                victim_pids.contains_key(pid),
                "{key} ran while its holder was alive"
            );
        }
    }
    assert_eq!(runs.len(), KEYS, "every key ran");
    let mut recovered_by: BTreeMap<String, u32> = BTreeMap::new();
    for (key, by) in &runs {
        let victim_runs = by
            .iter()
            .filter(|(p, _)| victim_pids.contains_key(p))
            .count();
        let other_runs: Vec<&(u32, u128)> = by
            .iter()
            .filter(|(p, _)| !victim_pids.contains_key(p))
            .collect();
        assert_eq!(
            other_runs.len(),
            1,
            "{key}: survivors ran it {} times: {by:?}",
            other_runs.len()
        );
        if orphaned.contains(key) {
            assert_eq!(victim_runs, 1, "{key}: {by:?}");
            assert!(
                other_runs[0].1 >= killed_at,
                "{key} re-ran before its holder died: {by:?}"
            );
            recovered_by.insert(key.clone(), other_runs[0].0);
        } else {
            assert_eq!(victim_runs, 0, "{key}: {by:?}");
        }
    }
    // Every surviving caller got the value of the run that counted.
    for name in &survivors {
        let results = rig.results(name);
        assert_eq!(results.len(), KEYS);
        for (key, outcome, pid) in results {
            assert_ne!(outcome, "error", "{name}: {key}: {pid}");
            let winner = runs[&key]
                .iter()
                .find(|(p, _)| !victim_pids.contains_key(p))
                .unwrap()
                .0;
            assert_eq!(pid, winner.to_string(), "{name}: {key}");
        }
    }
    let outcomes: BTreeMap<String, Vec<String>> = survivors
        .iter()
        .flat_map(|n| rig.results(n))
        .fold(BTreeMap::new(), |mut m, (k, o, _)| {
            m.entry(k).or_insert_with(Vec::new).push(o);
            m
        });
    for (key, o) in &outcomes {
        let ran = o.iter().filter(|o| *o != "replayed").collect::<Vec<_>>();
        let expected = if orphaned.contains(key) {
            "recovered"
        } else {
            "executed"
        };
        assert_eq!(ran, vec![expected], "{key}: {o:?}");
    }
    eprintln!(
        "SIGKILLed holders {:?}; their keys ran again once each after the lease: {recovered_by:?}",
        victim_pids
    );
}
