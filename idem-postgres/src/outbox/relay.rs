//! [`PgRelay`]: the relay ([`OutboxRelay`]) over the outbox table: at least
//! once, in order per key, with any number of relays running at once.
//!
//! One pass is one transaction: lock the heads of the oldest waiting keys
//! (skipping keys another relay holds), read those keys' rows, send them in
//! waves (a wave holds at most one message per key, so a key's next message
//! goes only after the previous one was confirmed), then delete what the
//! broker confirmed and mark what failed, and commit. A relay killed
//! mid-pass leaves its rows in place, unlocked by the aborted transaction:
//! the next pass re-sends them with the same ids.

use super::Outbox;
use crate::errors;
use idem_core::Error;
use idem_core::outbox::{Failed, OutboxMessage, OutboxRelay, RelayReport, RelaySource};
use sqlx::postgres::PgListener;
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};
use std::fmt;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;
/// How often (at least) a pass scans the table from its start rather than
/// from where the previous pass began: the deleted rows at the table's old end cost a
/// scan one visit each until vacuum removes them (longer while any long
/// transaction runs in the database), and only a row that was blocked,
/// backing off, held by another relay or committed late waits there.
const RESCAN: Duration = Duration::from_secs(1);

/// How a pass's transaction begins. It commits asynchronously: a commit
/// lost in a server crash brings its deleted rows back, which are sent again
/// under the same ids, as after a relay crash.
///
/// No sequential scans: every statement of a pass has an index to probe
/// (the primary key, `(msg_key, seq)`). Under churn the outbox is analyzed
/// while nearly empty, so the planner believes it holds a handful of rows
/// and checked "no older row of this key" by reading the whole table once
/// per candidate row: with hundreds of thousands of dead rows that scan ran
/// CPU-bound for minutes and stalled the relay (auto_explain caught the
/// plan: a nested-loop anti join over `Seq Scan … rows=8`; the statements
/// themselves are shaped against it too, table.rs). And as a last bound, no
/// statement runs longer than 20 s: cancelled, the pass fails and the next
/// one goes on.
const PASS: &str = "BEGIN; SET LOCAL synchronous_commit = off; SET LOCAL enable_seqscan = off; \
                    SET LOCAL statement_timeout = '20s'";

/// Where the next pass starts scanning.
struct Scan {
    from: i64,
    rescanned: Instant,
    /// Until the next rescan: [`RESCAN`], or ten times what the last one
    /// took when the dead rows make it slow (the relay then mostly sends
    /// instead of scanning), at most a minute.
    every: Duration,
}

/// Publishes an [`Outbox`] through a [`Sink`](idem_core::outbox::Sink): the
/// relay over a [`PgSource`]. Cheap to share: run several (in one process
/// or many) for throughput or availability; they never send one key's
/// messages at once. Inserts wake a sleeping relay (`LISTEN`/`NOTIFY`);
/// its poll (default 5 s) is the insurance.
///
/// ```no_run
/// use idem_core::outbox::Sink;
/// use idem_postgres::{PgStore, outbox::PgRelay};
/// use std::time::Duration;
///
/// # async fn demo(store: PgStore, sink: impl Sink + 'static) {
/// let relay = PgRelay::new(&store, sink)
///     .batch_size(500)
///     .poll_interval(Duration::from_secs(10))
///     .send_timeout(Duration::from_secs(15));
/// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
/// let running = tokio::spawn(async move { relay.run(async { let _ = stopped.await; }).await });
/// // … at shutdown: the pass under way finishes, then `run` returns.
/// let _ = stop.send(());
/// let report = running.await.unwrap();
/// # }
/// ```
pub type PgRelay<K> = OutboxRelay<PgSource, K>;

/// [`PgRelay`]'s name before the relay was one for every store; the same
/// type (`Relay::new(&store, sink)` still works).
///
/// ```no_run
/// # fn demo(store: idem_postgres::PgStore, sink: impl idem_core::outbox::Sink) {
/// let relay: idem_postgres::outbox::Relay<_> = idem_postgres::outbox::PgRelay::new(&store, sink);
/// # }
/// ```
pub type Relay<K> = PgRelay<K>;

/// The outbox table as a relay drains it: one shard, shared with other
/// relays key by key through row locks (`FOR UPDATE SKIP LOCKED`), and
/// where this relay's next pass starts scanning. Made from a
/// [`PgStore`](crate::PgStore), a pool (the default table) or an [`Outbox`] by
/// [`PgRelay::new`]; one a relay.
///
/// ```no_run
/// # fn demo(store: idem_postgres::PgStore) {
/// let source = idem_postgres::outbox::PgSource::from(&store);
/// # }
/// ```
pub struct PgSource {
    outbox: Outbox,
    scan: Mutex<Scan>,
}

/// A pass's transaction: the rows it read stay locked until it ends.
pub struct PgHold(Transaction<'static, Postgres>);

/// A `run`'s wake-ups: the `LISTEN` connection, and whether this relay
/// asked inserts to notify (`<table>_outbox_wake`) — only while it sleeps,
/// since notifying commits run one at a time.
pub struct PgWake {
    listener: Option<PgListener>,
    idle: bool,
}

/// From a [`PgStore`](crate::PgStore) (its outbox), a pool (the default
/// table's) or an [`Outbox`].
impl<O: Into<Outbox>> From<O> for PgSource {
    fn from(outbox: O) -> PgSource {
        PgSource {
            outbox: outbox.into(),
            scan: Mutex::new(Scan {
                from: 0,
                rescanned: Instant::now(),
                every: RESCAN,
            }),
        }
    }
}

impl fmt::Debug for PgSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSource")
            .field("table", &self.outbox.sql.table)
            .finish_non_exhaustive()
    }
}

/// A row the relay read: its `seq` and the message it sends. A row
/// without `headers` (NULL: untraced, or written before the column
/// existed) is a message without headers; one whose `headers` is not an
/// object of strings (written by hand) is sent without headers, with a
/// warning, rather than parked: they carry the trace context, and a lost
/// trace link is better than a deliverable message held back for an
/// operator.
fn owned_row(r: &sqlx::postgres::PgRow) -> Result<(i64, OutboxMessage), sqlx::Error> {
    let attempts: i32 = r.try_get("attempts")?;
    let payload: Vec<u8> = r.try_get("payload")?;
    let headers: Option<String> = r.try_get("headers")?;
    let message = OutboxMessage::new(
        r.try_get::<String, _>("id")?,
        r.try_get::<String, _>("topic")?,
        r.try_get::<String, _>("msg_key")?,
        payload,
    )
    .with_attempts(u32::try_from(attempts).unwrap_or(0));
    let message = match headers.as_deref().map(super::headers::decode) {
        None => message,
        Some(Ok(headers)) => message.with_headers(headers),
        Some(Err(why)) => {
            tracing::warn!(
                id = %message.id,
                reason = %why,
                "outbox row's `headers` is not an object of strings: sending the message without headers"
            );
            message
        }
    };
    Ok((r.try_get("seq")?, message))
}

/// What a pass writes back for a failed send.
#[derive(Default)]
struct Failures {
    seq: Vec<i64>,
    reason: Vec<String>,
    park: Vec<bool>,
    retry_ms: Vec<i64>,
}

impl RelaySource for PgSource {
    /// The table's name.
    type Shard = String;
    type Hold = PgHold;
    type At = i64;
    type Wake = PgWake;

    const POLL: Duration = Duration::from_secs(5);
    const MIN_POLL: Duration = Duration::from_millis(10);

    async fn shards(&self) -> Result<Vec<String>, Error> {
        Ok(vec![self.outbox.sql.table.clone()])
    }

    /// Begins the pass's transaction: its reads lock the rows they take.
    async fn lock(&self, _: &String, _batch: usize) -> Result<Option<PgHold>, Error> {
        let tx = self
            .outbox
            .pool
            .begin_with(PASS)
            .await
            .map_err(self.outbox.fail("outbox relay"))?;
        Ok(Some(PgHold(tx)))
    }

    /// Locks the heads of the oldest waiting keys (skipping keys another
    /// relay holds), then reads those keys' later rows.
    async fn read(
        &self,
        _: &String,
        hold: &mut PgHold,
        batch: usize,
    ) -> Result<Vec<(i64, OutboxMessage)>, Error> {
        let sql = &self.outbox.sql;
        let fail = self.outbox.fail("outbox relay");
        let tx = &mut hold.0;
        let limit = i64::try_from(batch).unwrap_or(i64::MAX);
        let (from, rescan) = self.scan_from();
        let started = Instant::now();
        let heads = sqlx::query(AssertSqlSafe(sql.heads.as_str()))
            .bind(from)
            .bind(limit)
            .fetch_all(&mut **tx)
            .await
            .map_err(&fail)?;
        if rescan {
            let took = started.elapsed().saturating_mul(10);
            locked(&self.scan).every = took.clamp(RESCAN, Duration::from_secs(60));
        }
        if let Some(first) = heads.first() {
            // Everything before this pass's first head was sent, or waits
            // (blocked, backing off, another relay's): the next passes start
            // here, and a rescan from the start picks the waiting ones up.
            let seq: i64 = first.try_get("seq").map_err(&fail)?;
            locked(&self.scan).from = seq - 1;
        }
        let mut owned = Vec::with_capacity(heads.len());
        let mut longer = Vec::new();
        for r in &heads {
            let row = owned_row(r).map_err(&fail)?;
            if r.try_get::<bool, _>("more").map_err(&fail)? {
                longer.push(row.1.key.clone());
            }
            owned.push(row);
        }
        // Keys with later rows (the common case of distinct keys has none):
        // their next messages go in later waves of this pass.
        let room = batch.saturating_sub(owned.len());
        if !longer.is_empty() && room > 0 {
            let seen: Vec<i64> = owned.iter().map(|o| o.0).collect();
            let rows = sqlx::query(AssertSqlSafe(sql.batch.as_str()))
                .bind(&longer)
                .bind(&seen)
                .bind(i64::try_from(room).unwrap_or(i64::MAX))
                .fetch_all(&mut **tx)
                .await
                .map_err(&fail)?;
            for r in &rows {
                owned.push(owned_row(r).map_err(&fail)?);
            }
            owned.sort_by_key(|o| o.0);
        }
        Ok(owned)
    }

    async fn delete(&self, _: &String, hold: &mut PgHold, sent: &[i64]) -> Result<(), Error> {
        sqlx::query(AssertSqlSafe(self.outbox.sql.delete.as_str()))
            .bind(sent)
            .execute(&mut *hold.0)
            .await
            .map_err(self.outbox.fail("outbox relay"))?;
        Ok(())
    }

    /// Parks the refused rows and sets the others' attempts and retry
    /// time, in one statement.
    async fn park(
        &self,
        _: &String,
        hold: &mut PgHold,
        failed: Vec<Failed<i64>>,
    ) -> Result<(), Error> {
        let mut failures = Failures::default();
        for f in failed {
            failures.seq.push(f.at);
            failures.reason.push(f.error.to_string());
            failures.park.push(f.park);
            failures
                .retry_ms
                .push(i64::try_from(f.retry_in.as_millis()).unwrap_or(i64::MAX));
        }
        sqlx::query(AssertSqlSafe(self.outbox.sql.failed.as_str()))
            .bind(&failures.seq)
            .bind(&failures.reason)
            .bind(&failures.park)
            .bind(&failures.retry_ms)
            .execute(&mut *hold.0)
            .await
            .map_err(self.outbox.fail("outbox relay"))?;
        Ok(())
    }

    /// Commits the pass (a pass that found nothing rolls back).
    async fn commit(&self, _: &String, hold: PgHold, report: &RelayReport) -> Result<(), Error> {
        let sql = &self.outbox.sql;
        if report.handled() == 0 {
            return hold
                .0
                .rollback()
                .await
                .map_err(self.outbox.fail("outbox relay"));
        }
        // Failing here after the broker confirmed: the rows stay and are
        // sent again, with the same ids.
        hold.0.commit().await.map_err(|e| {
            let e = errors::map("outbox relay commit", &sql.table, e);
            tracing::warn!(error = %e, sent = report.sent, "the relay could not record what the broker confirmed; those messages will be sent again (same ids)");
            e
        })
    }

    fn start(&self, sink: &str) -> PgWake {
        tracing::info!(table = %self.outbox.sql.table, sink = %sink, "outbox relay started");
        PgWake {
            listener: None,
            idle: false,
        }
    }

    /// (Re)connects the `LISTEN`; drops the notifications that arrived
    /// during the last pass: the coming one covers them.
    async fn listen(&self, wake: &mut PgWake) {
        if wake.listener.is_none() {
            wake.listener = self.connect_listener().await;
        }
        if let Some(l) = wake.listener.as_mut() {
            while l.next_buffered().is_some() {}
        }
    }

    /// Busy (the pass handled anything): straight to the next pass, and no
    /// wake-ups needed meanwhile. About to sleep: inserts notify from now
    /// on, and one more pass covers a row committed before that.
    async fn rest(&self, wake: &mut PgWake, pass: &RelayReport) -> bool {
        if pass.handled() > 0 {
            if wake.idle {
                wake.idle = !self.set_idle(false).await;
            }
            true
        } else if !wake.idle && wake.listener.is_some() {
            wake.idle = self.set_idle(true).await;
            true
        } else {
            false
        }
    }

    /// The next notification; never without a listener (one lost is
    /// dropped: the poll covers the time until it is back).
    async fn woken(&self, wake: &mut PgWake) {
        let Some(l) = wake.listener.as_mut() else {
            return std::future::pending().await;
        };
        if let Err(e) = l.recv().await {
            tracing::debug!(error = %e, "outbox LISTEN connection lost; polling until it is back");
            wake.listener = None;
        }
    }

    /// Sleeping peers are woken by inserts again.
    async fn stop(&self, wake: PgWake) {
        if !wake.idle {
            self.set_idle(true).await;
        }
    }
}

impl PgSource {
    /// The `seq` this pass scans after: where the last pass began, or the
    /// table's start once per [`RESCAN`].
    /// Also says whether this pass rescans.
    fn scan_from(&self) -> (i64, bool) {
        let mut scan = locked(&self.scan);
        if scan.rescanned.elapsed() >= scan.every {
            scan.rescanned = Instant::now();
            scan.from = 0;
            return (0, true);
        }
        (scan.from, false)
    }

    /// Sets whether inserts notify; `true` when it was written.
    async fn set_idle(&self, idle: bool) -> bool {
        match sqlx::query(AssertSqlSafe(self.outbox.sql.idle.as_str()))
            .bind(idle)
            .execute(&self.outbox.pool)
            .await
        {
            Ok(_) => true,
            Err(e) => {
                tracing::debug!(error = %e, idle, "outbox relay could not record whether it sleeps; the poll covers it");
                false
            }
        }
    }

    async fn connect_listener(&self) -> Option<PgListener> {
        let listen = async {
            let mut l = PgListener::connect_with(&self.outbox.pool).await?;
            l.listen(&self.outbox.sql.channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match listen.await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!(error = %e, "outbox relay cannot LISTEN; polling");
                None
            }
        }
    }
}

/// The relay's own state, whatever a panicking holder left in it.
fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
