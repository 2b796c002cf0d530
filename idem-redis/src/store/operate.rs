//! Operator commands on Redis: `inspect` (pipelined `GET` + `PTTL`),
//! `forget` (the `forget` script: check and delete in one step) and `scan`
//! (`SCAN … MATCH` on every master, then `GET` + `PTTL` per page).

use super::notify::FORGOTTEN;
use super::record::{self, Code, Record, unreadable, wrong_type};
use super::reply::{as_int, classify, protocol, unavailable};
use super::scripts::{SCRIPTS, invocation};
use super::{Conn, RedisStore};
use idem_core::Error;
use idem_core::store::failure_key;
use idem_core::store::namespace_prefix;
use idem_core::store::{RecordInfo, ScanPage, millis};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{RedisError, Value};
use std::time::Duration;

/// A cluster master's address: host, port.
type Node = (String, u16);

/// A record and its `PTTL` as an operator sees them (value only if asked).
pub(super) fn info(record: Record, pttl: i64, with_value: bool) -> RecordInfo {
    let ttl_left = u64::try_from(pttl).ok().map(Duration::from_millis);
    match record {
        Record::Pending(p) => {
            // The lease is live while the key's PTTL is above LEASE_END.
            let lease_left = u64::try_from(pttl)
                .ok()
                .and_then(|t| t.checked_sub(p.lease_end))
                .unwrap_or(0);
            RecordInfo::pending(
                p.attempt,
                ttl_left,
                Duration::from_millis(lease_left),
                p.fingerprint,
            )
            .with_steps(p.steps.into_iter().map(|s| s.name).collect())
        }
        Record::Completed(c) => {
            RecordInfo::completed(c.kind, c.value, c.fingerprint, ttl_left, with_value)
        }
    }
}

/// A server error inside a pipeline reply: another Redis type is a corrupt
/// record, as the scripts report it; the rest as any error.
fn item_error(op: &'static str, e: RedisError) -> Error {
    if e.code() == Some("WRONGTYPE") {
        return wrong_type();
    }
    classify(op, e)
}

/// Reads the `GET` and `PTTL` replies of one key; `None` when there is no
/// record (absent, or expired since it was listed).
fn read_pair(
    op: &'static str,
    get: Option<Value>,
    pttl: Option<Value>,
    with_value: bool,
) -> Option<Result<RecordInfo, Error>> {
    let raw = match get {
        Some(Value::Nil) => return None,
        Some(Value::BulkString(raw)) => raw,
        Some(Value::ServerError(e)) => return Some(Err(item_error(op, e.into()))),
        other => return Some(Err(protocol(op, &other.unwrap_or(Value::Nil)))),
    };
    let pttl = as_int(pttl.as_ref()).unwrap_or(-1);
    Some(record::decode(raw, pttl).map(|r| info(r, pttl, with_value)))
}

/// `SCAN`'s pattern for keys starting with `prefix`: glob characters
/// escaped, since a namespace or scope may hold them (`:` and `%` are
/// percent-escaped already, `key.rs`).
fn match_pattern(prefix: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 8);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('*');
    out
}

/// A cluster scan's position: which master (by address, so a page never
/// lands on another node than the one whose cursor it carries) and the
/// cursor on it.
fn split_cluster_cursor(cursor: &str) -> Option<(&str, u16, &str)> {
    let (addr, at) = cursor.rsplit_once('@')?;
    let (host, port) = addr.rsplit_once(':')?;
    Some((host, port.parse().ok()?, at))
}

impl RedisStore {
    pub(super) async fn inspect_key(
        &self,
        key: &str,
        with_value: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let mut pipe = redis::pipe();
        pipe.ignore_errors()
            .cmd("GET")
            .arg(key)
            .cmd("PTTL")
            .arg(key);
        let replies: Result<Vec<Value>, RedisError> = match &self.conn {
            Conn::Single(c) => pipe.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => pipe.query_async(&mut c.clone()).await,
        };
        let mut replies = replies.map_err(|e| item_error("inspect", e))?.into_iter();
        read_pair("inspect", replies.next(), replies.next(), with_value).transpose()
    }

    pub(super) async fn forget_key(
        &self,
        key: &str,
        force: bool,
    ) -> Result<Option<RecordInfo>, Error> {
        let lua = &SCRIPTS.forget;
        let mut cmd = invocation(lua.script.get_hash(), key, 1, 1);
        cmd.arg(if force { "1" } else { "0" });
        let reply = self.eval("forget", lua, key, &cmd).await?;
        let mut items = match reply {
            Value::Int(i) => {
                return match Code::of(i) {
                    Some(Code::Missing) => Ok(None),
                    Some(Code::WrongType) => Err(wrong_type()),
                    _ => Err(protocol("forget", &Value::Int(i))),
                };
            }
            Value::Array(items) => items,
            other => return Err(protocol("forget", &other)),
        };
        let code = as_int(items.first()).and_then(Code::of);
        let take = |items: &mut Vec<Value>, at: usize| match items.get_mut(at) {
            Some(Value::BulkString(raw)) => Some(std::mem::take(raw)),
            _ => None,
        };
        match (code, items.len()) {
            (Some(Code::Done), 3) => {
                self.publish_forgotten(key).await;
                let pttl = as_int(items.get(2)).unwrap_or(-1);
                let raw = take(&mut items, 1).ok_or_else(|| protocol("forget", &Value::Nil))?;
                Ok(Some(info(record::decode(raw, pttl)?, pttl, false)))
            }
            (Some(Code::InProgress), 4) => {
                let left = as_int(items.get(1)).unwrap_or(0);
                let pttl = as_int(items.get(3)).unwrap_or(-1);
                let attempt = match take(&mut items, 2).map(|raw| record::decode(raw, pttl)) {
                    Some(Ok(Record::Pending(p))) => p.attempt,
                    _ => 1,
                };
                Err(Error::LeaseHeld {
                    lease_left: Duration::from_millis(u64::try_from(left).unwrap_or(0)),
                    attempt,
                })
            }
            (Some(Code::Unreadable), 2) => {
                let raw = take(&mut items, 1).unwrap_or_default();
                Err(unreadable(&raw))
            }
            _ => Err(protocol("forget", &Value::Array(items))),
        }
    }

    /// `Store::count_failure`: the `failure` script on the counter's own
    /// key (one key, so any slot of a cluster), one round trip.
    pub(super) async fn count_failure_key(&self, key: &str, ttl: Duration) -> Result<u32, Error> {
        let counter = failure_key(key);
        let lua = &SCRIPTS.failure;
        let ms = millis(ttl);
        let mut cmd = invocation(lua.script.get_hash(), &counter, 1, 20);
        cmd.arg(ms);
        parse_failure(self.eval("count_failure", lua, &counter, &cmd).await?)
    }

    /// Deletes the failure counter of `key` after a forget: a second
    /// command, since on a cluster the counter lives in another slot than
    /// the record. Best effort: a counter left behind only makes the
    /// key's next failures count from where they were, until it expires.
    pub(super) async fn reset_failures(&self, key: &str) {
        let mut del = redis::cmd("DEL");
        del.arg(failure_key(key));
        if let Err(e) = self.send(&del).await {
            tracing::warn!(error = %e, "forget could not reset the key's failure count (DEL refused?); it expires with its TTL");
        }
    }

    /// Tells the local caches of every process that `key` is gone: one
    /// `SPUBLISH` on its namespace's channel (another slot than the key's,
    /// so not from the script). Best effort: a cache that misses it (this
    /// user may not publish, or the subscriber was down) replays its copy
    /// until the record's TTL at most, as documented on `local_cache`.
    async fn publish_forgotten(&self, key: &str) {
        let mut publish = redis::cmd("SPUBLISH");
        publish
            .arg(format!("{}{FORGOTTEN}", namespace_prefix(key)))
            .arg(key);
        if let Err(e) = self.send(&publish).await {
            tracing::warn!(error = %e, "forget could not tell other processes' local caches (SPUBLISH refused?): their copies replay until the record's TTL");
        }
    }

    pub(super) async fn scan_prefix(
        &self,
        prefix: &str,
        cursor: Option<&str>,
        count: usize,
    ) -> Result<ScanPage, Error> {
        let count = count.clamp(1, 10_000);
        let mut scan = redis::cmd("SCAN");
        // On a cluster: the master this page scans, and the one after it.
        let mut node: Option<(Node, Option<Node>)> = None;
        match &self.conn {
            Conn::Single(_) => {
                scan.arg(cursor.unwrap_or("0"));
            }
            Conn::Cluster(_) => {
                let masters = self.masters().await?;
                let (here, at) = match cursor {
                    None => match masters.first() {
                        Some(first) => (first.clone(), "0"),
                        None => return Ok(ScanPage::default()),
                    },
                    Some(cursor) => {
                        let (host, port, at) = split_cluster_cursor(cursor).ok_or_else(|| {
                            Error::InvalidConfig(format!(
                                "scan cursor {cursor:?} is not one this store wrote; start the scan again"
                            ))
                        })?;
                        ((host.to_owned(), port), at)
                    }
                };
                let idx = masters.iter().position(|m| *m == here).ok_or_else(|| {
                    unavailable(
                        "scan",
                        format!(
                            "the cluster's masters changed during the scan ({}:{} is no longer one); start the scan again",
                            here.0, here.1
                        ),
                    )
                })?;
                scan.arg(at);
                node = Some((here, masters.get(idx + 1).cloned()));
            }
        }
        scan.arg("MATCH")
            .arg(match_pattern(prefix))
            .arg("COUNT")
            .arg(count);
        let route = node
            .as_ref()
            .map(|((host, port), _)| SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            });
        let reply = match (&self.conn, &route) {
            (Conn::Cluster(c), Some(route)) => {
                c.clone()
                    .route_command(scan, RoutingInfo::SingleNode(route.clone()))
                    .await
            }
            _ => self.send(&scan).await,
        }
        .map_err(|e| classify("scan", e))?;
        let (next, keys) = parse_scan(reply)?;
        let cursor = match (next.as_str(), &node) {
            ("0", None) => None,
            (next, None) => Some(next.to_owned()),
            ("0", Some((_, after))) => after
                .as_ref()
                .map(|(host, port)| format!("{host}:{port}@0")),
            (next, Some(((host, port), _))) => Some(format!("{host}:{port}@{next}")),
        };
        if keys.is_empty() {
            return Ok(ScanPage {
                records: Vec::new(),
                cursor,
            });
        }
        let mut pipe = redis::pipe();
        pipe.ignore_errors();
        for key in &keys {
            pipe.cmd("GET").arg(key).cmd("PTTL").arg(key);
        }
        let replies = match (&self.conn, route) {
            (Conn::Cluster(c), Some(route)) => {
                c.clone()
                    .route_pipeline(pipe, 0, 2 * keys.len(), route)
                    .await
            }
            (Conn::Cluster(c), None) => pipe.query_async::<Vec<Value>>(&mut c.clone()).await,
            (Conn::Single(c), _) => pipe.query_async::<Vec<Value>>(&mut c.clone()).await,
        }
        .map_err(|e| classify("scan", e))?;
        let mut replies = replies.into_iter();
        let records = keys
            .into_iter()
            .filter_map(|key| {
                let found = read_pair("scan", replies.next(), replies.next(), false)?;
                Some((key, found))
            })
            .collect();
        Ok(ScanPage { records, cursor })
    }

    /// The cluster's masters as `(host, port)`, sorted so that every page of
    /// a scan walks them in the same order.
    async fn masters(&self) -> Result<Vec<Node>, Error> {
        let Conn::Cluster(c) = &self.conn else {
            return Ok(Vec::new());
        };
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let reply = c
            .clone()
            .route_command(cmd, RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random))
            .await
            .map_err(|e| classify("scan", e))?;
        let Value::Array(ranges) = reply else {
            return Err(protocol("scan", &reply));
        };
        let mut masters: Vec<Node> = ranges
            .iter()
            .filter_map(|range| {
                let Value::Array(parts) = range else {
                    return None;
                };
                let Some(Value::Array(master)) = parts.get(2) else {
                    return None;
                };
                let host = match master.first()? {
                    Value::BulkString(h) => String::from_utf8_lossy(h).into_owned(),
                    Value::SimpleString(h) => h.clone(),
                    _ => return None,
                };
                let port = u16::try_from(as_int(master.get(1))?).ok()?;
                Some((host, port))
            })
            .collect();
        masters.sort();
        masters.dedup();
        Ok(masters)
    }
}

/// The `failure` script's reply: `{DONE, count}`, `{UNREADABLE, bytes}`
/// or `WRONG_TYPE`.
fn parse_failure(reply: Value) -> Result<u32, Error> {
    let bad = |v: &Value| protocol("count_failure", v);
    let items = match reply {
        Value::Int(i) if Code::of(i) == Some(Code::WrongType) => return Err(wrong_type()),
        Value::Array(items) => items,
        other => return Err(bad(&other)),
    };
    match (as_int(items.first()).and_then(Code::of), items.get(1)) {
        (Some(Code::Done), Some(count)) => as_int(Some(count))
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad(count)),
        (Some(Code::Unreadable), Some(Value::BulkString(raw))) => {
            Err(not_a_count(&String::from_utf8_lossy(raw)))
        }
        _ => Err(bad(&Value::Array(items))),
    }
}

/// A failure counter that holds something other than a count.
fn not_a_count(found: &str) -> Error {
    let shown: String = found
        .chars()
        .take(24)
        .map(|c| if c.is_control() { '.' } else { c })
        .collect();
    Error::corrupt(format!(
        "a failure counter holds {shown:?} instead of a count; another program shares this key          space — use a distinct namespace, or delete the key"
    ))
}

/// `SCAN`'s reply: the next cursor and the keys of this page.
fn parse_scan(reply: Value) -> Result<(String, Vec<String>), Error> {
    let bad = |v: &Value| protocol("scan", v);
    let Value::Array(mut parts) = reply else {
        return Err(bad(&reply));
    };
    if parts.len() != 2 {
        return Err(bad(&Value::Array(parts)));
    }
    let keys = parts.pop().unwrap_or(Value::Nil);
    let next = match parts.pop() {
        Some(Value::BulkString(c)) => String::from_utf8_lossy(&c).into_owned(),
        Some(Value::SimpleString(c)) => c,
        Some(Value::Int(i)) => i.to_string(),
        other => return Err(bad(&other.unwrap_or(Value::Nil))),
    };
    let Value::Array(keys) = keys else {
        return Err(bad(&keys));
    };
    let keys = keys
        .into_iter()
        .filter_map(|k| match k {
            Value::BulkString(k) => Some(String::from_utf8_lossy(&k).into_owned()),
            Value::SimpleString(k) => Some(k),
            _ => None,
        })
        .collect();
    Ok((next, keys))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_escape_globs() {
        assert_eq!(match_pattern("idem:charge:"), "idem:charge:*");
        assert_eq!(match_pattern("a*b?[c]\\:"), "a\\*b\\?\\[c\\]\\\\:*");
    }

    #[test]
    fn cluster_cursors_round_trip() {
        assert_eq!(
            split_cluster_cursor("127.0.0.1:7001@1234"),
            Some(("127.0.0.1", 7001, "1234"))
        );
        assert_eq!(split_cluster_cursor("nonsense"), None);
    }
}
