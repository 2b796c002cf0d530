//! Which waiting records may start now: the gate rule of the run loop.
//!
//! A record holds gates while it runs (its idem key, and in
//! order-per-key mode its partition's record key). A record whose gate is
//! held waits, and so does every later record sharing a gate with a
//! waiting one, so records of one gate start in arrival order. Kept apart
//! from the run loop so the rule is tested without a broker.

use std::collections::{HashSet, VecDeque};

/// A record's gates, at most two, each the 64-bit hash of the gate's name
/// under the run's seed: no string per record. Two names with one hash
/// (one chance in 2^64 a pair) only make a record wait for another.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Gates {
    ids: [u64; 2],
    len: usize,
}

impl Gates {
    /// Adds a gate; a record has two at most (a third is not held).
    pub(super) fn push(&mut self, id: u64) {
        if let Some(slot) = self.ids.get_mut(self.len) {
            *slot = id;
            self.len += 1;
        }
    }

    pub(super) fn as_slice(&self) -> &[u64] {
        self.ids.get(..self.len).unwrap_or(&[])
    }
}

/// Something that waits to start and holds gates while it runs.
pub(super) trait Gated {
    /// The gates it holds while it runs.
    fn gates(&self) -> &[u64];
}

/// Records waiting to start, in arrival order, and the gates held by the
/// running ones.
#[derive(Debug)]
pub(super) struct StartQueue<T> {
    waiting: VecDeque<T>,
    busy: HashSet<u64, foldhash::fast::RandomState>,
}

impl<T> Default for StartQueue<T> {
    fn default() -> Self {
        StartQueue {
            waiting: VecDeque::new(),
            busy: HashSet::default(),
        }
    }
}

impl<T: Gated> StartQueue<T> {
    /// Records waiting.
    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }

    /// Queues a record behind the others.
    pub(super) fn push(&mut self, item: T) {
        self.waiting.push_back(item);
    }

    /// Takes, in arrival order, at most `room` records whose gates are
    /// free, and marks their gates held. `begin` is asked last, for each
    /// record about to start: a record it refuses (its partition was
    /// revoked meanwhile) is dropped from the queue and holds nothing.
    pub(super) fn start(&mut self, room: usize, mut begin: impl FnMut(&T) -> bool) -> Vec<T> {
        let mut start = Vec::new();
        // In place: a record that starts (or is refused) is removed where it
        // stands, which is at or near the front, as blocked records are
        // few. Rebuilding the queue moved every waiting record on every
        // turn of the run loop: quadratic in the backlog.
        let mut blocked: HashSet<u64, foldhash::fast::RandomState> = HashSet::default();
        let mut at = 0;
        while start.len() < room {
            let Some(item) = self.waiting.get(at) else {
                break;
            };
            let free = item
                .gates()
                .iter()
                .all(|g| !self.busy.contains(g) && !blocked.contains(g));
            if !free {
                blocked.extend(item.gates());
                at += 1;
                continue;
            }
            let Some(item) = self.waiting.remove(at) else {
                break;
            };
            if begin(&item) {
                self.busy.extend(item.gates());
                start.push(item);
            }
        }
        start
    }

    /// Takes every record still waiting, in arrival order, leaving the
    /// queue empty (gates held by running records stay held).
    pub(super) fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.waiting.drain(..)
    }

    /// Frees the gates of a record that finished.
    pub(super) fn release(&mut self, gates: &[u64]) {
        for g in gates {
            self.busy.remove(g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Item(&'static str, Vec<u64>);

    impl Gated for Item {
        fn gates(&self) -> &[u64] {
            &self.1
        }
    }

    /// A gate named as the run loop names them, hashed.
    fn gate(name: &str) -> u64 {
        use std::hash::BuildHasher;
        foldhash::fast::FixedState::default().hash_one(name)
    }

    fn item(name: &'static str, gates: &[&str]) -> Item {
        Item(name, gates.iter().map(|g| gate(g)).collect())
    }

    #[test]
    fn gates_hold_two_at_most() {
        let mut g = Gates::default();
        assert!(g.as_slice().is_empty());
        g.push(1);
        g.push(2);
        g.push(3);
        assert_eq!(g.as_slice(), [1, 2]);
    }

    fn names(items: &[Item]) -> Vec<&'static str> {
        items.iter().map(|i| i.0).collect()
    }

    fn queue(items: Vec<Item>) -> StartQueue<Item> {
        let mut q = StartQueue::default();
        for i in items {
            q.push(i);
        }
        q
    }

    fn all(_: &Item) -> bool {
        true
    }

    #[test]
    fn free_records_start_in_arrival_order() {
        let mut q = queue(vec![
            item("a", &["k:a"]),
            item("b", &["k:b"]),
            item("c", &[]),
        ]);
        assert_eq!(names(&q.start(10, all)), ["a", "b", "c"]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn no_more_than_room_start_and_the_rest_keep_their_order() {
        let mut q = queue(vec![
            item("a", &["k:a"]),
            item("b", &["k:b"]),
            item("c", &["k:c"]),
        ]);
        assert!(q.start(0, all).is_empty());
        assert_eq!(names(&q.start(2, all)), ["a", "b"]);
        assert_eq!(names(&q.start(2, all)), ["c"]);
    }

    #[test]
    fn a_record_waits_while_its_gate_is_held_and_starts_once_released() {
        let mut q = queue(vec![item("a", &["k:x"]), item("b", &["k:x"])]);
        assert_eq!(names(&q.start(10, all)), ["a"]);
        assert!(q.start(10, all).is_empty());
        assert_eq!(q.len(), 1);
        q.release(&[gate("k:x")]);
        assert_eq!(names(&q.start(10, all)), ["b"]);
    }

    #[test]
    fn a_later_record_sharing_a_gate_with_a_waiting_one_waits_behind_it() {
        // a runs holding x; b (x, r) waits; c shares r with b so it must
        // not overtake b; d shares nothing and starts.
        let mut q = queue(vec![item("a", &["k:x"])]);
        assert_eq!(names(&q.start(10, all)), ["a"]);
        q.push(item("b", &["k:x", "r:1"]));
        q.push(item("c", &["k:y", "r:1"]));
        q.push(item("d", &["k:z"]));
        assert_eq!(names(&q.start(10, all)), ["d"]);
        q.release(&[gate("k:x")]);
        assert_eq!(names(&q.start(10, all)), ["b"]);
        q.release(&[gate("k:x"), gate("r:1")]);
        assert_eq!(names(&q.start(10, all)), ["c"]);
    }

    #[test]
    fn a_record_refused_by_begin_is_dropped_and_holds_no_gate() {
        let mut q = queue(vec![item("gone", &["k:x"]), item("b", &["k:x"])]);
        let started = q.start(10, |i| i.0 != "gone");
        assert_eq!(names(&started), ["b"]);
        assert_eq!(q.len(), 0);
    }

    #[test]
    fn drain_hands_back_every_waiting_record_in_arrival_order() {
        let mut q = queue(vec![
            item("a", &["k:x"]),
            item("b", &["k:x"]),
            item("c", &["k:c"]),
        ]);
        assert_eq!(names(&q.start(1, all)), ["a"]);
        let left: Vec<Item> = q.drain().collect();
        assert_eq!(names(&left), ["b", "c"]);
        assert_eq!(q.len(), 0);
        // a still holds its gate until released.
        q.push(item("d", &["k:x"]));
        assert!(q.start(10, all).is_empty());
    }

    #[test]
    fn begin_is_not_asked_for_records_that_cannot_start() {
        let mut q = queue(vec![
            item("a", &["k:x"]),
            item("b", &["k:x"]),
            item("c", &["k:c"]),
        ]);
        let mut asked = Vec::new();
        let started = q.start(1, |i| {
            asked.push(i.0);
            true
        });
        assert_eq!(names(&started), ["a"]);
        assert_eq!(asked, ["a"]);
        assert_eq!(q.len(), 2);
    }
}
