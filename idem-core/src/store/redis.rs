//! `RedisStore`: the state machine as four Lua scripts, one key each.

use super::record::{self, FORMAT_VERSION, Record, decode_completed, unreadable, wrong_type};
use super::{Claim, ClaimReply, Store, ValueKind, WriteReply, millis, record_ttl, store_lease};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use crate::token::Token;
use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, RedisError, RedisWrite, Script, ServerErrorKind, ToRedisArgs, Value};
use std::io::Write;
use std::sync::LazyLock;
use std::time::Duration;

/// A script and its source: `EVALSHA` by hash, and the source to load on a
/// node that no longer has it.
struct Lua {
    script: Script,
    source: &'static str,
}

impl Lua {
    fn new(source: &'static str) -> Lua {
        Lua {
            script: Script::new(source),
            source,
        }
    }
}

struct Scripts {
    claim: Lua,
    complete: Lua,
    release: Lua,
    extend: Lua,
}

// Hashed once per process.
static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    claim: Lua::new(include_str!("../../../lua/claim.lua")),
    complete: Lua::new(include_str!("../../../lua/complete.lua")),
    release: Lua::new(include_str!("../../../lua/release.lua")),
    extend: Lua::new(include_str!("../../../lua/extend.lua")),
});

/// Timeouts and reconnection for [`RedisStore`].
///
/// ```
/// use idem_core::RedisStoreConfig;
/// use std::time::Duration;
/// let cfg = RedisStoreConfig::default().response_timeout(Duration::from_millis(250));
/// assert_eq!(cfg.get_response_timeout(), Duration::from_millis(250));
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    connection_timeout: Duration,
    response_timeout: Duration,
    reconnect_retries: usize,
}

impl Default for RedisStoreConfig {
    fn default() -> Self {
        RedisStoreConfig {
            connection_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            reconnect_retries: 1,
        }
    }
}

impl RedisStoreConfig {
    /// How long to wait for a TCP connection (default 1 s).
    ///
    /// ```
    /// let c = idem_core::RedisStoreConfig::default().connection_timeout(std::time::Duration::from_secs(2));
    /// assert_eq!(c.get_connection_timeout().as_secs(), 2);
    /// ```
    pub fn connection_timeout(mut self, d: Duration) -> Self {
        self.connection_timeout = d;
        self
    }

    /// How long to wait for one reply (default 1 s). A timed-out claim may
    /// still have landed; idem re-sends it with the same owner token, which
    /// the script answers as the same claim.
    ///
    /// ```
    /// let c = idem_core::RedisStoreConfig::default().response_timeout(std::time::Duration::from_millis(300));
    /// assert_eq!(c.get_response_timeout().as_millis(), 300);
    /// ```
    pub fn response_timeout(mut self, d: Duration) -> Self {
        self.response_timeout = d;
        self
    }

    /// How many reconnection attempts follow a dropped connection before a
    /// request fails (default 1; idem re-sends claims itself).
    ///
    /// ```
    /// let c = idem_core::RedisStoreConfig::default().reconnect_retries(5);
    /// assert_eq!(c.get_reconnect_retries(), 5);
    /// ```
    pub fn reconnect_retries(mut self, n: usize) -> Self {
        self.reconnect_retries = n;
        self
    }

    /// The connection timeout.
    ///
    /// ```
    /// assert_eq!(idem_core::RedisStoreConfig::default().get_connection_timeout().as_secs(), 1);
    /// ```
    pub fn get_connection_timeout(&self) -> Duration {
        self.connection_timeout
    }

    /// The response timeout.
    ///
    /// ```
    /// assert_eq!(idem_core::RedisStoreConfig::default().get_response_timeout().as_secs(), 1);
    /// ```
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// The reconnection attempts.
    ///
    /// ```
    /// assert_eq!(idem_core::RedisStoreConfig::default().get_reconnect_retries(), 1);
    /// ```
    pub fn get_reconnect_retries(&self) -> usize {
        self.reconnect_retries
    }
}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Records in Redis (standalone or Cluster), one compact string per key,
/// changed only by the Lua scripts in `lua/`.
///
/// Cheap to clone: clones share one multiplexed connection (standalone:
/// redis's `ConnectionManager`, which reconnects by itself; Cluster: one
/// connection per master, routed by key slot).
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// let store = idem_core::RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// let idem = idem_core::Idempotency::builder(store).namespace("payments").build();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.conn {
            Conn::Single(_) => "standalone",
            Conn::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore").field("mode", &kind).finish()
    }
}

impl RedisStore {
    /// Connects to a standalone Redis (7.0 or newer) with default timeouts.
    ///
    /// Fails with [`Error::InvalidConfig`] for a malformed URL and
    /// [`Error::Unavailable`] when Redis cannot be reached.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_core::RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        RedisStore::connect_with(url, RedisStoreConfig::default()).await
    }

    /// Connects to a standalone Redis with explicit timeouts.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// use idem_core::{RedisStore, RedisStoreConfig};
    /// let cfg = RedisStoreConfig::default().response_timeout(std::time::Duration::from_millis(200));
    /// let store = RedisStore::connect_with("redis://127.0.0.1:6379/", cfg).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(url: &str, config: RedisStoreConfig) -> Result<RedisStore, Error> {
        let client = redis::Client::open(url).map_err(bad_url)?;
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connection_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(config.reconnect_retries)
            .set_max_delay(Duration::from_millis(500));
        let manager = ConnectionManager::new_with_config(client, manager_config)
            .await
            .map_err(|e| classify("connect", e))?;
        let store = RedisStore {
            conn: Conn::Single(manager),
        };
        store.load_scripts().await?;
        Ok(store)
    }

    /// Connects to a Redis Cluster given one or more of its nodes.
    ///
    /// Every script touches exactly one key, so any key works on any slot;
    /// see the README for how keys map to slots and how to co-locate them.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_core::RedisStore::connect_cluster(&["redis://127.0.0.1:7001/", "redis://127.0.0.1:7002/"]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster(urls: &[&str]) -> Result<RedisStore, Error> {
        RedisStore::connect_cluster_with(urls, RedisStoreConfig::default()).await
    }

    /// Connects to a Redis Cluster with explicit timeouts.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// use idem_core::{RedisStore, RedisStoreConfig};
    /// let store = RedisStore::connect_cluster_with(&["redis://127.0.0.1:7001/"], RedisStoreConfig::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster_with(
        urls: &[&str],
        config: RedisStoreConfig,
    ) -> Result<RedisStore, Error> {
        if urls.is_empty() {
            return Err(Error::InvalidConfig(
                "connect_cluster needs at least one node URL".to_owned(),
            ));
        }
        let client = ClusterClient::builder(urls.iter().copied())
            .connection_timeout(config.connection_timeout)
            .response_timeout(config.response_timeout)
            .retries(u32::try_from(config.reconnect_retries).unwrap_or(u32::MAX))
            .max_retry_wait(500)
            .build()
            .map_err(bad_url)?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| classify("connect", e))?;
        Ok(RedisStore {
            conn: Conn::Cluster(conn),
        })
    }

    /// Wraps a `ConnectionManager` you configured yourself.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client).await?;
    /// let store = idem_core::RedisStore::from_manager(manager);
    /// # Ok(()) }
    /// ```
    pub fn from_manager(manager: ConnectionManager) -> RedisStore {
        RedisStore {
            conn: Conn::Single(manager),
        }
    }

    /// Wraps a cluster connection you configured yourself.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::cluster::ClusterClient::new(vec!["redis://127.0.0.1:7001/"])?;
    /// let store = idem_core::RedisStore::from_cluster(client.get_async_connection().await?);
    /// # Ok(()) }
    /// ```
    pub fn from_cluster(conn: ClusterConnection) -> RedisStore {
        RedisStore {
            conn: Conn::Cluster(conn),
        }
    }

    /// Loads the four scripts now, so the first call of each is one round trip.
    async fn load_scripts(&self) -> Result<(), Error> {
        let s = &*SCRIPTS;
        for lua in [&s.claim, &s.complete, &s.release, &s.extend] {
            let loaded = match &self.conn {
                Conn::Single(c) => lua.script.load_async(&mut c.clone()).await,
                Conn::Cluster(c) => lua.script.load_async(&mut c.clone()).await,
            };
            loaded.map_err(|e| classify("connect", e))?;
        }
        // Fresh claims and replays need no script, so a user without
        // EVALSHA would see bodies run and then fail to store: refuse at
        // connect instead. With no key the script itself answers an error
        // (argument check); only the ACL answers NOPERM.
        let probe = redis::cmd("EVALSHA")
            .arg(s.extend.script.get_hash())
            .arg(0)
            .to_owned();
        match self.send(&probe).await {
            Err(e) if matches!(e.kind(), redis::ErrorKind::Server(ServerErrorKind::NoPerm)) => {
                Err(classify("connect", e))
            }
            _ => Ok(()),
        }
    }

    /// Sends one command and turns a top-level error reply into an `Err`.
    async fn send(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        server_error(match &self.conn {
            // The manager's own method: `ConnectionLike::req_packed_command`
            // would box one more future per call.
            Conn::Single(c) => c.clone().send_packed_command(cmd).await,
            Conn::Cluster(c) => {
                redis::aio::ConnectionLike::req_packed_command(&mut c.clone(), cmd).await
            }
        })
    }

    /// Sends `cmd` (from [`invocation`]: `lua` on `key`) and, when Redis no longer has
    /// the script (`NOSCRIPT`: SCRIPT FLUSH, restart, fail-over), loads it on
    /// the key's node and sends the same command once more.
    async fn eval(
        &self,
        op: &'static str,
        lua: &Lua,
        key: &str,
        cmd: &Cmd,
    ) -> Result<Value, Error> {
        let reply = match self.send(cmd).await {
            Err(e) if is_noscript(&e) => {
                let loaded = match &self.conn {
                    Conn::Single(c) => lua.script.load_async(&mut c.clone()).await.map(drop),
                    // To the key's own primary only: redis-rs sends a plain
                    // SCRIPT LOAD to every primary, which fails while any
                    // one of them is down, healthy slots included.
                    Conn::Cluster(c) => {
                        let mut load = redis::cmd("SCRIPT");
                        load.arg("LOAD").arg(lua.source);
                        let node = Route::with_key(key, SlotAddr::Master);
                        let routing =
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(node));
                        c.clone().route_command(load, routing).await.map(drop)
                    }
                };
                match loaded {
                    Ok(()) => self.send(cmd).await,
                    Err(e) => Err(e),
                }
            }
            other => other,
        };
        reply.map_err(|e| classify(op, e))
    }

    /// The common paths of a claim as one plain command, no script:
    /// `SET key pending NX PX ttl GET` creates a fresh record (nil) or hands
    /// back the one there without writing. With `PTTL` pipelined in the same
    /// round trip when the remaining TTL is wanted (the local cache).
    async fn set_nx_get(
        &self,
        claim: &Claim<'_>,
        record: &PendingRecord<'_>,
        ttl: u64,
    ) -> Result<(Option<Vec<u8>>, i64), Error> {
        let mut set = Cmd::with_capacity(7, 3 + claim.key.len() + 3 + 16 + 32 + 2 * MS_DIGITS + 12);
        set.arg("SET")
            .arg(claim.key)
            .arg(record)
            .arg("NX")
            .arg("PX")
            .arg(ttl)
            .arg("GET");
        let (found, pttl) = if claim.want_ttl_left {
            let mut pipe = redis::pipe();
            pipe.add_command(set).cmd("PTTL").arg(claim.key);
            let replies: redis::RedisResult<Vec<Value>> = match &self.conn {
                Conn::Single(c) => pipe.query_async(&mut c.clone()).await,
                Conn::Cluster(c) => pipe.query_async(&mut c.clone()).await,
            };
            let mut replies = replies.map_err(classify_claim)?.into_iter();
            let found = server_error(Ok(replies.next().unwrap_or(Value::Nil)));
            let pttl = as_int(replies.next().as_ref()).unwrap_or(-1);
            (found, pttl)
        } else {
            (self.send(&set).await, -1)
        };
        match found.map_err(classify_claim)? {
            Value::Nil => Ok((None, pttl)),
            Value::BulkString(found) => Ok((Some(found), pttl)),
            other => Err(protocol("claim", &other)),
        }
    }

    /// The rare path of a claim, when a pending record is there: the claim
    /// script, which answers InProgress, takes an expired lease over
    /// (attempt + 1) or restarts our own re-sent claim, atomically.
    async fn claim_contended(
        &self,
        claim: &Claim<'_>,
        record: PendingRecord<'_>,
        ttl: u64,
    ) -> Result<ClaimReply, Error> {
        let want = if claim.want_ttl_left { "1" } else { "0" };
        let lua = &SCRIPTS.claim;
        let mut cmd = invocation(
            lua.script.get_hash(),
            claim.key,
            3,
            3 + 16 + 32 + 2 * MS_DIGITS + 3,
        );
        cmd.arg(record).arg(ttl).arg(want);
        parse_claim(self.eval("claim", lua, claim.key, &cmd).await?)
    }

    /// The record of `key` and its `PTTL`, read with plain `GET` and `PTTL`
    /// (allowed when Redis is out of memory); `None` when there is none or
    /// Redis does not answer.
    async fn read_record(&self, key: &str) -> Option<(Result<Record, Error>, i64)> {
        let mut pipe = redis::pipe();
        pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        let read: redis::RedisResult<(Option<Vec<u8>>, i64)> = match &self.conn {
            Conn::Single(c) => pipe.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => pipe.query_async(&mut c.clone()).await,
        };
        let (record, ttl) = read.ok()?;
        Some((record::decode(record?, ttl), ttl))
    }
}

/// `EVALSHA <sha1> 1 <key>`, sized for `extra` more bytes in `args` more
/// arguments: the command is written once, straight into the buffer the
/// connection packs from (`ScriptInvocation` first copies every key and
/// argument into a `Vec<Vec<u8>>` of its own).
fn invocation(hash: &str, key: &str, args: usize, extra: usize) -> Cmd {
    let mut cmd = Cmd::with_capacity(4 + args, 7 + hash.len() + 1 + key.len() + extra);
    cmd.arg("EVALSHA").arg(hash).arg("1").arg(key);
    cmd
}

/// The claim's answer from a record it found, when no write is needed: a
/// completed record (or a mismatch), and, for a claim refused for lack of
/// memory, a live holder. `None` when only a write could answer (an
/// expired lease to take over).
fn answer_found(found: Record, claim: &Claim<'_>, ttl_left_ms: i64) -> Option<ClaimReply> {
    let given = claim.fingerprint;
    let mismatch =
        |stored: Option<Fingerprint>| matches!((given, stored), (Some(a), Some(b)) if *a != b);
    match found {
        Record::Completed(done) if mismatch(done.fingerprint) => Some(ClaimReply::Mismatch),
        Record::Completed(done) => Some(ClaimReply::Completed(done)),
        Record::Pending(p) if mismatch(p.fingerprint) => Some(ClaimReply::Mismatch),
        // Our own claim landed before: the same claim.
        Record::Pending(p) if p.token == *claim.token.as_bytes() => {
            Some(ClaimReply::Acquired { attempt: p.attempt })
        }
        Record::Pending(p) => {
            let left = u64::try_from(ttl_left_ms).ok()?.checked_sub(p.lease_end)?;
            (left > 0).then(|| ClaimReply::InProgress {
                retry_after: Duration::from_millis(left),
            })
        }
    }
}

/// A pending record (lua/README.md), built here so that the script's fast
/// path is a single `SET NX GET` of it, like the floor it is measured against.
struct PendingRecord<'a> {
    fingerprint: &'a [u8],
    token: &'a Token,
    lease_end: u64,
}

impl ToRedisArgs for PendingRecord<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut w = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail; the length
        // byte is at most 16 (`Fingerprint`) and the script checks it.
        let _ = w.write_all(&[FORMAT_VERSION, b'P', self.fingerprint.len() as u8]);
        let _ = w.write_all(self.fingerprint);
        let _ = w.write_all(self.token.as_bytes());
        let _ = write!(w, "{}:1", self.lease_end);
    }
}

/// A completed record (lua/README.md), written into the command as one
/// argument without first assembling it in a buffer of its own.
struct CompletedRecord<'a> {
    kind: ValueKind,
    fingerprint: &'a [u8],
    value: &'a [u8],
}

impl ToRedisArgs for CompletedRecord<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut w = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail. The length
        // byte is at most 16 (`Fingerprint`) and the scripts check it.
        let _ = w.write_all(&[
            FORMAT_VERSION,
            self.kind.tag(),
            self.fingerprint.len() as u8,
        ]);
        let _ = w.write_all(self.fingerprint);
        let _ = w.write_all(self.value);
    }
}

/// A top-level error reply as an `Err`, as `Cmd::query_async` would give it
/// (the scripts never put errors inside an array).
fn server_error(reply: Result<Value, RedisError>) -> Result<Value, RedisError> {
    match reply? {
        Value::ServerError(e) => Err(e.into()),
        v => Ok(v),
    }
}

/// How `classify` starts the reason of an `OOM` refusal.
const OOM_REASON: &str = "Redis is out of memory";

fn is_oom(e: &Error) -> bool {
    matches!(e, Error::Unavailable { reason, .. } if reason.starts_with(OOM_REASON))
}

fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript)
}

/// Decimal digits of a millisecond count (at most 20).
const MS_DIGITS: usize = 20;

fn bad_url(e: RedisError) -> Error {
    // The URL itself is not repeated: it may carry a password.
    Error::InvalidConfig(format!(
        "the Redis URL cannot be used: {e}; expected redis://[user:password@]host:port/[db]"
    ))
}

/// A refused `SET`: another Redis type under the key is a corrupt record,
/// as the scripts report it; the rest as any error.
fn classify_claim(e: RedisError) -> Error {
    if e.code() == Some("WRONGTYPE") {
        return wrong_type();
    }
    classify("claim", e)
}

fn classify(op: &'static str, e: RedisError) -> Error {
    // Redis refuses a command called by a script with ERR, not NOPERM.
    let denied = matches!(e.kind(), redis::ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.to_string().contains("can't run this command");
    let reason = match e.kind() {
        _ if denied => format!(
            "Redis ACL denied the command ({e}); grant the commands listed in the README's ACL section"
        ),
        _ if e.code() == Some("OOM") => {
            format!("{OOM_REASON} and refuses new records ({e}); raise maxmemory or free keys")
        }
        _ if e.is_timeout() => format!("no reply within the response timeout ({e})"),
        _ => e.to_string(),
    };
    Error::unavailable(op, reason)
}

fn protocol(op: &'static str, v: &Value) -> Error {
    Error::unavailable(
        op,
        format!("unexpected reply from the idem script: {v:?}; is this Redis 7 or newer?"),
    )
}

fn as_int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}

fn parse_claim(v: Value) -> Result<ClaimReply, Error> {
    let mut items = match v {
        // The fast path: a fresh key, created.
        Value::Int(1) => return Ok(ClaimReply::Acquired { attempt: 1 }),
        Value::Array(items) => items,
        other => return Err(protocol("claim", &other)),
    };
    let code = as_int(items.first());
    let reply = match (code, items.len()) {
        (Some(1), 2) => as_int(items.get(1)).map(|a| ClaimReply::Acquired {
            attempt: u32::try_from(a).unwrap_or(u32::MAX),
        }),
        (Some(3), 2 | 3) => {
            let ttl = as_int(items.get(2)).unwrap_or(-1);
            return match items.swap_remove(1) {
                Value::BulkString(rec) => decode_completed(rec, ttl).map(ClaimReply::Completed),
                other => Err(protocol("claim", &other)),
            };
        }
        (Some(4), 2) => as_int(items.get(1)).map(|ms| ClaimReply::InProgress {
            retry_after: std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        }),
        (Some(5), 1) => Some(ClaimReply::Mismatch),
        (Some(6), 2) => {
            return match items.swap_remove(1) {
                Value::BulkString(rec) => Err(unreadable(&rec)),
                other => Err(protocol("claim", &other)),
            };
        }
        (Some(7), 1) => return Err(wrong_type()),
        _ => None,
    };
    reply.ok_or_else(|| protocol("claim", &Value::Array(items)))
}

fn parse_write(op: &'static str, v: Value) -> Result<WriteReply, Error> {
    match v {
        Value::Int(1) => Ok(WriteReply::Done),
        Value::Int(0) => Ok(WriteReply::Missing),
        Value::Int(2) => Ok(WriteReply::OtherOwner),
        Value::Int(3) => Ok(WriteReply::AlreadyCompleted),
        // The write scripts do not send the record back: say what it is not.
        Value::Int(6) => Err(Error::Corrupt(
            "the key holds bytes that are not an idem record this build can read (damaged, \
             another program's, or a newer idem's format); use a distinct namespace, or delete the key"
                .to_owned(),
        )),
        Value::Int(7) => Err(wrong_type()),
        other => Err(protocol(op, &other)),
    }
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let ttl = millis(record_ttl(claim.ttl, claim.lease));
        let record = PendingRecord {
            fingerprint: claim.fingerprint.map_or(&[], |f| f.as_bytes()),
            token: claim.token,
            // The lease ends when the key's remaining TTL falls to this: a
            // difference of durations, so no clock is read on either side.
            lease_end: ttl - millis(store_lease(claim.lease)),
        };
        match self.set_nx_get(&claim, &record, ttl).await {
            Ok((None, _)) => Ok(ClaimReply::Acquired { attempt: 1 }),
            Ok((Some(found), pttl)) => match record::decode(found, pttl)? {
                // Someone holds it, or held it and stopped (a takeover), or
                // it is our own claim re-sent: the script decides atomically.
                Record::Pending(_) => self.claim_contended(&claim, record, ttl).await,
                completed => answer_found(completed, &claim, pttl)
                    .ok_or_else(|| protocol("claim", &Value::Nil)),
            },
            // A full Redis refuses the write before it runs, but the record
            // there still answers every case that needs no write: a
            // completed record replays, a live holder is InProgress (not
            // "unavailable": with FailMode::Open that would run the body
            // beside it). Only an absent record or an expired lease, which
            // need a write, keep the OOM error for the fail mode to decide.
            Err(e) if is_oom(&e) => match self.read_record(claim.key).await {
                Some((Ok(found), pttl)) => answer_found(found, &claim, pttl).ok_or(e),
                Some((Err(corrupt), _)) => Err(corrupt),
                None => Err(e),
            },
            Err(e) => Err(e),
        }
    }

    async fn complete(
        &self,
        key: &str,
        token: &Token,
        fingerprint: Option<&Fingerprint>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let record = CompletedRecord {
            kind,
            fingerprint: fingerprint.map_or(&[], |f| f.as_bytes()),
            value,
        };
        let lua = &SCRIPTS.complete;
        let mut cmd = invocation(lua.script.get_hash(), key, 2, 32 + 3 + 16 + value.len());
        cmd.arg(token.as_bytes().as_slice()).arg(record);
        parse_write("complete", self.eval("complete", lua, key, &cmd).await?)
    }

    async fn release(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let lua = &SCRIPTS.release;
        let mut cmd = invocation(lua.script.get_hash(), key, 1, 32);
        cmd.arg(token.as_bytes().as_slice());
        parse_write("release", self.eval("release", lua, key, &cmd).await?)
    }

    async fn extend(&self, key: &str, token: &Token, lease: Duration) -> Result<WriteReply, Error> {
        let lua = &SCRIPTS.extend;
        let mut cmd = invocation(lua.script.get_hash(), key, 2, 32 + MS_DIGITS);
        cmd.arg(token.as_bytes().as_slice())
            .arg(millis(store_lease(lease)));
        parse_write("extend", self.eval("extend", lua, key, &cmd).await?)
    }
}
