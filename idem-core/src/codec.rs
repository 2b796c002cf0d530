//! Turning results into stored bytes and back (serde_json, optional LZ4).

use crate::error::Error;
use crate::store::{Completed, ValueKind};
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::cell::RefCell;

/// A result ready to store.
#[cfg(test)]
pub(crate) struct Encoded {
    pub kind: ValueKind,
    pub bytes: Vec<u8>,
}

/// `encode_bytes` into a `Vec`, for tests.
#[cfg(test)]
pub(crate) fn encode<T: Serialize>(
    value: &T,
    limit: usize,
    compress_above: Option<usize>,
) -> Encoded {
    encode_with(value, limit, compress_above, |kind, bytes| Encoded {
        kind,
        bytes: bytes.to_vec(),
    })
}

/// Serializes `value`; over `limit` it becomes a `TooLarge` marker and when
/// it cannot be serialized an `Unstorable` one, so that replays report the
/// problem instead of running the body again. One allocation: the
/// serializer writes in a buffer this thread keeps, copied out once.
pub(crate) fn encode_bytes<T: Serialize>(
    value: &T,
    limit: usize,
    compress_above: Option<usize>,
) -> (ValueKind, Bytes) {
    encode_with(value, limit, compress_above, |kind, bytes| {
        (kind, shared_bytes(bytes))
    })
}

/// `bytes` as a [`Bytes`] of its own, but for the stored form of `()` and
/// `None`, `null` (what most consumers' handlers return): one static copy
/// shared by every result, where each would take an allocation, and the
/// store another.
pub(crate) fn shared_bytes(bytes: &[u8]) -> Bytes {
    const NULL: &[u8] = b"null";
    if bytes == NULL {
        Bytes::from_static(NULL)
    } else {
        Bytes::copy_from_slice(bytes)
    }
}

/// Hands `done` the stored form of `value` (see `encode_bytes`).
fn encode_with<T: Serialize, R>(
    value: &T,
    limit: usize,
    compress_above: Option<usize>,
    done: impl FnOnce(ValueKind, &[u8]) -> R,
) -> R {
    thread_local! {
        static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    BUFFER.with(|buf| match buf.try_borrow_mut() {
        Ok(mut json) => {
            json.clear();
            let out = encode_in(&mut json, value, limit, compress_above, done);
            // A huge result's buffer is not kept for the thread's life.
            if json.capacity() > KEPT {
                *json = Vec::new();
            }
            out
        }
        // A value whose Serialize stores a result on this thread.
        Err(_) => encode_in(&mut Vec::new(), value, limit, compress_above, done),
    })
}

/// The largest buffer `encode_with` keeps between results.
const KEPT: usize = 64 << 10;

fn encode_in<T: Serialize, R>(
    json: &mut Vec<u8>,
    value: &T,
    limit: usize,
    compress_above: Option<usize>,
    done: impl FnOnce(ValueKind, &[u8]) -> R,
) -> R {
    if let Err(e) = serde_json::to_writer(&mut *json, value) {
        return done(ValueKind::Unstorable, e.to_string().as_bytes());
    }
    if json.len() > limit {
        return done(
            ValueKind::TooLarge,
            format!("{} {limit}", json.len()).as_bytes(),
        );
    }
    match compress_above {
        Some(threshold) if json.len() > threshold => {
            let packed = lz4_flex::compress_prepend_size(json);
            if packed.len() < json.len() {
                return done(ValueKind::Lz4Json, &packed);
            }
        }
        _ => {}
    }
    done(ValueKind::Json, json)
}

/// The error a caller gets for a marker that `encode` stored.
pub(crate) fn marker_error(kind: ValueKind, bytes: &[u8]) -> Option<Error> {
    if !matches!(kind, ValueKind::TooLarge | ValueKind::Unstorable) {
        return None;
    }
    let text = String::from_utf8_lossy(bytes);
    match kind {
        ValueKind::TooLarge => {
            let mut parts = text.split(' ').map(|p| p.parse::<usize>().unwrap_or(0));
            Some(Error::TooLarge {
                size: parts.next().unwrap_or(0),
                limit: parts.next().unwrap_or(0),
            })
        }
        ValueKind::Unstorable => Some(Error::codec(format!(
            "the first run's result could not be serialized ({text}), so no result was stored; \
             the body is not run again for this key — fix the type's Serialize impl"
        ))),
        _ => None,
    }
}

/// The JSON inside an `Lz4Json` value, refusing a length prefix over
/// `limit` before lz4 allocates it: a damaged record must not make us
/// allocate gigabytes.
pub(crate) fn decompress(value: &[u8], limit: usize) -> Result<Vec<u8>, Error> {
    let size = value
        .get(..4)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes);
    match size {
        Some(n) if (n as usize) <= limit => {}
        _ => {
            return Err(Error::corrupt(
                "compressed record with a missing or oversized length prefix".to_owned(),
            ));
        }
    }
    lz4_flex::decompress_size_prepended(value).map_err(|e| {
        Error::corrupt(format!("compressed record does not decompress: {e}")).with_source(e)
    })
}

/// Reads a stored result back as `T`.
pub(crate) fn decode<T: DeserializeOwned>(c: &Completed, limit: usize) -> Result<T, Error> {
    let parse = |json: &[u8]| -> Result<T, Error> {
        serde_json::from_slice(json).map_err(|e| {
            // Only valid JSON of another shape is a changed type; bytes that
            // are not JSON at all are a damaged or foreign record.
            if serde_json::from_slice::<serde::de::IgnoredAny>(json).is_err() {
                return Error::corrupt(format!(
                    "the stored value is not JSON ({e}); another program may share this key \
                     space — use a distinct namespace, or delete the key"
                ))
                .with_source(e);
            }
            Error::codec(format!(
                "the stored result does not deserialize as `{}`: {e}; the result type changed since it \
                 was stored — change the scope (e.g. \"charge.v2\") when changing a result type",
                std::any::type_name::<T>()
            ))
            .with_source(e)
        })
    };
    match c.kind {
        ValueKind::Json => parse(&c.value),
        ValueKind::Lz4Json => parse(&decompress(&c.value, limit)?),
        kind => Err(marker_error(kind, &c.value)
            .unwrap_or_else(|| Error::corrupt(format!("unknown value kind {kind:?}")))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn completed(e: Encoded) -> Completed {
        Completed {
            kind: e.kind,
            value: Bytes::from(e.bytes),
            fingerprint: None,
            ttl_left: None,
        }
    }

    #[test]
    fn round_trips_and_markers() {
        let big = "x".repeat(2000);
        let e = encode(&big, 1 << 20, Some(100));
        assert_eq!(e.kind, ValueKind::Lz4Json);
        assert!(e.bytes.len() < 200);
        assert_eq!(decode::<String>(&completed(e), 1 << 20).unwrap(), big);

        let e = encode(&big, 100, None);
        assert_eq!(e.kind, ValueKind::TooLarge);
        assert!(matches!(
            decode::<String>(&completed(e), 100),
            Err(Error::TooLarge {
                size: 2002,
                limit: 100
            })
        ));

        let bad: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
        let e = encode(&bad, 100, None);
        assert_eq!(e.kind, ValueKind::Unstorable);
        assert!(matches!(
            decode::<u8>(&completed(e), 100),
            Err(Error::Codec { .. })
        ));

        let e = encode(&7u32, 100, None);
        assert!(matches!(
            decode::<String>(&completed(e), 100),
            Err(Error::Codec { .. })
        ));

        let mut lying = completed(encode(&big, 1 << 20, Some(1)));
        lying.value = Bytes::from_static(&[0xff, 0xff, 0xff, 0x7f, 1, 2]);
        assert!(matches!(
            decode::<String>(&lying, 1 << 20),
            Err(Error::Corrupt { .. })
        ));
    }
}
