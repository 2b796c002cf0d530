//! The Redis record format (lua/README.md) on the client side: the one
//! Rust definition of versions, state bytes, reply codes, encoding and
//! decoding. The scripts' side is `lua/prelude.lua` (and `lua/record_ops.lua`).

use bytes::Bytes;
use idem_core::Error;
use idem_core::Fingerprint;
use idem_core::store::Token;
use idem_core::store::{Claim, Completed, StepRecord, ValueKind, millis, record_ttl, store_lease};
use redis::{RedisWrite, ToRedisArgs};
use std::io::Write;
use std::time::Duration;

/// The format version this build writes and reads.
pub(crate) const FORMAT_VERSION: u8 = b'1';

/// The longest fingerprint a record may carry (idem writes 16 bytes).
const MAX_FP_LEN: usize = 32;

/// Decimal digits of a millisecond count (at most 20).
pub(crate) const MS_DIGITS: usize = 20;

/// The state byte of a pending record (completed ones carry their
/// `ValueKind::tag`).
pub(crate) const PENDING: u8 = b'P';

/// The waiter mark (`WAITED` in `lua/prelude.lua`): among a pending
/// record's steps, a step with an empty name and an empty value. The
/// `claim` script of a caller subscribed to the key appends it; `complete`
/// publishes only for a marked record. Shaped as a step so that parsers
/// from before the mark read marked records (as a nameless step).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) const WAITED: &[u8] = b"|0:0:";

/// The scripts' reply codes (`lua/prelude.lua` names the same numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Code {
    Missing = 0,
    Done = 1,
    OtherOwner = 2,
    Completed = 3,
    InProgress = 4,
    Mismatch = 5,
    Unreadable = 6,
    WrongType = 7,
}

impl Code {
    pub(crate) const ALL: [Code; 8] = [
        Code::Missing,
        Code::Done,
        Code::OtherOwner,
        Code::Completed,
        Code::InProgress,
        Code::Mismatch,
        Code::Unreadable,
        Code::WrongType,
    ];

    pub(crate) fn of(reply: i64) -> Option<Code> {
        Code::ALL.into_iter().find(|c| *c as i64 == reply)
    }
}

/// The pending record a claim writes and the record's TTL in ms.
pub(crate) fn pending_record<'a>(claim: &Claim<'a>) -> (PendingRecord<'a>, u64) {
    let ttl = millis(record_ttl(claim.ttl, claim.lease));
    let record = PendingRecord {
        fingerprint: claim.fingerprint.map_or(&[], |f| f.as_bytes()),
        token: claim.token,
        // The lease ends when the key's remaining TTL falls to this: a
        // difference of durations, so no clock is read on either side.
        lease_end: ttl - millis(store_lease(claim.lease)),
    };
    (record, ttl)
}

/// A pending record, built here so that a claim is a single plain
/// `SET NX GET` of it, like the floor it is measured against.
pub(crate) struct PendingRecord<'a> {
    pub(crate) fingerprint: &'a [u8],
    pub(crate) token: &'a Token,
    /// The key's remaining TTL (ms) at which the lease runs out.
    pub(crate) lease_end: u64,
}

impl ToRedisArgs for PendingRecord<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut w = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail; the length
        // byte is at most 16 (`Fingerprint`) and the script checks it.
        // `itoa`, not `write!`: a record is written twice per call (the
        // claim, and the complete's `IFEQ`), and `fmt` was a third of it.
        let mut lease_end = itoa::Buffer::new();
        let _ = w.write_all(&[FORMAT_VERSION, PENDING, self.fingerprint.len() as u8]);
        let _ = w.write_all(self.fingerprint);
        let _ = w.write_all(self.token.as_bytes());
        let _ = w.write_all(lease_end.format(self.lease_end).as_bytes());
        let _ = w.write_all(b":1");
    }
}

/// A completed record (lua/README.md), written into the command as one
/// argument without first assembling it in a buffer of its own.
pub(crate) struct CompletedRecord<'a> {
    pub(crate) kind: ValueKind,
    pub(crate) fingerprint: &'a [u8],
    pub(crate) value: &'a [u8],
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

/// Splits a completed record into its parts without copying the value.
pub(crate) fn decode_completed(record: Vec<u8>, ttl_left_ms: i64) -> Result<Completed, Error> {
    let (kind, fplen) = match record.as_slice() {
        [FORMAT_VERSION, tag, fplen, ..] => match ValueKind::from_tag(*tag) {
            Some(kind) => (kind, usize::from(*fplen)),
            None => return Err(unreadable(&record)),
        },
        _ => return Err(unreadable(&record)),
    };
    if fplen > MAX_FP_LEN || record.len() < 3 + fplen {
        return Err(unreadable(&record));
    }
    let fingerprint = Fingerprint::from_bytes(&record[3..3 + fplen]);
    let value = Bytes::from(record).slice(3 + fplen..);
    Ok(Completed {
        kind,
        value,
        fingerprint,
        ttl_left: u64::try_from(ttl_left_ms).ok().map(Duration::from_millis),
    })
}

/// A pending record's parts (lua/README.md: `TOKEN LEASE_END ":" ATTEMPT STEPS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) fingerprint: Option<Fingerprint>,
    /// The holder's token, as the 32 hex digits it is stored as.
    pub(crate) token: [u8; 32],
    /// The key's remaining TTL (ms) at which the lease runs out.
    pub(crate) lease_end: u64,
    pub(crate) attempt: u32,
    /// The finished steps of a `run_steps` call, in order.
    pub(crate) steps: Vec<StepRecord>,
    /// Whether a waiter marked the record ([`WAITED`]).
    pub(crate) waited: bool,
}

/// Any record, as a plain `GET` finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Pending(Pending),
    Completed(Completed),
}

/// Reads a record of either state; `ttl_left_ms` is the key's `PTTL`.
pub(crate) fn decode(record: Vec<u8>, ttl_left_ms: i64) -> Result<Record, Error> {
    match record.as_slice() {
        [FORMAT_VERSION, PENDING, fplen, rest @ ..] => {
            let fplen = usize::from(*fplen);
            decode_pending(rest, fplen)
                .map(Record::Pending)
                .ok_or_else(|| unreadable(&record))
        }
        _ => decode_completed(record, ttl_left_ms).map(Record::Completed),
    }
}

/// `FP TOKEN LEASE_END ":" ATTEMPT STEPS`, all of it checked.
fn decode_pending(rest: &[u8], fplen: usize) -> Option<Pending> {
    if fplen > MAX_FP_LEN {
        return None;
    }
    let (fp, rest) = rest.split_at_checked(fplen)?;
    let (token, tail) = rest.split_at_checked(32)?;
    if !token.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let (lease_end, tail) = digits(tail)?;
    let (attempt, tail) = digits(tail.strip_prefix(b":")?)?;
    let (steps, waited) = decode_steps(tail)?;
    Some(Pending {
        fingerprint: Fingerprint::from_bytes(fp),
        token: token.try_into().ok()?,
        lease_end: std::str::from_utf8(lease_end).ok()?.parse().ok()?,
        // Saturating, as the scripts cap it.
        attempt: std::str::from_utf8(attempt)
            .ok()?
            .parse::<u64>()
            .ok()?
            .min(u64::from(u32::MAX)) as u32,
        steps,
        waited,
    })
}

/// The leading decimal digits of `s` (at least one) and the rest.
fn digits(s: &[u8]) -> Option<(&[u8], &[u8])> {
    let n = s.iter().take_while(|b| b.is_ascii_digit()).count();
    (n > 0).then(|| s.split_at(n))
}

/// A length written in decimal, at most 9 digits (as the scripts check).
fn length(s: &[u8]) -> Option<(usize, &[u8])> {
    let (n, rest) = digits(s)?;
    if n.len() > 9 {
        return None;
    }
    let n = std::str::from_utf8(n).ok()?.parse().ok()?;
    Some((n, rest.strip_prefix(b":")?))
}

/// `STEPS = *(STEP / WAITED)`, the whole tail: the steps, and whether the
/// waiter mark is among them (a nameless step with a value is refused).
fn decode_steps(mut tail: &[u8]) -> Option<(Vec<StepRecord>, bool)> {
    let mut steps = Vec::new();
    let mut waited = false;
    while !tail.is_empty() {
        let (len, rest) = length(tail.strip_prefix(b"|")?)?;
        let (name, rest) = rest.split_at_checked(len)?;
        let (len, rest) = length(rest)?;
        let (value, rest) = rest.split_at_checked(len)?;
        tail = rest;
        if name.is_empty() {
            if !value.is_empty() {
                return None;
            }
            waited = true;
            continue;
        }
        steps.push(StepRecord {
            name: String::from_utf8(name.to_vec()).ok()?,
            value: Bytes::copy_from_slice(value),
        });
    }
    Some((steps, waited))
}

/// One step as the `step` script appends it (for tests and tools).
#[cfg(test)]
pub(crate) fn encode_step(name: &str, value: &[u8]) -> Vec<u8> {
    [
        format!("|{}:{name}{}:", name.len(), value.len()).as_bytes(),
        value,
    ]
    .concat()
}

/// Says what is wrong with a record the scripts could not read.
pub(crate) fn unreadable(record: &[u8]) -> Error {
    match record.first() {
        Some(v) if v.is_ascii_digit() && *v > FORMAT_VERSION => Error::corrupt(format!(
            "the record was written by a newer idem (format version {}); this build reads version 1 — \
             upgrade this service, or roll the newer one back",
            *v as char
        )),
        _ => {
            let shown: String = String::from_utf8_lossy(&record[..record.len().min(24)])
                .chars()
                .map(|c| if c.is_control() { '.' } else { c })
                .collect();
            Error::corrupt(format!(
                "{} bytes that are not an idem record (starting {shown:?}); \
                 another program may share this key space — use a distinct namespace, \
                 or delete the key",
                record.len()
            ))
        }
    }
}

pub(crate) fn wrong_type() -> Error {
    Error::corrupt(
        "the key holds a Redis type other than string; another program shares this key space — \
         use a distinct namespace, or delete the key"
            .to_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_and_refuses() {
        let c = decode_completed(b"1C\x00{\"a\":1}".to_vec(), 1000).unwrap();
        assert_eq!(c.kind, ValueKind::Json);
        assert_eq!(&c.value[..], b"{\"a\":1}");
        assert_eq!(c.fingerprint, None);
        let mut rec = b"1C\x10".to_vec();
        rec.extend_from_slice(&[9u8; 16]);
        rec.extend_from_slice(b"7");
        let c = decode_completed(rec, -1).unwrap();
        assert_eq!(c.fingerprint, Fingerprint::from_bytes(&[9u8; 16]));
        assert_eq!(c.ttl_left, None);
        assert!(matches!(
            decode_completed(b"1C\x20ab".to_vec(), 1),
            Err(Error::Corrupt { .. })
        ));
        assert!(matches!(
            decode_completed(b"".to_vec(), 1),
            Err(Error::Corrupt { .. })
        ));
        assert!(matches!(
            decode_completed(b"1Q\x00".to_vec(), 1),
            Err(Error::Corrupt { .. })
        ));
        let newer = unreadable(b"2C\x00x").to_string();
        assert!(newer.contains("newer idem"), "{newer}");
    }

    #[test]
    fn decodes_pending_records_whole() {
        let token = [b'a'; 32];
        let mut rec = b"1P\x00".to_vec();
        rec.extend_from_slice(&token);
        rec.extend_from_slice(b"1500:99999999999999999");
        let Ok(Record::Pending(p)) = decode(rec.clone(), 2000) else {
            panic!("pending record not read");
        };
        assert_eq!((p.token, p.lease_end, p.attempt), (token, 1500, u32::MAX));
        assert!(p.steps.is_empty());
        let mut with_steps = b"1P\x00".to_vec();
        with_steps.extend_from_slice(&token);
        with_steps.extend_from_slice(b"1500:2");
        with_steps.extend_from_slice(&encode_step("reserve", b"{\"n\":1}"));
        with_steps.extend_from_slice(&encode_step("charge", b"\"ch|1:x\""));
        let Ok(Record::Pending(p)) = decode(with_steps, 2000) else {
            panic!("pending record with steps not read");
        };
        let steps: Vec<(&str, &[u8])> = p
            .steps
            .iter()
            .map(|s| (s.name.as_str(), &s.value[..]))
            .collect();
        assert_eq!(
            steps,
            [
                ("reserve", &b"{\"n\":1}"[..]),
                ("charge", &b"\"ch|1:x\""[..])
            ]
        );
        for bad in [&b"x:1"[..], b"15:", b":1", b"1e+14:1", b"15"] {
            let mut r = b"1P\x00".to_vec();
            r.extend_from_slice(&token);
            r.extend_from_slice(bad);
            assert!(
                matches!(decode(r, 1), Err(Error::Corrupt { .. })),
                "{bad:?}"
            );
        }
        let newer = unreadable(b"2C\x00x").to_string();
        assert!(newer.contains("newer idem"), "{newer}");
    }

    /// A golden record: what it is, its bytes, and its state byte and
    /// fingerprint length (None when unreadable).
    type Golden = (&'static str, Vec<u8>, Option<(u8, usize)>);

    /// Records every reader must agree on.
    fn golden() -> Vec<Golden> {
        let token = "0123456789abcdef0123456789abcdef";
        let fp = [7u8; 16];
        let with_fp = |head: &[u8], tail: &[u8]| [head, &fp[..], tail].concat();
        vec![
            (
                "pending",
                format!("1P\x00{token}1500:1").into_bytes(),
                Some((b'P', 0)),
            ),
            (
                "pending with fp",
                with_fp(b"1P\x10", format!("{token}9:3").as_bytes()),
                Some((b'P', 16)),
            ),
            (
                "pending with steps",
                [
                    format!("1P\x00{token}1500:2").as_bytes(),
                    &encode_step("reserve", b"7"),
                    &encode_step("charge", b"\"|3:abc1:x\""),
                    &encode_step("empty", b""),
                ]
                .concat(),
                Some((b'P', 0)),
            ),
            (
                "pending, step value longer than the record",
                format!("1P\x00{token}1500:2|1:a9:xx").into_bytes(),
                None,
            ),
            (
                "pending, step without its value",
                format!("1P\x00{token}1500:2|1:a").into_bytes(),
                None,
            ),
            (
                "pending, garbage after the attempt",
                format!("1P\x00{token}1500:2x").into_bytes(),
                None,
            ),
            (
                "pending, step with bytes after it",
                format!("1P\x00{token}1500:2|1:a1:xy").into_bytes(),
                None,
            ),
            ("json", b"1C\x00{\"a\":1}".to_vec(), Some((b'C', 0))),
            ("json with fp", with_fp(b"1C\x10", b"42"), Some((b'C', 16))),
            ("lz4", b"1Z\x00\x02\x00\x00\x00xx".to_vec(), Some((b'Z', 0))),
            ("too large", b"1L\x009 4".to_vec(), Some((b'L', 0))),
            ("unstorable", b"1U\x00oops".to_vec(), Some((b'U', 0))),
            ("empty value", b"1C\x00".to_vec(), Some((b'C', 0))),
            ("newer version", b"2C\x00{}".to_vec(), None),
            ("unknown state", b"1Q\x00{}".to_vec(), None),
            ("fp longer than the record", b"1C\x20ab".to_vec(), None),
            (
                "fp length over 32",
                [b"1C\x21".as_slice(), &[0u8; 40]].concat(),
                None,
            ),
            ("empty", Vec::new(), None),
            (
                "pending, bad lease end",
                format!("1P\x00{token}x:1").into_bytes(),
                None,
            ),
            ("pending, short token", b"1P\x00abc15:1".to_vec(), None),
            (
                "pending, marked",
                [format!("1P\x00{token}1500:1").as_bytes(), WAITED].concat(),
                Some((b'P', 0)),
            ),
            (
                "pending with steps, marked between them",
                [
                    format!("1P\x00{token}1500:2").as_bytes(),
                    &encode_step("reserve", b"7"),
                    WAITED,
                    &encode_step("charge", b"\"|0:0:\""),
                ]
                .concat(),
                Some((b'P', 0)),
            ),
            (
                "pending, a nameless step with a value",
                format!("1P\x00{token}1500:1|0:1:x").into_bytes(),
                None,
            ),
        ]
    }

    /// The golden records that carry the waiter mark.
    const MARKED: [&str; 2] = ["pending, marked", "pending with steps, marked between them"];

    #[test]
    fn golden_records_in_rust() {
        for (what, rec, expected) in golden() {
            let read = decode(rec.clone(), 1000);
            match (expected, read) {
                (Some((b'P', n)), Ok(Record::Pending(p))) => {
                    assert_eq!(p.fingerprint.map_or(0, |_| 16), n, "{what}");
                    assert_eq!(p.waited, MARKED.contains(&what), "{what}");
                    assert!(p.steps.iter().all(|s| !s.name.is_empty()), "{what}");
                }
                (Some((tag, _)), Ok(Record::Completed(c))) => {
                    assert_eq!(c.kind.tag(), tag, "{what}")
                }
                (None, Err(Error::Corrupt { .. })) => {}
                (expected, read) => panic!("{what}: expected {expected:?}, read {read:?}"),
            }
        }
    }

    /// The prelude's parsers, run by a real Redis, read every golden record
    /// as the Rust side does, and its reply codes are `Code`'s.
    #[tokio::test]
    async fn golden_records_and_codes_in_lua() {
        use crate::store::scripts::PRELUDE;
        let server = idem_testkit::RedisServer::start();
        let mut con = server.connection();
        let codes: Vec<i64> = redis::Script::new(&format!(
            "{PRELUDE}\nreturn {{MISSING, DONE, OTHER_OWNER, COMPLETED, IN_PROGRESS, MISMATCH, UNREADABLE, WRONG_TYPE}}"
        ))
        .invoke(&mut con)
        .expect("prelude runs");
        assert_eq!(codes, Code::ALL.map(|c| c as i64).to_vec());
        // Every state byte the prelude's header reads, each paired with the
        // letter it stands for: the pending state and ValueKind's tags, no
        // other byte.
        let states: String = redis::Script::new(&format!(
            "{PRELUDE}\n\
             local t = {{}}\n\
             for b = 0, 255 do\n\
               local s = header('1' .. string.char(b) .. string.char(0))\n\
               if s then t[#t + 1] = string.char(b) .. s end\n\
             end\n\
             table.sort(t)\n\
             return table.concat(t, ' ')"
        ))
        .invoke(&mut con)
        .expect("prelude runs");
        let mut tags: Vec<String> = [
            ValueKind::Json,
            ValueKind::Lz4Json,
            ValueKind::TooLarge,
            ValueKind::Unstorable,
        ]
        .map(|k| char::from(k.tag()).to_string().repeat(2))
        .to_vec();
        tags.push(char::from(PENDING).to_string().repeat(2));
        tags.sort();
        assert_eq!(
            states,
            tags.join(" "),
            "Lua's states are the pending state and ValueKind's tags"
        );
        let read = redis::Script::new(&format!(
            "{PRELUDE}\n\
             local state, n = header(ARGV[1])\n\
             if not state then return {{}} end\n\
             if state ~= PENDING then return {{state, n, 0}} end\n\
             local owner, _, _, _, waited = pending(ARGV[1], n)\n\
             if not owner then return {{}} end\n\
             return {{state, n, waited and 1 or 0}}"
        ));
        for (what, rec, expected) in golden() {
            let got: Vec<redis::Value> = read.arg(rec.as_slice()).invoke(&mut con).expect(what);
            let (got, waited) = match got.as_slice() {
                [
                    redis::Value::BulkString(s),
                    redis::Value::Int(n),
                    redis::Value::Int(w),
                ] => (Some((s[0], *n as usize)), *w == 1),
                [] => (None, false),
                other => panic!("{what}: {other:?}"),
            };
            assert_eq!(got, expected, "{what}: Lua reads it differently");
            assert_eq!(waited, MARKED.contains(&what), "{what}: the mark, in Lua");
        }
        let mark: Vec<u8> = redis::Script::new(&format!("{PRELUDE}\nreturn WAITED"))
            .invoke(&mut con)
            .expect("prelude runs");
        assert_eq!(mark, WAITED, "Lua's waiter mark is record::WAITED");
    }
}
