//! `DynamoStore::create_table`: the table and its TTL, for tests and
//! development (production tables come from infrastructure code, with the
//! same schema).

use crate::record::EXPIRES_AT;
use crate::store::DynamoStore;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType, TableStatus,
    TimeToLiveSpecification,
};
use idem_core::Error;
use std::time::Duration;

impl DynamoStore {
    /// Creates the store's table if it does not exist: the partition key
    /// (a string), no sort key, on-demand billing; waits until it is
    /// `ACTIVE`, then turns DynamoDB's TTL on for `expires_at`. A table
    /// that exists already is left as it is.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] when the credentials may not create it,
    /// [`Error::Unavailable`] when DynamoDB does not answer or the table
    /// does not become `ACTIVE` within a minute.
    pub async fn create_table(&self) -> Result<(), Error> {
        let attribute = |name: &str| {
            AttributeDefinition::builder()
                .attribute_name(name)
                .attribute_type(ScalarAttributeType::S)
                .build()
        };
        let key = KeySchemaElement::builder()
            .attribute_name(self.key_attribute())
            .key_type(KeyType::Hash)
            .build();
        let (attribute, key) = match (attribute(self.key_attribute()), key) {
            (Ok(a), Ok(k)) => (a, k),
            (Err(e), _) | (_, Err(e)) => {
                return Err(Error::InvalidConfig(format!("the table's schema: {e}")));
            }
        };
        let created = self
            .client_ref()
            .create_table()
            .table_name(self.table())
            .attribute_definitions(attribute)
            .key_schema(key)
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        if let Err(e) = created {
            let exists = e
                .as_service_error()
                .is_some_and(|s| s.is_resource_in_use_exception());
            if !exists {
                return Err(self.map_err("create_table", e));
            }
        }
        self.wait_active().await?;
        let ttl = TimeToLiveSpecification::builder()
            .enabled(true)
            .attribute_name(EXPIRES_AT)
            .build()
            .map_err(|e| Error::InvalidConfig(format!("the table's TTL: {e}")))?;
        let turned_on = self
            .client_ref()
            .update_time_to_live()
            .table_name(self.table())
            .time_to_live_specification(ttl)
            .send()
            .await;
        if let Err(e) = turned_on {
            // Already on: DynamoDB refuses to set it again.
            let already = e
                .as_service_error()
                .and_then(aws_sdk_dynamodb::error::ProvideErrorMetadata::message)
                .is_some_and(|m| m.contains("already enabled"));
            if !already {
                return Err(self.map_err("create_table", e));
            }
        }
        tracing::info!(table = self.table(), "DynamoDB table ready");
        Ok(())
    }

    async fn wait_active(&self) -> Result<(), Error> {
        for _ in 0..120 {
            let out = self
                .client_ref()
                .describe_table()
                .table_name(self.table())
                .send()
                .await
                .map_err(|e| self.map_err("create_table", e))?;
            if out.table().and_then(|t| t.table_status()) == Some(&TableStatus::Active) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Err(Error::unavailable(
            "create_table",
            format!(
                "table `{}` did not become ACTIVE within a minute",
                self.table()
            ),
        ))
    }
}
