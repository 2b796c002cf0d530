//! The client side against a real server: one key, resent on every retry,
//! through ABORTED (key in flight) and UNAVAILABLE (store down).

use crate::support::{CREATE_PAYMENT, TestServer, payment};
use idem_grpc::IdempotencyLayer;
use idem_grpc::client::{CallErrorKind, Operation, RetryPolicy};
use idem_testkit::{TestContext, eventually};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering::SeqCst};
use std::time::Duration;

fn patient() -> RetryPolicy {
    RetryPolicy::default()
        .max_retries(200)
        .initial_backoff(Duration::from_millis(100))
        .max_backoff(Duration::from_millis(500))
        .deadline(Duration::from_secs(120))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_aborted_gets_the_first_calls_answer() {
    let ctx = TestContext::redis().await.with_namespace("grpc-client");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .retry_after(Duration::from_millis(200)),
        ctx.ledger().clone(),
    )
    .await;
    let op = Operation::with_key("c-1").unwrap().retry(patient());
    let mut slow = payment(900);
    slow.sleep_ms = 5_000;
    // Someone else's attempt with this key is in flight.
    let first = {
        let mut client = server.client().await;
        let req = op.request(slow.clone());
        tokio::spawn(async move { client.create_payment(req).await })
    };
    eventually("the first call runs", Duration::from_secs(30), || async {
        (server.ledger.count("c-1") == 1).then_some(())
    })
    .await;
    let client = server.client().await;
    let attempts = AtomicU32::new(0);
    let reply = op
        .call(|| {
            attempts.fetch_add(1, SeqCst);
            let mut client = client.clone();
            let req = op.request(slow.clone());
            async move { client.create_payment(req).await }
        })
        .await
        .unwrap();
    assert!(reply.replayed);
    assert!(
        reply.attempts >= 2,
        "the first attempt met the call in flight"
    );
    assert_eq!(reply.attempts, attempts.load(SeqCst));
    assert_eq!(reply.response.get_ref().run, 1);
    assert_eq!(first.await.unwrap().unwrap().get_ref().run, 1);
    assert_eq!(server.ledger.count("c-1"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_through_a_store_outage_runs_once() {
    let mut ctx = TestContext::redis()
        .await
        .with_namespace("grpc-client-down");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem())
            .unary(CREATE_PAYMENT)
            .retry_after(Duration::from_millis(200)),
        ctx.ledger().clone(),
    )
    .await;
    ctx.server_mut().kill();
    let op = Arc::new(Operation::new().retry(patient()));
    let attempts = Arc::new(AtomicU32::new(0));
    let call = {
        let (op, attempts, client) = (op.clone(), attempts.clone(), server.client().await);
        tokio::spawn(async move {
            op.call(|| {
                let mut client = client.clone();
                let req = op.request(payment(5));
                let refused = attempts.clone();
                async move {
                    let r = client.create_payment(req).await;
                    if r.as_ref()
                        .is_err_and(|s| s.code() == tonic::Code::Unavailable)
                    {
                        refused.fetch_add(1, SeqCst);
                    }
                    r
                }
            })
            .await
        })
    };
    eventually(
        "an attempt met the outage",
        Duration::from_secs(30),
        || async { (attempts.load(SeqCst) >= 1).then_some(()) },
    )
    .await;
    ctx.server_mut().restart();
    let reply = call.await.unwrap().unwrap();
    assert!(reply.attempts >= 2);
    assert!(!reply.replayed);
    assert_eq!(server.ledger.count(op.key()), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_is_final_and_not_retried() {
    let ctx = TestContext::redis()
        .await
        .with_namespace("grpc-client-final");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let client = server.client().await;
    let op = Operation::new().retry(patient());
    let send = |amount| {
        let mut client = client.clone();
        let req = op.request(payment(amount));
        async move { client.create_payment(req).await }
    };
    op.call(|| send(1)).await.unwrap();
    let err = op.call(|| send(2)).await.unwrap_err();
    assert_eq!(err.kind(), CallErrorKind::Refused);
    assert_eq!(err.attempts(), 1);
    assert_eq!(err.status().code(), tonic::Code::FailedPrecondition);
    assert!(err.to_string().contains(op.key()), "{err}");
}
