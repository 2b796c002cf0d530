//! The relay: drains the outbox table into a [`Sink`], at least once, in
//! order per key, with any number of relays running at once.
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
use idem_core::outbox::{OutboxMessage, RelayReport, SendPolicy, Sink, Waves, send_in_waves};
use sqlx::postgres::PgListener;
use sqlx::{AssertSqlSafe, Row};
use std::pin::pin;
use std::time::Duration;
use tokio::time::Instant;

/// Messages a pass takes by default.
const DEFAULT_BATCH: usize = 256;
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

/// Publishes an [`Outbox`] through a [`Sink`]. Cheap to share: run several
/// (in one process or many) for throughput or availability; they never send
/// one key's messages at once.
///
/// ```no_run
/// use idem_core::outbox::Sink;
/// use idem_postgres::{PgStore, outbox::Relay};
/// use std::time::Duration;
///
/// # async fn demo(store: PgStore, sink: impl Sink + 'static) {
/// let relay = Relay::new(&store, sink)
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
pub struct Relay<S> {
    outbox: Outbox,
    sink: S,
    batch: usize,
    poll: Duration,
    policy: SendPolicy,
    scan: std::sync::Mutex<Scan>,
}

impl<S> std::fmt::Debug for Relay<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("table", &self.outbox.sql.table)
            .field("batch", &self.batch)
            .field("poll", &self.poll)
            .field("send_timeout", &self.policy.send_timeout)
            .finish_non_exhaustive()
    }
}

/// A row the relay read: its `seq` and the message it sends.
fn owned_row(r: &sqlx::postgres::PgRow) -> Result<(i64, OutboxMessage), sqlx::Error> {
    let attempts: i32 = r.try_get("attempts")?;
    let payload: Vec<u8> = r.try_get("payload")?;
    let message = OutboxMessage {
        id: r.try_get("id")?,
        topic: r.try_get("topic")?,
        key: r.try_get("msg_key")?,
        payload: payload.into(),
        attempts: u32::try_from(attempts).unwrap_or(0),
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

impl<S: Sink> Relay<S> {
    /// A relay of `outbox` (a [`PgStore`](crate::PgStore)'s, a pool's
    /// default table, or an [`Outbox::new`]) into `sink`, with 256 messages a pass, a 5 s poll
    /// behind `LISTEN`, a 30 s send timeout and retries backing off from
    /// 200 ms to 30 s.
    ///
    /// ```no_run
    /// # fn demo(store: idem_postgres::PgStore, sink: impl idem_core::outbox::Sink) {
    /// let relay = idem_postgres::outbox::Relay::new(&store, sink);
    /// # }
    /// ```
    pub fn new(outbox: impl Into<Outbox>, sink: S) -> Relay<S> {
        Relay {
            outbox: outbox.into(),
            sink,
            batch: DEFAULT_BATCH,
            poll: Duration::from_secs(5),
            policy: SendPolicy::default(),
            scan: std::sync::Mutex::new(Scan {
                from: 0,
                rescanned: Instant::now(),
                every: RESCAN,
            }),
        }
    }

    /// Messages a pass takes (1 to 10,000; default 256).
    ///
    /// ```no_run
    /// # fn demo(r: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.batch_size(1000);
    /// # }
    /// ```
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch = n.clamp(1, 10_000);
        self
    }

    /// How long the relay sleeps without a notification before looking
    /// anyway (default 5 s): the insurance behind `LISTEN`/`NOTIFY`, which
    /// loses notifications while its connection is down.
    ///
    /// ```no_run
    /// # fn demo(r: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.poll_interval(std::time::Duration::from_secs(1));
    /// # }
    /// ```
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(10));
        self
    }

    /// How long one wave of sends may wait for the broker's confirmations
    /// (default 30 s); unconfirmed messages are retried (the broker may have
    /// them: their ids make the copies harmless).
    ///
    /// ```no_run
    /// # fn demo(r: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.send_timeout(std::time::Duration::from_secs(5));
    /// # }
    /// ```
    pub fn send_timeout(mut self, limit: Duration) -> Self {
        self.policy.send_timeout = limit.max(Duration::from_millis(1));
        self
    }

    /// The retry delay after a failed send: `first`, doubling per attempt up
    /// to `max` (default 200 ms to 30 s). The key's later messages wait.
    ///
    /// ```no_run
    /// # use std::time::Duration;
    /// # fn demo(r: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let r = r.retry_backoff(Duration::from_millis(50), Duration::from_secs(5));
    /// # }
    /// ```
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.policy.first_backoff = first;
        self.policy.max_backoff = max.max(first);
        self
    }

    /// The `seq` this pass scans after: where the last pass began, or the
    /// table's start once per [`RESCAN`].
    /// Also says whether this pass rescans.
    fn scan_from(&self) -> (i64, bool) {
        let mut scan = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        if scan.rescanned.elapsed() >= scan.every {
            scan.rescanned = Instant::now();
            scan.from = 0;
            return (0, true);
        }
        (scan.from, false)
    }

    /// One pass: sends up to a batch of waiting messages and writes back the
    /// outcome. Fails with [`Error::Unavailable`] when PostgreSQL cannot be
    /// reached (nothing is lost: the rows stay); sink failures are not
    /// errors, they are counted in the report.
    ///
    /// ```no_run
    /// # async fn demo(relay: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) -> Result<(), idem_core::Error> {
    /// // Drain everything (a test, a one-shot job):
    /// while relay.drain_once().await?.sent > 0 {}
    /// # Ok(()) }
    /// ```
    pub async fn drain_once(&self) -> Result<RelayReport, Error> {
        let sql = &self.outbox.sql;
        let fail = self.outbox.fail("outbox relay");
        let mut tx = self.outbox.pool.begin_with(PASS).await.map_err(&fail)?;
        let limit = i64::try_from(self.batch).unwrap_or(i64::MAX);
        let (from, rescan) = self.scan_from();
        let started = Instant::now();
        let heads = sqlx::query(AssertSqlSafe(sql.heads.as_str()))
            .bind(from)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await
            .map_err(&fail)?;
        if rescan {
            let took = started.elapsed().saturating_mul(10);
            self.scan.lock().unwrap_or_else(|p| p.into_inner()).every =
                took.clamp(RESCAN, Duration::from_secs(60));
        }
        if let Some(first) = heads.first() {
            // Everything before this pass's first head was sent, or waits
            // (blocked, backing off, another relay's): the next passes start
            // here, and a rescan from the start picks the waiting ones up.
            let seq: i64 = first.try_get("seq").map_err(&fail)?;
            self.scan.lock().unwrap_or_else(|p| p.into_inner()).from = seq - 1;
        }
        if heads.is_empty() {
            tx.rollback().await.map_err(&fail)?;
            return Ok(RelayReport::default());
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
        let room = self.batch.saturating_sub(owned.len());
        if !longer.is_empty() && room > 0 {
            let seen: Vec<i64> = owned.iter().map(|o| o.0).collect();
            let rows = sqlx::query(AssertSqlSafe(sql.batch.as_str()))
                .bind(&longer)
                .bind(&seen)
                .bind(i64::try_from(room).unwrap_or(i64::MAX))
                .fetch_all(&mut *tx)
                .await
                .map_err(&fail)?;
            for r in &rows {
                owned.push(owned_row(r).map_err(&fail)?);
            }
            owned.sort_by_key(|o| o.0);
        }
        let Waves {
            sent,
            failed,
            report,
        } = send_in_waves(&self.sink, &self.policy, owned).await;
        let mut failures = Failures::default();
        for f in failed {
            failures.seq.push(f.at);
            failures.reason.push(f.error.to_string());
            failures.park.push(f.park);
            failures
                .retry_ms
                .push(i64::try_from(f.retry_in.as_millis()).unwrap_or(i64::MAX));
        }
        if !sent.is_empty() {
            sqlx::query(AssertSqlSafe(sql.delete.as_str()))
                .bind(&sent)
                .execute(&mut *tx)
                .await
                .map_err(&fail)?;
        }
        if !failures.seq.is_empty() {
            sqlx::query(AssertSqlSafe(sql.failed.as_str()))
                .bind(&failures.seq)
                .bind(&failures.reason)
                .bind(&failures.park)
                .bind(&failures.retry_ms)
                .execute(&mut *tx)
                .await
                .map_err(&fail)?;
        }
        // Failing here after the broker confirmed: the rows stay and are
        // sent again, with the same ids.
        tx.commit().await.map_err(|e| {
            let e = errors::map("outbox relay commit", &sql.table, e);
            tracing::warn!(error = %e, sent = report.sent, "the relay could not record what the broker confirmed; those messages will be sent again (same ids)");
            e
        })?;
        Ok(report)
    }

    /// Runs passes until `shutdown` completes: at once while there is work,
    /// else when an insert notifies, a retry falls due or the poll interval
    /// ends. A pass under way when `shutdown` completes finishes first (it
    /// is bounded by the send timeout), so nothing is sent twice because of
    /// the stop. PostgreSQL or the broker being down is logged and retried,
    /// never returned: the relay outlives outages.
    ///
    /// ```no_run
    /// # async fn demo(relay: idem_postgres::outbox::Relay<std::sync::Arc<dyn idem_core::outbox::Sink>>) {
    /// let (_stop, stopped) = tokio::sync::oneshot::channel::<()>(); // send on `_stop` at shutdown
    /// let report = relay.run(async { let _ = stopped.await; }).await;
    /// # }
    /// ```
    pub async fn run(&self, shutdown: impl Future<Output = ()>) -> RelayReport {
        let mut shutdown = pin!(shutdown);
        let mut listener: Option<PgListener> = None;
        let mut totals = RelayReport::default();
        let mut next_retry: Option<Instant> = None;
        let mut outages = 0u32;
        // Whether this relay asked inserts to notify (`<table>_outbox_wake`):
        // only while it sleeps, since notifying commits run one at a time.
        let mut idle = false;
        tracing::info!(table = %self.outbox.sql.table, sink = %self.sink.describe(), "outbox relay started");
        loop {
            if listener.is_none() {
                listener = self.listen().await;
            }
            // Notifications that arrived during the last pass are covered
            // by the next one.
            if let Some(l) = listener.as_mut() {
                while l.next_buffered().is_some() {}
            }
            let now = Instant::now();
            if next_retry.is_some_and(|at| at <= now) {
                next_retry = None;
            }
            let wait = match self.drain_once().await {
                Ok(pass) => {
                    outages = 0;
                    totals.add(pass);
                    if let Some(d) = pass.retry_in {
                        let at = now + d;
                        next_retry = Some(next_retry.map_or(at, |n| n.min(at)));
                    }
                    if pass.handled() > 0 {
                        // Busy: straight to the next pass, and no wake-ups
                        // needed meanwhile.
                        if idle {
                            idle = !self.set_idle(false).await;
                        }
                        Duration::ZERO
                    } else if !idle && listener.is_some() {
                        // About to sleep: inserts notify from now on; one
                        // more pass covers a row committed before that.
                        idle = self.set_idle(true).await;
                        Duration::ZERO
                    } else {
                        next_retry.map_or(self.poll, |at| {
                            at.saturating_duration_since(now).min(self.poll)
                        })
                    }
                }
                Err(e) => {
                    outages = outages.saturating_add(1);
                    let wait = self.policy.backoff(outages);
                    tracing::warn!(error = %e, retry_in = ?wait, "outbox relay pass failed; nothing is lost, retrying");
                    wait
                }
            };
            tokio::select! {
                biased;
                () = &mut shutdown => break,
                () = tokio::time::sleep(wait) => {}
                woke = notified(&mut listener) => {
                    if let Err(e) = woke {
                        tracing::debug!(error = %e, "outbox LISTEN connection lost; polling until it is back");
                        listener = None;
                    }
                }
            }
        }
        // Sleeping peers are woken by inserts again.
        if !idle {
            self.set_idle(true).await;
        }
        tracing::info!(
            sent = totals.sent,
            parked = totals.parked,
            failed = totals.failed,
            "outbox relay stopped"
        );
        totals
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

    async fn listen(&self) -> Option<PgListener> {
        let listen = async {
            let mut l = PgListener::connect_with(&self.outbox.pool).await?;
            l.listen(&self.outbox.sql.channel).await?;
            Ok::<_, sqlx::Error>(l)
        };
        match listen.await {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!(error = %e, "outbox relay cannot LISTEN; polling every {:?}", self.poll);
                None
            }
        }
    }
}

/// The next notification, or never without a listener.
async fn notified(listener: &mut Option<PgListener>) -> Result<(), sqlx::Error> {
    match listener {
        Some(l) => l.recv().await.map(|_| ()),
        None => std::future::pending().await,
    }
}
