//! The outbox table beside the records (`<table>_outbox`): its DDL, the
//! channel its inserts notify, and its statements, rendered once per table.
//!
//! | column | meaning |
//! | --- | --- |
//! | `seq` | commit-ish order: the relay publishes a key's messages by `seq` |
//! | `id` | the deterministic message id (`idem_core::outbox::message_id`), unique: publishing it twice keeps one row |
//! | `topic`, `msg_key`, `payload` | where it goes, its ordering key, its bytes (JSON) |
//! | `attempts`, `last_error` | failed sends so far, and the last reason |
//! | `retry_at` | after a failed send: not before this time (the key waits behind it) |
//! | `parked_at` | set when the broker refused it; the key waits until an operator retries or drops it |
//! | `headers` | the message's headers (the W3C trace context, feature `otel`) as a `json` object of name → string in order, published with it unchanged; NULL for none (headers.rs says why `json`) |

use crate::config::Partitioning;
use crate::config::TableName;

/// Suffix of the outbox table beside the records table.
pub(crate) const OUTBOX_TABLE: &str = "outbox";
/// Suffix of the one-row table that says whether a relay sleeps.
pub(crate) const WAKE_TABLE: &str = "outbox_wake";
/// Longest channel name PostgreSQL keeps (`NAMEDATALEN - 1`).
const MAX_CHANNEL: usize = 63;

/// The statements that create the outbox table, its indexes and its
/// notifying trigger, each safe to run again (run by `PgStore::migrate`,
/// under its advisory lock, after the records table).
pub(crate) fn ddl(table: &TableName, parts: Option<&Partitioning>) -> Vec<String> {
    let outbox = table.beside(OUTBOX_TABLE);
    let wake = table.beside(WAKE_TABLE);
    let notify = table.routine("outbox_notify");
    let trigger = table.index("outbox_notify");
    // Partitioned, the unique keys hold `gen`, the period of the insert
    // (partitions.rs): a message's id is unique within its period.
    let (seq, generation, tail, unique) = match parts {
        None => ("PRIMARY KEY", String::new(), ")".to_owned(), "id"),
        Some(parts) => (
            "NOT NULL",
            format!(
                "\x20   gen        bigint      NOT NULL DEFAULT {},\n",
                parts.gen_of("clock_timestamp()")
            ),
            format!(",\n\x20   PRIMARY KEY (seq, gen)\n) {}", Partitioning::BY),
            "id, gen",
        ),
    };
    let mut statements = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {outbox} (\n\
             \x20   seq        bigint      GENERATED ALWAYS AS IDENTITY {seq},\n\
             {generation}\
             \x20   id         text        COLLATE \"C\" NOT NULL,\n\
             \x20   topic      text        NOT NULL,\n\
             \x20   msg_key    text        COLLATE \"C\" NOT NULL,\n\
             \x20   payload    bytea       NOT NULL,\n\
             \x20   created_at timestamptz NOT NULL DEFAULT now(),\n\
             \x20   attempts   integer     NOT NULL DEFAULT 0,\n\
             \x20   last_error text,\n\
             \x20   retry_at   timestamptz,\n\
             \x20   parked_at  timestamptz,\n\
             \x20   headers    json\n\
             {tail}"
        ),
        // Tables made before headers gain the column: nullable without a
        // default, so adding it is a catalog change (no rewrite, a brief
        // lock), and the rows already there read as messages without
        // headers. Partitions gain it from their parent.
        format!("ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS headers json"),
        format!(
            "CREATE UNIQUE INDEX IF NOT EXISTS {index} ON {outbox} ({unique})",
            index = table.index("outbox_id_idx")
        ),
        // A key's older rows, for the relay's "is this the key's head" check.
        format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {outbox} (msg_key, seq)",
            index = table.index("outbox_key_idx")
        ),
    ];
    if parts.is_some() {
        statements.push(Partitioning::default_partition(
            table,
            &format!("{OUTBOX_TABLE}_p"),
            &outbox,
        ));
    }
    statements.extend([
        // Whether a relay sleeps (one row). A transaction that NOTIFYs
        // takes a database-wide lock at its commit, held through the WAL
        // flush, so notifying commits run one at a time (measured: run_in_tx
        // with a message fell from 3,000 to 900 calls/s at 16 in flight).
        // Inserts therefore notify only while a relay sleeps; a busy relay
        // needs no wake-up.
        format!("CREATE TABLE IF NOT EXISTS {wake} (idle boolean NOT NULL)"),
        format!("INSERT INTO {wake} (idle) SELECT true WHERE NOT EXISTS (SELECT 1 FROM {wake})"),
        // Per inserting statement, not per row: the relay only needs to wake.
        format!(
            "CREATE OR REPLACE FUNCTION {notify}() RETURNS trigger LANGUAGE plpgsql AS $idem$\n\
             BEGIN\n\
             \x20   IF EXISTS (SELECT 1 FROM {wake} WHERE idle) THEN\n\
             \x20       PERFORM pg_notify('{channel}', '');\n\
             \x20   END IF;\n\
             \x20   RETURN NULL;\n\
             END\n\
             $idem$",
            channel = channel(table)
        ),
        format!("DROP TRIGGER IF EXISTS {trigger} ON {outbox}"),
        format!(
            "CREATE TRIGGER {trigger} AFTER INSERT ON {outbox} \
             FOR EACH STATEMENT EXECUTE FUNCTION {notify}()"
        ),
    ]);
    statements
}

/// The `LISTEN` channel of a table's outbox: its (schema-qualified) name,
/// shortened to what the server keeps. Two long names that shorten alike
/// share a channel, which costs a spurious wake-up, nothing more.
pub(crate) fn channel(table: &TableName) -> String {
    let mut name = format!("idem_outbox:{table}").replace('"', "");
    while name.len() > MAX_CHANNEL {
        name.pop();
    }
    name
}

/// The outbox's statements for one table.
#[derive(Debug)]
pub(crate) struct OutboxSql {
    pub(crate) table: String,
    pub(crate) channel: String,
    /// Sets whether a relay sleeps (`$1`): inserts notify only then.
    pub(crate) idle: String,
    /// Inserts a message without headers (`headers` stays NULL): the
    /// statement of every untraced publish, as before headers existed.
    pub(crate) insert: String,
    /// Inserts a message with its headers (`$5`, a `json` object as text).
    pub(crate) insert_with_headers: String,
    pub(crate) heads: String,
    pub(crate) batch: String,
    pub(crate) delete: String,
    pub(crate) failed: String,
    pub(crate) parked: String,
    pub(crate) retry: String,
    pub(crate) retry_all: String,
    pub(crate) drop: String,
    pub(crate) backlog: String,
}

/// What the relay reads of a row it sends (`headers` as its text: the
/// object as it was written).
const ROW_COLUMNS: &str =
    "o.seq, o.id, o.topic, o.msg_key, o.payload, o.attempts, o.headers::text AS headers";

/// What `parked`, `drop` and `list` read of a row.
const PARKED_COLUMNS: &str = "id, topic, msg_key, octet_length(payload)::bigint AS size, attempts, \
     last_error, (extract(epoch FROM created_at) * 1000)::bigint AS created_ms, \
     (extract(epoch FROM parked_at) * 1000)::bigint AS parked_ms";

impl OutboxSql {
    pub(crate) fn new(table: &TableName) -> OutboxSql {
        let t = table.beside(OUTBOX_TABLE);
        OutboxSql {
            channel: channel(table),
            idle: format!(
                "UPDATE {wake} SET idle = $1 WHERE idle <> $1",
                wake = table.beside(WAKE_TABLE)
            ),
            insert: format!(
                "INSERT INTO {t} (id, topic, msg_key, payload) VALUES ($1, $2, $3, $4) \
                 ON CONFLICT DO NOTHING"
            ),
            insert_with_headers: format!(
                "INSERT INTO {t} (id, topic, msg_key, payload, headers) \
                 VALUES ($1, $2, $3, $4, $5::json) ON CONFLICT DO NOTHING"
            ),
            // The heads of the oldest keys waiting: in commit-ish order from
            // just past `$1`, the sendable rows with no older row of their
            // key at all (one parked, backing off, or being sent by another
            // relay), locked unless another relay holds them, up to `$2`.
            // Rows skipped do not count, so a blocked or busy key's backlog
            // hides no other key (it costs the scan an index probe per row
            // passed over). A relay thus owns a key from its head, and no two
            // relays ever send one key's messages at once. `more` says
            // whether the key has later rows (read by `batch`).
            //
            // The per-key probes compare `seq + 0`, which no index on `seq`
            // serves, and the `NOT EXISTS` has an `OFFSET 0`, which keeps
            // it a subplan run per candidate instead of a join the planner
            // picks: each is then an index probe of `(msg_key, seq)`, a few
            // entries per key. Under churn the planner, believing the table
            // nearly empty, otherwise read every older row (dead ones
            // included) once per candidate, by a sequential scan, a walk of
            // the primary key or a whole scan of the key index: minutes of
            // CPU per pass (auto_explain caught all three).
            heads: format!(
                "SELECT {ROW_COLUMNS},\n\
                 \x20      EXISTS (SELECT 1 FROM {t} n WHERE n.msg_key = o.msg_key AND n.seq + 0 > o.seq) AS more\n\
                 FROM {t} o\n\
                 WHERE o.seq > $1 AND o.parked_at IS NULL AND (o.retry_at IS NULL OR o.retry_at <= now())\n\
                 \x20 AND NOT EXISTS (SELECT 1 FROM {t} p WHERE p.msg_key = o.msg_key AND p.seq + 0 < o.seq OFFSET 0)\n\
                 ORDER BY o.seq LIMIT $2\n\
                 FOR UPDATE OF o SKIP LOCKED"
            ),
            // The later rows of owned keys, oldest first: nobody else's,
            // since they are not heads. Each key's run stops before its
            // first row that cannot go now (parked, or waiting out a retry
            // backoff), so no message overtakes an earlier one of its key.
            // Ordered and probed by `seq + 0` for the same reason as the
            // heads: through `(msg_key, seq)`, never a walk of the primary
            // key.
            batch: format!(
                "SELECT {ROW_COLUMNS} FROM {t} o\n\
                 WHERE o.msg_key = ANY($1) AND o.seq <> ALL($2)\n\
                 \x20 AND NOT EXISTS (SELECT 1 FROM {t} p WHERE p.msg_key = o.msg_key AND p.seq + 0 <= o.seq\n\
                 \x20   AND (p.parked_at IS NOT NULL OR p.retry_at > now()) OFFSET 0)\n\
                 ORDER BY o.seq + 0 LIMIT $3 FOR UPDATE"
            ),
            delete: format!("DELETE FROM {t} WHERE seq = ANY($1)"),
            // A failed send: `park` says whether the broker refused it
            // (parked) or could not take it now (retried after `retry_ms`).
            failed: format!(
                "UPDATE {t} AS o SET attempts = o.attempts + 1, last_error = f.reason,\n\
                 \x20   retry_at = CASE WHEN f.park THEN NULL\n\
                 \x20                   ELSE now() + f.retry_ms * interval '1 millisecond' END,\n\
                 \x20   parked_at = CASE WHEN f.park THEN now() END\n\
                 FROM unnest($1::bigint[], $2::text[], $3::boolean[], $4::bigint[]) AS f(seq, reason, park, retry_ms)\n\
                 WHERE o.seq = f.seq"
            ),
            parked: format!(
                "SELECT {PARKED_COLUMNS} FROM {t} WHERE parked_at IS NOT NULL ORDER BY seq LIMIT $1"
            ),
            retry: format!(
                "UPDATE {t} SET parked_at = NULL, retry_at = NULL WHERE id = $1 AND parked_at IS NOT NULL"
            ),
            retry_all: format!(
                "UPDATE {t} SET parked_at = NULL, retry_at = NULL WHERE parked_at IS NOT NULL"
            ),
            drop: format!(
                "DELETE FROM {t} WHERE id = $1 AND parked_at IS NOT NULL RETURNING {PARKED_COLUMNS}"
            ),
            backlog: format!(
                "SELECT count(*) FILTER (WHERE parked_at IS NULL) AS pending,\n\
                 \x20      count(*) FILTER (WHERE parked_at IS NOT NULL) AS parked,\n\
                 \x20      ceil(extract(epoch FROM now() - min(created_at) FILTER (WHERE parked_at IS NULL)) * 1000)::bigint AS oldest_ms\n\
                 FROM {t}"
            ),
            table: t,
        }
    }
}
