//! API Gateway events (HTTP API v2 and REST API v1 payloads) through
//! `lambda_http`'s conversion into an `http::Request`, then idem-http's
//! layer over a handler, as `idem_lambda::http::run` serves them: the first
//! request with a key runs the handler, a retry while it runs gets `409`
//! with `Retry-After`, a retry after it gets the stored answer with
//! `Idempotent-Replayed: true` (handler not run), the key on another body
//! `422`; each response converts back into Lambda's answer.

use http_body_util::BodyExt;
use idem_core::{Idempotency, MemoryStore};
use idem_lambda::http::{Body, IdempotencyLayer, Request, service, service_fn};
use idem_testkit::Runs;
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::Semaphore;
use tower::ServiceExt;

fn v2_event(key: &str, body: &str) -> String {
    serde_json::json!({
        "version": "2.0",
        "routeKey": "POST /payments",
        "rawPath": "/payments",
        "rawQueryString": "",
        "headers": {
            "content-type": "application/json",
            "idempotency-key": key,
            "host": "abc123.execute-api.us-east-1.amazonaws.com"
        },
        "requestContext": {
            "accountId": "123456789012",
            "apiId": "abc123",
            "domainName": "abc123.execute-api.us-east-1.amazonaws.com",
            "domainPrefix": "abc123",
            "http": {
                "method": "POST",
                "path": "/payments",
                "protocol": "HTTP/1.1",
                "sourceIp": "192.0.2.1",
                "userAgent": "curl/8"
            },
            "requestId": "req-1",
            "routeKey": "POST /payments",
            "stage": "$default",
            "time": "28/Nov/2026:21:00:00 +0000",
            "timeEpoch": 1_795_900_000_000_u64
        },
        "body": body,
        "isBase64Encoded": false
    })
    .to_string()
}

fn v1_event(key: &str, body: &str) -> String {
    serde_json::json!({
        "resource": "/payments",
        "path": "/payments",
        "httpMethod": "POST",
        "headers": {
            "Content-Type": "application/json",
            "Idempotency-Key": key,
            "Host": "abc123.execute-api.us-east-1.amazonaws.com"
        },
        "multiValueHeaders": {
            "Content-Type": ["application/json"],
            "Idempotency-Key": [key],
            "Host": ["abc123.execute-api.us-east-1.amazonaws.com"]
        },
        "queryStringParameters": null,
        "multiValueQueryStringParameters": null,
        "pathParameters": null,
        "stageVariables": null,
        "requestContext": {
            "accountId": "123456789012",
            "resourceId": "res1",
            "stage": "prod",
            "requestId": "req-1",
            "identity": { "sourceIp": "192.0.2.1" },
            "resourcePath": "/payments",
            "httpMethod": "POST",
            "apiId": "abc123",
            "path": "/prod/payments"
        },
        "body": body,
        "isBase64Encoded": false
    })
    .to_string()
}

/// A payments handler that counts its runs and, while `gate` has no
/// permit, waits for one (a request still running).
fn payments(
    runs: Arc<Runs>,
    gate: Arc<Semaphore>,
) -> impl tower_service::Service<
    Request,
    Response = http::Response<Body>,
    Error = Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    service_fn(move |req: Request| {
        let (runs, gate) = (Arc::clone(&runs), Arc::clone(&gate));
        async move {
            runs.record();
            let _permit = gate.acquire().await.unwrap();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let amount: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let answer = serde_json::json!({ "id": format!("pay-{}", runs.get()), "amount": amount["amount"] });
            Ok::<_, Infallible>(
                http::Response::builder()
                    .status(201)
                    .header("content-type", "application/json")
                    .body(Body::from(answer.to_string()))
                    .unwrap(),
            )
        }
    })
}

async fn text(resp: http::Response<Body>) -> (http::StatusCode, http::HeaderMap, String) {
    // Through lambda_http's conversion into Lambda's answer.
    let resp = lambda_http::IntoResponse::into_response(resp).await;
    let (parts, body) = resp.into_parts();
    let body = match body {
        lambda_http::Body::Text(t) => t,
        lambda_http::Body::Binary(b) => String::from_utf8(b).unwrap(),
        lambda_http::Body::Empty => String::new(),
        _ => unreachable!(),
    };
    (parts.status, parts.headers, body)
}

async fn replay_and_in_progress(make: fn(&str, &str) -> String) {
    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("api")
        .build();
    let runs = Arc::new(Runs::default());
    let gate = Arc::new(Semaphore::new(0));
    let layer = IdempotencyLayer::new(idem).require_key(true);
    let svc = service(&layer, payments(Arc::clone(&runs), Arc::clone(&gate)));
    let request = |key: &str, body: &str| lambda_http::request::from_str(&make(key, body)).unwrap();

    // The first request runs, and is held in its handler.
    let first = tokio::spawn(svc.clone().oneshot(request("k-1", r#"{"amount":500}"#)));
    idem_testkit::eventually(
        "the first request in its handler",
        std::time::Duration::from_secs(5),
        || async { (runs.get() == 1).then_some(()) },
    )
    .await;

    // A retry while it runs: 409 with Retry-After, handler not run.
    let busy = svc
        .clone()
        .oneshot(request("k-1", r#"{"amount":500}"#))
        .await
        .unwrap();
    let (status, headers, _) = text(busy).await;
    assert_eq!(status, 409);
    assert!(headers.contains_key("retry-after"));
    assert_eq!(runs.get(), 1);

    gate.add_permits(100);
    let (status, headers, body) = text(first.await.unwrap().unwrap()).await;
    assert_eq!(status, 201);
    assert!(!headers.contains_key("idempotent-replayed"));
    assert_eq!(body, r#"{"amount":500,"id":"pay-1"}"#);

    // A retry after it: the stored answer, replayed.
    let retry = svc
        .clone()
        .oneshot(request("k-1", r#"{"amount":500}"#))
        .await
        .unwrap();
    let (status, headers, replayed) = text(retry).await;
    assert_eq!((status.as_u16(), replayed.as_str()), (201, body.as_str()));
    assert_eq!(headers["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 1);

    // The key on another body: 422, handler not run.
    let reused = svc
        .clone()
        .oneshot(request("k-1", r#"{"amount":900}"#))
        .await
        .unwrap();
    assert_eq!(text(reused).await.0, 422);
    // No key: 400 (require_key).
    let mut no_key = request("k-2", "{}");
    no_key.headers_mut().remove("idempotency-key");
    assert_eq!(
        text(svc.clone().oneshot(no_key).await.unwrap()).await.0,
        400
    );
    assert_eq!(runs.get(), 1);
}

/// An API Gateway HTTP API (payload v2) event.
#[tokio::test]
async fn api_gateway_v2_events_replay_and_answer_in_progress() {
    replay_and_in_progress(v2_event).await;
}

/// An API Gateway REST API (payload v1) event.
#[tokio::test]
async fn api_gateway_v1_events_replay_and_answer_in_progress() {
    replay_and_in_progress(v1_event).await;
}

/// A request's claim lasts no longer than its invocation has left: with
/// the layer's lease at 60 s and the deadline 3 s ahead, the key in flight
/// holds at most 3 s of lease, so a request cut off by the function's
/// timeout frees its key then; an invocation without a deadline, or with
/// one in the past (cargo-lambda's emulator sends 1970), keeps the 60 s.
#[tokio::test]
async fn a_requests_lease_is_bounded_by_its_invocations_deadline() {
    use lambda_http::RequestExt;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    let idem = Idempotency::builder(MemoryStore::new())
        .namespace("api")
        .build();
    let layer = IdempotencyLayer::new(idem.clone()).lease(Duration::from_secs(60));
    let epoch_ms = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
    let cases = [
        (
            "ahead",
            Some(epoch_ms(SystemTime::now() + Duration::from_secs(3))),
        ),
        ("none", None),
        ("1970", Some(1_000)),
    ];
    for (name, deadline) in cases {
        let runs = Arc::new(Runs::default());
        let gate = Arc::new(Semaphore::new(0));
        let svc = service(&layer, payments(Arc::clone(&runs), Arc::clone(&gate)));
        let key = format!("k-{name}");
        let mut request =
            lambda_http::request::from_str(&v2_event(&key, r#"{"amount":1}"#)).unwrap();
        if let Some(deadline) = deadline {
            let mut ctx = lambda_runtime::Context::default();
            ctx.deadline = deadline;
            request = request.with_lambda_context(ctx);
        }
        let running = tokio::spawn(svc.oneshot(request));
        idem_testkit::eventually(
            "the request in its handler",
            Duration::from_secs(5),
            || async { (runs.get() == 1).then_some(()) },
        )
        .await;

        let info = idem.inspect("http", &key).await.unwrap().unwrap();
        let left = info.lease_left.unwrap();
        if name == "ahead" {
            assert!(
                left > Duration::ZERO && left <= Duration::from_secs(3),
                "{name}: {left:?} of lease left"
            );
        } else {
            assert!(
                left > Duration::from_secs(30),
                "{name}: {left:?} of lease left"
            );
        }

        gate.add_permits(1);
        assert_eq!(text(running.await.unwrap().unwrap()).await.0, 201, "{name}");
        assert_eq!(runs.get(), 1, "{name}");
    }
}
