//! What idem costs on DynamoDB, against the floor of the same conditional
//! writes sent by hand on the same endpoint, in the same run, rounds
//! interleaved:
//!
//! - **fresh call** (claim + complete of a new key through `Idempotency`)
//!   against a conditional `PutItem` then a conditional `UpdateItem` of
//!   the same item, sent with the SDK alone;
//! - **replay** (a call of a completed key) against one conditional
//!   `PutItem` whose condition fails and returns the item (`ALL_OLD`).
//!
//! ```text
//! cargo bench --bench dynamodb --features dynamodb -- --calls 300 --rounds 5
//! ```
//!
//! Needs the local AWS endpoint (`cargo xtask setup`, or
//! `IDEM_AWS_ENDPOINT`). An emulator is not DynamoDB's speed: the ratios
//! are what the bench measures.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a bench program: it fails loudly and prints its report"
)]

use idem::dynamodb::aws_sdk_dynamodb::Client;
use idem::dynamodb::aws_sdk_dynamodb::types::{
    AttributeValue, ReturnValuesOnConditionCheckFailure,
};
use idem::{Error, Idempotency, Outcome};
use idem_testkit::DynamoTestTable;
use std::time::{Duration, Instant};

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The floor of a fresh call: the claim's conditional put and the
/// complete's conditional update, by hand.
async fn floor_fresh(client: &Client, table: &str, key: &str) {
    let now = now_ms();
    client
        .put_item()
        .table_name(table)
        .item("pk", AttributeValue::S(key.to_owned()))
        .item(
            "token",
            AttributeValue::S("0123456789abcdef0123456789abcdef".into()),
        )
        .item(
            "lease_deadline",
            AttributeValue::N((now + 30_000).to_string()),
        )
        .item(
            "expires_ms",
            AttributeValue::N((now + 86_400_000).to_string()),
        )
        .condition_expression("attribute_not_exists(pk) OR expires_ms <= :now")
        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await
        .unwrap();
    client
        .update_item()
        .table_name(table)
        .key("pk", AttributeValue::S(key.to_owned()))
        .update_expression("SET #k = :k, #v = :v REMOVE #t, lease_deadline")
        .condition_expression("#t = :t AND expires_ms > :now")
        .expression_attribute_names("#k", "kind")
        .expression_attribute_names("#v", "value")
        .expression_attribute_names("#t", "token")
        .expression_attribute_values(":k", AttributeValue::S("C".into()))
        .expression_attribute_values(":v", AttributeValue::B(b"7".to_vec().into()))
        .expression_attribute_values(
            ":t",
            AttributeValue::S("0123456789abcdef0123456789abcdef".into()),
        )
        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await
        .unwrap();
}

/// The floor of a replay: one conditional put that fails and returns the
/// stored item.
async fn floor_replay(client: &Client, table: &str, key: &str) {
    let now = now_ms();
    let r = client
        .put_item()
        .table_name(table)
        .item("pk", AttributeValue::S(key.to_owned()))
        .item(
            "token",
            AttributeValue::S("fedcba9876543210fedcba9876543210".into()),
        )
        .condition_expression("attribute_not_exists(pk) OR expires_ms <= :now")
        .expression_attribute_values(":now", AttributeValue::N(now.to_string()))
        .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
        .send()
        .await;
    let e = r.expect_err("the floor's replay must find the item");
    assert!(
        e.as_service_error()
            .is_some_and(|e| e.is_conditional_check_failed_exception())
    );
}

/// One round of `calls` idem calls of the round's keys, each answering
/// `expected`: calls per second.
async fn idem_round(idem: &Idempotency, round: usize, calls: usize, expected: Outcome) -> f64 {
    let t = Instant::now();
    for i in 0..calls {
        let (_, o) = idem
            .call("op", format!("{round}-{i}"))
            .run_outcome(|| async { Ok::<_, Error>(7u32) })
            .await
            .unwrap();
        assert_eq!(o, expected);
    }
    per_sec(calls, t.elapsed())
}

fn per_sec(n: usize, d: Duration) -> f64 {
    n as f64 / d.as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let calls = arg("--calls", 300);
    let rounds = arg("--rounds", 5);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (table, store) = DynamoTestTable::create().await;
        let client = table.client().clone();
        let idem = Idempotency::builder(store).namespace("bench").build();
        let body = || async { Ok::<_, Error>(7u32) };
        let (mut fresh, mut fresh_floor, mut replay, mut replay_floor) =
            (vec![], vec![], vec![], vec![]);
        // Warm up the connections.
        for i in 0..20 {
            idem.call("warm", i.to_string()).run(body).await.unwrap();
            floor_fresh(&client, &table.name, &format!("warm-{i}")).await;
        }
        for round in 0..rounds {
            fresh.push(idem_round(&idem, round, calls, Outcome::Executed).await);

            let t = Instant::now();
            for i in 0..calls {
                floor_fresh(&client, &table.name, &format!("floor-{round}-{i}")).await;
            }
            fresh_floor.push(per_sec(calls, t.elapsed()));

            replay.push(idem_round(&idem, round, calls, Outcome::Replayed).await);

            let t = Instant::now();
            for i in 0..calls {
                floor_replay(&client, &table.name, &format!("floor-{round}-{i}")).await;
            }
            replay_floor.push(per_sec(calls, t.elapsed()));
        }
        let (f, ff, r, rf) = (
            median(fresh),
            median(fresh_floor),
            median(replay),
            median(replay_floor),
        );
        println!(
            "DynamoStore on {} ({calls} sequential calls per round, median of {rounds} rounds)",
            idem_testkit::aws_endpoint()
        );
        println!("| case | idem calls/s | floor ops/s | ratio |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| fresh call (claim + complete) vs PutItem + UpdateItem | {f:.0} | {ff:.0} | {:.2} |",
            f / ff
        );
        println!(
            "| replay vs one conditional PutItem | {r:.0} | {rf:.0} | {:.2} |",
            r / rf
        );
        drop(table);
    });
}
