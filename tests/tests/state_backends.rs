//! One suite for both state backends: the local stores and Redis answer
//! every call of the plugins' state alike, and [`State`] applies the outage
//! rule in one place.

use levee::config::{RedisErrorRule, SharedStateConfig, StateBackend};
use levee::state::{Failure, LocalStore, PluginBounds, RedisState, State, Store, VectorEntry};
use levee_tests::RedisServer;
use std::sync::Arc;
use std::time::Duration;

fn redis_state(redis: &RedisServer, rule: RedisErrorRule) -> RedisState {
    let settings = SharedStateConfig {
        backend: StateBackend::Redis,
        redis_url: redis.url(),
        timeout_ms: 500,
        retry_interval_ms: 100,
        on_redis_error: rule,
        ..SharedStateConfig::default()
    };
    match RedisState::new(&settings) {
        Ok(state) => state,
        Err(e) => panic!("redis client: {e}"),
    }
}

/// A two-dimensional entry in plugin `p`'s namespace `cache`.
fn cache_entry() -> VectorEntry {
    VectorEntry {
        namespace: "p:cache".into(),
        vector: vec![1.0, 0.0],
        payload: b"hit".to_vec(),
        expires_unix_ms: 0,
        origin: "suite".into(),
    }
}

/// What every backend must do, run against `store`.
async fn suite(name: &str, store: &dyn Store) {
    // Key-value: set, get, overwrite, delete, expiry.
    assert_eq!(store.kv_get("p:missing").await, Ok(None), "{name}");
    store.kv_set("p:k", b"one", 0).await.unwrap();
    assert_eq!(store.kv_get("p:k").await, Ok(Some(b"one".to_vec())), "{name}");
    store.kv_set("p:k", b"two", 0).await.unwrap();
    assert_eq!(store.kv_get("p:k").await, Ok(Some(b"two".to_vec())), "{name}");
    store.kv_delete("p:k").await.unwrap();
    assert_eq!(store.kv_get("p:k").await, Ok(None), "{name}");
    store.kv_set("p:short", b"x", 50).await.unwrap();
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.kv_get("p:short").await, Ok(None), "{name}: a value outlived its TTL");

    // Increments are atomic and give a new key its TTL; a non-integer is the caller's error.
    assert_eq!(store.kv_incr("p:n", 5, 0).await, Ok(5), "{name}");
    assert_eq!(store.kv_incr("p:n", -2, 0).await, Ok(3), "{name}");
    let counts: Vec<_> = (0..20).map(|_| store.kv_incr("p:c", 1, 0)).collect();
    let mut seen: Vec<i64> = futures::future::join_all(counts).await.into_iter().map(Result::unwrap).collect();
    seen.sort();
    assert_eq!(seen, (1..=20).collect::<Vec<_>>(), "{name}: concurrent increments");
    assert_eq!(store.kv_incr("p:ttl", 1, 50).await, Ok(1), "{name}");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(store.kv_incr("p:ttl", 1, 50).await, Ok(1), "{name}: a new counter did not expire");
    store.kv_set("p:text", b"not a number", 0).await.unwrap();
    assert!(matches!(store.kv_incr("p:text", 1, 0).await, Err(Failure::Refused(_))), "{name}");

    // Token buckets: the capacity, then a refusal that says how long to wait; a refund.
    for _ in 0..3 {
        assert!(store.take("p:b", 3.0, 1.0, 1.0).await.unwrap().allowed, "{name}");
    }
    let refused = store.take("p:b", 3.0, 1.0, 1.0).await.unwrap();
    assert!(!refused.allowed, "{name}");
    assert!(refused.retry_after_secs > 0.5 && refused.retry_after_secs <= 1.0, "{name}: {refused:?}");
    assert!(store.take("p:b", 3.0, 1.0, -1.0).await.unwrap().allowed, "{name}: a refund");
    assert!(store.take("p:b", 3.0, 1.0, 1.0).await.unwrap().allowed, "{name}: the refunded token");
    // Another plugin's bucket of the same name is its own.
    assert!(store.take("q:b", 3.0, 1.0, 3.0).await.unwrap().allowed, "{name}");

    // Vectors are accepted (where they are searched is the State's business).
    store.vector_insert(&cache_entry()).await.unwrap();
}

#[tokio::test]
async fn the_local_stores_pass_the_suite() {
    suite("local", &LocalStore::default()).await;
}

#[tokio::test]
async fn redis_passes_the_suite() {
    let redis = RedisServer::start();
    suite("redis", &redis_state(&redis, RedisErrorRule::Open)).await;
}

#[tokio::test]
async fn the_outage_rule_is_applied_once_for_every_call() {
    let mut redis = RedisServer::start();
    let open = State::shared(Arc::new(redis_state(&redis, RedisErrorRule::Open)));
    let closed = State::shared(Arc::new(redis_state(&redis, RedisErrorRule::Closed)));
    open.kv_set("p:k", b"shared", 0).await.unwrap();
    assert_eq!(closed.kv_get("p:k").await.unwrap(), Some(b"shared".to_vec()), "both read the same Redis");
    redis.kill();
    // Open: every call is served by this replica's stores, and counted.
    open.kv_set("p:k", b"local", 0).await.unwrap();
    assert_eq!(open.kv_get("p:k").await.unwrap(), Some(b"local".to_vec()));
    assert_eq!(open.kv_incr("p:n", 1, 0).await.unwrap(), 1);
    assert!(open.take("p:b", 1.0, 0.0, 1.0).await.unwrap().allowed);
    assert!(open.rule_stats.fallbacks.load(std::sync::atomic::Ordering::Relaxed) >= 4);
    // Closed: every call fails and says why.
    for outcome in [
        closed.kv_get("p:k").await.map(|_| ()),
        closed.kv_set("p:k", b"x", 0).await,
        closed.kv_incr("p:n", 1, 0).await.map(|_| ()),
        closed.kv_delete("p:k").await,
        closed.take("p:b", 1.0, 0.0, 1.0).await.map(|_| ()),
    ] {
        assert!(outcome.unwrap_err().contains("shared state unavailable"));
    }
    // A vector entry: indexed here only under the open rule; the closed rule fails it and indexes nothing.
    let entry = cache_entry();
    open.vector_insert(&entry).await.unwrap();
    assert!(closed.vector_insert(&entry).await.unwrap_err().contains("shared state unavailable"));
    assert_eq!(open.local.vectors.search("p:cache", &[1.0, 0.0], 1, 0.0).unwrap().len(), 1);
    assert_eq!(closed.local.vectors.search("p:cache", &[1.0, 0.0], 1, 0.0).unwrap().len(), 0);
}

#[tokio::test]
async fn an_entry_a_replica_refuses_is_never_shared() {
    let redis = RedisServer::start();
    let state = Arc::new(State::shared(Arc::new(redis_state(&redis, RedisErrorRule::Open))));
    let follower = Arc::new(State::shared(Arc::new(redis_state(&redis, RedisErrorRule::Open))));
    for s in [&state, &follower] {
        s.local.set_plugin_bounds("p", PluginBounds { vector_bytes: 4096, ..PluginBounds::default() });
    }
    let caps = levee::capabilities::Capabilities::over(follower.clone());
    caps.start_sharing();
    // Over the plugin's vector bytes: refused here, so never published.
    let big = VectorEntry {
        namespace: "p:cache".into(),
        vector: vec![1.0; 2048],
        payload: Vec::new(),
        expires_unix_ms: 0,
        origin: "writer".into(),
    };
    assert!(state.vector_insert(&big).await.is_err());
    let small = VectorEntry { vector: vec![1.0, 0.0], payload: b"ok".to_vec(), ..big };
    state.vector_insert(&small).await.unwrap();
    // The follower indexes the accepted entry from the plugin's own stream, and only it.
    for _ in 0..100 {
        if follower.local.vectors.len("p:cache") > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let hits = follower.local.vectors.search("p:cache", &[1.0, 0.0], 10, 0.0).unwrap();
    assert_eq!(hits.len(), 1, "the follower indexed {} entries", hits.len());
    assert_eq!(hits[0].payload, b"ok");
}
