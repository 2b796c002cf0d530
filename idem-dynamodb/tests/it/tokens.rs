//! Writes conditioned on the owner token: a holder whose lease ran out and
//! whose key was taken over can neither complete, release nor extend the
//! new owner's record, and a complete re-sent after its reply was lost is
//! recognised by its bytes.

use idem_core::store::{Claim, ClaimReply, Complete, Store, Token, ValueKind, WriteReply};
use idem_testkit::DynamoTestTable;
use std::time::Duration;

const LEASE: Duration = Duration::from_secs(1);
const TTL: Duration = Duration::from_secs(60);

#[tokio::test]
async fn an_old_holder_cannot_touch_the_new_owners_record() {
    let (_table, store) = DynamoTestTable::create().await;
    let (old, new) = (Token::random(), Token::random());
    let claim = |t| Claim::new("ns:op:k", t, LEASE, TTL);
    assert_eq!(
        store.claim(claim(&old)).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    // Live lease: the other owner waits.
    let busy = store.claim(claim(&new)).await.unwrap();
    assert!(matches!(busy, ClaimReply::InProgress { .. }), "{busy:?}");
    tokio::time::sleep(LEASE + Duration::from_millis(50)).await;
    assert_eq!(
        store.claim(claim(&new)).await.unwrap(),
        ClaimReply::Acquired { attempt: 2 }
    );

    // The old holder's late writes change nothing.
    assert_eq!(
        store.extend("ns:op:k", &old, LEASE).await.unwrap(),
        WriteReply::OtherOwner
    );
    let late = Complete::new("ns:op:k", &old, ValueKind::Json, b"\"old\"");
    assert_eq!(store.complete(late).await.unwrap(), WriteReply::OtherOwner);
    assert_eq!(
        store.release("ns:op:k", &old).await.unwrap(),
        WriteReply::OtherOwner
    );

    // The new owner still holds it and completes it.
    assert_eq!(
        store.extend("ns:op:k", &new, LEASE).await.unwrap(),
        WriteReply::Done
    );
    let done = Complete::new("ns:op:k", &new, ValueKind::Json, b"\"new\"");
    assert_eq!(store.complete(done).await.unwrap(), WriteReply::Done);
    // The same complete re-sent: its own result, so Done.
    assert_eq!(store.complete(done).await.unwrap(), WriteReply::Done);
    // Another result, or any other write, by the old holder: refused.
    assert_eq!(
        store.complete(late).await.unwrap(),
        WriteReply::AlreadyCompleted
    );
    assert_eq!(
        store.release("ns:op:k", &old).await.unwrap(),
        WriteReply::AlreadyCompleted
    );
    assert_eq!(
        store.extend("ns:op:k", &old, LEASE).await.unwrap(),
        WriteReply::AlreadyCompleted
    );
    match store.claim(claim(&old)).await.unwrap() {
        ClaimReply::Completed(c) => assert_eq!(&c.value[..], b"\"new\""),
        other => panic!("expected the new owner's result, got {other:?}"),
    }
}

#[tokio::test]
async fn writes_to_a_missing_or_expired_record_are_missing() {
    let (_table, store) = DynamoTestTable::create().await;
    let token = Token::random();
    assert_eq!(
        store.release("ns:op:none", &token).await.unwrap(),
        WriteReply::Missing
    );
    assert_eq!(
        store.extend("ns:op:none", &token, LEASE).await.unwrap(),
        WriteReply::Missing
    );
    // A record whose TTL passed is still in the table (DynamoDB deletes it
    // lazily) but counts as absent: its owner's writes are Missing and a
    // new claim is a fresh attempt 1.
    let short = Claim::new(
        "ns:op:short",
        &token,
        Duration::from_millis(100),
        Duration::from_millis(100),
    );
    assert_eq!(
        store.claim(short).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
    tokio::time::sleep(Duration::from_millis(450)).await;
    let done = Complete::new("ns:op:short", &token, ValueKind::Json, b"1");
    assert_eq!(store.complete(done).await.unwrap(), WriteReply::Missing);
    let other = Token::random();
    let again = Claim::new("ns:op:short", &other, LEASE, TTL);
    assert_eq!(
        store.claim(again).await.unwrap(),
        ClaimReply::Acquired { attempt: 1 }
    );
}
