use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Payload {
    pub amount: u64,
}

#[idempotent(key = id, fingerprint = payload)]
pub async fn charge(id: u64, payload: Payload) -> Result<u64, Error> {
    Ok(id + payload.amount)
}

fn main() {}
