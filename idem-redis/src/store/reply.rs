//! What the server answered: replies parsed into the store's types, errors
//! mapped to `idem_core::Error` with what to do about them.

use super::record::{Code, Record, decode_completed, unreadable, wrong_type};
use idem_core::Error;
use idem_core::Fingerprint;
use idem_core::store::{Claim, ClaimReply, WriteReply};
use redis::{RedisError, ServerErrorKind, Value};
use std::time::Duration;

/// The claim's answer from a record it found, when no write is needed: a
/// completed record (or a mismatch), and, for a claim refused for lack of
/// memory, a live holder. `None` when only a write could answer (an
/// expired lease to take over).
pub(super) fn answer_found(
    found: Record,
    claim: &Claim<'_>,
    ttl_left_ms: i64,
) -> Option<ClaimReply> {
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

/// A top-level error reply as an `Err`, as `Cmd::query_async` would give it
/// (the scripts never put errors inside an array).
pub(super) fn server_error(reply: Result<Value, RedisError>) -> Result<Value, RedisError> {
    match reply? {
        Value::ServerError(e) => Err(e.into()),
        v => Ok(v),
    }
}

/// How `classify` starts the reason of an `OOM` refusal.
const OOM_REASON: &str = "Redis is out of memory";

pub(super) fn is_oom(e: &Error) -> bool {
    matches!(e, Error::Unavailable { reason, .. } if reason.starts_with(OOM_REASON))
}

pub(super) fn is_noscript(e: &RedisError) -> bool {
    e.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript)
}

pub(super) fn bad_url(e: RedisError) -> Error {
    // The URL itself is not repeated: it may carry a password.
    Error::InvalidConfig(format!(
        "the Redis URL cannot be used: {e}; expected redis://[user:password@]host:port/[db]"
    ))
}

/// A refused `SET`: another Redis type under the key is a corrupt record,
/// as the scripts report it; the rest as any error.
pub(super) fn classify_claim(e: RedisError) -> Error {
    if e.code() == Some("WRONGTYPE") {
        return wrong_type();
    }
    classify("claim", e)
}

pub(super) fn classify(op: &'static str, e: RedisError) -> Error {
    // Redis refuses a command called by a script with ERR, not NOPERM
    // (Valkey: "ACL failure in script: …").
    let denied = matches!(e.kind(), redis::ErrorKind::Server(ServerErrorKind::NoPerm))
        || e.to_string().contains("can't run this command")
        || e.to_string().contains("ACL failure in script");
    let reason = match e.kind() {
        _ if denied => format!(
            "Redis ACL denied the command ({e}); grant the commands listed in docs/operating.md, section Redis ACL"
        ),
        _ if e.code() == Some("OOM") => {
            format!("{OOM_REASON} and refuses new records ({e}); raise maxmemory or free keys")
        }
        _ if e.is_timeout() => format!("no reply within the response timeout ({e})"),
        _ => e.to_string(),
    };
    unavailable(op, reason).with_source(e)
}

/// Redis's unavailability: the reason ends with what to check. (Other
/// stores' crates build `Unavailable` with their own advice.)
pub(super) fn unavailable(op: &'static str, reason: impl std::fmt::Display) -> Error {
    Error::unavailable(
        op,
        format!("{reason}; check that Redis is up and reachable"),
    )
}

pub(super) fn protocol(op: &'static str, v: &Value) -> Error {
    unavailable(
        op,
        format!("unexpected reply from the idem script: {v:?}; is this Redis 7 or newer?"),
    )
}

pub(super) fn as_int(v: Option<&Value>) -> Option<i64> {
    match v {
        Some(Value::Int(i)) => Some(*i),
        _ => None,
    }
}

pub(super) fn parse_claim(v: Value) -> Result<ClaimReply, Error> {
    let mut items = match v {
        Value::Array(items) => items,
        other => return Err(protocol("claim", &other)),
    };
    let code = as_int(items.first()).and_then(Code::of);
    let reply = match (code, items.len()) {
        (Some(Code::Done), 2) => as_int(items.get(1)).map(|a| ClaimReply::Acquired {
            attempt: u32::try_from(a).unwrap_or(u32::MAX),
        }),
        (Some(Code::Completed), 2 | 3) => {
            let ttl = as_int(items.get(2)).unwrap_or(-1);
            return match items.swap_remove(1) {
                Value::BulkString(rec) => decode_completed(rec, ttl).map(ClaimReply::Completed),
                other => Err(protocol("claim", &other)),
            };
        }
        (Some(Code::InProgress), 2) => as_int(items.get(1)).map(|ms| ClaimReply::InProgress {
            retry_after: Duration::from_millis(u64::try_from(ms).unwrap_or(0)),
        }),
        (Some(Code::Mismatch), 1) => Some(ClaimReply::Mismatch),
        (Some(Code::Unreadable), 2) => {
            return match items.swap_remove(1) {
                Value::BulkString(rec) => Err(unreadable(&rec)),
                other => Err(protocol("claim", &other)),
            };
        }
        (Some(Code::WrongType), 1) => return Err(wrong_type()),
        _ => None,
    };
    reply.ok_or_else(|| protocol("claim", &Value::Array(items)))
}

pub(super) fn parse_write(op: &'static str, v: Value) -> Result<WriteReply, Error> {
    let code = match &v {
        Value::Int(i) => Code::of(*i),
        _ => None,
    };
    match code {
        Some(Code::Done) => Ok(WriteReply::Done),
        Some(Code::Missing) => Ok(WriteReply::Missing),
        Some(Code::OtherOwner) => Ok(WriteReply::OtherOwner),
        Some(Code::Completed) => Ok(WriteReply::AlreadyCompleted),
        // The write scripts do not send the record back: say what it is not.
        Some(Code::Unreadable) => Err(Error::corrupt(
            "the key holds bytes that are not an idem record this build can read (damaged, \
             another program's, or a newer idem's format); use a distinct namespace, or delete the key"
                .to_owned(),
        )),
        Some(Code::WrongType) => Err(wrong_type()),
        _ => Err(protocol(op, &v)),
    }
}

/// Whether a pipeline failed on the way rather than a command being refused.
pub(crate) fn unreached(e: &RedisError) -> bool {
    e.is_io_error() || e.is_connection_dropped() || e.is_timeout() || e.is_unrecoverable_error()
}

/// Whether a pipeline's reply is `NOSCRIPT` (the server lost the script).
pub(super) fn is_noscript_reply(v: Option<&Value>) -> bool {
    match v {
        Some(Value::ServerError(e)) => is_noscript(&redis::RedisError::from(e.clone())),
        _ => false,
    }
}
