//! Batches on Redis (`Store::claim_batch`, `Store::finish_batch`): the
//! single calls' commands, pipelined. A standalone server gets one round
//! trip per batch (plus one for the claims that found a pending record and
//! need the claim script); a cluster gets one pipeline per slot, sent
//! concurrently, since redis-rs routes a pipeline by its keys' one slot.
//!
//! A batch is a transport: every key gets exactly the commands its single
//! call would send. A key that comes more than once is split into waves
//! ([`key_waves`](crate::store::key_waves)), so each wave holds a key at most once and the waves run
//! in order: a key's items see each other's effects
//! in batch order, whatever is retried inside a wave. An item redirected
//! (`MOVED`/`ASK`, a cluster resharding) or whose script is gone
//! (`NOSCRIPT`) is sent again alone through the single call, which follows
//! redirects and loads scripts.

use super::complete::{CompletePath, complete_batch_cmd, complete_script_cmd, is_ok};
use super::record::{self, MS_DIGITS, PendingRecord, Record, pending_record};
use super::reply::{
    answer_found, as_int, classify, classify_claim, is_noscript, is_oom, parse_claim, parse_write,
    protocol, unreached,
};
use super::scripts::{SCRIPTS, invocation};
use super::{Conn, RedisStore};
use futures_util::future::join_all;
use idem_core::Error;
use idem_core::store::Token;
use idem_core::store::{Claim, ClaimReply, Finish, WriteReply};
use idem_core::store::{Store, in_waves};
use redis::cluster_routing::Slot;
use redis::{Cmd, RedisError, Value};
use smallvec::{SmallVec, smallvec};
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, PoisonError};

/// What one item of a pipeline got back: the replies of its commands, or
/// the error of its first command (or of the whole pipeline). Inline: an
/// item has one command (two with `PTTL`), and a batch has an item per
/// message.
type ItemReplies = Result<ItemValues, RedisError>;

/// The replies of one item of a pipeline.
type ItemValues = SmallVec<[Value; 2]>;

/// The commands of one item of a pipeline.
type ItemCmds = SmallVec<[Cmd; 2]>;

/// `SET key pending NX PX ttl GET`: a claim's common paths as one plain
/// command (creates a fresh record, or hands back the one there).
pub(super) fn set_nx_get_cmd(key: &str, record: &PendingRecord<'_>, ttl: u64) -> Cmd {
    let mut set = Cmd::with_capacity(7, 3 + key.len() + 3 + 16 + 32 + 2 * MS_DIGITS + 12);
    set.arg("SET")
        .arg(key)
        .arg(record)
        .arg("NX")
        .arg("PX")
        .arg(ttl)
        .arg("GET");
    set
}

/// The claim script's invocation, for a claim that found a pending record.
///
/// `waiting`: a caller in this process is subscribed to the key and waits
/// on it, so a pending record another token holds is marked (`WAITED`)
/// and the holder's complete publishes.
pub(super) fn claim_script_cmd(
    claim: &Claim<'_>,
    record: &PendingRecord<'_>,
    ttl: u64,
    waiting: bool,
) -> Cmd {
    let want = if claim.want_ttl_left { "1" } else { "0" };
    let waiting = if waiting { "1" } else { "0" };
    let mut cmd = invocation(
        SCRIPTS.claim.script.get_hash(),
        claim.key,
        4,
        3 + 16 + 32 + 2 * MS_DIGITS + 4,
    );
    cmd.arg(record).arg(ttl).arg(want).arg(waiting);
    cmd
}

/// The release script's invocation.
fn release_cmd(key: &str, token: &Token) -> Cmd {
    let mut cmd = invocation(SCRIPTS.release.script.get_hash(), key, 1, 32);
    cmd.arg(token.as_bytes().as_slice());
    cmd
}

/// Whether an item must be sent again alone: the cluster moved its slot
/// (or is between states), which the single call's routing follows.
fn redirected(e: &RedisError) -> bool {
    e.is_cluster_error()
}

/// What the first round trip of a claim decided.
enum Step {
    /// Answered.
    Reply(Result<ClaimReply, Error>),
    /// A pending record is there: the claim script decides.
    Script,
    /// Sent again alone (redirected, or refused for lack of memory, where
    /// the single call reads the record to answer what needs no write).
    Alone,
}

/// Reads the `SET NX GET` (and `PTTL`) replies of one claim.
fn first_step(claim: &Claim<'_>, replies: ItemReplies) -> Step {
    let mut replies = match replies {
        Ok(replies) => replies.into_iter(),
        Err(e) if redirected(&e) => return Step::Alone,
        Err(e) => {
            let e = classify_claim(e);
            return if is_oom(&e) {
                Step::Alone
            } else {
                Step::Reply(Err(e))
            };
        }
    };
    let found = replies.next().unwrap_or(Value::Nil);
    let pttl = as_int(replies.next().as_ref()).unwrap_or(-1);
    let found = match found {
        Value::Nil => return Step::Reply(Ok(ClaimReply::Acquired { attempt: 1 })),
        Value::BulkString(found) => found,
        other => return Step::Reply(Err(protocol("claim", &other))),
    };
    match record::decode(found, pttl) {
        Ok(Record::Pending(_)) => Step::Script,
        Ok(completed) => Step::Reply(
            answer_found(completed, claim, pttl).ok_or_else(|| protocol("claim", &Value::Nil)),
        ),
        Err(corrupt) => Step::Reply(Err(corrupt)),
    }
}

impl RedisStore {
    /// Sends each item's commands, as few round trips as the topology
    /// allows, and answers each item's replies in order.
    async fn pipelined(&self, items: Vec<(&str, ItemCmds)>) -> Vec<ItemReplies> {
        match &self.conn {
            Conn::Single(c) => send_group(&mut c.clone(), items, None).await.0,
            Conn::Cluster(c) => {
                // redis-rs routes a pipeline to its first key's slot and
                // refuses one that spans slots: one pipeline per slot.
                let mut groups: HashMap<Slot, Vec<usize>> = HashMap::new();
                for (i, (key, _)) in items.iter().enumerate() {
                    groups.entry(Slot::for_key(key)).or_default().push(i);
                }
                let n = items.len();
                let mut items: Vec<Option<(&str, ItemCmds)>> =
                    items.into_iter().map(Some).collect();
                let sends: Vec<_> = groups
                    .into_values()
                    .map(|indices| {
                        let group: Vec<(&str, ItemCmds)> = indices
                            .iter()
                            .filter_map(|&i| items.get_mut(i).and_then(Option::take))
                            .collect();
                        let mut conn = c.clone();
                        async move { (indices, send_group(&mut conn, group, None).await.0) }
                    })
                    .collect();
                let mut out: Vec<Option<ItemReplies>> = (0..n).map(|_| None).collect();
                for (indices, replies) in join_all(sends).await {
                    for (i, reply) in indices.into_iter().zip(replies) {
                        if let Some(slot) = out.get_mut(i) {
                            *slot = Some(reply);
                        }
                    }
                }
                out.into_iter()
                    .map(|r| r.unwrap_or_else(|| Err(short_reply())))
                    .collect()
            }
        }
    }

    /// `Store::claim_batch`: wave by wave, one pipelined `SET NX GET` per
    /// claim, then one pipelined claim script per claim that found a
    /// pending record.
    pub(super) async fn claim_many(&self, claims: &[Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        in_waves(
            claims,
            |c| c.key,
            |batch| async move { self.claim_wave(&batch).await },
            || protocol("claim", &Value::Nil),
        )
        .await
    }

    /// The claims of one wave (distinct keys).
    async fn claim_wave(&self, claims: &[&Claim<'_>]) -> Vec<Result<ClaimReply, Error>> {
        let plans: Vec<(PendingRecord<'_>, u64)> =
            claims.iter().map(|c| pending_record(c)).collect();
        let items = claims
            .iter()
            .zip(&plans)
            .map(|(c, (record, ttl))| {
                let mut cmds: ItemCmds = smallvec![set_nx_get_cmd(c.key, record, *ttl)];
                if c.want_ttl_left {
                    let mut pttl = redis::cmd("PTTL");
                    pttl.arg(c.key);
                    cmds.push(pttl);
                }
                (c.key, cmds)
            })
            .collect();
        let steps: Vec<Step> = claims
            .iter()
            .zip(self.pipelined(items).await)
            .map(|(c, replies)| first_step(c, replies))
            .collect();
        let contended: Vec<usize> = (0..steps.len())
            .filter(|&i| matches!(steps.get(i), Some(Step::Script)))
            .collect();
        let scripted = contended
            .iter()
            .filter_map(|&i| Some((claims.get(i)?, plans.get(i)?)))
            .map(|(c, (record, ttl))| {
                let waiting = self.waited_on(c.key);
                (c.key, smallvec![claim_script_cmd(c, record, *ttl, waiting)])
            })
            .collect();
        let mut scripted = contended
            .into_iter()
            .zip(self.pipelined(scripted).await)
            .collect::<HashMap<usize, ItemReplies>>();
        let mut out = Vec::with_capacity(claims.len());
        for (i, (step, claim)) in steps.into_iter().zip(claims).enumerate() {
            out.push(match step {
                Step::Reply(reply) => reply,
                Step::Alone => self.claim(**claim).await,
                Step::Script => match scripted.remove(&i).map(only_reply) {
                    Some(Ok(v)) => parse_claim(v),
                    Some(Err(e)) if !is_noscript(&e) && !redirected(&e) => {
                        Err(classify("claim", e))
                    }
                    // The single script path loads the script where it
                    // is gone and follows a redirect.
                    _ => {
                        let (record, ttl) = pending_record(claim);
                        self.claim_contended(claim, record, ttl).await
                    }
                },
            });
        }
        out
    }

    /// `Store::finish_batch`: wave by wave, one pipelined script call per
    /// complete or release; on Valkey 8.1+ and Redis 8.4+, a complete of a
    /// claim this process made fresh is a plain `SET … IFEQ` instead (and
    /// the script, alone, when that does not match).
    ///
    /// `then` goes last in the pipeline, after every write, when it can:
    /// on a single Redis (not a cluster) and for a batch with no key twice
    /// (one wave). It goes through the `rider` script, which runs it only
    /// once every complete of the batch is stored, and else answers an
    /// `UNSTORED` error reply (lua/README.md, "rider"). Its reply comes
    /// back with the writes' (an error reply as `Value::ServerError`);
    /// `None` when it was not sent.
    pub(super) async fn finish_many(
        &self,
        ops: &[Finish<'_>],
        then: Option<&Cmd>,
    ) -> (Vec<Result<WriteReply, Error>>, Option<Result<Value, Error>>) {
        // A complete with outbox messages or a durability has a path of
        // its own (complete.rs): such a batch is answered as single calls
        // in its order would be. The runtime's batches have none.
        if ops.iter().any(|op| {
            matches!(op, Finish::Complete(c) if !c.outbox.is_empty() || !c.durability.is_async())
        }) {
            let mut replies = Vec::with_capacity(ops.len());
            for op in ops {
                replies.push(op.run_on(self).await);
            }
            return (replies, None);
        }
        // Carried by one server, after every write: so only on a single
        // Redis, and with a batch that is one wave (no key twice).
        let mut then = then.filter(|_| matches!(self.conn, Conn::Single(_)) && distinct_keys(ops));
        // Written by the one wave that carries `then`.
        let then_reply: Mutex<Option<Result<Value, Error>>> = Mutex::new(None);
        let replies = in_waves(
            ops,
            Finish::key,
            |batch| {
                let then = then.take();
                let then_reply = &then_reply;
                async move {
                    // Without IFEQ the completes are scripts: on one Redis
                    // they go as one call (a cluster's keys span slots).
                    let scripted = matches!(self.conn, Conn::Single(_))
                        && self.server.path() == CompletePath::Script;
                    let joint: Vec<bool> = batch
                        .iter()
                        .map(|op| {
                            scripted && matches!(op, Finish::Complete(c) if c.as_claimed.is_some())
                        })
                        .collect();
                    let mut plain = Vec::with_capacity(batch.len());
                    let mut items: Vec<(&str, ItemCmds)> = batch
                        .iter()
                        .zip(&joint)
                        .filter(|(_, joint)| !**joint)
                        .map(|(op, _)| {
                            let cmd = match **op {
                                Finish::Complete(c) => c.claim().and_then(|claim| {
                                    self.server.complete_plain_cmd(&claim, c.kind, c.value)
                                }),
                                Finish::Release { .. } => None,
                            };
                            plain.push(cmd.is_some());
                            (op.key(), smallvec![cmd.unwrap_or_else(|| finish_cmd(op))])
                        })
                        .collect();
                    let completes: Vec<&Finish<'_>> = batch
                        .iter()
                        .zip(&joint)
                        .filter(|(_, joint)| **joint)
                        .map(|(op, _)| *op)
                        .collect();
                    if let Some(first) = completes.first() {
                        items.push((first.key(), smallvec![complete_batch_cmd(&completes)]));
                    }
                    // `then` goes through the `rider` script, which runs
                    // it only once every complete of the batch is stored:
                    // a complete that is not (its script gone, an `IFEQ`
                    // that did not match) is stored alone after this
                    // round trip, and its entry must not be acked before
                    // that.
                    let gate = then.and_then(|then| {
                        let keys = batch.iter().filter_map(|op| match op {
                            Finish::Complete(c) => Some(c.key),
                            Finish::Release { .. } => None,
                        });
                        rider_cmd(keys, then)
                    });
                    let mut replies = match (gate, &self.conn) {
                        (Some(gate), Conn::Single(c)) => {
                            let (replies, extra) =
                                send_group(&mut c.clone(), items, Some(gate)).await;
                            if let Some(Ok(Value::ServerError(e))) = &extra
                                && e.code() == "NOSCRIPT"
                                && let Some(op) = batch.first()
                                && let Err(load) = self.reload(&SCRIPTS.rider, op.key()).await
                            {
                                tracing::debug!(error = %load, "the rider script could not be loaded again");
                            }
                            let extra = match extra {
                                Some(Ok(v)) => Ok(v),
                                Some(Err(e)) => Err(classify("finish_batch", e)),
                                None => Err(protocol("finish_batch", &Value::Nil)),
                            };
                            *then_reply.lock().unwrap_or_else(PoisonError::into_inner) =
                                Some(extra);
                            replies
                        }
                        _ => self.pipelined(items).await,
                    };
                    let mut joint_replies = match completes.first() {
                        Some(first) => {
                            let reply = replies.pop().unwrap_or_else(|| Err(short_reply()));
                            self.joint_replies(reply, completes.len(), first.key())
                                .await
                                .into_iter()
                        }
                        None => Vec::new().into_iter(),
                    };
                    let mut replies = replies.into_iter();
                    let mut plain = plain.into_iter();
                    let mut out = Vec::with_capacity(batch.len());
                    for (op, joint) in batch.into_iter().zip(joint) {
                        let op_name = finish_name(op);
                        if joint {
                            out.push(match joint_replies.next() {
                                Some(Ok(v)) => parse_write(op_name, v),
                                Some(Err(e)) if unreached(&e) => Err(classify(op_name, e)),
                                // Refused, or the script gone: alone, as
                                // the single complete loads it.
                                _ => self.finish_alone(op).await,
                            });
                            continue;
                        }
                        let replies = replies.next().unwrap_or_else(|| Err(short_reply()));
                        let plain = plain.next().unwrap_or(false);
                        out.push(match replies {
                            Ok(r) if plain && is_ok(r.first()) => Ok(WriteReply::Done),
                            // Not the record this process wrote (or refused):
                            // the script says what is there.
                            Ok(_) if plain => self.finish_alone(op).await,
                            // The connection failed: as the single complete.
                            Err(e) if plain && unreached(&e) => Err(classify(op_name, e)),
                            // Refused (out of memory, another type): the
                            // script may still write, or says what is there.
                            Err(_) if plain => self.finish_alone(op).await,
                            replies => match only_reply(replies) {
                                Ok(v) => parse_write(op_name, v),
                                Err(e) if !is_noscript(&e) && !redirected(&e) => {
                                    Err(classify(op_name, e))
                                }
                                Err(_) => self.finish_alone(op).await,
                            },
                        });
                    }
                    out
                }
            },
            || protocol("complete", &Value::Nil),
        )
        .await;
        let then_reply = then_reply
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner);
        (replies, then_reply)
    }

    /// [`finish_batch`](idem_core::store::Store::finish_batch), with `then`
    /// sent in the same round trip after every write of `ops`, when this
    /// store can carry it: on a single Redis (not a cluster) and for a
    /// batch with no key twice. Answers the writes' replies, as
    /// `finish_batch` would, and `then`'s reply (an error reply as
    /// `Value::ServerError`; `Err` when the round trip failed, and it may
    /// or may not have run), or `None` when `then` was not sent: its
    /// caller then sends it itself. A server that executes `then` has
    /// executed those writes first, and runs it only if every complete of
    /// `ops` is stored by then: it goes through the `rider` script
    /// (lua/README.md, "rider"), so a complete that is not (its script
    /// gone, a `SET … IFEQ` that did not match or was refused, another
    /// owner's record; stored alone after the round trip, or refused)
    /// withholds `then`, and its reply is an error reply, `UNSTORED` (or
    /// `NOSCRIPT` when the rider script itself was gone: it is loaded again
    /// for the next batch), after which the caller sends it itself once the
    /// results are stored. A refusal of `then` by the ACL answers
    /// `NOPERM`. idem-consumer's Redis Streams adapter acks the entries
    /// whose results these are this way, so an entry is never acked before
    /// its result is stored.
    ///
    /// ```no_run
    /// use idem_core::store::{Claim, Complete, Finish, Store, Token, ValueKind};
    /// use idem_redis::RedisStore;
    /// use std::time::Duration;
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = RedisStore::connect("redis://127.0.0.1/").await?;
    /// let token = Token::random();
    /// let claim = Claim::new("idem:orders:7", &token, Duration::from_secs(5), Duration::from_secs(60));
    /// store.claim(claim).await?;
    /// let mut xack = redis::cmd("XACK");
    /// xack.arg("orders").arg("billing").arg("1-0");
    /// let done = [Finish::Complete(Complete::of_claim(&claim, ValueKind::Json, b"7"))];
    /// let (replies, acked) = store.finish_batch_then(&done, &xack).await;
    /// assert!(replies[0].is_ok());
    /// println!("XACK answered {acked:?}");
    /// # Ok(()) }
    /// ```
    pub async fn finish_batch_then(
        &self,
        ops: &[Finish<'_>],
        then: &Cmd,
    ) -> (Vec<Result<WriteReply, Error>>, Option<Result<Value, Error>>) {
        self.finish_many(ops, Some(then)).await
    }
}

impl RedisStore {
    /// The reply of one `complete_batch` call, split per complete: `n`
    /// replies, or the call's error for each. After `NOSCRIPT` the script
    /// is loaded again (for the next batch; these complete alone).
    async fn joint_replies(
        &self,
        reply: ItemReplies,
        n: usize,
        key: &str,
    ) -> Vec<Result<Value, RedisError>> {
        let values = match reply.map(|r| r.into_iter().next()) {
            Ok(Some(Value::Array(values))) if values.len() == n => values,
            Ok(other) => {
                let e = RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "complete_batch answered something other than one reply per key",
                    format!("{other:?}"),
                ));
                return vec![Err(e); n];
            }
            Err(e) => {
                if is_noscript(&e)
                    && let Err(load) = self.reload(&SCRIPTS.complete_batch, key).await
                {
                    tracing::debug!(error = %load, "complete_batch could not be loaded again");
                }
                return vec![Err(e); n];
            }
        };
        values
            .into_iter()
            .map(|v| match v {
                Value::ServerError(e) => Err(e.into()),
                v => Ok(v),
            })
            .collect()
    }
}

/// The `rider` script's invocation: `carried` (the command
/// [`RedisStore::finish_batch_then`] carries), run only if each of `keys`
/// holds a completed record by then. `None` for a command with a cursor
/// argument (an `XACK` has none), or an argument of a kind redis-rs adds
/// later: not carried.
fn rider_cmd<'k>(keys: impl Iterator<Item = &'k str> + Clone, carried: &Cmd) -> Option<Cmd> {
    let n = keys.clone().count();
    let mut cmd = Cmd::with_capacity(3 + n + carried.args_iter().len(), 0);
    cmd.arg("EVALSHA")
        .arg(SCRIPTS.rider.script.get_hash())
        .arg(n);
    for key in keys {
        cmd.arg(key);
    }
    for arg in carried.args_iter() {
        match arg {
            redis::Arg::Simple(a) => cmd.arg(a),
            _ => return None,
        };
    }
    Some(cmd)
}

/// No key twice: the batch goes to the store as one wave.
fn distinct_keys(ops: &[Finish<'_>]) -> bool {
    let mut seen: HashSet<&str, foldhash::fast::RandomState> =
        HashSet::with_capacity_and_hasher(ops.len(), Default::default());
    ops.iter().all(|op| seen.insert(op.key()))
}

impl RedisStore {
    /// One item of a finish batch sent again alone, through the scripts
    /// (which load themselves where they are gone, and follow redirects):
    /// a plain `SET … IFEQ` that did not match is not tried twice.
    async fn finish_alone(&self, op: &Finish<'_>) -> Result<WriteReply, Error> {
        match op {
            Finish::Complete(c) => self.complete_script(c).await,
            Finish::Release { key, token } => self.release(key, token).await,
        }
    }
}

/// The command of one complete or release.
fn finish_cmd(op: &Finish<'_>) -> Cmd {
    match op {
        Finish::Complete(c) => complete_script_cmd(c),
        Finish::Release { key, token } => release_cmd(key, token),
    }
}

/// The operation's name in errors and metrics.
fn finish_name(op: &Finish<'_>) -> &'static str {
    match op {
        Finish::Complete { .. } => "complete",
        Finish::Release { .. } => "release",
    }
}

/// The one reply of a one-command item.
fn only_reply(replies: ItemReplies) -> Result<Value, RedisError> {
    replies?.into_iter().next().ok_or_else(short_reply)
}

/// A pipeline that answered fewer replies than it was sent commands.
fn short_reply() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "Redis answered a pipeline with fewer replies than commands; the connection is reset on the next call",
    ))
}

/// Sends the items' commands as one pipeline on `conn` and splits the
/// replies per item. A failed pipeline fails each of its items.
///
/// `extra` goes last; its reply comes back apart.
async fn send_group(
    conn: &mut impl redis::aio::ConnectionLike,
    items: Vec<(&str, ItemCmds)>,
    extra: Option<Cmd>,
) -> (Vec<ItemReplies>, Option<Result<Value, RedisError>>) {
    if items.is_empty() && extra.is_none() {
        return (Vec::new(), None);
    }
    let mut pipe = redis::pipe();
    // Each command's error stays in its place, for its own item.
    pipe.ignore_errors();
    let counts: Vec<usize> = items.iter().map(|(_, cmds)| cmds.len()).collect();
    for cmd in items.into_iter().flat_map(|(_, cmds)| cmds) {
        pipe.add_command(cmd);
    }
    let with_extra = extra.is_some();
    if let Some(cmd) = extra {
        pipe.add_command(cmd);
    }
    let replies: Vec<Value> = match pipe.query_async(conn).await {
        Ok(replies) => replies,
        Err(e) => {
            let extra = with_extra.then(|| Err(e.clone()));
            return (counts.iter().map(|_| Err(e.clone())).collect(), extra);
        }
    };
    let mut replies = replies.into_iter();
    let items = counts
        .into_iter()
        .map(|n| {
            let item: ItemValues = replies.by_ref().take(n).collect();
            match item.first() {
                None => Err(short_reply()),
                Some(Value::ServerError(e)) => Err(e.clone().into()),
                Some(_) => Ok(item),
            }
        })
        .collect();
    // An error reply (`Value::ServerError`) is `extra`'s sender's to read.
    let extra = with_extra.then(|| replies.next().ok_or_else(short_reply));
    (items, extra)
}
