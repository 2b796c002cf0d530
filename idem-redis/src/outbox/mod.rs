//! The outbox of a [`RedisStore`]: messages a body staged
//! ([`stage`](idem_core::outbox::stage)) sit in a Redis Stream, appended by the script
//! that stored the call's result; [`RedisRelay`] publishes them.
//!
//! Each message is one stream entry (`id`, `topic`, `key`, `payload`, and
//! `headers` when the message has any); a parked message keeps its entry,
//! with its reason in a hash beside the stream. The keys and the headers'
//! encoding (netstrings: `11:traceparent,55:00-…-01,`) are laid out in
//! `store/outbox.rs`.
//!
//! An entry without `headers` (every entry written before the field
//! existed) is a message without headers. One whose `headers` cannot be
//! decoded (written by something other than idem) is sent without
//! headers, with a warning, rather than parked: they carry the trace
//! context, and a lost trace link is better than a deliverable message
//! held back for an operator.

mod relay;

pub use self::relay::{RedisRelay, RedisSource};

use crate::RedisStore;
use crate::store::outbox::{HEADERS_FIELD, StreamKeys, decode_headers, index_key, outbox_error};
use idem_core::Error;
use idem_core::outbox::OutboxMessage;
use idem_core::outbox::{Backlog, Parked};
use redis::{RedisError, Value};
use std::collections::HashMap;
use std::sync::LazyLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The outbox's own scripts (`lua/outbox_*.lua`).
pub(crate) struct Scripts {
    pub(crate) lock: redis::Script,
    pub(crate) unlock: redis::Script,
    pub(crate) park: redis::Script,
    pub(crate) prune: redis::Script,
}

pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    lock: redis::Script::new(include_str!("../../lua/outbox_lock.lua")),
    unlock: redis::Script::new(include_str!("../../lua/outbox_unlock.lua")),
    park: redis::Script::new(include_str!("../../lua/outbox_park.lua")),
    prune: redis::Script::new(include_str!("../../lua/outbox_prune.lua")),
});

/// The outbox of a [`RedisStore`], for operators and relays: what waits,
/// what is parked, and sending parked messages again or dropping them.
///
/// ```no_run
/// use idem_redis::RedisStore;
/// # async fn demo() -> Result<(), idem_core::Error> {
/// let store = RedisStore::connect("redis://127.0.0.1/").await?;
/// let outbox = store.outbox();
/// let backlog = outbox.backlog().await?;
/// for m in outbox.parked(100).await? {
///     eprintln!("{} to {}: {}", m.id, m.topic, m.reason.as_deref().unwrap_or("?"));
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct RedisOutbox {
    pub(crate) store: RedisStore,
}

impl From<&RedisStore> for RedisOutbox {
    fn from(store: &RedisStore) -> RedisOutbox {
        store.outbox()
    }
}

impl From<RedisStore> for RedisOutbox {
    fn from(store: RedisStore) -> RedisOutbox {
        RedisOutbox { store }
    }
}

impl RedisStore {
    /// This store's outbox: where [`stage`](idem_core::outbox::stage)d messages
    /// wait for a [`RedisRelay`].
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// println!("{} waiting", store.outbox().backlog().await?.pending);
    /// # Ok(()) }
    /// ```
    pub fn outbox(&self) -> RedisOutbox {
        RedisOutbox {
            store: self.clone(),
        }
    }
}

/// One outbox stream and what the index said of it (cluster).
pub(crate) struct Listed {
    pub(crate) keys: StreamKeys,
    /// The index score as Redis wrote it, for the prune's check.
    pub(crate) score: Option<String>,
}

/// What a pass's first round trip read, under the stream's lock.
pub(crate) struct Opened {
    pub(crate) marks: HashMap<String, ParkedMark>,
    pub(crate) first: Vec<Entry>,
}

/// A stream entry read back: its id and the message, or why it cannot be
/// sent.
pub(crate) struct Entry {
    pub(crate) id: String,
    pub(crate) message: Result<OutboxMessage, String>,
}

impl RedisOutbox {
    fn fail(&self, op: &'static str) -> impl Fn(RedisError) -> Error + '_ {
        move |e| outbox_error(op, e)
    }

    /// The streams to drain: the one stream standalone; the index's on a
    /// cluster.
    pub(crate) async fn streams(&self) -> Result<Vec<Listed>, Error> {
        let prefix = self.store.outbox_prefix();
        if !self.store.is_cluster() {
            return Ok(vec![Listed {
                keys: StreamKeys::single(prefix),
                score: None,
            }]);
        }
        let mut zrange = redis::cmd("ZRANGE");
        zrange
            .arg(index_key(prefix))
            .arg(0)
            .arg(-1)
            .arg("WITHSCORES");
        let reply = self
            .store
            .outbox_cmd(&zrange)
            .await
            .map_err(self.fail("outbox streams"))?;
        let mut streams = Vec::new();
        for (member, score) in pairs(&reply) {
            if let Some(keys) = StreamKeys::from_stream(prefix, &member) {
                streams.push(Listed {
                    keys,
                    score: Some(score),
                });
            }
        }
        Ok(streams)
    }

    /// Up to `count` entries of `stream` after `after` (exclusive; `-` for
    /// the start).
    pub(crate) async fn read(
        &self,
        stream: &str,
        after: &str,
        count: usize,
    ) -> Result<Vec<Entry>, Error> {
        let mut xrange = redis::cmd("XRANGE");
        xrange
            .arg(stream)
            .arg(range_start(after))
            .arg("+")
            .arg("COUNT")
            .arg(count);
        let reply = self
            .store
            .outbox_cmd(&xrange)
            .await
            .map_err(self.fail("outbox read"))?;
        Ok(entries(&reply))
    }

    /// A pass's first round trip, pipelined on the stream's slot: take or
    /// renew the lock for `holder`, read the parked marks and the first
    /// `count` entries. `None` when another relay holds the stream.
    pub(crate) async fn open(
        &self,
        keys: &StreamKeys,
        holder: &[u8],
        lease_ms: u64,
        after: &str,
        count: usize,
    ) -> Result<Option<Opened>, Error> {
        let lock = &SCRIPTS.lock;
        let mut pipe = redis::pipe();
        pipe.cmd("EVALSHA")
            .arg(lock.get_hash())
            .arg(1)
            .arg(&keys.lock)
            .arg(holder)
            .arg(lease_ms);
        pipe.cmd("HGETALL").arg(&keys.parked);
        pipe.cmd("XRANGE")
            .arg(&keys.stream)
            .arg(range_start(after))
            .arg("+")
            .arg("COUNT")
            .arg(count);
        let replies = match self.store.outbox_pipe(&pipe).await {
            // Not loaded on this node (a restart, a fail-over): load it,
            // then pipeline again.
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                self.store
                    .outbox_load(lock)
                    .await
                    .map_err(self.fail("outbox relay lock"))?;
                self.store
                    .outbox_pipe(&pipe)
                    .await
                    .map_err(self.fail("outbox relay lock"))?
            }
            other => other.map_err(self.fail("outbox relay lock"))?,
        };
        let [held, marks, first] = <[Value; 3]>::try_from(replies).map_err(|r| {
            outbox_error(
                "outbox relay lock",
                RedisError::from((
                    redis::ErrorKind::Client,
                    "unexpected pipeline reply",
                    format!("{} replies for 3 commands", r.len()),
                )),
            )
        })?;
        if !matches!(held, Value::Int(1)) {
            return Ok(None);
        }
        Ok(Some(Opened {
            marks: pairs(&marks)
                .into_iter()
                .map(|(entry, mark)| (entry, ParkedMark::parse(&mark)))
                .collect(),
            first: entries(&first),
        }))
    }

    /// The parked entries of one stream: entry id → (attempts, parked at
    /// ms, reason).
    pub(crate) async fn parked_entries(
        &self,
        keys: &StreamKeys,
    ) -> Result<HashMap<String, ParkedMark>, Error> {
        let mut hgetall = redis::cmd("HGETALL");
        hgetall.arg(&keys.parked);
        let reply = self
            .store
            .outbox_cmd(&hgetall)
            .await
            .map_err(self.fail("outbox parked"))?;
        Ok(pairs(&reply)
            .into_iter()
            .map(|(entry, mark)| (entry, ParkedMark::parse(&mark)))
            .collect())
    }

    /// What waits: pending (parked excluded) and parked messages, and the
    /// age of the oldest pending one.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// let b = store.outbox().backlog().await?;
    /// if b.parked > 0 { eprintln!("{} parked: `idem outbox list`", b.parked); }
    /// # Ok(()) }
    /// ```
    pub async fn backlog(&self) -> Result<Backlog, Error> {
        let mut backlog = Backlog::default();
        for listed in self.streams().await? {
            let keys = &listed.keys;
            let mut pipe = redis::pipe();
            pipe.cmd("XLEN").arg(&keys.stream);
            pipe.cmd("HLEN").arg(&keys.parked);
            let replies = self
                .store
                .outbox_pipe(&pipe)
                .await
                .map_err(self.fail("outbox backlog"))?;
            let count = |i: usize| match replies.get(i) {
                Some(Value::Int(n)) => u64::try_from(*n).unwrap_or(0),
                _ => 0,
            };
            let (len, parked) = (count(0), count(1));
            backlog.pending += len.saturating_sub(parked);
            backlog.parked += parked;
            if len > parked {
                let marks = self.parked_entries(keys).await?;
                // The oldest entry that is not parked.
                let mut after = "-".to_owned();
                'scan: loop {
                    let page = self.read(&keys.stream, &after, 256).await?;
                    let Some(last) = page.last() else { break };
                    after = last.id.clone();
                    for e in &page {
                        if !marks.contains_key(&e.id) {
                            let age = entry_age(&e.id);
                            backlog.oldest = Some(backlog.oldest.map_or(age, |o| o.max(age)));
                            break 'scan;
                        }
                    }
                }
            }
        }
        Ok(backlog)
    }

    /// Parked messages, oldest first, at most `limit`.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// for m in store.outbox().parked(50).await? {
    ///     eprintln!("{} (key {}): {}", m.id, m.key, m.reason.unwrap_or_default());
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn parked(&self, limit: usize) -> Result<Vec<Parked>, Error> {
        Ok(self
            .parked_with_place(limit)
            .await?
            .into_iter()
            .map(|(_, p)| p)
            .collect())
    }

    /// Parked messages with their stream and entry id.
    async fn parked_with_place(
        &self,
        limit: usize,
    ) -> Result<Vec<((StreamKeys, String), Parked)>, Error> {
        let mut out = Vec::new();
        for listed in self.streams().await? {
            let keys = listed.keys;
            let mut marks: Vec<(String, ParkedMark)> =
                self.parked_entries(&keys).await?.into_iter().collect();
            marks.sort_by_key(|m| entry_order(&m.0));
            for (entry, mark) in marks {
                let Some(e) = self.read_one(&keys.stream, &entry).await? else {
                    continue; // dropped meanwhile
                };
                let (id, topic, key, size) = match &e.message {
                    Ok(m) => (
                        m.id.clone(),
                        m.topic.clone(),
                        m.key.clone(),
                        m.payload.len(),
                    ),
                    Err(_) => (entry.clone(), String::new(), String::new(), 0),
                };
                let parked = Parked {
                    id,
                    topic,
                    key,
                    size: u64::try_from(size).unwrap_or(u64::MAX),
                    attempts: mark.attempts,
                    reason: Some(mark.reason.clone()),
                    created_at: UNIX_EPOCH + Duration::from_millis(entry_order(&entry).0),
                    parked_at: Some(UNIX_EPOCH + Duration::from_millis(mark.at_ms)),
                };
                out.push(((keys.clone(), entry), parked));
            }
        }
        out.sort_by_key(|p| p.1.created_at);
        out.truncate(limit);
        Ok(out)
    }

    async fn read_one(&self, stream: &str, entry: &str) -> Result<Option<Entry>, Error> {
        let mut xrange = redis::cmd("XRANGE");
        xrange.arg(stream).arg(entry).arg(entry);
        let reply = self
            .store
            .outbox_cmd(&xrange)
            .await
            .map_err(self.fail("outbox read"))?;
        Ok(entries(&reply).into_iter().next())
    }

    /// Sends the parked message `id` again (first in its key): `false`
    /// when no parked message has that id.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// store.outbox().retry("9f1c0e6a2b7d4c1e8f3a5b6c7d8e9f01").await?;
    /// # Ok(()) }
    /// ```
    pub async fn retry(&self, id: &str) -> Result<bool, Error> {
        for ((keys, entry), parked) in self.parked_with_place(usize::MAX).await? {
            if parked.id == id {
                let mut hdel = redis::cmd("HDEL");
                hdel.arg(&keys.parked).arg(&entry);
                self.store
                    .outbox_cmd(&hdel)
                    .await
                    .map_err(self.fail("outbox retry"))?;
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Sends every parked message again; answers how many.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// let n = store.outbox().retry_all().await?;
    /// # Ok(()) }
    /// ```
    pub async fn retry_all(&self) -> Result<u64, Error> {
        let mut n = 0;
        for listed in self.streams().await? {
            let mut del = redis::cmd("DEL");
            del.arg(&listed.keys.parked);
            let marks = self.parked_entries(&listed.keys).await?.len();
            self.store
                .outbox_cmd(&del)
                .await
                .map_err(self.fail("outbox retry"))?;
            n += u64::try_from(marks).unwrap_or(0);
        }
        Ok(n)
    }

    /// Gives up on the parked message `id`: deletes it, and its key's later
    /// messages go on. Answers what was dropped, `None` when no parked
    /// message has that id.
    ///
    /// ```no_run
    /// # async fn demo(store: idem_redis::RedisStore) -> Result<(), idem_core::Error> {
    /// if let Some(m) = store.outbox().drop_parked("9f1c0e6a2b7d4c1e8f3a5b6c7d8e9f01").await? {
    ///     eprintln!("dropped {} to {}", m.id, m.topic);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn drop_parked(&self, id: &str) -> Result<Option<Parked>, Error> {
        for ((keys, entry), parked) in self.parked_with_place(usize::MAX).await? {
            if parked.id == id {
                let mut pipe = redis::pipe();
                pipe.atomic();
                pipe.cmd("XDEL").arg(&keys.stream).arg(&entry).ignore();
                pipe.cmd("HDEL").arg(&keys.parked).arg(&entry).ignore();
                self.store
                    .outbox_pipe(&pipe)
                    .await
                    .map_err(self.fail("outbox drop"))?;
                return Ok(Some(parked));
            }
        }
        Ok(None)
    }
}

/// A parked entry's mark: `attempts:parked-at-ms:reason`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParkedMark {
    pub(crate) attempts: u32,
    pub(crate) at_ms: u64,
    pub(crate) reason: String,
}

impl ParkedMark {
    pub(crate) fn render(&self) -> String {
        format!("{}:{}:{}", self.attempts, self.at_ms, self.reason)
    }

    /// Reads a mark; what cannot be read is kept as the reason.
    fn parse(text: &str) -> ParkedMark {
        let mut parts = text.splitn(3, ':');
        let attempts = parts.next().and_then(|a| a.parse().ok());
        let at_ms = parts.next().and_then(|a| a.parse().ok());
        match (attempts, at_ms, parts.next()) {
            (Some(attempts), Some(at_ms), Some(reason)) => ParkedMark {
                attempts,
                at_ms,
                reason: reason.to_owned(),
            },
            _ => ParkedMark {
                attempts: 1,
                at_ms: 0,
                reason: text.to_owned(),
            },
        }
    }
}

/// `XRANGE`'s start for the entries after `after` (exclusive; `-`: all).
fn range_start(after: &str) -> String {
    if after == "-" {
        "-".to_owned()
    } else {
        format!("({after}")
    }
}

/// A stream entry id as (ms, seq), for ordering; (0, 0) when malformed.
pub(crate) fn entry_order(id: &str) -> (u64, u64) {
    let mut parts = id.splitn(2, '-');
    let ms = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let seq = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    (ms, seq)
}

/// How long ago an entry was appended, from the ms in its id.
fn entry_age(id: &str) -> Duration {
    let at = UNIX_EPOCH + Duration::from_millis(entry_order(id).0);
    SystemTime::now().duration_since(at).unwrap_or_default()
}

pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) | Value::VerbatimString { text: s, .. } => Some(s.clone()),
        Value::Int(n) => Some(n.to_string()),
        Value::Double(d) => Some(d.to_string()),
        _ => None,
    }
}

/// A flat list of pairs (RESP2) or a map (RESP3) as text pairs.
fn pairs(reply: &Value) -> Vec<(String, String)> {
    match reply {
        Value::Map(m) => m
            .iter()
            .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
            .collect(),
        Value::Array(items) => {
            // ZRANGE … WITHSCORES in RESP3 answers [member, score] pairs.
            if items
                .iter()
                .all(|i| matches!(i, Value::Array(p) if p.len() == 2))
                && !items.is_empty()
            {
                return items
                    .iter()
                    .filter_map(|i| match i {
                        Value::Array(p) => Some((text(&p[0])?, text(&p[1])?)),
                        _ => None,
                    })
                    .collect();
            }
            items
                .chunks_exact(2)
                .filter_map(|p| Some((text(&p[0])?, text(&p[1])?)))
                .collect()
        }
        _ => Vec::new(),
    }
}

/// An `XRANGE` reply as entries.
fn entries(reply: &Value) -> Vec<Entry> {
    let Value::Array(items) = reply else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|item| {
            let Value::Array(parts) = item else {
                return None;
            };
            let id = text(parts.first()?)?;
            let message = parts
                .get(1)
                .map_or_else(|| Err("no fields".to_owned()), |f| message(&id, f));
            Some(Entry { id, message })
        })
        .collect()
}

/// The fields of entry `entry` as the message it carries.
fn message(entry: &str, fields: &Value) -> Result<OutboxMessage, String> {
    let list: Vec<(&Value, &Value)> = match fields {
        Value::Array(f) => f.chunks_exact(2).map(|p| (&p[0], &p[1])).collect(),
        Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
        _ => return Err("its fields are not a list".to_owned()),
    };
    let (mut id, mut topic, mut key, mut payload) = (None, None, None, None);
    let mut headers = None;
    for (k, v) in list {
        let Value::BulkString(name) = k else { continue };
        match name.as_slice() {
            b"id" => id = text(v),
            b"topic" => topic = text(v),
            b"key" => key = text(v),
            b"payload" => {
                if let Value::BulkString(b) = v {
                    payload = Some(bytes::Bytes::from(b.clone()));
                }
            }
            n if n == HEADERS_FIELD.as_bytes() => headers = Some(v),
            _ => {}
        }
    }
    let missing = |name: &str| format!("field `{name}` is missing or not text");
    let message = OutboxMessage::new(
        id.ok_or_else(|| missing("id"))?,
        topic.ok_or_else(|| missing("topic"))?,
        key.ok_or_else(|| missing("key"))?,
        payload.ok_or_else(|| "field `payload` is missing".to_owned())?,
    );
    let Some(field) = headers else {
        return Ok(message);
    };
    let decoded = match field {
        Value::BulkString(b) => decode_headers(b),
        _ => Err("not a string".to_owned()),
    };
    match decoded {
        Ok(headers) => Ok(message.with_headers(headers)),
        Err(why) => {
            tracing::warn!(
                entry,
                id = %message.id,
                reason = %why,
                "outbox entry's `headers` field is unreadable: sending the message without headers"
            );
            Ok(message)
        }
    }
}
