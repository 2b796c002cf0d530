//! The `idem` binary against a real redis-server: output and exit codes.

use idem_core::store::{Claim, StepStore, Store, Token};
use idem_core::{Error, Idempotency};
use idem_redis::RedisStore;
use idem_testkit::RedisServer;
use std::process::{Command, Output};
use std::time::Duration;

fn idem(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.env_remove("REDIS_URL");
    if let Some(url) = url {
        cmd.args(["--redis", url]);
    }
    cmd.args(args).output().expect("the idem binary runs")
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

#[tokio::test]
async fn inspect_forget_scan_and_exit_codes() {
    let server = RedisServer::start();
    let url = server.url();
    let store = RedisStore::connect(&url).await.unwrap();
    let service = Idempotency::builder(store.clone()).namespace("svc").build();
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
    store.claim(claim).await.unwrap();
    server.cli(&["SET", "svc:charge:garbage", "not a record"]);
    server.cli(&["HSET", "svc:charge:hash", "f", "v"]);
    let url = Some(url.as_str());
    let ns = ["--namespace", "svc"];
    let with = |rest: &[&'static str]| [&ns[..], rest].concat();

    // inspect: human, JSON with the value, missing.
    let o = idem(url, &with(&["inspect", "charge", "done"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(
        out(&o).contains("state:       completed (2 bytes; expires in 23h"),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("fingerprint: stored"), "{}", out(&o));
    // The header names the server and how it completes records.
    let header = out(&o).lines().next().unwrap_or_default().to_owned();
    assert!(
        header.starts_with("store:       redis (")
            && (header.ends_with("; complete: script)")
                || header.ends_with("; complete: set-ifeq)")),
        "{header}"
    );
    let o = idem(
        url,
        &with(&["--json", "inspect", "charge", "done", "--value"]),
    );
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(
        (&v["state"], &v["value"], &v["value_size"]),
        (&"completed".into(), &42.into(), &2.into())
    );
    assert_eq!(v["result_version"], 0);
    // A result stored with a result version shows it; its value is the
    // JSON, without the version's frame.
    let _: u32 = service
        .call("receipt", "v2")
        .result_version(2)
        .run(|| async { Ok::<_, Error>(42) })
        .await
        .unwrap();
    let o = idem(url, &["--namespace", "svc", "inspect", "receipt", "v2"]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("version:     2\n"), "{}", out(&o));
    assert!(
        out(&o).contains("completed (6 bytes, result version 2;"),
        "{}",
        out(&o)
    );
    let o = idem(
        url,
        &[
            "--namespace",
            "svc",
            "--json",
            "inspect",
            "receipt",
            "v2",
            "--value",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!((&v["result_version"], &v["value"]), (&2.into(), &42.into()));
    let o = idem(url, &with(&["inspect", "charge", "nope"]));
    assert_eq!(code(&o), 1);
    assert!(err(&o).contains("no record"), "{}", err(&o));
    let o = idem(url, &with(&["inspect", "charge", "held"]));
    assert_eq!(code(&o), 0);
    assert!(
        out(&o).contains("pending (attempt 1; lease live, 4m"),
        "{}",
        out(&o)
    );
    // A pending run_steps record shows its finished steps.
    store
        .save_step("svc:charge:held", &token, "reserve", b"1")
        .await
        .unwrap();
    store
        .save_step("svc:charge:held", &token, "charge", b"\"ch_1\"")
        .await
        .unwrap();
    let o = idem(url, &with(&["inspect", "charge", "held"]));
    assert!(
        out(&o).contains("steps:       2 finished (reserve, charge)"),
        "{}",
        out(&o)
    );
    let o = idem(url, &with(&["--json", "inspect", "charge", "held"]));
    let v: serde_json::Value = serde_json::from_str(&out(&o)).unwrap();
    assert_eq!(v["steps"], serde_json::json!(["reserve", "charge"]));

    // scan: by state and by age.
    let o = idem(url, &with(&["scan", "charge", "--state", "pending"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(out(&o).lines().count(), 1);
    assert!(out(&o).starts_with("held\tpending"), "{}", out(&o));
    let o = idem(url, &with(&["--json", "scan", "charge"]));
    let lines: Vec<serde_json::Value> = out(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 4, "done, held and two unreadable keys");
    assert_eq!(
        lines.iter().filter(|l| l["state"] == "unreadable").count(),
        2
    );
    let o = idem(url, &with(&["scan", "charge", "--older-than", "10m"]));
    assert_eq!(out(&o), "", "everything is fresh");
    // Claimed with a 24 h TTL: counted against 25 h, they are an hour old.
    let o = idem(
        url,
        &with(&["scan", "charge", "--ttl", "25h", "--older-than", "30m"]),
    );
    assert_eq!(out(&o).lines().count(), 2, "{}", out(&o));

    // forget: a live holder is refused without --force, then forced.
    let o = idem(url, &with(&["forget", "charge", "held"]));
    assert_eq!(code(&o), 3);
    assert!(
        err(&o).contains("lease has") && err(&o).contains("--force"),
        "{}",
        err(&o)
    );
    assert_ne!(server.cli(&["EXISTS", "svc:charge:held"]), "0");
    let o = idem(url, &with(&["forget", "charge", "held", "--force"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(
        out(&o).contains("forgot charge / held: it was pending"),
        "{}",
        out(&o)
    );
    assert_eq!(server.cli(&["EXISTS", "svc:charge:held"]), "0");
    let o = idem(url, &with(&["forget", "charge", "done"]));
    assert_eq!(code(&o), 0);
    assert!(
        out(&o).contains("local replay cache may replay it for up to"),
        "{}",
        out(&o)
    );
    assert_eq!(server.cli(&["EXISTS", "svc:charge:done"]), "0");
    let o = idem(url, &with(&["forget", "charge", "done"]));
    assert_eq!(code(&o), 1);

    // Not idem's records: a clear message, exit 4, nothing deleted.
    for key in ["garbage", "hash"] {
        for args in [
            vec!["inspect", "charge", key],
            vec!["forget", "charge", key, "--force"],
        ] {
            let o = idem(url, &[&ns[..], &args[..]].concat());
            assert_eq!(code(&o), 4, "{args:?}: {}", err(&o));
            assert!(
                err(&o).contains("unreadable") && err(&o).contains("delete the key"),
                "{}",
                err(&o)
            );
        }
    }
    assert_eq!(server.cli(&["GET", "svc:charge:garbage"]), "not a record");
    assert_eq!(server.cli(&["TYPE", "svc:charge:hash"]), "hash");

    // The README's operator user: enough for every command, and no more.
    server.cli(&[
        "ACL",
        "SETUSER",
        "idem-ops",
        "on",
        ">ops-pw",
        "resetkeys",
        "~svc:*",
        "resetchannels",
        "&svc:*",
        "-@all",
        "+evalsha",
        "+script|load",
        "+get",
        "+pttl",
        "+del",
        "+scan",
        "+spublish",
    ]);
    let ops = format!("redis://idem-ops:ops-pw@{}/", server.addr());
    let _: u32 = service
        .call("charge", "again")
        .run(|| async { Ok::<_, Error>(7) })
        .await
        .unwrap();
    for args in [
        vec!["inspect", "charge", "again"],
        vec!["scan", "charge"],
        vec!["forget", "charge", "again"],
    ] {
        let o = idem(Some(&ops), &[&ns[..], &args[..]].concat());
        assert_eq!(code(&o), 0, "{args:?} as the operator user: {}", err(&o));
    }
    assert_eq!(server.cli(&["EXISTS", "svc:charge:again"]), "0");

    // REDIS_URL is the default target.
    let o = Command::new(env!("CARGO_BIN_EXE_idem"))
        .env("REDIS_URL", server.url())
        .args(with(&["scan", "charge"]))
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(out(&o).lines().count(), 2);

    // A key stuck in flight after its holder died: found, then evicted
    // without --force (the README's walk-through).
    let token = Token::random();
    let claim = Claim::new(
        "svc:charge:stuck",
        &token,
        Duration::from_millis(50),
        Duration::from_secs(86_400),
    );
    store.claim(claim).await.unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    let o = idem(url, &with(&["scan", "charge", "--state", "pending"]));
    assert!(
        out(&o).starts_with("stuck\tpending (attempt 1; lease ran out"),
        "{}",
        out(&o)
    );
    let o = idem(url, &with(&["forget", "charge", "stuck"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(server.cli(&["EXISTS", "svc:charge:stuck"]), "0");
}

#[test]
fn bad_urls_and_arguments() {
    let o = idem(Some("not a url"), &["inspect", "charge", "k"]);
    assert_eq!(code(&o), 2);
    assert!(err(&o).contains("Redis URL cannot be used"), "{}", err(&o));
    let o = idem(Some("redis://127.0.0.1:1/"), &["inspect", "charge", "k"]);
    assert_eq!(code(&o), 5);
    assert!(err(&o).contains("unavailable"), "{}", err(&o));
    let o = idem(None, &["scan", "charge", "--state", "weird"]);
    assert_eq!(code(&o), 2);
    let o = idem(None, &["--namespace", "", "inspect", "charge", "k"]);
    assert_eq!(code(&o), 2);
    assert!(err(&o).contains("namespace is empty"), "{}", err(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_of_a_redis_store_status_list_retry_drop() {
    let server = RedisServer::start();
    let url = server.url();
    let store = RedisStore::connect(&url).await.unwrap();
    let service = Idempotency::builder(store).namespace("svc").build();
    for request in ["r-1", "r-2"] {
        let _: u32 = service
            .call("orders.create", request)
            .run(|| async {
                idem_core::outbox::stage("orders.created", "order-1", &request)?;
                Ok::<_, Error>(1)
            })
            .await
            .unwrap();
    }
    // The broker refused the first: a relay parks it in place.
    let entries = server.cli(&["XRANGE", "idem-outbox", "-", "+"]);
    let first = entries.lines().next().unwrap().trim().to_owned();
    server.cli(&["HSET", "idem-outbox.parked", &first, "1:0:no such topic"]);
    let refused = idem_core::outbox::message_id("svc:orders.create:r-1", "orders.created");
    let url = Some(url.as_str());

    let o = idem(url, &["outbox", "status"]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).starts_with("pending 1\tparked 1"), "{}", out(&o));
    let o = idem(url, &["outbox", "list"]);
    assert!(
        out(&o).contains(&format!("{refused}\torders.created\tkey order-1")),
        "{}",
        out(&o)
    );
    assert!(out(&o).contains("no such topic"), "{}", out(&o));
    let o = idem(url, &["outbox", "retry", &refused]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(code(&idem(url, &["outbox", "retry", "nope"])), 1);
    assert!(out(&idem(url, &["outbox", "status"])).starts_with("pending 2\tparked 0"));
    server.cli(&["HSET", "idem-outbox.parked", &first, "1:0:no such topic"]);
    let o = idem(url, &["outbox", "drop", &refused]);
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert_eq!(server.cli(&["XLEN", "idem-outbox"]).trim(), "1");
    assert_eq!(code(&idem(url, &["outbox", "drop", &refused])), 1);
    // Another prefix: another outbox, empty.
    let o = idem(url, &["--outbox-prefix", "shop:outbox", "outbox", "status"]);
    assert!(out(&o).starts_with("pending 0\tparked 0"), "{}", out(&o));
    let o = idem(url, &["--outbox-prefix", "a:b:c", "outbox", "status"]);
    assert_ne!(code(&o), 0, "a prefix with two colons is refused");
}
