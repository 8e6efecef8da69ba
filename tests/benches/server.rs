//! Requests/s and latency through the real server, in one run:
//! - cached responses: the semantic cache alone vs the five reference
//!   plugins (rate-limit, semantic-cache, coalesce, degrade, autoscale);
//! - short generations (4 tokens, distinct prompts): no plugins vs the five.
//!
//! `cargo bench -p levee-tests --bench server`

use levee::config::PluginConfig;
use levee_tests::{TestServer, config, guests, plugin};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const CONCURRENCY: usize = 8;

fn five() -> Vec<PluginConfig> {
    vec![
        plugin(
            "rate-limit",
            guests::RATE_LIMIT,
            json!({ "requests-per-minute": 10_000_000, "tokens-per-minute": 1_000_000_000 }),
        ),
        plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.92 })),
        plugin("coalesce", guests::COALESCE, json!({})),
        plugin(
            "degrade",
            guests::DEGRADE,
            json!({ "levels": [{ "name": "cap", "enter": { "queue-depth": 10_000 }, "max-tokens": 512 }] }),
        ),
        plugin("autoscale", guests::AUTOSCALE, json!({ "min-replicas": 1, "max-replicas": 8 })),
    ]
}

fn cache_only() -> Vec<PluginConfig> {
    vec![plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.92 }))]
}

struct Run {
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

async fn drive(base: &str, bodies: Vec<Value>) -> Run {
    let http = reqwest::Client::new();
    let queue = std::sync::Arc::new(std::sync::Mutex::new(bodies));
    let started = Instant::now();
    let workers = (0..CONCURRENCY).map(|_| {
        let (http, queue, url) = (http.clone(), queue.clone(), format!("{base}/v1/completions"));
        async move {
            let mut latencies = Vec::new();
            while let Some(body) = queue.lock().map(|mut q| q.pop()).ok().flatten() {
                let sent = Instant::now();
                let response = http.post(&url).json(&body).send().await.expect("request");
                assert_eq!(response.status(), 200);
                let _ = response.bytes().await;
                latencies.push(sent.elapsed());
            }
            latencies
        }
    });
    let mut latencies: Vec<Duration> = futures::future::join_all(workers).await.into_iter().flatten().collect();
    let elapsed = started.elapsed();
    latencies.sort();
    Run {
        per_second: latencies.len() as f64 / elapsed.as_secs_f64(),
        p50: latencies[latencies.len() / 2],
        p99: latencies[(latencies.len() - 1) * 99 / 100],
    }
}

async fn cached(plugins: Vec<PluginConfig>, requests: usize) -> Run {
    let mut config = config("");
    config.plugins = plugins;
    let server = TestServer::start(config).await;
    let body = json!({ "prompt": "What is the capital of France?", "max_tokens": 8, "temperature": 0 });
    let http = reqwest::Client::new();
    // Fill the cache, and wait until the entry serves.
    for _ in 0..100 {
        let response = http.post(server.url("/v1/completions")).json(&body).send().await.expect("request");
        if response.headers().contains_key("x-levee-cache") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drive(&server.base, vec![body; requests]).await
}

async fn generations(plugins: Vec<PluginConfig>, requests: usize) -> Run {
    let mut config = config("");
    config.engine.threads = 0;
    config.plugins = plugins;
    let server = TestServer::start(config).await;
    let bodies = (0..requests)
        .map(|i| json!({ "prompt": format!("Request {i}: count from one to"), "max_tokens": 4, "temperature": 0 }))
        .collect();
    drive(&server.base, bodies).await
}

fn row(name: &str, run: &Run) {
    println!(
        "| {name:<44} | {:>10.1} | {:>9.2} | {:>9.2} |",
        run.per_second,
        run.p50.as_secs_f64() * 1000.0,
        run.p99.as_secs_f64() * 1000.0
    );
}

fn main() {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    runtime.block_on(async {
        let cached_alone = cached(cache_only(), 2000).await;
        let cached_five = cached(five(), 2000).await;
        let generated_none = generations(Vec::new(), 48).await;
        let generated_five = generations(five(), 48).await;
        println!("Server throughput, {CONCURRENCY} concurrent clients, completions route");
        println!();
        println!("| {:<44} | {:>10} | {:>9} | {:>9} |", "path and chain", "requests/s", "p50 (ms)", "p99 (ms)");
        println!("|{}|{}|{}|{}|", "-".repeat(46), "-".repeat(12), "-".repeat(11), "-".repeat(11));
        row("cached response, semantic-cache alone", &cached_alone);
        row("cached response, five reference plugins", &cached_five);
        row("4-token generation, no plugins", &generated_none);
        row("4-token generation, five reference plugins", &generated_five);
        println!();
        let cost = 1.0 - cached_five.per_second / cached_alone.per_second;
        println!(
            "cached path: the five-plugin chain costs {:.1}% of requests/s against the cache alone (goal <= 10%)",
            cost * 100.0
        );
        let cost = 1.0 - generated_five.per_second / generated_none.per_second;
        println!("generation path: the five-plugin chain costs {:.1}% of requests/s against no plugins", cost * 100.0);
    });
}
