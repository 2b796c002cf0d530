//! The layer's answers from what the run produced: the first response, a
//! replay (re-negotiating a stored content coding), the runtime's errors.

use crate::config::Config;
use crate::encoding::{self, Replay};
use crate::prefer;
use crate::problem::{ProblemKind, problem_response};
use crate::stored::{Live, StoredResponse, explain};
use crate::{IDEMPOTENCY_RETENTION, IDEMPOTENT_REPLAYED, PREFERENCE_APPLIED};
use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};
use idem_core::{Error, KeyError, KeyPart};
use idem_layer::record::Record;
use idem_layer::task::Answers;
use std::time::Duration;

fn retention_header(cfg: &Config, response: &mut Response<Body>) {
    if cfg.advertise_retention {
        response.headers_mut().insert(
            IDEMPOTENCY_RETENTION,
            HeaderValue::from(cfg.settings.retention.as_secs()),
        );
    }
}

/// The layer's answers for one request; `accept` is its `Accept-Encoding`,
/// against which a stored content coding is re-negotiated.
pub(crate) struct HttpAnswers<'a> {
    pub(crate) cfg: &'a Config,
    pub(crate) accept: Option<&'a HeaderValue>,
    /// The wait the request asked for (`Prefer: wait`), as granted: sent
    /// back as `Preference-Applied` on the answers it was a duplicate's.
    pub(crate) granted: Option<Duration>,
}

impl HttpAnswers<'_> {
    /// `Preference-Applied: wait=N` on an answer to a duplicate that asked
    /// to wait.
    fn applied(&self, mut response: Response<Body>) -> Response<Body> {
        if let Some(granted) = self.granted {
            response
                .headers_mut()
                .insert(PREFERENCE_APPLIED, prefer::applied(granted));
        }
        response
    }
}

impl Answers for HttpAnswers<'_> {
    type Response = Response<Body>;
    type Live = Live;

    fn replay(&self, record: Record) -> Response<Body> {
        self.applied(replay(record, self.cfg, self.accept))
    }

    fn first(&self, ran: StoredResponse) -> Option<Response<Body>> {
        ran.take_live().map(|live| first_response(live, self.cfg))
    }

    fn refusal(&self, error: Error) -> Response<Body> {
        let in_flight = matches!(error, Error::InProgress { .. });
        let response = idem_error(error, self.cfg);
        if in_flight {
            // It waited what it asked for (or was granted), in vain.
            self.applied(response)
        } else {
            response
        }
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
fn replay(stored: Record, cfg: &Config, accept: Option<&HeaderValue>) -> Response<Body> {
    let Some(status) = stored.status else {
        return corrupt("a record without an HTTP status".to_owned(), cfg);
    };
    if let Some(why) = stored.not_kept {
        tracing::debug!(status, "processed, response not kept: 410");
        let detail = format!(
            "The request with this Idempotency-Key was processed (status {status}), but its response was not kept because {}, so it cannot be replayed. Do not send the request again, with this key or a new one: the operation was applied. Look its result up another way.",
            explain(why)
        );
        return problem_response(
            &cfg.problem_type_base,
            ProblemKind::ResponseNotKept,
            &detail,
            None,
            Some(status),
        );
    }
    let (mut response, body) = match rebuild(status, &stored) {
        Ok(rebuilt) => rebuilt,
        Err(why) => return corrupt(why, cfg),
    };
    let coded = response.headers().contains_key(header::CONTENT_ENCODING);
    match coded
        .then(|| encoding::negotiate(response.headers(), &body, accept, cfg.settings.max_response))
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

/// The stored response, and its body (for a coding to re-negotiate).
fn rebuild(status: u16, stored: &Record) -> Result<(Response<Body>, Bytes), String> {
    let status =
        StatusCode::from_u16(status).map_err(|_| format!("invalid stored status {status}"))?;
    let decoded = stored.decode()?;
    let mut response = Response::new(Body::from(decoded.body.clone()));
    *response.status_mut() = status;
    *response.headers_mut() = decoded.headers;
    Ok((response, decoded.body))
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
