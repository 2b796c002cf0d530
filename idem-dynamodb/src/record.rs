//! The item of one key: its attributes, and how a stored item is read back.
//! An item that does not decode is [`Error::Corrupt`], never a panic.

use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_core::store::{RecordInfo, StepRecord, ValueKind};
use idem_core::{Error, Fingerprint};
use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An item as the SDK gives and takes it.
pub(crate) type Item = HashMap<String, AttributeValue>;

/// The owner token (32 hex digits), while pending.
pub(crate) const TOKEN: &str = "token";
/// The lease deadline, epoch ms, while pending.
pub(crate) const LEASE: &str = "lease_deadline";
/// The attempt, while pending.
pub(crate) const ATTEMPT: &str = "attempt";
/// The record's expiry, epoch ms: what the store decides by.
pub(crate) const EXPIRES_MS: &str = "expires_ms";
/// The record's expiry, epoch seconds (rounded up): DynamoDB's TTL
/// attribute, cleanup only.
pub(crate) const EXPIRES_AT: &str = "expires_at";
/// The value's kind (one tag character), once completed.
pub(crate) const KIND: &str = "kind";
/// The stored value, once completed.
pub(crate) const VALUE: &str = "value";
/// The payload fingerprint (16 bytes), if the claim had one.
pub(crate) const FINGERPRINT: &str = "fingerprint";
/// The finished steps' values by name, while pending.
pub(crate) const STEPS: &str = "steps";
/// The finished steps' names in the order they finished, while pending.
pub(crate) const STEP_ORDER: &str = "step_order";
/// A failure counter's count (an item of its own, under `failure_key`).
pub(crate) const FAILURES: &str = "failures";

/// The client's clock, epoch ms: the `:now` of every condition.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(crate) fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

pub(crate) fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

pub(crate) fn b(v: &[u8]) -> AttributeValue {
    AttributeValue::B(Blob::new(v))
}

/// A stored value: text (`S`, readable in the console) when it is UTF-8,
/// as JSON and the markers are; bytes (`B`) otherwise (LZ4).
pub(crate) fn stored_value(v: &[u8]) -> AttributeValue {
    match std::str::from_utf8(v) {
        Ok(text) => s(text),
        Err(_) => b(v),
    }
}

/// Epoch seconds for the TTL attribute: the ms expiry, rounded up, so
/// DynamoDB never deletes a record before the store counts it expired.
pub(crate) fn ttl_seconds(expires_ms: u64) -> u64 {
    expires_ms.div_ceil(1000)
}

/// A record as the store reads it.
#[derive(Debug, Clone)]
pub(crate) enum State {
    Pending {
        token: String,
        lease_ms: u64,
        attempt: u32,
    },
    Completed {
        kind: ValueKind,
        value: Bytes,
    },
}

#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub(crate) state: State,
    pub(crate) fingerprint: Option<Fingerprint>,
    pub(crate) expires_ms: u64,
    /// Pending only: the finished steps, in order.
    pub(crate) steps: Vec<StepRecord>,
}

impl Record {
    /// Whether the record still counts at `now` (DynamoDB's TTL deletes
    /// it later, lazily).
    pub(crate) fn live(&self, now: u64) -> bool {
        self.expires_ms > now
    }

    /// Whether `token` holds this pending record.
    pub(crate) fn owned_by(&self, token: &str) -> bool {
        matches!(&self.state, State::Pending { token: t, .. } if t == token)
    }

    /// The record as an operator sees it at `now`.
    pub(crate) fn info(&self, now: u64, with_value: bool) -> RecordInfo {
        let ttl_left = Some(Duration::from_millis(self.expires_ms.saturating_sub(now)));
        match &self.state {
            State::Pending {
                lease_ms, attempt, ..
            } => RecordInfo::pending(
                *attempt,
                ttl_left,
                Duration::from_millis(lease_ms.saturating_sub(now)),
                self.fingerprint,
            )
            .with_steps(self.steps.iter().map(|s| s.name.clone()).collect()),
            State::Completed { kind, value } => {
                let mut info =
                    RecordInfo::completed(*kind, value.clone(), self.fingerprint, ttl_left, false);
                if with_value {
                    info.value = Some(value.clone());
                }
                info
            }
        }
    }
}

fn corrupt(what: &str) -> Error {
    Error::corrupt(format!(
        "a DynamoDB item {what}; it was not written by idem-dynamodb (another program's item \
         in the table?) or by a newer version"
    ))
}

fn num(item: &Item, name: &str) -> Result<u64, Error> {
    match item.get(name) {
        Some(AttributeValue::N(v)) => v
            .parse()
            .map_err(|_| corrupt(&format!("has `{name}` = {v:?}, not a whole number"))),
        Some(_) => Err(corrupt(&format!("has `{name}` of another type than N"))),
        None => Err(corrupt(&format!("has no `{name}`"))),
    }
}

fn string<'i>(item: &'i Item, name: &str) -> Result<Option<&'i str>, Error> {
    match item.get(name) {
        Some(AttributeValue::S(v)) => Ok(Some(v)),
        Some(_) => Err(corrupt(&format!("has `{name}` of another type than S"))),
        None => Ok(None),
    }
}

fn blob<'i>(item: &'i Item, name: &str) -> Result<Option<&'i [u8]>, Error> {
    match item.get(name) {
        Some(AttributeValue::B(v)) => Ok(Some(v.as_ref())),
        Some(_) => Err(corrupt(&format!("has `{name}` of another type than B"))),
        None => Ok(None),
    }
}

/// Reads a record's item. A failure counter's item is not a record.
pub(crate) fn decode(item: &Item) -> Result<Record, Error> {
    if item.contains_key(FAILURES) {
        return Err(corrupt("is a failure counter, not a record"));
    }
    let expires_ms = num(item, EXPIRES_MS)?;
    let fingerprint = match blob(item, FINGERPRINT)? {
        Some(bytes) => Some(
            Fingerprint::from_bytes(bytes)
                .ok_or_else(|| corrupt("has a fingerprint of the wrong length"))?,
        ),
        None => None,
    };
    let state = match string(item, TOKEN)? {
        Some(token) => State::Pending {
            token: token.to_owned(),
            lease_ms: num(item, LEASE)?,
            attempt: u32::try_from(num(item, ATTEMPT)?)
                .map_err(|_| corrupt("has an attempt over u32"))?,
        },
        None => {
            let tag =
                string(item, KIND)?.ok_or_else(|| corrupt("has neither `token` nor `kind`"))?;
            let kind = match tag.as_bytes() {
                [t] => ValueKind::from_tag(*t),
                _ => None,
            }
            .ok_or_else(|| corrupt(&format!("has an unknown kind {tag:?}")))?;
            let value = match item.get(VALUE) {
                Some(AttributeValue::S(text)) => Bytes::copy_from_slice(text.as_bytes()),
                Some(AttributeValue::B(bytes)) => Bytes::copy_from_slice(bytes.as_ref()),
                Some(_) => {
                    return Err(corrupt(&format!(
                        "has `{VALUE}` of another type than S or B"
                    )));
                }
                None => return Err(corrupt("is completed without `value`")),
            };
            State::Completed { kind, value }
        }
    };
    let steps = match state {
        State::Pending { .. } => decode_steps(item)?,
        State::Completed { .. } => Vec::new(),
    };
    Ok(Record {
        state,
        fingerprint,
        expires_ms,
        steps,
    })
}

fn decode_steps(item: &Item) -> Result<Vec<StepRecord>, Error> {
    let names = match item.get(STEP_ORDER) {
        Some(AttributeValue::L(names)) => names.as_slice(),
        Some(_) => {
            return Err(corrupt(&format!(
                "has `{STEP_ORDER}` of another type than L"
            )));
        }
        None => &[],
    };
    let values = match item.get(STEPS) {
        Some(AttributeValue::M(values)) => Some(values),
        Some(_) => return Err(corrupt(&format!("has `{STEPS}` of another type than M"))),
        None => None,
    };
    names
        .iter()
        .map(|name| {
            let AttributeValue::S(name) = name else {
                return Err(corrupt("has a step name that is not a string"));
            };
            match values.and_then(|v| v.get(name)) {
                Some(AttributeValue::S(value)) => Ok(StepRecord {
                    name: name.clone(),
                    value: Bytes::copy_from_slice(value.as_bytes()),
                }),
                Some(AttributeValue::B(value)) => Ok(StepRecord {
                    name: name.clone(),
                    value: Bytes::copy_from_slice(value.as_ref()),
                }),
                _ => Err(corrupt(&format!("lists step {name:?} without its value"))),
            }
        })
        .collect()
}

/// The size of `item` as DynamoDB counts it against its 400 KB limit
/// (attribute names and values), near enough to refuse before sending.
pub(crate) fn item_size(item: &Item) -> usize {
    item.iter().map(|(k, v)| k.len() + value_size(v)).sum()
}

fn value_size(v: &AttributeValue) -> usize {
    match v {
        AttributeValue::S(s) => s.len(),
        AttributeValue::N(n) => n.len().div_ceil(2) + 1,
        AttributeValue::B(b) => b.as_ref().len(),
        AttributeValue::M(m) => {
            3 + m
                .iter()
                .map(|(k, v)| 1 + k.len() + value_size(v))
                .sum::<usize>()
        }
        AttributeValue::L(l) => 3 + l.iter().map(|v| 1 + value_size(v)).sum::<usize>(),
        _ => 1,
    }
}

/// Every attribute the store writes besides the partition key.
pub(crate) const ATTRIBUTES: [&str; 11] = [
    TOKEN,
    LEASE,
    ATTEMPT,
    EXPIRES_MS,
    EXPIRES_AT,
    KIND,
    VALUE,
    FINGERPRINT,
    STEPS,
    STEP_ORDER,
    FAILURES,
];
