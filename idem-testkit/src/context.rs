//! One test context: a private server, a store on it, idem over that store,
//! and a ledger of body runs — redis-rs's `TestContext`, for idem.

use std::fmt;
use std::sync::Arc;

use idem_core::store::Store;
use idem_core::{Idempotency, IdempotencyBuilder, MemoryStore};
use idem_dynamodb::DynamoStore;
use idem_postgres::{PgStore, PgStoreConfig};
use idem_redis::{RedisStore, RedisStoreConfig};
use std::time::Duration;

use crate::record::{RecordPeek, RecordState, record_state};
use crate::{DynamoTestTable, FaultProxy, Ledger, PgTestDb, RedisCluster, RedisServer};

/// A store that can hand out builders, whatever its concrete type.
trait SharedStore: Send + Sync {
    fn builder(&self) -> IdempotencyBuilder;
    fn as_store(&self) -> &dyn Store;
}

impl<S: Store + Clone> SharedStore for S {
    fn builder(&self) -> IdempotencyBuilder {
        Idempotency::builder(self.clone())
    }
    fn as_store(&self) -> &dyn Store {
        self
    }
}

/// What a test runs against: a store (on its own `redis-server`, its own
/// three-master cluster, its own PostgreSQL database, or in memory), idem
/// over it and a [`Ledger`].
///
/// Every context owns its servers, so tests run in parallel without sharing
/// keys; dropping the context kills them. Tests that hold for every
/// store take a context and run once per constructor; store-specific
/// helpers ([`TestContext::server`], [`TestContext::record`], ...) panic
/// with a clear message on a context without that store.
///
/// ```no_run
/// use idem_testkit::TestContext;
///
/// # async fn demo() {
/// for ctx in [TestContext::redis().await, TestContext::memory()] {
///     let idem = ctx.with_namespace("test").idem();
///     # let _ = idem;
/// }
/// # }
/// ```
pub struct TestContext {
    server: Option<RedisServer>,
    cluster: Option<RedisCluster>,
    proxy: Option<FaultProxy>,
    store: Arc<dyn SharedStore>,
    redis: Option<RedisStore>,
    // Declared before `pg_db`: the store's pool is the database's, and the
    // database is dropped (with FORCE) only after everything else.
    postgres: Option<PgStore>,
    config: RedisStoreConfig,
    namespace: Option<String>,
    ledger: Ledger,
    pg_db: Option<PgTestDb>,
    dynamodb: Option<DynamoStore>,
    // Last: the store is dropped before its table is deleted.
    dynamo_table: Option<DynamoTestTable>,
}

impl fmt::Debug for TestContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TestContext")
            .field("store", &self.name())
            .field("server", &self.server.as_ref().map(RedisServer::url))
            .field("cluster", &self.cluster.as_ref().map(RedisCluster::urls))
            .field("proxy", &self.proxy.as_ref().map(FaultProxy::url))
            .field("database", &self.pg_db.as_ref().map(|db| db.name.as_str()))
            .field("namespace", &self.namespace)
            .finish_non_exhaustive()
    }
}

impl TestContext {
    /// A fresh `redis-server` and a [`RedisStore`] connected to it with the
    /// default configuration.
    ///
    /// # Panics
    ///
    /// When Redis is not installed, does not start, or refuses the store.
    pub async fn redis() -> TestContext {
        TestContext::redis_with(RedisServer::start(), RedisStoreConfig::default()).await
    }

    /// A [`RedisStore`] with `config`, connected straight to `server` (for
    /// a server started with arguments, e.g. `--maxmemory`).
    ///
    /// # Panics
    ///
    /// When the store cannot connect.
    pub async fn redis_with(server: RedisServer, config: RedisStoreConfig) -> TestContext {
        let store = connect(&server.url(), &config).await;
        TestContext::over_redis(server, None, store, config)
    }

    /// A [`RedisStore`] with `config` that reaches `server` through a
    /// [`FaultProxy`] (see [`TestContext::proxy`]), to inject faults between
    /// idem and Redis. [`TestContext::connect_direct`] gives stores that
    /// bypass the proxy.
    ///
    /// # Panics
    ///
    /// When the store cannot connect.
    pub async fn redis_behind_proxy(server: RedisServer, config: RedisStoreConfig) -> TestContext {
        let proxy = FaultProxy::start(server.addr());
        let store = connect(&proxy.url(), &config).await;
        TestContext::over_redis(server, Some(proxy), store, config)
    }

    fn over_redis(
        server: RedisServer,
        proxy: Option<FaultProxy>,
        store: RedisStore,
        config: RedisStoreConfig,
    ) -> TestContext {
        TestContext {
            server: Some(server),
            cluster: None,
            proxy,
            store: Arc::new(store.clone()),
            redis: Some(store),
            postgres: None,
            config,
            namespace: None,
            ledger: Ledger::new(),
            pg_db: None,
            dynamodb: None,
            dynamo_table: None,
        }
    }

    /// A fresh three-master [`RedisCluster`] and a [`RedisStore`] connected
    /// to it with the default configuration.
    ///
    /// # Panics
    ///
    /// When Redis is not installed, the cluster does not form, or the store
    /// cannot connect.
    pub async fn redis_cluster() -> TestContext {
        TestContext::redis_cluster_with(RedisCluster::start(), RedisStoreConfig::default()).await
    }

    /// A [`RedisStore`] with `config`, connected to `cluster`.
    ///
    /// # Panics
    ///
    /// When the store cannot connect.
    pub async fn redis_cluster_with(
        cluster: RedisCluster,
        config: RedisStoreConfig,
    ) -> TestContext {
        let store = connect_cluster(&cluster, &config).await;
        TestContext {
            server: None,
            cluster: Some(cluster),
            proxy: None,
            store: Arc::new(store.clone()),
            redis: Some(store),
            postgres: None,
            config,
            namespace: None,
            ledger: Ledger::new(),
            pg_db: None,
            dynamodb: None,
            dynamo_table: None,
        }
    }

    /// An empty [`MemoryStore`]: no server.
    pub fn memory() -> TestContext {
        TestContext {
            server: None,
            cluster: None,
            proxy: None,
            store: Arc::new(MemoryStore::new()),
            redis: None,
            postgres: None,
            config: RedisStoreConfig::default(),
            namespace: None,
            ledger: Ledger::new(),
            pg_db: None,
            dynamodb: None,
            dynamo_table: None,
        }
    }

    /// A fresh database of its own on the test PostgreSQL server (see
    /// [`PgTestDb`]) and a migrated [`PgStore`] over its pool. Dropping the
    /// context drops the database.
    ///
    /// # Panics
    ///
    /// When PostgreSQL is not reachable (the message says how to provide
    /// one) or the schema cannot be created.
    pub async fn postgres() -> TestContext {
        TestContext::postgres_with(PgStoreConfig::default()).await
    }

    /// As [`postgres`](TestContext::postgres), with the tables partitioned
    /// by the second (`PgStoreConfig::partitioned`): a test's rows of one
    /// key land in several partitions, and after the few seconds that
    /// `migrate` creates partitions for, in the default one.
    ///
    /// # Panics
    ///
    /// As [`postgres`](TestContext::postgres).
    pub async fn postgres_partitioned() -> TestContext {
        TestContext::postgres_with(PgStoreConfig::default().partitioned(Duration::from_secs(1)))
            .await
    }

    async fn postgres_with(config: PgStoreConfig) -> TestContext {
        let db = PgTestDb::new().await;
        let store = PgStore::from_pool_with(db.pool.clone(), config)
            .unwrap_or_else(|e| panic!("idem-testkit: {e}"));
        store.migrate().await.unwrap_or_else(|e| {
            panic!(
                "idem-testkit: cannot create idem's table in {}: {e}",
                db.name
            )
        });
        TestContext {
            server: None,
            cluster: None,
            proxy: None,
            store: Arc::new(store.clone()),
            redis: None,
            postgres: Some(store),
            config: RedisStoreConfig::default(),
            namespace: None,
            ledger: Ledger::new(),
            pg_db: Some(db),
            dynamodb: None,
            dynamo_table: None,
        }
    }

    /// A DynamoDB table of its own on the local AWS endpoint
    /// ([`DynamoTestTable`], deleted with the context) and a
    /// [`DynamoStore`] on it.
    ///
    /// # Panics
    ///
    /// When the endpoint is unreachable (the message says how to start
    /// one) or the table cannot be created.
    pub async fn dynamodb() -> TestContext {
        let (table, store) = DynamoTestTable::create().await;
        TestContext {
            server: None,
            cluster: None,
            proxy: None,
            store: Arc::new(store.clone()),
            redis: None,
            postgres: None,
            config: RedisStoreConfig::default(),
            namespace: None,
            ledger: Ledger::new(),
            pg_db: None,
            dynamodb: Some(store),
            dynamo_table: Some(table),
        }
    }

    /// The [`DynamoStore`].
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::dynamodb`].
    pub fn dynamo_store(&self) -> &DynamoStore {
        self.dynamodb
            .as_ref()
            .unwrap_or_else(|| panic!("idem-testkit: a {} context has no DynamoStore", self.name()))
    }

    /// The context's own DynamoDB table (to read its items beside the
    /// store).
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::dynamodb`].
    pub fn dynamo_table(&self) -> &DynamoTestTable {
        self.dynamo_table.as_ref().unwrap_or_else(|| {
            panic!(
                "idem-testkit: a {} context has no DynamoDB table",
                self.name()
            )
        })
    }

    /// Sets the namespace of every builder this context makes (by default,
    /// idem's own default namespace).
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> TestContext {
        self.namespace = Some(namespace.into());
        self
    }

    /// `"redis"`, `"cluster"`, `"postgres"`, `"dynamodb"` or `"memory"`,
    /// for assertion messages.
    pub fn name(&self) -> &'static str {
        if self.dynamodb.is_some() {
            return "dynamodb";
        }
        match (&self.cluster, &self.redis, &self.postgres) {
            (Some(_), _, _) => "cluster",
            (None, Some(_), _) => "redis",
            (None, None, Some(_)) => "postgres",
            (None, None, None) => "memory",
        }
    }

    /// A new builder over this context's store, with its namespace.
    pub fn builder(&self) -> IdempotencyBuilder {
        let builder = self.store.builder();
        match &self.namespace {
            Some(ns) => builder.namespace(ns.as_str()),
            None => builder,
        }
    }

    /// An `Idempotency` over this context's store with the defaults.
    pub fn idem(&self) -> Idempotency {
        self.builder().build()
    }

    /// An `Idempotency` over this context's store, configured by `f`.
    pub fn idem_with(
        &self,
        f: impl FnOnce(IdempotencyBuilder) -> IdempotencyBuilder,
    ) -> Idempotency {
        f(self.builder()).build()
    }

    /// The store, for tests of the [`Store`] trait itself.
    pub fn store(&self) -> &dyn Store {
        self.store.as_store()
    }

    /// The ledger of this context, for bodies to record their runs in.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The [`RedisStore`].
    ///
    /// # Panics
    ///
    /// On a memory context.
    pub fn redis_store(&self) -> &RedisStore {
        self.redis
            .as_ref()
            .unwrap_or_else(|| panic!("idem-testkit: a memory context has no RedisStore"))
    }

    /// The [`PgStore`].
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::postgres`].
    pub fn pg_store(&self) -> &PgStore {
        self.postgres
            .as_ref()
            .unwrap_or_else(|| panic!("idem-testkit: a {} context has no PgStore", self.name()))
    }

    /// The context's own database (to read its rows, or run SQL beside
    /// the store).
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::postgres`].
    pub fn pg_db(&self) -> &PgTestDb {
        self.pg_db
            .as_ref()
            .unwrap_or_else(|| panic!("idem-testkit: a {} context has no database", self.name()))
    }

    /// The server.
    ///
    /// # Panics
    ///
    /// On a memory or cluster context.
    pub fn server(&self) -> &RedisServer {
        self.server.as_ref().unwrap_or_else(|| {
            panic!(
                "idem-testkit: a {} context has no single server",
                self.name()
            )
        })
    }

    /// The server, to kill or restart it.
    ///
    /// # Panics
    ///
    /// On a memory or cluster context.
    pub fn server_mut(&mut self) -> &mut RedisServer {
        let name = self.name();
        self.server
            .as_mut()
            .unwrap_or_else(|| panic!("idem-testkit: a {name} context has no single server"))
    }

    /// The cluster.
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::redis_cluster`] or
    /// [`TestContext::redis_cluster_with`].
    pub fn cluster(&self) -> &RedisCluster {
        self.cluster
            .as_ref()
            .unwrap_or_else(|| panic!("idem-testkit: a {} context has no cluster", self.name()))
    }

    /// The proxy between the store and the server.
    ///
    /// # Panics
    ///
    /// Unless the context was made by [`TestContext::redis_behind_proxy`].
    pub fn proxy(&self) -> &FaultProxy {
        self.proxy.as_ref().unwrap_or_else(|| {
            panic!("idem-testkit: this context has no proxy (use TestContext::redis_behind_proxy)")
        })
    }

    /// A new [`RedisStore`] (its own connections) with this context's
    /// configuration, reaching the server or cluster the way the context's
    /// store does (through the proxy, if there is one).
    ///
    /// # Panics
    ///
    /// On a memory context, or when it cannot connect.
    pub async fn connect(&self) -> RedisStore {
        if let Some(cluster) = &self.cluster {
            return connect_cluster(cluster, &self.config).await;
        }
        let url = match &self.proxy {
            Some(proxy) => proxy.url(),
            None => self.server().url(),
        };
        connect(&url, &self.config).await
    }

    /// A new [`RedisStore`] with this context's configuration, connected
    /// straight to the server (past any proxy).
    ///
    /// # Panics
    ///
    /// On a memory or cluster context, or when it cannot connect.
    pub async fn connect_direct(&self) -> RedisStore {
        connect(&self.server().url(), &self.config).await
    }

    /// The raw record under the full Redis key `key`, read on the server
    /// directly (on a cluster, on the node that owns the key's slot).
    ///
    /// # Panics
    ///
    /// On a memory context (records are Redis's), or when the server does
    /// not answer.
    pub fn record(&self, key: &str) -> Option<Vec<u8>> {
        match &self.cluster {
            Some(cluster) => cluster.record(key),
            None => self.server().record(key),
        }
    }

    /// The state of the record under the full Redis key `key`.
    ///
    /// # Panics
    ///
    /// As [`TestContext::record`].
    pub fn record_state(&self, key: &str) -> Option<RecordState> {
        record_state(self.record(key).as_deref())
    }

    /// An async connection straight to the server, for reading records
    /// from async code and while the store's connection is faulted.
    ///
    /// # Panics
    ///
    /// On a memory or cluster context, or when the server cannot be reached.
    pub async fn peek(&self) -> RecordPeek {
        RecordPeek::connect(self.server()).await
    }

    /// The number of keys on the server (`DBSIZE`).
    ///
    /// # Panics
    ///
    /// On a memory or cluster context, or when the server does not answer.
    pub fn dbsize(&self) -> i64 {
        redis::cmd("DBSIZE")
            .query(&mut self.server().connection())
            .unwrap_or_else(|e| panic!("idem-testkit: DBSIZE: {e}"))
    }
}

async fn connect_cluster(cluster: &RedisCluster, config: &RedisStoreConfig) -> RedisStore {
    let urls = cluster.urls();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    RedisStore::connect_cluster_with(&urls, config.clone())
        .await
        .unwrap_or_else(|e| panic!("idem-testkit: cannot connect a RedisStore to {urls:?}: {e}"))
}

async fn connect(url: &str, config: &RedisStoreConfig) -> RedisStore {
    RedisStore::connect_with(url, config.clone())
        .await
        .unwrap_or_else(|e| panic!("idem-testkit: cannot connect a RedisStore to {url}: {e}"))
}
