//! The costs behind the reference policies, in one run:
//! - a semantic-cache hit against a generation, through the real server;
//! - one cache lookup's embedding + vector search with 100,000 entries;
//! - one token-bucket take, local against Redis.
//!
//! `cargo bench -p levee-tests --bench capabilities` (needs `redis-server`,
//! installed by `scripts/setup.sh`).

use levee::capabilities::embeddings::MiniLm;
use levee::capabilities::{Capabilities, Embedder};
use levee::config::{SharedStateConfig, StateBackend};
use levee::state::{RedisState, State};
use levee_tests::{RedisServer, TestServer, config, guests, plugin};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long the benchmark waits for the embedding model to take a text.
const WAIT: Duration = Duration::from_secs(60);

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

async fn chat(http: &reqwest::Client, server: &TestServer, question: &str, max_tokens: u32) -> (Duration, bool) {
    let sent = Instant::now();
    let response = http
        .post(server.url("/v1/chat/completions"))
        .json(&json!({ "messages": [{ "role": "user", "content": question }], "max_tokens": max_tokens, "temperature": 0 }))
        .send()
        .await
        .expect("request");
    assert_eq!(response.status(), 200);
    let hit = response.headers().contains_key("x-levee-cache");
    let _ = response.bytes().await;
    (sent.elapsed(), hit)
}

async fn cache_hit_against_generation() {
    let mut config = config("");
    config.plugins = vec![plugin("semantic-cache", guests::SEMANTIC_CACHE, json!({ "threshold": 0.85 }))];
    let server = TestServer::start(config).await;
    let http = reqwest::Client::new();
    let topics = ["rivers", "volcanoes", "bread", "chess", "owls", "glaciers", "violins", "comets"];
    let mut generations = Vec::new();
    for topic in topics {
        let (took, hit) = chat(&http, &server, &format!("Write a short paragraph about {topic}."), 64).await;
        assert!(!hit);
        generations.push(took);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut hits = Vec::new();
    for i in 0..40 {
        let topic = topics[i % topics.len()];
        let (took, hit) = chat(&http, &server, &format!("Write a short paragraph about {topic}."), 64).await;
        assert!(hit, "a repeated prompt missed the cache");
        hits.push(took);
    }
    let (generation, hit) = (percentile(&mut generations, 0.5), percentile(&mut hits, 0.5));
    println!("semantic cache through the server (chat, max_tokens 64, greedy):");
    println!("  generation p50 {:>8.2} ms  ({} prompts)", ms(generation), generations.len());
    println!("  cache hit  p50 {:>8.2} ms  ({} requests)", ms(hit), hits.len());
    println!("  hit / generation = {:.2}%  (goal ≤ 5%)", 100.0 * hit.as_secs_f64() / generation.as_secs_f64());
}

fn embed_and_search_at_100k() {
    const ENTRIES: usize = 100_000;
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/minilm");
    // ONNX Runtime threads of the embedding model (`embeddings.threads`); one ONNX environment per process.
    let threads = std::env::var("LEVEE_EMBED_THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(1);
    let embedder = MiniLm::shared(&path, threads).expect("embedding model (run scripts/setup.sh)");
    let caps = Capabilities::local();
    // Fill with real-looking vectors: embeddings of a few hundred texts, perturbed.
    let seeds: Vec<Vec<f32>> = (0..256)
        .map(|i| {
            embedder
                .embed("bench", &format!("What is the answer to question {i} about topic {}?", i * 7 % 31), WAIT)
                .unwrap()
        })
        .collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut noise = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let filled = Instant::now();
    for i in 0..ENTRIES {
        let vector: Vec<f32> = seeds[i % seeds.len()].iter().map(|x| x + 0.05 * noise()).collect();
        caps.vectors().insert("bench", &vector, format!("payload {i}").into_bytes(), 0).unwrap();
    }
    let fill = filled.elapsed();
    let questions: Vec<String> =
        (0..60).map(|i| format!("What is the answer to question {i} about topic {}?", i % 13)).collect();
    let (mut embeds, mut searches, mut totals) = (Vec::new(), Vec::new(), Vec::new());
    let mut exact = 0;
    for (i, question) in questions.iter().enumerate() {
        let t0 = Instant::now();
        let vector = embedder.embed("bench", question, WAIT).unwrap();
        let t1 = Instant::now();
        let hits = caps.vectors().search("bench", &vector, 1, 0.0).unwrap();
        let t2 = Instant::now();
        assert!(!hits.is_empty());
        if hits == caps.vectors().search_exact("bench", &vector, 1).unwrap() {
            exact += 1;
        }
        if i >= 10 {
            embeds.push(t1 - t0);
            searches.push(t2 - t1);
            totals.push(t2 - t0);
        }
    }
    println!(
        "cache lookup with {ENTRIES} entries of 384 dimensions (filled in {:.1} s), {threads} embedding thread(s):",
        fill.as_secs_f64()
    );
    println!("  embed          p50 {:>7.3} ms", ms(percentile(&mut embeds, 0.5)));
    println!(
        "  vector search  p50 {:>7.3} ms  (sign-bit prefilter + exact re-rank; found the exact nearest for {exact} of {} queries)",
        ms(percentile(&mut searches, 0.5)),
        questions.len()
    );
    println!(
        "  embed + search p50 {:>7.3} ms  p99 {:.3} ms  (goal ≤ 5 ms p50)",
        ms(percentile(&mut totals, 0.5)),
        ms(percentile(&mut totals, 0.99))
    );
}

async fn bucket_local_against_redis() {
    const TAKES: usize = 5000;
    let redis = RedisServer::start();
    let local = Capabilities::local();
    let settings = SharedStateConfig {
        backend: StateBackend::Redis,
        redis_url: redis.url(),
        timeout_ms: 1000,
        ..SharedStateConfig::default()
    };
    let shared = Capabilities::new(State::shared(Arc::new(RedisState::new(&settings).expect("redis client"))));
    let run = async |caps: &Capabilities| {
        let mut samples = Vec::with_capacity(TAKES);
        for i in 0..TAKES + 500 {
            let t0 = Instant::now();
            let take = caps.take(&format!("tenant-{}", i % 64), 1e9, 1e6, 1.0).await.unwrap();
            if i >= 500 {
                samples.push(t0.elapsed());
            }
            assert!(take.allowed);
        }
        (percentile(&mut samples, 0.5), percentile(&mut samples, 0.99))
    };
    let (local_p50, local_p99) = run(&local).await;
    let (redis_p50, redis_p99) = run(&shared).await;
    println!("token-bucket take ({TAKES} takes over 64 keys, one at a time):");
    println!("  local  p50 {:>8.2} µs  p99 {:>8.2} µs", local_p50.as_secs_f64() * 1e6, local_p99.as_secs_f64() * 1e6);
    println!(
        "  redis  p50 {:>8.2} µs  p99 {:>8.2} µs  (loopback, one Lua script per take)",
        redis_p50.as_secs_f64() * 1e6,
        redis_p99.as_secs_f64() * 1e6
    );
    println!("  redis / local = {:.0}×", redis_p50.as_secs_f64() / local_p50.as_secs_f64());
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime");
    if std::env::var("LEVEE_EMBED_THREADS").is_ok() {
        // Only the lookup: the server's embedding model would take the same (one per process) environment.
        embed_and_search_at_100k();
        return;
    }
    runtime.block_on(cache_hit_against_generation());
    embed_and_search_at_100k();
    runtime.block_on(bucket_local_against_redis());
}
