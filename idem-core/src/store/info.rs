//! What an operator sees of a record: its state, counters and clocks,
//! without the value unless asked (`inspect`, `forget`, `scan`).

use super::ValueKind;
use crate::error::Error;
use crate::fingerprint::Fingerprint;
use bytes::Bytes;
use std::fmt;
use std::time::Duration;

/// The state of a stored record.
///
/// ```
/// use idem_core::KeyState;
/// assert_eq!("pending".parse::<KeyState>(), Ok(KeyState::Pending));
/// assert_eq!(KeyState::TooLarge.as_str(), "too_large");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KeyState {
    /// Claimed, body running (or its holder died and the lease ran out).
    Pending,
    /// Completed with a stored result, which replays.
    Completed,
    /// Completed, but the result was over `max_value_size`: later calls get
    /// `Error::TooLarge`.
    TooLarge,
    /// Completed, but the result could not be serialized: later calls get
    /// `Error::Codec`.
    Unserializable,
}

impl KeyState {
    /// A short lowercase name (`pending`, `completed`, `too_large`,
    /// `unserializable`), as the CLI prints it.
    ///
    /// ```
    /// assert_eq!(idem_core::KeyState::Completed.as_str(), "completed");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            KeyState::Pending => "pending",
            KeyState::Completed => "completed",
            KeyState::TooLarge => "too_large",
            KeyState::Unserializable => "unserializable",
        }
    }

    /// The state of a completed record of this kind.
    ///
    /// ```
    /// use idem_core::KeyState;
    /// use idem_core::store::ValueKind;
    /// assert_eq!(KeyState::of_kind(ValueKind::Lz4Json), KeyState::Completed);
    /// ```
    pub fn of_kind(kind: ValueKind) -> KeyState {
        match kind {
            ValueKind::Json | ValueKind::Lz4Json => KeyState::Completed,
            ValueKind::TooLarge => KeyState::TooLarge,
            ValueKind::Unstorable => KeyState::Unserializable,
        }
    }
}

impl fmt::Display for KeyState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for KeyState {
    type Err = String;

    fn from_str(s: &str) -> Result<KeyState, String> {
        Ok(match s {
            "pending" => KeyState::Pending,
            "completed" => KeyState::Completed,
            "too_large" | "too-large" => KeyState::TooLarge,
            "unserializable" => KeyState::Unserializable,
            other => {
                return Err(format!(
                    "unknown state {other:?}; use pending, completed, too_large or unserializable"
                ));
            }
        })
    }
}

/// One record as `inspect`, `forget` and `scan` report it.
///
/// The value itself is carried only when asked for
/// ([`Idempotency::inspect_with_value`](crate::Idempotency::inspect_with_value)).
///
/// ```
/// use idem_core::{KeyState, RecordInfo};
/// use std::time::Duration;
/// let info = RecordInfo::pending(2, Some(Duration::from_secs(60)), Duration::from_secs(5), None);
/// assert_eq!(info.state, KeyState::Pending);
/// assert!(info.is_held());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// Pending, completed, too large or unserializable.
    pub state: KeyState,
    /// How a completed record's value is stored; `None` while pending.
    pub kind: Option<ValueKind>,
    /// A pending record's attempt (1 for the first holder, +1 per
    /// takeover); `None` once completed (the count is not kept).
    pub attempt: Option<u32>,
    /// How long the record has left; `None` when it never expires.
    pub ttl_left: Option<Duration>,
    /// A pending record's remaining lease (zero when it has run out: the
    /// holder stopped renewing); `None` once completed.
    pub lease_left: Option<Duration>,
    /// The payload fingerprint stored with the record, if any.
    pub fingerprint: Option<Fingerprint>,
    /// Size of the stored value in bytes, as stored (compressed when the
    /// kind is `Lz4Json`); `None` while pending.
    pub value_size: Option<usize>,
    /// The stored value, only when asked for: the JSON of a completed
    /// result (decompressed), or the marker text of a too-large or
    /// unserializable one.
    pub value: Option<Bytes>,
    /// The names of the steps a pending `run_steps` record holds, in the
    /// order they finished; empty otherwise.
    pub steps: Vec<String>,
    /// The result version a completed result was stored with
    /// ([`Call::result_version`](crate::Call::result_version); 0 for a
    /// result stored without one); `None` while pending, for a too-large or
    /// unserializable marker, for a value that cannot be read, and where
    /// the store did not send the value (a scan on PostgreSQL).
    /// [`Idempotency::inspect`](crate::Idempotency::inspect) always reads it.
    pub result_version: Option<u32>,
}

impl RecordInfo {
    /// A pending record.
    ///
    /// ```
    /// let info = idem_core::RecordInfo::pending(1, None, std::time::Duration::ZERO, None);
    /// assert!(!info.is_held()); // lease ran out
    /// ```
    pub fn pending(
        attempt: u32,
        ttl_left: Option<Duration>,
        lease_left: Duration,
        fingerprint: Option<Fingerprint>,
    ) -> RecordInfo {
        RecordInfo {
            state: KeyState::Pending,
            kind: None,
            attempt: Some(attempt),
            ttl_left,
            lease_left: Some(lease_left),
            fingerprint,
            value_size: None,
            value: None,
            steps: Vec::new(),
            result_version: None,
        }
    }

    /// A completed record holding `value` (stored bytes); the value is kept
    /// in the info only when `with_value`. Its
    /// [`result_version`](RecordInfo::result_version) is read from the
    /// value (a compressed one is decompressed for it).
    ///
    /// ```
    /// use idem_core::{KeyState, RecordInfo};
    /// use idem_core::store::ValueKind;
    /// let info = RecordInfo::completed(ValueKind::Json, bytes::Bytes::from_static(b"42"), None, None, false);
    /// assert_eq!((info.state, info.value_size, info.value), (KeyState::Completed, Some(2), None));
    /// assert_eq!(info.result_version, Some(0));
    /// let v2 = RecordInfo::completed(ValueKind::Json, bytes::Bytes::from_static(b"#v2\n42"), None, None, false);
    /// assert_eq!(v2.result_version, Some(2));
    /// ```
    pub fn completed(
        kind: ValueKind,
        value: Bytes,
        fingerprint: Option<Fingerprint>,
        ttl_left: Option<Duration>,
        with_value: bool,
    ) -> RecordInfo {
        RecordInfo {
            state: KeyState::of_kind(kind),
            kind: Some(kind),
            attempt: None,
            ttl_left,
            lease_left: None,
            fingerprint,
            value_size: Some(value.len()),
            // An empty value is one the store did not send (no result is
            // empty: `()` is stored as `null`).
            result_version: (!value.is_empty())
                .then(|| crate::codec::stored_version(kind, &value))
                .flatten(),
            value: with_value.then_some(value),
            steps: Vec::new(),
        }
    }

    /// The same record, holding these finished steps (by name).
    ///
    /// ```
    /// let info = idem_core::RecordInfo::pending(2, None, std::time::Duration::ZERO, None)
    ///     .with_steps(vec!["reserve".to_owned()]);
    /// assert_eq!(info.steps, ["reserve"]);
    /// ```
    pub fn with_steps(mut self, steps: Vec<String>) -> RecordInfo {
        self.steps = steps;
        self
    }

    /// True for a pending record whose holder's lease is live: a call now
    /// answers `InProgress`, and `forget` refuses it unless forced.
    ///
    /// ```
    /// let info = idem_core::RecordInfo::pending(1, None, std::time::Duration::from_millis(1), None);
    /// assert!(info.is_held());
    /// ```
    pub fn is_held(&self) -> bool {
        self.lease_left.is_some_and(|l| !l.is_zero())
    }

    /// How long ago the record was claimed, for records claimed with
    /// `result_ttl` (their TTL counts down from it; the claim time itself is
    /// not stored). `None` when the record never expires.
    ///
    /// ```
    /// use std::time::Duration;
    /// let info = idem_core::RecordInfo::pending(1, Some(Duration::from_secs(50)), Duration::ZERO, None);
    /// assert_eq!(info.age(Duration::from_secs(60)), Some(Duration::from_secs(10)));
    /// ```
    pub fn age(&self, result_ttl: Duration) -> Option<Duration> {
        self.ttl_left.map(|left| result_ttl.saturating_sub(left))
    }
}

/// One page of a [`OperatorStore::scan`](super::OperatorStore::scan).
///
/// ```
/// let page = idem_core::store::ScanPage { records: vec![], cursor: None };
/// assert!(page.cursor.is_none()); // the scan is done
/// ```
#[derive(Debug, Default)]
pub struct ScanPage {
    /// Stored keys found on this page, each with its record or the reason
    /// it cannot be read (another program's key, garbage bytes). A key
    /// that expired between listing and reading is left out.
    pub records: Vec<(String, Result<RecordInfo, Error>)>,
    /// Where the next page starts; `None` when the scan is complete. Opaque
    /// to callers: each store writes its own.
    pub cursor: Option<String>,
}
