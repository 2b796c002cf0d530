use idem::{idempotent, Idempotency, MemoryStore};

#[derive(Debug)]
pub enum Error {
    Idem,
    Parse(std::num::ParseIntError),
    Negative,
}

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error::Idem
    }
}

impl From<std::num::ParseIntError> for Error {
    fn from(e: std::num::ParseIntError) -> Self {
        Error::Parse(e)
    }
}

#[idempotent(key = id, using = idem)]
pub async fn parse(idem: &Idempotency, id: u32, input: &str) -> Result<u32, Error> {
    if input.is_empty() {
        return Ok(0);
    }
    let n: i64 = input.parse()?;
    if n < 0 {
        return Err(Error::Negative);
    }
    let doubled = async { n * 2 }.await;
    Ok(doubled as u32)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    assert_eq!(parse(&idem, 1, "").await.unwrap(), 0);
    assert_eq!(parse(&idem, 2, "21").await.unwrap(), 42);
    assert!(matches!(parse(&idem, 3, "x").await, Err(Error::Parse(_))));
    assert!(matches!(parse(&idem, 4, "-1").await, Err(Error::Negative)));
}
