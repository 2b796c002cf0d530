//! A record's Kafka headers, read without rdkafka's panic on a header
//! name that is not UTF-8.
//!
//! Kafka header names are bytes on the wire, and producers in other
//! languages write whatever bytes they are given. rdkafka 0.39 hands
//! names out as `&str`: its `Headers::try_get` (under `iter` and `get`)
//! unwraps the UTF-8 check, so such a record would panic the thread that
//! reads it. Without `unsafe` there is no other way to read a name, so
//! [`RecordHeaders::of`] reads each header once under
//! [`catch_unwind`](std::panic::catch_unwind) and remembers which ones
//! panicked; every later read skips them. A header whose name is not
//! UTF-8 can never be one idem looks for (the key header, the trace
//! headers, `idem-attempts` all have UTF-8 names), so skipping it changes
//! no lookup; the record's key and payload are not headers at all.
//!
//! The catch cannot help where a panic does not unwind (`panic = "abort"`),
//! and the process's panic hook still runs: by default it prints rdkafka's
//! panic message (`called Result::unwrap() on an Err value: Utf8Error`)
//! to stderr, once per such header, before the adapter's warning.

use rdkafka::message::{BorrowedHeaders, Header, Headers as _, OwnedHeaders};
use std::panic::{AssertUnwindSafe, catch_unwind};

/// The headers of one record: a copy of them all, byte for byte, and the
/// positions of those whose name rdkafka cannot read.
#[derive(Debug, Clone)]
pub(super) struct RecordHeaders {
    raw: OwnedHeaders,
    /// Positions (in order) of the headers whose name is not UTF-8:
    /// empty, and not allocated, for a well-formed record.
    unreadable: Vec<usize>,
}

impl RecordHeaders {
    /// Copies the headers of a record just polled (librdkafka's copy reads
    /// no name) and finds the unreadable ones, each read once.
    pub(super) fn of(headers: &BorrowedHeaders) -> RecordHeaders {
        let raw = headers.detach();
        let unreadable = (0..raw.count())
            .filter(|&idx| read(&raw, idx).is_err())
            .collect();
        RecordHeaders { raw, unreadable }
    }

    /// How many headers have a name that is not UTF-8 (skipped by
    /// [`iter`](Self::iter) and [`get`](Self::get)).
    pub(super) fn unreadable(&self) -> usize {
        self.unreadable.len()
    }

    /// Every header, as received (those with unreadable names included):
    /// for a copy that loses nothing.
    pub(super) fn raw(&self) -> &OwnedHeaders {
        &self.raw
    }

    /// The readable headers, in order.
    pub(super) fn iter(&self) -> impl Iterator<Item = Header<'_, &[u8]>> {
        (0..self.raw.count())
            .filter(|idx| !self.unreadable.contains(idx))
            .filter_map(|idx| read(&self.raw, idx).ok().flatten())
    }

    /// The value of header `name`, if present (the last one wins, as
    /// Kafka clients read repeated headers; no value reads as empty).
    pub(super) fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .filter(|h| h.key == name)
            .last()
            .map(|h| h.value.unwrap_or_default())
    }
}

/// Header `idx` of `headers` (`None` past the end); `Err` when rdkafka
/// panicked reading it (its name is not UTF-8).
fn read(headers: &OwnedHeaders, idx: usize) -> Result<Option<Header<'_, &[u8]>>, ()> {
    catch_unwind(AssertUnwindSafe(|| headers.try_get(idx))).map_err(drop)
}
