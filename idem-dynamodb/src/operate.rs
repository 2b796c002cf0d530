//! Operator calls (`inspect`, `forget`, `scan`, `count_failure`), for the
//! CLI and a consumer's failure counts.

use crate::record::{
    EXPIRES_AT, EXPIRES_MS, FAILURES, Item, LEASE, TOKEN, decode, n, now_ms, s, ttl_seconds,
};
use crate::store::{DynamoStore, names, values};
use async_trait::async_trait;
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};
use idem_core::Error;
use idem_core::store::{OperatorStore, RecordInfo, ScanPage, failure_key, millis};
use std::collections::HashMap;
use std::time::Duration;

/// How many rounds `count_failure` tries while its counter is created or
/// expires under it.
const COUNT_ROUNDS: usize = 8;

/// How many `Scan` requests one page reads at most while filtering leaves
/// it short (DynamoDB's `Limit` counts the items read, not those kept).
const SCAN_REQUESTS: usize = 8;

#[async_trait]
impl OperatorStore for DynamoStore {
    /// One strongly consistent `GetItem`.
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        let now = now_ms();
        let Some(item) = self.get("inspect", key).await? else {
            return Ok(None);
        };
        let record = decode(&item)?;
        Ok(record.live(now).then(|| record.info(now, with_value)))
    }

    /// A `GetItem` (an unreadable item is refused, never deleted), then a
    /// `DeleteItem` conditioned on the lease not being live (none when
    /// forced), then the failure counter's `DeleteItem`.
    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        let now = now_ms();
        let found = match self.get("forget", key).await? {
            Some(item) => Some(decode(&item)?),
            None => None,
        };
        let mut info = None;
        if let Some(record) = found {
            let mut req = self
                .client_ref()
                .delete_item()
                .table_name(self.table())
                .set_key(Some(self.item_key(key)))
                .return_values(ReturnValue::AllOld);
            if !force {
                req = req
                    .condition_expression(
                        "attribute_not_exists(#tok) OR #ld <= :now OR #exp <= :now",
                    )
                    .set_expression_attribute_names(Some(names(&[
                        ("#tok", TOKEN),
                        ("#ld", LEASE),
                        ("#exp", EXPIRES_MS),
                    ])))
                    .set_expression_attribute_values(Some(values(vec![(":now", n(now))])))
                    .return_values_on_condition_check_failure(
                        aws_sdk_dynamodb::types::ReturnValuesOnConditionCheckFailure::AllOld,
                    );
            }
            let deleted = match req.send().await {
                Ok(out) => out.attributes,
                Err(e) => match e.as_service_error() {
                    Some(DeleteItemError::ConditionalCheckFailedException(failed)) => {
                        let held = failed
                            .item()
                            .map(decode)
                            .transpose()?
                            .map(|r| r.info(now, false))
                            .unwrap_or_else(|| record.info(now, false));
                        return Err(Error::LeaseHeld {
                            lease_left: held.lease_left.unwrap_or_default(),
                            attempt: held.attempt.unwrap_or(1),
                        });
                    }
                    _ => return Err(self.map_err("forget", e)),
                },
            };
            let was = match deleted {
                Some(item) => decode(&item).unwrap_or(record),
                None => record,
            };
            info = was.live(now).then(|| was.info(now, false));
        }
        // An operator resetting a key resets its failures too.
        self.client_ref()
            .delete_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(&failure_key(key))))
            .send()
            .await
            .map_err(|e| self.map_err("forget", e))?;
        Ok(info)
    }

    /// `Scan` requests filtered on the prefix (never the failure
    /// counters), strongly consistent, until about `count` records or the
    /// end of the table. Records are not in key order. The cursor is the
    /// last key read. A scan reads the whole table (keys of other
    /// programs in a shared table too): an operator tool, not a hot path.
    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        let now = now_ms();
        let count = count.max(1);
        let key_prefix = &self.config().key_prefix;
        let mut start: Option<Item> =
            cursor.map(|c| HashMap::from([(self.key_attribute().to_owned(), s(c.to_owned()))]));
        let mut records = Vec::new();
        for _ in 0..SCAN_REQUESTS {
            let out = self
                .client_ref()
                .scan()
                .table_name(self.table())
                .consistent_read(true)
                .limit(i32::try_from(count).unwrap_or(i32::MAX))
                .filter_expression("begins_with(#pk, :p) AND attribute_not_exists(#fail)")
                .set_expression_attribute_names(Some(names(&[
                    ("#pk", self.key_attribute()),
                    ("#fail", FAILURES),
                ])))
                .set_expression_attribute_values(Some(values(vec![(
                    ":p",
                    s(format!("{key_prefix}{prefix}")),
                )])))
                .set_exclusive_start_key(start.take())
                .send()
                .await
                .map_err(|e| self.map_err("scan", e))?;
            for item in out.items() {
                let Some(AttributeValue::S(pk)) = item.get(self.key_attribute()) else {
                    continue;
                };
                let key = pk
                    .strip_prefix(key_prefix.as_str())
                    .unwrap_or(pk)
                    .to_owned();
                match decode(item) {
                    Ok(record) if record.live(now) => {
                        records.push((key, Ok(record.info(now, false))))
                    }
                    Ok(_) => {} // expired, not yet deleted by DynamoDB's TTL
                    Err(e) => records.push((key, Err(e))),
                }
            }
            start = out.last_evaluated_key;
            if start.is_none() || records.len() >= count {
                break;
            }
        }
        let cursor = start.and_then(|k| match k.get(self.key_attribute()) {
            Some(AttributeValue::S(pk)) => Some(pk.clone()),
            _ => None,
        });
        Ok(ScanPage { records, cursor })
    }

    /// One `UpdateItem` that adds one to a live counter; a conditional
    /// `PutItem` that starts it at 1 when there is none or it expired.
    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let counter = failure_key(key);
        for _ in 0..COUNT_ROUNDS {
            let now = now_ms();
            let expires = now.saturating_add(millis(ttl));
            let added = self
                .client_ref()
                .update_item()
                .table_name(self.table())
                .set_key(Some(self.item_key(&counter)))
                .update_expression("ADD #f :one SET #exp = :exp, #ttl = :ttl")
                .condition_expression("#exp > :now")
                .set_expression_attribute_names(Some(names(&[
                    ("#f", FAILURES),
                    ("#exp", EXPIRES_MS),
                    ("#ttl", EXPIRES_AT),
                ])))
                .set_expression_attribute_values(Some(values(vec![
                    (":one", n(1)),
                    (":exp", n(expires)),
                    (":ttl", n(ttl_seconds(expires))),
                    (":now", n(now)),
                ])))
                .return_values(ReturnValue::UpdatedNew)
                .send()
                .await;
            match added {
                Ok(out) => {
                    return match out.attributes.as_ref().and_then(|a| a.get(FAILURES)) {
                        Some(AttributeValue::N(v)) => v.parse().map_err(|_| {
                            Error::corrupt(format!("a failure counter holds {v:?}, not a count"))
                        }),
                        _ => Err(Error::corrupt(
                            "a failure counter came back without its count",
                        )),
                    };
                }
                Err(e) => match e.as_service_error() {
                    Some(UpdateItemError::ConditionalCheckFailedException(_)) => {}
                    _ => return Err(self.map_err("count_failure", e)),
                },
            }
            let mut item = self.item_key(&counter);
            item.insert(FAILURES.to_owned(), n(1));
            item.insert(EXPIRES_MS.to_owned(), n(expires));
            item.insert(EXPIRES_AT.to_owned(), n(ttl_seconds(expires)));
            let started = self
                .client_ref()
                .put_item()
                .table_name(self.table())
                .set_item(Some(item))
                .condition_expression("attribute_not_exists(#pk) OR #exp <= :now")
                .set_expression_attribute_names(Some(names(&[
                    ("#pk", self.key_attribute()),
                    ("#exp", EXPIRES_MS),
                ])))
                .set_expression_attribute_values(Some(values(vec![(":now", n(now))])))
                .send()
                .await;
            match started {
                Ok(_) => return Ok(1),
                Err(e) => match e.as_service_error() {
                    // Another caller started it first: add to it.
                    Some(PutItemError::ConditionalCheckFailedException(_)) => {}
                    _ => return Err(self.map_err("count_failure", e)),
                },
            }
        }
        Err(Error::unavailable(
            "count_failure",
            "the failure counter kept changing under the conditional writes; retry",
        ))
    }
}
