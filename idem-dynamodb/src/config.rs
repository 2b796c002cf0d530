//! Where a [`DynamoStore`](crate::DynamoStore) keeps its records: the table,
//! its partition key attribute, and a prefix for single-table designs.

use idem_core::Error;

/// The partition key attribute a table has unless configured otherwise.
pub const DEFAULT_KEY_ATTRIBUTE: &str = "pk";

/// The table a [`DynamoStore`](crate::DynamoStore) writes, and how its
/// items are keyed.
///
/// ```
/// use idem_dynamodb::DynamoStoreConfig;
/// let config = DynamoStoreConfig::new("app")       // one table shared with the application's items
///     .key_attribute("PK")                         // its partition key attribute
///     .key_prefix("IDEM#");                        // idem's items: PK = "IDEM#" + the stored key
/// assert_eq!(config.table_name(), "app");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DynamoStoreConfig {
    pub(crate) table: String,
    pub(crate) key_attribute: String,
    pub(crate) key_prefix: String,
}

impl DynamoStoreConfig {
    /// Records in `table`, keyed by `pk` (a string), no prefix.
    pub fn new(table: impl Into<String>) -> DynamoStoreConfig {
        DynamoStoreConfig {
            table: table.into(),
            key_attribute: DEFAULT_KEY_ATTRIBUTE.to_owned(),
            key_prefix: String::new(),
        }
    }

    /// The table's partition key attribute (a string, `S`), when it is not
    /// `pk`. The table must have no sort key.
    pub fn key_attribute(mut self, name: impl Into<String>) -> DynamoStoreConfig {
        self.key_attribute = name.into();
        self
    }

    /// A prefix before every stored key, to share a table with other items
    /// (single-table designs): idem's items are then `prefix + key`, and
    /// operator scans see only them.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> DynamoStoreConfig {
        self.key_prefix = prefix.into();
        self
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        &self.table
    }

    /// Checks the names against DynamoDB's rules, so that a wrong one fails
    /// at construction rather than at the first call.
    pub(crate) fn validate(&self) -> Result<(), Error> {
        let table_ok = (3..=255).contains(&self.table.len())
            && self
                .table
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'-' | b'.'));
        if !table_ok {
            return Err(Error::InvalidConfig(format!(
                "DynamoDB table name {:?} is invalid: 3 to 255 characters of a-z, A-Z, 0-9, \
                 '_', '-' and '.'",
                self.table
            )));
        }
        if self.key_attribute.is_empty() || self.key_attribute.len() > 255 {
            return Err(Error::InvalidConfig(format!(
                "DynamoDB key attribute {:?} is invalid: 1 to 255 bytes",
                self.key_attribute
            )));
        }
        if crate::record::ATTRIBUTES.contains(&self.key_attribute.as_str()) {
            return Err(Error::InvalidConfig(format!(
                "DynamoDB key attribute {:?} is one of the attributes idem-dynamodb writes; name \
                 the partition key otherwise",
                self.key_attribute
            )));
        }
        Ok(())
    }
}
