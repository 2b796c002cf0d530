//! A DynamoDB table of its own on the local AWS endpoint, deleted when
//! dropped: what a DynamoStore test runs on.

use idem_dynamodb::{DynamoStore, DynamoStoreConfig};

use crate::aws::{dynamodb_client, unique_name};

/// A fresh table (created with [`DynamoStore::create_table`]) and the
/// client that made it. Dropping it deletes the table, so tests share
/// nothing.
pub struct DynamoTestTable {
    /// The table's name (`idem-<pid>-<n>-<nanos>`).
    pub name: String,
    client: aws_sdk_dynamodb::Client,
}

impl std::fmt::Debug for DynamoTestTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DynamoTestTable")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl DynamoTestTable {
    /// A new table on the local endpoint, and a store on it with `config`
    /// (its table name replaced by the new table's).
    ///
    /// # Panics
    ///
    /// When the endpoint is unreachable (the message says how to start
    /// one) or the table cannot be created.
    pub async fn create_with(
        config: impl FnOnce(String) -> DynamoStoreConfig,
    ) -> (DynamoTestTable, DynamoStore) {
        let client = dynamodb_client().await;
        let name = unique_name("idem");
        let store = DynamoStore::with_config(client.clone(), config(name.clone()))
            .unwrap_or_else(|e| panic!("idem-testkit: DynamoStore on {name}: {e}"));
        store
            .create_table()
            .await
            .unwrap_or_else(|e| panic!("idem-testkit: cannot create DynamoDB table {name}: {e}"));
        (DynamoTestTable { name, client }, store)
    }

    /// A new table with the default key attribute and no prefix.
    ///
    /// # Panics
    ///
    /// As [`DynamoTestTable::create_with`].
    pub async fn create() -> (DynamoTestTable, DynamoStore) {
        DynamoTestTable::create_with(DynamoStoreConfig::new).await
    }

    /// The client that made the table.
    pub fn client(&self) -> &aws_sdk_dynamodb::Client {
        &self.client
    }
}

impl Drop for DynamoTestTable {
    fn drop(&mut self) {
        let (client, name) = (self.client.clone(), self.name.clone());
        // On a thread of its own: a drop inside a runtime cannot block it.
        let deleted = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
            if let Ok(rt) = rt {
                let r = rt.block_on(client.delete_table().table_name(&name).send());
                if let Err(e) = r {
                    tracing::warn!(table = %name, error = %aws_sdk_dynamodb::error::DisplayErrorContext(&e), "idem-testkit: cannot delete the test table");
                }
            }
        })
        .join();
        if deleted.is_err() {
            tracing::warn!(table = %self.name, "idem-testkit: the table's deletion panicked");
        }
    }
}
