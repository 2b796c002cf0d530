//! One idempotent run, as a task of its own: claim, run the handler,
//! stream its response to the client while keeping a copy, and store the
//! response or a "processed, response not kept" marker.

use crate::answer::HttpAnswers;
use crate::body::{CatchPanic, ChannelBody, Forward, FrameResult, Next, next_frame, panicked};
use crate::config::Config;
use crate::problem::ProblemKind;
use crate::stored::{self, Live, StoredHead, StoredResponse, explain};
use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Request, Response, StatusCode};
use http_body::Body as HttpBody;
use idem_layer::record::NotKept;
use idem_layer::settings::Claim;
use idem_layer::task::{self, BytesBody, Inner, send};
use idem_layer::wait::Wait;
use std::sync::Arc;
use tokio::sync::mpsc;
use tower_service::Service;

type RunError<E> = task::RunError<Response<Body>, E>;
pub(crate) type Reply<E> = task::Reply<Response<Body>, E>;

/// Everything one idempotent run needs, owned, so it can be a task.
pub(crate) struct Job<S> {
    pub(crate) inner: S,
    pub(crate) cfg: Arc<Config>,
    pub(crate) claim: Claim,
    pub(crate) accept_encoding: Option<HeaderValue>,
    /// How long this request waits for an in-flight one with its key, and
    /// the wait it asked for as granted (`Prefer: wait`).
    pub(crate) wait: Wait,
    pub(crate) request: Request<Body>,
}

impl<S> Job<S> {
    pub(crate) async fn run<ResBody>(self, reply: Reply<S::Error>)
    where
        S: Inner<Request<Body>, ResBody>,
        ResBody: BytesBody,
    {
        let Job {
            inner,
            cfg,
            claim,
            accept_encoding,
            wait,
            request,
        } = self;
        let mut reply = Some(reply);
        let mut rest: Option<Forward> = None;
        let config: &Config = &cfg;
        let result = claim
            .call_waiting(&cfg.settings, wait.wait)
            .run_outcome(|| execute(inner, request, config, &mut reply, &mut rest))
            .await;
        let answers = HttpAnswers {
            cfg: config,
            accept: accept_encoding.as_ref(),
            granted: wait.granted,
        };
        if let Some(answer) = task::answer(&answers, result) {
            // The client may be gone; the outcome is stored all the same.
            task::send(&mut reply, answer);
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
    inner: S,
    request: Request<Body>,
    cfg: &Config,
    reply: &mut Option<Reply<S::Error>>,
    rest: &mut Option<Forward>,
) -> Result<StoredResponse, RunError<S::Error>>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: BytesBody,
{
    let response = task::call_handler(inner, request, || panicked_problem(cfg)).await?;
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
    let limit = cfg.settings.max_response;
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
            reason = explain(why),
            "response passed through; stored as processed, not kept"
        );
        send(
            reply,
            Ok(Response::from_parts(parts, CatchPanic::wrap(body))),
        );
        return Ok(stored::not_kept(status.as_u16(), why));
    }
    tee(parts, body, cfg, reply, rest).await
}

/// Reads the body, sending it on to the client as it comes (from its first
/// frame on, unless it is complete at once) while keeping a copy up to the
/// limit.
///
/// Under `cancel_on_disconnect`, a client gone mid-response stops the
/// reading; the handler has run all the same, so what is stored is a
/// "processed, response not kept" marker, never a released key.
async fn tee<E>(
    parts: http::response::Parts,
    mut body: Body,
    cfg: &Config,
    reply: &mut Option<Reply<E>>,
    rest: &mut Option<Forward>,
) -> Result<StoredResponse, RunError<E>> {
    let limit = cfg.settings.max_response;
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
                    return Ok(client_gone(&head));
                }
            }
            if let Some(sender) = &tx
                && sender.send(Ok(frame)).await.is_err()
            {
                tracing::debug!("client gone mid-response");
                tx = None;
                if cfg.cancel_on_disconnect {
                    return Ok(client_gone(&head));
                }
                // Otherwise read on: the retry gets the stored response.
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
            return Ok(stored::not_kept(head.status(), NotKept::TooLarge));
        }
        if complete_at_once {
            break;
        }
    }
    let bytes = concat(chunks, total);
    match (parts, tx) {
        // Nothing sent yet: the response goes out once it is stored.
        (Some(parts), _) => {
            let live = Live {
                parts,
                body: bytes.clone(),
            };
            Ok(head.with_body(&bytes, Some(live), cfg.settings.max_value))
        }
        (None, tx) => {
            // The client's body ends only once the response is stored (the
            // sender is dropped after that), so that a retry sent as soon
            // as the response ended finds it.
            if let Some(tx) = tx {
                *rest = Some(Forward { body: None, tx });
            }
            Ok(head.with_body(&bytes, None, cfg.settings.max_value))
        }
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

/// The marker stored when the client left while its response streamed.
fn client_gone(head: &StoredHead) -> StoredResponse {
    tracing::debug!("client gone mid-response: stored as processed, not kept");
    stored::not_kept(head.status(), NotKept::ClientGone)
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
}
