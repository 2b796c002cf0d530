//! The Redis outbox's keys, and the store's side of it: a `complete` that
//! appends the body's staged messages to a stream in the same script.
//!
//! Standalone, one stream holds every message: `<prefix>`, with the parked
//! messages' reasons in the hash `<prefix>.parked` and the relay's lock at
//! `<prefix>.relay`. On a cluster the stream must be on the record's slot
//! (a script touches one slot), so there is one stream per slot that has
//! messages, `<prefix>{T}`, where `T` is a short tag that hashes to that
//! slot; the relay finds them in the sorted set `<prefix>.streams`, which a
//! complete updates (`ZADD`, score = now in ms) before its script.
//!
//! Record keys are `namespace:scope:key` with `:` escaped in the first two,
//! so each holds at least two colons; a prefix holds at most one and the
//! suffixes none, so no outbox key is ever a record key.

use super::reply::classify;
use super::{Conn, RedisStore};
use idem_core::Error;
use redis::cluster_routing::Slot;
use redis::{Cmd, RedisError, Value};
use std::collections::HashMap;
use std::sync::{Arc, LazyLock};

/// The outbox keys' prefix unless the store is given another.
pub(crate) const DEFAULT_PREFIX: &str = "idem-outbox";

/// The stream field that holds a message's headers
/// ([`OutboxMessage::headers`](idem_core::outbox::OutboxMessage::headers)),
/// written only for a message that has any: an entry without it (every
/// entry written before headers existed, and every untraced message) has
/// none.
pub(crate) const HEADERS_FIELD: &str = "headers";

/// A message's headers as the [`HEADERS_FIELD`] holds them: for each
/// header in order, its name then its value, each as a netstring
/// (`<length in decimal>:<bytes>,`, <https://cr.yp.to/proto/netstrings.txt>),
/// so `traceparent` = `00-…-01` is `11:traceparent,55:00-…-01,`. Length
/// prefixed, so any name or value (a `,`, a newline) reads back
/// byte-identical, in order, repeated names kept; still legible in
/// `redis-cli XRANGE`. The one place the encoding is written
/// ([`decode_headers`] reads it); the Lua scripts copy it unread.
///
/// ```text
/// 11:traceparent,55:00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01,10:tracestate,7:vnd=abc,
/// ```
pub(crate) fn encode_headers(headers: &[(String, String)]) -> Vec<u8> {
    let size: usize = headers.iter().map(|(n, v)| n.len() + v.len() + 12).sum();
    let mut out = Vec::with_capacity(size);
    for (name, value) in headers {
        for part in [name, value] {
            out.extend_from_slice(itoa::Buffer::new().format(part.len()).as_bytes());
            out.push(b':');
            out.extend_from_slice(part.as_bytes());
            out.push(b',');
        }
    }
    out
}

/// The headers [`encode_headers`] wrote, or why `field` is not such a
/// value (truncated, a length that is not a number, a name without its
/// value, bytes that are not UTF-8).
pub(crate) fn decode_headers(field: &[u8]) -> Result<Vec<(String, String)>, String> {
    let mut rest = field;
    let mut parts = Vec::new();
    while !rest.is_empty() {
        let colon = rest
            .iter()
            .position(|&b| b == b':')
            .ok_or("a netstring without its `:`")?;
        let digits = rest.get(..colon).unwrap_or_default();
        let len = std::str::from_utf8(digits)
            .ok()
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<usize>().ok())
            .ok_or_else(|| {
                format!(
                    "a netstring length that is not a number: {:?}",
                    String::from_utf8_lossy(digits)
                )
            })?;
        let start = colon + 1;
        let end = start.saturating_add(len);
        let (Some(bytes), Some(b',')) = (rest.get(start..end), rest.get(end)) else {
            return Err(format!(
                "a netstring of {len} bytes is cut short or not closed by `,`"
            ));
        };
        let part = String::from_utf8(bytes.to_vec())
            .map_err(|_| "a header name or value that is not UTF-8".to_owned())?;
        parts.push(part);
        rest = rest.get(end + 1..).unwrap_or_default();
    }
    if parts.len() % 2 != 0 {
        return Err("a header name without its value".to_owned());
    }
    let mut headers = Vec::with_capacity(parts.len() / 2);
    let mut parts = parts.into_iter();
    while let (Some(name), Some(value)) = (parts.next(), parts.next()) {
        headers.push((name, value));
    }
    Ok(headers)
}

/// The keys of one outbox stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamKeys {
    /// The messages, oldest first (`XADD … * id … topic … key … payload …`,
    /// then `headers …` for a message that has any: [`encode_headers`]).
    pub(crate) stream: String,
    /// Parked messages: stream entry id → `attempts:parked-at-ms:reason`.
    pub(crate) parked: String,
    /// The relay draining this stream: its id, with a lease (`PX`).
    pub(crate) lock: String,
}

impl StreamKeys {
    /// The standalone outbox: one stream.
    pub(crate) fn single(prefix: &str) -> StreamKeys {
        StreamKeys {
            stream: prefix.to_owned(),
            parked: format!("{prefix}.parked"),
            lock: format!("{prefix}.relay"),
        }
    }

    /// A cluster outbox stream, by the tag that puts it on its slot.
    fn tagged(prefix: &str, tag: &str) -> StreamKeys {
        StreamKeys {
            stream: format!("{prefix}{{{tag}}}"),
            parked: format!("{prefix}.parked{{{tag}}}"),
            lock: format!("{prefix}.relay{{{tag}}}"),
        }
    }

    /// The keys of a cluster stream named in the index; `None` for a
    /// member that is not one of ours.
    pub(crate) fn from_stream(prefix: &str, stream: &str) -> Option<StreamKeys> {
        let tag = stream
            .strip_prefix(prefix)?
            .strip_prefix('{')?
            .strip_suffix('}')?;
        (!tag.is_empty() && !tag.contains(['{', '}'])).then(|| StreamKeys::tagged(prefix, tag))
    }
}

/// A failed outbox command as idem's error (unreachable, refused…).
pub(crate) fn outbox_error(op: &'static str, e: RedisError) -> Error {
    classify(op, e)
}

/// The sorted set naming a cluster's outbox streams.
pub(crate) fn index_key(prefix: &str) -> String {
    format!("{prefix}.streams")
}

/// For every slot, a short tag that hashes to it: built once, from the
/// base-36 numbers in order (all 16,384 slots are covered by four
/// characters).
static SLOT_TAGS: LazyLock<HashMap<Slot, String>> = LazyLock::new(|| {
    let mut tags = HashMap::with_capacity(16_384);
    let mut n: u64 = 0;
    while tags.len() < 16_384 && n < 36u64.pow(5) {
        let tag = base36(n);
        tags.entry(Slot::for_key(tag.as_bytes())).or_insert(tag);
        n += 1;
    }
    tags
});

/// A short tag that hashes to `key`'s slot (`{tag}` puts another key on
/// that slot): the outbox streams' and the durability fences'.
pub(crate) fn slot_tag(key: &str) -> &'static str {
    SLOT_TAGS
        .get(&Slot::for_key(key.as_bytes()))
        .map_or("0", String::as_str)
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = Vec::new();
    loop {
        out.push(DIGITS[usize::try_from(n % 36).unwrap_or(0)]);
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.reverse();
    String::from_utf8(out).unwrap_or_default()
}

impl RedisStore {
    /// Gives this store's outbox another key prefix (default
    /// `idem-outbox`): one per application sharing a Redis, so that each
    /// relay publishes its own application's messages only. Printable, 1 to
    /// 128 bytes, without spaces, `{` or `}` (the cluster's hash tags are
    /// added after it), and with at most one `:` (so that no outbox key can
    /// be a record key, which holds two).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), idem_core::Error> {
    /// let store = idem_redis::RedisStore::connect("redis://127.0.0.1/").await?.with_outbox_prefix("shop:outbox")?;
    /// # Ok(()) }
    /// ```
    pub fn with_outbox_prefix(mut self, prefix: &str) -> Result<RedisStore, Error> {
        if prefix.is_empty()
            || prefix.len() > 128
            || prefix.contains(['{', '}'])
            || prefix.matches(':').count() > 1
            || prefix.chars().any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(Error::InvalidConfig(format!(
                "outbox prefix {prefix:?}: use 1 to 128 printable bytes without spaces, `{{` or \
                 `}}`, and at most one `:`, such as `shop:outbox`"
            )));
        }
        self.outbox = Arc::from(prefix);
        Ok(self)
    }

    /// The outbox keys' prefix.
    pub(crate) fn outbox_prefix(&self) -> &str {
        &self.outbox
    }

    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(_))
    }

    /// The keys of the outbox stream that takes the messages of the record
    /// at `record_key`: the one stream standalone, the record's slot's on a
    /// cluster.
    pub(crate) fn outbox_keys(&self, record_key: &str) -> StreamKeys {
        if !self.is_cluster() {
            return StreamKeys::single(&self.outbox);
        }
        // Every slot has a tag; were one missing, "0" would put the stream
        // on another slot, and the script would refuse the cross-slot keys
        // and write nothing.
        StreamKeys::tagged(&self.outbox, slot_tag(record_key))
    }

    /// One command on this store's connection (routed by its key on a
    /// cluster), a top-level error reply as an `Err`.
    pub(crate) async fn outbox_cmd(&self, cmd: &Cmd) -> Result<Value, RedisError> {
        self.send(cmd).await
    }

    /// A pipeline (atomic with `pipe.atomic()`; its keys on one slot on a
    /// cluster).
    pub(crate) async fn outbox_pipe(
        &self,
        pipe: &redis::Pipeline,
    ) -> Result<Vec<Value>, RedisError> {
        match &self.conn {
            Conn::Single(c) => pipe.query_async(&mut c.clone()).await,
            Conn::Cluster(c) => pipe.query_async(&mut c.clone()).await,
        }
    }

    /// Loads one of the outbox's own scripts (on every primary of a
    /// cluster), for a pipeline that calls it by hash.
    pub(crate) async fn outbox_load(&self, script: &redis::Script) -> Result<(), RedisError> {
        match &self.conn {
            Conn::Single(c) => script.load_async(&mut c.clone()).await.map(drop),
            Conn::Cluster(c) => script.load_async(&mut c.clone()).await.map(drop),
        }
    }

    /// Runs one of the outbox's own scripts (loaded on `NOSCRIPT`).
    pub(crate) async fn outbox_script(
        &self,
        script: &redis::Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<Value, RedisError> {
        let mut invocation = script.prepare_invoke();
        for k in keys {
            invocation.key(*k);
        }
        for a in args {
            invocation.arg(*a);
        }
        match &self.conn {
            Conn::Single(c) => invocation.invoke_async(&mut c.clone()).await,
            Conn::Cluster(c) => invocation.invoke_async(&mut c.clone()).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// Whatever the names and values hold (the netstring delimiters, a
    /// newline, nothing, multi-byte text, a repeated name), they read back
    /// as written, in order.
    #[test]
    fn headers_read_back_byte_identical() {
        let cases = [
            pairs(&[]),
            pairs(&[(
                "traceparent",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            )]),
            pairs(&[("a,b", "1:2,"), ("", ""), ("line", "x\ny"), ("é", "ü")]),
            pairs(&[("k", "first"), ("k", "second")]),
        ];
        for headers in cases {
            let field = encode_headers(&headers);
            assert_eq!(decode_headers(&field), Ok(headers.clone()), "{field:?}");
        }
        assert_eq!(
            encode_headers(&pairs(&[("tracestate", "vnd=abc")])),
            b"10:tracestate,7:vnd=abc,"
        );
        assert!(encode_headers(&[]).is_empty());
    }

    /// A field that is not what `encode_headers` writes is an error that
    /// says why, never a panic or a partial list.
    #[test]
    fn malformed_headers_are_an_error() {
        for bad in [
            &b"11:traceparent"[..],
            b"11:traceparent,",
            b"5:abc,",
            b"x:abc,",
            b":abc,",
            b"3:abc;3:def,",
            b"99999999999:a,",
            b"18446744073709551616:a,",
            b"2:\xff\xfe,1:a,",
            b"no colon",
        ] {
            assert!(decode_headers(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn every_slot_has_a_tag_that_hashes_to_it() {
        assert_eq!(SLOT_TAGS.len(), 16_384);
        for (slot, tag) in SLOT_TAGS.iter() {
            assert_eq!(Slot::for_key(format!("idem-outbox{{{tag}}}")), *slot);
            assert!(tag.len() <= 4, "{tag}");
        }
    }

    #[test]
    fn stream_keys_round_trip_through_the_index() {
        let k = StreamKeys::tagged("shop:outbox", "a7");
        assert_eq!(k.stream, "shop:outbox{a7}");
        assert_eq!(
            StreamKeys::from_stream("shop:outbox", &k.stream),
            Some(k.clone())
        );
        assert_eq!(StreamKeys::from_stream("shop:outbox", "other:{a7}"), None);
        assert_eq!(
            StreamKeys::from_stream("shop:outbox", "shop:outbox{}"),
            None
        );
        assert_eq!(Slot::for_key(&k.parked), Slot::for_key(&k.stream));
        assert_eq!(Slot::for_key(&k.lock), Slot::for_key(&k.stream));
    }
}
