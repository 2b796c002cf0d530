//! The statements, rendered once per table.
//!
//! Time is always `clock_timestamp()`, read once per statement in the CTE
//! `c`: the database's clock, never the client's, and not `now()`, which a
//! transaction freezes at its start. Durations travel as milliseconds.
//!
//! Every write is one statement that does the write when the row is the
//! caller's and otherwise reads the row back in the same round trip (the
//! `UNION ALL … WHERE NOT EXISTS` branch). That read uses the statement's
//! snapshot, which under READ COMMITTED may predate the row version the
//! write was refused on; so the caller trusts it only for answers that
//! need no write (in progress, completed, another owner, missing) and runs
//! the whole statement again when the snapshot says the write should have
//! happened.

use crate::config::TableName;
use crate::operate::info_columns;
use std::sync::Arc;

/// `$n` milliseconds as an interval.
macro_rules! ms {
    ($n:literal) => {
        concat!("($", $n, "::bigint * interval '1 millisecond')")
    };
}

/// The rendered statements of one table.
#[derive(Debug)]
pub(crate) struct Statements {
    pub claim: Arc<str>,
    pub complete: Arc<str>,
    table: String,
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
}

/// Columns a refused write reads back: `done, state, token, in_tx, live, same`.
const WRITE_REPLY: &str = "SELECT true AS done, NULL::\"char\" AS state, NULL::bytea AS token, \
     NULL::boolean AS in_tx, NULL::boolean AS live, NULL::boolean AS same FROM w";

impl Statements {
    pub(crate) fn new(t: &TableName) -> Statements {
        // The claim's own time, recovered inside ON CONFLICT (which cannot
        // see the CTE) from the lease end it just computed: exact, since
        // interval arithmetic on timestamptz is in whole microseconds.
        let now = concat!("(EXCLUDED.lease_until - ", ms!(3), ")");
        // `cur` reads the row first: when it shows a record this claim
        // cannot take (completed, or another holder's live lease), the
        // INSERT has no source row and never runs, so a replay or an
        // in-progress answer is a read-only statement (no row lock, no
        // transaction id, no WAL flush). When the snapshot is stale, the
        // INSERT's conflict path re-checks everything on the latest row.
        //
        // `sync`: a `run_in_tx` claim ($6) commits asynchronously. Losing
        // it in a server crash is harmless: the crash aborts the body's
        // transaction too, so the key is rightly free again. Plain claims
        // stay durable: their bodies' effects live outside the database.
        let claim = format!(
            "WITH c AS (SELECT clock_timestamp() AS now, \
                        CASE WHEN $6 THEN set_config('synchronous_commit', 'off', true) END AS sync), \
             cur AS (SELECT r.* FROM {t} r, c WHERE r.key = $1), \
             ins AS ( \
               INSERT INTO {t} AS r (attempt, lease_until, expires_at, state, in_tx, key, token, fingerprint, value) \
               SELECT 1, c.now + {lease}, c.now + {ttl}, 'P', $6, $1, $2, $5, NULL FROM c \
               WHERE NOT EXISTS (SELECT 1 FROM cur WHERE cur.expires_at > c.now \
                                 AND NOT (cur.state = 'P' AND (cur.token = $2 OR cur.lease_until <= c.now))) \
               ON CONFLICT (key) DO UPDATE SET \
                 attempt = CASE WHEN r.expires_at <= {now} THEN 1 \
                                WHEN r.token = EXCLUDED.token THEN r.attempt \
                                ELSE LEAST(r.attempt + 1, 4294967295) END, \
                 fingerprint = CASE WHEN r.expires_at <= {now} THEN EXCLUDED.fingerprint \
                                    WHEN r.token = EXCLUDED.token THEN r.fingerprint \
                                    ELSE COALESCE(EXCLUDED.fingerprint, r.fingerprint) END, \
                 lease_until = EXCLUDED.lease_until, \
                 expires_at = EXCLUDED.expires_at, \
                 state = 'P', token = EXCLUDED.token, value = NULL, in_tx = EXCLUDED.in_tx \
               WHERE r.expires_at <= {now} \
                  OR (r.state = 'P' AND octet_length(r.token) = 16 \
                      AND r.attempt BETWEEN 1 AND 4294967295 AND r.lease_until IS NOT NULL \
                      AND (r.fingerprint IS NULL OR octet_length(r.fingerprint) = 16) \
                      AND (EXCLUDED.fingerprint IS NULL OR r.fingerprint IS NULL \
                           OR r.fingerprint = EXCLUDED.fingerprint) \
                      AND (r.token = EXCLUDED.token OR r.lease_until <= {now})) \
               RETURNING r.attempt \
             ) \
             SELECT true AS won, ins.attempt, NULL::\"char\" AS state, NULL::bytea AS token, \
                    NULL::bytea AS fingerprint, NULL::bytea AS value, \
                    NULL::bigint AS lease_ms, NULL::bigint AS ttl_ms FROM ins \
             UNION ALL \
             SELECT false, r.attempt, r.state, r.token, r.fingerprint, r.value, \
                    ceil(extract(epoch FROM r.lease_until - c.now) * 1000)::bigint, \
                    ceil(extract(epoch FROM r.expires_at - c.now) * 1000)::bigint \
             FROM cur r, c WHERE NOT EXISTS (SELECT 1 FROM ins)",
            lease = ms!(3),
            ttl = ms!(4),
        );
        let refused = |kind: &str| {
            format!(
                "UNION ALL SELECT false, r.state, r.token, r.in_tx, r.expires_at > c.now, {kind} \
                 FROM {t} r, c WHERE r.key = $1 AND NOT EXISTS (SELECT 1 FROM w)"
            )
        };
        let complete = format!(
            "WITH c AS (SELECT clock_timestamp() AS now), \
             w AS (UPDATE {t} r SET state = $3, value = $4, attempt = NULL, lease_until = NULL, \
                          token = NULL, in_tx = false \
                   FROM c WHERE r.key = $1 AND r.state = 'P' AND r.token = $2 \
                     AND r.expires_at > c.now AND NOT r.in_tx RETURNING 1) \
             {WRITE_REPLY} {}",
            refused("(r.state = $3 AND r.value = $4)")
        );
        // A `run_in_tx` claim completed outside its transaction: that
        // transaction did not commit (or the record would be completed), so
        // the body's writes are gone and the key is released instead.
        let resolve_in_tx = format!(
            "WITH c AS (SELECT clock_timestamp() AS now), \
             w AS (DELETE FROM {t} r WHERE r.key = $1 AND r.state = 'P' AND r.token = $2 \
                   AND r.in_tx RETURNING 1) \
             {WRITE_REPLY} {}",
            refused("(r.state = $3 AND r.value = $4)")
        );
        let release = format!(
            "WITH c AS (SELECT clock_timestamp() AS now), \
             w AS (DELETE FROM {t} r USING c WHERE r.key = $1 AND r.state = 'P' \
                   AND r.token = $2 AND r.expires_at > c.now RETURNING 1) \
             {WRITE_REPLY} {}",
            refused("false")
        );
        // An extend commits asynchronously: losing one in a server crash
        // leaves the previous deadline, the same as an extend delayed by
        // that crash's downtime (during which no extend lands anyway), and
        // the holder's next renewal moves it on. It keeps renewals off the
        // WAL flush queue, where a busy server can hold them past a lease.
        let extend = format!(
            "WITH c AS (SELECT clock_timestamp() AS now, \
                        set_config('synchronous_commit', 'off', true) AS sync), \
             w AS (UPDATE {t} r SET lease_until = c.now + {lease}, \
                          expires_at = GREATEST(r.expires_at, c.now + 2 * {lease}) \
                   FROM c WHERE r.key = $1 AND r.state = 'P' AND r.token = $2 \
                     AND r.expires_at > c.now RETURNING 1) \
             {WRITE_REPLY} {}",
            refused("false"),
            lease = ms!(3),
        );
        let classify = format!(
            "SELECT false AS done, r.state, r.token, r.in_tx, r.expires_at > clock_timestamp() AS live, \
                    (r.state = $2 AND r.value = $3) AS same \
             FROM {t} r WHERE r.key = $1"
        );
        // SKIP LOCKED: reapers in several processes share the work instead
        // of queueing on each other's rows, and never wait on a live claim.
        let reap = format!(
            "DELETE FROM {t} WHERE key IN ( \
               SELECT key FROM {t} WHERE expires_at <= clock_timestamp() \
               LIMIT $1 FOR UPDATE SKIP LOCKED)"
        );
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
        Statements {
            inspect: inspect.into(),
            forget_lock: forget_lock.into(),
            forget_delete: forget_delete.into(),
            scan: scan.into(),
            scan_open: scan_open.into(),
            claim: claim.into(),
            complete: complete.into(),
            table: t.to_string(),
            resolve_in_tx: resolve_in_tx.into(),
            release: release.into(),
            extend: extend.into(),
            classify: classify.into(),
            reap: reap.into(),
        }
    }

    /// The `run_in_tx` completion: an owner-token compare-and-set that
    /// divides by zero when it touches no row, then COMMIT, then BEGIN (so
    /// the connection is in a transaction again, as sqlx believes). Every
    /// value is spliced as hex digits or a checked tag letter: no input can
    /// close a literal.
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
            "WITH u AS (UPDATE {t} SET state = '{tag}', value = decode('{value}', 'hex'), \
                    attempt = NULL, lease_until = NULL, token = NULL, in_tx = false \
                    WHERE key = convert_from(decode('{key}', 'hex'), 'UTF8') AND state = 'P' \
                      AND token = decode('{token}', 'hex') AND in_tx \
                      AND expires_at > clock_timestamp() RETURNING 1) \
             SELECT 1 / count(*) FROM u; COMMIT; BEGIN",
            t = self.table,
            key = hex(key.as_bytes()),
            token = hex(token),
            value = hex(value),
        )
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
    out
}
