//! Peeking at the records idem stores in Redis, for assertions on state.
//!
//! Tests read records only through this module, so a change of the record
//! format changes this one place. It reads the header alone (version,
//! state); what follows is idem-core's business.

use idem_core::store::ValueKind;

/// The one format version these peeks understand.
const FORMAT_VERSION: u8 = b'1';
/// The state byte of a claimed, not yet completed record.
const PENDING: u8 = b'P';

/// What a stored record says about its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// Claimed: a body holds (or held) the key's lease.
    Pending,
    /// Completed, with the kind of value stored.
    Completed(ValueKind),
    /// Not a record of this format version: another program's value, a
    /// truncated record, or one written by a newer idem.
    Unreadable,
}

impl RecordState {
    /// The state of the raw record `raw`.
    ///
    /// ```
    /// use idem_testkit::RecordState;
    ///
    /// assert_eq!(RecordState::of(b"1C\x00{}"), RecordState::Completed(idem_core::store::ValueKind::Json));
    /// assert_eq!(RecordState::of(b"hello"), RecordState::Unreadable);
    /// ```
    pub fn of(raw: &[u8]) -> RecordState {
        match raw {
            [FORMAT_VERSION, PENDING, ..] => RecordState::Pending,
            [FORMAT_VERSION, tag, ..] => {
                ValueKind::from_tag(*tag).map_or(RecordState::Unreadable, RecordState::Completed)
            }
            _ => RecordState::Unreadable,
        }
    }

    /// True for a completed record of any value kind.
    pub fn is_completed(self) -> bool {
        matches!(self, RecordState::Completed(_))
    }
}

/// The state of a record read with `GET` (`None`: no such key).
pub fn record_state(record: Option<&[u8]>) -> Option<RecordState> {
    record.map(RecordState::of)
}

/// An async connection straight to one server (no proxy in between), for
/// reading records while the store's own connection is being faulted.
/// Clones share the connection.
#[derive(Clone)]
pub struct RecordPeek {
    con: redis::aio::MultiplexedConnection,
}

impl std::fmt::Debug for RecordPeek {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordPeek").finish_non_exhaustive()
    }
}

impl RecordPeek {
    /// Connects to `server`.
    ///
    /// # Panics
    ///
    /// When the server cannot be reached.
    pub async fn connect(server: &crate::RedisServer) -> RecordPeek {
        let con = server
            .client()
            .get_multiplexed_async_connection()
            .await
            .unwrap_or_else(|e| panic!("idem-testkit: cannot connect to {}: {e}", server.url()));
        RecordPeek { con }
    }

    /// The raw record stored under `key` (the full Redis key, namespace
    /// included), or `None`.
    ///
    /// # Panics
    ///
    /// When the server does not answer, or the key holds another type.
    pub async fn raw(&mut self, key: &str) -> Option<Vec<u8>> {
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut self.con)
            .await
            .unwrap_or_else(|e| panic!("idem-testkit: GET {key}: {e}"))
    }

    /// The state of the record under `key`, or `None` when there is none.
    pub async fn state(&mut self, key: &str) -> Option<RecordState> {
        record_state(self.raw(key).await.as_deref())
    }

    /// Whether `key` exists, whatever it holds.
    ///
    /// # Panics
    ///
    /// When the server does not answer.
    pub async fn exists(&mut self, key: &str) -> bool {
        let n: u32 = redis::cmd("EXISTS")
            .arg(key)
            .query_async(&mut self.con)
            .await
            .unwrap_or_else(|e| panic!("idem-testkit: EXISTS {key}: {e}"));
        n == 1
    }
}

impl crate::RedisServer {
    /// The raw record stored under `key` on this server, or `None`.
    ///
    /// # Panics
    ///
    /// When the server does not answer, or the key holds another type.
    pub fn record(&self, key: &str) -> Option<Vec<u8>> {
        redis::cmd("GET")
            .arg(key)
            .query(&mut self.connection())
            .unwrap_or_else(|e| panic!("idem-testkit: GET {key} on {}: {e}", self.url()))
    }
}

impl crate::RedisCluster {
    /// The raw record of `key`, read on the node that owns its slot.
    ///
    /// # Panics
    ///
    /// When that node does not answer or redirects (the slot is moving).
    pub fn record(&self, key: &str) -> Option<Vec<u8>> {
        self.record_on(self.slot_owner(key), key)
            .unwrap_or_else(|e| panic!("idem-testkit: GET {key} on its slot owner: {e}"))
    }

    /// `GET key` on node `node` directly (no redirection): the raw record, or
    /// the error the node answered (such as `MOVED`).
    pub fn record_on(&self, node: usize, key: &str) -> Result<Option<Vec<u8>>, String> {
        let mut con = self.nodes()[node].connection();
        redis::cmd("GET")
            .arg(key)
            .query(&mut con)
            .map_err(|e| e.to_string())
    }
}
