//! What a key is: its syntax, its scope (method, path, route layers, tenant,
//! credentials) and a key reused for another request; over real sockets and
//! a real Redis, with exact handler counts.

use crate::support::{Counters, Harness, PROBLEM_BASE, idem_over, pay, send, serve, wait_until};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::routing::{get, post};
use axum::{Extension, Router};
use idem_core::Idempotency;
use idem_http::{IdempotencyKey, IdempotencyLayer};
use idem_testkit::RedisServer;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quoted_and_bare_keys_are_the_same_key() {
    let h = Harness::start(|l| l).await;
    let first = send(h.post("/pay", "abc-1")).await;
    let quoted = send(h.post("/pay", "\"abc-1\"")).await;
    assert!(!first.replayed());
    assert!(quoted.replayed());
    assert_eq!(quoted.body, first.body);

    let first = send(h.post("/pay", r#""a\"b\\c""#)).await;
    let bare = send(h.post("/pay", r#"a"b\c"#)).await;
    assert!(!first.replayed());
    assert!(bare.replayed());
    assert_eq!(bare.body, first.body);
    assert_eq!(h.runs(), 2);

    // The handler sees the unquoted key.
    let echo = send(h.post("/key", "\"with space\"")).await;
    assert_eq!(&echo.body[..], b"key=with space");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_keys_are_400() {
    let h = Harness::start(|l| l).await;
    let long = "k".repeat(256);
    let bad: Vec<HeaderValue> = vec![
        HeaderValue::from_static("\"\""),
        HeaderValue::from_str(&long).unwrap(),
        HeaderValue::from_static(r#""a\nb""#),
        HeaderValue::from_static("\"unterminated"),
        HeaderValue::from_static("\"a\";param=1"),
        HeaderValue::from_static("two words"),
        HeaderValue::from_bytes(b"cl\xc3\xa9").unwrap(),
        HeaderValue::from_bytes(b"a\tb").unwrap(),
    ];
    for value in bad {
        let a = send(
            h.http
                .post(format!("{}/pay", h.url))
                .header("idempotency-key", value.clone())
                .body("{}"),
        )
        .await;
        a.assert_problem(400, "invalid-key");
    }
    // The header twice.
    let a = send(
        h.http
            .post(format!("{}/pay", h.url))
            .header("idempotency-key", "a")
            .header("idempotency-key", "b")
            .body("{}"),
    )
    .await;
    a.assert_problem(400, "invalid-key");
    // 255 bytes is fine.
    let ok = send(h.post("/pay", &"k".repeat(255))).await;
    assert_eq!(ok.status, StatusCode::CREATED);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_key_is_400_when_required_and_passes_through_otherwise() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let app = Router::new()
        .route(
            "/required",
            post(pay).layer(
                IdempotencyLayer::new(idem.clone())
                    .require_key(true)
                    .problem_type_base(PROBLEM_BASE),
            ),
        )
        .route("/optional", post(pay).layer(IdempotencyLayer::new(idem)))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();

    let a = send(http.post(format!("{url}/required")).body("{}")).await;
    a.assert_problem(400, "missing-key");
    assert_eq!(c.runs(), 0);

    for n in 1..=2 {
        let a = send(http.post(format!("{url}/optional")).body("{}")).await;
        assert_eq!(a.status, StatusCode::CREATED);
        assert!(!a.replayed());
        assert_eq!(a.header("x-payment-id"), Some(n.to_string().as_str()));
    }
    assert_eq!(c.runs(), 2);

    // With a key, the required route is idempotent.
    for _ in 0..2 {
        let a = send(
            http.post(format!("{url}/required"))
                .header("idempotency-key", "r")
                .body("{}"),
        )
        .await;
        assert_eq!(a.status, StatusCode::CREATED);
    }
    assert_eq!(c.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_with_another_request_is_422() {
    let h = Harness::start(|l| l).await;
    let first = send(h.post("/pay", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED);

    let other_body = send(h.post("/pay", "k").body(r#"{"amount":501}"#)).await;
    other_body.assert_problem(422, "key-reused");
    let other_path = send(h.post("/pay2", "k")).await;
    other_path.assert_problem(422, "key-reused");
    let other_query = send(h.post("/pay?currency=EUR", "k")).await;
    other_query.assert_problem(422, "key-reused");
    let other_method = send(
        h.http
            .patch(format!("{}/pay", h.url))
            .header("idempotency-key", "k")
            .body(r#"{"amount":500}"#),
    )
    .await;
    other_method.assert_problem(422, "key-reused");

    // While in flight too.
    let slow = tokio::spawn(send(h.post("/slow", "k2").header("x-sleep-ms", "800")));
    wait_until("the slow request runs", || h.runs() == 2).await;
    let mismatch = send(h.post("/slow", "k2").body("other")).await;
    mismatch.assert_problem(422, "key-reused");
    slow.await.expect("slow request");

    assert!(send(h.post("/pay", "k")).await.replayed());
    assert_eq!(h.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_methods_pass_through() {
    let h = Harness::start(|l| l).await;
    for n in 1..=2 {
        let get = send(
            h.http
                .get(format!("{}/pay", h.url))
                .header("idempotency-key", "g"),
        )
        .await;
        assert_eq!(get.header("x-payment-id"), Some(n.to_string().as_str()));
        assert!(!get.replayed());
    }
    for _ in 0..2 {
        let put = send(
            h.http
                .put(format!("{}/pay", h.url))
                .header("idempotency-key", "\""),
        )
        .await;
        assert_eq!(
            put.status,
            StatusCode::CREATED,
            "PUT is not checked, even with a bad key"
        );
    }
    assert_eq!(h.runs(), 4);
    // PATCH is covered by default.
    let patch = || {
        h.http
            .patch(format!("{}/pay", h.url))
            .header("idempotency-key", "p")
            .body("{}")
    };
    send(patch()).await;
    assert!(send(patch()).await.replayed());
    assert_eq!(h.runs(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_are_configurable() {
    let h = Harness::start(|l| l.methods([Method::PUT])).await;
    let put = || {
        h.http
            .put(format!("{}/pay", h.url))
            .header("idempotency-key", "m")
            .body("{}")
    };
    send(put()).await;
    assert!(send(put()).await.replayed());
    assert_eq!(h.runs(), 1);
    send(h.post("/pay", "m")).await;
    assert!(!send(h.post("/pay", "m")).await.replayed());
    assert_eq!(h.runs(), 3);
}

#[tokio::test]
async fn the_key_reaches_the_handler() {
    let idem = Idempotency::builder(idem_core::MemoryStore::new()).build();
    let app = Router::new()
        .route(
            "/",
            post(|Extension(k): Extension<IdempotencyKey>| async move { k.as_str().to_owned() }),
        )
        .route("/get", get(|| async { "get" }))
        .layer(IdempotencyLayer::new(idem));
    let url = serve(app).await;
    let a = send(
        reqwest::Client::new()
            .post(format!("{url}/"))
            .header("idempotency-key", "\"x y\""),
    )
    .await;
    assert_eq!(&a.body[..], b"x y");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outer_layer_and_a_route_layer_combine() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let app = Router::new()
        .route(
            "/required",
            post(pay).layer(
                IdempotencyLayer::new(idem.clone())
                    .require_key(true)
                    .problem_type_base(PROBLEM_BASE),
            ),
        )
        .route("/optional", post(pay))
        .layer(IdempotencyLayer::new(idem))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();

    send(http.post(format!("{url}/required")).body("{}"))
        .await
        .assert_problem(400, "missing-key");
    let with_key = || {
        http.post(format!("{url}/required"))
            .header("idempotency-key", "both")
            .body("{}")
    };
    let first = send(with_key()).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "not a 409 from the inner layer"
    );
    assert!(send(with_key()).await.replayed());
    let optional = send(http.post(format!("{url}/optional")).body("{}")).await;
    assert_eq!(optional.status, StatusCode::CREATED);
    assert_eq!(c.runs(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nested_routers_fingerprint_the_full_path() {
    let redis = RedisServer::start();
    let idem = idem_over(&redis).await;
    let c = Counters::default();
    let versioned = |idem: Idempotency| {
        Router::new()
            .route("/pay", post(pay))
            .layer(IdempotencyLayer::new(idem).problem_type_base(PROBLEM_BASE))
    };
    let app = Router::new()
        .nest("/v1", versioned(idem.clone()))
        .nest("/v2", versioned(idem))
        .with_state(c.clone());
    let url = serve(app).await;
    let http = reqwest::Client::new();
    let at = |path: &str| {
        http.post(format!("{url}{path}"))
            .header("idempotency-key", "nested")
            .body("{}")
    };
    assert_eq!(send(at("/v1/pay")).await.status, StatusCode::CREATED);
    send(at("/v2/pay")).await.assert_problem(422, "key-reused");
    assert!(send(at("/v1/pay")).await.replayed());
    assert_eq!(c.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_never_sends_a_key_the_server_refuses() {
    let h = Harness::start(|l| l).await;
    let client = idem_client::Client::builder(&h.url)
        .retry(idem_client::RetryPolicy::no_retries())
        .build()
        .unwrap();
    let mut keys: Vec<String> = [
        "a",
        "a b",
        " a ",
        " a",
        "a ",
        "\"",
        "\"abc",
        "abc\"",
        "a\"b",
        "a\\b",
        "\\",
        "\"\"",
        "~!#$%&'()*+,-./:;<=>?@[]^_`{|}",
        "a;b=1",
        "",
        " ",
        "   ",
        "\t",
        "a\tb",
        "a\nb",
        "\u{7f}",
        "caf\u{e9}",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    keys.push("k".repeat(255));
    keys.push("k".repeat(256));
    keys.push(" ".repeat(254) + "x");
    for b in 0x20u8..=0x7e {
        keys.push(format!("x{}y", char::from(b)));
    }
    let mut sent = 0;
    for key in &keys {
        let answer = client
            .post_with_key::<_, serde_json::Value>("/key-json", key, &serde_json::json!({}))
            .await;
        match answer {
            Ok(r) => {
                sent += 1;
                assert_eq!(r.value["key"], key.as_str(), "the server read {key:?} back");
            }
            Err(e) if matches!(e.kind(), idem_client::ClientErrorKind::InvalidKey { .. }) => {
                // Refused by the client: the server refuses every form of it as well.
                for form in [
                    key.clone(),
                    format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\"")),
                ] {
                    let Ok(value) = HeaderValue::from_str(&form) else {
                        continue; // not even a header value
                    };
                    let a = send(
                        h.http
                            .post(format!("{}/key-json", h.url))
                            .header("idempotency-key", value)
                            .body("{}"),
                    )
                    .await;
                    if a.status.is_success() {
                        assert_ne!(
                            a.json()["key"],
                            key.as_str(),
                            "{form:?} accepted as {key:?}"
                        );
                    } else {
                        a.assert_problem(400, "invalid-key");
                    }
                }
            }
            Err(e) => panic!("{key:?}: {e}"),
        }
    }
    assert_eq!(h.runs(), sent);
    assert!(sent > 90, "{sent}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_have_separate_key_spaces() {
    let h = Harness::start(|l| {
        l.tenant(|parts: &axum::http::request::Parts| {
            Some(parts.headers.get("x-tenant")?.to_str().ok()?.to_owned())
        })
    })
    .await;
    let as_tenant = |t: &str| h.post("/pay", "shared-key").header("x-tenant", t);

    let a = send(as_tenant("acme")).await;
    let b = send(as_tenant("globex")).await;
    let colon = send(as_tenant("acme:x")).await;
    let none = send(h.post("/pay", "shared-key")).await;
    for (answer, id) in [(&a, "1"), (&b, "2"), (&colon, "3"), (&none, "4")] {
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed());
        assert_eq!(answer.header("x-payment-id"), Some(id));
    }
    let a2 = send(as_tenant("acme")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    let none2 = send(h.post("/pay", "shared-key")).await;
    assert_eq!(none2.body, none.body);
    assert_eq!(h.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_isolated_per_credential_by_default() {
    let h = Harness::start(|l| l).await;
    let as_ = |who: &str, key: &str, body: &'static str| {
        h.post("/pay", key)
            .header("authorization", format!("Bearer {who}"))
            .body(body)
    };
    // B uses the key first, with its own body: A's request is not a 422.
    let b_other = send(as_("b", "shared", r#"{"amount":1}"#)).await;
    let a = send(as_("a", "shared", r#"{"amount":500}"#)).await;
    assert_eq!(b_other.status, StatusCode::CREATED);
    assert_eq!(a.status, StatusCode::CREATED);
    assert!(!a.replayed());
    // A's key and body from B never replay A's response (and its Location-like headers).
    let a2 = send(as_("a", "k2", r#"{"amount":7}"#)).await;
    let b2 = send(as_("b", "k2", r#"{"amount":7}"#)).await;
    assert!(!b2.replayed());
    assert_ne!(b2.header("x-payment-id"), a2.header("x-payment-id"));
    // Each principal's retries replay its own responses.
    for (who, key, body, first) in [
        ("a", "shared", r#"{"amount":500}"#, &a),
        ("b", "shared", r#"{"amount":1}"#, &b_other),
        ("a", "k2", r#"{"amount":7}"#, &a2),
        ("b", "k2", r#"{"amount":7}"#, &b2),
    ] {
        let again = send(as_(who, key, body)).await;
        assert!(again.replayed(), "{who} {key}");
        assert_eq!(again.body, first.body, "{who} {key}");
        assert_eq!(again.header("x-payment-id"), first.header("x-payment-id"));
    }
    assert_eq!(h.runs(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_keys_are_an_explicit_opt_in() {
    let h = Harness::start(|l| l.shared_keys()).await;
    let a = send(h.post("/pay", "s").header("authorization", "Bearer a")).await;
    let b = send(h.post("/pay", "s").header("authorization", "Bearer b")).await;
    assert!(b.replayed());
    assert_eq!(b.body, a.body);
    assert_eq!(h.runs(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_refusals_are_never_stored() {
    // One key space for all, so that a fixed request would meet the refused one's key.
    let h = Harness::start(|l| l.shared_keys()).await;
    let refused = send(h.post("/guarded", "g-401")).await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    let forbidden = send(
        h.post("/guarded", "g-403")
            .header("authorization", "Bearer bad"),
    )
    .await;
    assert_eq!(forbidden.status, StatusCode::FORBIDDEN);
    // Neither refusal was stored: the client that fixes its credentials gets a fresh answer.
    assert!(h.key_is_free("g-401").await);
    assert!(h.key_is_free("g-403").await);
    let ok = send(
        h.post("/guarded", "g-ok")
            .header("authorization", "Bearer good"),
    )
    .await;
    assert_eq!(ok.status, StatusCode::CREATED);
    let again = send(
        h.post("/guarded", "g-ok")
            .header("authorization", "Bearer good"),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.body, ok.body);
    assert_eq!(h.runs(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credential_headers_are_configurable() {
    let h = Harness::start(|l| {
        l.tenant_from_headers([axum::http::HeaderName::from_static("x-api-key")])
    })
    .await;
    let with = |api_key: &str, auth: &str| {
        h.post("/pay", "k")
            .header("x-api-key", api_key)
            .header("authorization", auth)
    };
    let a = send(with("key-a", "Bearer 1")).await;
    let b = send(with("key-b", "Bearer 1")).await;
    assert!(!b.replayed(), "another API key is another key space");
    // Authorization no longer counts: same API key, same space.
    let a2 = send(with("key-a", "Bearer 2")).await;
    assert!(a2.replayed());
    assert_eq!(a2.body, a.body);
    assert_eq!(h.runs(), 2);
}
