// Places an order in three steps. The e-mail fails the first time: the
// retry resumes at the e-mail, and the card is charged once. Cargo.toml:
// `idem = "0.1"`, `tokio = { version = "1", features = ["full"] }`.
use idem::{Idempotency, MemoryStore};

#[derive(Debug)]
#[allow(dead_code)] // the fields are shown through Debug
enum CheckoutError {
    Idem(idem::Error),
    MailDown,
}

impl From<idem::Error> for CheckoutError {
    fn from(e: idem::Error) -> Self {
        CheckoutError::Idem(e)
    }
}

#[tokio::main]
async fn main() {
    let idem = Idempotency::builder(MemoryStore::new()).build(); // or RedisStore, PgStore
    for attempt in 1..=2 {
        let result = idem
            .call("orders.place", "order-1")
            .run_steps_outcome(async |s| {
                let hold = s
                    .step("reserve", async || {
                        println!("  reserving stock");
                        Ok::<_, CheckoutError>("hold-1".to_owned())
                    })
                    .await?;
                // A key for the provider: the charge is once even if this step is cut short.
                let provider_key = s.key("charge");
                let charge = s
                    .step("charge", async || {
                        println!("  charging 42.00 EUR (provider key {provider_key})");
                        Ok::<_, CheckoutError>("ch_1".to_owned())
                    })
                    .await?;
                s.step("email", async || {
                    println!("  sending the receipt");
                    if attempt == 1 {
                        Err(CheckoutError::MailDown)
                    } else {
                        Ok(())
                    }
                })
                .await?;
                Ok::<_, CheckoutError>((hold, charge))
            })
            .await;
        // attempt 1: Err(MailDown); attempt 2: Ok((("hold-1", "ch_1"), Recovered)), no second charge
        println!("attempt {attempt}: {result:?}");
    }
}
