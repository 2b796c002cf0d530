//! `IdempotencyService`: what happens to one request.

use crate::body::{CatchPanic, ChannelBody, Forward, FrameResult, Next, next_frame, panicked};
use crate::config::Config;
use crate::encoding::{self, Replay};
use crate::key::{IdempotencyKey, key_from_headers};
use crate::problem::{ProblemKind, problem_response};
use crate::scope;
use crate::stored::{FORMAT_VERSION, Live, NotKept, StoredHead, StoredResponse};
use crate::{IDEMPOTENCY_RETENTION, IDEMPOTENT_REPLAYED};
use axum::body::Body;
use axum::extract::OriginalUri;
use bytes::{Bytes, BytesMut};
use futures_util::future::{BoxFuture, FutureExt};
use http::header::{self, HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body::Body as HttpBody;
use http_body_util::{BodyExt, Limited};
use idem_core::{Error, Fingerprint, Idempotency, KeyError, KeyPart, Outcome};
use std::any::Any;
use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::{mpsc, oneshot};
use tower_service::Service;
use tracing::Instrument;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The future of [`IdempotencyService`]: the response, or the inner
/// service's own error (never one of the layer's: those are responses).
pub type ResponseFuture<E> = BoxFuture<'static, Result<Response<Body>, E>>;

/// The service made by [`IdempotencyLayer`](crate::IdempotencyLayer); see
/// the [crate documentation](crate) for what it does.
///
/// It takes `http::Request<B>` for any body `B` (axum's, hyper's
/// `Incoming`, …), hands the inner service an `http::Request<axum::body::Body>`
/// and answers `http::Response<axum::body::Body>`.
///
/// ```
/// use idem_core::{Idempotency, MemoryStore};
/// use idem_http::{IdempotencyLayer, IdempotencyService};
/// use tower_layer::Layer;
///
/// let idem = Idempotency::builder(MemoryStore::new()).build();
/// let inner = tower::service_fn(|_req: http::Request<axum::body::Body>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(axum::body::Body::from("ok")))
/// });
/// let svc: IdempotencyService<_> = IdempotencyLayer::new(idem).layer(inner);
/// ```
pub struct IdempotencyService<S> {
    inner: S,
    idem: Idempotency,
    config: Arc<Config>,
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, idem: Idempotency, config: Arc<Config>) -> Self {
        IdempotencyService {
            inner,
            idem,
            config,
        }
    }
}

impl<S: Clone> Clone for IdempotencyService<S> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            idem: self.idem.clone(),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("idem", &self.idem)
            .finish_non_exhaustive()
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service that was driven to readiness handles this request.
        let ready = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, ready);
        let idem = self.idem.clone();
        let config = Arc::clone(&self.config);
        Box::pin(handle(inner, idem, config, request))
    }
}

/// Why the run body did not produce a response to store.
enum RunError<E> {
    /// The runtime refused or failed (in flight, mismatch, store down, …).
    Idem(Error),
    /// A response to send as it is, with the key released: a status that is
    /// not stored, a panic or a failed body turned into a 500.
    Respond(Response<Body>),
    /// The key is released; the client already has what it gets (a
    /// response cut short, or nothing: it went away under
    /// `cancel_on_disconnect`).
    Released,
    /// The inner service's own error, passed on (the key is released).
    Inner(E),
}

impl<E> From<Error> for RunError<E> {
    fn from(e: Error) -> Self {
        RunError::Idem(e)
    }
}

/// Where the run sends the answer of the request; the service future
/// waits on the other end.
type Reply<E> = oneshot::Sender<Result<Response<Body>, E>>;

async fn passthrough<S, B, ResBody>(
    mut inner: S,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let response = inner.call(request.map(Body::new)).await?;
    Ok(response.map(Body::new))
}

async fn handle<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if !cfg.methods.contains(request.method()) {
        return passthrough(inner, request).await;
    }
    if let Some(bypass) = &cfg.bypass {
        let (parts, body) = request.into_parts();
        let skip = bypass(&parts);
        let request = Request::from_parts(parts, body);
        if skip {
            tracing::trace!("bypassed: passing through unclaimed");
            return passthrough(inner, request).await;
        }
        return handle_traced(inner, idem, cfg, request).await;
    }
    handle_traced(inner, idem, cfg, request).await
}

async fn handle_traced<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let span = tracing::info_span!(
        "idem.http",
        method = %request.method(),
        path = request.uri().path()
    );
    handle_idempotent(inner, idem, cfg, request)
        .instrument(span)
        .await
}

async fn handle_idempotent<S, B, ResBody>(
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    request: Request<B>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: HttpBody<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    if request.extensions().get::<IdempotencyKey>().is_some() {
        // An outer IdempotencyLayer already holds this request's key: claiming
        // it again here would find it in flight and answer 409.
        tracing::trace!("already under an outer idempotency layer: passing through");
        return passthrough(inner, request).await;
    }
    let (mut parts, body) = request.into_parts();
    let key = match key_from_headers(&parts.headers) {
        Ok(Some(key)) => key,
        Ok(None) if cfg.require_key => {
            tracing::debug!("refused: Idempotency-Key required but missing");
            return Ok(cfg.problem(
                ProblemKind::MissingKey,
                "This endpoint requires an Idempotency-Key header: send a fresh unique value (e.g. a UUID) per operation, and the same value when retrying it.",
                false,
            ));
        }
        Ok(None) => {
            tracing::trace!("no Idempotency-Key: passing through");
            return passthrough(inner, Request::from_parts(parts, body)).await;
        }
        Err(e) => {
            tracing::debug!(error = %e, "refused: malformed Idempotency-Key");
            return Ok(cfg.problem(ProblemKind::InvalidKey, &e.to_string(), false));
        }
    };
    let tenant = cfg.tenant.tenant_of(&parts);
    let scope = scope::compose(&cfg.scope, tenant.as_deref());

    let body = match read_request_body(body, cfg.max_request_body).await {
        Ok(body) => body,
        Err(ReadError::TooLarge) => {
            tracing::debug!(
                limit = cfg.max_request_body,
                "refused: request body over the limit"
            );
            let detail = format!(
                "The request body is over the {}-byte limit of idempotent requests.",
                cfg.max_request_body
            );
            return Ok(cfg.problem(ProblemKind::RequestTooLarge, &detail, false));
        }
        Err(ReadError::Failed(e)) => {
            tracing::debug!(error = %e, "refused: the request body could not be read");
            return Ok(cfg.problem(
                ProblemKind::UnreadableRequest,
                "The request body could not be read.",
                false,
            ));
        }
    };
    let fingerprint = request_fingerprint(&parts, &body);
    let accept_encoding = parts.headers.get(header::ACCEPT_ENCODING).cloned();
    parts.extensions.insert(IdempotencyKey(key.clone()));
    let request = Request::from_parts(parts, Body::from(body));

    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        tracing::error!("IdempotencyLayer needs a Tokio runtime to run handlers: answering 500");
        return Ok(cfg.problem(
            ProblemKind::Internal,
            "The idempotency layer is misconfigured (no Tokio runtime); the request was not processed.",
            false,
        ));
    };
    let (reply, answer) = oneshot::channel();
    let job = Job {
        inner,
        idem,
        cfg: Arc::clone(&cfg),
        scope,
        key,
        fingerprint,
        accept_encoding,
        request,
    };
    // The run is a task of its own: hyper drops this future when the client
    // goes away, and a started handler must not stop half-way through its
    // effects (unless the user asked for that, below).
    let task = runtime.spawn(job.run(reply).in_current_span());
    let abort = cfg
        .cancel_on_disconnect
        .then(|| AbortOnDrop(Some(task.abort_handle())));
    let answer = answer.await;
    if let Some(mut abort) = abort {
        // Answered: from here on the client's body drives cancellation.
        abort.0 = None;
    }
    match answer {
        Ok(answer) => answer,
        Err(_) => {
            tracing::error!("the idempotent run ended without an answer: 500");
            Ok(cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer failed; the request may have been processed.",
                false,
            ))
        }
    }
}

/// Aborts the run's task when the service future is dropped before the
/// answer came (`cancel_on_disconnect(true)`): the runtime then releases the
/// key, as it does for any dropped call.
struct AbortOnDrop(Option<tokio::task::AbortHandle>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(handle) = self.0.take() {
            tracing::debug!("client gone before the answer: cancelling the handler");
            handle.abort();
        }
    }
}

/// Everything one idempotent run needs, owned, so it can be a task.
struct Job<S> {
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    scope: String,
    key: String,
    fingerprint: Fingerprint,
    accept_encoding: Option<HeaderValue>,
    request: Request<Body>,
}

impl<S, ResBody> Job<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    async fn run(self, reply: Reply<S::Error>) {
        let Job {
            inner,
            idem,
            cfg,
            scope,
            key,
            fingerprint,
            accept_encoding,
            request,
        } = self;
        let mut reply = Some(reply);
        let mut rest: Option<Forward> = None;
        let mut call = idem
            .call(&scope, key.as_str())
            .fingerprint_raw(fingerprint)
            .ttl(cfg.retention)
            .wait(cfg.wait);
        if let Some(lease) = cfg.lease {
            call = call.lease(lease);
        }
        let config: &Config = &cfg;
        let result = call
            .run_outcome(|| execute(inner, request, config, &mut reply, &mut rest))
            .await;
        let answer = match result {
            Ok((stored, Outcome::Replayed)) => {
                tracing::debug!(status = stored.status, "replaying the stored response");
                Some(Ok(replay(stored, config, accept_encoding.as_ref())))
            }
            Ok((stored, outcome)) => {
                tracing::debug!(%outcome, status = stored.status, kept = stored.not_kept.is_none(), "handler ran; outcome stored");
                stored.live.map(|live| Ok(first_response(live, config)))
            }
            Err(RunError::Respond(response)) => Some(Ok(response)),
            Err(RunError::Inner(e)) => Some(Err(e)),
            Err(RunError::Idem(e)) => Some(Ok(idem_error(e, config))),
            Err(RunError::Released) => None,
        };
        if let (Some(answer), Some(reply)) = (answer, reply.take()) {
            // The client may be gone; the outcome is stored all the same.
            let _ = reply.send(answer);
        }
        if let Some(rest) = rest {
            rest.finish().await;
        }
    }
}

/// Runs the handler once, streams its response to the client, and decides
/// what is stored: the response when its body ends within the limit, a
/// "processed, response not kept" marker when it does not (stored as soon
/// as the limit is passed, while the rest streams on).
async fn execute<S, ResBody>(
    mut inner: S,
    request: Request<Body>,
    cfg: &Config,
    reply: &mut Option<Reply<S::Error>>,
    rest: &mut Option<Forward>,
) -> Result<StoredResponse, RunError<S::Error>>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    // A panic in the handler becomes a 500 problem here, so the key is
    // released (by the Err) and the client gets an answer instead of a
    // reset connection.
    let outcome = AssertUnwindSafe(async move { inner.call(request).await })
        .catch_unwind()
        .await;
    let response = match outcome {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            tracing::debug!("the inner service failed; key released");
            return Err(RunError::Inner(e));
        }
        Err(panic) => {
            tracing::error!(
                panic = panic_message(panic.as_ref()),
                "the handler panicked: answering 500 and releasing the Idempotency-Key"
            );
            return Err(RunError::Respond(panicked_problem(cfg)));
        }
    };
    let status = response.status();
    if !is_stored(status) {
        tracing::debug!(
            status = status.as_u16(),
            "status is not stored: key released, a retry runs the handler again"
        );
        return Err(RunError::Respond(
            response.map(|b| CatchPanic::wrap(Body::new(b))),
        ));
    }
    let (parts, body) = response.into_parts();
    let body = Body::new(body);
    let limit = cfg.max_response_body;
    let not_kept = if cfg.streams_through(&parts.headers) {
        Some(NotKept::Streamed)
    } else if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
        Some(NotKept::TooLarge)
    } else {
        None
    };
    if let Some(why) = not_kept {
        // Known before a byte is read: the marker is stored at once and
        // hyper reads the body itself.
        tracing::debug!(
            status = status.as_u16(),
            reason = why.explain(),
            "response passed through; stored as processed, not kept"
        );
        send(
            reply,
            Ok(Response::from_parts(parts, CatchPanic::wrap(body))),
        );
        return Ok(StoredResponse::not_kept(status.as_u16(), why));
    }
    tee(parts, body, cfg, reply, rest).await
}

/// Reads the body, sending it on to the client as it comes (from its first
/// frame on, unless it is complete at once) while keeping a copy up to the
/// limit.
async fn tee<E>(
    parts: http::response::Parts,
    mut body: Body,
    cfg: &Config,
    reply: &mut Option<Reply<E>>,
    rest: &mut Option<Forward>,
) -> Result<StoredResponse, RunError<E>> {
    let limit = cfg.max_response_body;
    let head = StoredHead::of(&parts, cfg.replay_set_cookie);
    let mut parts = Some(parts);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut total = 0usize;
    let mut tx: Option<mpsc::Sender<FrameResult>> = None;
    loop {
        let frame = match next_frame(&mut body).await {
            Next::Frame(frame) => frame,
            Next::End => break,
            Next::Failed(e) => {
                tracing::warn!(error = %e, "the response body failed: key released");
                return Err(match tx {
                    Some(tx) => {
                        let _ = tx.send(Err(e)).await;
                        RunError::Released
                    }
                    None => RunError::Respond(cfg.problem(
                        ProblemKind::ResponseFailed,
                        "The response could not be produced; retry with the same Idempotency-Key.",
                        false,
                    )),
                });
            }
            Next::Panicked(why) => {
                tracing::error!(panic = %why, "the response body panicked: key released");
                return Err(match tx {
                    Some(tx) => {
                        let _ = tx.send(Err(panicked())).await;
                        RunError::Released
                    }
                    None => RunError::Respond(panicked_problem(cfg)),
                });
            }
        };
        if let Some(data) = frame.data_ref() {
            total = total.saturating_add(data.len());
            if total <= limit {
                chunks.push(data.clone());
            } else {
                chunks = Vec::new();
            }
        }
        let over = total > limit;
        let complete_at_once = tx.is_none() && !over && body.is_end_stream();
        if !complete_at_once {
            if let Some(parts) = parts.take() {
                // The head goes out with the first frame: a panic before it
                // still gets a 500, and the client streams from here on.
                let (sender, receiver) = ChannelBody::pair();
                if send(reply, Ok(Response::from_parts(parts, Body::new(receiver)))) {
                    tx = Some(sender);
                } else if cfg.cancel_on_disconnect {
                    return Err(RunError::Released);
                }
            }
            if let Some(sender) = &tx {
                if sender.send(Ok(frame)).await.is_err() {
                    tracing::debug!("client gone mid-response");
                    tx = None;
                    if cfg.cancel_on_disconnect {
                        return Err(RunError::Released);
                    }
                    // Otherwise read on: the retry gets the stored response.
                }
            }
        }
        if over {
            tracing::debug!(
                limit,
                "response over the size limit: streamed on, stored as processed, not kept"
            );
            if let Some(tx) = tx {
                *rest = Some(Forward {
                    body: Some(body),
                    tx,
                });
            }
            return Ok(StoredResponse::not_kept(head.status(), NotKept::TooLarge));
        }
        if complete_at_once {
            break;
        }
    }
    let bytes = concat(chunks, total);
    match (parts, tx) {
        // Nothing sent yet: the response goes out once it is stored.
        (Some(parts), _) => {
            let mut stored = head.with_body(&bytes);
            stored.live = Some(Live { parts, body: bytes });
            Ok(stored)
        }
        (None, tx) => {
            // The client's body ends only once the response is stored (the
            // sender is dropped after that), so that a retry sent as soon
            // as the response ended finds it.
            if let Some(tx) = tx {
                *rest = Some(Forward { body: None, tx });
            }
            Ok(head.with_body(&bytes))
        }
    }
}

/// Sends the answer, if not sent yet; `false` when the client is gone.
fn send<E>(reply: &mut Option<Reply<E>>, answer: Result<Response<Body>, E>) -> bool {
    match reply.take() {
        Some(reply) => reply.send(answer).is_ok(),
        None => false,
    }
}

fn concat(mut chunks: Vec<Bytes>, total: usize) -> Bytes {
    match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => {
            let mut all = BytesMut::with_capacity(total);
            for c in chunks {
                all.extend_from_slice(&c);
            }
            all.freeze()
        }
    }
}

fn panicked_problem(cfg: &Config) -> Response<Body> {
    cfg.problem(
        ProblemKind::HandlerPanicked,
        "The request failed and was not recorded; it is safe to retry with the same Idempotency-Key.",
        false,
    )
}

/// Which statuses are stored and replayed: 2xx, 3xx and 4xx except 401,
/// 403 and 407 (a client that fixes its credentials must not get the old
/// refusal replayed) and 408, 409, 425 and 429 (transient: the client is
/// expected to retry). 1xx (upgrades included) and 5xx release the key.
fn is_stored(status: StatusCode) -> bool {
    match status.as_u16() {
        401 | 403 | 407 | 408 | 409 | 425 | 429 => false,
        s => (200..500).contains(&s),
    }
}

/// SHA-256 over method, path, query and body, each length-prefixed. The
/// path is the one the client sent, also under a `Router::nest` (which strips
/// its prefix from the URI the inner router sees).
fn request_fingerprint(parts: &http::request::Parts, body: &[u8]) -> Fingerprint {
    let uri = parts
        .extensions
        .get::<OriginalUri>()
        .map_or(&parts.uri, |original| &original.0);
    Fingerprint::of_parts(&[
        parts.method.as_str().as_bytes(),
        uri.path().as_bytes(),
        uri.query().unwrap_or("").as_bytes(),
        body,
    ])
}

enum ReadError {
    TooLarge,
    Failed(BoxError),
}

async fn read_request_body<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > u64::try_from(limit).unwrap_or(u64::MAX) {
        return Err(ReadError::TooLarge);
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(ReadError::TooLarge),
        Err(e) => Err(ReadError::Failed(e)),
    }
}

fn retention_header(cfg: &Config, response: &mut Response<Body>) {
    if cfg.advertise_retention {
        response.headers_mut().insert(
            IDEMPOTENCY_RETENTION,
            HeaderValue::from(cfg.retention.as_secs()),
        );
    }
}

/// The response for the request that ran the handler: exactly what the
/// handler answered (every header, `Set-Cookie` included).
fn first_response(live: Live, cfg: &Config) -> Response<Body> {
    let mut response = Response::from_parts(live.parts, Body::from(live.body));
    retention_header(cfg, &mut response);
    response
}

/// A replay: the stored status, headers and body, marked as a replay; or,
/// for a marker, the `response-not-kept` problem.
fn replay(stored: StoredResponse, cfg: &Config, accept: Option<&HeaderValue>) -> Response<Body> {
    if let Some(why) = stored.not_kept {
        tracing::debug!(status = stored.status, "processed, response not kept: 410");
        let detail = format!(
            "The request with this Idempotency-Key was processed (status {}), but its response was not kept because {}, so it cannot be replayed. Do not send the request again, with this key or a new one: the operation was applied. Look its result up another way.",
            stored.status,
            why.explain()
        );
        return problem_response(
            &cfg.problem_type_base,
            ProblemKind::ResponseNotKept,
            &detail,
            None,
            Some(stored.status),
        );
    }
    let mut response = match rebuild(&stored) {
        Ok(response) => response,
        Err(why) => return corrupt(why, cfg),
    };
    let coded = response.headers().contains_key(header::CONTENT_ENCODING);
    // `rebuild` decoded the body already, so this cannot fail.
    let body = || stored.body.to_bytes().unwrap_or_default();
    match coded
        .then(|| encoding::negotiate(response.headers(), &body(), accept, cfg.max_response_body))
    {
        None | Some(Replay::AsStored) => {}
        Some(Replay::Decoded(body)) => {
            tracing::debug!("stored body decoded for a request that does not accept its coding");
            response.headers_mut().remove(header::CONTENT_ENCODING);
            *response.body_mut() = Body::from(body);
        }
        Some(Replay::NotAcceptable(why)) => {
            tracing::debug!(reason = %why, "stored coding not acceptable: 406");
            return cfg.problem(
                ProblemKind::EncodingNotAcceptable,
                &format!(
                    "{why}. Send Accept-Encoding with that coding to get the stored response."
                ),
                false,
            );
        }
    }
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    retention_header(cfg, &mut response);
    response
}

fn corrupt(why: String, cfg: &Config) -> Response<Body> {
    tracing::error!(reason = %why, "a stored response cannot be replayed");
    cfg.problem(
        ProblemKind::Internal,
        "The stored response for this Idempotency-Key cannot be replayed.",
        false,
    )
}

fn rebuild(stored: &StoredResponse) -> Result<Response<Body>, String> {
    if stored.version != FORMAT_VERSION {
        return Err(format!("unknown record format version {}", stored.version));
    }
    let status = StatusCode::from_u16(stored.status)
        .map_err(|_| format!("invalid stored status {}", stored.status))?;
    let body = stored
        .body
        .to_bytes()
        .map_err(|e| format!("stored body: {e}"))?;
    let mut response = Response::new(Body::from(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|e| format!("stored header name {name:?}: {e}"))?;
        let value = value
            .to_bytes()
            .map_err(|e| format!("stored header {name}: {e}"))
            .and_then(|v| {
                HeaderValue::from_maybe_shared(v).map_err(|e| format!("stored header {name}: {e}"))
            })?;
        headers.append(name, value);
    }
    Ok(response)
}

/// Maps a runtime error to the layer's answer.
fn idem_error(e: Error, cfg: &Config) -> Response<Body> {
    match e {
        Error::InProgress { .. } => {
            tracing::debug!("a request with this key is in flight: 409");
            cfg.problem(
                ProblemKind::KeyInUse,
                "A request with this Idempotency-Key is being processed; retry after the Retry-After delay to get its response.",
                true,
            )
        }
        Error::FingerprintMismatch => {
            tracing::debug!("key reused with another request: 422");
            cfg.problem(
                ProblemKind::KeyReused,
                "This Idempotency-Key was already used with a different request (method, path, query or body); use a new key for a new operation.",
                false,
            )
        }
        Error::Unavailable { .. } => {
            tracing::warn!(error = %e, "idempotency store unavailable: 503, handler not run");
            cfg.problem(
                ProblemKind::StoreUnavailable,
                "The request was not processed because the idempotency store is unavailable; retry later with the same Idempotency-Key.",
                true,
            )
        }
        Error::InvalidKey(ref k) if key_part(k) == Some(KeyPart::Key) => {
            tracing::debug!(error = %e, "key refused by the runtime: 400");
            cfg.problem(ProblemKind::InvalidKey, &k.to_string(), false)
        }
        other => {
            tracing::error!(error = %other, "idempotency layer failure: 500");
            cfg.problem(
                ProblemKind::Internal,
                "The idempotency layer failed; the request may not have been processed.",
                false,
            )
        }
    }
}

fn key_part(e: &KeyError) -> Option<KeyPart> {
    match e {
        KeyError::Empty { part }
        | KeyError::TooLong { part, .. }
        | KeyError::ControlChar { part, .. } => Some(*part),
        _ => None,
    }
}

pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    if let Some(s) = panic.downcast_ref::<&'static str>() {
        s
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s
    } else {
        "(non-string panic payload)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_statuses() {
        for s in [200, 201, 204, 303, 400, 404, 410, 422] {
            assert!(is_stored(StatusCode::from_u16(s).unwrap()), "{s}");
        }
        for s in [101, 401, 403, 407, 408, 409, 425, 429, 500, 502, 503, 504] {
            assert!(!is_stored(StatusCode::from_u16(s).unwrap()), "{s}");
        }
    }

    #[test]
    fn fingerprint_covers_method_path_query_body() {
        let fp = |m: &str, uri: &str, body: &[u8]| {
            let (parts, ()) = Request::builder()
                .method(m)
                .uri(uri)
                .body(())
                .unwrap()
                .into_parts();
            request_fingerprint(&parts, body)
        };
        let base = fp("POST", "/a?x=1", b"{}");
        assert_eq!(base, fp("POST", "/a?x=1", b"{}"));
        assert_ne!(base, fp("PATCH", "/a?x=1", b"{}"));
        assert_ne!(base, fp("POST", "/b?x=1", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=2", b"{}"));
        assert_ne!(base, fp("POST", "/a?x=1", b"{ }"));
    }
}
