//! Durability (`idem_core::Durability`) on Redis: `WAIT` (replicas) or
//! `WAITAOF` (fsynced append-only files), pipelined with the write it
//! confirms, behind a **fence**.
//!
//! `WAIT` and `WAITAOF` count only the writes of their own connection, so
//! a replay (a claim that only read a completed record) or a takeover that
//! read steps confirms nothing with them alone. Every durable pipeline
//! therefore writes a fence key on the record's slot right after its own
//! command and before the wait: the replication stream (and the
//! append-only file) is ordered, so once the fence is confirmed, every
//! write the primary applied before it is too — the record this caller
//! wrote, and the one it read, whoever wrote it.
//!
//! The pipelines run on a connection of their own, opened at the first
//! durable call: a `WAIT` blocks its connection on the server until the
//! copies confirm or it times out, and the store's shared connection
//! (every `Async` call, lease renewals) must not queue behind it.

use super::outbox::slot_tag;
use super::record::{Record, decode, pending_record};
use super::reply::{
    answer_found, classify, classify_claim, is_noscript_reply, is_oom, parse_claim, protocol,
    server_error,
};
use super::scripts::SCRIPTS;
use super::{Conn, RedisStore, batch};
use idem_core::store::{Claim, ClaimReply};
use idem_core::{Durability, Error, MAX_DURABILITY_TIMEOUT};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Value};
use std::time::Duration;

/// How long a fence key lives: long enough to outlast any wait
/// ([`MAX_DURABILITY_TIMEOUT`]), short enough that fences of slots no
/// longer used go away by themselves.
const FENCE_TTL: Duration = Duration::from_secs(120);

/// Durable pipelines in flight at most per store; more wait for a
/// connection (within their own deadline). Each holds a connection of its
/// own while its wait blocks it.
const MAX_DURABLE_CONNECTIONS: usize = 64;

/// The durable calls' connections: one per pipeline in flight, kept for
/// the next when it answered, opened on demand. A pipeline never shares
/// its connection: a `WAIT` blocks the connection on the server, so a
/// second pipeline behind it would wait for both timeouts.
pub(super) struct DurableConn {
    open: Open,
    idle: std::sync::Mutex<Vec<Conn>>,
    permits: tokio::sync::Semaphore,
    /// The store's response timeout: a durable pipeline may take it plus
    /// its durability's timeout.
    response_timeout: Duration,
}

enum Open {
    Single(redis::Client, ConnectionManagerConfig),
    Cluster(ClusterClient),
    /// A store made from a connection: no URL to open another with, so
    /// the waits share it, one at a time (documented on `from_manager`).
    Shared,
}

impl DurableConn {
    fn new(open: Open, response_timeout: Duration) -> DurableConn {
        let permits = match open {
            Open::Shared => 1,
            _ => MAX_DURABLE_CONNECTIONS,
        };
        DurableConn {
            open,
            idle: std::sync::Mutex::new(Vec::new()),
            permits: tokio::sync::Semaphore::new(permits),
            response_timeout,
        }
    }

    /// For a standalone store: managers on the same URL, with no response
    /// timeout of their own (each pipeline is bounded by
    /// [`RedisStore::durable_pipe`], which knows its wait).
    pub(super) fn single(client: redis::Client, config: &super::RedisStoreConfig) -> DurableConn {
        let manager = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connection_timeout))
            .set_response_timeout(None)
            .set_number_of_retries(config.reconnect_retries)
            .set_max_delay(Duration::from_millis(500));
        DurableConn::new(Open::Single(client, manager), config.response_timeout)
    }

    /// For a cluster store: cluster connections whose per-request timeout
    /// leaves room for the longest wait.
    pub(super) fn cluster(
        urls: &[&str],
        config: &super::RedisStoreConfig,
    ) -> Result<DurableConn, Error> {
        let client = ClusterClient::builder(urls.iter().copied())
            .connection_timeout(config.connection_timeout)
            .response_timeout(config.response_timeout + MAX_DURABILITY_TIMEOUT)
            .retries(u32::try_from(config.reconnect_retries).unwrap_or(u32::MAX))
            .max_retry_wait(500)
            .build()
            .map_err(super::reply::bad_url)?;
        Ok(DurableConn::new(
            Open::Cluster(client),
            config.response_timeout,
        ))
    }

    /// For a store made from a connection.
    pub(super) fn shared(response_timeout: Duration) -> DurableConn {
        DurableConn::new(Open::Shared, response_timeout)
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Conn>> {
        // A panic elsewhere cannot leave the list half-written: use it.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The fence key of `key`'s slot: `<namespace>::fence{T}`, `T` a tag that
/// hashes to the slot. An empty scope is never a record's (records are
/// `namespace:scope:key`, scope not empty), so no record is overwritten,
/// and an ACL that allows `~<namespace>:*` allows it. A namespace holding a
/// brace would move the hash tag: such keys use `idem-fence{T}`.
fn fence_key(key: &str) -> String {
    let tag = slot_tag(key);
    match key.split_once(':') {
        Some((namespace, _)) if !namespace.contains(['{', '}']) => {
            format!("{namespace}::fence{{{tag}}}")
        }
        _ => format!("idem-fence{{{tag}}}"),
    }
}

/// The `WAIT` / `WAITAOF` that confirms `durability`.
fn wait_cmd(durability: Durability) -> Cmd {
    let ms = u64::try_from(durability.timeout().as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    match durability {
        Durability::Fsynced {
            local, replicas, ..
        } => {
            let mut cmd = redis::cmd("WAITAOF");
            cmd.arg(u8::from(local)).arg(replicas).arg(ms);
            cmd
        }
        Durability::Replicated { replicas, .. } => {
            let mut cmd = redis::cmd("WAIT");
            cmd.arg(replicas).arg(ms);
            cmd
        }
        // Never sent (callers check), and harmless: wait for no replica.
        _ => {
            let mut cmd = redis::cmd("WAIT");
            cmd.arg(0).arg(1);
            cmd
        }
    }
}

/// The command [`wait_cmd`] sends for `durability`, for messages.
fn wait_name(durability: Durability) -> &'static str {
    match durability {
        Durability::Fsynced { .. } => "WAITAOF",
        _ => "WAIT",
    }
}

/// What the fence and the wait answered: `Ok` when the copies asked for
/// confirmed.
fn judge_wait(
    op: &'static str,
    durability: Durability,
    fence: &Value,
    wait: &Value,
) -> Result<(), Error> {
    // A refusal by the ACL is configuration: no retry can get past it, so
    // it is not `NotConfirmed` (retryable) but `DurabilityUnsupported`.
    if let Value::ServerError(e) = fence {
        return Err(if e.code() == "NOPERM" {
            Error::DurabilityUnsupported {
                reason: format!(
                    "the Redis user may not write the durability fence ({e:?}): grant it SET on `<namespace>::fence*` keys (docs/operating.md, Redis ACL), or ask Durability::Async"
                ),
            }
        } else {
            Error::not_confirmed(op, format!("the fence write was refused ({e:?})"))
        });
    }
    if let Value::ServerError(e) = wait
        && e.code() == "NOPERM"
    {
        return Err(Error::DurabilityUnsupported {
            reason: format!(
                "the Redis user may not run {} ({e:?}): grant it `+wait` (`+waitaof` for Durability::Fsynced; docs/operating.md, Redis ACL), or ask Durability::Async",
                wait_name(durability)
            ),
        });
    }
    let timeout = durability.timeout();
    match (durability, wait) {
        (Durability::Replicated { replicas, .. }, Value::Int(got)) => {
            if *got >= i64::from(replicas) {
                Ok(())
            } else {
                Err(Error::not_confirmed(
                    op,
                    format!("{got} of {replicas} replica(s) confirmed within {timeout:?}"),
                ))
            }
        }
        (
            Durability::Fsynced {
                local, replicas, ..
            },
            Value::Array(got),
        ) => {
            let count = |i: usize| match got.get(i) {
                Some(Value::Int(n)) => *n,
                _ => -1,
            };
            let (got_local, got_replicas) = (count(0), count(1));
            if got_local >= i64::from(local) && got_replicas >= i64::from(replicas) {
                Ok(())
            } else {
                Err(Error::not_confirmed(
                    op,
                    format!(
                        "fsynced on {got_local} of {} primary and {got_replicas} of {replicas} replica(s) within {timeout:?}",
                        u8::from(local)
                    ),
                ))
            }
        }
        (_, Value::ServerError(e)) if format!("{e:?}").contains("appendonly") => {
            Err(Error::DurabilityUnsupported {
                reason: format!(
                    "the server refused WAITAOF ({e:?}): its append-only file is off; set `appendonly yes` (and `appendfsync always` or `everysec`), or ask Durability::Fsynced with local = false"
                ),
            })
        }
        // Refused for another reason (the ACL's NOPERM is answered above):
        // nothing confirmed.
        (_, Value::ServerError(e)) => Err(Error::not_confirmed(
            op,
            format!("the server refused the wait ({e:?})"),
        )),
        (_, other) => Err(protocol(op, other)),
    }
}

impl RedisStore {
    /// Whether the server can give `durability`, from what it said at
    /// connect (`HELLO`): every Redis 7 has `WAIT`; `WAITAOF` needs Redis
    /// or Valkey 7.2+.
    pub(super) fn can_give(&self, durability: Durability) -> Result<(), Error> {
        match durability {
            Durability::Fsynced { .. } if !self.server.has_waitaof() => {
                Err(Error::DurabilityUnsupported {
                    reason: format!(
                        "{durability} needs WAITAOF, and this server ({}) has none (Redis 7.2+ and Valkey 7.2+ have it; a store made with from_manager/from_cluster does not know its server: use RedisStore::connect); upgrade the server, or ask Durability::Replicated",
                        self.server()
                    ),
                })
            }
            _ => Ok(()),
        }
    }

    /// A connection no other pipeline uses now: an idle one, or a new one.
    async fn durable_conn(&self) -> Result<Conn, Error> {
        let durable = &self.durable;
        if let Some(conn) = durable.idle().pop() {
            return Ok(conn);
        }
        match &durable.open {
            Open::Single(client, config) => {
                ConnectionManager::new_with_config(client.clone(), config.clone())
                    .await
                    .map(Conn::Single)
                    .map_err(|e| classify("connect", e))
            }
            Open::Cluster(client) => client
                .get_async_connection()
                .await
                .map(Conn::Cluster)
                .map_err(|e| classify("connect", e)),
            Open::Shared => Ok(self.conn.clone()),
        }
    }

    /// Sends `cmds` on `key`'s primary followed by the fence and the wait,
    /// as one pipeline on the durable connection: the replies of `cmds`
    /// (errors as `Value::ServerError`), and whether the copies confirmed.
    pub(super) async fn durable_pipe(
        &self,
        op: &'static str,
        key: &str,
        cmds: Vec<Cmd>,
        durability: Durability,
    ) -> Result<(Vec<Value>, Result<(), Error>), Error> {
        let n = cmds.len();
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for cmd in cmds {
            pipe.add_command(cmd);
        }
        pipe.cmd("SET")
            .arg(fence_key(key))
            .arg("1")
            .arg("PX")
            .arg(u64::try_from(FENCE_TTL.as_millis()).unwrap_or(u64::MAX));
        pipe.add_command(wait_cmd(durability));
        let durable = &self.durable;
        let send = async {
            // Closed only when the store is dropped: then nothing waits.
            let _permit = durable
                .permits
                .acquire()
                .await
                .map_err(|_| Error::unavailable(op, "the store is shutting down"))?;
            let conn = self.durable_conn().await?;
            let replies = match conn.clone() {
                Conn::Single(mut c) => pipe.query_async::<Vec<Value>>(&mut c).await,
                Conn::Cluster(mut c) => {
                    let node = Route::with_key(key, SlotAddr::Master);
                    let count = pipe.len();
                    c.route_pipeline(pipe, 0, count, SingleNodeRoutingInfo::SpecificNode(node))
                        .await
                }
            }
            .map_err(|e| classify(op, e))?;
            // Answered: the connection is free for the next pipeline. (One
            // that failed or timed out is dropped, with whatever it still
            // owes.)
            durable.idle().push(conn);
            Ok::<_, Error>(replies)
        };
        let bound = durable.response_timeout + durability.timeout();
        let mut replies = match tokio::time::timeout(bound, send).await {
            Ok(replies) => replies?,
            Err(_) => {
                return Err(Error::unavailable(
                    op,
                    format!(
                        "Redis did not answer the durable {op} within {bound:?} (the response timeout plus the durability timeout); check that Redis is up and reachable"
                    ),
                ));
            }
        };
        if replies.len() != n + 2 {
            return Err(protocol(op, &Value::Array(replies)));
        }
        let wait = replies.pop().unwrap_or(Value::Nil);
        let fence = replies.pop().unwrap_or(Value::Nil);
        Ok((replies, judge_wait(op, durability, &fence, &wait)))
    }

    /// The fence and the wait alone: every write `key`'s primary applied
    /// before this is as durable as asked, or `Err(NotConfirmed)`.
    pub(super) async fn confirm_key(&self, key: &str, durability: Durability) -> Result<(), Error> {
        self.durable_pipe("confirm", key, Vec::new(), durability)
            .await?
            .1
    }

    /// `claim`, confirmed: the fresh path's `SET NX GET` goes with the fence
    /// and the wait (one round trip), which confirm the record it wrote or
    /// the completed record it read. A pending record found goes to the
    /// claim script, itself sent with the fence and the wait (a second
    /// round trip, on the rare contended path).
    pub(super) async fn claim_confirmed(
        &self,
        claim: Claim<'_>,
        durability: Durability,
    ) -> Result<ClaimReply, Error> {
        let (record, ttl) = pending_record(&claim);
        let mut cmds = vec![batch::set_nx_get_cmd(claim.key, &record, ttl)];
        if claim.want_ttl_left {
            let mut pttl = redis::cmd("PTTL");
            pttl.arg(claim.key);
            cmds.push(pttl);
        }
        let (mut replies, confirmed) = self
            .durable_pipe("claim", claim.key, cmds, durability)
            .await?;
        let pttl = match replies.get(1) {
            Some(Value::Int(ms)) => *ms,
            _ => -1,
        };
        let found = server_error(Ok(replies.swap_remove(0))).map_err(classify_claim);
        match found {
            Ok(Value::Nil) => {
                confirmed?;
                Ok(ClaimReply::Acquired { attempt: 1 })
            }
            Ok(Value::BulkString(found)) => match decode(found, pttl)? {
                Record::Pending(_) => {
                    self.claim_contended_confirmed(claim, record, ttl, durability)
                        .await
                }
                completed => match answer_found(completed, &claim, pttl) {
                    Some(reply @ ClaimReply::Completed(_)) => confirmed.map(|()| reply),
                    Some(reply) => Ok(reply),
                    None => Err(protocol("claim", &Value::Nil)),
                },
            },
            Ok(other) => Err(protocol("claim", &other)),
            // Out of memory: the plain claim answers from a read what needs
            // no write; the fence (a write) then cannot confirm, and says so.
            Err(e) if is_oom(&e) => {
                let reply = self.claim_plain(claim).await?;
                self.confirm_reply(claim.key, reply, durability).await
            }
            Err(e) => Err(e),
        }
    }

    /// A durable claim that found a pending record (a takeover, a re-sent
    /// claim, a live holder): the claim script goes with the fence and the
    /// wait, one pipeline on the durable connection (two after
    /// `NOSCRIPT`), and a won claim or a replay counts once they confirm.
    ///
    /// Not the script on the shared connection and the confirmation after
    /// it on the durable one: `WAIT` / `WAITAOF` confirm what the server
    /// they run on has, and the two connections may reach different
    /// servers. A failover between the two round trips (the shared
    /// connection's write on the old primary, the durable connection
    /// reconnected to the new one; or either of them reconnected between
    /// its own round trips) would let the new primary's fence vouch for a
    /// takeover it never received. One pipeline on one connection runs on
    /// one server, in order: if that server is demoted or lost meanwhile,
    /// the wait is refused or the connection fails, and nothing counts.
    async fn claim_contended_confirmed(
        &self,
        claim: Claim<'_>,
        record: super::record::PendingRecord<'_>,
        ttl: u64,
        durability: Durability,
    ) -> Result<ClaimReply, Error> {
        let waiting = self.waited_on(claim.key);
        let cmd = batch::claim_script_cmd(&claim, &record, ttl, waiting);
        let (mut replies, mut confirmed) = self
            .durable_pipe("claim", claim.key, vec![cmd.clone()], durability)
            .await?;
        // The script gone: loaded in the same pipeline, ahead of the call,
        // as `complete_confirmed` does.
        if is_noscript_reply(replies.first()) {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(SCRIPTS.claim.source);
            (replies, confirmed) = self
                .durable_pipe("claim", claim.key, vec![load, cmd], durability)
                .await?;
            let mut rest = replies.into_iter();
            if let Some(Value::ServerError(e)) = rest.next() {
                return Err(classify_claim(redis::RedisError::from(e)));
            }
            replies = rest.collect();
        }
        let first = replies.into_iter().next().unwrap_or(Value::Nil);
        let reply = match server_error(Ok(first)).map_err(classify_claim) {
            Ok(v) => parse_claim(v)?,
            // Out of memory (the claim script may write): the plain claim
            // answers from a read what needs no write; the fence (a write)
            // then cannot confirm, and says so.
            Err(e) if is_oom(&e) => {
                let reply = self.claim_plain(claim).await?;
                return self.confirm_reply(claim.key, reply, durability).await;
            }
            Err(e) => return Err(e),
        };
        match reply {
            ClaimReply::Acquired { .. } | ClaimReply::Completed(_) => confirmed.map(|()| reply),
            // A live holder or another fingerprint: nothing acknowledged.
            other => Ok(other),
        }
    }

    /// A claim's reply once confirmed: a won claim and a replay wait for
    /// the fence; `InProgress` and `Mismatch` report and need none.
    async fn confirm_reply(
        &self,
        key: &str,
        reply: ClaimReply,
        durability: Durability,
    ) -> Result<ClaimReply, Error> {
        if matches!(
            reply,
            ClaimReply::Acquired { .. } | ClaimReply::Completed(_)
        ) {
            self.confirm_key(key, durability).await?;
        }
        Ok(reply)
    }
}
