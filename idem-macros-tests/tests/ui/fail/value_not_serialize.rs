use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

pub struct Receipt {
    pub id: u64,
}

#[idempotent(key = id)]
pub async fn charge(id: u64) -> Result<Receipt, Error> {
    Ok(Receipt { id })
}

fn main() {}
