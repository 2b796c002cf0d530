//! Failures: the store down (fail closed, and open when configured), a
//! client that goes away mid-call, a panicking handler.

use crate::support::{CREATE_PAYMENT, TestServer, payment, slug, with_key};
use idem_core::FailMode;
use idem_grpc::IdempotencyLayer;
use idem_testkit::{TestContext, eventually};
use std::time::Duration;
use tonic::Code;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_is_unavailable_and_the_handler_does_not_run() {
    let mut ctx = TestContext::redis().await.with_namespace("grpc-down");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    client
        .create_payment(with_key(payment(1), "before"))
        .await
        .unwrap();

    ctx.server_mut().kill();
    for key in ["during-1", "during-2", "before"] {
        let status = client
            .create_payment(with_key(payment(1), key))
            .await
            .unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert_eq!(slug(&status).as_deref(), Some("store-unavailable"));
        assert_eq!(
            status.metadata().get("grpc-retry-pushback-ms").unwrap(),
            "1000"
        );
    }
    assert_eq!(
        server.ledger.total(),
        1,
        "fail-closed: nothing ran while the store was down"
    );

    // Back (empty): calls run again once the store reconnects.
    ctx.server_mut().restart();
    eventually("the store is back", Duration::from_secs(30), || {
        let mut client = client.clone();
        async move {
            match client.create_payment(with_key(payment(1), "after")).await {
                Ok(_) => Some(()),
                Err(s) if s.code() == Code::Unavailable => None,
                Err(s) => panic!("unexpected {s:?}"),
            }
        }
    })
    .await;
    assert_eq!(server.ledger.count("after"), 1);
    let r = client
        .create_payment(with_key(payment(1), "after"))
        .await
        .unwrap();
    assert_eq!(r.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(server.ledger.count("after"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_with_fail_open_runs_the_handler_unprotected() {
    let mut ctx = TestContext::redis().await.with_namespace("grpc-open");
    let idem = ctx.builder().fail_mode(FailMode::Open).build();
    let server = TestServer::start(
        IdempotencyLayer::new(idem).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    ctx.server_mut().kill();
    for run in 1..=2u64 {
        let r = client
            .create_payment(with_key(payment(1), "open"))
            .await
            .unwrap();
        assert_eq!(
            r.get_ref().run,
            run,
            "each call runs: nothing can be remembered"
        );
        assert!(r.metadata().get("idempotent-replayed").is_none());
    }
    assert_eq!(server.ledger.count("open"), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_mid_call_does_not_stop_the_handler_and_its_answer_is_stored() {
    let ctx = TestContext::redis().await.with_namespace("grpc-gone");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut slow = payment(42);
    slow.sleep_ms = 1_500;
    {
        let mut client = server.client().await;
        let call = client.create_payment(with_key(slow.clone(), "gone"));
        // The client gives up (its deadline) while the handler runs.
        let r = tokio::time::timeout(Duration::from_millis(300), call).await;
        assert!(r.is_err(), "the call was cut short");
    }
    eventually("the answer is stored", Duration::from_secs(30), || async {
        ctx.record_state("grpc-gone:/idem.test.v1.Payments/CreatePayment:gone")
            .filter(|s| s.is_completed())
    })
    .await;
    let mut client = server.client().await;
    let r = client.create_payment(with_key(slow, "gone")).await.unwrap();
    assert_eq!(r.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!((r.get_ref().run, r.get_ref().amount_cents), (1, 42));
    assert_eq!(server.ledger.count("gone"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_internal_and_releases_the_key() {
    let ctx = TestContext::redis().await.with_namespace("grpc-panic");
    let server = TestServer::start(
        IdempotencyLayer::new(ctx.idem()).unary(CREATE_PAYMENT),
        ctx.ledger().clone(),
    )
    .await;
    let mut client = server.client().await;
    let mut m = payment(5);
    m.panic = true;
    let status = client.create_payment(with_key(m, "p")).await.unwrap_err();
    assert_eq!(status.code(), Code::Internal);
    assert_eq!(slug(&status).as_deref(), Some("handler-panicked"));
    // Released: the retry (without the panic switch, so another message,
    // but the key is free, so no mismatch) runs.
    let r = client
        .create_payment(with_key(payment(5), "p"))
        .await
        .unwrap();
    assert_eq!(r.get_ref().run, 2);
    assert_eq!(server.ledger.count("p"), 2);
}
