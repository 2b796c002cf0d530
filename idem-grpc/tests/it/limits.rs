//! Replies the runtime cannot store: a reply whose record would be over the
//! runtime's `max_value_size` is answered once and then refused as not
//! kept, never answered `INTERNAL` on every retry.

use crate::support::{CREATE_PAYMENT, TestServer, padded_payment, slug, with_key};
use idem_grpc::IdempotencyLayer;
use idem_testkit::TestContext;
use tonic::Code;

/// A reply under `max_response_bytes` but whose stored record would be over
/// the runtime's 64 KiB value limit reaches the first caller whole; a retry
/// gets `FAILED_PRECONDITION` (`response-not-kept`) and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_over_the_runtimes_value_limit_is_answered_once_then_not_kept() {
    let ctx = TestContext::redis()
        .await
        .with_namespace("grpc-value-limit");
    let idem = ctx.idem_with(|b| b.max_value_size(64 * 1024));
    let server = TestServer::start(
        IdempotencyLayer::new(idem).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let first = client
        .create_payment(with_key(padded_payment(1, 100 * 1024), "v-1"))
        .await
        .unwrap();
    assert_eq!(first.get_ref().run, 1);
    assert!(first.get_ref().id.len() > 100 * 1024);
    for _ in 0..2 {
        let s = client
            .create_payment(with_key(padded_payment(1, 100 * 1024), "v-1"))
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
        assert_eq!(slug(&s).as_deref(), Some("response-not-kept"));
    }
    assert_eq!(server.ledger.count("v-1"), 1);
}

/// With `max_response_bytes(4 MiB)` and the runtime's default 4 MiB value
/// limit, a 3.5 MiB reply (4.7 MiB once base64 in the record) is answered
/// once; retries get `response-not-kept`, and the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_within_max_response_bytes_but_over_the_default_value_limit_is_not_kept() {
    let ctx = TestContext::redis()
        .await
        .with_namespace("grpc-value-default");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .max_response_bytes(4 * 1024 * 1024),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let pad = 3 * 1024 * 1024 + 512 * 1024;
    let first = client
        .create_payment(with_key(padded_payment(1, pad), "v-2"))
        .await
        .unwrap();
    assert_eq!(first.get_ref().run, 1);
    assert!(first.get_ref().id.len() > pad);
    let s = client
        .create_payment(with_key(padded_payment(1, pad), "v-2"))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::FailedPrecondition, "{s:?}");
    assert_eq!(slug(&s).as_deref(), Some("response-not-kept"));
    assert_eq!(server.ledger.count("v-2"), 1);
}
