//! A PostgreSQL store's errors keep the driver's: `source()` leads from
//! idem's `Error` to the `sqlx::Error`, to match on.

use idem_core::Error;
use idem_postgres::PgStore;
use std::error::Error as _;

#[tokio::test]
async fn an_unreachable_database_leads_to_the_sqlx_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("postgres://postgres@127.0.0.1:{port}/idem");
    let Err(e) = PgStore::connect(&url).await else {
        panic!("connected to a closed port")
    };
    assert!(matches!(e, Error::Unavailable { .. }), "{e}");
    let source = e.source().expect("a source");
    let sqlx = source
        .downcast_ref::<sqlx::Error>()
        .expect("the sqlx error is the source");
    assert!(
        matches!(sqlx, sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut),
        "{sqlx:?}"
    );
}
