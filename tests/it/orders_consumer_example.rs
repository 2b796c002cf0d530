//! `examples/orders_consumer.rs` driven as a user drives it: a Python
//! producer fills a Redis stream (duplicates, re-publishes, one poison
//! order), the example consumes it, is SIGKILLed mid-batch three times and
//! restarted, then stopped with SIGTERM. Checks that a consumer killed at
//! any point and restarted charges each order exactly once (the ledger file
//! it writes), dead-letters the poison order once, leaves nothing pending
//! and stops cleanly on SIGTERM.
//!
//! The example runs in a child process: this test binary re-executed as
//! the `worker` test, which calls the example's own `run` (the example's
//! source is compiled in, as `tests/metrics.rs` does with its example).

#[path = "../../examples/orders_consumer.rs"]
#[allow(dead_code)]
mod example;

use idem_testkit::RedisServer;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WORKER_ENV: &str = "ORDERS_EXAMPLE_WORKER";
const STREAM: &str = "orders";
const ORDERS: usize = 40;
const KILLS: usize = 3;

/// The producer, in another language: RESP over a plain socket. Every 5th
/// order is sent twice under one id, every 7th re-published under a new id
/// and timestamp; one order has a negative amount. Prints the entries added.
const PRODUCER: &str = r#"
import json, socket, sys
port, stream, run, n = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
def xadd(mid, order, amount, sent_at):
    payload = json.dumps({"order": order, "amount": amount, "sent_at": sent_at})
    args = [b"XADD", stream.encode(), b"*", b"id", mid.encode(), b"payload", payload.encode()]
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
out = []
for i in range(n):
    order = "o-%s-%d" % (run, i)
    out.append(xadd("evt-%d" % i, order, 100 + i, 1))
    if i % 5 == 0:
        out.append(xadd("evt-%d" % i, order, 100 + i, 1))
    if i % 7 == 0:
        out.append(xadd("evt-%d-again" % i, order, 100 + i, 2))
out.append(xadd("evt-poison", "o-%s-poison" % run, -5, 1))
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"".join(out))
f = s.makefile("rb")
for _ in out:
    line = f.readline()
    if not line.startswith(b"$"):
        sys.exit("XADD failed: %r" % line)
    f.readline()
print(len(out))
"#;

/// In a re-executed child: the example on the stream, until SIGTERM.
#[test]
fn worker() {
    let Ok(ledger) = std::env::var(WORKER_ENV) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let code = match rt.block_on(example::run(STREAM, example::Ledger(ledger.into()))) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("orders_consumer: {e}");
            1
        }
    };
    std::process::exit(code);
}

fn spawn_example(redis: &str, ledger: &Path, out: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "orders_consumer_example::worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WORKER_ENV, ledger)
        // The example's pretend payment provider takes 50 ms a charge: the
        // kills land mid-batch.
        .env("REDIS_URL", redis)
        .stdout(std::fs::File::create(out).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

fn charges(ledger: &Path) -> Vec<(String, String, i64)> {
    example::Ledger(ledger.into()).charges().unwrap()
}

fn produce(port: u16, run: &str) -> usize {
    let out = Command::new("python3")
        .args([
            "-c",
            PRODUCER,
            &port.to_string(),
            STREAM,
            run,
            &ORDERS.to_string(),
        ])
        .output()
        .expect("python3 runs the producer: install Python 3");
    assert!(
        out.status.success(),
        "producer: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

async fn wait_for(what: &str, deadline: Duration, mut done: impl AsyncFnMut() -> bool) {
    let end = Instant::now() + deadline;
    while !done().await {
        assert!(
            Instant::now() < end,
            "not reached within {deadline:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Entries delivered to the group but not acked, and entries not yet
/// delivered to it.
async fn unsettled(conn: &mut redis::aio::MultiplexedConnection) -> (i64, i64) {
    let pending: (i64, redis::Value, redis::Value, redis::Value) = redis::cmd("XPENDING")
        .arg(STREAM)
        .arg("billing")
        .query_async(conn)
        .await
        .unwrap();
    let groups: Vec<BTreeMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(STREAM)
        .query_async(conn)
        .await
        .unwrap();
    let lag = match groups.first().and_then(|g| g.get("lag")) {
        Some(redis::Value::Int(n)) => *n,
        other => panic!("no lag for the group: {other:?}"),
    };
    (pending.0, lag)
}

/// The example SIGKILLed mid-batch three times and restarted: each order
/// charged exactly once, the poison order dead-lettered once, nothing left
/// pending, and SIGTERM a clean stop that prints the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_restarted_the_example_charges_each_order_once() {
    let server = RedisServer::start();
    let dir = tempfile_dir();
    let ledger = dir.join("ledger.txt");
    let run = format!("{}", std::process::id());
    let added = produce(server.port(), &run);
    assert_eq!(added, ORDERS + ORDERS.div_ceil(5) + ORDERS.div_ceil(7) + 1);

    for i in 0..KILLS {
        let before = charges(&ledger).len();
        let mut child = spawn_example(&server.url(), &ledger, &dir.join(format!("out-{i}")));
        // Killed once it charged something: progress in every run, and the
        // rest of its batch still in flight.
        wait_for(
            "the example charged an order",
            Duration::from_secs(30),
            async || charges(&ledger).len() > before || child.try_wait().unwrap().is_some(),
        )
        .await;
        assert!(
            child.try_wait().unwrap().is_none(),
            "the example stopped on its own: {}",
            std::fs::read_to_string(dir.join(format!("out-{i}"))).unwrap()
        );
        child.kill().unwrap();
        child.wait().unwrap();
    }

    let out = dir.join("out-last");
    let mut child = spawn_example(&server.url(), &ledger, &out);
    let mut conn = redis::Client::open(server.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    // Its signal handlers are in place once it says it is consuming.
    wait_for(
        "the example consuming",
        Duration::from_secs(30),
        async || std::fs::read_to_string(&out).is_ok_and(|o| o.contains("consuming ")),
    )
    .await;
    wait_for("every entry acked", Duration::from_secs(40), async || {
        unsettled(&mut conn).await == (0, 0)
    })
    .await;
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "SIGTERM is a clean stop: {status:?}");
    let printed = std::fs::read_to_string(&out).unwrap();
    assert!(printed.contains("summary: "), "{printed}");

    let mut per_order: BTreeMap<String, usize> = BTreeMap::new();
    for (_, order, _) in charges(&ledger) {
        *per_order.entry(order).or_default() += 1;
    }
    let expected: BTreeMap<String, usize> =
        (0..ORDERS).map(|i| (format!("o-{run}-{i}"), 1)).collect();
    assert_eq!(per_order, expected, "each order charged exactly once");

    let dead: Vec<(String, BTreeMap<String, String>)> = redis::cmd("XRANGE")
        .arg(format!("{STREAM}:dead"))
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1.get("id").map(String::as_str), Some("evt-poison"));
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idem-orders-example-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
