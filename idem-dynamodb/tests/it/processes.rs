//! A holder killed mid-body is recovered after its lease: a worker process
//! (this test binary re-executed, `IDEM_WORKER=1`) claims the key on
//! DynamoStore and is SIGKILLed inside its body; another process's call
//! answers `InProgress` while the dead holder's lease is live, then takes
//! the key over (`Outcome::Recovered`, attempt 2) and runs the body. The
//! ledger file, appended by every body, shows exactly the two runs the
//! semantics promise (the dead holder's effect stands, the key ran once
//! more, not before the lease ended), and a later call replays.

use idem_core::{Error, Idempotency, Outcome};
use idem_dynamodb::DynamoStore;
use idem_testkit::{DynamoTestTable, FileLedger, unix_ms};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const LEASE: Duration = Duration::from_secs(4);
const KEY: &str = "order-1";

use idem_testkit::worker_env as env;

fn ledger(dir: &Path) -> FileLedger {
    FileLedger::at(dir.join("ledger"))
}

/// The worker process: runs only when re-executed by the test below.
#[test]
fn worker() {
    if std::env::var_os("IDEM_WORKER").is_none() {
        return;
    }
    let (table, dir, mode) = (
        env("IDEM_TABLE"),
        PathBuf::from(env("IDEM_DIR")),
        env("IDEM_MODE"),
    );
    idem_testkit::run_worker(async move {
        let store = DynamoStore::new(idem_testkit::dynamodb_client().await, table).unwrap();
        let idem = Idempotency::builder(store)
            .namespace("procs")
            .lease(LEASE)
            .build();
        let ledger = ledger(&dir);
        let hang = mode == "victim";
        let r = idem
            .call("op", KEY)
            .run_outcome(|| async move {
                ledger.record(KEY);
                if hang {
                    // Killed here, its effect recorded, its result never stored.
                    tokio::time::sleep(Duration::from_secs(600)).await;
                }
                Ok::<_, Error>(std::process::id())
            })
            .await;
        let line = match r {
            Ok((pid, outcome)) => format!("{outcome} {pid}"),
            Err(Error::InProgress { .. }) => "in_progress".to_owned(),
            Err(e) => format!("error {e}"),
        };
        std::fs::write(dir.join(format!("outcome-{mode}")), line).unwrap();
    });
    std::process::exit(0);
}

struct Rig {
    dir: PathBuf,
    table: String,
    children: Vec<Child>,
}

impl Rig {
    fn spawn(&mut self, mode: &str) -> u32 {
        let log = std::fs::File::create(self.dir.join(format!("log-{mode}"))).unwrap();
        let child = Command::new(std::env::current_exe().unwrap())
            .args([
                "processes::worker",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_WORKER", "1")
            .env("IDEM_TABLE", &self.table)
            .env("IDEM_DIR", &self.dir)
            .env("IDEM_MODE", mode)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("re-execute the test binary as a worker");
        let pid = child.id();
        self.children.push(child);
        pid
    }

    /// Runs a worker of `mode` to its end and returns its outcome line.
    fn run(&mut self, mode: &str) -> String {
        self.spawn(mode);
        let mut child = self.children.pop().unwrap();
        let status = child.wait().unwrap();
        let log = std::fs::read_to_string(self.dir.join(format!("log-{mode}"))).unwrap_or_default();
        assert!(status.success(), "worker {mode} failed: {status}\n{log}");
        std::fs::read_to_string(self.dir.join(format!("outcome-{mode}"))).unwrap()
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_holder_is_recovered_after_its_lease() {
    let (table, _store) = DynamoTestTable::create().await;
    let dir = std::env::temp_dir().join(format!(
        "idem-dynamodb-procs-{}-{}",
        std::process::id(),
        unix_ms()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rig = Rig {
        dir: dir.clone(),
        table: table.name.clone(),
        children: Vec::new(),
    };

    let spawned_at = unix_ms();
    let victim = rig.spawn("victim");
    let end = Instant::now() + Duration::from_secs(60);
    while ledger(&dir).runs().is_empty() {
        assert!(Instant::now() < end, "the victim never ran its body");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut child = rig.children.pop().unwrap();
    child.kill().unwrap(); // SIGKILL: no release, no complete
    assert!(!child.wait().unwrap().success());

    // The probe, from this process: inside the dead holder's lease it
    // answers in flight and the body does not run; if a loaded machine
    // delays it past the lease, it takes the key over itself. Either answer
    // is checked against the lease's bounds: the victim claimed after
    // `spawned_at` and before its body's first line.
    let first = ledger(&dir).runs()[0].clone();
    let store = DynamoStore::new(table.client().clone(), table.name.clone()).unwrap();
    let idem = Idempotency::builder(store)
        .namespace("procs")
        .lease(LEASE)
        .build();
    let probe_ledger = ledger(&dir);
    let asked_at = unix_ms();
    let probe = idem
        .call("op", KEY)
        .run_outcome(|| async move {
            probe_ledger.record(KEY);
            Ok::<_, Error>(0u32)
        })
        .await;
    let lease = LEASE.as_millis();
    let probe_took_over = match probe {
        Err(Error::InProgress { .. }) => {
            assert!(
                asked_at < first.unix_ms + lease,
                "asked at {asked_at}, after the lease ended: in flight is wrong"
            );
            false
        }
        Ok((_, Outcome::Recovered)) => {
            assert!(
                unix_ms() >= spawned_at + lease,
                "the probe took the key over inside the dead holder's lease"
            );
            true
        }
        other => panic!("asked at {asked_at}: {other:?}"),
    };

    // After the lease: another process takes the key over and runs the
    // body (or replays the probe's result, if the probe took it over).
    let wait = (first.unix_ms + lease).saturating_sub(unix_ms()) as u64 + 50;
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let line = tokio::task::spawn_blocking({
        let mut r = Rig {
            dir: dir.clone(),
            table: table.name.clone(),
            children: Vec::new(),
        };
        move || r.run("recover")
    })
    .await
    .unwrap();
    let expected = if probe_took_over {
        "replayed"
    } else {
        "recovered"
    };
    assert!(line.starts_with(expected), "the takeover: {line}");
    let runs = ledger(&dir).runs();
    assert_eq!(
        runs.len(),
        2,
        "the dead holder's run and exactly one more: {runs:?}"
    );
    assert_eq!(runs[0].pid, victim);
    assert!(
        runs[1].unix_ms >= spawned_at + lease,
        "the key ran again before the dead holder's lease ended: {runs:?}"
    );

    // And from now on it replays.
    let line = tokio::task::spawn_blocking({
        let mut r = Rig {
            dir: dir.clone(),
            table: table.name.clone(),
            children: Vec::new(),
        };
        move || r.run("replay")
    })
    .await
    .unwrap();
    assert!(line.starts_with("replayed"), "a later call: {line}");
    assert_eq!(ledger(&dir).runs().len(), 2);
    drop(rig);
    let _ = std::fs::remove_dir_all(&dir);
}
