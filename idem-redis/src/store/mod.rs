//! `RedisStore`: a plain `SET NX GET` for the common claims, four Lua
//! scripts for the rest, one key each.

mod batch;
mod complete;
mod config;
mod durable;
mod notify;
mod operate;
pub(crate) mod outbox;
pub(crate) mod record;
mod reply;
mod scripts;

pub use self::config::RedisStoreConfig;

use self::complete::Server;
use self::notify::{Notifier, Source};
use self::record::{MS_DIGITS, PendingRecord, Record};
use self::reply::{
    answer_found, as_int, bad_url, classify, classify_claim, is_noscript, is_oom, parse_claim,
    parse_write, protocol, server_error,
};
use self::scripts::{Lua, SCRIPTS, invocation};
use async_trait::async_trait;
use idem_core::Durability;
use idem_core::Error;
use idem_core::store::Token;
use idem_core::store::{
    Capabilities, Claim, ClaimReply, Complete, DurableStore, Finish, InvalidationSink, KeyWatch,
    OperatorStore, RecordInfo, ScanPage, StepRecord, StepStore, Store, WatchStore, WriteReply,
    millis, store_lease,
};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, RedisError, ServerErrorKind, Value};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

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
/// let store = idem_redis::RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// let idem = idem_core::Idempotency::builder(store).namespace("payments").build();
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    conn: Conn,
    /// Wakes this process's waiters (and local caches): `None` for a store
    /// made from a connection (no URL to open a subscriber with).
    notifier: Option<Arc<Notifier>>,
    /// What the server is, how `complete` runs on it, and the pending
    /// records this process wrote (complete.rs).
    server: Arc<Server>,
    /// Where outgoing messages go (`outbox::stage`): the keys' common
    /// prefix (outbox.rs).
    outbox: Arc<str>,
    /// The connection durable calls wait on (durable.rs).
    durable: Arc<durable::DurableConn>,
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
    /// let store = idem_redis::RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<RedisStore, Error> {
        RedisStore::connect_with(url, RedisStoreConfig::default()).await
    }

    /// Connects to a standalone Redis with explicit timeouts.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// use idem_redis::{RedisStore, RedisStoreConfig};
    /// let cfg = RedisStoreConfig::default().response_timeout(std::time::Duration::from_millis(200));
    /// let store = RedisStore::connect_with("redis://127.0.0.1:6379/", cfg).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_with(url: &str, config: RedisStoreConfig) -> Result<RedisStore, Error> {
        let client = redis::Client::open(url).map_err(bad_url)?;
        // The subscriber speaks RESP3, whose pushes share the connection
        // with replies; the store's own connection keeps the URL's choice.
        let info = client.get_connection_info().clone();
        let resp3 = info
            .redis_settings()
            .clone()
            .set_protocol(redis::ProtocolVersion::RESP3);
        let info = info.set_redis_settings(resp3);
        let subscriber = redis::Client::open(info).map_err(bad_url)?;
        let notifier = Notifier::new(Source::Single(subscriber), config.clone());
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connection_timeout))
            .set_response_timeout(Some(config.response_timeout))
            .set_number_of_retries(config.reconnect_retries)
            .set_max_delay(Duration::from_millis(500));
        let durable = durable::DurableConn::single(client.clone(), &config);
        let manager = ConnectionManager::new_with_config(client, manager_config)
            .await
            .map_err(|e| classify("connect", e))?;
        let mut store = RedisStore {
            conn: Conn::Single(manager),
            notifier: Some(Arc::new(notifier)),
            server: Arc::new(Server::unknown()),
            outbox: Arc::from(outbox::DEFAULT_PREFIX),
            durable: Arc::new(durable),
        };
        store.load_scripts().await?;
        store.server = Arc::new(store.detect_server().await);
        Ok(store)
    }

    /// Connects to a Redis Cluster given one or more of its nodes.
    ///
    /// Every script touches exactly one key, so any key works on any slot;
    /// see docs/operating.md (Redis Cluster) for how keys map to slots and how to co-locate them.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_redis::RedisStore::connect_cluster(&["redis://127.0.0.1:7001/", "redis://127.0.0.1:7002/"]).await?;
    /// # Ok(()) }
    /// ```
    pub async fn connect_cluster(urls: &[&str]) -> Result<RedisStore, Error> {
        RedisStore::connect_cluster_with(urls, RedisStoreConfig::default()).await
    }

    /// Connects to a Redis Cluster with explicit timeouts.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// use idem_redis::{RedisStore, RedisStoreConfig};
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
        let source = Source::Cluster(urls.iter().map(|u| (*u).to_owned()).collect());
        let notifier = Notifier::new(source, config.clone());
        let client = ClusterClient::builder(urls.iter().copied())
            .connection_timeout(config.connection_timeout)
            .response_timeout(config.response_timeout)
            .retries(u32::try_from(config.reconnect_retries).unwrap_or(u32::MAX))
            .max_retry_wait(500)
            .build()
            .map_err(bad_url)?;
        let durable = durable::DurableConn::cluster(urls, &config)?;
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| classify("connect", e))?;
        let mut store = RedisStore {
            conn: Conn::Cluster(conn),
            notifier: Some(Arc::new(notifier)),
            server: Arc::new(Server::unknown()),
            outbox: Arc::from(outbox::DEFAULT_PREFIX),
            durable: Arc::new(durable),
        };
        store.server = Arc::new(store.detect_server().await);
        Ok(store)
    }

    /// Wraps a `ConnectionManager` you configured yourself. Such a store
    /// has no URL to open a subscriber connection with: its waiters poll
    /// and its `forget`s reach no other process's local cache (use
    /// [`connect`](RedisStore::connect) for both). Its durable calls
    /// (`Durability`) wait on this same connection, so other calls queue
    /// behind their `WAIT`s, and it refuses `Durability::Fsynced` (it never
    /// asked the server whether it has `WAITAOF`).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let manager = redis::aio::ConnectionManager::new(client).await?;
    /// let store = idem_redis::RedisStore::from_manager(manager);
    /// # Ok(()) }
    /// ```
    pub fn from_manager(manager: ConnectionManager) -> RedisStore {
        RedisStore {
            conn: Conn::Single(manager),
            notifier: None,
            server: Arc::new(Server::unknown()),
            outbox: Arc::from(outbox::DEFAULT_PREFIX),
            durable: Arc::new(durable::DurableConn::shared(
                RedisStoreConfig::default().response_timeout,
            )),
        }
    }

    /// Wraps a cluster connection you configured yourself (waiters poll;
    /// see [`from_manager`](RedisStore::from_manager)).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::cluster::ClusterClient::new(vec!["redis://127.0.0.1:7001/"])?;
    /// let store = idem_redis::RedisStore::from_cluster(client.get_async_connection().await?);
    /// # Ok(()) }
    /// ```
    pub fn from_cluster(conn: ClusterConnection) -> RedisStore {
        RedisStore {
            conn: Conn::Cluster(conn),
            notifier: None,
            server: Arc::new(Server::unknown()),
            outbox: Arc::from(outbox::DEFAULT_PREFIX),
            durable: Arc::new(durable::DurableConn::shared(
                RedisStoreConfig::default().response_timeout,
            )),
        }
    }

    /// Loads the services' scripts now, so the first call of each is one
    /// round trip.
    async fn load_scripts(&self) -> Result<(), Error> {
        let s = &*SCRIPTS;
        for lua in [
            &s.claim,
            &s.complete,
            &s.complete_batch,
            &s.release,
            &s.extend,
            &s.failure,
            &s.step,
            &s.suspend,
            &s.rider,
        ] {
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
            Err(e) if is_noscript(&e) => match self.reload(lua, key).await {
                Ok(()) => self.send(cmd).await,
                Err(e) => Err(e),
            },
            other => other,
        };
        reply.map_err(|e| classify(op, e))
    }

    /// Loads `lua` again on `key`'s node, after a `NOSCRIPT`.
    async fn reload(&self, lua: &Lua, key: &str) -> Result<(), RedisError> {
        match &self.conn {
            Conn::Single(c) => lua.script.load_async(&mut c.clone()).await.map(drop),
            // To the key's own primary only: redis-rs sends a plain
            // SCRIPT LOAD to every primary, which fails while any
            // one of them is down, healthy slots included.
            Conn::Cluster(c) => {
                let mut load = redis::cmd("SCRIPT");
                load.arg("LOAD").arg(lua.source);
                let node = Route::with_key(key, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(node));
                c.clone().route_command(load, routing).await.map(drop)
            }
        }
    }

    /// A claim as [`Store::claim`] answers it, without durability.
    async fn claim_plain(&self, claim: Claim<'_>) -> Result<ClaimReply, Error> {
        let (record, ttl) = record::pending_record(&claim);
        match self.set_nx_get(&claim, &record, ttl).await {
            Ok((None, _)) => Ok(ClaimReply::Acquired { attempt: 1 }),
            Ok((Some(found), pttl)) => match record::decode(found, pttl)? {
                // Someone holds it, or held it and stopped (a takeover), or
                // it is our own claim re-sent: the script decides atomically.
                // Boxed, as the OOM path below: the paths a fresh claim and
                // a replay take keep their future small (async_trait's
                // box is allocated and written on every claim).
                Record::Pending(_) => Box::pin(self.claim_contended(&claim, record, ttl)).await,
                completed => answer_found(completed, &claim, pttl)
                    .ok_or_else(|| protocol("claim", &Value::Nil)),
            },
            // A full Redis refuses the write before it runs, but the record
            // there still answers every case that needs no write: a
            // completed record replays, a live holder is InProgress (not
            // "unavailable": with FailMode::Open that would run the body
            // beside it). Only an absent record or an expired lease, which
            // need a write, keep the OOM error for the fail mode to decide.
            Err(e) if is_oom(&e) => match Box::pin(self.read_record(claim.key)).await {
                Some((Ok(found), pttl)) => answer_found(found, &claim, pttl).ok_or(e),
                Some((Err(corrupt), _)) => Err(corrupt),
                None => Err(e),
            },
            Err(e) => Err(e),
        }
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
        let set = batch::set_nx_get_cmd(claim.key, record, ttl);
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
        let lua = &SCRIPTS.claim;
        let waiting = self.waited_on(claim.key);
        let cmd = batch::claim_script_cmd(claim, &record, ttl, waiting);
        parse_claim(self.eval("claim", lua, claim.key, &cmd).await?)
    }

    /// Whether a caller in this process is subscribed to `key` (a
    /// `Call::wait` between its `watch` and its end): its claims, sent
    /// after the subscription is active, mark a record another token holds
    /// (lua/README.md, "The waiter mark"), and `complete` publishes only
    /// for marked records. So a complete that lands before the marking
    /// claim is seen by that claim; one after it publishes to a
    /// subscription already there: no wake-up is lost.
    fn waited_on(&self, key: &str) -> bool {
        self.notifier.as_ref().is_some_and(|n| n.watches(key))
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

#[async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    // Written out as `async_trait` expands it, so that each path boxes
    // its own future: an `async fn` would hold both (the confirmed one,
    // with its fence, `WAIT` and retries, is the larger). And each is an
    // `async` block, not the call's future itself: a block is written
    // straight into its box, where a future returned by a call is built
    // on the stack and copied whole (1.8 KB, a `memcpy` per claim).
    // Measured with callgrind: a replay's client-side instructions.
    fn claim<'s, 'c, 'f>(
        &'s self,
        claim: Claim<'c>,
    ) -> Pin<Box<dyn Future<Output = Result<ClaimReply, Error>> + Send + 'f>>
    where
        's: 'f,
        'c: 'f,
        Self: 'f,
    {
        if claim.durability.is_async() {
            Box::pin(async move { self.claim_plain(claim).await })
        } else {
            Box::pin(async move { self.claim_confirmed(claim, claim.durability).await })
        }
    }

    /// complete.rs: on Valkey 8.1+ and Redis 8.4+, one plain `SET … IFEQ`
    /// of the record the claim wrote; the script when that does not match,
    /// the server has no `IFEQ`, or the record is not as claimed.
    async fn complete(&self, complete: Complete<'_>) -> Result<WriteReply, Error> {
        self.complete_request(complete).await
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

    async fn claim_batch(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        self.claim_many(claims).await
    }

    async fn finish_batch(&self, ops: &[Finish<'_>]) -> Vec<Result<WriteReply, Error>> {
        self.finish_many(ops, None).await.0
    }

    fn capabilities(&self) -> Capabilities<'_> {
        let caps = Capabilities::none()
            .steps(self)
            .operator(self)
            .durable(self)
            .outbox(true);
        // A store made from a connection has no subscriber: waiters poll.
        match &self.notifier {
            Some(_) => caps.watch(self),
            None => caps,
        }
    }
}

#[async_trait]
impl StepStore for RedisStore {
    /// The `step` script: one round trip, as a complete.
    async fn save_step(
        &self,
        key: &str,
        token: &Token,
        name: &str,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let lua = &SCRIPTS.step;
        let mut cmd = invocation(lua.script.get_hash(), key, 3, 32 + name.len() + value.len());
        cmd.arg(token.as_bytes().as_slice()).arg(name).arg(value);
        parse_write("step", self.eval("step", lua, key, &cmd).await?)
    }

    /// A plain `GET`, decoded here: no script.
    async fn steps(&self, key: &str, token: &Token) -> Result<Option<Vec<StepRecord>>, Error> {
        let mut get = redis::cmd("GET");
        get.arg(key);
        let found = match self.send(&get).await.map_err(|e| classify("steps", e))? {
            Value::Nil => return Ok(None),
            Value::BulkString(raw) => raw,
            other => return Err(protocol("steps", &other)),
        };
        Ok(match record::decode(found, -1)? {
            Record::Pending(p) if p.token == *token.as_bytes() => Some(p.steps),
            _ => None,
        })
    }

    async fn suspend(&self, key: &str, token: &Token) -> Result<WriteReply, Error> {
        let lua = &SCRIPTS.suspend;
        let mut cmd = invocation(lua.script.get_hash(), key, 1, 32);
        cmd.arg(token.as_bytes().as_slice());
        parse_write("suspend", self.eval("suspend", lua, key, &cmd).await?)
    }
}

#[async_trait]
impl OperatorStore for RedisStore {
    async fn inspect(&self, key: &str, with_value: bool) -> Result<Option<RecordInfo>, Error> {
        self.inspect_key(key, with_value).await
    }

    async fn forget(&self, key: &str, force: bool) -> Result<Option<RecordInfo>, Error> {
        let forgotten = self.forget_key(key, force).await?;
        self.reset_failures(key).await;
        Ok(forgotten)
    }

    async fn scan(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        self.scan_prefix(prefix, cursor, count).await
    }

    async fn count_failure(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        self.count_failure_key(key, ttl).await
    }
}

#[async_trait]
impl WatchStore for RedisStore {
    async fn watch(&self, key: &str) -> Option<KeyWatch> {
        self.notifier.as_ref()?.watch(key).await
    }

    async fn watch_forgotten(&self, prefix: &str, sink: InvalidationSink) -> bool {
        match &self.notifier {
            Some(n) => n.watch_forgotten(prefix, sink).await,
            None => false,
        }
    }
}

#[async_trait]
impl DurableStore for RedisStore {
    fn check_durability(&self, durability: Durability) -> Result<(), Error> {
        self.can_give(durability)
    }

    async fn confirm(&self, key: &str, durability: Durability) -> Result<(), Error> {
        if durability.is_async() {
            return Ok(());
        }
        self.confirm_key(key, durability).await
    }
}
