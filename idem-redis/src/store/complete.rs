//! Every complete path of `RedisStore`: `Store::complete` enters at
//! `complete_request`, which picks one plain `SET … IFEQ` where the server
//! has it (Valkey 8.1+, Redis 8.4+), the `complete` script elsewhere, the
//! script that appends outbox messages, or a durable pipeline (the write,
//! a fence and a wait: durable.rs); the commands a finish batch pipelines
//! (batch.rs) are built here too.
//!
//! A claim writes a pending record the client built itself from the
//! claim's key, owner token, fingerprint, lease and TTL
//! ([`pending_record`]). The runtime completes with the claim it sent
//! (`Complete::as_claimed`), so the complete rebuilds those exact bytes
//! and `SET key completed IFEQ pending KEEPTTL` is the same compare-and-set
//! as the script, without Lua and without anything kept per call between
//! the two. The outcome stays exact: an `IFEQ` that matches proves the
//! record is the caller's own untouched pending one, and any other answer
//! (no match, an error reply) falls back to the script, which tells
//! Missing / OtherOwner / AlreadyCompleted (or a re-sent complete) apart.
//! A record changed since its claim does not match: a takeover's (its
//! attempt number), an extended lease's (its lease end), one with steps,
//! and a marked one. The runtime knows the middle two (it sent the
//! renewal, it saved the steps) and completes those through the script
//! at once.
//!
//! No `SPUBLISH` goes with it: a caller that waits on the key marks the
//! pending record first (its `claim`, lua/README.md "The waiter mark"), so
//! the record's bytes are no longer the ones the claim wrote, the `IFEQ`
//! does not match, and the script, which publishes for a marked record,
//! answers. A complete no one waits on is one plain `SET`.

use super::outbox;
use super::record::{CompletedRecord, pending_record};
use super::reply::is_noscript_reply;
use super::reply::{classify, parse_write, protocol, server_error, unreached};
use super::scripts::{SCRIPTS, invocation};
use super::{Conn, RedisStore};
use idem_core::Error;
use idem_core::store::{Claim, Complete, Finish, ValueKind, WriteReply};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Value};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::OnceCell;

/// How a store completes a record: the name shown by
/// [`RedisStore::complete_path`], the `tracing` field at connect and
/// `idem inspect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CompletePath {
    /// The `complete` Lua script (Redis 7, unknown servers).
    Script,
    /// `SET … IFEQ … KEEPTTL` (Valkey 8.1+, Redis 8.4+); the script
    /// only when that does not match (a waiter marked the record, among
    /// others).
    SetIfEq,
}

impl CompletePath {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            CompletePath::Script => "script",
            CompletePath::SetIfEq => "set-ifeq",
        }
    }
}

/// What the server said it is (`HELLO`), and the complete path that follows.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Kind {
    /// `name version` as `HELLO` reported it, or `unknown`.
    pub(super) describe: String,
    pub(super) complete: CompletePath,
    /// Whether the server has `WAITAOF` (Redis and Valkey 7.2+), for
    /// `Durability::Fsynced`.
    pub(super) waitaof: bool,
}

impl Kind {
    fn unknown() -> Kind {
        Kind {
            describe: "unknown".to_owned(),
            complete: CompletePath::Script,
            waitaof: false,
        }
    }

    /// The server from a `HELLO` reply (a map in RESP3, a flat list of
    /// pairs in RESP2).
    pub(super) fn from_hello(reply: &Value) -> Kind {
        let field = |name: &str| hello_field(reply, name);
        let (Some(server), Some(version)) = (field("server"), field("version")) else {
            return Kind::unknown();
        };
        let waitaof = version_at_least(&server, &version, "valkey", (7, 2))
            || version_at_least(&server, &version, "redis", (7, 2));
        let complete = if has_set_ifeq(&server, &version) {
            CompletePath::SetIfEq
        } else {
            CompletePath::Script
        };
        Kind {
            describe: format!("{server} {version}"),
            complete,
            waitaof,
        }
    }
}

/// The server's kind, once known.
pub(super) struct Server {
    /// Set at connect; for a store made from a connection, at its first
    /// complete (until then, and for that complete, the script).
    kind: OnceCell<Kind>,
}

impl Server {
    /// A server not asked yet.
    pub(super) fn unknown() -> Server {
        Server {
            kind: OnceCell::new(),
        }
    }

    fn known(kind: Kind) -> Server {
        Server {
            kind: OnceCell::new_with(Some(kind)),
        }
    }

    /// Whether the server said (at connect) that it has `WAITAOF`.
    pub(super) fn has_waitaof(&self) -> bool {
        self.kind.get().is_some_and(|k| k.waitaof)
    }

    pub(super) fn path(&self) -> CompletePath {
        self.kind.get().map_or(CompletePath::Script, |k| k.complete)
    }

    /// The command of a complete without the script: `SET key completed
    /// IFEQ pending KEEPTTL`, `pending` being the record `claim` wrote.
    /// `None` where the server has no `IFEQ` (the script must answer). Its
    /// reply is `OK` when it wrote. No `SPUBLISH`: a record someone waits
    /// on is marked, so it does not match and the script publishes.
    pub(super) fn complete_plain_cmd(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
    ) -> Option<Cmd> {
        if self.path() != CompletePath::SetIfEq {
            return None;
        }
        let (pending, _) = pending_record(claim);
        // The completed record keeps the claim's fingerprint, as the
        // script does: the one inside the pending record.
        let record = CompletedRecord {
            kind,
            fingerprint: pending.fingerprint,
            value,
        };
        let fplen = pending.fingerprint.len();
        let mut set = Cmd::with_capacity(
            6,
            3 + claim.key.len() + 2 * (3 + fplen) + value.len() + 4 + 32 + 2 * 16 + 16,
        );
        set.arg("SET")
            .arg(claim.key)
            .arg(record)
            .arg("IFEQ")
            .arg(&pending)
            .arg("KEEPTTL");
        Some(set)
    }
}

impl RedisStore {
    /// A complete on a server without `IFEQ` (Redis 7), told its claim:
    /// the `complete_batch` script for this one key, which compares the
    /// record with the pending one the claim wrote and writes at once, as
    /// `IFEQ` would, and takes the `complete` script's step only when they
    /// differ. Its common path makes none of the record operations'
    /// closures: 13 % less server work per fresh call than the `complete`
    /// script (lua/README.md).
    pub(super) async fn complete_compared(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
    ) -> Result<WriteReply, Error> {
        let op = Finish::Complete(Complete::of_claim(claim, kind, value));
        let cmd = complete_batch_cmd(&[&op]);
        let lua = &SCRIPTS.complete_batch;
        match self.eval("complete", lua, claim.key, &cmd).await? {
            Value::Array(replies) if replies.len() == 1 => match replies.into_iter().next() {
                Some(Value::ServerError(e)) => Err(classify("complete", e.into())),
                Some(reply) => parse_write("complete", reply),
                None => Err(protocol("complete", &Value::Nil)),
            },
            other => Err(protocol("complete", &other)),
        }
    }
}

/// One call of the `complete_batch` script for `ops`, all completes told
/// their claim ([`Complete::as_claimed`]).
pub(super) fn complete_batch_cmd(ops: &[&Finish<'_>]) -> Cmd {
    let hash = SCRIPTS.complete_batch.script.get_hash();
    let mut cmd = Cmd::with_capacity(3 + 3 * ops.len(), 64 + 160 * ops.len());
    cmd.arg("EVALSHA").arg(hash).arg(ops.len());
    for op in ops {
        cmd.arg(op.key());
    }
    for op in ops {
        if let Finish::Complete(c) = **op
            && let Some(claim) = c.claim()
        {
            // What the claim wrote, to be compared whole (as IFEQ would);
            // the completed record keeps its fingerprint. The script reads
            // the owner token from it.
            let (pending, _) = pending_record(&claim);
            let record = CompletedRecord {
                kind: c.kind,
                fingerprint: pending.fingerprint,
                value: c.value,
            };
            cmd.arg(record).arg(&pending);
        }
    }
    cmd
}

impl RedisStore {
    /// `Store::complete`: the one entry of every complete. With outbox
    /// messages, the script that appends them (then the fence, for a
    /// durability); told its claim, the plain `SET … IFEQ` or, on a server
    /// without it, the compared script; else the `complete` script, which
    /// reads the record first. A durability other than `Async` sends the
    /// write with its fence and wait in one round trip (durable.rs).
    pub(super) async fn complete_request(&self, c: Complete<'_>) -> Result<WriteReply, Error> {
        if !c.outbox.is_empty() {
            // Boxed, as the confirmed complete below: a complete without
            // messages should not carry this branch's future in its own.
            return Box::pin(self.complete_with_messages(&c)).await;
        }
        match (c.claim(), c.durability.is_async()) {
            (Some(claim), true) => {
                if let Some(done) = self.complete_plain(&claim, c.kind, c.value).await {
                    return done;
                }
                if self.server.path() == CompletePath::Script {
                    return self.complete_compared(&claim, c.kind, c.value).await;
                }
                self.complete_script(&c).await
            }
            (claim, false) => {
                let plain =
                    claim.and_then(|claim| self.server.complete_plain_cmd(&claim, c.kind, c.value));
                // Boxed: its future (confirmations, retries) is the largest,
                // and every complete's future was as large as it, copied
                // whole into the box `async_trait` makes.
                Box::pin(self.complete_confirmed(&c, plain)).await
            }
            (None, true) => self.complete_script(&c).await,
        }
    }

    /// A complete with outbox messages: the result and the messages in one
    /// step, confirmed after when the call's durability asks for it.
    async fn complete_with_messages(&self, c: &Complete<'_>) -> Result<WriteReply, Error> {
        let reply = self.complete_outbox(c).await?;
        // The messages were written in the same step as the result: the
        // fence after it confirms both.
        if reply.is_done() && !c.durability.is_async() {
            self.confirm_key(c.key, c.durability).await?;
        }
        Ok(reply)
    }

    /// The `complete` script: reads the record, then writes as its owner.
    pub(super) async fn complete_script(&self, c: &Complete<'_>) -> Result<WriteReply, Error> {
        let cmd = complete_script_cmd(c);
        let lua = &SCRIPTS.complete;
        parse_write("complete", self.eval("complete", lua, c.key, &cmd).await?)
    }

    /// `complete`, confirmed: `plain` (the claim's `SET … IFEQ`, where the
    /// server has it) or, when it does not match, the script goes with the
    /// fence and the wait, one round trip. `Err(NotConfirmed)` only for a
    /// write that was `Done`.
    async fn complete_confirmed(
        &self,
        c: &Complete<'_>,
        plain: Option<Cmd>,
    ) -> Result<WriteReply, Error> {
        let (key, durability) = (c.key, c.durability);
        if let Some(set) = plain {
            let (replies, confirmed) = self
                .durable_pipe("complete", key, vec![set], durability)
                .await?;
            if is_ok(replies.first()) {
                return confirmed.map(|()| WriteReply::Done);
            }
        }
        let lua = &SCRIPTS.complete;
        let cmd = complete_script_cmd(c);
        let (mut replies, mut confirmed) = self
            .durable_pipe("complete", key, vec![cmd.clone()], durability)
            .await?;
        // Redis lost the script (restart, fail-over, SCRIPT FLUSH): load it
        // in the same pipeline, ahead of the call, on the durable
        // connection that just met the node without it. Loading it through
        // the main connection, as a plain call does, can miss after a
        // cluster failover: that connection only learns a slot's new
        // primary from a keyed command's MOVED, the durable path sends it
        // none, and its unkeyed SCRIPT LOAD went to the old primary, now a
        // replica, which takes it without a redirect.
        if is_noscript_reply(replies.first()) {
            let mut load = redis::cmd("SCRIPT");
            load.arg("LOAD").arg(lua.source);
            (replies, confirmed) = self
                .durable_pipe("complete", key, vec![load, cmd], durability)
                .await?;
            let mut rest = replies.into_iter();
            if let Some(Value::ServerError(e)) = rest.next() {
                return Err(classify("complete", redis::RedisError::from(e)));
            }
            replies = rest.collect();
        }
        let first = replies.into_iter().next().unwrap_or(Value::Nil);
        let written = server_error(Ok(first)).map_err(|e| classify("complete", e))?;
        let reply = parse_write("complete", written)?;
        if reply.is_done() {
            confirmed?;
        }
        Ok(reply)
    }

    /// The complete script with the messages appended to the outbox stream
    /// of the record's slot; on a cluster, the stream is named in the index
    /// first, so a relay finds it even if this process dies right after.
    async fn complete_outbox(&self, c: &Complete<'_>) -> Result<WriteReply, Error> {
        let (key, token, messages) = (c.key, c.token, c.outbox);
        let keys = self.outbox_keys(key);
        if self.is_cluster() {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            let mut zadd = redis::cmd("ZADD");
            zadd.arg(outbox::index_key(&self.outbox))
                .arg(u64::try_from(now).unwrap_or(u64::MAX))
                .arg(&keys.stream);
            self.send(&zadd)
                .await
                .map_err(|e| classify("complete", e))?;
        }
        let record = CompletedRecord {
            kind: c.kind,
            fingerprint: c.fingerprint.map_or(&[], |f| f.as_bytes()),
            value: c.value,
        };
        let lua = &SCRIPTS.complete;
        // Headers need a fifth argument per message, so the script is told
        // the layout by an empty argument before the messages (no message
        // id is empty): a call whose messages carry none (every untraced
        // call) sends exactly what it sent before headers existed. Messages
        // with an empty id (which idem never makes) go in the five-argument
        // layout too, so that one cannot be taken for the mark.
        let framed = messages
            .iter()
            .any(|m| !m.headers.is_empty() || m.id.is_empty());
        let headers: Vec<Vec<u8>> = if framed {
            messages
                .iter()
                .map(|m| outbox::encode_headers(&m.headers))
                .collect()
        } else {
            Vec::new()
        };
        let size: usize = messages
            .iter()
            .map(|m| m.id.len() + m.topic.len() + m.key.len() + m.payload.len() + 64)
            .sum::<usize>()
            + headers.iter().map(|h| h.len() + 16).sum::<usize>();
        let mut cmd = Cmd::with_capacity(
            8 + 5 * messages.len(),
            160 + key.len() + keys.stream.len() + c.value.len() + size,
        );
        cmd.arg("EVALSHA")
            .arg(lua.script.get_hash())
            .arg(2)
            .arg(key)
            .arg(&keys.stream)
            .arg(token.as_bytes().as_slice())
            .arg(record);
        if framed {
            cmd.arg("");
        }
        for (i, m) in messages.iter().enumerate() {
            cmd.arg(&m.id)
                .arg(&m.topic)
                .arg(&m.key)
                .arg(m.payload.as_ref());
            if let Some(h) = headers.get(i) {
                cmd.arg(h.as_slice());
            }
        }
        parse_write("complete", self.eval("complete", lua, key, &cmd).await?)
    }
}

/// The `complete` script's command for `c.token`'s record.
pub(super) fn complete_script_cmd(c: &Complete<'_>) -> Cmd {
    let record = CompletedRecord {
        kind: c.kind,
        fingerprint: c.fingerprint.map_or(&[], |f| f.as_bytes()),
        value: c.value,
    };
    let lua = &SCRIPTS.complete;
    let mut cmd = invocation(lua.script.get_hash(), c.key, 2, 32 + 3 + 16 + c.value.len());
    cmd.arg(c.token.as_bytes().as_slice()).arg(record);
    cmd
}

/// Whether a `SET` wrote (`OK`).
pub(super) fn is_ok(reply: Option<&Value>) -> bool {
    match reply {
        Some(Value::Okay) => true,
        Some(Value::SimpleString(s)) => s == "OK",
        _ => false,
    }
}

/// `SET … IFEQ` exists from Valkey 8.1 and Redis 8.4.
fn has_set_ifeq(server: &str, version: &str) -> bool {
    version_at_least(server, version, "valkey", (8, 1))
        || version_at_least(server, version, "redis", (8, 4))
}

/// Whether `server` `version` (as `HELLO` says them) is `name` at `min`
/// (major, minor) or later.
fn version_at_least(server: &str, version: &str, name: &str, min: (u32, u32)) -> bool {
    if server != name {
        return false;
    }
    let mut parts = version.split('.').map(str::parse::<u32>);
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= min,
        _ => false,
    }
}

fn hello_field(reply: &Value, name: &str) -> Option<String> {
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => Some(s.clone()),
        _ => None,
    };
    let pairs: Vec<(&Value, &Value)> = match reply {
        Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
        Value::Array(items) => items.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
        _ => return None,
    };
    pairs
        .into_iter()
        .find(|(k, _)| text(k).as_deref() == Some(name))
        .and_then(|(_, v)| text(v))
}

impl RedisStore {
    /// How this store completes records: `"set-ifeq"` (one plain `SET …
    /// IFEQ`, on Valkey 8.1+ and Redis 8.4+) or `"script"` (the Lua
    /// script: Redis 7, unknown servers, and a store made from a
    /// connection until its first complete has asked the server).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_redis::RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// println!("complete: {} on {}", store.complete_path(), store.server());
    /// # Ok(()) }
    /// ```
    pub fn complete_path(&self) -> &'static str {
        self.server.path().as_str()
    }

    /// The server's name and version as it reported them at connect
    /// (`HELLO`), e.g. `valkey 8.1.8`; `unknown` for a store made from a
    /// connection until its first complete.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_redis::RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// assert!(store.server().starts_with("redis") || store.server().starts_with("valkey"));
    /// # Ok(()) }
    /// ```
    pub fn server(&self) -> &str {
        self.server.kind.get().map_or("unknown", |k| &k.describe)
    }

    /// Asks the server what it is (`HELLO` without a version: it changes
    /// nothing on the connection, and every ACL user may send it). On a
    /// cluster, one node answers for all. No answer: scripts only.
    pub(super) async fn detect_server(&self) -> Server {
        Server::known(self.ask_server().await)
    }

    async fn ask_server(&self) -> Kind {
        let hello = redis::cmd("HELLO");
        let reply = match &self.conn {
            Conn::Single(c) => c.clone().send_packed_command(&hello).await,
            Conn::Cluster(c) => {
                let random = RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random);
                c.clone().route_command(hello, random).await
            }
        };
        let kind = match reply {
            Ok(v) => Kind::from_hello(&v),
            Err(e) => {
                tracing::debug!(error = %e, "HELLO failed: completing with the script");
                Kind::unknown()
            }
        };
        tracing::info!(
            server = %kind.describe,
            complete_path = kind.complete.as_str(),
            "connected to Redis"
        );
        kind
    }

    /// The complete of `claim` as `SET key completed IFEQ pending KEEPTTL`
    /// (one round trip, no `SPUBLISH`: a record someone waits on does not
    /// match). `None` when the script must answer: the server has no
    /// `IFEQ`, the record is not the pending one the claim wrote, or the
    /// server refused the `SET` (out of memory: the script may still
    /// write; another type under the key).
    pub(super) async fn complete_plain(
        &self,
        claim: &Claim<'_>,
        kind: ValueKind,
        value: &[u8],
    ) -> Option<Result<WriteReply, Error>> {
        if self.server.kind.get().is_none() {
            // A store made from a connection: ask once, here, off the
            // claim's path; this complete and earlier claims use the script.
            self.server.kind.get_or_init(|| self.ask_server()).await;
            return None;
        }
        let set = self.server.complete_plain_cmd(claim, kind, value)?;
        match self.send(&set).await {
            Ok(reply) => is_ok(Some(&reply)).then_some(Ok(WriteReply::Done)),
            // Refused (out of memory, another type under the key): the
            // script may still write, or says what is there.
            Err(e) if !unreached(&e) => None,
            Err(e) => Some(Err(classify("complete", e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(server: &str, version: &str) -> Value {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        Value::Array(vec![s("server"), s(server), s("version"), s(version)])
    }

    #[test]
    fn set_ifeq_from_valkey_8_1_and_redis_8_4() {
        let path = |server, version| Kind::from_hello(&hello(server, version)).complete;
        assert_eq!(path("valkey", "8.1.8"), CompletePath::SetIfEq);
        assert_eq!(path("valkey", "9.0.0"), CompletePath::SetIfEq);
        assert_eq!(path("valkey", "8.0.2"), CompletePath::Script);
        assert_eq!(path("redis", "7.0.15"), CompletePath::Script);
        assert_eq!(path("redis", "8.2.1"), CompletePath::Script);
        assert_eq!(path("redis", "8.4.0"), CompletePath::SetIfEq);
        assert_eq!(path("keydb", "9.9.9"), CompletePath::Script);
        assert_eq!(path("valkey", "eight"), CompletePath::Script);
        assert_eq!(Kind::from_hello(&Value::Nil).complete, CompletePath::Script);
    }

    #[test]
    fn waitaof_from_redis_and_valkey_7_2() {
        let waitaof = |server, version| Kind::from_hello(&hello(server, version)).waitaof;
        assert!(waitaof("valkey", "8.1.8"));
        assert!(waitaof("redis", "7.2.4"));
        assert!(!waitaof("redis", "7.0.15"));
        assert!(!waitaof("keydb", "9.9.9"));
        assert!(!Kind::from_hello(&Value::Nil).waitaof);
    }

    #[test]
    fn resp3_map_reply_is_read() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let map = Value::Map(vec![
            (s("server"), s("valkey")),
            (s("version"), s("8.1.8")),
            (s("proto"), Value::Int(3)),
        ]);
        let server = Kind::from_hello(&map);
        assert_eq!(server.complete, CompletePath::SetIfEq);
        assert_eq!(server.describe, "valkey 8.1.8");
    }
}
