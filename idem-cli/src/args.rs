//! The command line, as clap parses it.

use clap::{Args, Parser, Subcommand};
use idem_core::KeyState;
use std::time::Duration;

/// Inspect, forget and scan idem's idempotency records in Redis, PostgreSQL
/// or DynamoDB.
///
/// Exit codes: 0 done; 1 no such record; 2 bad arguments or URL; 3 refused,
/// the key is in flight (use --force only for a dead holder); 4 the record
/// is unreadable (not idem's, or damaged; nothing deleted); 5 the store
/// (Redis, PostgreSQL or DynamoDB) unreachable or refused the command; 6
/// anything else.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) target: Target,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Args)]
pub(crate) struct Target {
    /// Standalone Redis URL [default: $REDIS_URL, then redis://127.0.0.1:6379/].
    #[arg(long, global = true, env = "REDIS_URL", conflicts_with = "cluster")]
    pub(crate) redis: Option<String>,
    /// A Redis Cluster node URL (repeat for more nodes).
    #[arg(long, global = true, num_args = 1..)]
    pub(crate) cluster: Vec<String>,
    /// A PostgreSQL URL (idem-postgres's PgStore): used instead of Redis,
    /// even when $REDIS_URL is set.
    #[arg(long, global = true, conflicts_with = "cluster")]
    pub(crate) postgres: Option<String>,
    /// A DynamoDB table (idem-dynamodb's DynamoStore): used instead of
    /// Redis. Region, credentials and endpoint come from the standard AWS
    /// environment and config files (AWS_REGION, AWS_PROFILE,
    /// AWS_ENDPOINT_URL_DYNAMODB, ...).
    #[arg(long, global = true, value_name = "TABLE", conflicts_with_all = ["cluster", "postgres"])]
    pub(crate) dynamodb: Option<String>,
    /// The DynamoDB table's partition key attribute, with --dynamodb.
    #[arg(long, global = true, default_value = idem_dynamodb::DEFAULT_KEY_ATTRIBUTE, requires = "dynamodb")]
    pub(crate) key_attribute: String,
    /// The prefix of idem's items in a shared DynamoDB table
    /// (`DynamoStoreConfig::key_prefix`), with --dynamodb.
    #[arg(long, global = true, default_value = "", requires = "dynamodb")]
    pub(crate) key_prefix: String,
    /// The PostgreSQL table of the records (`PgStoreConfig::table`), with --postgres.
    #[arg(long, global = true, default_value = idem_postgres::DEFAULT_TABLE, requires = "postgres")]
    pub(crate) table: String,
    /// The namespace the service was built with (`Idempotency::builder(..).namespace(..)`).
    #[arg(long, global = true, default_value = "idem")]
    pub(crate) namespace: String,
    /// The Redis outbox's key prefix (`RedisStore::with_outbox_prefix`).
    #[arg(long, global = true, default_value = "idem-outbox")]
    pub(crate) outbox_prefix: String,
    /// Machine-readable output: one JSON object (scan: one per line).
    #[arg(long, global = true)]
    pub(crate) json: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Show one key's record: state, attempt, TTL and lease left, sizes.
    Inspect {
        /// The operation's scope, as in `idem.call(scope, key)`.
        scope: String,
        /// The idempotency key.
        key: String,
        /// Also print the stored value.
        #[arg(long)]
        value: bool,
    },
    /// Delete one key's record so that the next call runs the body again.
    Forget {
        /// The operation's scope.
        scope: String,
        /// The idempotency key.
        key: String,
        /// Delete even while a holder's lease is live (only for a dead holder).
        #[arg(long)]
        force: bool,
    },
    /// List a scope's keys with their state (SCAN, never KEYS).
    Scan {
        /// The operation's scope.
        scope: String,
        /// Only records in this state: pending, completed, too_large, unserializable.
        #[arg(long)]
        state: Option<KeyState>,
        /// Only records claimed longer ago than this (`10m`, `2h`), counted
        /// from their remaining TTL against --ttl.
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// The result TTL the service uses, for --older-than.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "24h")]
        ttl: Duration,
        /// Print at most this many keys.
        #[arg(long, default_value_t = 1000)]
        limit: usize,
    },
    /// The outbox: beside the PostgreSQL table with --postgres, else the
    /// Redis store's (`outbox::stage`): what waits, and the messages the
    /// broker refused.
    #[command(subcommand)]
    Outbox(OutboxCommand),
}

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// Messages waiting and parked, and the age of the oldest waiting one.
    Status,
    /// The parked messages (refused by the broker), oldest first, with why.
    List {
        /// Print at most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Send a parked message again (after fixing its cause); its key's later
    /// messages follow it.
    Retry {
        /// The message id, as `list` shows it.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Every parked message.
        #[arg(long)]
        all: bool,
    },
    /// Delete a parked message for good (its key's later messages go on).
    Drop {
        /// The message id, as `list` shows it.
        id: String,
    },
}
