//! # idem-dynamodb
//!
//! A DynamoDB store for [idem](https://docs.rs/idem): the same exactly-once
//! state machine as its Redis and PostgreSQL stores, on one DynamoDB table,
//! through the official `aws-sdk-dynamodb` client. Every write is a
//! conditional write on one item, which DynamoDB applies atomically.
//!
//! ```no_run
//! use idem_core::Idempotency;
//! use idem_dynamodb::DynamoStore;
//!
//! # async fn demo() -> Result<(), idem_core::Error> {
//! let config = aws_config::load_from_env().await; // region, credentials, endpoint from the environment
//! let store = DynamoStore::new(aws_sdk_dynamodb::Client::new(&config), "idem")?;
//! store.create_table().await?; // tests and development; production tables come from IaC
//! let idem = Idempotency::builder(store).namespace("payments").build();
//! let receipt: String = idem
//!     .call("charge", "order-7")
//!     .run(|| async { Ok::<_, idem_core::Error>("receipt-7".to_owned()) })
//!     .await?;
//! # let _ = receipt; Ok(()) }
//! ```
//!
//! # The table
//!
//! One item per key, in a table whose partition key is a string attribute
//! (`pk` unless [`DynamoStoreConfig::key_attribute`] says otherwise) and
//! which has **no sort key**. Its value is the stored key
//! (`namespace:scope:key`), after [`DynamoStoreConfig::key_prefix`] when
//! the table is shared with other items (a single-table design). The
//! store writes these attributes:
//!
//! | attribute | type | holds |
//! | --- | --- | --- |
//! | `token` | S | the owner token (32 hex digits), while pending |
//! | `lease_deadline` | N | the lease deadline, epoch ms (the holder's clock), while pending |
//! | `attempt` | N | 1, plus one per takeover, while pending |
//! | `steps`, `step_order` | M, L | finished durable steps (their JSON by name, names in order), while pending |
//! | `kind`, `value` | S, S or B | the result's kind tag, and its bytes once completed: text (S) for JSON and the markers, B for LZ4-compressed JSON |
//! | `fingerprint` | B | the payload fingerprint (16 bytes), when given |
//! | `expires_ms` | N | when the record stops counting, epoch ms: what the store decides by |
//! | `expires_at` | N | the same, epoch **seconds** rounded up: the table's TTL attribute |
//! | `failures` | N | a failure counter's count (an item of its own, `namespace::failures:…`) |
//!
//! In infrastructure code (CloudFormation), the table is:
//!
//! ```yaml
//! IdemTable:
//!   Type: AWS::DynamoDB::Table
//!   Properties:
//!     BillingMode: PAY_PER_REQUEST
//!     AttributeDefinitions: [{ AttributeName: pk, AttributeType: S }]
//!     KeySchema: [{ AttributeName: pk, KeyType: HASH }]
//!     TimeToLiveSpecification: { AttributeName: expires_at, Enabled: true }
//! ```
//!
//! and the store's role needs `dynamodb:PutItem`, `UpdateItem`,
//! `DeleteItem` and `GetItem` on it (`Scan` for operator calls such as
//! `idem scan`; `CreateTable`, `DescribeTable` and `UpdateTimeToLive` only
//! for [`DynamoStore::create_table`]).
//!
//! **Retention is cleanup, never the lease.** DynamoDB's TTL deletes
//! expired items lazily, up to a few days late. The store never relies on
//! it: every condition compares the stored deadlines (`lease_deadline`,
//! `expires_ms`) with the request's `:now`, so an expired record that is
//! still in the table counts as absent, and an expired lease as free.
//!
//! # Whose clock
//!
//! `:now` is the clock of the process sending the request (`SystemTime`),
//! and a lease deadline is written as the claimer's `now + lease`. Another
//! process takes a key over once **its** clock passes that deadline. With a
//! skew of `s` between the two clocks, a holder's lease is effectively
//! `lease − s` long as others see it; the keep-alive renews it every third
//! of a lease, so a live holder keeps its key while `s` stays under two
//! thirds of the lease, and **idem's guarantee holds for clock skew up to
//! the lease minus the keep-alive period**. Hosts synchronized by NTP (or
//! Amazon Time Sync, well under a second) against leases of seconds to
//! minutes are far inside that allowance; a lease shorter than the skew
//! between your hosts is not. A result's TTL counts on the same clocks, so
//! a record expires `s` early or late for a skewed reader. (RedisStore and
//! PgStore decide on the server's one clock; DynamoDB's condition
//! expressions have no clock of their own.)
//!
//! # What each call costs
//!
//! - **claim**: one conditional `PutItem`
//!   (`attribute_not_exists(pk) OR expires_ms <= :now`) with
//!   `ReturnValuesOnConditionCheckFailure=ALL_OLD`: a fresh key is acquired,
//!   and a duplicate in flight, a replay or a fingerprint mismatch is
//!   answered from the record the failed condition returns, one request
//!   either way. A **takeover** of an expired lease (and the owner's own
//!   claim re-sent) is a second request: an `UpdateItem` conditioned on the
//!   record exactly as read (token, deadline, expiry), so that `attempt`
//!   counts up and finished steps survive, and two racing takers cannot
//!   both win.
//! - **complete**, **release**, **extend**: one `UpdateItem` or
//!   `DeleteItem` each, **conditioned on the owner token**
//!   (`token = :t AND expires_ms > :now`). A holder whose lease was taken
//!   over can therefore neither overwrite nor delete the new owner's record:
//!   the failed condition's record says why, and the reply is the one every
//!   store gives (`OtherOwner`, `AlreadyCompleted`, `Missing`; `Done` for a
//!   complete that finds exactly its own result, the same complete re-sent
//!   after its reply was lost). `extend` sends a second `UpdateItem` only
//!   when the record would expire within two leases.
//! - **batches** (`claim_batch`, `finish_batch`): the single requests, sent
//!   concurrently for distinct keys, a repeated key in a later wave so that
//!   its items keep batch order. Not `TransactWriteItems`: one failed
//!   condition cancels the whole transaction, so a single duplicate would
//!   fail every item of the batch, and each item costs twice the write
//!   capacity; nor `BatchWriteItem`, which takes no conditions.
//!
//! # Limits and what the store does not do
//!
//! - **Result size.** An item is at most 400 KB (the store counts it as
//!   [`MAX_ITEM_BYTES`], 400,000 bytes). The store reports its value limit
//!   ([`DynamoStore::max_value_size`], 398,720 bytes less the key
//!   attribute's name and the key prefix) in its
//!   capabilities, and the runtime lowers its `max_value_size` to it: a
//!   larger result is returned to the call that produced it, stored as
//!   the too-large marker, and later calls get `Error::TooLarge` (never a
//!   body run again, never a write DynamoDB refuses). A `complete` sent
//!   directly with a larger value is refused before any request with
//!   `Error::TooLarge`. Finished durable steps count toward the same item;
//!   a step that would overflow it is refused by DynamoDB with an error
//!   that says so.
//! - **Outbox.** `DynamoStore` keeps no outbox (`Capabilities::outbox` is
//!   false), as `MemoryStore`: `outbox::stage` fails before the body runs,
//!   and a `complete` carrying messages is `Error::Unsupported`. Stage
//!   outbox messages on RedisStore or idem-postgres's PgStore, whose outbox
//!   commits with the result.
//! - **Notifications.** No `WatchStore`: a caller that waits for a key in
//!   flight polls it, and a local replay cache replays forgotten keys until
//!   its entries' TTL.
//! - **Durability.** Only `Durability::Async`: DynamoDB acknowledges a
//!   write once it is durable in several availability zones, and there is
//!   nothing further to confirm.
//!
//! Errors: a missing table or refused permission is
//! `Error::InvalidConfig` saying what to create or grant; the rest
//! `Error::Unavailable`, with a [`DynamoError`] as its `source()`; an item
//! that does not decode is `Error::Corrupt`.

#![cfg_attr(docsrs, feature(doc_cfg))]

mod config;
mod error;
mod operate;
mod record;
mod steps;
mod store;
mod table;

pub use config::{DEFAULT_KEY_ATTRIBUTE, DynamoStoreConfig};
pub use error::DynamoError;
pub use store::{DynamoStore, MAX_ITEM_BYTES};

/// The SDK this crate is built on, so that the `Client` you pass is the
/// same type (`idem::dynamodb::aws_sdk_dynamodb`).
pub use aws_sdk_dynamodb;
