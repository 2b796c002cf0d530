//! Turning results into stored bytes and back (serde_json, optional LZ4),
//! and the result version's frame.
//!
//! # The stored form of a result
//!
//! A result is stored as its JSON document, written by serde_json, then
//! LZ4-compressed (`ValueKind::Lz4Json`) when it is over the builder's
//! `compress_above` and compression makes it smaller. A result of version
//! `N > 0` ([`Call::result_version`](crate::Call::result_version)) has its
//! document preceded by a one-line frame, inside the compression:
//!
//! ```text
//! version 0:  {"id":"r-1"}                 (no frame: today's bytes)
//! version 2:  #v2\n{"id":"r-1"}             (`#v`, decimal version, LF, JSON)
//! ```
//!
//! No JSON text starts with `#`, so a frame is never mistaken for a
//! document and a version-0 record is byte-identical to one written before
//! versions existed. The frame lives in the value bytes, which every store
//! keeps opaque: no store, script or table changes, and a store added
//! later stores versions with no code of its own.

use crate::error::Error;
use crate::store::{Completed, ValueKind};
use crate::version::ReadRule;
use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::cell::RefCell;
use std::io::Write;

/// What a versioned document starts with; no JSON text starts with `#`.
pub(crate) const FRAME_START: &[u8] = b"#v";

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
    encode_versioned(value, 0, limit, compress_above)
}

/// `encode` of a result of `version`, for tests.
#[cfg(test)]
pub(crate) fn encode_versioned<T: Serialize>(
    value: &T,
    version: u32,
    limit: usize,
    compress_above: Option<usize>,
) -> Encoded {
    encode_with(value, version, limit, compress_above, |kind, bytes| {
        Encoded {
            kind,
            bytes: bytes.to_vec(),
        }
    })
}

/// Serializes `value`; over `limit` it becomes a `TooLarge` marker and when
/// it cannot be serialized an `Unstorable` one, so that replays report the
/// problem instead of running the body again. One allocation: the
/// serializer writes in a buffer this thread keeps, copied out once.
pub(crate) fn encode_bytes<T: Serialize>(
    value: &T,
    version: u32,
    limit: usize,
    compress_above: Option<usize>,
) -> (ValueKind, Bytes) {
    encode_with(value, version, limit, compress_above, |kind, bytes| {
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
    version: u32,
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
            let out = encode_in(&mut json, value, version, limit, compress_above, done);
            // A huge result's buffer is not kept for the thread's life.
            if json.capacity() > KEPT {
                *json = Vec::new();
            }
            out
        }
        // A value whose Serialize stores a result on this thread.
        Err(_) => encode_in(&mut Vec::new(), value, version, limit, compress_above, done),
    })
}

/// The largest buffer `encode_with` keeps between results.
const KEPT: usize = 64 << 10;

fn encode_in<T: Serialize, R>(
    json: &mut Vec<u8>,
    value: &T,
    version: u32,
    limit: usize,
    compress_above: Option<usize>,
    done: impl FnOnce(ValueKind, &[u8]) -> R,
) -> R {
    if version != 0 {
        json.extend_from_slice(FRAME_START);
        // Writing into a Vec cannot fail.
        let _ = write!(json, "{version}");
        json.push(b'\n');
    }
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

/// The version a stored JSON document was written with, and the document
/// without its frame. A document that starts with `#` but not with a
/// well-formed frame is a damaged or foreign record.
pub(crate) fn split_frame(doc: &[u8]) -> Result<(u32, &[u8]), Error> {
    let Some(rest) = doc.strip_prefix(FRAME_START) else {
        if doc.first() == Some(&b'#') {
            return Err(bad_frame(doc));
        }
        return Ok((0, doc));
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (number, after) = rest.split_at(digits.min(rest.len()));
    let version = std::str::from_utf8(number)
        .ok()
        .filter(|n| !n.is_empty())
        .and_then(|n| n.parse::<u32>().ok());
    match (version, after.strip_prefix(b"\n")) {
        (Some(version), Some(json)) => Ok((version, json)),
        _ => Err(bad_frame(doc)),
    }
}

fn bad_frame(doc: &[u8]) -> Error {
    let shown: String = String::from_utf8_lossy(doc).chars().take(24).collect();
    Error::corrupt(format!(
        "the stored value starts with {shown:?}, not a result version frame (`#v<version>` and a \
         newline) nor JSON; another program may share this key space — use a distinct namespace, \
         or delete the key"
    ))
}

/// The version of a completed result, from its stored bytes (a compressed
/// one is decompressed, bounded by LZ4's largest ratio); `None` for a
/// marker or an unreadable value. For operator tools, not for calls.
pub(crate) fn stored_version(kind: ValueKind, value: &[u8]) -> Option<u32> {
    match kind {
        ValueKind::Json => split_frame(value).ok().map(|(v, _)| v),
        ValueKind::Lz4Json => {
            // LZ4 expands at most ~255 times: a larger prefix is damage.
            let bound = value.len().saturating_mul(255).saturating_add(64);
            let json = decompress(value, bound).ok()?;
            split_frame(&json).ok().map(|(v, _)| v)
        }
        ValueKind::TooLarge | ValueKind::Unstorable => None,
    }
}

/// The stored JSON document of a completed result (decompressed), or the
/// error its marker stands for.
fn document(c: &Completed, limit: usize) -> Result<std::borrow::Cow<'_, [u8]>, Error> {
    match c.kind {
        ValueKind::Json => Ok(std::borrow::Cow::Borrowed(&c.value[..])),
        ValueKind::Lz4Json => Ok(std::borrow::Cow::Owned(decompress(&c.value, limit)?)),
        kind => Err(marker_error(kind, &c.value)
            .unwrap_or_else(|| Error::corrupt(format!("unknown value kind {kind:?}")))),
    }
}

/// Parses a stored JSON document as `T`; `versions` is `(stored, current)`
/// when they differ, for the message.
fn parse<T: DeserializeOwned>(json: &[u8], versions: Option<(u32, u32)>) -> Result<T, Error> {
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
        let reason = match versions {
            Some((stored, current)) => format!(
                "the stored result (result version {stored}) does not deserialize as `{}` \
                 (result version {current}): {e}; give the call a rule for other versions — \
                 `.on_other_version(VersionRule::upgrade(..))` to convert the stored JSON, or \
                 `VersionRule::Reject` to answer `Error::ResultVersion` with it — or give the \
                 new fields serde defaults; the record is kept and the body is not run again",
                std::any::type_name::<T>()
            ),
            None => format!(
                "the stored result does not deserialize as `{}`: {e}; the result type changed \
                 since it was stored — declare a result version when changing a result type \
                 (`.result_version(n)` with `.on_other_version(..)`, or `#[idempotent(version = \
                 n)]`), or change the scope (e.g. \"charge.v2\")",
                std::any::type_name::<T>()
            ),
        };
        Error::codec(reason).with_source(e)
    })
}

/// Reads a stored result back as `T`, as a reader of version 0 that
/// decodes every other version (what calls did before versions).
#[cfg(test)]
pub(crate) fn decode<T: DeserializeOwned>(c: &Completed, limit: usize) -> Result<T, Error> {
    decode_versioned(c, limit, 0, &ReadRule::Decode)
}

/// Reads a stored result back as `T` for a reader of version `current`:
/// a result of another version goes through `rule`. Writes nothing: a
/// record this cannot read stays as it is for a reader that can.
pub(crate) fn decode_versioned<T: DeserializeOwned>(
    c: &Completed,
    limit: usize,
    current: u32,
    rule: &ReadRule,
) -> Result<T, Error> {
    // What nearly every replay reads: an unframed (version 0) JSON record
    // read by a version-0 call, straight to serde as before versions (what
    // `split_frame` would answer for it, without its steps).
    if current == 0 && c.kind == ValueKind::Json && c.value.first() != Some(&b'#') {
        return parse(&c.value, None);
    }
    let doc = document(c, limit)?;
    let (stored, json) = split_frame(&doc)?;
    if stored == current {
        return parse(json, None);
    }
    match rule {
        ReadRule::Decode => parse(json, Some((stored, current))),
        // An upgrade converts what its author knew: older versions. A
        // newer record is read as the type is (serde defaults).
        ReadRule::Upgrade(_) if stored > current => parse(json, Some((stored, current))),
        ReadRule::Upgrade(upgrade) => {
            let value: serde_json::Value = parse(json, None)?;
            let upgraded = upgrade(value, stored)?;
            serde_json::from_value(upgraded).map_err(|e| {
                Error::codec(format!(
                    "the upgrade of a version-{stored} result to version {current} returned a \
                     value that does not deserialize as `{}`: {e}; the upgrade function must \
                     return the call's result type",
                    std::any::type_name::<T>()
                ))
                .with_source(e)
            })
        }
        ReadRule::Reject => {
            // Still refuse a record that is not JSON as corrupt.
            let _: serde::de::IgnoredAny = parse(json, None)?;
            Err(Error::ResultVersion {
                stored,
                current,
                raw_json: String::from_utf8_lossy(json).into_owned(),
            })
        }
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

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct ReceiptV1 {
        id: String,
        cents: u64,
    }

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct ReceiptV2 {
        id: String,
        amount: u64,
        #[serde(default)]
        currency: String,
    }

    fn v1() -> ReceiptV1 {
        ReceiptV1 {
            id: "r-1".into(),
            cents: 500,
        }
    }

    fn json_record(bytes: &'static [u8]) -> Completed {
        Completed {
            kind: ValueKind::Json,
            value: Bytes::from_static(bytes),
            fingerprint: None,
            ttl_left: None,
        }
    }

    fn upgrade_v1() -> ReadRule {
        ReadRule::of(crate::VersionRule::upgrade(|json, stored| {
            assert_eq!(stored, 1);
            Ok(ReceiptV2 {
                id: json["id"].as_str().unwrap_or_default().to_owned(),
                amount: json["cents"].as_u64().unwrap_or_default(),
                currency: "EUR".into(),
            })
        }))
    }

    /// Golden bytes: a version-0 result is stored exactly as before versions
    /// existed (no frame), and a version-N result as `#vN`, a newline, then
    /// the same JSON; compressed results carry the frame inside the LZ4.
    #[test]
    fn stored_bytes_of_each_version_are_fixed() {
        const V0: &[u8] = br#"{"id":"r-1","cents":500}"#;
        const V2: &[u8] = b"#v2\n{\"id\":\"r-1\",\"cents\":500}";
        let e = encode(&v1(), 1 << 20, None);
        assert_eq!((e.kind, &e.bytes[..]), (ValueKind::Json, V0));
        let e = encode_versioned(&v1(), 0, 1 << 20, None);
        assert_eq!((e.kind, &e.bytes[..]), (ValueKind::Json, V0));
        let e = encode_versioned(&v1(), 2, 1 << 20, None);
        assert_eq!((e.kind, &e.bytes[..]), (ValueKind::Json, V2));
        let e = encode_versioned(&u32::MAX, u32::MAX, 1 << 20, None);
        assert_eq!(&e.bytes[..], b"#v4294967295\n4294967295");
        assert_eq!(stored_version(ValueKind::Json, V0), Some(0));
        assert_eq!(stored_version(ValueKind::Json, V2), Some(2));

        let big = "x".repeat(2000);
        let e = encode_versioned(&big, 7, 1 << 20, Some(100));
        assert_eq!(e.kind, ValueKind::Lz4Json);
        let doc = decompress(&e.bytes, 1 << 20).unwrap();
        assert!(doc.starts_with(b"#v7\n\"xxx"));
        assert_eq!(stored_version(ValueKind::Lz4Json, &e.bytes), Some(7));
        let read: String = decode_versioned(&completed(e), 1 << 20, 7, &ReadRule::Reject).unwrap();
        assert_eq!(read, big);

        // The size limit counts the frame: it is part of the stored value.
        let e = encode_versioned(&1u8, 2, 4, None);
        assert_eq!((e.kind, &e.bytes[..]), (ValueKind::TooLarge, &b"5 4"[..]));
        assert_eq!(stored_version(ValueKind::TooLarge, b"5 4"), None);
    }

    /// A value that starts with `#` but no well-formed frame is damaged or
    /// foreign: `Corrupt`, never read as some version.
    #[test]
    fn malformed_frames_are_corrupt() {
        for bad in [
            &b"#"[..],
            b"#x\n1",
            b"#v\n1",
            b"#v2",
            b"#v2 1",
            b"#v-2\n1",
            b"#v4294967296\n1",
        ] {
            assert!(
                matches!(split_frame(bad), Err(Error::Corrupt { .. })),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
            let c = Completed {
                kind: ValueKind::Json,
                value: Bytes::copy_from_slice(bad),
                fingerprint: None,
                ttl_left: None,
            };
            assert!(matches!(decode::<u32>(&c, 100), Err(Error::Corrupt { .. })));
        }
        assert_eq!(split_frame(b"#v0\n1").unwrap(), (0, &b"1"[..]));
    }

    /// Each rule against an older, the same and a newer stored version.
    #[test]
    fn each_rule_reads_each_version() {
        let v0 = json_record(br#"{"id":"r-1","cents":500}"#);
        let v1 = json_record(b"#v1\n{\"id\":\"r-1\",\"cents\":500}");
        let v2 = json_record(b"#v2\n{\"id\":\"r-1\",\"amount\":500,\"currency\":\"USD\"}");
        let limit = 1 << 20;

        // Same version: decoded under every rule.
        for rule in [ReadRule::Decode, upgrade_v1(), ReadRule::Reject] {
            let r: ReceiptV1 = decode_versioned(&v1, limit, 1, &rule).unwrap();
            assert_eq!(r, super::tests::v1());
        }
        // Older, Decode: the shape changed, so Codec naming both versions.
        let e = decode_versioned::<ReceiptV2>(&v1, limit, 2, &ReadRule::Decode).unwrap_err();
        assert!(matches!(e, Error::Codec { .. }), "{e}");
        assert!(e.to_string().contains("result version 1"), "{e}");
        assert!(e.to_string().contains("on_other_version"), "{e}");
        // Older, Upgrade: the function's value.
        let r: ReceiptV2 = decode_versioned(&v1, limit, 2, &upgrade_v1()).unwrap();
        assert_eq!((r.amount, r.currency.as_str()), (500, "EUR"));
        // Older, Reject: the typed error with the stored JSON.
        match decode_versioned::<ReceiptV2>(&v1, limit, 2, &ReadRule::Reject) {
            Err(Error::ResultVersion {
                stored: 1,
                current: 2,
                raw_json,
            }) => assert_eq!(raw_json, r#"{"id":"r-1","cents":500}"#),
            other => panic!("{other:?}"),
        }
        // A version-0 record (stored before versions) is an older one.
        let e = decode_versioned::<ReceiptV2>(&v0, limit, 2, &ReadRule::Reject).unwrap_err();
        assert!(matches!(e, Error::ResultVersion { stored: 0, .. }), "{e}");
        // Newer, Decode and Upgrade: decoded as the reader's type (its
        // unknown fields ignored); here the shape does not fit: Codec.
        for rule in [ReadRule::Decode, upgrade_v1()] {
            let e = decode_versioned::<ReceiptV1>(&v2, limit, 1, &rule).unwrap_err();
            assert!(matches!(e, Error::Codec { .. }), "{e}");
        }
        // Newer, Reject: the typed error.
        let e = decode_versioned::<ReceiptV1>(&v2, limit, 1, &ReadRule::Reject).unwrap_err();
        assert!(
            matches!(
                e,
                Error::ResultVersion {
                    stored: 2,
                    current: 1,
                    ..
                }
            ),
            "{e}"
        );
        // A newer record whose new fields have defaults decodes.
        #[derive(serde::Deserialize)]
        struct Lenient {
            id: String,
        }
        let r: Lenient = decode_versioned(&v2, limit, 1, &upgrade_v1()).unwrap();
        assert_eq!(r.id, "r-1");
        // An upgrade's error is the call's; Reject of a record that is not
        // JSON is Corrupt, not a version problem.
        let failing = ReadRule::of(crate::VersionRule::<ReceiptV2>::upgrade(|_, _| {
            Err(Error::codec("cannot upgrade"))
        }));
        let e = decode_versioned::<ReceiptV2>(&v1, limit, 2, &failing).unwrap_err();
        assert_eq!(e.reason(), Some("cannot upgrade"));
        let garbage = json_record(b"#v1\nnot json");
        let e = decode_versioned::<ReceiptV2>(&garbage, limit, 2, &ReadRule::Reject).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    }
}
