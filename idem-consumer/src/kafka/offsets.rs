//! The commit rule: per partition, commit only up to the lowest offset not
//! yet decided.
//!
//! Kafka has no per-message ack: a consumer group remembers one offset per
//! partition, "everything before this is done". Handlers finish out of
//! order, so committing the offset of the last message *finished* would
//! claim that a slower, earlier message is done too, and a crash would then
//! skip it. The tracker commits the lowest offset still undecided instead (a
//! Kafka commit names the next offset to read), so a crash at any moment
//! re-delivers at most the undecided messages and those after them, and
//! idem replays the ones already done.

use std::collections::{BTreeSet, HashMap};

/// Offsets of one partition: taken, decided, committed.
///
/// ```
/// use idem_consumer::kafka::PartitionOffsets;
/// let mut p = PartitionOffsets::default();
/// for o in 3..=7 { p.take(o); }
/// p.decide(3);
/// p.decide(4);
/// p.decide(7); // 7 finished before 5 and 6
/// assert_eq!(p.to_commit(), Some(5)); // the next to read: 5 is not done
/// p.committed(5);
/// p.decide(6);
/// assert_eq!(p.to_commit(), None); // 5 still holds the commit back
/// p.decide(5);
/// assert_eq!(p.to_commit(), Some(8));
/// ```
#[derive(Debug, Clone, Default)]
pub struct PartitionOffsets {
    /// Taken from the broker and not yet decided.
    undecided: BTreeSet<i64>,
    /// One past the highest offset taken.
    next: Option<i64>,
    /// The offset last committed (Kafka's meaning: the next one to read).
    committed: Option<i64>,
}

impl PartitionOffsets {
    /// Records that the message at `offset` was taken for handling. Taking
    /// an offset again (the broker re-delivered it after a seek or a
    /// reconnect) makes it undecided again until it is decided again.
    pub fn take(&mut self, offset: i64) {
        self.undecided.insert(offset);
        let past = offset.saturating_add(1);
        self.next = Some(self.next.map_or(past, |n| n.max(past)));
    }

    /// Records that the message at `offset` is decided: acked (done or a
    /// replay), or moved to a retry or dead-letter topic. Returns false when
    /// the offset was not undecided.
    pub fn decide(&mut self, offset: i64) -> bool {
        self.undecided.remove(&offset)
    }

    /// The offset a commit may name now: the lowest undecided offset, or
    /// one past the highest taken when everything is decided; `None` before
    /// anything was taken.
    pub fn committable(&self) -> Option<i64> {
        self.undecided.first().copied().or(self.next)
    }

    /// The offset to commit when it moves past the last commit; `None` when
    /// a commit would say nothing new (a commit never goes backwards).
    pub fn to_commit(&self) -> Option<i64> {
        let c = self.committable()?;
        match self.committed {
            Some(done) if c <= done => None,
            _ => Some(c),
        }
    }

    /// Records a commit the broker accepted.
    pub fn committed(&mut self, offset: i64) {
        self.committed = Some(self.committed.map_or(offset, |c| c.max(offset)));
    }

    /// The last commit recorded.
    pub fn last_committed(&self) -> Option<i64> {
        self.committed
    }

    /// Messages taken and not decided.
    pub fn undecided(&self) -> usize {
        self.undecided.len()
    }

    /// Whether `offset` is taken and not decided.
    pub fn is_undecided(&self, offset: i64) -> bool {
        self.undecided.contains(&offset)
    }
}

/// [`PartitionOffsets`] for every partition a consumer holds.
///
/// ```
/// use idem_consumer::kafka::OffsetTracker;
/// let mut t = OffsetTracker::default();
/// t.take("orders", 0, 10);
/// t.take("orders", 1, 4);
/// t.decide("orders", 1, 4);
/// // Partition 0: 10 is where reading started and is not done yet.
/// assert_eq!(t.to_commit(), vec![("orders".into(), 0, 10), ("orders".into(), 1, 5)]);
/// ```
#[derive(Debug, Clone, Default)]
pub struct OffsetTracker {
    partitions: HashMap<(String, i32), PartitionOffsets>,
}

impl OffsetTracker {
    /// See [`PartitionOffsets::take`].
    pub fn take(&mut self, topic: &str, partition: i32, offset: i64) {
        self.partition_mut(topic, partition).take(offset);
    }

    /// See [`PartitionOffsets::decide`]; false for a partition not tracked
    /// (revoked meanwhile).
    pub fn decide(&mut self, topic: &str, partition: i32, offset: i64) -> bool {
        self.partitions
            .get_mut(&(topic.to_owned(), partition))
            .is_some_and(|p| p.decide(offset))
    }

    /// Every partition whose commit can move forward, with the offset to commit.
    pub fn to_commit(&self) -> Vec<(String, i32, i64)> {
        let mut out: Vec<(String, i32, i64)> = self
            .partitions
            .iter()
            .filter_map(|((t, p), offs)| offs.to_commit().map(|o| (t.clone(), *p, o)))
            .collect();
        out.sort();
        out
    }

    /// See [`PartitionOffsets::committed`].
    pub fn committed(&mut self, topic: &str, partition: i32, offset: i64) {
        if let Some(p) = self.partitions.get_mut(&(topic.to_owned(), partition)) {
            p.committed(offset);
        }
    }

    /// The state of one partition, if tracked.
    pub fn partition(&self, topic: &str, partition: i32) -> Option<&PartitionOffsets> {
        self.partitions.get(&(topic.to_owned(), partition))
    }

    /// Stops tracking a partition (it was revoked and given up).
    pub fn forget(&mut self, topic: &str, partition: i32) {
        self.partitions.remove(&(topic.to_owned(), partition));
    }

    /// Undecided messages over all partitions.
    pub fn undecided(&self) -> usize {
        self.partitions
            .values()
            .map(PartitionOffsets::undecided)
            .sum()
    }

    fn partition_mut(&mut self, topic: &str, partition: i32) -> &mut PartitionOffsets {
        self.partitions
            .entry((topic.to_owned(), partition))
            .or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn seven_before_five_commits_nothing_past_four() {
        let mut p = PartitionOffsets::default();
        for o in 0..=9 {
            p.take(o);
        }
        for o in 0..=4 {
            p.decide(o);
        }
        p.decide(7);
        assert_eq!(p.to_commit(), Some(5));
        p.committed(5);
        p.decide(6);
        p.decide(8);
        assert_eq!(p.to_commit(), None, "5 is still undecided");
        p.decide(5);
        assert_eq!(p.to_commit(), Some(9), "9 is still undecided");
        p.decide(9);
        assert_eq!(p.to_commit(), Some(10));
    }

    #[test]
    fn gaps_in_offsets_do_not_hold_the_commit() {
        // Compaction and transaction markers leave holes: offsets never seen
        // are not waited for.
        let mut p = PartitionOffsets::default();
        p.take(3);
        p.take(10);
        p.decide(3);
        assert_eq!(p.to_commit(), Some(10));
        p.decide(10);
        assert_eq!(p.to_commit(), Some(11));
    }

    #[test]
    fn a_refetched_offset_holds_the_commit_again_but_never_moves_it_back() {
        let mut p = PartitionOffsets::default();
        for o in 0..4 {
            p.take(o);
            p.decide(o);
        }
        p.committed(4);
        p.take(2); // re-delivered after a reconnect
        assert_eq!(p.committable(), Some(2));
        assert_eq!(p.to_commit(), None);
        p.decide(2);
        assert_eq!(p.to_commit(), None);
        assert_eq!(p.last_committed(), Some(4));
    }

    #[test]
    fn nothing_taken_nothing_to_commit_and_unknown_partitions_are_ignored() {
        let mut t = OffsetTracker::default();
        assert!(t.to_commit().is_empty());
        assert!(!t.decide("x", 0, 1));
        t.take("x", 0, 1);
        t.forget("x", 0);
        assert!(!t.decide("x", 0, 1));
        assert!(t.to_commit().is_empty());
    }

    /// Offsets with random gaps, taken in order, decided in a random order
    /// interleaved with taking; commits applied at random moments.
    fn scenario() -> impl Strategy<Value = (Vec<i64>, Vec<usize>, Vec<bool>)> {
        prop::collection::vec(1i64..4, 1..60).prop_flat_map(|gaps| {
            let offsets: Vec<i64> = gaps
                .iter()
                .scan(0i64, |o, g| {
                    *o += g;
                    Some(*o)
                })
                .collect();
            let n = offsets.len();
            let order = Just((0..n).collect::<Vec<usize>>()).prop_shuffle();
            let commits = prop::collection::vec(any::<bool>(), 2 * n);
            (Just(offsets), order, commits)
        })
    }

    proptest! {
        #[test]
        fn the_commit_never_passes_an_undecided_offset_and_reaches_the_end(
            (offsets, order, commit_now) in scenario()
        ) {
            let mut p = PartitionOffsets::default();
            let mut taken = 0usize;
            let mut decided = vec![false; offsets.len()];
            let mut last_commit: Option<i64> = None;
            let mut steps = commit_now.iter();
            for &i in &order {
                // Take everything up to the message about to be decided
                // (a consumer reads in order, decides in any order).
                while taken <= i {
                    p.take(offsets[taken]);
                    taken += 1;
                }
                prop_assert!(p.decide(offsets[i]));
                decided[i] = true;
                if steps.next().copied().unwrap_or(true)
                    && let Some(c) = p.to_commit() {
                        // The rule: every offset below the commit is decided.
                        for (j, &o) in offsets.iter().enumerate().take(taken) {
                            if o < c {
                                prop_assert!(decided[j], "commit {} passes undecided {}", c, o);
                            }
                        }
                        prop_assert!(last_commit.is_none_or(|l| c > l), "commits only move forward");
                        p.committed(c);
                        last_commit = Some(c);
                    }
            }
            let end = offsets[offsets.len() - 1] + 1;
            if let Some(c) = p.to_commit() {
                p.committed(c);
            }
            prop_assert_eq!(p.last_committed(), Some(end));
            prop_assert_eq!(p.undecided(), 0);
        }
    }
}
