//! Misbehaving plugins through the real server, each beside an innocent
//! plugin. Every case runs twice on the same traffic: once with the
//! innocent plugin alone, once with the bad plugin added. In the second run
//! the server stays ready, requests that touch no plugin (`/health`,
//! `/v1/models`, `/tokenize`) keep their latency (p99 within 1.5× of the
//! first run plus a small margin), the innocent plugin is never charged a
//! fault and keeps its state, and the process's memory stays within the
//! bounds the bad plugin was given.

use levee::config::PluginConfig;
use levee_tests::{TestServer, config, exclusive, guests, metric, plugin};
use reqwest::Client;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// How long each run sends traffic.
const RUN: Duration = Duration::from_secs(4);
/// Latency a run with the bad plugin may add to a plugin-free request's p99 past 1.5×.
const MARGIN: Duration = Duration::from_millis(25);
/// What the process may grow by in a run besides the bad plugin's bounds
/// (the engine's buffers, the allocator's slack, the HTTP clients).
const RSS_SLACK: u64 = 160 << 20;

/// What one run measured.
#[derive(Debug)]
struct Run {
    /// Plugin-free requests' latency, 50th and 99th percentile.
    p50: Duration,
    p99: Duration,
    /// `/ready` answers other than 200.
    not_ready: usize,
    /// Completion statuses.
    statuses: BTreeMap<u16, usize>,
    /// Growth of the process's resident memory over the run, bytes.
    rss_growth: u64,
}

fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb << 10)
}

fn percentile(samples: &mut [Duration], q: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * q).round() as usize]
}

/// Serves `plugins` and sends `body` to `/v1/completions` from `clients`
/// loops for [`RUN`], while one more loop times plugin-free requests and
/// asks `/ready`.
async fn run(plugins: Vec<PluginConfig>, body: &Value, clients: usize) -> (TestServer, Run) {
    let mut config = config("");
    config.plugins = plugins;
    let server = TestServer::start(config).await;
    let http = Client::new();
    // One request first, so that neither run pays for the first forward pass.
    http.post(server.url("/v1/completions")).json(body).send().await.expect("warm-up request");
    let before = rss();
    let until = Instant::now() + RUN;
    let traffic: Vec<_> = (0..clients)
        .map(|_| {
            let (http, url, body) = (http.clone(), server.url("/v1/completions"), body.clone());
            tokio::spawn(async move {
                let mut statuses = BTreeMap::new();
                while Instant::now() < until {
                    let status = http.post(&url).json(&body).send().await.map_or(0, |r| r.status().as_u16());
                    *statuses.entry(status).or_insert(0) += 1;
                }
                statuses
            })
        })
        .collect();
    let (mut latencies, mut not_ready, mut peak) = (Vec::new(), 0, before);
    while Instant::now() < until {
        for (i, path) in ["/health", "/v1/models", "/tokenize"].into_iter().enumerate() {
            let started = Instant::now();
            let response = if i == 2 {
                http.post(server.url(path)).json(&json!({ "prompt": "hello world" })).send().await
            } else {
                http.get(server.url(path)).send().await
            };
            assert_eq!(response.expect(path).status(), 200, "{path}");
            latencies.push(started.elapsed());
        }
        let ready = http.get(server.url("/ready")).send().await.map_or(0, |r| r.status().as_u16());
        not_ready += usize::from(ready != 200);
        peak = peak.max(rss());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut statuses = BTreeMap::new();
    for loop_statuses in futures::future::join_all(traffic).await {
        for (status, n) in loop_statuses.expect("traffic loop") {
            *statuses.entry(status).or_insert(0) += n;
        }
    }
    let run = Run {
        p50: percentile(&mut latencies, 0.5),
        p99: percentile(&mut latencies, 0.99),
        not_ready,
        statuses,
        rss_growth: peak.saturating_sub(before),
    };
    (server, run)
}

/// Runs `innocent` alone and then beside `bad`, checks what every case
/// must show, and returns the server of the second run (innocent first in
/// its chain) for the case's own checks.
async fn beside(
    name: &str,
    innocent: PluginConfig,
    bad: PluginConfig,
    body: Value,
    clients: usize,
    bound: u64,
) -> TestServer {
    let (_, alone) = run(vec![innocent.clone()], &body, clients).await;
    let (server, with_bad) = run(vec![innocent, bad], &body, clients).await;
    println!(
        "{name}: plugin-free p50/p99 {:.1}/{:.1} ms alone, {:.1}/{:.1} ms beside it; statuses {:?} then {:?}; \
         RSS +{} MiB (bound {} MiB + slack)",
        alone.p50.as_secs_f64() * 1e3,
        alone.p99.as_secs_f64() * 1e3,
        with_bad.p50.as_secs_f64() * 1e3,
        with_bad.p99.as_secs_f64() * 1e3,
        alone.statuses,
        with_bad.statuses,
        with_bad.rss_growth >> 20,
        bound >> 20,
    );
    assert_eq!(with_bad.not_ready, 0, "{name}: /ready failed beside the bad plugin");
    let allowed = alone.p99.mul_f64(1.5) + MARGIN;
    assert!(with_bad.p99 <= allowed, "{name}: p99 {:?} beside the bad plugin, allowed {allowed:?}", with_bad.p99);
    assert!(with_bad.rss_growth <= bound + RSS_SLACK, "{name}: RSS grew by {} MiB", with_bad.rss_growth >> 20);
    assert!(with_bad.statuses.keys().all(|s| *s != 0 && *s < 500), "{name}: {:?}", with_bad.statuses);
    let chain = server.levee.app.pipeline.policies.snapshot();
    let innocent = &chain.plugins()[0];
    assert_eq!(
        innocent.stats.total_faults(),
        0,
        "{name}: the innocent plugin was charged faults (trap, deadline, over-memory, malformed, instantiate: {:?})",
        innocent.stats.faults_by_kind()
    );
    assert!(!innocent.stats.quarantined());
    server
}

/// The innocent plugin of most cases: counts its calls in its own key-value store.
fn counter() -> PluginConfig {
    plugin("innocent", guests::SCRIPTED, json!({ "hooks": ["admit", "completed"], "count": true }))
}

fn completion(prompt: &str) -> Value {
    json!({ "prompt": prompt, "max_tokens": 1, "temperature": 0 })
}

async fn metrics(server: &TestServer) -> String {
    reqwest::get(server.url("/metrics")).await.expect("metrics").text().await.expect("text")
}

async fn bad_faults(server: &TestServer) -> u64 {
    server.levee.app.pipeline.policies.snapshot().plugins()[1].stats.total_faults()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_cache_hit_is_a_fault_and_a_large_one_stalls_nothing() {
    let _model = exclusive().await;
    // Over plugin-runtime.max-hit-bytes (256 KiB): a malformed decision.
    let huge = plugin("huge", guests::SCRIPTED, json!({ "hooks": ["lookup"], "lookup": { "hit_bytes": 300_000 } }));
    let server = beside("huge hit", counter(), huge, completion("Say hello."), 3, 0).await;
    assert!(bad_faults(&server).await > 0, "the oversized hit was not a fault");
    // Within the bound: served, counted off the async workers, and handed
    // to the innocent `completed` plugin (4 MiB cap) without its faulting.
    let mut innocent = counter();
    innocent.memory_mib = 4;
    let large = plugin("large", guests::SCRIPTED, json!({ "hooks": ["lookup"], "lookup": { "hit_bytes": 200_000 } }));
    let server = beside("large hit", innocent, large, completion("Say hello."), 3, 0).await;
    assert_eq!(bad_faults(&server).await, 0);
    let response =
        Client::new().post(server.url("/v1/completions")).json(&completion("Say hello.")).send().await.unwrap();
    assert_eq!(response.headers()["x-levee-cache"], "hit");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["choices"][0]["text"].as_str().map(str::len), Some(200_000));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_value_byte_flood_stays_within_its_bound() {
    let _model = exclusive().await;
    // 4 MiB a request into a 16 MiB bound.
    let mut flood = plugin("flood", guests::SCRIPTED, json!({ "hooks": ["admit"], "kv_set_bytes": 4 << 20 }));
    flood.kv_max_bytes = 16 << 20;
    flood.kv_max_value_bytes = 8 << 20;
    let server = beside("kv flood", counter(), flood, completion("Say hello."), 3, 16 << 20).await;
    let caps = &server.levee.app.caps;
    let sets = caps.kv_get("flood:sets").await.unwrap().map(|v| String::from_utf8(v).unwrap()).unwrap_or_default();
    println!("kv flood: {sets} values of 4 MiB written, {} bytes held", caps.local_kv("flood:").bytes());
    assert!(sets.parse::<u64>().unwrap() > 8, "the flood wrote only {sets} values");
    assert!(caps.local_kv("flood:").bytes() <= 16 << 20);
    assert!(caps.kv_get("innocent:calls:admit").await.unwrap().is_some(), "the innocent plugin's keys are gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_flood_does_not_reset_another_plugins_exhausted_bucket() {
    let _model = exclusive().await;
    // The innocent plugin allows each tenant one request, ever.
    let innocent = plugin(
        "innocent",
        guests::SCRIPTED,
        json!({ "hooks": ["admit"], "bucket": { "capacity": 1, "refill": 0.0001 }, "count": true }),
    );
    let mut flood = plugin("flood", guests::SCRIPTED, json!({ "hooks": ["admit"], "bucket_flood": 2000 }));
    flood.max_buckets = 1000;
    let server = beside("bucket flood", innocent, flood, completion("Say hello."), 3, 0).await;
    // Every request of the run came from the same (anonymous) tenant: one
    // was allowed, the rest refused, and the flood did not undo it.
    let response =
        Client::new().post(server.url("/v1/completions")).json(&completion("Say hello.")).send().await.unwrap();
    assert_eq!(response.status(), 429, "the innocent plugin's exhausted bucket was reset");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_flood_does_not_wipe_another_plugins_cache() {
    let _model = exclusive().await;
    let cache = plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.85 }));
    let mut flood = plugin("flood", guests::SCRIPTED, json!({ "hooks": ["admit"], "vector_flood": 200 }));
    flood.vector_max_namespaces = 64;
    flood.vector_max_bytes = 4 << 20;
    // Requests that the cache answers after the first: the namespace the flood must not evict.
    let server =
        beside("namespace flood", cache, flood, completion("What is the capital of France?"), 2, 4 << 20).await;
    let response = Client::new()
        .post(server.url("/v1/completions"))
        .json(&completion("What is the capital of France?"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.headers().get("x-levee-cache").map(|v| v.to_str().unwrap()),
        Some("hit"),
        "the cache's namespace was evicted by another plugin's"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_flood_does_not_charge_an_innocent_plugin() {
    let _model = exclusive().await;
    // The innocent cache has the default 10 ms for a call; its time in the
    // embedding model is the host's.
    let mut cache = plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.85 }));
    cache.time_budget_ms = 10.0;
    let mut flood = plugin(
        "flood",
        guests::SCRIPTED,
        json!({ "hooks": ["admit"], "embed": 16, "embed_text": "a long text to embed, again and again ".repeat(20) }),
    );
    flood.time_budget_ms = 5000.0;
    let server = beside("embedding flood", cache, flood, completion("hello world"), 3, 0).await;
    let text = metrics(&server).await;
    let waited = metric(&text, "levee_plugin_host_wait_seconds_total{plugin=\"semantic-cache\"}").unwrap();
    println!("embedding flood: the cache waited {waited:.3} s on the model in all, not charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_init_and_a_plugin_holding_its_whole_pool_delay_nobody_else() {
    let _model = exclusive().await;
    let mut slow = plugin("slow", guests::SCRIPTED, json!({ "hooks": ["admit"], "init_spin_ms": 500 }));
    slow.time_budget_ms = 20.0;
    let server = beside("slow init", counter(), slow, completion("Say hello."), 4, 0).await;
    println!("slow init: {} faults", bad_faults(&server).await);

    let mut hog = plugin("hog", guests::SCRIPTED, json!({ "hooks": ["admit"], "call_spin_ms": 40 }));
    hog.time_budget_ms = 100.0;
    hog.max_instances = 2;
    let server = beside("pool held", counter(), hog, completion("Say hello."), 6, 0).await;
    println!("pool held: {} faults", bad_faults(&server).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_labels_messages_and_log_floods_are_bounded() {
    let _model = exclusive().await;
    let long = "x".repeat(100_000);
    let label = plugin("label", guests::SCRIPTED, json!({ "hooks": ["shape"], "shape": { "label": long } }));
    let server = beside("oversized label", counter(), label, completion("Say hello."), 3, 0).await;
    assert!(bad_faults(&server).await > 0, "a 100 kB label was accepted");
    let response =
        Client::new().post(server.url("/v1/completions")).json(&completion("Say hello.")).send().await.unwrap();
    assert!(response.headers().get("x-levee-degraded").is_none());

    let message = plugin(
        "message",
        guests::SCRIPTED,
        json!({ "hooks": ["admit"], "admit": { "reject": { "status": 429, "message": long } } }),
    );
    let server = beside("oversized message", counter(), message, completion("Say hello."), 3, 0).await;
    assert!(bad_faults(&server).await > 0, "a 100 kB rejection message was accepted");

    let log = plugin(
        "log",
        guests::SCRIPTED,
        json!({ "hooks": ["admit"], "log": { "lines": 1000, "text": "a line\nERROR forged host line" } }),
    );
    let server = beside("log flood", counter(), log, completion("Say hello."), 3, 0).await;
    let dropped = metric(&metrics(&server).await, "levee_plugin_log_dropped_total{plugin=\"log\"}").unwrap();
    println!("log flood: {dropped} lines dropped");
    assert!(dropped > 1000.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flaky_plugin_and_a_memory_hoarder_are_contained() {
    let _model = exclusive().await;
    let flaky = plugin("flaky", guests::SCRIPTED, json!({ "hooks": ["admit"], "fault_every": 2 }));
    let server = beside("fault every other call", counter(), flaky, completion("Say hello."), 3, 0).await;
    let chain = server.levee.app.pipeline.policies.snapshot();
    assert!(chain.plugins()[1].stats.quarantined(), "a plugin faulting every other call was not quarantined");

    // 4 MiB more of its memory kept by every call; its instances together may hold 32 MiB.
    let mut hoarder = plugin("hoarder", guests::SCRIPTED, json!({ "hooks": ["admit"], "hold_bytes": 4 << 20 }));
    hoarder.memory_total_mib = Some(32);
    hoarder.max_instances = 8;
    let server = beside("memory hoarder", counter(), hoarder, completion("Say hello."), 4, 32 << 20).await;
    let held = metric(&metrics(&server).await, "levee_plugin_memory_bytes{plugin=\"hoarder\"}").unwrap();
    println!("memory hoarder: its instances hold {} MiB, {} faults", held as u64 >> 20, bad_faults(&server).await);
    assert!(held <= (32 << 20) as f64);
    assert!(bad_faults(&server).await > 0, "the hoarder never hit its total");
}
