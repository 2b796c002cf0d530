//! The steps of one idempotent run that do not depend on the protocol:
//! buffering the request, running the handler with its panics caught,
//! where the run goes on when its request is dropped, and turning the run's
//! result into the answer.
//! What differs (how a response is kept, replayed or refused) comes in
//! through [`Answers`] and the layers' own `execute`.

use super::record::Record;
use bytes::Bytes;
use futures_util::FutureExt;
use http::Response;
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Limited};
use idem_core::{Error, Outcome};
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use tokio::sync::oneshot;
use tower_service::Service;

/// A boxed error of a request body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body of `Bytes` a layer can buffer or hand on, as both layers take
/// them (request bodies, and the responses of the wrapped service).
pub trait BytesBody: HttpBody<Data = Bytes, Error: Into<BoxError>> + Send + 'static {}

impl<B> BytesBody for B
where
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
}

/// The wrapped service, as a run needs it: movable into a task of its own
/// with its future and error.
pub trait Inner<Req, ResBody>:
    Service<Req, Response = Response<ResBody>, Future: Send + 'static, Error: Send + 'static>
    + Send
    + 'static
{
}

impl<S, Req, ResBody> Inner<Req, ResBody> for S
where
    S: Service<Req, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
}

/// The service driven to readiness, for the request at hand; a clone (not
/// ready yet) stays in its place for the next one.
pub fn take_ready<S: Clone>(inner: &mut S) -> S {
    let clone = inner.clone();
    std::mem::replace(inner, clone)
}

/// Why a request body was not buffered.
#[derive(Debug)]
pub enum ReadError {
    /// The body is over the limit.
    TooLarge,
    /// The body failed while it was read.
    Failed(BoxError),
}

/// The whole body, refused as soon as it is known to pass `limit`.
pub async fn read_limited<B: BytesBody>(body: B, limit: usize) -> Result<Bytes, ReadError> {
    if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ReadError::TooLarge),
        Err(e) => Err(ReadError::Failed(e)),
    }
}

/// Where the run sends the request's answer; the service future waits on
/// the other end.
pub type Reply<R, E> = oneshot::Sender<Result<R, E>>;

/// Sends the answer, if not sent yet; `false` when the client is gone.
pub fn send<R, E>(reply: &mut Option<Reply<R, E>>, answer: Result<R, E>) -> bool {
    match reply.take() {
        Some(reply) => reply.send(answer).is_ok(),
        None => false,
    }
}

/// Why a run stored nothing (the key is released).
pub enum RunError<R, E> {
    /// The runtime refused or failed (in flight, mismatch, store down, …).
    Idem(Error),
    /// An answer to send as it is: a status that is not stored, a panic or
    /// a failed body turned into the layer's error answer.
    Respond(R),
    /// The client already has what it gets (a response cut short mid-stream).
    Released,
    /// The inner service's own error, passed on.
    Inner(E),
}

impl<R, E> From<Error> for RunError<R, E> {
    fn from(e: Error) -> Self {
        RunError::Idem(e)
    }
}

/// Calls the wrapped service once. A panic is caught here and answered
/// with `panicked` (the layer's error answer), so that the key is released
/// (by the `Err`) and the client gets an answer instead of a reset stream.
pub async fn call_handler<S, Req, R>(
    mut inner: S,
    request: Req,
    panicked: impl FnOnce() -> R,
) -> Result<S::Response, RunError<R, S::Error>>
where
    S: Service<Req>,
{
    match AssertUnwindSafe(async move { inner.call(request).await })
        .catch_unwind()
        .await
    {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(e)) => {
            tracing::debug!("the inner service failed; key released");
            Err(RunError::Inner(e))
        }
        Err(panic) => {
            tracing::error!(
                panic = panic_message(panic.as_ref()),
                "the handler panicked: answering an error and releasing its idempotency key"
            );
            Err(RunError::Respond(panicked()))
        }
    }
}

/// The message of a caught panic, for the log.
pub fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "(non-string panic payload)"
    }
}

/// What one run stores, and the answer of the request that ran the handler
/// (never stored). The answer is in a mutex only to be `Sync` (response
/// bodies are not): the runtime holds a reference to the value while it
/// stores it.
pub struct Ran<L> {
    /// What the run stores.
    pub record: Record,
    live: Mutex<Option<L>>,
}

impl<L> Ran<L> {
    /// A run's record, with the answer of the request that ran it (`None`
    /// when there is none to hand, as for a run read back from the store).
    pub fn new(record: Record, live: Option<L>) -> Ran<L> {
        Ran {
            record,
            live: Mutex::new(live),
        }
    }

    /// The answer of the request that ran the handler, if any.
    pub fn take_live(self) -> Option<L> {
        // A poisoned lock still holds the answer: nothing panics while it
        // is held.
        self.live
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl<L> serde::Serialize for Ran<L> {
    fn serialize<Ser: serde::Serializer>(&self, s: Ser) -> Result<Ser::Ok, Ser::Error> {
        self.record.serialize(s)
    }
}

impl<'de, L> serde::Deserialize<'de> for Ran<L> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Ran::new(Record::deserialize(d)?, None))
    }
}

/// What a layer answers, from a run's result.
pub trait Answers {
    /// The layer's response type.
    type Response;
    /// What the run stores besides the record (the first request's answer).
    type Live;

    /// A duplicate's answer: the stored response, or why it cannot be had.
    fn replay(&self, record: Record) -> Self::Response;
    /// The answer of the request that ran the handler; `None` when it was
    /// sent already (a streamed response).
    fn first(&self, ran: Ran<Self::Live>) -> Option<Self::Response>;
    /// The answer to a refusal or failure of the runtime.
    fn refusal(&self, error: Error) -> Self::Response;
}

/// What `Call::run_outcome` gives a run.
pub type RunResult<A, E> =
    Result<(Ran<<A as Answers>::Live>, Outcome), RunError<<A as Answers>::Response, E>>;

/// The answer to send, from the run's result; `None` when the client has it
/// already.
pub fn answer<A: Answers, E>(
    answers: &A,
    result: RunResult<A, E>,
) -> Option<Result<A::Response, E>> {
    match result {
        Ok((ran, Outcome::Replayed)) => {
            tracing::debug!(
                status = ran.record.status,
                code = ran.record.code,
                "replaying the stored response"
            );
            Some(Ok(answers.replay(ran.record)))
        }
        Ok((ran, outcome)) => {
            tracing::debug!(%outcome, status = ran.record.status, code = ran.record.code, kept = ran.record.not_kept.is_none(), "handler ran; outcome stored");
            answers.first(ran).map(Ok)
        }
        Err(RunError::Respond(response)) => Some(Ok(response)),
        Err(RunError::Inner(e)) => Some(Err(e)),
        Err(RunError::Idem(e)) => Some(Ok(answers.refusal(e))),
        Err(RunError::Released) => None,
    }
}

/// Why a run gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// Not called within a Tokio runtime.
    #[error("no Tokio runtime to run the handler in")]
    NoRuntime,
    /// The run ended (it panicked) before it sent an answer.
    #[error("the idempotent run ended without an answer")]
    NoAnswer,
}

/// Runs `job` and waits for the answer it sends, the job polled by this
/// future itself (no task to spawn and no wake-up passed on from one: most
/// runs are over by the time they answer).
///
/// The server drops this future when its client goes away, and a started
/// handler must not stop half-way through its effects: the job still
/// running then (or still running once it has answered, a streamed
/// response storing its body) goes on in a Tokio task of its own. With
/// `cancel_on_drop` it is dropped instead when this future is dropped
/// before the answer came; as for any call dropped mid-body, its key stays
/// in flight until its lease ends (the handler may have made effects). A
/// panic out of the job (the handler's own are caught inside it) ends it
/// without an answer, as it would end its task.
pub async fn run_until_answered<R, E, Fut>(
    job: impl FnOnce(Reply<R, E>) -> Fut,
    cancel_on_drop: bool,
) -> Result<Result<R, E>, TaskError>
where
    Fut: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| TaskError::NoRuntime)?;
    let (reply, mut answer) = oneshot::channel();
    let mut run = Running {
        job: Some(Box::pin(job(reply))),
        runtime,
        cancel_on_drop,
    };
    let answer = std::future::poll_fn(|cx| {
        if let Some(job) = run.job.as_mut() {
            let polled = std::panic::catch_unwind(AssertUnwindSafe(|| job.as_mut().poll(cx)));
            match polled {
                Ok(std::task::Poll::Pending) => {}
                Ok(std::task::Poll::Ready(())) => run.job = None,
                Err(_) => {
                    tracing::error!("an idempotent run panicked before it answered");
                    run.job = None;
                }
            }
        }
        std::pin::Pin::new(&mut answer).poll(cx)
    })
    .await;
    // Answered: from here on the response body drives cancellation, and
    // what is left of the job goes on in a task of its own.
    run.cancel_on_drop = false;
    drop(run);
    answer.map_err(|_| TaskError::NoAnswer)
}

/// A job polled in place; dropped unfinished, it goes on in a task (or,
/// cancelled on drop, stops).
struct Running<Fut: Future<Output = ()> + Send + 'static> {
    job: Option<std::pin::Pin<Box<Fut>>>,
    runtime: tokio::runtime::Handle,
    cancel_on_drop: bool,
}

impl<Fut: Future<Output = ()> + Send + 'static> Drop for Running<Fut> {
    fn drop(&mut self) {
        let Some(job) = self.job.take() else {
            return;
        };
        if self.cancel_on_drop {
            tracing::debug!("client gone before the answer: cancelling the handler");
            return;
        }
        self.runtime.spawn(job);
    }
}
