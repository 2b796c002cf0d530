use idem::idempotent;

#[derive(Debug)]
pub struct Error;

impl From<idem::Error> for Error {
    fn from(_: idem::Error) -> Self {
        Error
    }
}

#[idempotent(key = id)]
pub async fn charge(id: u64) -> u64 {
    id
}

pub type Amount = Option<u64>;

#[idempotent(key = id)]
pub async fn amount(id: u64) -> Amount {
    Some(id)
}

#[idempotent(key = id)]
pub async fn nothing(id: u64) {
    let _ = id;
}

fn main() {}
