//! `every_store!`: one test body, a `#[tokio::test]` per store.

/// Runs each listed `async fn(TestContext)` against the listed stores: a
/// module per test, holding one `#[tokio::test]` (multi-thread, 2 workers)
/// per store, each given a fresh [`TestContext`](crate::TestContext) with
/// the namespace. Stores: `redis`, `cluster`, `postgres`,
/// `postgres_partitioned`, `dynamodb` (a table of its own on the local AWS
/// endpoint), `memory`.
///
/// ```ignore
/// idem_testkit::every_store!(namespace = "steps", stores = [redis, cluster, postgres, memory];
///     steps_run_once_then_the_result_replays,
///     a_failed_step_resumes_at_that_step,
/// );
/// ```
#[macro_export]
macro_rules! every_store {
    (namespace = $ns:literal, stores = $stores:tt; $($name:ident),* $(,)?) => {
        $( $crate::every_store!(@test $ns, $name, $stores); )*
    };
    (@test $ns:literal, $name:ident, [$($store:ident),+ $(,)?]) => {
        mod $name {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $store() {
                    super::$name($crate::every_store!(@context $store).with_namespace($ns)).await;
                }
            )+
        }
    };
    (@context redis) => { $crate::TestContext::redis().await };
    (@context cluster) => { $crate::TestContext::redis_cluster().await };
    (@context postgres) => { $crate::TestContext::postgres().await };
    (@context postgres_partitioned) => { $crate::TestContext::postgres_partitioned().await };
    (@context memory) => { $crate::TestContext::memory() };
    (@context dynamodb) => { $crate::TestContext::dynamodb().await };
}
