//! A record's tries through idem: the first in a turn's batch, with the
//! records started beside it; the later ones (after a failure, or while
//! another consumer holds the key) alone; and the move aside to the retry
//! or dead-letter topic. The run loop (`kafka.rs`) starts records and
//! accounts for them as they land.

use super::gates::Gates;
use super::hand_off::{self, Destination};
use super::poller::Taken;
use super::schedule::{Attempts, Step};
use super::{Done, End, Held, KafkaConsumer, KafkaReport};
use crate::consumer::{Consumer, Handled};
use crate::decision::Classify;
use crate::error::ConsumerError;
use crate::message::Message;
use idem_core::Outcome;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::fmt;
use std::future::Future;
use std::sync::Mutex as StdMutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;

/// A record the loop starts this turn, gated and counted in flight.
pub(super) struct Started<'a> {
    pub(super) held: Held<'a>,
    pub(super) key: Result<String, ConsumerError>,
    pub(super) fingerprint: idem_core::Fingerprint,
    pub(super) gates: Gates,
}

/// A record after its first try, in a turn's batch.
pub(super) enum After<'a> {
    Done(Done<'a>),
    Again(Again<'a>),
}

/// A record that goes on alone after its batch: another try after a
/// pause, or a move aside.
pub(super) struct Again<'a> {
    held: Held<'a>,
    key: Result<String, ConsumerError>,
    fingerprint: idem_core::Fingerprint,
    gates: Gates,
    attempts: Attempts<'a>,
    report: KafkaReport,
    then: Then,
}

/// What a record not yet decided does next.
enum Then {
    Pause { delay: Duration, run_again: bool },
    Move(Destination),
}

impl Then {
    /// What follows `step`, counted in `report`; `None` when the record is
    /// done (acked).
    fn of(step: Step, outcome: Option<Outcome>, report: &mut KafkaReport) -> Option<Then> {
        match step {
            Step::Ack => {
                match outcome {
                    Some(Outcome::Replayed) => report.replayed += 1,
                    Some(Outcome::Recovered) => report.recovered += 1,
                    _ => {}
                }
                None
            }
            Step::Move(dest) => Some(Then::Move(dest)),
            Step::Wait(delay) => {
                report.nacked += 1;
                Some(Then::Pause {
                    delay,
                    run_again: false,
                })
            }
            Step::Retry(delay) => Some(Then::Pause {
                delay,
                run_again: true,
            }),
        }
    }
}

/// What a record's handler did in its tries: whether it ran in the last
/// one, and its last error (the reason header when the record is moved
/// aside). A try where the handler did not run (the key held elsewhere,
/// the store down) keeps the error of the one before.
#[derive(Default)]
struct Watch {
    ran: AtomicBool,
    last_error: StdMutex<Option<String>>,
}

impl Watch {
    /// `handler(m)`, noted in `watch` (a batch hands out no index past
    /// its records, so `None` never comes in practice).
    fn watch<'w, H, Fut, T, E>(
        watch: Option<&'w Watch>,
        handler: &H,
        m: Message,
    ) -> impl Future<Output = Result<T, E>> + use<'w, H, Fut, T, E>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: fmt::Display,
    {
        if let Some(w) = watch {
            w.ran.store(true, Ordering::Relaxed);
        }
        let fut = handler(m);
        async move {
            let out = fut.await;
            if let (Err(e), Some(w)) = (&out, watch) {
                *w.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
            }
            out
        }
    }

    fn ran(&self) -> bool {
        self.ran.load(Ordering::Relaxed)
    }

    fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl KafkaConsumer {
    /// Pauses `d`, or less when `t`'s partition is revoked meanwhile;
    /// returns whether the partition is still ours.
    async fn pause(&self, t: &Taken, d: Duration) -> bool {
        let end = Instant::now() + d;
        loop {
            let revoked = self.shared.revoked.notified();
            if !self.shared.is_live(t) {
                return false;
            }
            tokio::select! {
                _ = tokio::time::sleep_until(end) => return self.shared.is_live(t),
                _ = revoked => {}
            }
        }
    }

    /// The records started in one turn of the loop, their first tries as
    /// one idem batch: one claims round trip, the handlers that won their
    /// keys run concurrently, their results stored as they finish. The
    /// gates let no two records of one key start together, so none waits
    /// for another. Each record goes to `landed` as soon as its try is
    /// decided: done, or to go on alone in [`resume`](Self::resume) (another
    /// try after a pause, or a move aside), so a slower handler never holds
    /// back another record's decision.
    pub(super) async fn turn<'a, C, T, E, H, Fut>(
        &'a self,
        consumer: &Consumer<C>,
        handler: &H,
        started: Vec<Started<'a>>,
        landed: &mpsc::UnboundedSender<After<'a>>,
    ) where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let n = started.len();
        let watches: Vec<Watch> = (0..n).map(|_| Watch::default()).collect();
        let watched = |i: usize, m: Message| Watch::watch(watches.get(i), handler, m);
        let mut keys = Vec::with_capacity(n);
        let mut fps = Vec::with_capacity(n);
        // The batch reads copies (a message is a few shared pointers), so
        // each record can leave the turn as soon as it is decided.
        let mut msgs = Vec::with_capacity(n);
        let mut records = Vec::with_capacity(n);
        for Started {
            held,
            key,
            fingerprint,
            gates,
        } in started
        {
            keys.push(key);
            fps.push(fingerprint);
            msgs.push(held.taken.msg.clone());
            records.push(Some((held, fingerprint, gates)));
        }
        let decided = |i: usize, handled: Handled<T>| {
            let Some((held, fingerprint, gates)) = records.get_mut(i).and_then(Option::take) else {
                return;
            };
            let mut report = KafkaReport::default();
            let mut attempts = Attempts::new(&self.cfg, held.taken.topic.clone());
            let watch = watches.get(i);
            let step = attempts.next(
                handled.decision,
                watch.is_some_and(Watch::ran),
                held.taken.msg.delivery_count(),
                || watch.and_then(Watch::last_error),
            );
            let after = match Then::of(step, handled.outcome, &mut report) {
                None => After::Done(Done {
                    held,
                    gates,
                    end: End::Acked,
                    report,
                }),
                Some(then) => {
                    // The batch hands each key back; a record without one
                    // is only ever moved aside, so making it again is for
                    // the odd case.
                    let key = match handled.key {
                        Some(key) => Ok(key),
                        None => consumer.key_and_fingerprint_of(&held.taken.msg).0,
                    };
                    After::Again(Again {
                        held,
                        key,
                        fingerprint,
                        gates,
                        attempts,
                        report,
                        then,
                    })
                }
            };
            // The loop is gone only when the run is dropped: the record's
            // `Held` then keeps it for the next run.
            let _ = landed.send(after);
        };
        consumer
            .handle_keyed_batch(&msgs, keys, fps, &watched, None, decided)
            .await;
    }

    /// A record's tries after its first, alone: the pause, the next try
    /// through idem, until it is decided, moved aside or its partition is
    /// no longer ours.
    pub(super) async fn resume<'a, C, T, E, H, Fut>(
        &'a self,
        consumer: &Consumer<C>,
        handler: &H,
        again: Again<'a>,
        landed: &mpsc::UnboundedSender<After<'a>>,
    ) where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        // The record is handed back once done, however its tries end.
        let done: Done<'a> = async {
            let Again {
                mut held,
                key,
                fingerprint,
                gates,
                mut attempts,
                mut report,
                mut then,
            } = again;
            let watch = Watch::default();
            let watched = |m: Message| Watch::watch(Some(&watch), handler, m);
            let dest = loop {
                let (delay, run_again) = match then {
                    Then::Move(dest) => break dest,
                    Then::Pause { delay, run_again } => (delay, run_again),
                };
                if !self.pause(&held.taken, delay).await {
                    return Done {
                        held,
                        gates,
                        end: End::Abandoned,
                        report,
                    };
                }
                if run_again {
                    report.retried += 1;
                    let next = held.taken.msg.delivery_count().saturating_add(1);
                    held.taken.msg = held.taken.msg.clone().with_delivery_count(next);
                }
                watch.ran.store(false, Ordering::Relaxed);
                let handled = consumer
                    .handle_keyed(&held.taken.msg, key.clone(), Some(fingerprint), &watched)
                    .await;
                let step = attempts.next(
                    handled.decision,
                    watch.ran(),
                    held.taken.msg.delivery_count(),
                    || watch.last_error(),
                );
                then = match Then::of(step, handled.outcome, &mut report) {
                    Some(then) => then,
                    None => {
                        return Done {
                            held,
                            gates,
                            end: End::Acked,
                            report,
                        };
                    }
                };
            };
            self.move_aside(consumer, held, gates, dest, report).await
        }
        .await;
        let _ = landed.send(After::Done(done));
    }

    /// Publishes `taken` to `dest`, retrying with the consumer's backoff for
    /// as long as the partition is ours: the offset is decided only once
    /// the broker has the copy, so a failed publish never loses the record.
    async fn move_aside<'a, C>(
        &'a self,
        consumer: &Consumer<C>,
        held: Held<'a>,
        gates: Gates,
        dest: Destination,
        report: KafkaReport,
    ) -> Done<'a> {
        let runs = held.taken.msg.delivery_count();
        let mut failures = 0u32;
        loop {
            let published = hand_off::publish(
                &self.producer,
                &held.taken,
                &dest,
                runs,
                self.cfg.publish_timeout,
            )
            .await;
            let end = match published {
                Ok(()) => End::Moved(dest),
                Err(e) => {
                    failures = failures.saturating_add(1);
                    let pause = consumer.backoff_for(failures);
                    tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "could not move the record aside; retrying");
                    if self.pause(&held.taken, pause).await {
                        continue;
                    }
                    End::Abandoned
                }
            };
            return Done {
                held,
                gates,
                end,
                report,
            };
        }
    }
}
