//! The service the layer wraps around a tonic server: picks the protected
//! unary calls, reads their key and message, and runs each in a task of its
//! own (claim, run the handler, store its answer, answer the client).

use crate::body::{Chain, Complete};
use crate::config::{Config, Refusal, refuse, tenant_of};
use crate::frame::{self, FrameError};
use crate::method::{KeySource, UnaryMethod};
use crate::stored::{self, explain};
use crate::wait;
use crate::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use bytes::{Bytes, BytesMut};
use futures_util::FutureExt;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::BodyExt;
use idem_core::{Error, Fingerprint, Idempotency};
use idem_layer::record::{NotKept, Record};
use idem_layer::settings::{Claim, MaxLease};
use idem_layer::task::{
    self, Answers, BytesBody, Inner, Ran, ReadError, TaskError, read_limited, take_ready,
};
use idem_layer::wait::Wait;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tonic::body::Body;
use tower_service::Service;
use tracing::Instrument;

/// The future of [`IdempotencyService::call`].
pub type ResponseFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

/// The service [`IdempotencyLayer`](crate::IdempotencyLayer) wraps around
/// a tonic server or service. See the [crate documentation](crate).
///
/// ```
/// use idem_grpc::{IdempotencyLayer, IdempotencyService};
/// use tower_layer::Layer;
/// # let idem = idem_core::Idempotency::builder(idem_core::MemoryStore::new()).build();
/// # #[derive(Clone)] struct MyService;
/// let svc: IdempotencyService<MyService> = IdempotencyLayer::new(idem).unary("/a.B/C").layer(MyService);
/// ```
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("idem", &self.idem)
            .field("config", &self.cfg)
            .finish()
    }
}

impl<S> IdempotencyService<S> {
    pub(crate) fn new(inner: S, idem: Idempotency, cfg: Arc<Config>) -> IdempotencyService<S> {
        IdempotencyService { inner, idem, cfg }
    }
}

impl<S, ResBody> Service<Request<Body>> for IdempotencyService<S>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Inner<Request<Body>, ResBody> + Clone,
    ResBody: BytesBody,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let mut inner = take_ready(&mut self.inner);
        let cfg = self.cfg.clone();
        let Some(method) = cfg.methods.get(request.uri().path()).cloned() else {
            if request.headers().contains_key(IDEMPOTENCY_KEY) {
                // A caller asking for idempotency never gets a run without it.
                let path = request.uri().path().to_owned();
                tracing::debug!(%path, "idempotency-key sent to a method not declared unary: refused");
                return Box::pin(async move {
                    Ok(refuse(
                        &cfg,
                        Refusal::NotUnary,
                        &format!(
                            "{path} is not protected by the idempotency layer (streaming methods never are; unary ones must be declared with IdempotencyLayer::unary); the request was not processed. Send it without idempotency-key, or declare the method"
                        ),
                    ))
                });
            }
            let call = inner.call(request);
            return Box::pin(async move { call.await.map(|r| r.map(Body::new)) });
        };
        if matches!(method.key, KeySource::Metadata)
            && !cfg.settings.require_key
            && !request.headers().contains_key(IDEMPOTENCY_KEY)
        {
            // No key and none required: not buffered, not claimed.
            let call = inner.call(request);
            return Box::pin(async move { call.await.map(|r| r.map(Body::new)) });
        }
        let idem = self.idem.clone();
        // Opened here, in the span the call arrives in (an application's
        // own server span, if any), as idem-http's `idem.http` is.
        let span = tracing::info_span!(
            "idem.grpc",
            path = %method.path,
            // Recorded only with `otel`, when this is the call's server span.
            otel.kind = tracing::field::Empty,
        );
        #[cfg(feature = "otel")]
        idem_layer::otel::continue_request(&span, request.headers());
        Box::pin(protect(inner, idem, cfg, method, request).instrument(span))
    }
}

/// A protected unary call: key, message, fingerprint, then the run task.
async fn protect<S, ResBody>(
    mut inner: S,
    idem: Idempotency,
    cfg: Arc<Config>,
    method: UnaryMethod,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Inner<Request<Body>, ResBody>,
    ResBody: BytesBody,
{
    let (parts, body) = request.into_parts();
    // A method keyed by a request field ignores the metadata entry: the
    // field replaces it, so the entry is not even read.
    let metadata_key = match method.key {
        KeySource::Metadata => match key_from_metadata(&parts.headers) {
            Ok(key) => key,
            Err(message) => return Ok(refuse(&cfg, Refusal::InvalidKey, &message)),
        },
        KeySource::Message(_) => None,
    };
    let bytes = match read_limited(body, cfg.settings.max_request).await {
        Ok(bytes) => bytes,
        Err(ReadError::TooLarge) => {
            return Ok(refuse(
                &cfg,
                Refusal::RequestTooLarge,
                &format!(
                    "the request message is over the idempotency layer's {}-byte limit; the request was not processed",
                    cfg.settings.max_request
                ),
            ));
        }
        Err(ReadError::Failed(e)) => {
            return Ok(refuse(
                &cfg,
                Refusal::UnreadableRequest,
                &format!("the request body could not be read ({e}); the request was not processed"),
            ));
        }
    };
    let message = match frame::messages(&bytes) {
        Ok(messages) => match messages.as_slice() {
            [one] => *one,
            [] => {
                return Ok(refuse(
                    &cfg,
                    Refusal::UnreadableRequest,
                    "a unary request carries exactly one message and this one has none; the request was not processed",
                ));
            }
            _ => {
                return Ok(refuse(
                    &cfg,
                    Refusal::NotUnary,
                    &format!(
                        "{} was declared unary but the request carries {} messages: client-streaming methods are never protected; the request was not processed",
                        method.path,
                        messages.len()
                    ),
                ));
            }
        },
        Err(e) => {
            let why = match e {
                FrameError::Truncated => "the body ends inside a message".to_owned(),
                FrameError::BadFlag(f) => format!("compression flag {f}"),
            };
            return Ok(refuse(
                &cfg,
                Refusal::UnreadableRequest,
                &format!(
                    "the request is not a gRPC message ({why}); the request was not processed"
                ),
            ));
        }
    };
    let needs_decoding = matches!(method.key, KeySource::Message(_)) || method.part.is_some();
    if message.compressed && needs_decoding {
        return Ok(refuse(
            &cfg,
            Refusal::CompressedRequest,
            &format!(
                "{} reads its idempotency key or fingerprint from the request message, which the layer cannot read compressed; send the request uncompressed",
                method.path
            ),
        ));
    }
    let key = match &method.key {
        KeySource::Metadata => metadata_key,
        KeySource::Message(read) => match read(message.bytes) {
            Ok(Some(key)) => match idem_key::validate(&key) {
                Ok(()) => Some(key),
                Err(e) => {
                    return Ok(refuse(
                        &cfg,
                        Refusal::InvalidKey,
                        &format!("the request's idempotency key field is refused: {e}"),
                    ));
                }
            },
            Ok(None) => None,
            Err(e) => {
                return Ok(refuse(
                    &cfg,
                    Refusal::UnreadableRequest,
                    &format!(
                        "the request message does not decode ({e}), so its idempotency key cannot be read; the request was not processed"
                    ),
                ));
            }
        },
    };
    let request = Request::from_parts(parts, full(bytes.clone()));
    let Some(key) = key else {
        if cfg.settings.require_key {
            let where_ = match method.key {
                KeySource::Metadata => "an idempotency-key metadata entry",
                KeySource::Message(_) => "its idempotency key field set",
            };
            return Ok(refuse(
                &cfg,
                Refusal::MissingKey,
                &format!(
                    "{} requires {where_} (a UUID per operation, the same on every retry); the request was not processed",
                    method.path
                ),
            ));
        }
        tracing::debug!(path = %method.path, "no idempotency key: passed through unprotected");
        return inner.call(request).await.map(|r| r.map(Body::new));
    };
    let fingerprint = match &method.part {
        None => Fingerprint::of_parts(&[
            b"idem-grpc v1",
            method.path.as_bytes(),
            &[u8::from(message.compressed)],
            message.bytes,
        ]),
        Some(part) => match part(message.bytes) {
            Ok(part) => {
                Fingerprint::of_parts(&[b"idem-grpc part v1", method.path.as_bytes(), &part])
            }
            Err(e) => {
                return Ok(refuse(
                    &cfg,
                    Refusal::UnreadableRequest,
                    &format!(
                        "the request message does not decode ({e}); the request was not processed"
                    ),
                ));
            }
        },
    };
    let tenant = match tenant_of(&cfg.settings.tenant, request.headers()) {
        Ok(tenant) => tenant,
        Err(message) => {
            return Ok(refuse(
                &cfg,
                Refusal::InvalidTenant,
                &format!("{message}; the request was not processed"),
            ));
        }
    };
    let scope = idem_key::scope::compose_bytes(
        method.scope.as_deref().unwrap_or(&method.path),
        tenant.as_deref(),
    );
    let wait = wait::of(request.headers(), &cfg.settings);
    let max_lease = request.extensions().get::<MaxLease>().map(|m| m.0);
    let job = Job {
        inner,
        cfg: cfg.clone(),
        claim: Claim {
            idem,
            scope,
            key,
            fingerprint,
            max_lease,
        },
        wait,
        request,
    };
    // A client that goes away (hyper drops this future) does not stop a
    // started handler: the rest of the run moves to a task of its own, and
    // its answer is still stored.
    // In the caller's span (`idem.grpc`) also once the run is a task of
    // its own: the call's span is its child.
    match task::run_until_answered(|reply| job.run(reply).in_current_span(), false).await {
        Ok(answer) => answer,
        Err(TaskError::NoRuntime) => Ok(refuse(
            &cfg,
            Refusal::Internal,
            "the idempotency layer needs a Tokio runtime; the request was not processed",
        )),
        Err(TaskError::NoAnswer) => Ok(refuse(
            &cfg,
            Refusal::Internal,
            "the idempotent run ended without an answer; retry with the same key",
        )),
    }
}

/// The key in the `idempotency-key` metadata entry, if any; the error
/// message says what is wrong and what to send.
fn key_from_metadata(headers: &HeaderMap) -> Result<Option<String>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(
            "the idempotency-key metadata entry was sent more than once; send exactly one"
                .to_owned(),
        );
    }
    idem_key::decode(first.as_bytes())
        .map(Some)
        .map_err(|e| e.to_string())
}

fn full(bytes: Bytes) -> Body {
    Body::new(Complete::new(bytes, None))
}

type RunError<E> = task::RunError<Response<Body>, E>;
type Reply<E> = task::Reply<Response<Body>, E>;

/// Everything one idempotent run needs, owned, so it can be a task.
struct Job<S> {
    inner: S,
    cfg: Arc<Config>,
    claim: Claim,
    /// How long this call waits for an in-flight one with its key, and the
    /// wait it asked for as granted (`idem-wait`).
    wait: Wait,
    request: Request<Body>,
}

impl<S> Job<S> {
    async fn run<ResBody>(self, reply: Reply<S::Error>)
    where
        S: Inner<Request<Body>, ResBody>,
        ResBody: BytesBody,
    {
        let Job {
            inner,
            cfg,
            claim,
            wait,
            request,
        } = self;
        let mut reply = Some(reply);
        let mut call = claim.call_waiting(&cfg.settings, wait.wait);
        if let Some(group) = &cfg.group {
            call = call.in_group(group);
        }
        let config: &Config = &cfg;
        let result = call
            .run_outcome(|| execute(inner, request, config, &mut reply))
            .await;
        let answers = GrpcAnswers {
            cfg: config,
            granted: wait.granted,
        };
        if let Some(answer) = task::answer(&answers, result) {
            // The client may be gone; the answer is stored all the same.
            task::send(&mut reply, answer);
        }
    }
}

/// Runs the handler once and reads its reply: a unary reply (one message,
/// then trailers) is kept whole and stored if its status is stored; a
/// stream, or a reply over the limit, is sent on as it comes and stored as
/// "processed, not kept".
async fn execute<S, ResBody>(
    inner: S,
    request: Request<Body>,
    cfg: &Config,
    reply: &mut Option<Reply<S::Error>>,
) -> Result<Ran<Response<Body>>, RunError<S::Error>>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: BytesBody,
{
    let response = task::call_handler(inner, request, || {
        refuse(
            cfg,
            Refusal::HandlerPanicked,
            "the handler failed and nothing was recorded; it is safe to retry with the same key",
        )
    })
    .await?;
    let (parts, body) = response.into_parts();
    let mut body = Body::new(body);
    let mut data = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let frame = AssertUnwindSafe(body.frame()).catch_unwind().await;
        let frame = match frame {
            Ok(None) => break,
            Ok(Some(Ok(frame))) => frame,
            Ok(Some(Err(status))) => {
                tracing::warn!(error = %status, "the reply failed: key released");
                return Err(RunError::Respond(refuse(
                    cfg,
                    Refusal::ResponseFailed,
                    "the reply could not be produced and nothing was recorded; retry with the same key",
                )));
            }
            Err(_) => {
                tracing::error!("the reply panicked: key released");
                return Err(RunError::Respond(refuse(
                    cfg,
                    Refusal::HandlerPanicked,
                    "the handler failed and nothing was recorded; it is safe to retry with the same key",
                )));
            }
        };
        match frame.into_data() {
            Ok(chunk) => {
                data.extend_from_slice(&chunk);
                let why = if frame::count_messages(&data) > 1 {
                    Some(NotKept::Streamed)
                } else if data.len() > cfg.settings.max_response {
                    Some(NotKept::TooLarge)
                } else {
                    None
                };
                if let Some(why) = why {
                    // The handler ran: record that, and let the client read on.
                    tracing::debug!(
                        reason = explain(why),
                        "reply passed through; stored as processed, not kept"
                    );
                    if let Some(reply) = reply.take() {
                        let _ = reply.send(Ok(Response::from_parts(
                            parts,
                            Body::new(Chain::new(data.freeze(), body)),
                        )));
                    }
                    return Ok(Ran::new(stored::not_kept(why), None));
                }
            }
            Err(frame) => {
                if let Ok(t) = frame.into_trailers() {
                    match &mut trailers {
                        Some(all) => all.extend(t),
                        None => trailers = Some(t),
                    }
                }
            }
        }
    }
    let data = data.freeze();
    let code = status_code(trailers.as_ref()).or_else(|| status_code(Some(&parts.headers)));
    let live = Response::from_parts(
        parts,
        Body::new(Complete::new(data.clone(), trailers.clone())),
    );
    match code {
        Some(code) if cfg.stores(code) => {
            let stored = stored::kept(code, live.headers(), &data, trailers.as_ref());
            if !stored.fits(cfg.settings.max_value) {
                // The runtime would keep a "too large" marker no retry can
                // be answered from: this reply is not kept, as one over
                // max_response_bytes is not.
                tracing::debug!(
                    max_value_size = cfg.settings.max_value,
                    "reply's record over the runtime's max_value_size: answered, stored as processed, not kept"
                );
                return Ok(Ran::new(stored::not_kept(NotKept::TooLarge), Some(live)));
            }
            Ok(Ran::new(stored, Some(live)))
        }
        code => {
            tracing::debug!(
                ?code,
                "status is not stored: key released, a retry runs the handler again"
            );
            Err(RunError::Respond(live))
        }
    }
}

fn status_code(headers: Option<&HeaderMap>) -> Option<i32> {
    headers?
        .get("grpc-status")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The layer's answers: gRPC statuses, replays byte for byte.
struct GrpcAnswers<'a> {
    cfg: &'a Config,
    /// The wait the call asked for (`idem-wait`), as granted: reported on
    /// the answers it gets as a duplicate.
    granted: Option<std::time::Duration>,
}

impl Answers for GrpcAnswers<'_> {
    type Response = Response<Body>;
    type Live = Response<Body>;

    fn replay(&self, record: Record) -> Response<Body> {
        let mut response = replay(record, self.cfg);
        wait::mark(response.headers_mut(), self.granted);
        response
    }

    fn first(&self, ran: Ran<Response<Body>>) -> Option<Response<Body>> {
        ran.take_live()
    }

    fn refusal(&self, error: Error) -> Response<Body> {
        let in_flight = matches!(error, Error::InProgress { .. });
        let mut response = idem_error(error, self.cfg);
        if in_flight {
            wait::mark(response.headers_mut(), self.granted);
        }
        response
    }
}

/// A replay: the stored metadata, messages and trailers, marked as a
/// replay; or, for a marker, the `response-not-kept` refusal.
fn replay(stored: Record, cfg: &Config) -> Response<Body> {
    if let Some(why) = stored.not_kept {
        return refuse(
            cfg,
            Refusal::ResponseNotKept,
            &format!(
                "the call with this idempotency key was processed, but its answer was not kept because {}, so it cannot be replayed; do not send it again under this key or a new one, look its result up another way",
                explain(why)
            ),
        );
    }
    match rebuild(&stored) {
        Ok(response) => response,
        Err(why) => {
            tracing::error!(reason = %why, "a stored answer cannot be replayed");
            refuse(
                cfg,
                Refusal::Internal,
                "the stored answer for this idempotency key cannot be replayed",
            )
        }
    }
}

fn rebuild(stored: &Record) -> Result<Response<Body>, String> {
    if stored.code.is_none() {
        return Err("a record without a gRPC status code".to_owned());
    }
    let mut decoded = stored.decode()?;
    decoded
        .headers
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let trailers = (!decoded.trailers.is_empty()).then_some(decoded.trailers);
    let mut response = Response::new(Body::new(Complete::new(decoded.body, trailers)));
    *response.headers_mut() = decoded.headers;
    Ok(response)
}

/// Maps a runtime error to the layer's answer.
fn idem_error(e: Error, cfg: &Config) -> Response<Body> {
    match e {
        Error::InProgress { .. } => refuse(
            cfg,
            Refusal::KeyInUse,
            "a call with this idempotency key is in flight; retry after grpc-retry-pushback-ms with the same key to get its answer",
        ),
        Error::FingerprintMismatch => refuse(
            cfg,
            Refusal::KeyReused,
            "this idempotency key was already used with a different request; use a new key for a new operation",
        ),
        Error::Unavailable { .. } => {
            tracing::warn!(error = %e, "idempotency store unavailable: UNAVAILABLE, handler not run");
            refuse(
                cfg,
                Refusal::StoreUnavailable,
                "the call was not processed because the idempotency store is unavailable; retry later with the same key",
            )
        }
        Error::InvalidKey(k) => refuse(cfg, Refusal::InvalidKey, &k.to_string()),
        // The others a retry with the same key can get past: the runtime's
        // durability not confirmed, a lease lost, a conflicting write.
        other if other.is_retryable() => {
            tracing::warn!(error = %other, "idempotency store did not confirm the call: UNAVAILABLE");
            refuse(
                cfg,
                Refusal::StoreNotConfirmed,
                &format!(
                    "the idempotency store did not confirm this call ({other}); retry later with the same key"
                ),
            )
        }
        other => {
            tracing::error!(error = %other, "idempotency layer failure: INTERNAL");
            refuse(
                cfg,
                Refusal::Internal,
                "the idempotency layer failed; the call may not have been processed",
            )
        }
    }
}
