//! The writes that end or renew a claim: `complete`, `release` and
//! `extend` as plain statements re-run while the row races them, and the
//! `run_in_tx` completion inside the body's own transaction (`tx.rs`).

use crate::errors;
use crate::row::{WriteState, read_write_row, row_done};
use crate::schema::LEASE_LOST;
use crate::store::PgStore;
use crate::tx::{self, TxSlot};
use idem_core::Error;
use idem_core::store::WriteReply;
use sqlx::{AssertSqlSafe, Postgres, Transaction};
use std::sync::Arc;

/// How many times a claim or write is re-run when the row changed between
/// the refused write and its read-back (see `sql.rs`). Each re-run means
/// another caller's write landed in between, so a handful is plenty.
pub(crate) const MAX_RACES: usize = 16;

/// A write statement and the parameters it binds after the key (`$1`) and
/// the owner token (`$2`).
#[derive(Clone, Copy)]
pub(crate) enum WriteKind<'a> {
    /// Stores the result: its kind's tag (`$3`) and its bytes (`$4`).
    Complete { tag: i8, value: &'a [u8] },
    /// Deletes the pending record.
    Release,
    /// Moves the lease on by `lease_ms` (`$3`).
    Extend { lease_ms: i64 },
    /// Appends a finished step: its name (`$3`) and value's JSON (`$4`).
    Step { name: &'a str, value: &'a str },
}

impl WriteKind<'_> {
    /// The operation's name, for errors.
    fn op(self) -> &'static str {
        match self {
            WriteKind::Complete { .. } => "complete",
            WriteKind::Release => "release",
            WriteKind::Extend { .. } => "extend",
            WriteKind::Step { .. } => "save_step",
        }
    }
}

impl PgStore {
    /// Runs a write statement (`complete`, `release`, `extend`): one row
    /// changed is the answer; none, and `classify` says why, re-running the
    /// write while that read contradicts the refusal (the row changed in
    /// between).
    pub(crate) async fn write(
        &self,
        key: &str,
        token: &[u8; 16],
        write: WriteKind<'_>,
    ) -> Result<WriteState, Error> {
        let op = write.op();
        let sql = &self.inner.sql;
        let sql = match write {
            WriteKind::Complete { .. } => &sql.complete,
            WriteKind::Release => &sql.release,
            WriteKind::Extend { .. } => &sql.extend,
            WriteKind::Step { .. } => &sql.save_step,
        };
        for _ in 0..MAX_RACES {
            let q = sqlx::query(AssertSqlSafe(Arc::clone(sql)))
                .bind(key)
                .bind(&token[..]);
            let q = match write {
                WriteKind::Complete { tag, value } => q.bind(tag).bind(value),
                WriteKind::Release => q,
                WriteKind::Extend { lease_ms } => q.bind(lease_ms),
                WriteKind::Step { name, value } => q.bind(name).bind(value),
            };
            let done = q
                .execute(&self.inner.pool)
                .await
                .map_err(self.fail(op))?
                .rows_affected();
            if done > 0 {
                return Ok(WriteState::Reply(WriteReply::Done));
            }
            // `same` compares the stored record with this write's, which
            // only a `complete` has.
            let (kind, value) = match write {
                WriteKind::Complete { tag, value } => (tag, value),
                WriteKind::Release | WriteKind::Extend { .. } | WriteKind::Step { .. } => {
                    (0, &[][..])
                }
            };
            match self.classify(op, key, token, kind, value).await? {
                WriteState::Ours => continue,
                state => return Ok(state),
            }
        }
        Err(errors::unavailable(
            op,
            "the record kept changing under this write; retry",
        ))
    }

    /// Completes inside the body's transaction (see `tx.rs`): a
    /// compare-and-set on the owner token, then commit.
    pub(crate) async fn complete_in_tx(
        &self,
        slot: &TxSlot,
        mut txn: Transaction<'static, Postgres>,
        key: &str,
        token: &[u8; 16],
        kind: i8,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        // The CAS and the COMMIT travel in one message (simple query
        // protocol), so `run_in_tx` costs one round trip over the body's
        // own transaction: the claim. A CAS that touches no row raises
        // `LEASE_LOST`, which stops the message before its COMMIT. Values travel
        // hex-encoded, so nothing in them can end the literal.
        let script = self.inner.sql.cas_and_commit(key, token, kind, value);
        let cas = sqlx::raw_sql(AssertSqlSafe(script))
            .execute(&mut *txn)
            .await;
        let failure = match cas {
            Ok(_) => {
                // Committed; the `BEGIN` after the COMMIT left an empty
                // transaction open, which dropping `txn` rolls back with the
                // connection's next use (no round trip now, no WAL).
                drop(txn);
                slot.committed();
                return Ok(WriteReply::Done);
            }
            Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some(LEASE_LOST) => {
                // The CAS touched no row: the lease is no longer ours.
                rollback(txn).await;
                let reply = match self.classify("complete", key, token, kind, value).await? {
                    WriteState::Reply(r) => r,
                    WriteState::Ours | WriteState::TxBound => WriteReply::Missing,
                };
                tracing::warn!(
                    ?reply,
                    "the lease was lost before the body's transaction could commit: rolled back, nothing of the body was kept"
                );
                slot.failed(Error::LeaseLost);
                return Ok(reply);
            }
            Err(e) if matches!(e, sqlx::Error::Database(_)) => {
                rollback(txn).await;
                e
            }
            Err(e) => {
                // The connection broke mid-message: the COMMIT may or may
                // not have landed. The record tells: idem re-sends
                // `complete`, which finds it completed (committed) or still
                // ours (rolled back, then released).
                let e = self.fail("complete")(e);
                slot.failed(Error::unavailable(
                    "complete",
                    format!(
                        "{e}; the body's transaction did not commit and the key was released: \
                         retry with the same key"
                    ),
                ));
                return Err(e);
            }
        };
        // The database refused the CAS or the commit: the transaction rolled
        // back, so the key is released for the next call to run.
        let e = self.fail("complete")(failure);
        let e = match e {
            Error::Conflict { .. } => e,
            other => Error::unavailable(
                "commit",
                format!(
                    "the body's transaction could not commit ({other}); nothing was committed and \
                     the key was released. If the body caught a failed statement and returned Ok, \
                     return its error instead (an aborted transaction cannot commit)"
                ),
            )
            .with_source(other),
        };
        tracing::warn!(error = %e, "the body's transaction was rolled back; releasing the key");
        let _ = self.write(key, token, WriteKind::Release).await;
        slot.failed(e);
        Ok(WriteReply::Missing)
    }

    /// Reads the row as it is now (a fresh statement, so a fresh snapshot).
    async fn classify(
        &self,
        op: &'static str,
        key: &str,
        token: &[u8; 16],
        kind: i8,
        value: &[u8],
    ) -> Result<WriteState, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.classify)))
            .bind(key)
            .bind(kind)
            .bind(value)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail(op))?;
        read_write_row(row.as_ref(), token)
    }
}

impl PgStore {
    /// A `run_in_tx` claim completed outside its transaction: that
    /// transaction did not commit (or this would find the record
    /// completed), so its writes are gone: release instead.
    pub(crate) async fn resolve_in_tx(
        &self,
        key: &str,
        token: &[u8; 16],
        tag: i8,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.resolve_in_tx)))
            .bind(key)
            .bind(&token[..])
            .bind(tag)
            .bind(value)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail("complete"))?;
        if row_done(row.as_ref()) {
            tracing::warn!(
                "the body's transaction did not commit: nothing of it was kept; the key was released"
            );
            if let Some(slot) = tx::current() {
                slot.failed_if_unset(Error::LeaseLost);
            }
            return Ok(WriteReply::Missing);
        }
        match read_write_row(row.as_ref(), token)? {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }
}

async fn rollback(txn: Transaction<'static, Postgres>) {
    if let Err(e) = txn.rollback().await {
        // The connection is gone: the server rolls back on its own.
        tracing::debug!(error = %e, "rollback failed; the server aborts the transaction with the connection");
    }
}
