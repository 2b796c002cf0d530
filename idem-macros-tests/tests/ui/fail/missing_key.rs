use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(ttl = "1h")]
pub async fn charge(id: u64) -> Result<u64, Error> {
    Ok(id)
}

#[idempotent]
pub async fn refund(id: u64) -> Result<u64, Error> {
    Ok(id)
}

fn main() {}
