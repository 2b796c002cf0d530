//! Fingerprints: a short hash of a call's payload, stored with its record, so
//! that a key reused for a different payload is refused instead of replayed.

use crate::error::Error;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::fmt;

/// 128 bits of SHA-256 over a payload.
///
/// Stored with the record (16 bytes): a later call with the same key and a
/// different fingerprint gets [`Error::FingerprintMismatch`]. A call without a
/// fingerprint matches any.
///
/// ```
/// use idem_core::Fingerprint;
/// let a = Fingerprint::of(&("charge", 500, "EUR")).unwrap();
/// let b = Fingerprint::of(&("charge", 500, "USD")).unwrap();
/// assert_ne!(a, b);
/// assert_eq!(a, Fingerprint::of(&("charge", 500, "EUR")).unwrap());
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 16]);

impl Fingerprint {
    /// Hashes a `Serialize` value through its canonical JSON form (object keys
    /// sorted), so a `HashMap`'s iteration order does not change it.
    ///
    /// Fails with [`Error::Codec`] when the value cannot be serialized (for
    /// example a map with non-string keys).
    ///
    /// ```
    /// use std::collections::HashMap;
    /// let m: HashMap<&str, u32> = [("a", 1), ("b", 2), ("c", 3)].into();
    /// let n: HashMap<&str, u32> = [("c", 3), ("b", 2), ("a", 1)].into();
    /// assert_eq!(idem_core::Fingerprint::of(&m).unwrap(), idem_core::Fingerprint::of(&n).unwrap());
    /// ```
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<Fingerprint, Error> {
        let canonical = serde_json::to_value(value).map_err(|e| {
            Error::codec(format!("fingerprint value cannot be serialized: {e}")).with_source(e)
        })?;
        let bytes = serde_json::to_vec(&canonical).map_err(|e| {
            Error::codec(format!("fingerprint value cannot be serialized: {e}")).with_source(e)
        })?;
        Ok(Fingerprint::of_bytes(&bytes))
    }

    /// Hashes raw bytes.
    ///
    /// ```
    /// let f = idem_core::Fingerprint::of_bytes(b"POST /payments {\"amount\":5}");
    /// assert_eq!(f.as_bytes().len(), 16);
    /// ```
    pub fn of_bytes(bytes: &[u8]) -> Fingerprint {
        Fingerprint::of_parts(&[bytes])
    }

    /// Hashes several byte strings, each length-prefixed so that moving bytes
    /// from one part to the next changes the result (`("ab","c") != ("a","bc")`).
    ///
    /// ```
    /// use idem_core::Fingerprint;
    /// assert_ne!(Fingerprint::of_parts(&[b"ab", b"c"]), Fingerprint::of_parts(&[b"a", b"bc"]));
    /// ```
    pub fn of_parts(parts: &[&[u8]]) -> Fingerprint {
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        Fingerprint::from_sha256(h.finalize().into())
    }

    /// Keeps the first 128 bits of a SHA-256 digest computed elsewhere
    /// (for example incrementally over a streamed body).
    ///
    /// ```
    /// let f = idem_core::Fingerprint::from_sha256([7u8; 32]);
    /// assert_eq!(f.as_bytes(), &[7u8; 16]);
    /// ```
    pub fn from_sha256(digest: [u8; 32]) -> Fingerprint {
        let mut out = [0u8; 16];
        out.copy_from_slice(&digest[..16]);
        Fingerprint(out)
    }

    /// Rebuilds a fingerprint from its 16 stored bytes; `None` for any other length.
    ///
    /// ```
    /// let f = idem_core::Fingerprint::of_bytes(b"x");
    /// assert_eq!(idem_core::Fingerprint::from_bytes(f.as_bytes()), Some(f));
    /// ```
    pub fn from_bytes(bytes: &[u8]) -> Option<Fingerprint> {
        <[u8; 16]>::try_from(bytes).ok().map(Fingerprint)
    }

    /// The 16 bytes stored in the record.
    ///
    /// ```
    /// assert_eq!(idem_core::Fingerprint::of_bytes(b"").as_bytes().len(), 16);
    /// ```
    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}
