//! The keys and values the phases use, built without allocating.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::OnceLock;

/// The namespace and scope of every idem record here: stored keys are
/// `idem:bench:<36-byte key>` (47 bytes). The floor's keys have the same
/// length: `flor:bench:<36-byte key>`.
pub(crate) const SCOPE: &str = "bench";
pub(crate) const FLOOR_PREFIX: &str = "flor:bench:";
pub(crate) const PLAIN_PREFIX: &str = "plan:bench:";

/// The value every small body returns: 62 characters, so its JSON (what idem
/// stores, and what the floor stores) is 64 bytes.
pub(crate) const VALUE: &str = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
static VALUE_JSON: OnceLock<Vec<u8>> = OnceLock::new();

pub(crate) fn value_json() -> &'static [u8] {
    VALUE_JSON.get_or_init(|| serde_json::to_vec(VALUE).unwrap())
}

/// A 36-byte user key, unique per (run, phase, task, sequence number), written
/// straight into whatever buffer builds the stored key (no temporary String).
#[derive(Clone, Copy)]
pub(crate) struct FreshKey {
    pub(crate) run: u32,
    pub(crate) phase: u8,
    pub(crate) task: u16,
    pub(crate) seq: u64,
}

impl fmt::Display for FreshKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 8 hex + '-' + 2 hex + 4 digits + '-' + 20 digits = 36 bytes, by
        // hand: `{:020}` padding would cost more than some of what we measure.
        let mut b = [b'0'; 36];
        hex(&mut b[0..8], u64::from(self.run));
        b[8] = b'-';
        hex(&mut b[9..11], u64::from(self.phase));
        dec(&mut b[11..15], u64::from(self.task));
        b[15] = b'-';
        dec(&mut b[16..36], self.seq);
        f.write_str(std::str::from_utf8(&b).unwrap())
    }
}

fn hex(out: &mut [u8], mut v: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b"0123456789abcdef"[(v & 0xf) as usize];
        v >>= 4;
    }
}

fn dec(out: &mut [u8], mut v: u64) {
    for slot in out.iter_mut().rev() {
        *slot = b'0' + (v % 10) as u8;
        v /= 10;
    }
}

/// One of the pre-filled replay keys, also 36 bytes.
#[derive(Clone, Copy)]
pub(crate) struct ReplayKey {
    pub(crate) run: u32,
    pub(crate) set: u8,
    pub(crate) idx: u64,
}

impl fmt::Display for ReplayKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // 8 hex + "-r" + 1 hex + '-' + 24 digits = 36 bytes.
        let mut b = [b'0'; 36];
        hex(&mut b[0..8], u64::from(self.run));
        b[8] = b'-';
        b[9] = b'r';
        hex(&mut b[10..11], u64::from(self.set));
        b[11] = b'-';
        dec(&mut b[12..36], self.idx);
        f.write_str(std::str::from_utf8(&b).unwrap())
    }
}

/// A large, repetitive JSON value for the compression phases: 170 rows of
/// about 97 bytes (16.4 KB of JSON). Rows are `Copy`, so a body returning a
/// clone pays one memcpy, not 170 allocations.
#[derive(Clone, Copy, Serialize, Deserialize)]
pub(crate) struct Row {
    id: u64,
    price_cents: u64,
    quantity: u32,
    status: Status,
    flags: [bool; 4],
}

#[derive(Clone, Copy, Serialize, Deserialize)]
enum Status {
    Active,
    Backordered,
}

static BIG: OnceLock<Vec<Row>> = OnceLock::new();

pub(crate) fn big_value() -> &'static Vec<Row> {
    BIG.get_or_init(|| {
        (0..170u64)
            .map(|i| Row {
                id: 100_000 + i,
                price_cents: 1999 + (i % 7) * 100,
                quantity: (i % 5) as u32 + 1,
                status: if i % 11 == 0 {
                    Status::Backordered
                } else {
                    Status::Active
                },
                flags: [i % 2 == 0, false, true, i % 3 == 0],
            })
            .collect()
    })
}
