//! `PgStore` as an `idem_core::store::Store`: the claim and its race loop here,
//! the writes in `write.rs`, operators' reads in `operate.rs`.

use crate::claim_path::ClaimPath;
use crate::errors;
use crate::row::{ClaimRead, WriteState, corrupt, get, read_claim, read_insert};
use crate::store::PgStore;
use crate::time::{lease_ms, millis, ms_i64, record_ttl_ms};
use crate::tx;
use crate::write::{MAX_RACES, WriteKind};
use async_trait::async_trait;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, DurableStore, Finish, OperatorStore, ScanPage,
    StepRecord, StepStore, Store, Token, ValueKind, WriteReply,
};
use idem_core::{Error, RecordInfo};
use sqlx::{AssertSqlSafe, Row};
use std::sync::Arc;
use std::time::Duration;

#[async_trait]
impl Store for PgStore {
    fn name(&self) -> &'static str {
        "postgres"
    }

    async fn claim(&self, c: Claim<'_>) -> Result<ClaimReply, Error> {
        let reply = self.claim_row(&c).await?;
        if matches!(
            reply,
            ClaimReply::Acquired { .. } | ClaimReply::Completed(_)
        ) {
            self.check_durability(c.durability)?;
        }
        Ok(reply)
    }

    async fn complete(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
        if !c.outbox.is_empty() {
            return Err(Error::Unsupported {
                op: "complete with outbox messages",
            });
        }
        let reply = self.complete_row(c.key, c.token, c.kind, c.value).await?;
        if reply.is_done() {
            self.check_durability(c.durability)?;
        }
        Ok(reply)
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let token = *token.as_raw();
        match self.write(key, &token, WriteKind::Release).await? {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let token = *token.as_raw();
        let ms = ms_i64(lease_ms(lease));
        match self
            .write(key, &token, WriteKind::Extend { lease_ms: ms })
            .await?
        {
            WriteState::Reply(r) => Ok(r),
            WriteState::Ours | WriteState::TxBound => Ok(WriteReply::Missing),
        }
    }

    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        self.claim_many(claims).await
    }

    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        self.finish_many(ops).await
    }

    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::none()
            .steps(self)
            .operator(self)
            .durable(self)
    }
}

#[async_trait]
impl StepStore for PgStore {
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let token = *token.as_raw();
        // Kept as the JSON's text in a jsonb string, so its bytes come back
        // exactly (a jsonb value would be normalised).
        let value = std::str::from_utf8(value)
            .map_err(|_| Error::codec("a step value that is not UTF-8 JSON"))?;
        match self
            .write(key, &token, WriteKind::Step { name, value })
            .await?
        {
            WriteState::Reply(r) => Ok(r),
            // A `run_in_tx` claim: its steps are not recorded (no steps
            // inside a store transaction).
            WriteState::Ours | WriteState::TxBound => Err(Error::Unsupported {
                op: "save_step inside run_in_tx",
            }),
        }
    }

    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.steps)))
            .bind(key)
            .fetch_optional(&self.inner.pool)
            .await
            .map_err(self.fail("steps"))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let state: i8 = get(&row, "state")?;
        let owner: Option<Vec<u8>> = get(&row, "token")?;
        if state as u8 != b'P' || owner.as_deref() != Some(&token.as_raw()[..]) {
            return Ok(None);
        }
        let steps: Option<String> = get(&row, "steps")?;
        decode_steps(steps.as_deref()).map(Some)
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let done = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.suspend)))
            .bind(key)
            .bind(&token.as_raw()[..])
            .execute(&self.inner.pool)
            .await
            .map_err(self.fail("suspend"))?
            .rows_affected();
        if done > 0 {
            return Ok(WriteReply::Done);
        }
        // No steps (or not ours): a release deletes it, or says why not.
        self.release(key, token).await
    }
}

#[async_trait]
impl OperatorStore for PgStore {
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        self.inspect_row(key, with_value).await
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        self.forget_row(key, force).await
    }

    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let sql = &self.inner.sql;
        let fail = |e| errors::map_failures("count_failure", &sql.failures_table, e);
        let row = sqlx::query(AssertSqlSafe(Arc::clone(&sql.count_failure)))
            .bind(key)
            .bind(ms_i64(millis(ttl)))
            .fetch_one(&self.inner.pool)
            .await
            .map_err(fail)?;
        let count: i64 = row
            .try_get(0)
            .map_err(|e| corrupt(&format!("column failures: {e}")))?;
        u32::try_from(count).map_err(|_| {
            corrupt(&format!(
                "the failure count {count} in {} is out of range",
                sql.failures_table
            ))
        })
    }

    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        self.scan_page(prefix, cursor, count).await
    }
}

impl PgStore {
    /// The claim statement(s), and the race loop that retries them while
    /// the row changes under them.
    async fn claim_row(&self, c: &Claim<'_>) -> Result<ClaimReply, Error> {
        let token = *c.token.as_raw();
        let slot = tx::current();
        if let Some(slot) = &slot {
            slot.note_claim(token, c.key, &self.inner.outbox);
        }
        let lease = ms_i64(lease_ms(c.lease));
        let ttl = ms_i64(record_ttl_ms(c.ttl, c.lease));
        let fingerprint = c.fingerprint.map(|f| &f.as_bytes()[..]);
        // A `run_in_tx` claim runs on a connection of the caller's pool,
        // which the body's transaction then opens on (see `tx.rs`).
        let mut conn = match &slot {
            Some(slot) => match slot.claim_conn(&self.inner.pool).await {
                Some(conn) => Some(conn.map_err(self.fail("claim"))?),
                None => None,
            },
            None => None,
        };
        let mut path = match self.inner.sql.partitioned {
            false => self.inner.forecast.path(),
            true => ClaimPath::Combined,
        };
        for _ in 0..MAX_RACES {
            let sql = &self.inner.sql;
            let q = match path {
                ClaimPath::Insert => sqlx::query(AssertSqlSafe(Arc::clone(match slot {
                    Some(_) => &sql.claim_insert_tx,
                    None => &sql.claim_insert,
                })))
                .bind(c.key)
                .bind(&token[..])
                .bind(lease)
                .bind(ttl)
                .bind(fingerprint),
                ClaimPath::Read => {
                    sqlx::query(AssertSqlSafe(Arc::clone(&sql.claim_read))).bind(c.key)
                }
                ClaimPath::Combined => sqlx::query(AssertSqlSafe(Arc::clone(&sql.claim)))
                    .bind(c.key)
                    .bind(&token[..])
                    .bind(lease)
                    .bind(ttl)
                    .bind(fingerprint)
                    .bind(slot.is_some()),
            };
            let row = match conn.as_mut() {
                Some(conn) => q.fetch_optional(&mut **conn).await,
                None => q.fetch_optional(&self.inner.pool).await,
            }
            .map_err(self.fail("claim"))?;
            let read = match path {
                ClaimPath::Insert => read_insert(row.as_ref())?,
                _ => read_claim(row.as_ref(), c, &token)?,
            };
            // Whatever the first statement could not answer, the combined
            // one can.
            path = ClaimPath::Combined;
            if let ClaimRead::Reply(reply) = read {
                let won = matches!(reply, ClaimReply::Acquired { .. });
                self.inner.forecast.observe(!won);
                if let (true, Some(slot), Some(conn)) = (won, &slot, conn) {
                    slot.keep_conn(conn);
                }
                return Ok(reply);
            }
        }
        Err(errors::unavailable(
            "claim",
            "the record kept changing under this claim; retry",
        ))
    }

    /// The complete of `token`'s pending row: inside a `run_in_tx` call's
    /// own transaction when it is one.
    async fn complete_row(
        &self,
        key: &str,
        token: &Token,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let token = *token.as_raw();
        let tag = kind.tag() as i8;
        // A `run_in_tx` call's own complete: inside the body's transaction.
        if let Some(slot) = tx::current()
            && let Some(txn) = slot.take_tx(&token)
        {
            return self
                .complete_in_tx(&slot, txn, key, &token, tag, value)
                .await;
        }
        let first = self
            .write(key, &token, WriteKind::Complete { tag, value })
            .await;
        match first {
            Ok(WriteState::Reply(r)) => Ok(r),
            // A `run_in_tx` claim completed outside its transaction: that
            // transaction did not commit (or this would find the record
            // completed), so its writes are gone: release instead.
            Ok(WriteState::TxBound) => self.resolve_in_tx(key, &token, tag, value).await,
            Ok(WriteState::Ours) => Ok(WriteReply::Missing),
            Err(e) => Err(e),
        }
    }
}

#[async_trait]
impl DurableStore for PgStore {
    /// PostgreSQL's durability is the server's: a commit returns once it
    /// is as durable as `synchronous_commit` (with
    /// `synchronous_standby_names`) says, for every statement idem sends.
    /// There is nothing more a call could ask, so only `Async` is taken.
    fn check_durability(&self, durability: idem_core::Durability) -> Result<(), Error> {
        if durability.is_async() {
            return Ok(());
        }
        Err(Error::DurabilityUnsupported {
            reason: format!(
                "PgStore takes its durability from the server, not per call ({durability} was asked): \
                 set `synchronous_commit = remote_apply` (or `on` / `remote_write`) with \
                 `synchronous_standby_names` on the primary (docs/postgres.md, Durability), and use \
                 Durability::Async"
            ),
        })
    }

    /// Called only with a durability `check_durability` accepted:
    /// `Async`, which needs no wait.
    async fn confirm(&self, _key: &str, durability: idem_core::Durability) -> Result<(), Error> {
        self.check_durability(durability)
    }
}

/// One step as the `steps` column keeps it.
#[derive(serde::Deserialize)]
struct StoredStep {
    n: String,
    v: String,
}

/// The `steps` column's text: `[{"n": name, "v": value JSON}, …]` or NULL.
fn decode_steps(text: Option<&str>) -> Result<Vec<StepRecord>, Error> {
    let Some(text) = text else {
        return Ok(Vec::new());
    };
    let steps: Vec<StoredStep> = serde_json::from_str(text)
        .map_err(|e| corrupt(&format!("a steps column that is not a list of steps: {e}")))?;
    Ok(steps
        .into_iter()
        .map(|s| StepRecord {
            name: s.n,
            value: s.v.into_bytes().into(),
        })
        .collect())
}
