//! The reference rate-limit and degrade plugins through the real server and
//! the real model: what a client sees when a tenant runs out, when a token
//! budget meets a burst, and when the engine is overloaded and recovers.

use levee_tests::{TestServer, config, exclusive, guests, metric, plugin};
use reqwest::Client;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const ALPHA: &str = "key-alpha-0001";
const BETA: &str = "key-beta-0002";
const KEYS: &str = "[[api-keys]]\nkey = \"key-alpha-0001\"\ntenant = \"alpha\"\n\n[[api-keys]]\nkey = \"key-beta-0002\"\ntenant = \"beta\"\n";

struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

async fn complete(http: &Client, server: &TestServer, key: &str, body: Value) -> Reply {
    let response = http.post(server.url("/v1/completions")).bearer_auth(key).json(&body).send().await.expect("request");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response.json().await.unwrap_or(Value::Null);
    Reply { status, headers, body }
}

async fn metrics(http: &Client, server: &TestServer) -> String {
    http.get(server.url("/metrics")).send().await.expect("metrics").text().await.expect("text")
}

#[tokio::test]
async fn an_empty_bucket_refuses_one_tenant_with_retry_after_and_not_another() {
    let _model = exclusive().await;
    let mut config = config(KEYS);
    config.plugins = vec![plugin("rate-limit", guests::RATE_LIMIT, json!({ "requests-per-minute": 3 }))];
    let server = TestServer::start(config).await;
    let http = Client::new();
    let body = json!({ "prompt": "Hello", "max_tokens": 1, "temperature": 0 });

    for i in 0..3 {
        assert_eq!(complete(&http, &server, ALPHA, body.clone()).await.status, 200, "request {i} of 3");
    }
    let refused = complete(&http, &server, ALPHA, body.clone()).await;
    assert_eq!(refused.status, 429);
    // 3/min refills one request every 20 s; the bucket is empty now.
    let retry_after: u64 = refused.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!((18..=20).contains(&retry_after), "Retry-After {retry_after}");
    assert_eq!(refused.headers["x-levee-refused-by"], "rate-limit");
    assert_eq!(refused.body["error"]["code"], "rate_limit_exceeded", "{}", refused.body);
    // Another tenant has a bucket of its own.
    for i in 0..3 {
        assert_eq!(complete(&http, &server, BETA, body.clone()).await.status, 200, "tenant beta, request {i}");
    }
}

#[tokio::test]
async fn a_token_budget_holds_under_32_concurrent_requests() {
    let _model = exclusive().await;
    const BUDGET: f64 = 240.0;
    let mut config = config(KEYS);
    config.plugins = vec![plugin(
        "rate-limit",
        guests::RATE_LIMIT,
        json!({ "tokens-per-minute": BUDGET, "requests-per-minute": 1000 }),
    )];
    let server = TestServer::start(config).await;
    let http = Client::new();
    let started = Instant::now();
    let body = json!({ "prompt": "Count slowly: one, two, three,", "max_tokens": 12, "temperature": 0 });
    let replies = futures::future::join_all((0..32).map(|_| complete(&http, &server, ALPHA, body.clone()))).await;
    let elapsed = started.elapsed().as_secs_f64();

    let admitted: Vec<&Reply> = replies.iter().filter(|r| r.status == 200).collect();
    assert!(replies.iter().all(|r| r.status == 200 || r.status == 429), "only 200 and 429 expected");
    let used: u64 = admitted.iter().map(|r| r.body["usage"]["total_tokens"].as_u64().unwrap()).sum();
    let reserved_each =
        admitted[0].body["usage"]["prompt_tokens"].as_u64().unwrap() + body["max_tokens"].as_u64().unwrap();
    // The bucket starts full and refills BUDGET/60 tokens a second.
    let allowance = BUDGET + BUDGET / 60.0 * elapsed;
    println!(
        "32 concurrent: {} admitted, {} refused; {used} tokens used of a {BUDGET}-token budget (+{:.0} refill in {elapsed:.1} s)",
        admitted.len(),
        32 - admitted.len(),
        allowance - BUDGET
    );
    assert!(!admitted.is_empty() && admitted.len() < 32);
    assert!(
        (admitted.len() as u64 * reserved_each) as f64 <= allowance + reserved_each as f64 * 2.0,
        "admissions overshot the budget: {} × {reserved_each}",
        admitted.len()
    );
    assert!(used as f64 <= allowance, "used {used} tokens of {allowance:.0}");
    let text = metrics(&http, &server).await;
    assert!(metric(&text, "levee_plugin_rejected_tokens{plugin=\"rate-limit\"}").unwrap_or(0.0) >= 1.0, "{text}");
}

#[tokio::test]
async fn degradation_steps_up_under_overload_and_back_down_after_it() {
    let _model = exclusive().await;
    let mut config = config("");
    config.engine.max_running = 1;
    config.plugins = vec![plugin(
        "degrade",
        guests::DEGRADE,
        json!({
            "exit-ratio": 0.5,
            "hold-secs": 1,
            "levels": [
                { "name": "cap", "enter": { "queue-depth": 3 }, "max-tokens": 4 },
                { "name": "shed", "enter": { "queue-depth": 8 }, "shed-priority-at-least": 5, "retry-after-secs": 2 }
            ]
        }),
    )];
    let server = TestServer::start(config).await;
    let http = Client::new();
    // A prompt the model continues at length, so that generations last.
    let body = |priority: i64| {
        json!({
            "prompt": "Once upon a time, in a small village by the sea, there lived",
            "max_tokens": 32, "temperature": 0, "priority": priority
        })
    };

    // Normal load: nothing degraded.
    let calm = complete(&http, &server, "", body(0)).await;
    assert_eq!(calm.status, 200);
    assert!(!calm.headers.contains_key("x-levee-degraded"));

    // A synthetic overload: 30 requests at once against one running slot,
    // the later ones at a low priority (5).
    let burst = futures::future::join_all((0..30).map(|i| {
        let http = http.clone();
        let server = &server;
        async move {
            tokio::time::sleep(Duration::from_millis(5 * i)).await;
            complete(&http, server, "", body(if i < 15 { 0 } else { 5 })).await
        }
    }))
    .await;
    // Both levels cap max tokens; the second also sheds priority 5.
    let capped: Vec<&Reply> =
        burst.iter().filter(|r| r.status == 200 && r.headers.contains_key("x-levee-degraded")).collect();
    let shed = burst.iter().filter(|r| r.status == 503).count();
    println!("overload: {} capped, {shed} shed of {}", capped.len(), burst.len());
    assert!(!capped.is_empty(), "no request was degraded under the overload");
    for reply in &capped {
        assert!(reply.body["usage"]["completion_tokens"].as_u64().unwrap() <= 4, "a capped request ran past its cap");
    }
    for reply in burst.iter().filter(|r| r.status == 503) {
        assert!(reply.headers.contains_key("retry-after"));
    }
    assert!(burst.iter().all(|r| r.status == 200 || r.status == 503));

    // The overload is over: after hold-secs at each level, back to normal.
    let mut recovered = false;
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let reply = complete(&http, &server, "", body(0)).await;
        if reply.status == 200 && !reply.headers.contains_key("x-levee-degraded") {
            recovered = true;
            break;
        }
    }
    assert!(recovered, "degradation never stepped back down");
    let text = metrics(&http, &server).await;
    assert_eq!(metric(&text, "levee_plugin_level{plugin=\"degrade\"}"), Some(0.0), "{text}");
    assert!(metric(&text, "levee_plugin_level_downs{plugin=\"degrade\"}").unwrap_or(0.0) >= 1.0);
}
