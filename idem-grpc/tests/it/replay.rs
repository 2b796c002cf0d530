//! Replays: byte for byte (initial metadata, message, status, trailers),
//! error statuses only when opted in, and a key reused with another message.

use crate::support::{CREATE_PAYMENT, TestServer, payment, slug, with_key};
use idem_grpc::IdempotencyLayer;
use idem_testkit::TestContext;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_gets_the_first_answer_byte_for_byte() {
    let ctx = TestContext::redis().await.with_namespace("grpc-replay");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    let md = [("idempotency-key", "r-1")];
    let first = raw.call(CREATE_PAYMENT, &md, &payment(700)).await;
    assert_eq!(first.grpc_status().as_deref(), Some("0"));
    assert!(!first.replayed());
    assert_eq!(first.headers["x-run"], "1");
    for _ in 0..3 {
        let again = raw.call(CREATE_PAYMENT, &md, &payment(700)).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "message bytes");
        assert_eq!(again.trailers, first.trailers, "status and trailers");
        assert_eq!(again.comparable_headers(), first.comparable_headers());
    }
    assert_eq!(server.ledger.count("r-1"), 1);
    assert_eq!(first.payment().amount_cents, 700);

    // tonic's own client sees the same reply, and the replay mark.
    let mut client = server.client().await;
    let r = client
        .create_payment(with_key(payment(700), "r-1"))
        .await
        .unwrap();
    assert_eq!(r.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(r.metadata().get("x-run").unwrap(), "1");
    assert_eq!(r.get_ref().run, 1);
    assert_eq!(server.ledger.count("r-1"), 1);
}

/// Trailing metadata a handler sets on an `OK` reply (a response extension
/// moved into the trailers by a layer inside the idempotency layer) is
/// stored and replayed; a replay has a `date` of its own and a
/// `content-length` of its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trailing_metadata_of_an_ok_reply_is_replayed() {
    let ctx = TestContext::redis().await.with_namespace("grpc-trailing");
    let server = TestServer::start_with_trailing(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    let md = [("idempotency-key", "tr-1")];
    let mut m = payment(5);
    m.currency = "trailing".into();
    let first = raw.call(CREATE_PAYMENT, &md, &m).await;
    assert_eq!(first.trailers["grpc-status"], "0");
    assert_eq!(first.trailers["x-trailing-run"], "1", "{first:?}");
    let again = raw.call(CREATE_PAYMENT, &md, &m).await;
    assert!(again.replayed());
    assert_eq!(again.trailers, first.trailers);
    assert!(again.headers.contains_key("date"));
    assert_eq!(
        again.headers["content-length"],
        again.body.len().to_string().as_str()
    );
    // tonic's client merges the trailers into the reply's metadata.
    let mut client = server.client().await;
    let r = client.create_payment(with_key(m, "tr-1")).await.unwrap();
    assert_eq!(r.metadata().get("x-trailing-run").unwrap(), "1");
    assert_eq!(server.ledger.count("tr-1"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_statuses_release_the_key_unless_opted_in_and_then_replay_exactly() {
    let ctx = TestContext::redis().await.with_namespace("grpc-errors");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .store_error_codes([Code::FailedPrecondition]),
        ctx.ledger().clone(),
    )
    .await;
    let raw = server.raw();
    // UNAVAILABLE from the handler: not stored, the retry runs it again.
    let mut m = payment(1);
    m.fail_code = Code::Unavailable as i32;
    for run in 1..=2 {
        let a = raw
            .call(CREATE_PAYMENT, &[("idempotency-key", "e-1")], &m)
            .await;
        assert_eq!(a.grpc_status().as_deref(), Some("14"));
        assert!(!a.replayed());
        assert_eq!(a.headers["x-run"], run.to_string().as_str());
    }
    assert_eq!(server.ledger.count("e-1"), 2);

    // FAILED_PRECONDITION, opted in: stored, replayed exactly.
    m.fail_code = Code::FailedPrecondition as i32;
    let first = raw
        .call(CREATE_PAYMENT, &[("idempotency-key", "e-2")], &m)
        .await;
    assert_eq!(first.grpc_status().as_deref(), Some("9"));
    assert_eq!(first.headers["grpc-message"], "declined%20(run%201)");
    let again = raw
        .call(CREATE_PAYMENT, &[("idempotency-key", "e-2")], &m)
        .await;
    assert!(again.replayed());
    assert_eq!(again.comparable_headers(), first.comparable_headers());
    assert_eq!(again.body, first.body);
    assert_eq!(again.trailers, first.trailers);
    assert_eq!(server.ledger.count("e-2"), 1);

    let mut client = server.client().await;
    let status = client
        .create_payment(with_key(m.clone(), "e-2"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "declined (run 1)");
    assert_eq!(
        slug(&status),
        None,
        "the handler's own status, not a refusal"
    );
    assert_eq!(server.ledger.count("e-2"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_message_is_failed_precondition() {
    let ctx = TestContext::redis().await.with_namespace("grpc-reuse");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    client
        .create_payment(with_key(payment(100), "m-1"))
        .await
        .unwrap();
    let status = client
        .create_payment(with_key(payment(200), "m-1"))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(slug(&status).as_deref(), Some("key-reused"));
    assert!(status.message().contains("use a new key"), "{status:?}");
    assert_eq!(server.ledger.count("m-1"), 1);
    // The original still replays.
    let r = client
        .create_payment(with_key(payment(100), "m-1"))
        .await
        .unwrap();
    assert_eq!(r.get_ref().amount_cents, 100);
    assert_eq!(server.ledger.count("m-1"), 1);
}
