//! Errors that say what to do, and records that do not decode: a missing
//! table is `InvalidConfig` naming `create_table`; an item another
//! program wrote is `Corrupt`, never a panic; a table shared with other
//! items (another key attribute, a key prefix) keeps idem's items apart.

use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::store::{Claim, ClaimReply, OperatorStore, Store, Token};
use idem_core::{Error, Idempotency, KeyState, Outcome};
use idem_dynamodb::{DynamoStore, DynamoStoreConfig};
use idem_testkit::DynamoTestTable;
use std::time::Duration;

#[tokio::test]
async fn a_missing_table_says_how_to_create_it() {
    let client = idem_testkit::dynamodb_client().await;
    let store = DynamoStore::new(client, idem_testkit::unique_name("absent")).unwrap();
    let token = Token::random();
    let r = store
        .claim(Claim::new(
            "ns:op:k",
            &token,
            Duration::from_secs(5),
            Duration::from_secs(60),
        ))
        .await;
    match r {
        Err(Error::InvalidConfig(msg)) => {
            assert!(
                msg.contains("does not exist") && msg.contains("create_table"),
                "{msg}"
            );
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[tokio::test]
async fn invalid_names_are_refused_at_construction() {
    let client = idem_testkit::dynamodb_client().await;
    assert!(matches!(
        DynamoStore::new(client.clone(), "x"),
        Err(Error::InvalidConfig(_))
    ));
    let config = DynamoStoreConfig::new("idem").key_attribute("token");
    assert!(matches!(
        DynamoStore::with_config(client, config),
        Err(Error::InvalidConfig(_))
    ));
}

#[tokio::test]
async fn an_item_idem_did_not_write_is_corrupt() {
    let (table, store) = DynamoTestTable::create().await;
    table
        .client()
        .put_item()
        .table_name(&table.name)
        .item("pk", AttributeValue::S("ns:op:alien".into()))
        .item("expires_ms", AttributeValue::N("99999999999999".into()))
        .item("owner", AttributeValue::S("another program".into()))
        .send()
        .await
        .unwrap();
    let token = Token::random();
    let claim = Claim::new(
        "ns:op:alien",
        &token,
        Duration::from_secs(5),
        Duration::from_secs(60),
    );
    assert!(matches!(
        store.claim(claim).await,
        Err(Error::Corrupt { .. })
    ));
    assert!(matches!(
        store.inspect("ns:op:alien", false).await,
        Err(Error::Corrupt { .. })
    ));
    assert!(matches!(
        store.forget("ns:op:alien", true).await,
        Err(Error::Corrupt { .. })
    ));
    let page = store.scan("ns:", None, 10).await.unwrap();
    assert!(
        matches!(page.records.as_slice(), [(k, Err(Error::Corrupt { .. }))] if k == "ns:op:alien")
    );
}

#[tokio::test]
async fn a_shared_table_with_a_prefix_keeps_idems_items_apart() {
    let (table, store) = DynamoTestTable::create_with(|name| {
        DynamoStoreConfig::new(name)
            .key_attribute("PK")
            .key_prefix("IDEM#")
    })
    .await;
    // The application's own item in the same table.
    table
        .client()
        .put_item()
        .table_name(&table.name)
        .item("PK", AttributeValue::S("ORDER#7".into()))
        .send()
        .await
        .unwrap();
    let idem = Idempotency::builder(store.clone())
        .namespace("shop")
        .build();
    let run = || {
        idem.call("charge", "7")
            .run_outcome(|| async { Ok::<_, Error>(7u32) })
    };
    assert_eq!(run().await.unwrap(), (7, Outcome::Executed));
    assert_eq!(run().await.unwrap(), (7, Outcome::Replayed));
    let item = table
        .client()
        .get_item()
        .table_name(&table.name)
        .key("PK", AttributeValue::S("IDEM#shop:charge:7".into()))
        .send()
        .await
        .unwrap();
    assert!(item.item.is_some(), "idem's item is under its prefix");
    let page = store.scan("", None, 100).await.unwrap();
    let keys: Vec<&str> = page.records.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["shop:charge:7"],
        "only idem's items, without the prefix"
    );
    let info = idem.inspect("charge", "7").await.unwrap().unwrap();
    assert_eq!(info.state, KeyState::Completed);
    let token = Token::random();
    let claim = Claim::new(
        "shop:charge:7",
        &token,
        Duration::from_secs(5),
        Duration::from_secs(60),
    );
    assert!(matches!(
        store.claim(claim).await.unwrap(),
        ClaimReply::Completed(_)
    ));
}

/// Credentials whose policy refuses the store's writes are
/// `InvalidConfig`, naming the IAM actions the store needs, never an outage
/// to retry: on a moto server of the test's own that enforces IAM, a user
/// allowed only `dynamodb:GetItem` gets past its reads (a missing table is
/// still told as such) and is refused its claim and `create_table`.
/// (moto answers a refusal
/// with an XML `403`, where DynamoDB answers JSON `AccessDeniedException`;
/// both are access denied.)
#[tokio::test]
async fn refused_credentials_name_the_iam_actions_the_store_needs() {
    let moto = idem_testkit::IamMoto::start(3);
    let (key_id, secret) = moto.user_allowed("reader", &["dynamodb:GetItem"]);
    let client = aws_sdk_dynamodb::Client::new(&moto.config(&key_id, &secret).await);
    let store = DynamoStore::new(client, idem_testkit::unique_name("iam")).unwrap();

    match store.inspect("ns:op:k", false).await {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("does not exist"), "{msg}"),
        other => panic!("expected the missing table past the policy, got {other:?}"),
    }

    let token = Token::random();
    let claimed = store
        .claim(Claim::new(
            "ns:op:k",
            &token,
            Duration::from_secs(5),
            Duration::from_secs(60),
        ))
        .await;
    let Err(e @ Error::InvalidConfig(_)) = claimed else {
        panic!("expected InvalidConfig, got {claimed:?}");
    };
    let msg = e.to_string();
    assert!(
        msg.contains("access denied") && msg.contains("dynamodb:PutItem"),
        "{msg}"
    );

    match store.create_table().await {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("access denied"), "{msg}"),
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}
