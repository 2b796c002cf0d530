//! `DynamoStore`: the store's handle, its requests, and the `Store` state
//! machine on conditional writes.

use crate::config::DynamoStoreConfig;
use crate::error::{DynamoError, map};
use crate::record::{
    ATTEMPT, EXPIRES_AT, EXPIRES_MS, FINGERPRINT, Item, KIND, LEASE, Record, STEP_ORDER, STEPS,
    State, TOKEN, VALUE, b, decode, item_size, n, now_ms, s, stored_value, ttl_seconds,
};
use async_trait::async_trait;
use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, Completed, Finish, Store, Token, WriteReply,
    in_waves, millis, record_ttl, store_lease,
};
use idem_core::{Error, Fingerprint};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The item size the store keeps under, in bytes: DynamoDB's limit is
/// 400 KB (attribute names and values, UTF-8 and raw bytes), counted here
/// as 400,000 bytes to stay on the safe side of every reading of "KB".
pub const MAX_ITEM_BYTES: usize = 400_000;

/// What the store keeps beside a value in a completed item, at most: the
/// attribute names, the fingerprint, the expiry numbers and the kind tag,
/// with room to spare. The stored key and the prefix are counted apart.
const ITEM_OVERHEAD: usize = 256;

/// The longest stored key the reported value limit leaves room for
/// (namespace, scope and key, each up to 255 bytes, escaped).
const KEY_ALLOWANCE: usize = 1024;

/// How many conditional writes a claim sends at most while the record
/// changes under it (each lost race means another caller's write landed).
const CLAIM_ROUNDS: usize = 16;

/// A [`Store`](idem_core::store::Store) on one DynamoDB table, through the
/// official `aws-sdk-dynamodb` client. Clones share the client.
///
/// See the crate documentation for the table's schema, whose clock decides
/// leases, and what each method costs.
#[derive(Clone)]
pub struct DynamoStore {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) client: Client,
    pub(crate) config: DynamoStoreConfig,
}

impl std::fmt::Debug for DynamoStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoStore")
            .field("table", &self.inner.config.table)
            .field("key_attribute", &self.inner.config.key_attribute)
            .field("key_prefix", &self.inner.config.key_prefix)
            .finish_non_exhaustive()
    }
}

/// How a conditional write ended.
pub(crate) enum Written {
    /// The condition held and the write happened.
    Done,
    /// The condition failed; the item as it was (`None`: no item).
    Failed(Option<Item>),
}

/// Sends a conditional write; a failed condition is [`Written::Failed`]
/// with the old item (`ALL_OLD`), any other error is mapped.
macro_rules! conditional {
    ($store:expr, $op:literal, $req:expr, $err:path) => {{
        match $req
            .return_values_on_condition_check_failure(
                aws_sdk_dynamodb::types::ReturnValuesOnConditionCheckFailure::AllOld,
            )
            .send()
            .await
        {
            Ok(_) => Ok(Written::Done),
            Err(e) => match e.as_service_error() {
                Some($err(failed)) => Ok(Written::Failed(failed.item().cloned())),
                _ => Err($store.map_err($op, e)),
            },
        }
    }};
}
pub(crate) use conditional;

/// Expression attribute names, from `(placeholder, attribute)` pairs.
pub(crate) fn names(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// Expression attribute values, from `(placeholder, value)` pairs.
pub(crate) fn values(pairs: Vec<(&str, AttributeValue)>) -> HashMap<String, AttributeValue> {
    pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

impl DynamoStore {
    /// A store on `table` (partition key `pk`, no prefix) through `client`.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let config = aws_config::load_from_env().await;
    /// let store = idem_dynamodb::DynamoStore::new(aws_sdk_dynamodb::Client::new(&config), "idem")?;
    /// # let _ = store; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a name DynamoDB would refuse.
    pub fn new(client: Client, table: impl Into<String>) -> Result<DynamoStore, Error> {
        DynamoStore::with_config(client, DynamoStoreConfig::new(table))
    }

    /// A store with `config` (key attribute, key prefix) through `client`.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a name DynamoDB would refuse.
    pub fn with_config(client: Client, config: DynamoStoreConfig) -> Result<DynamoStore, Error> {
        config.validate()?;
        Ok(DynamoStore {
            inner: Arc::new(Inner { client, config }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DynamoStoreConfig {
        &self.inner.config
    }

    /// The SDK client, to share it or to read the table beside the store.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The largest value this store stores, in bytes: DynamoDB's 400 KB
    /// item less what a completed item holds beside its value (the key,
    /// up to 1 KiB of it, its prefix and the store's attributes). Reported
    /// to the runtime as [`Capabilities::max_value_size`], which lowers
    /// the builder's `max_value_size` to it.
    ///
    /// ```no_run
    /// # fn demo(store: idem_dynamodb::DynamoStore) {
    /// assert!(store.max_value_size() < 400 * 1024);
    /// # }
    /// ```
    pub fn max_value_size(&self) -> usize {
        MAX_ITEM_BYTES
            - ITEM_OVERHEAD
            - KEY_ALLOWANCE
            - self.inner.config.key_prefix.len()
            - self.inner.config.key_attribute.len()
    }

    pub(crate) fn table(&self) -> &str {
        &self.inner.config.table
    }

    pub(crate) fn client_ref(&self) -> &Client {
        &self.inner.client
    }

    /// The partition key value of a stored key.
    pub(crate) fn pk(&self, key: &str) -> AttributeValue {
        s(format!("{}{key}", self.inner.config.key_prefix))
    }

    pub(crate) fn key_attribute(&self) -> &str {
        &self.inner.config.key_attribute
    }

    /// The key of `key`'s item, for `GetItem` and `DeleteItem`.
    pub(crate) fn item_key(&self, key: &str) -> Item {
        HashMap::from([(self.key_attribute().to_owned(), self.pk(key))])
    }

    pub(crate) fn map_err<E>(
        &self,
        op: &'static str,
        e: aws_sdk_dynamodb::error::SdkError<E, aws_sdk_dynamodb::config::http::HttpResponse>,
    ) -> Error
    where
        E: aws_sdk_dynamodb::error::ProvideErrorMetadata
            + std::error::Error
            + Send
            + Sync
            + 'static,
    {
        map(op, self.table(), self.key_attribute(), e)
    }

    /// Reads `key`'s item with a strongly consistent read.
    pub(crate) async fn get(&self, op: &'static str, key: &str) -> Result<Option<Item>, Error> {
        let out = self
            .inner
            .client
            .get_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(key)))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| self.map_err(op, e))?;
        Ok(out.item)
    }

    /// The fresh claim: one conditional `PutItem` that writes a pending
    /// record where there is none, or only an expired one.
    async fn put_fresh(&self, c: &Claim<'_>, now: u64) -> Result<Written, Error> {
        let lease = millis(store_lease(c.lease));
        let expires = now.saturating_add(millis(record_ttl(c.ttl, c.lease)));
        let mut item: Item = HashMap::with_capacity(10);
        item.insert(self.key_attribute().to_owned(), self.pk(c.key));
        item.insert(TOKEN.to_owned(), s(c.token.as_str()));
        item.insert(LEASE.to_owned(), n(now.saturating_add(lease)));
        item.insert(ATTEMPT.to_owned(), n(1));
        item.insert(EXPIRES_MS.to_owned(), n(expires));
        item.insert(EXPIRES_AT.to_owned(), n(ttl_seconds(expires)));
        item.insert(STEPS.to_owned(), AttributeValue::M(HashMap::new()));
        item.insert(STEP_ORDER.to_owned(), AttributeValue::L(Vec::new()));
        if let Some(fp) = c.fingerprint {
            item.insert(FINGERPRINT.to_owned(), b(fp.as_bytes()));
        }
        let req = self
            .inner
            .client
            .put_item()
            .table_name(self.table())
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(#pk) OR #exp <= :now")
            .set_expression_attribute_names(Some(names(&[
                ("#pk", self.key_attribute()),
                ("#exp", EXPIRES_MS),
            ])))
            .set_expression_attribute_values(Some(values(vec![(":now", n(now))])));
        conditional!(
            self,
            "claim",
            req,
            aws_sdk_dynamodb::operation::put_item::PutItemError::ConditionalCheckFailedException
        )
    }

    /// The takeover of an expired lease (`attempt` one more) or the
    /// owner's own claim re-sent (`attempt` kept): a compare-and-swap on
    /// the pending record exactly as it was read, keeping its steps.
    async fn swap_pending(
        &self,
        c: &Claim<'_>,
        old: (&str, u64, u64),
        attempt: u32,
        now: u64,
    ) -> Result<Written, Error> {
        let (old_token, old_lease, old_expires) = old;
        let takeover = old_token != c.token.as_str();
        let lease = millis(store_lease(c.lease));
        let expires = now.saturating_add(millis(record_ttl(c.ttl, c.lease)));
        let mut set =
            String::from("SET #tok = :t, #ld = :ld, #att = :att, #exp = :exp, #ttl = :ttl");
        let mut name_pairs = vec![
            ("#tok", TOKEN),
            ("#ld", LEASE),
            ("#att", ATTEMPT),
            ("#exp", EXPIRES_MS),
            ("#ttl", EXPIRES_AT),
        ];
        let mut value_pairs = vec![
            (":t", s(c.token.as_str())),
            (":ld", n(now.saturating_add(lease))),
            (":att", n(u64::from(attempt))),
            (":exp", n(expires)),
            (":ttl", n(ttl_seconds(expires))),
            (":old_t", s(old_token)),
            (":old_ld", n(old_lease)),
            (":old_exp", n(old_expires)),
        ];
        if let (true, Some(fp)) = (takeover, c.fingerprint) {
            set.push_str(", #fp = :fp");
            name_pairs.push(("#fp", FINGERPRINT));
            value_pairs.push((":fp", b(fp.as_bytes())));
        }
        let req = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(c.key)))
            .update_expression(set)
            .condition_expression("#tok = :old_t AND #ld = :old_ld AND #exp = :old_exp")
            .set_expression_attribute_names(Some(names(&name_pairs)))
            .set_expression_attribute_values(Some(values(value_pairs)));
        conditional!(
            self,
            "claim",
            req,
            aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException
        )
    }

    /// What a failed owner-conditioned write found: the reply the other
    /// stores give, and `Done` for a complete that finds exactly its own
    /// result (`same`).
    pub(crate) fn judge(
        old: Option<&Item>,
        token: &Token,
        now: u64,
        same: impl FnOnce(&Record) -> bool,
    ) -> Result<WriteReply, Error> {
        let Some(item) = old else {
            return Ok(WriteReply::Missing);
        };
        let record = decode(item)?;
        if !record.live(now) {
            return Ok(WriteReply::Missing);
        }
        Ok(match &record.state {
            State::Completed { .. } if same(&record) => WriteReply::Done,
            State::Completed { .. } => WriteReply::AlreadyCompleted,
            State::Pending { token: t, .. } if t == token.as_str() => {
                // The condition failed for a reason other than ownership:
                // only an expiry between reading the clock and the write.
                WriteReply::Missing
            }
            State::Pending { .. } => WriteReply::OtherOwner,
        })
    }

    /// The owner condition every write of a pending record carries: the
    /// token holds it, and it has not expired.
    pub(crate) const OWNED: &'static str = "#tok = :t AND #exp > :now";

    async fn delete_owned(&self, key: &str, token: &Token, now: u64) -> Result<Written, Error> {
        let req = self
            .inner
            .client
            .delete_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(key)))
            .condition_expression(Self::OWNED)
            .set_expression_attribute_names(Some(names(&[("#tok", TOKEN), ("#exp", EXPIRES_MS)])))
            .set_expression_attribute_values(Some(values(vec![
                (":t", s(token.as_str())),
                (":now", n(now)),
            ])));
        conditional!(
            self,
            "release",
            req,
            aws_sdk_dynamodb::operation::delete_item::DeleteItemError::ConditionalCheckFailedException
        )
    }

    /// Sets the lease deadline (and the expiry, when given) of the
    /// caller's pending record; with `min_expires`, only while the record
    /// expires no sooner than that.
    async fn set_lease(
        &self,
        key: &str,
        token: &Token,
        now: u64,
        deadline: u64,
        expires: Option<u64>,
        min_expires: Option<u64>,
    ) -> Result<Written, Error> {
        let mut set = String::from("SET #ld = :ld");
        let mut name_pairs = vec![("#tok", TOKEN), ("#exp", EXPIRES_MS), ("#ld", LEASE)];
        let mut value_pairs = vec![
            (":t", s(token.as_str())),
            (":now", n(now)),
            (":ld", n(deadline)),
        ];
        if let Some(expires) = expires {
            set.push_str(", #exp = :exp, #ttl = :ttl");
            name_pairs.push(("#ttl", EXPIRES_AT));
            value_pairs.push((":exp", n(expires)));
            value_pairs.push((":ttl", n(ttl_seconds(expires))));
        }
        let condition = match min_expires {
            Some(min) => {
                value_pairs.push((":min", n(min)));
                format!("{} AND #exp >= :min", Self::OWNED)
            }
            None => Self::OWNED.to_owned(),
        };
        let req = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(key)))
            .update_expression(set)
            .condition_expression(condition)
            .set_expression_attribute_names(Some(names(&name_pairs)))
            .set_expression_attribute_values(Some(values(value_pairs)));
        conditional!(
            self,
            "extend",
            req,
            aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException
        )
    }
}

fn mismatch(given: Option<&Fingerprint>, stored: Option<&Fingerprint>) -> bool {
    matches!((given, stored), (Some(a), Some(b)) if a != b)
}

#[async_trait]
impl Store for DynamoStore {
    fn name(&self) -> &'static str {
        "dynamodb"
    }

    /// One conditional `PutItem` for a fresh key, a duplicate in flight, a
    /// replay or a mismatch (the stored record comes back with the failed
    /// condition, `ALL_OLD`); two for a takeover or a re-sent claim (the
    /// second a compare-and-swap on the record as read).
    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        let mut seen: Option<Item> = None;
        for _ in 0..CLAIM_ROUNDS {
            let now = now_ms();
            let item = match seen.take() {
                Some(item) => item,
                None => match self.put_fresh(&c, now).await? {
                    Written::Done => return Ok(ClaimReply::Acquired { attempt: 1 }),
                    // Deleted between the condition and its answer: again.
                    Written::Failed(None) => continue,
                    Written::Failed(Some(item)) => item,
                },
            };
            let record = decode(&item)?;
            if !record.live(now) {
                continue; // expired: the fresh put takes it
            }
            if mismatch(c.fingerprint, record.fingerprint.as_ref()) {
                return Ok(ClaimReply::Mismatch);
            }
            let (token, lease_ms, attempt) = match record.state {
                State::Completed { kind, value } => {
                    return Ok(ClaimReply::Completed(Completed {
                        kind,
                        value,
                        fingerprint: record.fingerprint,
                        ttl_left: Some(Duration::from_millis(record.expires_ms - now)),
                    }));
                }
                State::Pending {
                    token,
                    lease_ms,
                    attempt,
                } => (token, lease_ms, attempt),
            };
            let attempt = if token == c.token.as_str() {
                attempt // our own claim, re-sent after its reply was lost
            } else if lease_ms > now {
                return Ok(ClaimReply::InProgress {
                    retry_after: Duration::from_millis(lease_ms - now),
                });
            } else {
                attempt.saturating_add(1) // the holder's lease ran out
            };
            let old = (token.as_str(), lease_ms, record.expires_ms);
            match self.swap_pending(&c, old, attempt, now).await? {
                Written::Done => return Ok(ClaimReply::Acquired { attempt }),
                Written::Failed(item) => seen = item,
            }
        }
        Err(Error::unavailable(
            "claim",
            format!(
                "the record changed under {CLAIM_ROUNDS} conditional writes in a row (other \
                 callers kept taking the key over); retry the call"
            ),
        ))
    }

    /// One `UpdateItem` conditioned on the owner token: sets the value,
    /// removes the lease, the token and the steps; the expiry stays.
    async fn complete(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
        if !c.outbox.is_empty() {
            return Err(Error::Unsupported {
                op: "complete with outbox messages (DynamoStore keeps no outbox: stage outbox \
                     messages on RedisStore or idem-postgres's PgStore)",
            });
        }
        let now = now_ms();
        let size = self.completed_size(c.key, c.value.len());
        if size > MAX_ITEM_BYTES {
            tracing::warn!(
                error = %DynamoError::ItemTooLarge { size, limit: MAX_ITEM_BYTES },
                "refusing a result DynamoDB would not store"
            );
            return Err(Error::TooLarge {
                size: c.value.len(),
                limit: self.max_value_size(),
            });
        }
        let kind = c.kind.tag();
        let req = self
            .inner
            .client
            .update_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(c.key)))
            .update_expression("SET #kind = :k, #val = :v REMOVE #tok, #ld, #att, #steps, #order")
            .condition_expression(Self::OWNED)
            .set_expression_attribute_names(Some(names(&[
                ("#tok", TOKEN),
                ("#exp", EXPIRES_MS),
                ("#kind", KIND),
                ("#val", VALUE),
                ("#ld", LEASE),
                ("#att", ATTEMPT),
                ("#steps", STEPS),
                ("#order", STEP_ORDER),
            ])))
            .set_expression_attribute_values(Some(values(vec![
                (":t", s(c.token.as_str())),
                (":now", n(now)),
                (":k", s(char::from(kind).to_string())),
                (":v", stored_value(c.value)),
            ])));
        let written = conditional!(
            self,
            "complete",
            req,
            aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException
        )?;
        match written {
            Written::Done => Ok(WriteReply::Done),
            // A stored result keeps no owner: exactly this result is this
            // same complete, re-sent after its reply was lost.
            Written::Failed(old) => Self::judge(
                old.as_ref(),
                c.token,
                now,
                |r| matches!(&r.state, State::Completed { kind: k, value: v } if *k == c.kind && v[..] == *c.value),
            ),
        }
    }

    /// One `DeleteItem` conditioned on the owner token.
    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let now = now_ms();
        match self.delete_owned(key, token, now).await? {
            Written::Done => Ok(WriteReply::Done),
            Written::Failed(old) => Self::judge(old.as_ref(), token, now, |_| false),
        }
    }

    /// One `UpdateItem` conditioned on the owner token (and on the record
    /// expiring no sooner than two leases from now); a second one, which
    /// also moves the expiry on, when it would.
    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let now = now_ms();
        let lease = millis(store_lease(lease));
        let deadline = now.saturating_add(lease);
        // Keep at least one more lease of record after the lease ends, so
        // an expired lease is still seen (and counted) as a takeover.
        let min_expires = now.saturating_add(lease.saturating_mul(2));
        let old = match self
            .set_lease(key, token, now, deadline, None, Some(min_expires))
            .await?
        {
            Written::Done => return Ok(WriteReply::Done),
            Written::Failed(old) => old,
        };
        let owned_live = old
            .as_ref()
            .map(decode)
            .transpose()?
            .is_some_and(|r| r.live(now) && r.owned_by(token.as_str()));
        if !owned_live {
            return Self::judge(old.as_ref(), token, now, |_| false);
        }
        match self
            .set_lease(key, token, now, deadline, Some(min_expires), None)
            .await?
        {
            Written::Done => Ok(WriteReply::Done),
            Written::Failed(old) => Self::judge(old.as_ref(), token, now, |_| false),
        }
    }

    /// Per key, concurrently: each wave of distinct keys
    /// ([`in_waves`]) sends its claims at once, and a key that comes again
    /// waits for the next wave. No `TransactWriteItems` (one failed
    /// condition cancels every item, so one duplicate would fail the
    /// batch) and no `BatchWriteItem` (no conditions at all).
    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        in_waves(
            claims,
            |c| c.key,
            |wave| futures_util::future::join_all(wave.into_iter().map(|c| self.claim(*c))),
            || Error::unavailable("claim", "a batch item was left unanswered"),
        )
        .await
    }

    /// Per key, concurrently, wave by wave, as
    /// [`claim_batch`](Store::claim_batch) and for the same reasons.
    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        in_waves(
            ops,
            |op| op.key(),
            |wave| futures_util::future::join_all(wave.into_iter().map(|op| op.run_on(self))),
            || Error::unavailable("finish_batch", "a batch item was left unanswered"),
        )
        .await
    }

    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
            .steps(self)
            .operator(self)
            .max_value_size(self.max_value_size())
    }
}

impl DynamoStore {
    /// The size of `key`'s completed item with a value of `value_len`
    /// bytes, as DynamoDB counts it.
    fn completed_size(&self, key: &str, value_len: usize) -> usize {
        let mut item: Item = HashMap::new();
        item.insert(self.key_attribute().to_owned(), self.pk(key));
        item.insert(KIND.to_owned(), s("C"));
        item.insert(FINGERPRINT.to_owned(), b(&[0; 16]));
        item.insert(EXPIRES_MS.to_owned(), n(u64::MAX));
        item.insert(EXPIRES_AT.to_owned(), n(u64::MAX));
        item_size(&item) + VALUE.len() + value_len
    }
}
