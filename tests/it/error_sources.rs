//! idem's errors keep their cause: the message says what to do, and
//! `source()` leads to the driver's or decoder's own error, to match on.

use idem::{Error, Idempotency, MemoryStore, RedisStore};
use std::error::Error as _;

/// The first error in `e`'s chain of causes that is a `T`.
fn cause<T: std::error::Error + 'static>(e: &Error) -> Option<&T> {
    let mut next = e.source();
    while let Some(s) = next {
        if let Some(t) = s.downcast_ref::<T>() {
            return Some(t);
        }
        next = s.source();
    }
    None
}

/// A port on this machine that nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn an_unreachable_redis_leads_to_the_redis_error() {
    let url = format!("redis://127.0.0.1:{}/", closed_port());
    let Err(e) = RedisStore::connect(&url).await else {
        panic!("connected to a closed port")
    };
    assert!(matches!(e, Error::Unavailable { op: "connect", .. }), "{e}");
    assert!(e.to_string().contains("check that Redis is up"), "{e}");
    let redis = cause::<redis::RedisError>(&e).expect("the redis-rs error is the source");
    assert!(
        redis.is_io_error() || redis.is_connection_refusal(),
        "{redis:?}"
    );
}

#[tokio::test]
async fn a_stored_value_of_another_type_leads_to_the_serde_json_error() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    let first: Result<String, Error> = idem
        .call("s", "k")
        .run(|| async { Ok("text".to_owned()) })
        .await;
    assert_eq!(first.unwrap(), "text");
    let again: Result<u32, Error> = idem.call("s", "k").run(|| async { Ok(1) }).await;
    let e = again.unwrap_err();
    assert!(matches!(e, Error::Codec { .. }), "{e}");
    assert!(e.to_string().contains("change the scope"), "{e}");
    let json = cause::<serde_json::Error>(&e).expect("the serde_json error is the source");
    assert!(json.is_data(), "{json:?}");
}
