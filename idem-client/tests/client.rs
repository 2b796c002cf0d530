//! End-to-end tests over real sockets against scripted axum servers on 127.0.0.1.
//!
//! Timing assertions are lower bounds only.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "test code: a failed unwrap, index or assertion is a failed test, and a test may print"
)]

mod support;

use std::collections::{BTreeMap, HashSet};
use std::error::Error;
use std::time::Duration;

use http::{Method, StatusCode};
use idem_client::{Client, ClientError, ClientErrorKind, GiveUpReason, Response, RetryPolicy};
use serde::Deserialize;
use serde_json::json;
use support::{Reply, Server, unused_port};

#[derive(Debug, Deserialize, PartialEq)]
struct Receipt {
    id: String,
    cents: u64,
}

const RECEIPT: &str = r#"{"id":"r_1","cents":100}"#;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// Tiny backoffs so the suite stays fast.
fn fast() -> RetryPolicy {
    RetryPolicy::default()
        .max_retries(4)
        .initial_backoff(ms(20))
        .max_backoff(ms(200))
        .deadline(Duration::from_secs(10))
}

fn client(server: &Server, policy: RetryPolicy) -> Client {
    Client::builder(server.url())
        .retry(policy)
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

#[tokio::test]
async fn retries_503_503_then_201_with_one_key() {
    let server = Server::start(vec![
        Reply::problem(503, r#"{"title":"busy"}"#),
        Reply::status(503),
        Reply::json(201, RECEIPT),
    ])
    .await;
    let client = client(&server, fast());

    let r: Response<Receipt> = client
        .post("/payments", &json!({"cents": 100}))
        .await
        .unwrap();

    assert_eq!(r.attempts, 3);
    assert_eq!(r.status, StatusCode::CREATED);
    assert!(!r.replayed);
    assert_eq!(
        r.value,
        Receipt {
            id: "r_1".into(),
            cents: 100
        }
    );
    let uuid = uuid::Uuid::parse_str(&r.key).unwrap();
    assert_eq!(uuid.get_version_num(), 4);

    let seen = server.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.method, Method::POST);
        assert_eq!(s.path, "/payments");
        assert_eq!(
            s.key.as_deref(),
            Some(r.key.as_str()),
            "same key on every attempt"
        );
        assert_eq!(&s.body[..], br#"{"cents":100}"#);
        assert_eq!(s.headers["content-type"], "application/json");
    }
    // Equal jitter: the n-th delay is at least half its base (20 ms, 40 ms).
    assert!(seen[1].at - seen[0].at >= ms(10));
    assert!(seen[2].at - seen[1].at >= ms(20));
}

#[tokio::test]
async fn each_operation_gets_its_own_key() {
    let server = Server::start(vec![Reply::json(200, RECEIPT)]).await;
    let client = client(&server, fast());
    let a: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    let b: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_ne!(a.key, b.key);
    assert_eq!(a.attempts, 1);
}

#[tokio::test]
async fn retry_after_seconds_is_a_lower_bound() {
    let server = Server::start(vec![
        Reply::status(503).header("retry-after", "1"),
        Reply::json(201, RECEIPT),
    ])
    .await;
    let client = client(&server, fast().initial_backoff(ms(10)));

    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();

    assert_eq!(r.attempts, 2);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    let gap = seen[1].at - seen[0].at;
    assert!(gap >= ms(950), "Retry-After: 1 not honoured, gap {gap:?}");
}

#[tokio::test]
async fn retry_after_http_date_is_honoured() {
    let server = Server::start(vec![
        Reply::status(429).retry_after_date(Duration::from_secs(2)),
        Reply::json(200, RECEIPT),
    ])
    .await;
    let client = client(&server, fast().initial_backoff(ms(10)));

    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();

    assert_eq!(r.attempts, 2);
    let seen = server.seen();
    // The date has 1 s resolution, so "now + 2 s" is at least 1 s away.
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap >= ms(900),
        "HTTP-date Retry-After not honoured, gap {gap:?}"
    );
    assert_eq!(seen[0].key, seen[1].key);
}

#[tokio::test]
async fn retry_after_is_capped_by_max_retry_after() {
    let server = Server::start(vec![
        Reply::status(503).header("retry-after", "3600"),
        Reply::json(200, RECEIPT),
    ])
    .await;
    let client = client(&server, fast().max_retry_after(ms(50)));
    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_eq!(r.attempts, 2);
}

const KEY_REUSED: &str = r#"{
    "type": "https://idem.example/problems/key-reused",
    "title": "Idempotency key reused",
    "status": 422,
    "detail": "this key was first used with a different body",
    "instance": "/payments"
}"#;

#[tokio::test]
async fn no_retry_on_422_and_problem_is_parsed() {
    let server = Server::start(vec![
        Reply::problem(422, KEY_REUSED),
        Reply::json(201, RECEIPT),
    ])
    .await;
    let client = client(&server, fast());

    let err = client
        .post_with_key::<_, Receipt>("/payments", "order-7", &json!({"cents": 5}))
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 1, "422 must not be retried");
    assert_eq!(err.status(), Some(StatusCode::UNPROCESSABLE_ENTITY));
    assert_eq!(err.attempts(), Some(1));
    assert_eq!(err.key(), Some("order-7"));
    let problem = err.problem().expect("problem+json parsed");
    assert_eq!(problem.title.as_deref(), Some("Idempotency key reused"));
    assert_eq!(problem.status, Some(422));
    assert_eq!(
        problem.r#type.as_deref(),
        Some("https://idem.example/problems/key-reused")
    );
    assert_eq!(problem.extensions["instance"], "/payments");
    assert!(matches!(
        err.kind(),
        ClientErrorKind::Status {
            replayed: false,
            ..
        }
    ));

    let msg = err.to_string();
    assert!(
        msg.starts_with(
            "POST /payments failed with 422 Unprocessable Entity after 1 attempt (key order-7): \
             the key was reused with a different request body; send a new key"
        ),
        "{msg}"
    );
    assert!(msg.contains("Idempotency key reused"), "{msg}");
}

#[tokio::test]
async fn no_retry_on_400() {
    let server = Server::start(vec![
        Reply::problem(
            400,
            r#"{"title":"Bad Request","detail":"cents must be positive"}"#,
        ),
        Reply::json(201, RECEIPT),
    ])
    .await;
    let client = client(&server, fast());

    let err = client
        .post::<_, Receipt>("/payments", &json!({"cents": -1}))
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 1, "400 must not be retried");
    assert_eq!(err.status(), Some(StatusCode::BAD_REQUEST));
    assert_eq!(
        err.problem().and_then(|p| p.detail.as_deref()),
        Some("cents must be positive")
    );
    match err.kind() {
        ClientErrorKind::Status { body, .. } => {
            assert!(body.contains("cents must be positive"));
            assert_eq!(err.attempts(), Some(1));
        }
        other => panic!("expected Status, got {other:?}"),
    }
}

#[tokio::test]
async fn other_4xx_are_not_retried() {
    for code in [401, 403, 404, 408, 412] {
        let server = Server::start(vec![Reply::status(code), Reply::json(200, RECEIPT)]).await;
        let err = client(&server, fast())
            .post::<_, Receipt>("/payments", &json!({}))
            .await
            .unwrap_err();
        assert_eq!(server.seen().len(), 1, "{code} must not be retried");
        assert_eq!(err.status().map(|s| s.as_u16()), Some(code));
    }
}

#[tokio::test]
async fn plain_500_is_retried() {
    let server = Server::start(vec![Reply::status(500), Reply::json(201, RECEIPT)]).await;
    let client = client(&server, fast());
    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_eq!(r.attempts, 2);
    let seen = server.seen();
    assert_eq!(seen[0].key, seen[1].key);
}

#[tokio::test]
async fn replayed_500_is_final() {
    let server = Server::start(vec![
        Reply::json(500, r#"{"error":"card processor exploded"}"#)
            .header("idempotent-replayed", "true"),
        Reply::json(201, RECEIPT),
    ])
    .await;
    let client = client(&server, fast());

    let err = client
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 1, "a replayed 500 must not be retried");
    assert!(
        matches!(err.kind(), ClientErrorKind::Status { status, replayed: true, .. } if *status == StatusCode::INTERNAL_SERVER_ERROR)
            && err.attempts() == Some(1),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(msg.contains("send a new key"), "{msg}");
}

#[tokio::test]
async fn status_409_in_progress_is_retried() {
    let server = Server::start(vec![
        Reply::problem(409, r#"{"title":"in progress"}"#),
        Reply::status(409),
        Reply::json(200, RECEIPT),
    ])
    .await;
    let client = client(&server, fast());
    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_eq!(r.attempts, 3);
    let keys: HashSet<_> = server.seen().into_iter().map(|s| s.key).collect();
    assert_eq!(keys.len(), 1);
}

#[tokio::test]
async fn gateway_errors_are_retried() {
    let server = Server::start(vec![
        Reply::status(502),
        Reply::status(504),
        Reply::status(429),
        Reply::json(200, RECEIPT),
    ])
    .await;
    let r: Response<Receipt> = client(&server, fast())
        .post("/payments", &json!({}))
        .await
        .unwrap();
    assert_eq!(r.attempts, 4);
}

#[tokio::test]
async fn gives_up_after_the_retry_limit() {
    let server = Server::start(vec![Reply::problem(
        503,
        r#"{"title":"Service Unavailable","detail":"redis down"}"#,
    )])
    .await;
    let client = client(&server, fast().max_retries(2));

    let err = client
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 3);
    match err.kind() {
        ClientErrorKind::GaveUp { reason, last, .. } => {
            assert_eq!(err.attempts(), Some(3));
            assert_eq!(*reason, GiveUpReason::RetriesExhausted);
            assert!(matches!(last.kind(), ClientErrorKind::Status { .. }));
            assert_eq!(server.seen()[0].key.as_deref(), err.key());
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(
        err.problem().and_then(|p| p.detail.as_deref()),
        Some("redis down")
    );
    let msg = err.to_string();
    assert!(msg.contains("gave up after 3 attempts"), "{msg}");
    assert!(msg.contains("503 Service Unavailable"), "{msg}");
    assert!(msg.contains("same key"), "{msg}");
}

#[tokio::test]
async fn gives_up_when_the_deadline_would_pass() {
    let server = Server::start(vec![Reply::status(503).header("retry-after", "5")]).await;
    let client = client(&server, fast().deadline(ms(500)));

    let err = client
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();

    assert_eq!(server.seen().len(), 1);
    assert!(
        matches!(
            err.kind(),
            ClientErrorKind::GaveUp {
                reason: GiveUpReason::DeadlineExceeded,
                ..
            }
        ) && err.attempts() == Some(1),
        "{err:?}"
    );
}

#[tokio::test]
async fn reaches_a_server_that_starts_after_the_first_attempt() {
    let port = unused_port();
    let server = Server::new(vec![Reply::json(201, RECEIPT)]);
    let late = server.clone();
    tokio::spawn(async move {
        tokio::time::sleep(ms(300)).await;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        late.serve(listener);
    });
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .retry(
            RetryPolicy::default()
                .max_retries(50)
                .initial_backoff(ms(50))
                .max_backoff(ms(100))
                .deadline(Duration::from_secs(10)),
        )
        .build()
        .unwrap();

    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();

    assert!(r.attempts >= 2, "first attempt should have been refused");
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].key.as_deref(), Some(r.key.as_str()));
}

#[tokio::test]
async fn connection_refused_gives_up_with_transport_error() {
    let port = unused_port();
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .retry(fast().max_retries(1))
        .build()
        .unwrap();
    let err = client
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();
    match err.kind() {
        ClientErrorKind::GaveUp { last, .. } => {
            assert_eq!(err.attempts(), Some(2));
            assert!(
                matches!(last.kind(), ClientErrorKind::Transport { .. })
                    && last.attempts() == Some(2)
            );
        }
        other => panic!("expected GaveUp, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains("could not connect"), "{msg}");
}

#[tokio::test]
async fn source_leads_from_the_error_to_the_refused_connection() {
    let port = unused_port();
    let client = Client::builder(format!("http://127.0.0.1:{port}"))
        .retry(RetryPolicy::no_retries())
        .build()
        .unwrap();
    let err = client
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();

    // GaveUp -> the last attempt's ClientError -> reqwest -> ... -> io.
    let last = err.source().unwrap();
    let last = last.downcast_ref::<ClientError>().unwrap();
    assert!(
        matches!(last.kind(), ClientErrorKind::Transport { .. }),
        "{last:?}"
    );
    let transport = last.source().unwrap();
    let transport = transport.downcast_ref::<reqwest::Error>().unwrap();
    assert!(transport.is_connect(), "{transport:?}");
    let mut cause: Option<&(dyn Error + 'static)> = Some(transport);
    let mut refused = false;
    while let Some(c) = cause {
        refused |= c
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
        cause = c.source();
    }
    assert!(refused, "no io::Error ConnectionRefused under {err:?}");
}

#[tokio::test]
async fn slow_attempt_times_out_and_is_retried_with_the_same_key() {
    let server = Server::start(vec![
        Reply::json(200, RECEIPT).delay(Duration::from_secs(3)),
        Reply::json(200, RECEIPT),
    ])
    .await;
    let client = Client::builder(server.url())
        .retry(fast())
        .timeout(ms(200))
        .build()
        .unwrap();
    let r: Response<Receipt> = client.post("/payments", &json!({})).await.unwrap();
    assert_eq!(r.attempts, 2);
    let seen = server.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(seen[0].key, seen[1].key);
}

#[tokio::test]
async fn replayed_flag_and_caller_key_are_reported() {
    let server = Server::start(vec![
        Reply::json(201, RECEIPT).header("idempotent-replayed", "true"),
    ])
    .await;
    let client = client(&server, fast());

    let r: Response<Receipt> = client
        .post_with_key("/payments", "order-42", &json!({"cents": 100}))
        .await
        .unwrap();

    assert!(r.replayed);
    assert_eq!(r.key, "order-42");
    assert_eq!(r.attempts, 1);
    assert_eq!(server.seen()[0].key.as_deref(), Some("order-42"));
}

#[tokio::test]
async fn invalid_caller_keys_are_rejected_before_any_request() {
    let server = Server::start(vec![Reply::json(200, RECEIPT)]).await;
    let client = client(&server, fast());
    let too_long = "k".repeat(256);
    for key in [
        "",
        too_long.as_str(),
        "ab\u{1}cd",
        "tab\tkey",
        "new\nline",
        "   ",
        "caf\u{e9}",
    ] {
        let err = client
            .post_with_key::<_, Receipt>("/payments", key, &json!({}))
            .await
            .unwrap_err();
        assert!(
            matches!(err.kind(), ClientErrorKind::InvalidKey { .. }),
            "{key:?}: {err:?}"
        );
        assert_eq!(err.attempts(), None);
    }
    let err = client
        .request(Method::POST, "/payments")
        .header("Idempotency-Key", "")
        .send::<Receipt>()
        .await
        .unwrap_err();
    assert!(matches!(err.kind(), ClientErrorKind::InvalidKey { .. }));
    assert_eq!(server.seen().len(), 0, "nothing may be sent with a bad key");

    // The longest valid key goes through untouched.
    let longest = "k".repeat(255);
    let r: Response<Receipt> = client
        .patch_with_key("/payments/1", &longest, &json!({}))
        .await
        .unwrap();
    assert_eq!(r.key, longest);
    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, Method::PATCH);
    assert_eq!(seen[0].key.as_deref(), Some(longest.as_str()));
}

#[tokio::test]
async fn clones_share_one_connection_pool() {
    let server = Server::start(vec![Reply::json(200, RECEIPT)]).await;
    let first = client(&server, fast());
    let second = first.clone();
    for c in [&first, &second, &first, &second] {
        let _: Response<Receipt> = c.post("/payments", &json!({})).await.unwrap();
        // Let the connection go back to the idle pool.
        tokio::time::sleep(ms(50)).await;
    }
    let peers: HashSet<_> = server.seen().iter().map(|s| s.peer).collect();
    assert_eq!(peers.len(), 1, "clones should reuse one pooled connection");

    // Control: a separately built client has its own pool.
    let separate = client(&server, fast());
    let _: Response<Receipt> = separate.post("/payments", &json!({})).await.unwrap();
    let peers: HashSet<_> = server.seen().iter().map(|s| s.peer).collect();
    assert_eq!(peers.len(), 2);
}

#[tokio::test]
async fn request_builder_sends_method_headers_key_and_body() {
    let server = Server::start(vec![Reply::json(200, RECEIPT)]).await;
    let client = Client::builder(format!("{}/api/", server.url()))
        .retry(fast())
        .header("authorization", "Bearer x")
        .build()
        .unwrap();

    let r = client
        .request(Method::PUT, "/limits/7")
        .json(&json!({"daily": 500}))
        .key("limits-7")
        .header("x-trace", "t-1")
        .send::<Receipt>()
        .await
        .unwrap();
    assert_eq!(r.key, "limits-7");
    let _: Response<Receipt> = client.patch("orders/1", &json!({"s": 1})).await.unwrap();

    let seen = server.seen();
    assert_eq!(seen[0].method, Method::PUT);
    assert_eq!(seen[0].path, "/api/limits/7");
    assert_eq!(seen[0].key.as_deref(), Some("limits-7"));
    assert_eq!(seen[0].headers["x-trace"], "t-1");
    assert_eq!(&seen[0].body[..], br#"{"daily":500}"#);
    assert_eq!(seen[1].method, Method::PATCH);
    assert_eq!(seen[1].path, "/api/orders/1");
    assert!(seen[1].key.is_some());
    for s in &seen {
        assert_eq!(s.headers["authorization"], "Bearer x");
    }
}

#[tokio::test]
async fn undecodable_success_body_is_a_decode_error_not_retried() {
    let server = Server::start(vec![Reply::json(201, "not json")]).await;
    let err = client(&server, fast())
        .post::<_, Receipt>("/payments", &json!({}))
        .await
        .unwrap_err();
    assert_eq!(server.seen().len(), 1);
    assert!(
        matches!(err.kind(), ClientErrorKind::Decode { status, .. } if *status == StatusCode::CREATED)
            && err.attempts() == Some(1),
        "{err:?}"
    );
    assert!(err.to_string().contains("was applied"));
}

#[tokio::test]
async fn empty_success_body_decodes_as_unit() {
    let server = Server::start(vec![Reply::status(204)]).await;
    let r = client(&server, fast())
        .request(Method::DELETE, "/payments/1")
        .send::<()>()
        .await
        .unwrap();
    assert_eq!(r.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn unserializable_body_is_an_encode_error_and_nothing_is_sent() {
    let server = Server::start(vec![Reply::json(200, RECEIPT)]).await;
    let mut body = BTreeMap::new();
    body.insert(vec![1u8], 1u8); // JSON object keys must be strings
    let err = client(&server, fast())
        .post::<_, Receipt>("/payments", &body)
        .await
        .unwrap_err();
    assert!(
        matches!(err.kind(), ClientErrorKind::Encode { .. }),
        "{err:?}"
    );
    assert_eq!(server.seen().len(), 0);
}

#[test]
fn bad_configuration_is_a_build_error() {
    for base in [
        "not a url",
        "ftp://example.com",
        "http://h/?q=1",
        "/relative",
    ] {
        assert!(
            matches!(
                Client::builder(base)
                    .build()
                    .map_err(ClientError::into_parts),
                Err((ClientErrorKind::Build { .. }, _))
            ),
            "{base}"
        );
    }
    assert!(matches!(
        Client::builder("http://127.0.0.1:1")
            .header("bad name", "v")
            .build()
            .map_err(ClientError::into_parts),
        Err((ClientErrorKind::Build { .. }, _))
    ));
    assert!(matches!(
        Client::builder("http://127.0.0.1:1")
            .header("x-ok", "line\nbreak")
            .build()
            .map_err(ClientError::into_parts),
        Err((ClientErrorKind::Build { .. }, _))
    ));
    assert!(matches!(
        Client::builder("http://127.0.0.1:1")
            .header("idempotency-key", "fixed")
            .build()
            .map_err(ClientError::into_parts),
        Err((ClientErrorKind::Build { .. }, _))
    ));
}
