//! A server process SIGKILLed mid-call and another started: the client's
//! retry with the same key gets `ABORTED` while the dead server's lease
//! runs, then takes the key over and runs the handler again
//! (`Outcome::Recovered`: the killed run may have made part of its
//! effects), and every later retry gets that answer replayed.
//!
//! The servers are this test binary re-executed as the `kill::worker`
//! test, with `IDEM_GRPC_WORKER` set; runs are counted across processes in
//! a `FileLedger`.

use crate::support::pb::payments_client::PaymentsClient;
use crate::support::{CREATE_PAYMENT, Svc, TestServer, payment};
use idem_core::Idempotency;
use idem_grpc::IdempotencyLayer;
use idem_grpc::client::{Operation, RetryPolicy};
use idem_testkit::{FileLedger, Ledger, RedisServer, eventually};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use tonic::transport::Channel;

const WORKER_ENV: &str = "IDEM_GRPC_WORKER";
const LEASE: Duration = Duration::from_secs(2);

/// The child: a server behind the layer on Redis, printing its address.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER_ENV) else {
        return; // an ordinary test run: nothing to do
    };
    let redis = std::env::var("IDEM_GRPC_REDIS").unwrap();
    let ledger = FileLedger::at(std::env::var("IDEM_GRPC_LEDGER").unwrap());
    idem_testkit::run_worker(async move {
        let store = idem_redis::RedisStore::connect(&redis).await.unwrap();
        let idem = Idempotency::builder(store)
            .namespace("grpc-kill")
            .lease(LEASE)
            .build();
        let layer = IdempotencyLayer::new(idem).unary(CREATE_PAYMENT);
        let svc = Svc {
            ledger: Ledger::new(),
            file: Some(ledger),
            hang: mode == "hang",
        };
        let server = TestServer::start_with(layer, svc).await;
        println!("LISTENING {}", server.addr);
        std::future::pending::<()>().await;
    });
}

/// Starts a worker and waits for its address.
fn spawn(mode: &str, redis: &str, ledger: &Path) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "kill::worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WORKER_ENV, mode)
        .env("IDEM_GRPC_REDIS", redis)
        .env("IDEM_GRPC_LEDGER", ledger)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    // Read on a thread of its own, so a worker that never listens fails the
    // test (generously late) instead of hanging it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let addr = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            // libtest prints "test kill::worker ... " on the same line first.
            .find_map(|l| {
                l.split_once("LISTENING ")
                    .map(|(_, addr)| addr.trim().to_owned())
            });
        let _ = tx.send(addr);
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("the {mode} worker did not start listening"));
    (child, addr)
}

async fn client(addr: &str) -> PaymentsClient<Channel> {
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    PaymentsClient::new(channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_call_is_recovered_by_the_retry_after_the_lease() {
    let redis = RedisServer::start();
    let dir = std::env::temp_dir().join(format!("idem-grpc-kill-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let ledger_path = dir.join("ledger");
    let ledger = FileLedger::at(&ledger_path);
    let runs = |key: &str| ledger.runs().iter().filter(|r| r.key == key).count();

    let op = Operation::with_key("kill-1").unwrap().retry(
        RetryPolicy::default()
            .max_retries(500)
            .initial_backoff(Duration::from_millis(100))
            .max_backoff(Duration::from_millis(500))
            .deadline(Duration::from_secs(120)),
    );

    // Server A takes the call and dies in the middle of it.
    let (mut a, a_addr) = spawn("hang", &redis.url(), &ledger_path);
    let mut to_a = client(&a_addr).await;
    let first = tokio::spawn({
        let req = op.request(payment(1234));
        async move { to_a.create_payment(req).await }
    });
    eventually(
        "server A runs the handler",
        Duration::from_secs(60),
        || async { (runs("kill-1") == 1).then_some(()) },
    )
    .await;
    a.kill().unwrap();
    a.wait().unwrap();
    let cut = first.await.unwrap();
    assert!(cut.is_err(), "the call to the killed server fails: {cut:?}");

    // Server B: the retry waits out A's lease (ABORTED meanwhile), then runs.
    let (mut b, b_addr) = spawn("serve", &redis.url(), &ledger_path);
    let to_b = client(&b_addr).await;
    let reply = op
        .call(|| {
            let mut c = to_b.clone();
            let req = op.request(payment(1234));
            async move { c.create_payment(req).await }
        })
        .await
        .unwrap();
    assert!(!reply.replayed);
    assert_eq!(reply.response.get_ref().run, 2, "B's run is the second");
    assert_eq!(runs("kill-1"), 2, "A's cut-short run and B's recovery");

    // Later retries: B's answer, replayed; nothing runs again.
    let again = op
        .call(|| {
            let mut c = to_b.clone();
            let req = op.request(payment(1234));
            async move { c.create_payment(req).await }
        })
        .await
        .unwrap();
    assert!(again.replayed);
    assert_eq!(again.response.get_ref(), reply.response.get_ref());
    assert_eq!(runs("kill-1"), 2);

    b.kill().unwrap();
    b.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
