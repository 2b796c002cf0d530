//! Test support for `idem`: real `redis-server` processes, 3-master Redis
//! clusters, a fault-injecting TCP proxy, and the one context every test
//! builds on.
//!
//! This crate is dev-only (`publish = false`). It is used by the integration
//! tests and benchmarks of the other crates in the workspace. Every setup
//! failure panics with a clear message (including the tail of the server log
//! where one exists): that is the right behaviour for test support code.
//!
//! * [`TestContext`]: a private server, a store on it (or a `MemoryStore`),
//!   idem over that store and a [`Ledger`]; optionally a [`FaultProxy`]
//!   between store and server.
//! * [`Ledger`] and [`FileLedger`]: exact counts of body runs per key, across
//!   tasks, and across OS processes through an `O_APPEND` file; [`Runs`]
//!   when a plain count is enough.
//! * [`LogCapture`]: what idem logs, captured to assert on.
//! * [`RecordState`], [`RecordPeek`], [`RedisServer::record`],
//!   [`RedisCluster::record`]: the one place tests read stored records.
//! * [`eventually`], [`Rng`], [`BodyError`]: polling without timing
//!   assertions, deterministic shuffles, a body error type.
//! * [`run_worker`], [`exit_with_parent`]: the child side of tests that
//!   re-execute their binary as worker processes.
//! * [`KafkaBroker`]: a Kafka-protocol broker (`tansu`) on a free port, in
//!   memory.
//! * [`NatsServer`], [`RabbitServer`]: a private NATS (JetStream) or
//!   RabbitMQ node on free ports, its data in a temporary directory that
//!   survives a restart, for tests that kill or restart the broker.
//! * [`RedisServer`]: one `redis-server` on a free port of `127.0.0.1`, no
//!   persistence, files in a temporary directory, killed on drop.
//! * [`RedisCluster`]: three such servers formed into a real cluster of three
//!   masters (no replicas), with helpers to restart a node and move a slot.
//! * [`FaultProxy`]: a TCP proxy that can add latency, stall, blackhole,
//!   drop or refuse connections.
//! * [`Monitor`]: the commands a server runs, in order (`MONITOR`), for
//!   tests that check the order of writes made on several connections.
//! * `otel::Traces` (feature `otel`): OpenTelemetry spans exported to
//!   memory and read back, with helpers to pick in them (`otel::attribute`,
//!   `otel::one`).
//!
//! ```no_run
//! use idem_testkit::TestContext;
//!
//! # async fn demo() {
//! let ctx = TestContext::redis().await.with_namespace("test");
//! let idem = ctx.idem();
//! let ledger = ctx.ledger().clone();
//! let v: u32 = idem
//!     .call("charge", "order-1")
//!     .run(|| async move {
//!         ledger.record("order-1");
//!         Ok::<_, idem_core::Error>(500)
//!     })
//!     .await
//!     .unwrap();
//! assert_eq!((v, ctx.ledger().count("order-1")), (500, 1));
//! assert!(ctx.record_state("test:charge:order-1").is_some_and(|s| s.is_completed()));
//! # }
//! ```
//!
//! The lower-level pieces work on their own too:
//!
//! ```no_run
//! use idem_testkit::{FaultProxy, RedisServer};
//!
//! let server = RedisServer::start();
//! assert_eq!(server.cli(&["PING"]), "PONG");
//! let proxy = FaultProxy::start(server.addr());
//! let client = redis::Client::open(proxy.url()).unwrap();
//! # let _ = client;
//! ```
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test support: a set-up that fails panics the test that asked for it"
)]

mod acl;
mod aws;
mod claims;
mod cluster;
mod context;
mod counting;
mod cpu;
mod dynamodb;
mod errors;
mod every_store;
mod kafka;
mod ledger;
mod logs;
mod monitor;
mod nats;
#[cfg(feature = "otel")]
pub mod otel;
mod poll;
mod ports;
mod postgres;
mod proxy;
mod rabbitmq;
mod record;
mod rng;
mod runs;
mod server;
mod spawn;
mod worker;

pub use acl::store_acl;
pub use aws::{
    AWS_ENDPOINT_ENV, IamMoto, aws_config, aws_endpoint, dynamodb_client, sqs_client, unique_name,
};
pub use claims::claim;
pub use cluster::{CLUSTER_SLOTS, RedisCluster, key_slot};
pub use context::TestContext;
pub use counting::{CountingStore, StoreCounts};
pub use cpu::process_cpu;
pub use dynamodb::DynamoTestTable;
pub use errors::{BodyError, is_typed_store_error, is_unavailable};
pub use kafka::{KafkaBroker, TANSU_INSTALL, require_tansu};
pub use ledger::{FileLedger, FileRun, Ledger, unix_ms};
pub use logs::LogCapture;
pub use monitor::Monitor;
pub use nats::{NatsServer, require_nats};
pub use poll::eventually;
pub use ports::free_port;
pub use postgres::{PgServer, PgTestDb, pg_admin_url};
pub use proxy::FaultProxy;
pub use rabbitmq::{RabbitServer, require_rabbitmq};
pub use record::{RecordPeek, RecordState, record_state};
pub use rng::Rng;
pub use runs::Runs;
pub use server::{RedisServer, SERVER_ENV, VALKEY_ENV, valkey_server};
pub use worker::{CHARGE_ONCE_SCRIPT, exit_with_parent, run_worker, worker_env};

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The message [`require_redis`] panics with when Redis is not installed.
const MISSING_REDIS: &str = "redis-server not found on PATH: install it with \
     `apt-get install redis-server`, or run .ci/run which does";

/// Paths of the two Redis binaries this crate runs.
#[derive(Debug, Clone)]
pub(crate) struct RedisBinaries {
    pub(crate) server: PathBuf,
    pub(crate) cli: PathBuf,
}

/// Looks `name` up on `PATH`, then in `/usr/bin` and `/usr/local/bin`.
fn find_binary(name: &str) -> Option<PathBuf> {
    let from_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    from_path
        .into_iter()
        // Debian puts nats-server and rabbitmq-server in /usr/sbin, which a
        // user's PATH lacks.
        .chain(
            ["/usr/bin", "/usr/local/bin", "/usr/sbin", "/usr/local/sbin"]
                .into_iter()
                .map(PathBuf::from),
        )
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

fn is_executable(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// The Redis binaries, or a panic with installation instructions.
/// [`server::SERVER_ENV`] names another server binary (Valkey); its
/// directory's `valkey-cli` or `redis-cli` is used with it when there is one.
pub(crate) fn redis_binaries() -> &'static RedisBinaries {
    static BINARIES: OnceLock<Option<RedisBinaries>> = OnceLock::new();
    BINARIES
        .get_or_init(|| match server::server_from_env() {
            Some(server) => Some(RedisBinaries {
                cli: server::cli_beside(&server).or_else(|| find_binary("redis-cli"))?,
                server,
            }),
            None => Some(RedisBinaries {
                server: find_binary("redis-server")?,
                cli: find_binary("redis-cli")?,
            }),
        })
        .as_ref()
        .unwrap_or_else(|| panic!("{MISSING_REDIS}"))
}

/// Panics with a clear message when `redis-server` or `redis-cli` is missing.
///
/// Both binaries are looked up on `PATH`, then in `/usr/bin` and
/// `/usr/local/bin`. [`RedisServer::start`] calls this first, so tests
/// rarely need to call it themselves; it is public for tests that want to
/// fail early, before any other setup.
///
/// # Panics
///
/// With "redis-server not found on PATH: install it with `apt-get install
/// redis-server`, or run .ci/run which does" when either binary is missing.
pub fn require_redis() {
    let _ = redis_binaries();
}
