//! Batches on PostgreSQL (`Store::claim_batch`, `Store::finish_batch`):
//! one statement per wave of distinct keys (`idem_core::store::in_waves`),
//! its arrays `unnest`ed into one row per key. Each key runs exactly the
//! single call's statement logic (`sql.rs`); an item the batch statement
//! cannot answer (a race, a refused write whose reason must be read) goes
//! through the single call, which answers it as it always does.
//!
//! Inside `run_in_tx` a batch runs the single calls: that claim and
//! complete belong to the body's transaction (`tx.rs`).

use crate::row::{ClaimRead, read_claim};
use crate::store::PgStore;
use crate::time::{lease_ms, ms_i64, record_ttl_ms};
use crate::tx;
use idem_core::Error;
use idem_core::store::{Claim, ClaimReply, Finish, Store, WriteReply, in_waves};
use sqlx::{AssertSqlSafe, Row};
use std::collections::HashSet;
use std::sync::Arc;

impl PgStore {
    /// `Store::claim_batch`.
    pub(crate) async fn claim_many(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        if tx::current().is_some() {
            return self.claim_each(claims.iter()).await;
        }
        in_waves(
            claims,
            |c| c.key,
            |batch| async move { self.claim_wave(&batch).await },
            || lost("claim"),
        )
        .await
    }

    /// The claims of one wave (distinct keys) as one statement.
    async fn claim_wave(&self, claims: &[&Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        let keys: Vec<&str> = claims.iter().map(|c| c.key).collect();
        let tokens: Vec<&[u8]> = claims.iter().map(|c| &c.token.as_raw()[..]).collect();
        let leases: Vec<i64> = claims.iter().map(|c| ms_i64(lease_ms(c.lease))).collect();
        let ttls: Vec<i64> = claims
            .iter()
            .map(|c| ms_i64(record_ttl_ms(c.ttl, c.lease)))
            .collect();
        let fps: Vec<Option<&[u8]>> = claims
            .iter()
            .map(|c| c.fingerprint.map(|f| &f.as_bytes()[..]))
            .collect();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.claim_batch)))
            .bind(keys)
            .bind(tokens)
            .bind(leases)
            .bind(ttls)
            .bind(fps)
            .fetch_all(&self.inner.pool)
            .await;
        let rows = match rows {
            Ok(rows) if rows.len() == claims.len() => rows,
            // The statement failed (each item then gets its own error from
            // its single call) or the table changed under it.
            other => {
                if let Err(e) = other {
                    tracing::warn!(error = %e, "a batch's claim statement failed; claiming its keys one by one");
                }
                return self.claim_each(claims.iter().copied()).await;
            }
        };
        let mut out = Vec::with_capacity(claims.len());
        for (claim, row) in claims.iter().zip(&rows) {
            let token = *claim.token.as_raw();
            out.push(match read_claim(Some(row), claim, &token) {
                Ok(ClaimRead::Reply(reply)) => {
                    let won = matches!(reply, ClaimReply::Acquired { .. });
                    self.inner.forecast.observe(!won);
                    Ok(reply)
                }
                Ok(ClaimRead::Race) => self.claim(**claim).await,
                Err(e) => Err(e),
            });
        }
        out
    }

    /// Claims one at a time, as the default `claim_batch` does.
    async fn claim_each<'c, 'a: 'c>(
        &self,
        claims: impl Iterator<Item = &'c Claim<'a>>,
    ) -> Vec<Result<ClaimReply, Error>> {
        let mut out = Vec::new();
        for claim in claims {
            out.push(self.claim(*claim).await);
        }
        out
    }

    /// `Store::finish_batch`.
    pub(crate) async fn finish_many(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        // A complete with outbox messages or a durability is refused by the
        // single call (this store has neither): such a batch is answered as
        // single calls in its order would be.
        let special = ops.iter().any(|op| {
            matches!(op, Finish::Complete(c) if !c.outbox.is_empty() || !c.durability.is_async())
        });
        let in_tx = special || tx::current().is_some();
        in_waves(
            ops,
            Finish::key,
            |batch| async move {
                let done = if in_tx {
                    HashSet::new()
                } else {
                    self.finish_wave(&batch).await
                };
                let mut out = Vec::with_capacity(batch.len());
                for op in batch {
                    out.push(if done.contains(op.key()) {
                        Ok(WriteReply::Done)
                    } else {
                        op.run_on(self).await
                    });
                }
                out
            },
            || lost("complete"),
        )
        .await
    }

    /// The completes and releases of one wave (distinct keys) as one
    /// statement: the keys it wrote. A failed statement wrote nothing, so
    /// every item goes through its single call (and gets its own error).
    async fn finish_wave<'k>(&self, ops: &[&Finish<'k>]) -> HashSet<&'k str> {
        let keys: Vec<&str> = ops.iter().map(|op| op.key()).collect();
        let tokens: Vec<&[u8]> = ops.iter().map(|op| &op.token().as_raw()[..]).collect();
        // A release is a row without a state.
        let (states, values): (Vec<Option<i8>>, Vec<Option<&[u8]>>) = ops
            .iter()
            .map(|op| match **op {
                Finish::Complete(c) => (Some(c.kind.tag() as i8), Some(c.value)),
                Finish::Release { .. } => (None, None),
            })
            .unzip();
        let rows = sqlx::query(AssertSqlSafe(Arc::clone(&self.inner.sql.finish_batch)))
            .bind(keys)
            .bind(tokens)
            .bind(states)
            .bind(values)
            .fetch_all(&self.inner.pool)
            .await;
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                tracing::warn!(error = %e, "a batch's write statement failed; writing its keys one by one");
                return HashSet::new();
            }
        };
        let written: HashSet<String> = rows
            .iter()
            .filter_map(|row| row.try_get::<String, _>(0).ok())
            .collect();
        ops.iter()
            .map(|op| op.key())
            .filter(|key| written.contains(*key))
            .collect()
    }
}

/// A batch item left without a reply: cannot happen (every wave answers
/// each of its items); an error rather than a panic all the same.
fn lost(op: &'static str) -> Error {
    crate::errors::unavailable(op, "the batch lost an item's reply; retry it")
}
