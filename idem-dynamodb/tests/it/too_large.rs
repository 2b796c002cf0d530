//! Results over DynamoDB's 400 KB item: the store reports its limit, the
//! runtime stores a larger result as the too-large marker (the producing
//! call gets its value, later calls `Error::TooLarge`, the body never runs
//! again), a direct over-limit complete is refused before any request
//! with `Error::TooLarge` and leaves the pending record as it was, and a
//! result just under the limit is stored and replayed whole.

use idem_core::store::{Claim, Complete, OperatorStore, Store, Token, ValueKind, WriteReply};
use idem_core::{Error, Idempotency, KeyState, Outcome};
use idem_testkit::{DynamoTestTable, Ledger};
use std::time::Duration;

#[tokio::test]
async fn the_runtime_stores_an_over_limit_result_as_too_large() {
    let (_table, store) = DynamoTestTable::create().await;
    let limit = store.max_value_size();
    assert!(
        limit < idem_dynamodb::MAX_ITEM_BYTES && limit > 390_000,
        "{limit}"
    );
    let idem = Idempotency::builder(store.clone()).namespace("big").build();
    assert_eq!(
        idem.max_value_size(),
        limit,
        "the store's limit lowers the runtime's"
    );
    let ledger = Ledger::new();
    let big = "x".repeat(500 * 1024);
    let call = || {
        let (ledger, big) = (ledger.clone(), big.clone());
        idem.call("report", "r1").run_outcome(move || async move {
            ledger.record("r1");
            Ok::<_, Error>(big)
        })
    };
    let (v, outcome) = call().await.unwrap();
    assert_eq!((v.len(), outcome), (big.len(), Outcome::Executed));
    match call().await {
        Err(Error::TooLarge { size, limit: l }) => assert!(size > l && l == limit),
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert_eq!(ledger.count("r1"), 1, "the body ran again");
    let info = store
        .inspect("big:report:r1", false)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(info.state, KeyState::TooLarge);
}

#[tokio::test]
async fn a_direct_over_limit_complete_is_refused_and_keeps_the_claim() {
    let (_table, store) = DynamoTestTable::create().await;
    let token = Token::random();
    let claim = Claim::new(
        "ns:op:big",
        &token,
        Duration::from_secs(30),
        Duration::from_secs(60),
    );
    store.claim(claim).await.unwrap();
    let big = vec![b'7'; 401 * 1024];
    let r = store
        .complete(Complete::of_claim(&claim, ValueKind::Json, &big))
        .await;
    assert!(matches!(r, Err(Error::TooLarge { .. })), "{r:?}");
    let info = store.inspect("ns:op:big", false).await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::Pending, "the claim stays as it was");
    assert_eq!(
        store.release("ns:op:big", &token).await.unwrap(),
        WriteReply::Done
    );
}

#[tokio::test]
async fn a_result_just_under_the_limit_is_stored_and_replayed() {
    let (_table, store) = DynamoTestTable::create().await;
    let idem = Idempotency::builder(store.clone()).namespace("big").build();
    // JSON of a string: two quotes around it.
    let value = "y".repeat(store.max_value_size() - 2);
    let call = || {
        let value = value.clone();
        idem.call("report", "r2")
            .run_outcome(move || async move { Ok::<_, Error>(value) })
    };
    assert_eq!(call().await.unwrap().1, Outcome::Executed);
    let (v, outcome) = call().await.unwrap();
    assert_eq!((v.len(), outcome), (value.len(), Outcome::Replayed));
}
