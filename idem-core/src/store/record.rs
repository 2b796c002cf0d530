//! Reading the Redis record format (lua/README.md) on the client side.

use super::{Completed, ValueKind};
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use bytes::Bytes;
use std::time::Duration;

/// The format version this build writes and reads.
pub(crate) const FORMAT_VERSION: u8 = b'1';

/// Splits a completed record into its parts without copying the value.
pub(crate) fn decode_completed(record: Vec<u8>, ttl_left_ms: i64) -> Result<Completed, Error> {
    let (kind, fplen) = match record.as_slice() {
        [FORMAT_VERSION, tag, fplen, ..] => match ValueKind::from_tag(*tag) {
            Some(kind) => (kind, usize::from(*fplen)),
            None => return Err(unreadable(&record)),
        },
        _ => return Err(unreadable(&record)),
    };
    if record.len() < 3 + fplen {
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

/// A pending record's parts (lua/README.md: `TOKEN LEASE_END ":" ATTEMPT`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pending {
    pub(crate) fingerprint: Option<Fingerprint>,
    /// The holder's token, as the 32 hex digits it is stored as.
    pub(crate) token: [u8; 32],
    /// The key's remaining TTL (ms) at which the lease runs out.
    pub(crate) lease_end: u64,
    pub(crate) attempt: u32,
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
        [FORMAT_VERSION, b'P', fplen, rest @ ..] => {
            let fplen = usize::from(*fplen);
            decode_pending(rest, fplen)
                .map(Record::Pending)
                .ok_or_else(|| unreadable(&record))
        }
        _ => decode_completed(record, ttl_left_ms).map(Record::Completed),
    }
}

/// `FP TOKEN LEASE_END ":" ATTEMPT`, all of it checked.
fn decode_pending(rest: &[u8], fplen: usize) -> Option<Pending> {
    if fplen > 32 {
        return None;
    }
    let (fp, rest) = rest.split_at_checked(fplen)?;
    let (token, tail) = rest.split_at_checked(32)?;
    if !token.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let tail = std::str::from_utf8(tail).ok()?;
    let (lease_end, attempt) = tail.split_once(':')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(lease_end) || !digits(attempt) {
        return None;
    }
    Some(Pending {
        fingerprint: Fingerprint::from_bytes(fp),
        token: token.try_into().ok()?,
        lease_end: lease_end.parse().ok()?,
        // Saturating, as the scripts cap it.
        attempt: attempt.parse::<u64>().ok()?.min(u64::from(u32::MAX)) as u32,
    })
}

/// Says what is wrong with a record the scripts could not read.
pub(crate) fn unreadable(record: &[u8]) -> Error {
    match record.first() {
        Some(v) if v.is_ascii_digit() && *v > FORMAT_VERSION => Error::Corrupt(format!(
            "the record was written by a newer idem (format version {}); this build reads version 1 — \
             upgrade this service, or roll the newer one back",
            *v as char
        )),
        _ => {
            let shown: String = String::from_utf8_lossy(&record[..record.len().min(24)])
                .chars()
                .map(|c| if c.is_control() { '.' } else { c })
                .collect();
            Error::Corrupt(format!(
                "{} bytes that are not an idem record (starting {shown:?}); \
                 another program may share this key space — use a distinct namespace, \
                 or delete the key",
                record.len()
            ))
        }
    }
}

pub(crate) fn wrong_type() -> Error {
    Error::Corrupt(
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
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(
            decode_completed(b"".to_vec(), 1),
            Err(Error::Corrupt(_))
        ));
        assert!(matches!(
            decode_completed(b"1Q\x00".to_vec(), 1),
            Err(Error::Corrupt(_))
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
        for bad in [&b"x:1"[..], b"15:", b":1", b"1e+14:1", b"15"] {
            let mut r = b"1P\x00".to_vec();
            r.extend_from_slice(&token);
            r.extend_from_slice(bad);
            assert!(matches!(decode(r, 1), Err(Error::Corrupt(_))), "{bad:?}");
        }
        let newer = unreadable(b"2C\x00x").to_string();
        assert!(newer.contains("newer idem"), "{newer}");
    }
}
