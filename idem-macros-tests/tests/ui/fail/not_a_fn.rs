use idem::idempotent;

#[idempotent(key = id)]
pub struct Charge {
    pub id: u64,
}

pub trait Payments {
    #[idempotent(key = id)]
    async fn charge(&self, id: u64) -> Result<u64, idem::Error>;
}

fn main() {}
