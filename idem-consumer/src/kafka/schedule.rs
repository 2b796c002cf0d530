//! What happens to a record after each try through idem: done, wait and
//! try again, run again after the backoff, or move it to the retry or
//! dead-letter topic.
//!
//! Kept apart from the run loop so the rule of the module's table (runs in
//! process, then the retry topic or the dead-letter topic; fail-closed
//! waits when nothing ran) is one pure function, tested without a broker.

use super::KafkaConfig;
use super::hand_off::Destination;
use crate::decision::{DeadLetterReason, Decision};
use std::sync::Arc;
use std::time::Duration;

/// The text of `MaxFailures` when no handler error was captured.
const NO_ERROR_TEXT: &str = "nacked";

/// The next step for a record after one try.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// Done (executed, replayed or recovered): its offset is decided.
    Ack,
    /// The handler did not run (idem's store down, the key in flight
    /// elsewhere): the record is fine, wait this long and try again; no
    /// attempt is counted (fail-closed).
    Wait(Duration),
    /// The handler ran and failed: wait this long and run it again here,
    /// with the next delivery count.
    Retry(Duration),
    /// Move it aside; its offset is decided once the broker has the copy.
    Move(Destination),
}

/// The in-process attempts of one record.
#[derive(Debug)]
pub(super) struct Attempts<'a> {
    cfg: &'a KafkaConfig,
    /// The topic the record was read from (its dead-letter topic follows it).
    topic: Arc<str>,
    /// Handler runs that failed in this process.
    runs_here: u32,
}

impl<'a> Attempts<'a> {
    /// No attempt made yet for a record of `topic`.
    pub(super) fn new(cfg: &'a KafkaConfig, topic: Arc<str>) -> Attempts<'a> {
        Attempts {
            cfg,
            topic,
            runs_here: 0,
        }
    }

    /// The step after a try that idem decided as `decision`. `ran` says
    /// whether the handler ran in that try, `delivery_count` is the
    /// record's count for that try (over every hop), and `last_error` gives
    /// the handler's last error, read only when the record is dead-lettered
    /// for its failures.
    pub(super) fn next(
        &mut self,
        decision: Decision,
        ran: bool,
        delivery_count: u32,
        last_error: impl FnOnce() -> Option<String>,
    ) -> Step {
        match decision {
            Decision::Ack => Step::Ack,
            Decision::DeadLetter { reason } => {
                Step::Move(Destination::DeadLetter(self.dead_letter_topic(), reason))
            }
            Decision::Nack { delay } if !ran => Step::Wait(delay),
            Decision::Nack { delay } => {
                self.runs_here += 1;
                if self.runs_here < self.cfg.attempts_in_process {
                    return Step::Retry(delay);
                }
                Step::Move(match &self.cfg.retry_topic {
                    Some(rt) => Destination::Retry(rt.clone()),
                    None => Destination::DeadLetter(
                        self.dead_letter_topic(),
                        // Every attempt counted here ran the handler and
                        // failed, over every hop.
                        DeadLetterReason::MaxFailures {
                            failures: delivery_count,
                            last_error: last_error().unwrap_or_else(|| NO_ERROR_TEXT.into()),
                        },
                    ),
                })
            }
        }
    }

    fn dead_letter_topic(&self) -> String {
        self.cfg.dead_letter_for(&self.topic)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DELAY: Duration = Duration::from_millis(250);

    fn config() -> KafkaConfig {
        KafkaConfig::new("127.0.0.1:9092", "g", ["orders"])
    }

    fn nack() -> Decision {
        Decision::Nack { delay: DELAY }
    }

    fn no_error() -> Option<String> {
        None
    }

    #[test]
    fn an_ack_is_done() {
        let cfg = config();
        let mut a = Attempts::new(&cfg, "orders".into());
        assert_eq!(a.next(Decision::Ack, true, 1, no_error), Step::Ack);
        assert_eq!(a.next(Decision::Ack, false, 1, no_error), Step::Ack);
    }

    #[test]
    fn a_dead_letter_goes_to_the_topics_dead_letter_topic_with_its_reason() {
        let cfg = config();
        let mut a = Attempts::new(&cfg, "orders".into());
        let reason = DeadLetterReason::Permanent("card declined".into());
        assert_eq!(
            a.next(
                Decision::DeadLetter {
                    reason: reason.clone()
                },
                true,
                1,
                no_error
            ),
            Step::Move(Destination::DeadLetter("orders.DLT".into(), reason))
        );
    }

    #[test]
    fn a_configured_dead_letter_topic_wins_over_the_per_topic_default() {
        let cfg = config().dead_letter_topic("all.DLT");
        let mut a = Attempts::new(&cfg, "orders".into());
        let reason = DeadLetterReason::FingerprintMismatch;
        assert_eq!(
            a.next(
                Decision::DeadLetter {
                    reason: reason.clone()
                },
                false,
                1,
                no_error
            ),
            Step::Move(Destination::DeadLetter("all.DLT".into(), reason))
        );
    }

    #[test]
    fn a_nack_where_nothing_ran_waits_forever_without_counting() {
        let cfg = config().attempts_in_process(1);
        let mut a = Attempts::new(&cfg, "orders".into());
        for _ in 0..100 {
            assert_eq!(a.next(nack(), false, 1, no_error), Step::Wait(DELAY));
        }
        // The one attempt allowed is still there for a handler run.
        assert_eq!(
            a.next(nack(), true, 1, no_error),
            Step::Move(Destination::DeadLetter(
                "orders.DLT".into(),
                DeadLetterReason::MaxFailures {
                    failures: 1,
                    last_error: NO_ERROR_TEXT.into()
                }
            ))
        );
    }

    #[test]
    fn failed_runs_retry_in_process_then_go_to_the_retry_topic() {
        let cfg = config().attempts_in_process(3).retry_topic("orders.retry");
        let mut a = Attempts::new(&cfg, "orders".into());
        assert_eq!(a.next(nack(), true, 1, no_error), Step::Retry(DELAY));
        assert_eq!(a.next(nack(), true, 2, no_error), Step::Retry(DELAY));
        assert_eq!(
            a.next(nack(), true, 3, || panic!("not read for the retry topic")),
            Step::Move(Destination::Retry("orders.retry".into()))
        );
    }

    #[test]
    fn without_a_retry_topic_the_last_failure_is_dead_lettered_with_its_error() {
        let cfg = config().attempts_in_process(2);
        let mut a = Attempts::new(&cfg, "orders".into());
        assert_eq!(
            a.next(nack(), true, 4, || panic!("not read while retrying")),
            Step::Retry(DELAY)
        );
        assert_eq!(
            a.next(nack(), true, 5, || Some("timeout".into())),
            Step::Move(Destination::DeadLetter(
                "orders.DLT".into(),
                DeadLetterReason::MaxFailures {
                    failures: 5,
                    last_error: "timeout".into()
                }
            ))
        );
    }

    #[test]
    fn waits_between_failed_runs_do_not_use_up_attempts() {
        let cfg = config().attempts_in_process(2).retry_topic("orders.retry");
        let mut a = Attempts::new(&cfg, "orders".into());
        assert_eq!(a.next(nack(), true, 1, no_error), Step::Retry(DELAY));
        assert_eq!(a.next(nack(), false, 2, no_error), Step::Wait(DELAY));
        assert_eq!(a.next(nack(), false, 2, no_error), Step::Wait(DELAY));
        assert_eq!(
            a.next(nack(), true, 2, no_error),
            Step::Move(Destination::Retry("orders.retry".into()))
        );
    }

    #[test]
    fn one_attempt_in_process_moves_the_record_on_its_first_failure() {
        let cfg = config().attempts_in_process(0).retry_topic("orders.retry");
        let mut a = Attempts::new(&cfg, "orders".into());
        assert_eq!(
            a.next(nack(), true, 1, no_error),
            Step::Move(Destination::Retry("orders.retry".into()))
        );
    }
}
