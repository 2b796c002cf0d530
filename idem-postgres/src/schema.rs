//! The table that holds the records: its DDL (also shipped as
//! `schema.sql`) and the idempotent migration.
//!
//! One row per key, the state machine of `idem_core::store::Store` in columns:
//!
//! | column | pending (`P`) | completed (`C`, `Z`, `L`, `U`) |
//! | --- | --- | --- |
//! | `state` | `'P'` | the value's kind tag, as in the Redis record |
//! | `attempt` | 1, +1 per takeover | NULL |
//! | `lease_until` | end of the holder's lease (database clock) | NULL |
//! | `expires_at` | end of the record: the claim's time + result TTL, at least two leases | same, kept from the claim |
//! | `token` | the holder's 16-byte owner token | NULL |
//! | `fingerprint` | 16 bytes or NULL | kept from the claim |
//! | `value` | NULL | the stored bytes |
//! | `in_tx` | claimed by `run_in_tx`: completes only inside the body's transaction | false |
//! | `steps` | a `run_steps` call's finished steps, `[{"n": name, "v": value JSON as text}, …]` in order, or NULL; kept by a takeover | NULL |
//!
//! Beside it, `<table>_failures` keeps each key's count of failed runs
//! (`key`, `failures`, `expires_at`), created by the same migration.
//!
//! No `CHECK` constraints: a row written by something else is read, found
//! unreadable and reported as `Error::Corrupt` without being overwritten,
//! and the common paths pay for no extra checks.

use crate::config::Partitioning;
use crate::config::TableName;

/// The function that writes a claim (see [`claim_function`]).
pub(crate) const CLAIM_FN: &str = "claim";
/// The function that completes a `run_in_tx` claim inside the body's
/// transaction (see [`complete_in_tx_function`]).
pub(crate) const COMPLETE_IN_TX_FN: &str = "complete_in_tx";
/// The table beside the records that counts each key's failed runs
/// (`Store::count_failure`): `<table>_failures`, one row per key with a
/// count and its own expiry, so it outlives the record's release.
pub(crate) const FAILURES_TABLE: &str = "failures";
/// The SQLSTATE the `run_in_tx` completion raises when the caller no longer
/// holds the lease: the transaction aborts before its `COMMIT`.
pub(crate) const LEASE_LOST: &str = "IDL01";

/// The statements that create the table, its index and its two functions,
/// each idempotent (`IF NOT EXISTS`, `CREATE OR REPLACE`), in order. The expiry index is BRIN: rows are written
/// roughly in expiry order, so a few bytes per block range find the expired
/// ones for `reap`, while a B-tree on a timestamp would make every claim
/// insert into the same rightmost page.
pub(crate) fn ddl(table: &TableName, parts: Option<&Partitioning>) -> Vec<String> {
    // A partitioned table's unique key must hold the partition key
    // (partitions.rs says what follows from that).
    let (generation, key, tail) = match parts {
        None => ("", "PRIMARY KEY", ") WITH (fillfactor = 75)".to_owned()),
        Some(_) => (
            "\x20   gen         bigint      NOT NULL,\n",
            "NOT NULL",
            format!(",\n\x20   PRIMARY KEY (key, gen)\n) {}", Partitioning::BY),
        ),
    };
    let mut statements = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (\n\
             {generation}\
             \x20   attempt     bigint,\n\
             \x20   lease_until timestamptz,\n\
             \x20   expires_at  timestamptz NOT NULL,\n\
             \x20   state       \"char\"      NOT NULL,\n\
             \x20   in_tx       boolean     NOT NULL DEFAULT false,\n\
             \x20   key         text        COLLATE \"C\" {key},\n\
             \x20   token       bytea,\n\
             \x20   fingerprint bytea,\n\
             \x20   value       bytea,\n\
             \x20   steps       jsonb\n\
             {tail}"
        ),
        // Tables made before durable steps gain the column (no rewrite:
        // a NULL default is metadata only).
        format!("ALTER TABLE {table} ADD COLUMN IF NOT EXISTS steps jsonb"),
        format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {table} USING brin (expires_at)",
            index = table.index("expires_idx")
        ),
    ];
    if parts.is_some() {
        statements.push(Partitioning::default_partition(
            table,
            crate::config::RECORDS,
            &table.to_string(),
        ));
    }
    statements.extend([
        match parts {
            None => claim_function(table),
            Some(parts) => claim_function_partitioned(table, parts),
        },
        complete_in_tx_function(table),
        format!(
            "CREATE TABLE IF NOT EXISTS {failures} (\n\
             \x20   key         text        COLLATE \"C\" PRIMARY KEY,\n\
             \x20   failures    bigint      NOT NULL,\n\
             \x20   expires_at  timestamptz NOT NULL\n\
             )",
            failures = table.beside(FAILURES_TABLE)
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {failures} USING brin (expires_at)",
            index = table.index("failures_expires_idx"),
            failures = table.beside(FAILURES_TABLE)
        ),
    ]);
    statements.extend(crate::outbox::table::ddl(table, parts));
    statements
}

/// Which kind of table (`'r'` plain, `'p'` partitioned) the records and
/// the outbox are, where they exist: `migrate` refuses to run one layout's
/// DDL over the other's tables, whose `IF NOT EXISTS` would pass silently.
pub(crate) fn kinds(table: &TableName) -> String {
    let quoted = |name: String| format!("'{}'", name.replace('\'', "''"));
    format!(
        "SELECT (SELECT relkind::text FROM pg_class WHERE oid = to_regclass({records})), \
                (SELECT relkind::text FROM pg_class WHERE oid = to_regclass({outbox}))",
        records = quoted(table.to_string()),
        outbox = quoted(table.beside(crate::outbox::table::OUTBOX_TABLE)),
    )
}

/// What marks the schema of `statements` as in place: their hash, kept as
/// the comment of the outbox's wake table (a table of idem's own, which the
/// DDL creates last), so that [`in_place`] recognises this version's schema
/// without locking anything.
pub(crate) fn stamp(statements: &[String]) -> String {
    // FNV-1a over the statements: any change of the DDL (a new version, a
    // table of another name) is another stamp.
    let hash = statements
        .iter()
        .flat_map(|s| s.bytes().chain([0]))
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("idem-postgres schema {hash:016x}")
}

/// Records `stamp` once the DDL ran (in its transaction).
pub(crate) fn stamp_statement(table: &TableName, stamp: &str) -> String {
    format!(
        "COMMENT ON TABLE {wake} IS '{stamp}'",
        wake = table.beside(crate::outbox::table::WAKE_TABLE)
    )
}

/// `true` when the wake table carries the stamp `$1` and the tables the DDL
/// creates all exist (one dropped by hand is made again); a catalog read,
/// no lock on the tables.
pub(crate) fn in_place(table: &TableName) -> String {
    let quoted = |name: String| format!("'{}'", name.replace('\'', "''"));
    let exists = |name: String| format!("to_regclass({}) IS NOT NULL", quoted(name));
    format!(
        "SELECT coalesce(obj_description(to_regclass({wake}), 'pg_class') = $1, false)\n\
         \x20   AND {records} AND {failures} AND {outbox}",
        wake = quoted(table.beside(crate::outbox::table::WAKE_TABLE)),
        records = exists(table.to_string()),
        failures = exists(table.beside(FAILURES_TABLE)),
        outbox = exists(table.beside(crate::outbox::table::OUTBOX_TABLE)),
    )
}

/// The write half of a claim, called by the claim statement (`sql.rs`) only
/// when the row it read shows a record this claim may take, so a replay or
/// an in-progress answer never starts an `INSERT`: a data-modifying CTE
/// would initialise one on every call, which cost a replay 3.5 times the
/// server instructions of a plain read. Returns the attempt when the claim
/// is the caller's, NULL when the latest row refused it.
///
/// `n` is the claim statement's own time; `absent` says its read found no
/// row, so the common fresh claim first tries a bare insert, whose plan
/// carries no conflict clause to initialise. A `run_in_tx` claim (`tx`)
/// commits asynchronously: losing it in a server crash is harmless, since
/// the crash aborts the body's transaction too, so the key is rightly free
/// again. Plain claims stay durable: their bodies' effects live outside the
/// database. The `ON CONFLICT` branch re-checks everything on the latest
/// row version, whatever the caller's read saw.
fn claim_function(table: &TableName) -> String {
    let name = table.routine(CLAIM_FN);
    format!(
        "CREATE OR REPLACE FUNCTION {name}(\n\
         \x20   k text, tok bytea, lease_ms bigint, ttl_ms bigint, fp bytea, tx boolean, n timestamptz,\n\
         \x20   absent boolean\n\
         ) RETURNS bigint LANGUAGE plpgsql VOLATILE AS $idem$\n\
         #variable_conflict use_column\n\
         DECLARE\n\
         \x20   won bigint;\n\
         BEGIN\n\
         \x20   IF tx THEN\n\
         \x20       PERFORM set_config('synchronous_commit', 'off', true);\n\
         \x20   END IF;\n\
         \x20   IF absent THEN\n\
         \x20       INSERT INTO {table} (attempt, lease_until, expires_at, state, in_tx, key, token, fingerprint, value)\n\
         \x20       VALUES (1, n + lease_ms * interval '1 millisecond', n + ttl_ms * interval '1 millisecond',\n\
         \x20               'P', tx, k, tok, fp, NULL)\n\
         \x20       ON CONFLICT (key) DO NOTHING\n\
         \x20       RETURNING 1 INTO won;\n\
         \x20       IF FOUND THEN\n\
         \x20           RETURN won;\n\
         \x20       END IF;\n\
         \x20   END IF;\n\
         \x20   INSERT INTO {table} AS r (attempt, lease_until, expires_at, state, in_tx, key, token, fingerprint, value)\n\
         \x20   VALUES (1, n + lease_ms * interval '1 millisecond', n + ttl_ms * interval '1 millisecond',\n\
         \x20           'P', tx, k, tok, fp, NULL)\n\
         \x20   ON CONFLICT (key) DO UPDATE SET\n\
         \x20       attempt = CASE WHEN r.expires_at <= n THEN 1\n\
         \x20                      WHEN r.token = EXCLUDED.token THEN r.attempt\n\
         \x20                      ELSE LEAST(r.attempt + 1, 4294967295) END,\n\
         \x20       fingerprint = CASE WHEN r.expires_at <= n THEN EXCLUDED.fingerprint\n\
         \x20                          WHEN r.token = EXCLUDED.token THEN r.fingerprint\n\
         \x20                          ELSE COALESCE(EXCLUDED.fingerprint, r.fingerprint) END,\n\
         \x20       lease_until = EXCLUDED.lease_until, expires_at = EXCLUDED.expires_at,\n\
         \x20       state = 'P', token = EXCLUDED.token, value = NULL, in_tx = EXCLUDED.in_tx,\n\
         \x20       steps = CASE WHEN r.expires_at <= n THEN NULL ELSE r.steps END\n\
         \x20   WHERE r.expires_at <= n\n\
         \x20      OR (r.state = 'P' AND octet_length(r.token) = 16\n\
         \x20          AND r.attempt BETWEEN 1 AND 4294967295 AND r.lease_until IS NOT NULL\n\
         \x20          AND (r.fingerprint IS NULL OR octet_length(r.fingerprint) = 16)\n\
         \x20          AND (EXCLUDED.fingerprint IS NULL OR r.fingerprint IS NULL\n\
         \x20               OR r.fingerprint = EXCLUDED.fingerprint)\n\
         \x20          AND (r.token = EXCLUDED.token OR r.lease_until <= n))\n\
         \x20   RETURNING r.attempt INTO won;\n\
         \x20   RETURN won;\n\
         END\n\
         $idem$"
    )
}

/// The claim function of a partitioned table (`partitions.rs`): the same
/// answers as [`claim_function`], with the uniqueness no index can give
/// (a key may have rows in several partitions) from an advisory lock per
/// key, taken first and held to the end of the transaction. Under it, the
/// read sees every committed row of the key: a live one is taken over where
/// it is (an update that names the row's partition), or left alone; with
/// none, the claim inserts into the current period, replacing an expired
/// row of the key there. The claim statement is this function alone, and
/// it answers the claim's columns (`sql::claim_col`): the key's row is
/// read once, since every read that cannot name a partition probes them
/// all.
fn claim_function_partitioned(table: &TableName, parts: &Partitioning) -> String {
    let name = table.routine(CLAIM_FN);
    let space = lock_space(table);
    let generation = parts.gen_of("clock_timestamp()");
    format!(
        "CREATE OR REPLACE FUNCTION {name}(\n\
         \x20   k text, tok bytea, lease_ms bigint, ttl_ms bigint, fp bytea, tx boolean, n timestamptz\n\
         ) RETURNS TABLE (won bigint, attempt bigint, state \"char\", token bytea, fingerprint bytea,\n\
         \x20                value bytea, lease_left interval, ttl_left interval)\n\
         LANGUAGE plpgsql VOLATILE AS $idem$\n\
         #variable_conflict use_column\n\
         DECLARE\n\
         \x20   got bigint;\n\
         \x20   cur record;\n\
         BEGIN\n\
         \x20   IF tx THEN\n\
         \x20       PERFORM set_config('synchronous_commit', 'off', true);\n\
         \x20   END IF;\n\
         \x20   PERFORM pg_advisory_xact_lock({space}, hashtext(k));\n\
         \x20   SELECT r.gen, r.attempt, r.state, r.token, r.fingerprint, r.value, r.lease_until, r.expires_at\n\
         \x20   INTO cur FROM {table} r WHERE r.key = k AND r.expires_at > n;\n\
         \x20   IF NOT FOUND THEN\n\
         \x20       INSERT INTO {table} AS r (gen, attempt, lease_until, expires_at, state, in_tx, key, token, fingerprint, value)\n\
         \x20       VALUES ({generation}, 1, n + lease_ms * interval '1 millisecond',\n\
         \x20               n + ttl_ms * interval '1 millisecond', 'P', tx, k, tok, fp, NULL)\n\
         \x20       ON CONFLICT (key, gen) DO UPDATE SET\n\
         \x20           attempt = 1, lease_until = EXCLUDED.lease_until, expires_at = EXCLUDED.expires_at,\n\
         \x20           state = 'P', in_tx = EXCLUDED.in_tx, token = EXCLUDED.token,\n\
         \x20           fingerprint = EXCLUDED.fingerprint, value = NULL, steps = NULL\n\
         \x20       WHERE r.expires_at <= n\n\
         \x20       RETURNING r.attempt INTO got;\n\
         \x20       RETURN QUERY SELECT got, NULL::bigint, NULL::\"char\", NULL::bytea, NULL::bytea, NULL::bytea,\n\
         \x20                           NULL::interval, NULL::interval;\n\
         \x20       RETURN;\n\
         \x20   END IF;\n\
         \x20   IF cur.state = 'P' AND (cur.token = tok OR cur.lease_until <= n) THEN\n\
         \x20       UPDATE {table} AS r SET\n\
         \x20           attempt = CASE WHEN r.token = tok THEN r.attempt ELSE LEAST(r.attempt + 1, 4294967295) END,\n\
         \x20           fingerprint = CASE WHEN r.token = tok THEN r.fingerprint ELSE COALESCE(fp, r.fingerprint) END,\n\
         \x20           lease_until = n + lease_ms * interval '1 millisecond',\n\
         \x20           expires_at = n + ttl_ms * interval '1 millisecond',\n\
         \x20           state = 'P', token = tok, value = NULL, in_tx = tx\n\
         \x20       WHERE r.key = k AND r.gen = cur.gen AND r.expires_at > n\n\
         \x20         AND r.state = 'P' AND octet_length(r.token) = 16\n\
         \x20         AND r.attempt BETWEEN 1 AND 4294967295 AND r.lease_until IS NOT NULL\n\
         \x20         AND (r.fingerprint IS NULL OR octet_length(r.fingerprint) = 16)\n\
         \x20         AND (fp IS NULL OR r.fingerprint IS NULL OR r.fingerprint = fp)\n\
         \x20         AND (r.token = tok OR r.lease_until <= n)\n\
         \x20       RETURNING r.attempt INTO got;\n\
         \x20   END IF;\n\
         \x20   RETURN QUERY SELECT got, cur.attempt, cur.state, cur.token, cur.fingerprint, cur.value,\n\
         \x20                       cur.lease_until - n, cur.expires_at - n;\n\
         END\n\
         $idem$"
    )
}

/// The first key of the claims' advisory locks on a partitioned table:
/// a hash of its name, so two tables' claims of one key do not wait on
/// each other.
pub(crate) fn lock_space(table: &TableName) -> i32 {
    let hash = table.to_string().bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    i32::from_ne_bytes(hash.to_ne_bytes())
}

/// The `run_in_tx` completion: an owner-token compare-and-set inside the
/// body's transaction, raising [`LEASE_LOST`] when it touches no row so that
/// the `COMMIT` sent in the same message never runs. A function, so the
/// message carrying it (simple protocol, spliced literals) plans a function
/// call instead of an `UPDATE` on every call.
fn complete_in_tx_function(table: &TableName) -> String {
    let name = table.routine(COMPLETE_IN_TX_FN);
    format!(
        "CREATE OR REPLACE FUNCTION {name}(k text, tok bytea, tag \"char\", v bytea)\n\
         RETURNS void LANGUAGE plpgsql VOLATILE AS $idem$\n\
         #variable_conflict use_column\n\
         BEGIN\n\
         \x20   UPDATE {table} SET state = tag, value = v, attempt = NULL, lease_until = NULL,\n\
         \x20                      token = NULL, in_tx = false, steps = NULL\n\
         \x20   WHERE key = k AND state = 'P' AND token = tok AND in_tx\n\
         \x20     AND expires_at > clock_timestamp();\n\
         \x20   IF NOT FOUND THEN\n\
         \x20       RAISE EXCEPTION 'idem: this call no longer holds the key''s lease; nothing of it commits'\n\
         \x20           USING ERRCODE = '{LEASE_LOST}';\n\
         \x20   END IF;\n\
         END\n\
         $idem$"
    )
}

/// The whole schema as one script, as `schema.sql` ships it.
pub(crate) fn script(table: &TableName, parts: Option<&Partitioning>) -> String {
    let mut out = String::from(
        "-- idem-postgres: the table of idempotency records.\n\
         -- Generated by idem-postgres (`PgStore::schema_sql`); `PgStore::migrate()` runs the same\n\
         -- statements. Safe to run again: every statement is IF NOT EXISTS. To use another table\n\
         -- name, replace \"idem_keys\" everywhere and pass it as `PgStoreConfig::table(..)`.\n\n",
    );
    for statement in ddl(table, parts) {
        out.push_str(&statement);
        out.push_str(";\n\n");
    }
    out.pop();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_file_matches_the_migration() {
        let table = TableName::parse(crate::config::DEFAULT_TABLE).unwrap();
        let shipped = include_str!("../schema.sql");
        if std::env::var_os("IDEM_WRITE_SCHEMA").is_some() {
            std::fs::write(
                concat!(env!("CARGO_MANIFEST_DIR"), "/schema.sql"),
                script(&table, None),
            )
            .unwrap();
            return;
        }
        assert_eq!(
            shipped,
            script(&table, None),
            "schema.sql is stale: regenerate it from schema::script (see this test)"
        );
    }
}
