//! `PgStoreConfig`: which table holds the records, and how its name is
//! checked and quoted before it is ever spliced into SQL.

use idem_core::Error;
use std::fmt;
use std::time::Duration;

/// The table name used when none is configured.
pub const DEFAULT_TABLE: &str = "idem_keys";

/// Longest identifier PostgreSQL keeps (`NAMEDATALEN - 1`); longer ones are
/// silently truncated by the server, which would make two configured names
/// meet in one table.
const MAX_IDENT: usize = 63;

/// Settings of a [`PgStore`](crate::PgStore).
///
/// The table may be schema-qualified (`"billing.idem_keys"`). Each part must
/// be a plain identifier (ASCII letters, digits, `_`, not starting with a
/// digit, at most 63 bytes); it is then double-quoted in every statement, so
/// it is used exactly as written, case included. Anything else (quotes,
/// semicolons, spaces) is refused with [`Error::InvalidConfig`] when the
/// store is built: the name is the one piece of SQL idem cannot bind as a
/// parameter.
///
/// ```
/// use idem_postgres::PgStoreConfig;
/// let config = PgStoreConfig::table("billing.idem_keys");
/// assert_eq!(config.table_name(), "billing.idem_keys");
/// assert!(PgStoreConfig::table("x\"; DROP TABLE orders; --").validate().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgStoreConfig {
    table: String,
    partitions: Option<Duration>,
}

impl Default for PgStoreConfig {
    fn default() -> PgStoreConfig {
        PgStoreConfig::table(DEFAULT_TABLE)
    }
}

impl PgStoreConfig {
    /// A configuration whose records live in `table` (default `idem_keys`).
    /// Checked by [`validate`](PgStoreConfig::validate) when the store is built.
    ///
    /// ```
    /// let config = idem_postgres::PgStoreConfig::table("idem_keys");
    /// assert!(config.validate().is_ok());
    /// ```
    pub fn table(name: impl Into<String>) -> PgStoreConfig {
        PgStoreConfig {
            table: name.into(),
            partitions: None,
        }
    }

    /// Partitions the records table and the outbox table by time, one
    /// partition per `period` (whole seconds, from a minute to a week), so
    /// that expired records and relayed messages go by dropping whole
    /// partitions instead of `DELETE` and vacuum. The plain tables are the
    /// default; see [`PgStore::maintain`](crate::PgStore::maintain) and
    /// docs/outbox.md ("Retention") for what changes. Checked by
    /// [`validate`](PgStoreConfig::validate).
    ///
    /// ```
    /// use idem_postgres::PgStoreConfig;
    /// use std::time::Duration;
    /// let config = PgStoreConfig::default().partitioned(Duration::from_secs(3600));
    /// assert!(config.validate().is_ok());
    /// assert!(PgStoreConfig::default().partitioned(Duration::from_millis(1500)).validate().is_err());
    /// ```
    pub fn partitioned(mut self, period: Duration) -> PgStoreConfig {
        self.partitions = Some(period);
        self
    }

    /// The table name as configured.
    ///
    /// ```
    /// assert_eq!(idem_postgres::PgStoreConfig::default().table_name(), "idem_keys");
    /// ```
    pub fn table_name(&self) -> &str {
        &self.table
    }

    /// Checks the table name; the error says what is wrong with it.
    ///
    /// ```
    /// use idem_postgres::PgStoreConfig;
    /// assert!(PgStoreConfig::table("a.b.c").validate().is_err());
    /// assert!(PgStoreConfig::table("1abc").validate().is_err());
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        TableName::parse(&self.table)?;
        self.partitioning().map(|_| ())
    }

    pub(crate) fn partitioning(&self) -> Result<Option<Partitioning>, Error> {
        self.partitions.map(Partitioning::new).transpose()
    }

    pub(crate) fn table_ident(&self) -> Result<TableName, Error> {
        TableName::parse(&self.table)
    }
}

/// A checked, possibly schema-qualified table name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    schema: Option<String>,
    table: String,
}

impl TableName {
    /// [`DEFAULT_TABLE`], which needs no check (the tests parse it).
    pub(crate) fn default_table() -> TableName {
        TableName {
            schema: None,
            table: DEFAULT_TABLE.to_owned(),
        }
    }

    pub(crate) fn parse(name: &str) -> Result<TableName, Error> {
        let mut parts = name.split('.');
        let first = parts.next().unwrap_or_default();
        let second = parts.next();
        if parts.next().is_some() {
            return Err(invalid(
                name,
                "it has more than one `.`; use `table` or `schema.table`",
            ));
        }
        for part in [Some(first), second].into_iter().flatten() {
            check_ident(name, part)?;
        }
        Ok(match second {
            Some(table) => TableName {
                schema: Some(first.to_owned()),
                table: table.to_owned(),
            },
            None => TableName {
                schema: None,
                table: first.to_owned(),
            },
        })
    }

    /// `"index_name"` for an index of this table, quoted; PostgreSQL puts
    /// an index in its table's schema, so it is never qualified.
    pub(crate) fn index(&self, suffix: &str) -> String {
        let mut name = format!("{}_{suffix}", self.table);
        // Keep under the identifier limit the server would truncate to
        // anyway, so that `IF NOT EXISTS` finds the same name every time.
        while name.len() > MAX_IDENT {
            name.pop();
        }
        quote(&name)
    }
}

impl TableName {
    /// `"schema"."table_suffix"` for a function of this table: unlike an
    /// index, a function is created in the search path's first schema
    /// unless qualified, so it is qualified like the table.
    /// Names too long for the identifier limit keep the suffix and gain a
    /// hash of the whole table name, so two long table names never share
    /// (and overwrite) each other's functions.
    pub(crate) fn routine(&self, suffix: &str) -> String {
        self.beside(suffix)
    }

    /// `"schema"."table_suffix"` for a table kept beside this one (the
    /// failure counts), named as [`routine`](TableName::routine) names a
    /// function: in the same schema, never clashing for long names.
    pub(crate) fn beside(&self, suffix: &str) -> String {
        let mut name = format!("{}_{suffix}", self.table);
        if name.len() > MAX_IDENT {
            let hash = self.table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let keep = MAX_IDENT - suffix.len() - 10;
            name = format!("{}_{:08x}_{suffix}", &self.table[..keep], hash as u32);
        }
        let name = quote(&name);
        match &self.schema {
            Some(schema) => format!("{}.{name}", quote(schema)),
            None => name,
        }
    }
}

impl fmt::Display for TableName {
    /// The quoted, SQL-ready form: `"schema"."table"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(schema) = &self.schema {
            write!(f, "{}.", quote(schema))?;
        }
        f.write_str(&quote(&self.table))
    }
}

fn check_ident(whole: &str, part: &str) -> Result<(), Error> {
    if part.is_empty() {
        return Err(invalid(whole, "a part of it is empty"));
    }
    if part.len() > MAX_IDENT {
        return Err(invalid(
            whole,
            &format!(
                "`{part}` is {} bytes, over PostgreSQL's 63-byte identifier limit",
                part.len()
            ),
        ));
    }
    let mut bytes = part.bytes();
    let starts_ok = bytes
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_');
    if !starts_ok || !bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_') {
        return Err(invalid(
            whole,
            "use ASCII letters, digits and `_` only, not starting with a digit",
        ));
    }
    Ok(())
}

/// Double-quotes an identifier. The checked names hold no `"`, but doubling
/// keeps this correct for any input.
fn quote(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}

fn invalid(name: &str, why: &str) -> Error {
    Error::InvalidConfig(format!(
        "PgStoreConfig::table({name:?}) cannot be used: {why} (e.g. \"idem_keys\" or \"app.idem_keys\")"
    ))
}

// The layout of a partitioned store (`partitioned`): how its tables and
// their partitions are named and made; `partitions.rs` maintains them.

/// Shortest and longest period a partition may span (`PgStoreConfig::partitioned`).
const MIN_PERIOD: u64 = 1;
const MAX_PERIOD: u64 = 31 * 24 * 3600;

/// How the tables of a partitioned store are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Partitioning {
    /// Seconds per partition.
    period: u64,
}

impl Partitioning {
    pub(crate) fn new(period: Duration) -> Result<Partitioning, Error> {
        let secs = period.as_secs();
        if period.subsec_nanos() != 0 || !(MIN_PERIOD..=MAX_PERIOD).contains(&secs) {
            return Err(Error::InvalidConfig(format!(
                "PgStoreConfig::partitioned({period:?}) cannot be used: the period must be whole \
                 seconds, from {MIN_PERIOD} s to 31 days (e.g. an hour, or a day); pick one that \
                 the longest result TTL spans a dozen times at most"
            )));
        }
        Ok(Partitioning { period: secs })
    }

    /// The period (`gen`) that the timestamp expression `at` falls in.
    pub(crate) fn gen_of(&self, at: &str) -> String {
        format!("floor(extract(epoch FROM {at}) / {})::bigint", self.period)
    }

    /// The clause that partitions a table's `CREATE TABLE`.
    pub(crate) const BY: &'static str = "PARTITION BY RANGE (gen)";

    /// Creates the default partition of `parent`, whose partitions are
    /// named `<table>_<suffix><gen>`.
    pub(crate) fn default_partition(table: &TableName, suffix: &str, parent: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF {parent} DEFAULT{storage}",
            name = default_name(table, suffix),
            storage = storage(suffix),
        )
    }
}

/// The suffix of the records' partitions' names (`<table>_p<gen>`).
pub(crate) const RECORDS: &str = "p";

/// The default partition's name among the partitions named `<table>_<suffix>…`.
pub(crate) fn default_name(table: &TableName, suffix: &str) -> String {
    table.beside(&format!("{suffix}default"))
}

/// The records' partitions keep room for the updates of a row (completion,
/// lease renewals) on its page, as the plain table does.
pub(crate) fn storage(suffix: &str) -> &'static str {
    if suffix == RECORDS {
        " WITH (fillfactor = 75)"
    } else {
        ""
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_qualified_names() {
        assert_eq!(
            TableName::parse("idem_keys").unwrap().to_string(),
            "\"idem_keys\""
        );
        assert_eq!(
            TableName::parse("App.Keys_2").unwrap().to_string(),
            "\"App\".\"Keys_2\""
        );
        assert_eq!(
            TableName::parse("_x").unwrap().index("expires_idx"),
            "\"_x_expires_idx\""
        );
    }

    #[test]
    fn refuses_everything_else() {
        for bad in [
            "",
            ".",
            "a.",
            ".a",
            "a.b.c",
            "9lives",
            "idem keys",
            "idem\"keys",
            "idem;keys",
            "x\"; DROP TABLE orders; --",
            "idem-keys",
            "clé",
            "a\0b",
            &"x".repeat(64),
        ] {
            let e = TableName::parse(bad).unwrap_err();
            assert!(matches!(e, Error::InvalidConfig(_)), "{bad:?}: {e}");
        }
        assert!(TableName::parse(&"x".repeat(63)).is_ok());
    }

    #[test]
    fn routine_names_are_qualified_and_distinct_when_long() {
        assert_eq!(
            TableName::parse("app.keys").unwrap().routine("claim"),
            "\"app\".\"keys_claim\""
        );
        let a = TableName::parse(&format!("{}a", "t".repeat(62))).unwrap();
        let b = TableName::parse(&format!("{}b", "t".repeat(62))).unwrap();
        let (ra, rb) = (a.routine("claim"), b.routine("claim"));
        assert_ne!(ra, rb);
        for r in [&ra, &rb] {
            assert_eq!(r.len(), MAX_IDENT + 2, "{r}");
            assert!(r.ends_with("_claim\""), "{r}");
        }
    }

    #[test]
    fn long_index_names_stay_under_the_limit() {
        let t = TableName::parse(&"t".repeat(63)).unwrap();
        assert_eq!(t.index("expires_idx").len(), 63 + 2);
    }
}
