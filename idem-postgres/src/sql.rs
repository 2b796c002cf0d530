//! The statements, rendered once per table.
//!
//! Time is always `clock_timestamp()`, read once per statement (in `c`)
//! where several columns must agree on it: the database's clock, never the
//! client's, and not `now()`, which a transaction freezes at its start.
//! Durations travel to the server as milliseconds; the claim's time left
//! comes back as intervals.
//!
//! The claim is one statement: it reads the row and, only when the read
//! shows a record it may take, calls the table's claim function to write
//! (`schema.rs`). When the store's recent claims were one-sided, a bare
//! insert or a bare read goes first (`claim_path.rs`). The other writes are
//! plain statements whose affected-row count is the answer on the common
//! path; a refused one is followed by `classify`. Either read runs on a
//! snapshot that under READ COMMITTED may predate the row version the write
//! was refused on; so the caller trusts it only for answers that need no
//! write (in progress, completed, another owner, missing) and runs the write
//! again when the read says it should have happened.

use crate::config::Partitioning;
use crate::config::TableName;
use crate::schema::{CLAIM_FN, COMPLETE_IN_TX_FN, FAILURES_TABLE};
use std::sync::Arc;

/// `$n` milliseconds as an interval.
macro_rules! ms {
    ($n:literal) => {
        concat!("($", $n, "::bigint * interval '1 millisecond')")
    };
}

/// The claim statement's columns: position (read by position, which costs
/// the client no name lookups on the hottest path) and name (for errors).
/// The order is the `SELECT` list's in [`Statements::new`].
pub(crate) mod claim_col {
    pub(crate) type Col = (usize, &'static str);
    pub(crate) const WON: Col = (0, "won");
    pub(crate) const ATTEMPT: Col = (1, "attempt");
    pub(crate) const STATE: Col = (2, "state");
    pub(crate) const TOKEN: Col = (3, "token");
    pub(crate) const FINGERPRINT: Col = (4, "fingerprint");
    pub(crate) const VALUE: Col = (5, "value");
    /// The lease and the record's time left, as intervals (the difference
    /// of two database timestamps: no numeric arithmetic on the server).
    pub(crate) const LEASE_LEFT: Col = (6, "lease_left");
    pub(crate) const TTL_LEFT: Col = (7, "ttl_left");
    /// The bare insert's one column: the attempt it won.
    pub(crate) const INSERTED: Col = (0, "attempt");
}

/// The columns every operator read selects, with `c.now` the statement's
/// clock and `$with_value` whether the value itself travels.
pub(crate) fn info_columns(with_value: &str) -> String {
    format!(
        "r.key, r.state, r.attempt, r.token, r.fingerprint, \
         (SELECT array_agg(e->>'n') FROM jsonb_array_elements(r.steps) e) AS step_names, \
         CASE WHEN {with_value} THEN r.value END AS value, \
         octet_length(r.value)::bigint AS value_size, \
         ceil(extract(epoch FROM r.lease_until - c.now) * 1000)::bigint AS lease_ms, \
         ceil(extract(epoch FROM r.expires_at - c.now) * 1000)::bigint AS ttl_ms"
    )
}

/// The rendered statements of one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: Arc<str>,
    pub claim_insert: Arc<str>,
    pub claim_insert_tx: Arc<str>,
    pub claim_read: Arc<str>,
    /// The combined claim of a batch of distinct keys (`batch.rs`).
    pub claim_batch: Arc<str>,
    /// The completes and releases of a batch of distinct keys.
    pub finish_batch: Arc<str>,
    pub complete: Arc<str>,
    /// `Store::save_step`: append a step to the owner's pending row.
    pub save_step: Arc<str>,
    /// `Store::steps`: the row's owner and steps.
    pub steps: Arc<str>,
    /// `Store::suspend` of a row with steps: its lease ends now.
    pub suspend: Arc<str>,
    /// The quoted name of the `run_in_tx` completion function.
    complete_in_tx: String,
    pub resolve_in_tx: Arc<str>,
    pub release: Arc<str>,
    pub extend: Arc<str>,
    pub classify: Arc<str>,
    pub reap: Arc<str>,
    pub inspect: Arc<str>,
    pub forget_lock: Arc<str>,
    pub forget_delete: Arc<str>,
    pub scan: Arc<str>,
    pub scan_open: Arc<str>,
    /// The quoted name of the failure counts' table.
    pub failures_table: String,
    pub count_failure: Arc<str>,
    pub forget_failures: Arc<str>,
    pub reap_failures: Arc<str>,
    /// Partitioned tables: every claim sends the combined statement, which
    /// alone reads the key's live row and takes its lock (partitions.rs).
    pub partitioned: bool,
}

/// Columns a refused `resolve_in_tx` reads back, as `classify` answers:
/// `done, state, token, in_tx, live, same`.
const WRITE_REPLY: &str = "SELECT true AS done, NULL::\"char\" AS state, NULL::bytea AS token, \
     NULL::boolean AS in_tx, NULL::boolean AS live, NULL::boolean AS same FROM w";

impl Statements {
    pub(crate) fn new(t: &TableName, parts: Option<&Partitioning>) -> Statements {
        // The claim reads the row and calls the claim function (schema.rs)
        // only when that row shows no record this claim must leave alone
        // (none, expired, its own, or a lapsed lease): a replay or an
        // in-progress answer is a read-only statement (no row lock, no
        // transaction id, no WAL flush) that initialises nothing that
        // writes. `won` is the function's answer: the attempt, or NULL
        // when the latest row refused the claim (then the columns are the
        // statement's read, possibly stale). `OFFSET 0` keeps `c` one row
        // read once, so every column sees the same time. Columns in
        // `claim_col`'s order.
        let claim = format!(
            "SELECT CASE WHEN r.key IS NULL OR r.expires_at <= c.now \
                          OR (r.state = 'P' AND (r.token = $2 OR r.lease_until <= c.now)) \
                     THEN {claim_fn}($1, $2, $3, $4, $5, $6, c.now, r.key IS NULL) END AS won, \
                    r.attempt, r.state, r.token, r.fingerprint, r.value, \
                    r.lease_until - c.now AS lease_left, r.expires_at - c.now AS ttl_left \
             FROM (SELECT clock_timestamp() AS now OFFSET 0) c LEFT JOIN {t} r ON r.key = $1",
            claim_fn = t.routine(CLAIM_FN),
        );
        // Partitioned, the function reads the key's live row itself, under
        // the key's lock, and answers the same columns (schema.rs).
        let claim = match parts {
            None => claim,
            Some(_) => format!(
                "SELECT * FROM {claim_fn}($1, $2, $3, $4, $5, $6, clock_timestamp())",
                claim_fn = t.routine(CLAIM_FN),
            ),
        };
        // The forecast's two one-sided claims (`claim_path.rs`). The insert
        // wins an absent key and answers nothing for a present one (no row
        // lock, no write: `DO NOTHING` stops at the index probe). The read
        // has the claim's columns (`won` always NULL) and no function call
        // to initialise. Each reads the clock per column: the time left
        // reported on a lease and on a record are separate answers. The
        // `run_in_tx` insert also marks the row `in_tx` and commits
        // asynchronously, as the claim function does for it (schema.rs).
        let insert = |in_tx: &str, from: &str| {
            format!(
                "INSERT INTO {t} (attempt, lease_until, expires_at, state, in_tx, key, token, fingerprint, value) \
                 SELECT 1, clock_timestamp() + {lease}, clock_timestamp() + {ttl}, 'P', {in_tx}, $1, $2, $5, NULL{from} \
                 ON CONFLICT (key) DO NOTHING RETURNING attempt",
                lease = ms!(3),
                ttl = ms!(4),
            )
        };
        let claim_insert = insert("false", "");
        let claim_insert_tx = insert(
            "true",
            " FROM (SELECT set_config('synchronous_commit', 'off', true)) AS async_commit",
        );
        let claim_read = format!(
            "SELECT NULL::bigint AS won, r.attempt, r.state, r.token, r.fingerprint, r.value, \
                    r.lease_until - clock_timestamp() AS lease_left, \
                    r.expires_at - clock_timestamp() AS ttl_left \
             FROM {t} r WHERE r.key = $1"
        );
        // The writes are plain statements: on the common path one row
        // changes and that is the whole answer. A refused write (zero rows:
        // another owner, completed, expired) reads the row back with
        // `classify` in a second statement, so only that rare path pays a
        // second round trip, and the common one does not initialise a
        // read-back plan it never runs.
        let complete = format!(
            "UPDATE {t} SET state = $3, value = $4, attempt = NULL, lease_until = NULL, \
                    token = NULL, in_tx = false, steps = NULL \
             WHERE key = $1 AND state = 'P' AND token = $2 \
               AND expires_at > clock_timestamp() AND NOT in_tx"
        );
        // A step already recorded under this name is kept as it is (the
        // same step re-sent): the row still counts as written, `Done`.
        let save_step = format!(
            "UPDATE {t} SET steps = CASE \
                 WHEN COALESCE(steps, '[]') @> jsonb_build_array(jsonb_build_object('n', $3::text)) THEN steps \
                 ELSE COALESCE(steps, '[]') || jsonb_build_array(jsonb_build_object('n', $3::text, 'v', $4::text)) END \
             WHERE key = $1 AND state = 'P' AND token = $2 \
               AND expires_at > clock_timestamp() AND NOT in_tx"
        );
        let steps = format!(
            "SELECT state, token, steps::text AS steps FROM {t} \
             WHERE key = $1 AND expires_at > clock_timestamp()"
        );
        let suspend = format!(
            "UPDATE {t} SET lease_until = clock_timestamp() \
             WHERE key = $1 AND state = 'P' AND token = $2 AND expires_at > clock_timestamp() \
               AND jsonb_array_length(COALESCE(steps, '[]')) > 0"
        );
        // A `run_in_tx` claim completed outside its transaction: that
        // transaction did not commit (or the record would be completed), so
        // the body's writes are gone and the key is released instead.
        let resolve_in_tx = format!(
            "WITH c AS (SELECT clock_timestamp() AS now), \
             w AS (DELETE FROM {t} r WHERE r.key = $1 AND r.state = 'P' AND r.token = $2 \
                   AND r.in_tx RETURNING 1) \
             {WRITE_REPLY} \
             UNION ALL (SELECT false, r.state, r.token, r.in_tx, r.expires_at > c.now, \
                              (r.state = $3 AND r.value = $4) \
             FROM {t} r, c WHERE r.key = $1 AND NOT EXISTS (SELECT 1 FROM w) \
             ORDER BY r.expires_at DESC LIMIT 1)"
        );
        let release = format!(
            "DELETE FROM {t} WHERE key = $1 AND state = 'P' AND token = $2 \
               AND expires_at > clock_timestamp()"
        );
        // An extend commits asynchronously: losing one in a server crash
        // leaves the previous deadline, the same as an extend delayed by
        // that crash's downtime (during which no extend lands anyway), and
        // the holder's next renewal moves it on. It keeps renewals off the
        // WAL flush queue, where a busy server can hold them past a lease.
        let extend = format!(
            "WITH c AS (SELECT clock_timestamp() AS now, \
                        set_config('synchronous_commit', 'off', true) AS sync) \
             UPDATE {t} r SET lease_until = c.now + {lease}, \
                    expires_at = GREATEST(r.expires_at, c.now + 2 * {lease}) \
             FROM c WHERE r.key = $1 AND r.state = 'P' AND r.token = $2 AND r.expires_at > c.now",
            lease = ms!(3),
        );
        let classify = format!(
            "SELECT false AS done, r.state, r.token, r.in_tx, r.expires_at > clock_timestamp() AS live, \
                    (r.state = $2 AND r.value = $3) AS same \
             FROM {t} r WHERE r.key = $1 ORDER BY r.expires_at DESC LIMIT 1"
        );
        // SKIP LOCKED: reapers in several processes share the work instead
        // of queueing on each other's rows, and never wait on a live claim.
        // Partitioned, only the default partition is reaped: the others
        // go whole (`PgStore::maintain`).
        let reap = match parts {
            None => format!(
                "DELETE FROM {t} WHERE key IN ( \
                   SELECT key FROM {t} WHERE expires_at <= clock_timestamp() \
                   LIMIT $1 FOR UPDATE SKIP LOCKED)"
            ),
            Some(_) => format!(
                "DELETE FROM {d} WHERE (key, gen) IN ( \
                   SELECT key, gen FROM {d} WHERE expires_at <= clock_timestamp() \
                   LIMIT $1 FOR UPDATE SKIP LOCKED)",
                d = crate::config::default_name(t, crate::config::RECORDS),
            ),
        };
        // Operators' reads: live rows only, as Redis (whose expired keys are
        // gone) and MemoryStore answer.
        let clock = "(SELECT clock_timestamp() AS now) c";
        let inspect = format!(
            "SELECT {} FROM {t} r, {clock} WHERE r.key = $1 AND r.expires_at > c.now",
            info_columns("$2")
        );
        let forget_lock = format!(
            "SELECT {} FROM {t} r, {clock} WHERE r.key = $1 AND r.expires_at > c.now FOR UPDATE OF r",
            info_columns("false")
        );
        let forget_delete = format!("DELETE FROM {t} WHERE key = $1");
        // Keyset pagination: $1 the prefix (lower bound), $2 the last key of
        // the previous page, $3 the page size + 1, $4 the first string past
        // the prefix (upper bound).
        let scan_open = format!(
            "SELECT {} FROM {t} r, {clock} \
             WHERE r.key >= $1 AND r.key > COALESCE($2, '') AND starts_with(r.key, $1) \
               AND r.expires_at > c.now ORDER BY r.key LIMIT $3",
            info_columns("false")
        );
        let scan = scan_open.replace(" ORDER BY", " AND r.key < $4 ORDER BY");
        // One statement, so concurrent counts of a key queue on its row
        // and each sees the one before it: N counts answer 1..=N. An
        // expired count (not reaped yet) starts again at 1.
        let failures_table = t.beside(FAILURES_TABLE);
        let f = &failures_table;
        let count_failure = format!(
            "INSERT INTO {f} AS f (key, failures, expires_at) \
             VALUES ($1, 1, clock_timestamp() + {ttl}) \
             ON CONFLICT (key) DO UPDATE SET \
                failures = CASE WHEN f.expires_at <= clock_timestamp() THEN 1 \
                                ELSE LEAST(f.failures + 1, 4294967295) END, \
                expires_at = EXCLUDED.expires_at \
             RETURNING failures",
            ttl = ms!(2),
        );
        let forget_failures = format!("DELETE FROM {f} WHERE key = $1");
        let reap_failures = format!(
            "DELETE FROM {f} WHERE key IN ( \
               SELECT key FROM {f} WHERE expires_at <= clock_timestamp() \
               LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
        // A batch of distinct keys (`batch.rs`): the combined claim per
        // row of the arrays, in their order, with the position appended
        // after `claim_col`'s columns; and the completes and releases as
        // `complete` and `release` above, answering the keys they changed.
        // A key the batch statement does not answer goes through the single
        // call, which re-runs the same write and reads why it was refused.
        let claim_batch = format!(
            "SELECT CASE WHEN r.key IS NULL OR r.expires_at <= c.now \
                          OR (r.state = 'P' AND (r.token = b.token OR r.lease_until <= c.now)) \
                     THEN {claim_fn}(b.key, b.token, b.lease, b.ttl, b.fp, false, c.now, r.key IS NULL) END AS won, \
                    r.attempt, r.state, r.token, r.fingerprint, r.value, \
                    r.lease_until - c.now AS lease_left, r.expires_at - c.now AS ttl_left, b.ord \
             FROM unnest($1::text[], $2::bytea[], $3::bigint[], $4::bigint[], $5::bytea[]) \
                  WITH ORDINALITY AS b(key, token, lease, ttl, fp, ord) \
             CROSS JOIN (SELECT clock_timestamp() AS now OFFSET 0) c \
             LEFT JOIN {t} r ON r.key = b.key ORDER BY b.ord",
            claim_fn = t.routine(CLAIM_FN),
        );
        // Partitioned, each claim takes its key's advisory lock and holds
        // it to the statement's end: the keys go in their sorted order, so
        // two batches never wait on each other's locks in a cycle.
        let claim_batch = match parts {
            None => claim_batch,
            Some(_) => format!(
                "SELECT x.*, b.ord \
                 FROM (SELECT * FROM unnest($1::text[], $2::bytea[], $3::bigint[], $4::bigint[], $5::bytea[]) \
                       WITH ORDINALITY AS b(key, token, lease, ttl, fp, ord) ORDER BY b.key OFFSET 0) b \
                 CROSS JOIN LATERAL {claim_fn}(b.key, b.token, b.lease, b.ttl, b.fp, false, clock_timestamp()) x \
                 ORDER BY b.ord",
                claim_fn = t.routine(CLAIM_FN),
            ),
        };
        let finish_batch = format!(
            "WITH b AS (SELECT * FROM unnest($1::text[], $2::bytea[], $3::\"char\"[], $4::bytea[]) \
                        AS b(key, token, state, value)), \
             c AS (SELECT clock_timestamp() AS now), \
             done AS (UPDATE {t} r SET state = b.state, value = b.value, attempt = NULL, \
                             lease_until = NULL, token = NULL, in_tx = false, steps = NULL \
                      FROM b, c WHERE b.state IS NOT NULL AND r.key = b.key AND r.state = 'P' \
                        AND r.token = b.token AND r.expires_at > c.now AND NOT r.in_tx \
                      RETURNING r.key), \
             gone AS (DELETE FROM {t} r USING b, c WHERE b.state IS NULL AND r.key = b.key \
                        AND r.state = 'P' AND r.token = b.token AND r.expires_at > c.now \
                      RETURNING r.key) \
             SELECT key FROM done UNION ALL SELECT key FROM gone"
        );
        Statements {
            claim_batch: claim_batch.into(),
            finish_batch: finish_batch.into(),
            count_failure: count_failure.into(),
            forget_failures: forget_failures.into(),
            reap_failures: reap_failures.into(),
            failures_table,
            inspect: inspect.into(),
            forget_lock: forget_lock.into(),
            forget_delete: forget_delete.into(),
            scan: scan.into(),
            scan_open: scan_open.into(),
            claim: claim.into(),
            claim_insert: claim_insert.into(),
            claim_insert_tx: claim_insert_tx.into(),
            claim_read: claim_read.into(),
            complete: complete.into(),
            save_step: save_step.into(),
            steps: steps.into(),
            suspend: suspend.into(),
            complete_in_tx: t.routine(COMPLETE_IN_TX_FN),
            resolve_in_tx: resolve_in_tx.into(),
            release: release.into(),
            extend: extend.into(),
            classify: classify.into(),
            reap: reap.into(),
            partitioned: parts.is_some(),
        }
    }

    /// The `run_in_tx` completion: the completion function (an owner-token
    /// compare-and-set that raises `LEASE_LOST` when it touches no row),
    /// then COMMIT, then BEGIN (so the connection is in a transaction again,
    /// as sqlx believes). Every value is spliced as hex digits or a checked
    /// tag letter: no input can close a literal.
    pub(crate) fn cas_and_commit(
        &self,
        key: &str,
        token: &[u8; 16],
        kind: i8,
        value: &[u8],
    ) -> String {
        let tag = char::from(kind as u8);
        let tag = if tag.is_ascii_alphabetic() { tag } else { '?' };
        format!(
            "SELECT {f}(convert_from(decode('{key}', 'hex'), 'UTF8'), decode('{token}', 'hex'), \
                        '{tag}', decode('{value}', 'hex')); COMMIT; BEGIN",
            f = self.complete_in_tx,
            key = hex::encode(key),
            token = hex::encode(token),
            value = hex::encode(value),
        )
    }
}
