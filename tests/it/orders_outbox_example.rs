//! The outbox's end-to-end proof: the chain RabbitMQ → `run_in_tx`
//! (`examples/orders_outbox.rs`'s `place`) → relay → Kafka → idem consumer,
//! each stage a process (`tests/systems/orders_outbox.rs`). A Python
//! producer (pika) publishes orders to RabbitMQ with duplicates; the
//! `take`, `relay` and `ship` stages are SIGKILLed at random points and
//! restarted, and PostgreSQL is stopped (immediately, like a crash) and
//! restarted twice while orders flow.
//!
//! The invariant: once everything has settled, whatever was killed when,
//! PostgreSQL and the ledger file show each order's row exactly once, each
//! downstream effect (order, event) exactly once, nothing lost (every
//! order's two events), `created` before `paid` for every order, the outbox
//! empty and nothing parked or dead-lettered; and SIGTERM stops every
//! stage cleanly.
//!
//! The stages run in child processes: this test binary re-executed as the
//! `worker` test, which calls the stages' `run` (their source and the
//! example's are compiled in). PostgreSQL and the Kafka broker (tansu) are
//! private to the test; RabbitMQ is the shared one on 127.0.0.1:5672
//! (`AMQP_URL`), on a queue of the test's own, deleted at the end.
//!
//! A killed `ship` member is restarted after the group's session timeout
//! (the others at once): see the fault loop for the broker's reason.
//! `IDEM_CHAOS_SEED` replays a fault schedule, `IDEM_KEEP_LOGS=1` keeps the
//! stages' logs.
//!
//! The producer needs pika in `~/.cache/idem-pika`:
//! `python3 -m pip install --quiet --target ~/.cache/idem-pika pika`
//! (`.ci/run` does it).

#[path = "../../examples/orders_outbox.rs"]
#[allow(dead_code)]
mod example;

#[path = "../systems/orders_outbox.rs"]
mod stages;

use idem::consumer::rabbitmq::{declare_queue, lapin};
use idem::postgres::sqlx::postgres::{PgPool, PgPoolOptions};
use idem::postgres::{DEFAULT_TABLE, sqlx};
use idem_testkit::{KafkaBroker, PgServer, Rng};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const WORKER_ENV: &str = "ORDERS_OUTBOX_WORKER";
const ORDERS: usize = 60;
/// SIGKILLs per stage.
const KILLS: usize = 4;
/// PostgreSQL stops and restarts.
const PG_RESTARTS: usize = 2;
/// How long everything may take to settle after the last fault: generous,
/// for a loaded 2-core machine; a healthy run needs a few seconds.
const SETTLE: Duration = Duration::from_secs(90);

/// The producer, in another language: every order once, the same message
/// (same `message_id`) twice for every 5th order, and every 7th order
/// published again under a new id; paced, so that orders keep coming while
/// the stages are killed. Prints how many messages it published.
const PRODUCER: &str = r#"
import json, sys, time
import pika
url, queue, run, n, pace = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
conn = pika.BlockingConnection(pika.URLParameters(url))
ch = conn.channel()
ch.confirm_delivery()
sent = 0
def publish(mid, order, amount):
    global sent
    body = json.dumps({"order": order, "amount": amount})
    props = pika.BasicProperties(message_id=mid, delivery_mode=2, content_type="application/json")
    ch.basic_publish("", queue, body, props, mandatory=True)
    sent += 1
for i in range(n):
    order = "o-%s-%d" % (run, i)
    publish("evt-%s-%d" % (run, i), order, 100 + i)
    if i % 5 == 0:
        publish("evt-%s-%d" % (run, i), order, 100 + i)
    if i % 7 == 0:
        publish("evt-%s-%d-again" % (run, i), order, 100 + i)
    time.sleep(pace)
conn.close()
print(sent)
"#;

/// In a re-executed child: one stage, until SIGTERM.
#[test]
fn worker() {
    let Ok(mode) = std::env::var(WORKER_ENV) else {
        return;
    };
    let mode = stages::Mode::from_args(std::iter::once(mode)).unwrap();
    let code = idem_testkit::run_worker(async {
        match stages::run(mode).await {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("orders_outbox: {e}");
                1
            }
        }
    });
    std::process::exit(code);
}

/// Where pika is installed, and the Python path that finds it.
fn pika_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_else(|| "/root".into());
    PathBuf::from(home).join(".cache").join("idem-pika")
}

fn require_pika() {
    let out = Command::new("python3")
        .args(["-c", "import pika"])
        .env("PYTHONPATH", pika_dir())
        .output()
        .expect("python3 runs the producer: install Python 3");
    assert!(
        out.status.success(),
        "the producer needs pika, which python3 cannot import from {} ({}); install it with \
         `python3 -m pip install --quiet --target ~/.cache/idem-pika pika` (.ci/run does)",
        pika_dir().display(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// One stage's child process, restarted after each kill; its stdout and
/// stderr go to one log file over every run.
struct Stage {
    mode: &'static str,
    child: Child,
    log: PathBuf,
    starts: usize,
}

struct Setup {
    env: Vec<(&'static str, String)>,
    dir: PathBuf,
}

impl Setup {
    fn spawn(&self, mode: &'static str) -> Child {
        let log = self.log(mode);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let err = out.try_clone().unwrap();
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "orders_outbox_example::worker",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(WORKER_ENV, mode)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd.spawn().unwrap()
    }

    fn log(&self, mode: &str) -> PathBuf {
        self.dir.join(format!("{mode}.log"))
    }

    fn start(&self, mode: &'static str) -> Stage {
        Stage {
            mode,
            child: self.spawn(mode),
            log: self.log(mode),
            starts: 1,
        }
    }

    fn restart(&self, stage: &mut Stage) {
        stage.child = self.spawn(stage.mode);
        stage.starts += 1;
    }
}

impl Stage {
    /// Whether the current run catches SIGTERM (it says so once).
    fn stoppable(&self) -> bool {
        let said = std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(" started (pid ") && l.ends_with("stops it cleanly"))
            .count();
        said >= self.starts
    }
}

/// The last lines of every stage's log, for a failure message.
fn tails(stages: &[Stage]) -> String {
    stages
        .iter()
        .map(|s| {
            let text = std::fs::read_to_string(&s.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(15)..].join("\n");
            format!(
                "--- {} ({} runs), {}:\n{tail}",
                s.mode,
                s.starts,
                s.log.display()
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The test's queue on the shared RabbitMQ, deleted when dropped (a
/// failing test included).
struct Queue {
    url: String,
    name: String,
}

impl Queue {
    fn dead(&self) -> String {
        format!("{}.dead", self.name)
    }

    fn dlx(&self) -> String {
        format!("{}.dlx", self.name)
    }

    async fn declare(url: &str, name: String) -> Queue {
        let conn = lapin::Connection::connect(url, Default::default())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "RabbitMQ is not reachable at {url} ({e}): start rabbitmq-server (.ci/run does)"
                )
            });
        let q = Queue {
            url: url.to_owned(),
            name,
        };
        let channel = conn.create_channel().await.unwrap();
        declare_queue(&channel, &q.name, &q.dlx(), &q.dead())
            .await
            .unwrap();
        q
    }

    /// Messages ready in `queue` (not counting those delivered and unacked).
    async fn ready(&self, queue: &str) -> u32 {
        let conn = lapin::Connection::connect(&self.url, Default::default())
            .await
            .unwrap();
        let channel = conn.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let q = channel
            .queue_declare(queue.into(), passive, Default::default())
            .await
            .unwrap();
        q.message_count()
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let (url, names, dlx) = (
            self.url.clone(),
            [self.name.clone(), self.dead()],
            self.dlx(),
        );
        // Drop may run inside the test's runtime: a thread with its own.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let Ok(conn) = lapin::Connection::connect(&url, Default::default()).await else {
                    return;
                };
                let Ok(channel) = conn.create_channel().await else {
                    return;
                };
                for q in names {
                    let _ = channel
                        .queue_delete(q.as_str().into(), Default::default())
                        .await;
                }
                let _ = channel
                    .exchange_delete(dlx.as_str().into(), Default::default())
                    .await;
            });
        })
        .join();
    }
}

async fn count(pool: &PgPool, sql: &str) -> Option<i64> {
    sqlx::query_as::<_, (i64,)>(sqlx::AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .ok()
        .map(|(n,)| n)
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos:x}", std::process::id())
}

fn sigterm(child: &Child) {
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -TERM {}", child.id());
}

/// Waits for `child` up to `limit`; `None` if it is still running.
fn wait_bounded(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Stages SIGKILLed at random and PostgreSQL restarted while orders flow:
/// each order's row once, each (order, event) effect once with `created`
/// before `paid`, nothing lost, parked or dead-lettered, and every stage
/// stops cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_stages_and_a_restarted_postgres_still_apply_each_order_and_event_once_in_order() {
    require_pika();
    let started = Instant::now();
    let pg = PgServer::start();
    let kafka = KafkaBroker::start();
    let amqp = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let run = unique("outbox");
    let queue = Queue::declare(&amqp, format!("orders-{run}")).await;
    let dir = std::env::temp_dir().join(format!("idem-{run}"));
    std::fs::create_dir_all(&dir).unwrap();
    let ledger_path = dir.join("ledger.txt");
    let topic = format!("shipping-{run}");
    let env = stages::Env {
        database_url: pg.url("postgres"),
        amqp_url: amqp.clone(),
        queue: queue.name.clone(),
        brokers: kafka.bootstrap(),
        topic: topic.clone(),
        group: format!("shipping-{run}"),
        ledger: ledger_path.clone(),
        // A killed ship member's partitions move after this.
        session_timeout_ms: 3000,
        // A slow step in each body, so that kills land inside them.
        work_delay: Duration::from_millis(50),
    };
    stages::ensure_topics(&env).await.unwrap();
    let setup = Setup {
        env: vec![
            ("DATABASE_URL", env.database_url.clone()),
            ("AMQP_URL", env.amqp_url.clone()),
            ("ORDERS_QUEUE", env.queue.clone()),
            ("KAFKA_BROKERS", env.brokers.clone()),
            ("SHIP_TOPIC", env.topic.clone()),
            ("SHIP_GROUP", env.group.clone()),
            ("LEDGER", ledger_path.display().to_string()),
            (
                "KAFKA_SESSION_TIMEOUT_MS",
                env.session_timeout_ms.to_string(),
            ),
            ("ORDERS_WORK_DELAY_MS", "50".into()),
            ("RUST_LOG", "warn".into()),
        ],
        dir: dir.clone(),
    };

    let mut producer = Command::new("python3")
        .args([
            "-c",
            PRODUCER,
            &amqp,
            &queue.name,
            &run,
            &ORDERS.to_string(),
            "0.25",
        ])
        .env("PYTHONPATH", pika_dir())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stages: Vec<Stage> = ["take", "relay", "ship"]
        .into_iter()
        .map(|m| setup.start(m))
        .collect();

    // The faults, in a random order at random intervals (the seed replays a
    // run): each stage SIGKILLed and restarted KILLS times, PostgreSQL
    // stopped and restarted PG_RESTARTS times.
    let seed = std::env::var("IDEM_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) ^ started.elapsed().as_nanos() as u64);
    eprintln!("fault seed {seed} (IDEM_CHAOS_SEED={seed} replays the schedule)");
    let mut rng = Rng::new(seed);
    let mut faults: Vec<Option<usize>> = (0..stages.len())
        .flat_map(|i| std::iter::repeat_n(Some(i), KILLS))
        .chain(std::iter::repeat_n(None, PG_RESTARTS))
        .collect();
    rng.shuffle(&mut faults);
    for fault in faults {
        tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
        match fault {
            Some(i) => {
                let stopped = stages[i].child.try_wait().unwrap().is_some();
                assert!(
                    !stopped,
                    "the {} stage stopped on its own:\n{}",
                    stages[i].mode,
                    tails(&stages)
                );
                let stage = &mut stages[i];
                stage.child.kill().unwrap();
                stage.child.wait().unwrap();
                eprintln!(
                    "{:>6.1}s SIGKILL {}",
                    started.elapsed().as_secs_f64(),
                    stage.mode
                );
                if stage.mode == "ship" {
                    // Restarted once the group has forgotten the dead member
                    // (its session timeout), as a supervisor with a restart
                    // delay would: tansu 0.6 (the test broker) assigns
                    // partitions to members that died unexpired and then
                    // never rebalances them away, so a member killed and
                    // replaced within the session timeout, twice in a row,
                    // can strand a partition for good (seen with
                    // librdkafka's `debug=cgrp`; Kafka rebalances after the
                    // session timeout).
                    let forgotten = Duration::from_millis(u64::from(env.session_timeout_ms) + 500);
                    tokio::time::sleep(forgotten).await;
                }
                setup.restart(stage);
            }
            None => {
                eprintln!("{:>6.1}s PostgreSQL stop", started.elapsed().as_secs_f64());
                tokio::task::block_in_place(|| pg.stop());
                tokio::time::sleep(Duration::from_millis(300 + rng.below(700))).await;
                tokio::task::block_in_place(|| pg.start_again());
                eprintln!(
                    "{:>6.1}s PostgreSQL up again",
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }

    let produced = tokio::task::block_in_place(|| {
        let out = wait_bounded(&mut producer, Duration::from_secs(60));
        assert!(out.is_some(), "the producer did not finish within 60 s");
        producer.wait_with_output().unwrap()
    });
    assert!(
        produced.status.success(),
        "producer: {}",
        String::from_utf8_lossy(&produced.stderr)
    );
    let published: usize = String::from_utf8_lossy(&produced.stdout)
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        published,
        ORDERS + ORDERS.div_ceil(5) + ORDERS.div_ceil(7),
        "messages the producer published"
    );

    // Settled: every event in the ledger, every order row there, the
    // outbox drained and the queue empty.
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(5))
        .connect_lazy(&env.database_url)
        .unwrap();
    let ledger = stages::Ledger::at(&ledger_path);
    let outbox_table = format!("{DEFAULT_TABLE}_outbox");
    let expected_events = ORDERS * example::EVENTS.len();
    let end = Instant::now() + SETTLE;
    loop {
        let events = ledger.entries().unwrap().len();
        let rows = count(
            &pool,
            "SELECT count(DISTINCT order_id) FROM orders_outbox_example",
        )
        .await;
        let outbox = count(&pool, &format!("SELECT count(*) FROM {outbox_table}")).await;
        let ready = queue.ready(&queue.name).await;
        if events >= expected_events
            && rows == Some(ORDERS as i64)
            && outbox == Some(0)
            && ready == 0
            && stages.iter().all(Stage::stoppable)
        {
            break;
        }
        if Instant::now() >= end {
            // The broker's log too (its directory goes with it).
            let _ = std::fs::copy(kafka.dir().join("tansu.log"), dir.join("tansu.log"));
        }
        assert!(
            Instant::now() < end,
            "not settled {SETTLE:?} after the last fault (logs in {}): {events} of {expected_events} events in \
             the ledger, {rows:?} of {ORDERS} orders in PostgreSQL, {outbox:?} messages in the \
             outbox, {ready} orders waiting in the queue, stages up: {:?}\n{}",
            dir.display(),
            stages
                .iter()
                .map(|s| (s.mode, s.stoppable()))
                .collect::<Vec<_>>(),
            tails(&stages)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled_at = started.elapsed();

    // A clean stop: each stage finishes what it holds and exits 0.
    for s in &stages {
        sigterm(&s.child);
    }
    for i in 0..stages.len() {
        let status = tokio::task::block_in_place(|| {
            wait_bounded(&mut stages[i].child, Duration::from_secs(40))
        });
        let Some(status) = status else {
            let _ = stages[i].child.kill();
            panic!(
                "the {} stage did not stop within 40 s of SIGTERM:\n{}",
                stages[i].mode,
                tails(&stages)
            );
        };
        assert!(
            status.success(),
            "the {} stage's SIGTERM is a clean stop: {status:?}\n{}",
            stages[i].mode,
            tails(&stages)
        );
    }

    // Each order's row exactly once.
    let rows: Vec<(String, i64)> = sqlx::query_as(
        "SELECT order_id, count(*) FROM orders_outbox_example GROUP BY order_id ORDER BY order_id",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let orders: Vec<String> = (0..ORDERS).map(|i| format!("o-{run}-{i}")).collect();
    let expected_rows: BTreeMap<String, i64> = orders.iter().map(|o| (o.clone(), 1)).collect();
    assert_eq!(
        rows.into_iter().collect::<BTreeMap<_, _>>(),
        expected_rows,
        "each order's row exactly once"
    );

    // Each downstream effect exactly once, nothing lost, created before paid.
    let entries = ledger.entries().unwrap();
    let mut per_effect: BTreeMap<(String, String), usize> = BTreeMap::new();
    for e in &entries {
        *per_effect.entry(e.clone()).or_default() += 1;
    }
    let expected_effects: BTreeMap<(String, String), usize> = orders
        .iter()
        .flat_map(|o| example::EVENTS.map(|ev| ((o.clone(), ev.to_owned()), 1)))
        .collect();
    assert_eq!(
        per_effect, expected_effects,
        "each (order, event) in the ledger exactly once"
    );
    for o in &orders {
        let at = |ev: &str| entries.iter().position(|(eo, e)| eo == o && e == ev);
        assert!(
            at("created") < at("paid"),
            "{o}: created before paid in the ledger"
        );
    }

    // Nothing waiting, parked or dead-lettered.
    assert_eq!(
        count(&pool, &format!("SELECT count(*) FROM {outbox_table}")).await,
        Some(0),
        "the outbox is empty"
    );
    assert_eq!(
        count(
            &pool,
            &format!("SELECT count(*) FROM {outbox_table} WHERE parked_at IS NOT NULL")
        )
        .await,
        Some(0),
        "nothing parked"
    );
    assert_eq!(
        queue.ready(&queue.dead()).await,
        0,
        "no order dead-lettered"
    );
    let ship_log = std::fs::read_to_string(setup.log("ship")).unwrap();
    let summary = ship_log
        .lines()
        .rfind(|l| l.starts_with("ship summary: "))
        .unwrap_or_else(|| panic!("the ship stage printed its summary:\n{}", tails(&stages)));
    assert!(
        summary.ends_with(" 0 dead-lettered"),
        "no event dead-lettered: {summary}"
    );
    // What the faults caused, for the reader (not asserted: which run did
    // the work is not the point).
    let lines = |mode: &str, pat: &str| {
        std::fs::read_to_string(setup.log(mode.trim()))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(mode) && l.contains(pat))
            .count()
    };
    eprintln!(
        "take: {} executed, {} replayed, {} recovered, {} nacked; relay: {} confirmed ({} re-sends \
         after a failure or a crash); ship: {} applied, {} found applied after a crash",
        lines("take ", " executed "),
        lines("take ", " replayed "),
        lines("take ", " recovered "),
        lines("take ", "-> nack"),
        lines("relay ", "-> confirmed"),
        lines("relay ", "-> confirmed").saturating_sub(expected_events),
        lines("ship ", "-> applied"),
        lines("ship ", "in the ledger already"),
    );
    eprintln!(
        "settled {:.1}s after the start; {} stage runs; done in {:.1}s",
        settled_at.as_secs_f64(),
        stages.iter().map(|s| s.starts).sum::<usize>(),
        started.elapsed().as_secs_f64()
    );
    if std::env::var_os("IDEM_KEEP_LOGS").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        eprintln!("logs kept in {}", dir.display());
    }
    drop(kafka);
    drop(pg);
}
