//! Operating a `PgStore`: `inspect`, `forget` and `scan`, with the same
//! answers as idem's Redis and memory stores (see `idem_core::store::Store`).
//!
//! Reads are single statements on the database's clock. `forget` reads the
//! row under `FOR UPDATE`, decides in Rust (the same decoding as every
//! other read, so an unreadable row is refused and kept) and deletes it in
//! the same transaction. `scan` pages by primary key (keyset pagination on
//! the `COLLATE "C"` key): each page is one bounded index range scan,
//! never a full-table read.

use crate::errors::map_failures;
use crate::row::{get, row_info};
use crate::store::PgStore;
use idem_core::store::ScanPage;
use idem_core::{Error, RecordInfo};
use sqlx::AssertSqlSafe;
use std::sync::Arc;

/// The smallest string above every string that starts with `prefix`, in
/// byte order (`COLLATE "C"`, where UTF-8 sorts by code point): the prefix
/// with its last character raised by one (dropping trailing characters that
/// cannot be raised). `None` only when every character is `char::MAX`.
pub(crate) fn prefix_end(prefix: &str) -> Option<String> {
    let mut chars: Vec<char> = prefix.chars().collect();
    while let Some(last) = chars.pop() {
        // The next scalar value (skipping the surrogate gap).
        let next = (u32::from(last) + 1..=u32::from(char::MAX)).find_map(char::from_u32);
        if let Some(next) = next {
            chars.push(next);
            return Some(chars.into_iter().collect());
        }
    }
    None
}

impl PgStore {
    pub(crate) async fn inspect_row(
        &self,
        key: &str,
        with_value: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.inspect)))
            .bind(key)
            .bind(with_value)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail("inspect"))?;
        row.map(|r| row_info(&r, with_value)).transpose()
    }

    pub(crate) async fn forget_row(
        &self,
        key: &str,
        force: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let fail = self.fail("forget");
        let mut txn = self.inner.pool.begin().await.map_err(&fail)?;
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.forget_lock)))
            .bind(key)
            .fetch_optional(&mut *txn)
            .await
            .map_err(&fail)?;
        let Some(row) = row else {
            // Nothing live: an expired leftover is the reaper's, not ours.
            self.forget_failures(&mut txn, key).await?;
            txn.commit().await.map_err(&fail)?;
            return Ok(None);
        };
        // Unreadable rows are refused (and the transaction rolled back on drop).
        let info = row_info(&row, false)?;
        if info.is_held() && !force {
            return Err(Error::LeaseHeld {
                lease_left: info.lease_left.unwrap_or_default(),
                attempt: info.attempt.unwrap_or(1),
            });
        }
        sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.forget_delete)))
            .bind(key)
            .execute(&mut *txn)
            .await
            .map_err(&fail)?;
        self.forget_failures(&mut txn, key).await?;
        txn.commit().await.map_err(&fail)?;
        Ok(Some(info))
    }

    /// Deletes the failure count of `key` in the forget's transaction: an
    /// operator resetting a key resets its failures with it.
    async fn forget_failures(
        &self,
        txn: &mut sqlx::Transaction<'static, sqlx::Postgres>,
        key: &str,
    ) -> Result<(), Error> {
        let sql = &self.inner.sql;
        sqlx::query(AssertSqlSafe(Arc::clone(&sql.forget_failures)))
            .bind(key)
            .execute(&mut **txn)
            .await
            .map_err(|e| map_failures("forget", &sql.failures_table, e))?;
        Ok(())
    }

    pub(crate) async fn scan_page(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        let count = count.clamp(1, 10_000);
        let limit = i64::try_from(count + 1).unwrap_or(i64::MAX);
        // Both bounds of the key range are index conditions, so a page
        // reads at most `count + 1` live rows of the range (plus expired
        // ones the reaper has not deleted yet).
        let query = match prefix_end(prefix) {
            Some(end) => sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.scan)))
                .bind(prefix)
                .bind(cursor)
                .bind(limit)
                .bind(end),
            None => sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.scan_open)))
                .bind(prefix)
                .bind(cursor)
                .bind(limit),
        };
        let rows = query
            .fetch_all(&self.inner.pool)
            .await
            .map_err(self.fail("scan"))?;
        let more = rows.len() > count;
        let mut records = Vec::with_capacity(count.min(rows.len()));
        for row in rows.iter().take(count) {
            let key: String = get(row, "key")?;
            records.push((key, row_info(row, false)));
        }
        let cursor = if more {
            records.last().map(|(k, _)| k.clone())
        } else {
            None
        };
        Ok(ScanPage { records, cursor })
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_next_string_in_byte_order() {
        assert_eq!(prefix_end("idem:charge:").as_deref(), Some("idem:charge;"));
        assert_eq!(prefix_end("aü").as_deref(), Some("aý"));
        assert_eq!(prefix_end("a\u{d7ff}").as_deref(), Some("a\u{e000}"));
        assert_eq!(prefix_end("a\u{10ffff}").as_deref(), Some("b"));
        assert_eq!(prefix_end("\u{10ffff}"), None);
        assert_eq!(prefix_end(""), None);
    }
}
