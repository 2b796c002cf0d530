//! The `idem` binary with `--dynamodb TABLE`: the same commands, output and
//! exit codes over a DynamoStore (a table of this test's own on the local
//! AWS endpoint, reached through the standard AWS environment).

use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::store::{Claim, Store, Token};
use idem_core::{Error, Idempotency, Outcome};
use idem_testkit::DynamoTestTable;
use std::process::{Command, Output};
use std::time::Duration;

fn idem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idem"))
        .env_remove("REDIS_URL")
        .env("AWS_ENDPOINT_URL", idem_testkit::aws_endpoint())
        .env("AWS_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "idem-test")
        .env("AWS_SECRET_ACCESS_KEY", "idem-test")
        .env("AWS_EC2_METADATA_DISABLED", "true")
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
async fn inspect_forget_scan_over_dynamodb() {
    let (table, store) = DynamoTestTable::create().await;
    let service = Idempotency::builder(store.clone()).namespace("svc").build();
    let _: u32 = service
        .call("charge", "done")
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
    table
        .client()
        .put_item()
        .table_name(&table.name)
        .item("pk", AttributeValue::S("svc:charge:garbage".into()))
        .item("expires_ms", AttributeValue::N("99999999999999".into()))
        .send()
        .await
        .unwrap();
    let name = table.name.as_str();
    let with =
        |rest: &[&'static str]| [&["--dynamodb", name, "--namespace", "svc"][..], rest].concat();

    let o = idem(&with(&["inspect", "charge", "done"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("completed (2 bytes"), "{}", out(&o));
    assert_eq!(code(&idem(&with(&["inspect", "charge", "nope"]))), 1);

    // A key in flight is refused without --force, and kept.
    let o = idem(&with(&["forget", "charge", "held"]));
    assert_eq!(code(&o), 3, "{}", err(&o));
    let o = idem(&with(&["forget", "charge", "held", "--force"]));
    assert_eq!(code(&o), 0, "{}", err(&o));

    // An unreadable item: exit 4, nothing deleted.
    let o = idem(&with(&["forget", "charge", "garbage", "--force"]));
    assert_eq!(code(&o), 4, "{}", err(&o));
    let o = idem(&with(&["scan", "charge"]));
    assert_eq!(code(&o), 0, "{}", err(&o));
    assert!(out(&o).contains("done\tcompleted"), "{}", out(&o));
    assert!(out(&o).contains("garbage\tunreadable"), "{}", out(&o));

    // No outbox on DynamoDB: refused, saying so.
    let o = idem(&with(&["outbox", "status"]));
    assert_ne!(code(&o), 0);
    assert!(
        err(&o).contains("DynamoStore keeps no outbox"),
        "{}",
        err(&o)
    );

    // The forgotten key runs again.
    let (_, outcome) = service
        .call("charge", "held")
        .run_outcome(|| async { Ok::<_, Error>(1u8) })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Executed);
}
