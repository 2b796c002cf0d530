//! Decoding the rows idem's statements answer: a row that does not decode
//! is `Error::Corrupt`, never a guess.

use crate::sql::claim_col;
use crate::time::{duration_ms, interval_ms};
use bytes::Bytes;
use idem_core::store::{Claim, ClaimReply, Completed, ValueKind, WriteReply};
use idem_core::{Error, Fingerprint, RecordInfo};
use sqlx::postgres::PgRow;
use sqlx::{Postgres, Row};

/// What a write statement's reply says.
#[derive(Debug)]
pub(crate) enum WriteState {
    Reply(WriteReply),
    /// The read-back shows the caller's own pending record: the row changed
    /// between the refused write and the read. Re-run.
    Ours,
    /// The caller's own pending record, claimed by `run_in_tx`: only its
    /// transaction may complete it.
    TxBound,
}

pub(crate) fn read_write_row(row: Option<&PgRow>, token: &[u8; 16]) -> Result<WriteState, Error> {
    let Some(row) = row else {
        return Ok(WriteState::Reply(WriteReply::Missing));
    };
    let done: bool = get(row, "done")?;
    if done {
        return Ok(WriteState::Reply(WriteReply::Done));
    }
    let live: Option<bool> = get(row, "live")?;
    if live != Some(true) {
        return Ok(WriteState::Reply(WriteReply::Missing));
    }
    let state: Option<i8> = get(row, "state")?;
    let state = state.map(|s| s as u8);
    match state {
        Some(b'P') => {
            let stored: Option<Vec<u8>> = get(row, "token")?;
            match stored {
                Some(t) if t.len() == 16 && t[..] == token[..] => {
                    let in_tx: Option<bool> = get(row, "in_tx")?;
                    Ok(if in_tx == Some(true) {
                        WriteState::TxBound
                    } else {
                        WriteState::Ours
                    })
                }
                Some(t) if t.len() == 16 => Ok(WriteState::Reply(WriteReply::OtherOwner)),
                _ => Err(corrupt("a pending record without a 16-byte owner token")),
            }
        }
        Some(tag) if ValueKind::from_tag(tag).is_some() => {
            let same: Option<bool> = get(row, "same")?;
            Ok(WriteState::Reply(if same == Some(true) {
                WriteReply::Done
            } else {
                WriteReply::AlreadyCompleted
            }))
        }
        other => Err(corrupt(&format!(
            "unknown state {:?}",
            other.map(char::from)
        ))),
    }
}

/// The record of one row of `sql::info_columns`, or why it cannot be read.
pub(crate) fn row_info(row: &PgRow, with_value: bool) -> Result<RecordInfo, Error> {
    let state: i8 = get(row, "state")?;
    let fingerprint: Option<Vec<u8>> = get(row, "fingerprint")?;
    let fingerprint = match fingerprint {
        None => None,
        Some(f) => Some(
            Fingerprint::from_bytes(&f)
                .ok_or_else(|| corrupt("a fingerprint that is not 16 bytes"))?,
        ),
    };
    let ttl_ms: Option<i64> = get(row, "ttl_ms")?;
    let ttl_left = Some(duration_ms(ttl_ms));
    match state as u8 {
        b'P' => {
            let token: Option<Vec<u8>> = get(row, "token")?;
            let attempt: Option<i64> = get(row, "attempt")?;
            let lease_ms: Option<i64> = get(row, "lease_ms")?;
            let attempt = attempt
                .and_then(|a| u32::try_from(a).ok())
                .filter(|a| *a >= 1);
            match (token.map(|t| t.len()), attempt, lease_ms) {
                (Some(16), Some(attempt), Some(lease)) => {
                    let steps: Option<Vec<String>> = get(row, "step_names")?;
                    Ok(RecordInfo::pending(
                        attempt,
                        ttl_left,
                        duration_ms(Some(lease)),
                        fingerprint,
                    )
                    .with_steps(steps.unwrap_or_default()))
                }
                _ => Err(corrupt(
                    "a pending record with a bad owner token, attempt or lease",
                )),
            }
        }
        tag => {
            let kind = ValueKind::from_tag(tag)
                .ok_or_else(|| corrupt(&format!("unknown state {:?}", char::from(tag))))?;
            let size: Option<i64> = get(row, "value_size")?;
            let size = size
                .and_then(|s| usize::try_from(s).ok())
                .ok_or_else(|| corrupt("a completed record without a value"))?;
            let value: Option<Vec<u8>> = get(row, "value")?;
            let mut info = RecordInfo::completed(
                kind,
                value.map(Bytes::from).unwrap_or_default(),
                fingerprint,
                ttl_left,
                with_value,
            );
            // The size is the stored one even when the value stayed home.
            info.value_size = Some(size);
            Ok(info)
        }
    }
}

/// A column to read: by name, or by position with its name for errors (the
/// claim's columns, `sql::claim_col`: no name lookups on the hottest path).
pub(crate) trait Column {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>;
    fn name(&self) -> &str;
}

impl Column for &str {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        row.try_get(*self)
    }
    fn name(&self) -> &str {
        self
    }
}

impl Column for claim_col::Col {
    fn read<'r, T>(&self, row: &'r PgRow) -> Result<T, sqlx::Error>
    where
        T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
    {
        row.try_get(self.0)
    }
    fn name(&self) -> &str {
        self.1
    }
}

/// One column of a row idem wrote; one it cannot decode makes the row
/// `Error::Corrupt`.
pub(crate) fn get<'r, T>(row: &'r PgRow, column: impl Column) -> Result<T, Error>
where
    T: sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres>,
{
    column
        .read(row)
        .map_err(|e| corrupt(&format!("column {}: {e}", column.name())))
}

pub(crate) fn corrupt(what: &str) -> Error {
    Error::corrupt(format!(
        "{what}; the row was not written by idem-postgres (or was edited by hand) and was left \
         as it is — delete it, or use a table of its own for idem"
    ))
}

fn mismatch(given: Option<&Fingerprint>, stored: Option<&[u8]>) -> bool {
    matches!((given, stored), (Some(a), Some(b)) if a.as_bytes()[..] != *b)
}

/// What one claim statement answered.
pub(crate) enum ClaimRead {
    Reply(ClaimReply),
    /// The statement cannot answer: it was one-sided (`claim_path.rs`), or
    /// its snapshot says the claim should have won. Run the combined one.
    Race,
}

/// The bare insert's answer: the key is won, or it was present (the
/// combined statement then decides).
pub(crate) fn read_insert(row: Option<&PgRow>) -> Result<ClaimRead, Error> {
    let Some(row) = row else {
        return Ok(ClaimRead::Race);
    };
    acquired(get(row, claim_col::INSERTED)?)
}

fn acquired(attempt: i64) -> Result<ClaimRead, Error> {
    let attempt = u32::try_from(attempt).map_err(|_| corrupt("attempt out of range"))?;
    Ok(ClaimRead::Reply(ClaimReply::Acquired { attempt }))
}

pub(crate) fn read_claim(
    row: Option<&PgRow>,
    c: &Claim<'_>,
    token: &[u8; 16],
) -> Result<ClaimRead, Error> {
    let Some(row) = row else {
        // The bare read answers none for an absent key; the combined
        // statement always answers one row, so none there means a changed
        // table.
        return Ok(ClaimRead::Race);
    };
    let won: Option<i64> = get(row, claim_col::WON)?;
    if let Some(attempt) = won {
        return acquired(attempt);
    }
    let attempt: Option<i64> = get(row, claim_col::ATTEMPT)?;
    let ttl_ms = interval_ms(get(row, claim_col::TTL_LEFT)?);
    if ttl_ms.is_none_or(|t| t <= 0) {
        return Ok(ClaimRead::Race);
    }
    let state: Option<i8> = get(row, claim_col::STATE)?;
    let fingerprint: Option<Vec<u8>> = get(row, claim_col::FINGERPRINT)?;
    if fingerprint.as_ref().is_some_and(|f| f.len() != 16) {
        return Err(corrupt("a fingerprint that is not 16 bytes"));
    }
    let fp = fingerprint.as_deref();
    match state.map(|s| s as u8) {
        Some(b'P') => {
            let stored: Option<Vec<u8>> = get(row, claim_col::TOKEN)?;
            let lease_ms = interval_ms(get(row, claim_col::LEASE_LEFT)?);
            let valid = stored.as_ref().is_some_and(|t| t.len() == 16)
                && attempt.is_some_and(|a| (1..=i64::from(u32::MAX)).contains(&a))
                && lease_ms.is_some();
            if !valid {
                return Err(corrupt(
                    "a pending record with a bad owner token, attempt or lease",
                ));
            }
            if mismatch(c.fingerprint, fp) {
                return Ok(ClaimRead::Reply(ClaimReply::Mismatch));
            }
            match lease_ms {
                Some(left) if left > 0 && stored.as_deref() != Some(&token[..]) => {
                    Ok(ClaimRead::Reply(ClaimReply::InProgress {
                        retry_after: duration_ms(Some(left)),
                    }))
                }
                _ => Ok(ClaimRead::Race),
            }
        }
        Some(tag) => {
            let Some(kind) = ValueKind::from_tag(tag) else {
                return Err(corrupt(&format!("unknown state {:?}", char::from(tag))));
            };
            if mismatch(c.fingerprint, fp) {
                return Ok(ClaimRead::Reply(ClaimReply::Mismatch));
            }
            let value: Option<Vec<u8>> = get(row, claim_col::VALUE)?;
            let value = value.ok_or_else(|| corrupt("a completed record without a value"))?;
            Ok(ClaimRead::Reply(ClaimReply::Completed(Completed {
                kind,
                value: Bytes::from(value),
                fingerprint: fp.and_then(Fingerprint::from_bytes),
                ttl_left: Some(duration_ms(ttl_ms)),
            })))
        }
        None => Err(corrupt("a record without a state")),
    }
}

pub(crate) fn row_done(row: Option<&PgRow>) -> bool {
    row.is_some_and(|r| r.try_get::<bool, _>("done").unwrap_or(false))
}
