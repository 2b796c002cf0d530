//! `RedisStoreConfig`: timeouts and reconnection.

use std::time::Duration;

/// Timeouts and reconnection for [`RedisStore`](crate::RedisStore).
///
/// ```
/// use idem_redis::RedisStoreConfig;
/// use std::time::Duration;
/// let cfg = RedisStoreConfig::default().response_timeout(Duration::from_millis(250));
/// assert_eq!(cfg.get_response_timeout(), Duration::from_millis(250));
/// ```
#[derive(Debug, Clone)]
pub struct RedisStoreConfig {
    pub(super) connection_timeout: Duration,
    pub(super) response_timeout: Duration,
    pub(super) reconnect_retries: usize,
}

impl Default for RedisStoreConfig {
    fn default() -> Self {
        RedisStoreConfig {
            connection_timeout: Duration::from_secs(1),
            response_timeout: Duration::from_secs(1),
            reconnect_retries: 1,
        }
    }
}

impl RedisStoreConfig {
    /// How long to wait for a TCP connection (default 1 s).
    ///
    /// ```
    /// let c = idem_redis::RedisStoreConfig::default().connection_timeout(std::time::Duration::from_secs(2));
    /// assert_eq!(c.get_connection_timeout().as_secs(), 2);
    /// ```
    pub fn connection_timeout(mut self, d: Duration) -> Self {
        self.connection_timeout = d;
        self
    }

    /// How long to wait for one reply (default 1 s). A timed-out claim may
    /// still have landed; idem re-sends it with the same owner token, which
    /// the script answers as the same claim.
    ///
    /// A durable call's round trip (its write, the fence and the `WAIT` or
    /// `WAITAOF` of its `idem_core::Durability`) is bounded by this
    /// timeout **plus** the durability's timeout: the server holds the
    /// reply for up to the durability's timeout, and this one is the
    /// margin for the network and the server. Past the sum the round trip
    /// counts as unanswered (`Error::Unavailable`, whose reason says "the
    /// response timeout plus the durability timeout"): a claim is re-sent
    /// with the same token, a result's complete retried for up to half a
    /// lease, as for any unreachable store. A store made with
    /// [`from_manager`](crate::RedisStore::from_manager) or
    /// [`from_cluster`](crate::RedisStore::from_cluster) uses the default,
    /// 1 s, for that margin; the response timeout of the connection you
    /// gave it, if it has one, must leave room for the wait too.
    ///
    /// ```
    /// let c = idem_redis::RedisStoreConfig::default().response_timeout(std::time::Duration::from_millis(300));
    /// assert_eq!(c.get_response_timeout().as_millis(), 300);
    /// ```
    pub fn response_timeout(mut self, d: Duration) -> Self {
        self.response_timeout = d;
        self
    }

    /// How many reconnection attempts follow a dropped connection before a
    /// request fails (default 1; idem re-sends claims itself).
    ///
    /// ```
    /// let c = idem_redis::RedisStoreConfig::default().reconnect_retries(5);
    /// assert_eq!(c.get_reconnect_retries(), 5);
    /// ```
    pub fn reconnect_retries(mut self, n: usize) -> Self {
        self.reconnect_retries = n;
        self
    }

    /// The connection timeout.
    ///
    /// ```
    /// assert_eq!(idem_redis::RedisStoreConfig::default().get_connection_timeout().as_secs(), 1);
    /// ```
    pub fn get_connection_timeout(&self) -> Duration {
        self.connection_timeout
    }

    /// The response timeout.
    ///
    /// ```
    /// assert_eq!(idem_redis::RedisStoreConfig::default().get_response_timeout().as_secs(), 1);
    /// ```
    pub fn get_response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// The reconnection attempts.
    ///
    /// ```
    /// assert_eq!(idem_redis::RedisStoreConfig::default().get_reconnect_retries(), 1);
    /// ```
    pub fn get_reconnect_retries(&self) -> usize {
        self.reconnect_retries
    }
}
