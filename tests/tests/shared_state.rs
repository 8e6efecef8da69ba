//! Replicas sharing state through one Redis: real `levee` processes with the
//! reference plugins, a real `redis-server` of the test's own.

use levee_tests::{RedisServer, Replica, exclusive, guests, metric};
use reqwest::Client;
use serde_json::json;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_levee-replica");
const KEY: &str = "key-alpha-0001";
const BETA: &str = "key-beta-0002";

fn shared(redis: &RedisServer, rule: &str) -> String {
    format!(
        "[shared-state]\nbackend = \"redis\"\nredis-url = \"{}\"\non-redis-error = \"{rule}\"\ntimeout-ms = 500\nretry-interval-ms = 200\n\n[[api-keys]]\nkey = \"{KEY}\"\ntenant = \"alpha\"\n\n[[api-keys]]\nkey = \"{BETA}\"\ntenant = \"beta\"\n",
        redis.url()
    )
}

fn rate_limit(rpm: u32, on_store_error: &str) -> String {
    format!(
        "[[plugins]]\nname = \"rate-limit\"\npath = {:?}\ntime-budget-ms = 2000\n[plugins.config]\nrequests-per-minute = {rpm}\non-store-error = \"{on_store_error}\"\n",
        guests::RATE_LIMIT
    )
}

/// Sends one tiny completion; returns the status and `Retry-After`.
async fn complete(http: &Client, replica: &Replica) -> (u16, Option<String>) {
    let response = http
        .post(replica.url("/v1/completions"))
        .bearer_auth(KEY)
        .json(&json!({ "prompt": "Hello", "max_tokens": 1, "temperature": 0 }))
        .send()
        .await
        .expect("request");
    let retry_after = response.headers().get("retry-after").map(|v| v.to_str().unwrap_or_default().to_string());
    (response.status().as_u16(), retry_after)
}

/// Alternates `n` requests over `replicas`; returns the admissions of each.
async fn alternate(http: &Client, replicas: &[&Replica], n: usize) -> Vec<usize> {
    let mut admitted = vec![0; replicas.len()];
    for i in 0..n {
        let (status, retry_after) = complete(http, replicas[i % replicas.len()]).await;
        match status {
            200 => admitted[i % replicas.len()] += 1,
            429 => {
                let secs: u64 = retry_after.expect("429 without Retry-After").parse().expect("Retry-After in seconds");
                assert!((1..=60).contains(&secs), "Retry-After {secs}");
            }
            other => panic!("request {i}: unexpected status {other}"),
        }
    }
    admitted
}

async fn metrics(http: &Client, replica: &Replica) -> String {
    http.get(replica.url("/metrics")).send().await.expect("metrics").text().await.expect("metrics text")
}

#[tokio::test]
async fn two_replicas_enforce_one_rate_limit_and_share_the_cache() {
    let _model = exclusive().await;
    let redis = RedisServer::start();
    let cache = format!(
        "[[plugins]]\nname = \"semantic-cache\"\npath = {:?}\ntime-budget-ms = 2000\n[plugins.config]\nthreshold = 0.85\n",
        guests::SEMANTIC_CACHE
    );
    let toml = format!("{}{}{}", shared(&redis, "open"), rate_limit(6, "allow"), cache);
    let a = Replica::start(BIN, &toml).await;
    let b = Replica::start(BIN, &toml).await;
    let http = Client::new();

    let admitted = alternate(&http, &[&a, &b], 12).await;
    let total: usize = admitted.iter().sum();
    println!("one limit of 6/min over two replicas: admitted {admitted:?}");
    assert!((6..=7).contains(&total), "two replicas admitted {total} against one limit of 6/min: {admitted:?}");
    assert!(admitted.iter().all(|&n| n > 0), "both replicas should have admitted some: {admitted:?}");

    // A response cached through one replica is served from cache by the other.
    let chat = |replica: &Replica, question: &str| {
        http.post(replica.url("/v1/chat/completions"))
            .bearer_auth(BETA)
            .json(&json!({ "messages": [{ "role": "user", "content": question }], "max_tokens": 8, "temperature": 0 }))
            .send()
    };
    // Tenant alpha's limit is spent; tenant beta has its own.
    let first = chat(&a, "What is the capital of France?").await.expect("request");
    assert_eq!(first.status(), 200);
    let first: serde_json::Value = first.json().await.expect("json");
    let mut served = None;
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let text = metrics(&http, &b).await;
        if metric(&text, "levee_vectors_followed_total").unwrap_or(0.0) >= 1.0 {
            served = Some(chat(&b, "What's the capital city of France?").await.expect("request"));
            break;
        }
    }
    let served = served.expect("replica b never indexed replica a's cache entry");
    assert_eq!(served.status(), 200);
    assert_eq!(served.headers().get("x-levee-cache").map(|v| v.to_str().unwrap_or_default()), Some("hit"));
    let served: serde_json::Value = served.json().await.expect("json");
    assert_eq!(served["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"]);
}

#[tokio::test]
async fn requests_survive_a_redis_outage_and_sharing_resumes_after_it() {
    let _model = exclusive().await;
    let mut redis = RedisServer::start();
    let open = format!("{}{}", shared(&redis, "open"), rate_limit(4, "allow"));
    let closed = format!("{}{}", shared(&redis, "closed"), rate_limit(4, "reject"));
    let a = Replica::start(BIN, &open).await;
    let b = Replica::start(BIN, &open).await;
    let c = Replica::start(BIN, &closed).await;
    let http = Client::new();

    let shared_before = alternate(&http, &[&a, &b], 6).await;
    assert_eq!(shared_before.iter().sum::<usize>(), 4, "one shared limit of 4: {shared_before:?}");

    redis.kill();
    // Fail open: each replica limits on its own, from a full local bucket.
    let during = alternate(&http, &[&a, &a], 2).await;
    assert_eq!(during, vec![1, 1], "with Redis down, rule `open` serves from the local bucket");
    let text = metrics(&http, &a).await;
    assert_eq!(metric(&text, "levee_redis_up"), Some(0.0));
    assert!(metric(&text, "levee_redis_fallbacks_total").unwrap_or(0.0) >= 1.0, "{text}");
    // Fail closed: the store error reaches the plugin, whose rule is `reject`.
    let (status, retry_after) = complete(&http, &c).await;
    assert_eq!(status, 503, "rule `closed` + on-store-error `reject` refuses while Redis is down");
    assert!(retry_after.is_some());
    let text = metrics(&http, &c).await;
    assert!(metric(&text, "levee_redis_refusals_total").unwrap_or(0.0) >= 1.0, "{text}");

    redis.restart();
    for replica in [&a, &b, &c] {
        let mut polls = 0;
        while metric(&metrics(&http, replica).await, "levee_redis_up") != Some(1.0) {
            polls += 1;
            assert!(polls < 100, "a replica did not find Redis again within 10 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Shared again, over the new (empty) Redis: 4 in all. Served locally it
    // would be a's 2 left plus b's 3 asked = 5.
    let shared_after = alternate(&http, &[&a, &b], 6).await;
    println!("before the outage {shared_before:?}, during {during:?}, after {shared_after:?}");
    assert_eq!(shared_after.iter().sum::<usize>(), 4, "sharing did not resume: {shared_after:?}");
    let text = metrics(&http, &a).await;
    assert_eq!(metric(&text, "levee_redis_up"), Some(1.0));
    // c reads the shared bucket again, which a and b have just spent: 429, not 503.
    assert_eq!(complete(&http, &c).await.0, 429, "rule `closed` uses the shared bucket again once Redis is back");
}
