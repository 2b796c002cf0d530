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
}
