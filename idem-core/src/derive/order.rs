//! An object's entries put in key order, once they are written as they
//! came: the one definition both ways of writing the canonical form use.

use std::ops::Range;

/// An object's entry: its unescaped key (a range of the bytes keys are
/// kept in) and where it was written (`"key":value`).
pub(super) type Entry = (Range<usize>, Range<usize>);

/// Rewrites the entries of an object whose keys did not come strictly
/// increasing, `out[body..]` being those entries as they came: sorted by
/// key (bytes of `keys`), and of a key given twice the last value only.
pub(super) fn write_in_order(out: &mut Vec<u8>, body: usize, keys: &[u8], entries: &mut [Entry]) {
    // Stable: of a key given twice, the last entry stays last.
    entries.sort_by(|a, b| keys[a.0.clone()].cmp(&keys[b.0.clone()]));
    // Written again in order after the entries as they came, which are
    // then taken out: one buffer, no copy of it.
    let written = out.len();
    let mut first = true;
    for (i, (key, entry)) in entries.iter().enumerate() {
        if entries
            .get(i + 1)
            .is_some_and(|(next, _)| keys[next.clone()] == keys[key.clone()])
        {
            continue;
        }
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_within(entry.clone());
    }
    out.drain(body..written);
}
