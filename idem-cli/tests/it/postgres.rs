//! The `idem` binary with `--postgres`: the same commands, output and exit
//! codes over a PgStore (a fresh database of this test's own).

use idem_core::Error;
use idem_core::store::{Claim, Token};
use idem_testkit::TestContext;
use std::process::{Command, Output};
use std::time::Duration;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .env_remove("REDIS_URL")
        .args(args)
        .output()
        .expect("the idem binary runs")
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited")
}

fn out(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn err(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspect_forget_scan_over_postgres() {
    let ctx = TestContext::postgres().await.with_namespace("svc");
    let service = ctx.idem();
    let _: u32 = service
        .call("charge", "done")
        .fingerprint(&"p")
        .run(|| async { Ok::<_, Error>(42) })
        .await
        .unwrap();
    let token = Token::random();
    let claim = Claim::new(
        "svc:charge:held",
        &token,
        Duration::from_secs(300),
        Duration::from_secs(86_400),
    );
    ctx.store().claim(claim).await.unwrap();
    let db = ctx.pg_db();
    db.exec(
        "INSERT INTO idem_keys (key, state, expires_at, value) \
         VALUES ('svc:charge:garbage', 'X', now() + interval '1 hour', '\\x00')",
    )
    .await;
    let url = db.url.as_str();
    let with =
        |rest: &[&'static str]| [&["--postgres", url, "--namespace", "svc"][..], rest].concat();

    let o = idem(&with(&["inspect", "charge", "done"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("completed (2 bytes"), "{}", out(&o));
    let o = idem(&with(&["--json", "inspect", "charge", "done", "--value"]));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(
        (&v["state"], &v["value"]),
        (&"completed".into(), &42.into())
    );
    assert_eq!(code(&idem(&with(&["inspect", "charge", "nope"]))), 1);

    // A key in flight is refused without --force, and kept.
    let o = idem(&with(&["forget", "charge", "held"]));
    assert_eq!(code(&o), 3, "{}", err(&o));
    assert!(err(&o).contains("--force"), "{}", err(&o));
    let o = idem(&with(&["--json", "scan", "charge", "--state", "pending"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    let keys: Vec<String> = out(&o)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["key"].to_string())
        .collect();
    assert_eq!(keys, ["\"held\""]);
    let o = idem(&with(&["forget", "charge", "held", "--force"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("forgot charge / held"), "{}", out(&o));

    // An unreadable row: exit 4, nothing deleted.
    let o = idem(&with(&["forget", "charge", "garbage", "--force"]));
    assert_eq!(code(&o), 4, "{}", err(&o));
    assert_eq!(
        db.count("SELECT count(*) FROM idem_keys WHERE key = 'svc:charge:garbage'")
            .await,
        1
    );
    let o = idem(&with(&["scan", "charge"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("done\tcompleted"), "{}", out(&o));
    assert!(out(&o).contains("garbage\tunreadable"), "{}", out(&o));

    // The forgotten key runs again.
    let (_, outcome) = service
        .call("charge", "held")
        .run_outcome(|| async { Ok::<_, Error>(1u8) })
        .await
        .unwrap();
    assert_eq!(outcome, idem_core::Outcome::Executed);
}

#[test]
fn bad_postgres_urls_and_tables() {
    // Nothing listens on port 1: unreachable, exit 5, and the message names PostgreSQL.
    let o = idem(&[
        "--postgres",
        "postgres://postgres@127.0.0.1:1/x",
        "inspect",
        "s",
        "k",
    ]);
    assert_eq!(code(&o), 5, "{}", err(&o));
    assert!(err(&o).contains("PostgreSQL"), "{}", err(&o));
    let o = idem(&["--postgres", "not a url", "inspect", "s", "k"]);
    assert!(matches!(code(&o), 2 | 5), "{}", err(&o));
    let o = idem(&[
        "--postgres",
        "postgres://postgres@127.0.0.1:1/x",
        "--table",
        "x\"; DROP TABLE t",
        "inspect",
        "s",
        "k",
    ]);
    assert_eq!(code(&o), 2, "{}", err(&o));
    let o = idem(&["--table", "t", "inspect", "s", "k"]);
    assert_eq!(code(&o), 2, "--table needs --postgres: {}", err(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_status_list_retry_drop() {
    let ctx = TestContext::postgres().await;
    let db = ctx.pg_db();
    let outbox = idem_postgres::PgStore::from_pool(db.pool.clone()).outbox();
    let mut tx = db.pool.begin().await.unwrap();
    for (id, key) in [("m-refused", "order-1"), ("m-waiting", "order-1")] {
        outbox
            .publish_with_id(
                &mut tx,
                "orders.created",
                key,
                id,
                &serde_json::json!({"n": 1}),
            )
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    let park = "UPDATE idem_keys_outbox SET parked_at = now(), attempts = 1, \
                last_error = 'the broker refused the message: no such topic' WHERE id = 'm-refused'";
    db.exec(park).await;
    let url = db.url.as_str();
    let with = |rest: &[&'static str]| [&["--postgres", url][..], rest].concat();

    let o = idem(&with(&["outbox", "status"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).starts_with("pending 1\tparked 1"), "{}", out(&o));
    let o = idem(&with(&["outbox", "list"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(
        out(&o).contains("m-refused\torders.created\tkey order-1"),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("no such topic"), "{}", out(&o));
    let o = idem(&with(&["--json", "outbox", "list"]));
    let v: serde_json::Value = serde_json::from_str(out(&o).trim()).unwrap();
    assert_eq!((&v["id"], &v["attempts"]), (&"m-refused".into(), &1.into()));

    // Retry: no longer parked; an unknown id is exit 1.
    let o = idem(&with(&["outbox", "retry", "m-refused"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(code(&idem(&with(&["outbox", "retry", "nope"]))), 1);
    assert!(out(&idem(&with(&["outbox", "status"]))).starts_with("pending 2\tparked 0"));
    // Drop: only a parked message, and only once.
    let o = idem(&with(&["outbox", "drop", "m-waiting"]));
    assert_eq!(
        code(&o),
        1,
        "a waiting message is never dropped: {}",
        err(&o)
    );
    db.exec(park).await;
    let o = idem(&with(&["outbox", "drop", "m-refused"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("dropped m-refused"), "{}", out(&o));
    assert_eq!(code(&idem(&with(&["outbox", "drop", "m-refused"]))), 1);
    assert_eq!(db.count("SELECT count(*) FROM idem_keys_outbox").await, 1);
}
