//! Durable steps: the finished steps live in the pending item itself (a map
//! of values by name and a list of names in order), so a takeover finds
//! them with the record and completion drops them with one write.

use crate::record::{
    EXPIRES_MS, LEASE, STEP_ORDER, STEPS, TOKEN, decode, n, now_ms, s, stored_value,
};
use crate::store::{DynamoStore, Written, conditional, names, values};
use async_trait::async_trait;
use aws_sdk_dynamodb::types::AttributeValue;
use idem_core::Error;
use idem_core::store::{StepRecord, StepStore, Store, Token, WriteReply};

#[async_trait]
impl StepStore for DynamoStore {
    /// One `UpdateItem` conditioned on the owner token and on the step not
    /// being recorded yet. The steps count toward the item's 400 KB: a
    /// step that would overflow it is refused by DynamoDB
    /// ([`Error::Unavailable`] whose source says so).
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let now = now_ms();
        let req = self
            .client_ref()
            .update_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(key)))
            .update_expression(
                "SET #steps.#name = :v, #order = list_append(if_not_exists(#order, :empty), :names)",
            )
            .condition_expression(format!(
                "{} AND attribute_not_exists(#steps.#name)",
                DynamoStore::OWNED
            ))
            .set_expression_attribute_names(Some(names(&[
                ("#tok", TOKEN),
                ("#exp", EXPIRES_MS),
                ("#steps", STEPS),
                ("#order", STEP_ORDER),
                ("#name", name),
            ])))
            .set_expression_attribute_values(Some(values(vec![
                (":t", s(token.as_str())),
                (":now", n(now)),
                // Text: step values are JSON (bytes only if not UTF-8).
                (":v", stored_value(value)),
                (":empty", AttributeValue::L(Vec::new())),
                (":names", AttributeValue::L(vec![s(name)])),
            ])));
        let written = conditional!(
            self,
            "step",
            req,
            aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException
        )?;
        let old = match written {
            Written::Done => return Ok(WriteReply::Done),
            Written::Failed(old) => old,
        };
        if let Some(record) = old.as_ref().map(decode).transpose()?
            && record.live(now)
            && record.owned_by(token.as_str())
        {
            // Recorded already: this same write re-sent; the first one stays.
            if record.steps.iter().any(|s| s.name == name) {
                return Ok(WriteReply::Done);
            }
        }
        DynamoStore::judge(old.as_ref(), token, now, |_| false)
    }

    /// One strongly consistent `GetItem`.
    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let now = now_ms();
        let Some(item) = self.get("steps", key).await? else {
            return Ok(None);
        };
        let record = decode(&item)?;
        Ok((record.live(now) && record.owned_by(token.as_str())).then_some(record.steps))
    }

    /// One `UpdateItem` that ends the lease now when steps are recorded,
    /// else the `DeleteItem` of [`Store::release`].
    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let now = now_ms();
        let req = self
            .client_ref()
            .update_item()
            .table_name(self.table())
            .set_key(Some(self.item_key(key)))
            .update_expression("SET #ld = :now")
            .condition_expression(format!("{} AND size(#order) > :zero", DynamoStore::OWNED))
            .set_expression_attribute_names(Some(names(&[
                ("#tok", TOKEN),
                ("#exp", EXPIRES_MS),
                ("#ld", LEASE),
                ("#order", STEP_ORDER),
            ])))
            .set_expression_attribute_values(Some(values(vec![
                (":t", s(token.as_str())),
                (":now", n(now)),
                (":zero", n(0)),
            ])));
        let written = conditional!(
            self,
            "suspend",
            req,
            aws_sdk_dynamodb::operation::update_item::UpdateItemError::ConditionalCheckFailedException
        )?;
        let old = match written {
            Written::Done => return Ok(WriteReply::Done),
            Written::Failed(old) => old,
        };
        let owned_without_steps = old
            .as_ref()
            .map(decode)
            .transpose()?
            .is_some_and(|r| r.live(now) && r.owned_by(token.as_str()) && r.steps.is_empty());
        if owned_without_steps {
            return self.release(key, token).await;
        }
        DynamoStore::judge(old.as_ref(), token, now, |_| false)
    }
}
