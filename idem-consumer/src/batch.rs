//! A fetched batch: bounded concurrency, one decision per message, and
//! copies of one message inside the batch run once.

use crate::consumer::{Consumer, Handled, Judged, report, run_handler, usable_key};
use crate::decision::{Classify, Decision};
use crate::error::ConsumerError;
use crate::message::Message;
use futures_util::future::{Either, join_all};
use idem_core::{Batch, Call, Fingerprint, FinishRoundTrip};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::future::Future;
use std::time::Duration;
use tracing::Instrument;

/// Makes the round trip that stores a set of results, from the indices of
/// the messages whose results they are ([`Batch::finish_with`]).
pub(crate) type MakeRoundTrip<'a> = dyn Fn(&[usize]) -> Option<FinishRoundTrip> + Send + Sync + 'a;

/// A message of the batch that goes to idem.
struct Run {
    index: usize,
    over_delivery_limit: bool,
    span: tracing::Span,
}

impl<C> Consumer<C> {
    /// Handles a batch with at most [`concurrency`](Consumer::concurrency)
    /// handlers at once and returns one [`Handled`] per message, in order.
    /// One message failing does not affect the others (partial batch
    /// failure).
    ///
    /// The batch costs idem's store two round trips, not two per message:
    /// every claim goes in one ([`idem_core::Batch`]), the handlers that
    /// won their key run, and their results and releases go in one more.
    /// Each message keeps exactly the decision it would get alone.
    ///
    /// A message whose key and payload equal those of an earlier one in the
    /// batch is not run: it gets the first copy's decision, with
    /// `duplicate_of` set. Never a plain ack: the copy may be the same
    /// broker message as the first (a JetStream redelivery in the same
    /// fetch), and acking it would remove a message whose first copy was
    /// nacked or dead-lettered. A copy of a nacked message comes back and
    /// replays then.
    ///
    /// ```
    /// use idem_consumer::{Consumer, Message};
    /// use std::sync::atomic::{AtomicU32, Ordering};
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
    /// let consumer = Consumer::new(idem, "orders");
    /// let runs = AtomicU32::new(0);
    /// let handler = |_: Message| async { runs.fetch_add(1, Ordering::SeqCst); Ok::<_, String>(()) };
    /// let batch = [Message::new("1").with_id("a"), Message::new("2").with_id("b"), Message::new("1").with_id("a")];
    /// let out = consumer.handle_batch(&batch, &handler).await;
    /// assert!(out.iter().all(|h| h.decision.is_ack()));
    /// assert_eq!(out[2].duplicate_of, Some(0));
    /// assert_eq!(runs.load(Ordering::SeqCst), 2);
    /// # });
    /// ```
    pub async fn handle_batch<T, E, H, Fut>(&self, msgs: &[Message], handler: &H) -> Vec<Handled<T>>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        self.handle_batch_with(msgs, handler, None).await
    }

    /// [`handle_batch`](Consumer::handle_batch), with `round_trips` making
    /// the round trip that stores each set of results: it gets the indices
    /// (in `msgs`) of the messages whose results the round trip stores,
    /// every one of them decided [`Decision::Ack`] (a handler that
    /// returned `Ok` is acked whatever became of its stored result).
    pub(crate) async fn handle_batch_with<T, E, H, Fut>(
        &self,
        msgs: &[Message],
        handler: &H,
        round_trips: Option<&MakeRoundTrip<'_>>,
    ) -> Vec<Handled<T>>
    where
        H: Fn(Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        let (keys, fps): (Vec<_>, Vec<_>) = msgs
            .iter()
            .map(|msg| self.key_and_fingerprint_of(msg))
            .unzip();
        let mut done: Vec<Option<Handled<T>>> = (0..msgs.len()).map(|_| None).collect();
        self.handle_keyed_batch(
            msgs,
            keys,
            fps,
            &|_, msg| handler(msg),
            round_trips,
            |i, handled| {
                if let Some(slot) = done.get_mut(i) {
                    *slot = Some(handled);
                }
            },
        )
        .await;
        done.into_iter()
            // Unreachable: every message is answered once. A nack loses
            // nothing.
            .map(|h| {
                h.unwrap_or_else(|| {
                    Handled::decided(
                        Decision::Nack {
                            delay: Duration::ZERO,
                        },
                        None,
                    )
                })
            })
            .collect()
    }

    /// The batch with each message's key and fingerprint already made, and
    /// a handler told the index (in `msgs`) of the message it runs for;
    /// each message's [`Handled`] goes to `each(i, handled)` as soon as it
    /// is decided, once per message, so a slower handler never holds back
    /// another message's decision. A retryable failure, whose count the
    /// store keeps, is decided once the batch's handlers are done (the
    /// counts go together), and a copy of an earlier message with its
    /// first copy.
    pub(crate) async fn handle_keyed_batch<T, E, H, Fut>(
        &self,
        msgs: &[Message],
        keys: Vec<Result<String, ConsumerError>>,
        fps: Vec<Fingerprint>,
        handler: &H,
        round_trips: Option<&MakeRoundTrip<'_>>,
        each: impl FnMut(usize, Handled<T>),
    ) where
        H: Fn(usize, Message) -> Fut,
        Fut: Future<Output = Result<T, E>>,
        T: Serialize + DeserializeOwned,
        E: fmt::Display,
        C: Classify<E>,
    {
        // Borrowing the keys, hashed with a seeded fast hash: no copy of a
        // key and no SipHash per message.
        let mut first_of: HashMap<(&str, &[u8; 16]), usize, foldhash::fast::RandomState> =
            HashMap::with_capacity_and_hasher(msgs.len(), Default::default());
        let duplicate_of: Vec<Option<usize>> = keys
            .iter()
            .zip(&fps)
            .enumerate()
            .map(|(i, (key, fp))| {
                let k = key.as_deref().ok()?;
                match first_of.entry((k, fp.as_bytes())) {
                    Entry::Occupied(first) => Some(*first.get()),
                    Entry::Vacant(slot) => {
                        slot.insert(i);
                        None
                    }
                }
            })
            .collect();
        drop(first_of);
        let mut out = Answers {
            each,
            copies: Vec::new(),
            msgs,
        };
        // The messages that run, each with its span; those without a key
        // are decided at once.
        let mut runs: Vec<Run> = Vec::with_capacity(msgs.len());
        let mut run_keys: Vec<String> = Vec::with_capacity(msgs.len());
        // Sized once: pushing into a growing `Batch` moved every call
        // each time it grew.
        let mut calls: Vec<Call<'_>> = Vec::with_capacity(msgs.len());
        for (i, key) in keys.into_iter().enumerate() {
            if let Some(first) = duplicate_of[i] {
                out.copies.push(Duplicate {
                    index: i,
                    first,
                    key: key.ok(),
                });
                continue;
            }
            let msg = &msgs[i];
            let span = self.message_span(msg);
            match usable_key(key) {
                Err(refused) => {
                    report(&span, &refused);
                    out.give(i, refused);
                }
                Ok(key) => {
                    calls.push(self.call_for(msg, &key, fps.get(i).copied()).in_span(&span));
                    run_keys.push(key);
                    runs.push(Run {
                        index: i,
                        over_delivery_limit: self.over_delivery_limit(msg),
                        span,
                    });
                }
            }
        }
        // One claims round trip, the handlers that won, the round trips of
        // completes and releases as they finish.
        let mut batch = Batch::from(calls).concurrency(self.batch_concurrency());
        if let Some(make) = round_trips {
            let runs = &runs;
            batch = batch.finish_with(move |done| {
                let done: Vec<usize> = done
                    .iter()
                    .filter_map(|&j| Some(runs.get(j)?.index))
                    .collect();
                make(&done)
            });
        }
        // Decided as they come, but for retryable failures, counted in the
        // store together.
        let mut counting = Vec::new();
        batch
            .run_each(
                |j| {
                    let run = &runs[j];
                    let index = run.index;
                    let handling = run_handler(
                        move |msg| handler(index, msg),
                        &msgs[index],
                        run.over_delivery_limit,
                    );
                    // Instrumented only for a subscriber that takes the span:
                    // entering a disabled one changes nothing it sees.
                    if run.span.is_disabled() {
                        Either::Left(handling)
                    } else {
                        Either::Right(handling.instrument(run.span.clone()))
                    }
                },
                |j, result| {
                    let (Some(run), Some(key)) = (runs.get(j), run_keys.get_mut(j)) else {
                        return;
                    };
                    let key = std::mem::take(key);
                    let judged = {
                        let _enter = (!run.span.is_disabled()).then(|| run.span.enter());
                        self.judge_now(&msgs[run.index], key, result)
                    };
                    match judged {
                        Judged::Now(handled) => {
                            report(&run.span, &handled);
                            out.give(run.index, handled);
                        }
                        Judged::Count(retry) => counting.push((run.index, run.span.clone(), retry)),
                    }
                },
            )
            .await;
        if !counting.is_empty() {
            let counted = counting.into_iter().map(|(index, span, retry)| async move {
                let handled = self.judge_retry(retry).instrument(span.clone()).await;
                report(&span, &handled);
                (index, handled)
            });
            for (index, handled) in join_all(counted).await {
                out.give(index, handled);
            }
        }
    }
}

/// A message whose key and payload equal those of an earlier one in the
/// batch: not run, decided with its first copy.
struct Duplicate {
    index: usize,
    first: usize,
    key: Option<String>,
}

/// Where a batch's decisions go, its copies with their first copies.
struct Answers<'m, F> {
    each: F,
    copies: Vec<Duplicate>,
    msgs: &'m [Message],
}

impl<F> Answers<'_, F> {
    fn give<T>(&mut self, index: usize, handled: Handled<T>)
    where
        F: FnMut(usize, Handled<T>),
    {
        for copy in self.copies.iter_mut().filter(|c| c.first == index) {
            let decision = handled.decision.clone();
            tracing::debug!(
                id = self.msgs.get(copy.index).and_then(Message::id),
                first_id = self.msgs.get(index).and_then(Message::id),
                decision = decision.as_str(),
                "copy of an earlier message in the same batch: not run, settled as the first copy"
            );
            (self.each)(
                copy.index,
                Handled {
                    decision,
                    outcome: None,
                    value: None,
                    key: copy.key.take(),
                    duplicate_of: Some(index),
                },
            );
        }
        (self.each)(index, handled);
    }
}
