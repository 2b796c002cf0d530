use idem::{idempotent, Idempotency, MemoryStore};

#[derive(Debug)]
pub struct AppError;

impl From<idem::Error> for AppError {
    fn from(_: idem::Error) -> Self {
        AppError
    }
}

pub type AppResult<T> = Result<T, AppError>;
pub type Answer = std::result::Result<u32, AppError>;

mod app {
    // An alias spelled `Result` with one parameter, like `io::Result`.
    pub type Result<T> = std::result::Result<T, super::AppError>;
}

#[idempotent(key = id, using = idem)]
pub async fn one(idem: &Idempotency, id: u32) -> AppResult<u32> {
    Ok(id)
}

#[idempotent(key = id, using = idem)]
pub async fn two(idem: &Idempotency, id: u32) -> Answer {
    Ok(id)
}

#[idempotent(key = id, using = idem)]
pub async fn three(idem: &Idempotency, id: u32) -> app::Result<u32> {
    Ok(id)
}

#[idempotent(key = id, using = idem)]
pub async fn four(idem: &Idempotency, id: u32) -> Result<u32, idem::Error> {
    Ok(id)
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let idem = Idempotency::builder(MemoryStore::new()).build();
    assert_eq!(one(&idem, 1).await.unwrap(), 1);
    assert_eq!(two(&idem, 2).await.unwrap(), 2);
    assert_eq!(three(&idem, 3).await.unwrap(), 3);
    assert_eq!(four(&idem, 4).await.unwrap(), 4);
}
