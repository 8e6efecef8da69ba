//! A burst several times the engine's capacity against a real server, with
//! mixed priorities: every request must get a response or a proper
//! 429/503/504, the server must stay up, high-priority requests must keep a
//! bounded p99, and memory must stay bounded.
//!
//! `cargo bench -p levee-tests --bench load` runs an in-process server on
//! the default model. `LEVEE_URL=http://host:port` sends the same burst to
//! a running server instead (memory is then not measured).
//! `LEVEE_BURST` (default 240) sets the number of requests.

use levee_tests::{TestServer, config};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

fn rss_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    runtime.block_on(async {
        let burst: usize = std::env::var("LEVEE_BURST").ok().and_then(|v| v.parse().ok()).unwrap_or(240);
        let (base, _server) = match std::env::var("LEVEE_URL") {
            Ok(url) => (url, None),
            Err(_) => {
                let mut config = config("");
                config.engine.threads = 0;
                config.engine.max_running = 16;
                config.engine.max_queue_requests = 64;
                config.engine.queue_timeout_secs = 20.0;
                let server = TestServer::start(config).await;
                (server.base.clone(), Some(server))
            }
        };
        let rss_before = rss_kib("VmRSS:");
        let http = reqwest::Client::builder().pool_max_idle_per_host(burst).build().expect("http client");
        let prompts = ["Write a haiku about rain.", "List three fruits.", "What is 2 + 2?", "Describe the sea in one sentence."];
        let started = Instant::now();
        let requests = (0..burst).map(|i| {
            let http = http.clone();
            let url = format!("{base}/v1/completions");
            // One request in four is high priority (lower runs first).
            let high = i % 4 == 0;
            let body = json!({ "prompt": prompts[i % prompts.len()], "max_tokens": 24, "temperature": 0, "priority": if high { -10 } else { 10 } });
            async move {
                let sent = Instant::now();
                let status = match http.post(url).json(&body).send().await {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let _ = response.bytes().await;
                        status
                    }
                    Err(_) => 0,
                };
                (high, status, sent.elapsed())
            }
        });
        let results = futures::future::join_all(requests).await;
        let wall = started.elapsed();
        let alive = http.get(format!("{base}/health")).send().await.map(|r| r.status() == 200).unwrap_or(false);

        let mut by_status: BTreeMap<u16, usize> = BTreeMap::new();
        for (_, status, _) in &results {
            *by_status.entry(*status).or_default() += 1;
        }
        println!("Load burst: {burst} concurrent completions (max_tokens 24), 1 in 4 at high priority");
        println!("wall time {:.1} s; server alive after the burst: {alive}", wall.as_secs_f64());
        println!("statuses: {by_status:?}  (0 = no response)");
        println!();
        println!("| priority | admitted (200) | refused (429/503/504) | p50 latency (s) | p99 latency (s) |");
        println!("|----------|---------------:|----------------------:|----------------:|----------------:|");
        for (name, high) in [("high", true), ("low", false)] {
            let mut ok: Vec<Duration> = results.iter().filter(|r| r.0 == high && r.1 == 200).map(|r| r.2).collect();
            ok.sort();
            let refused = results.iter().filter(|r| r.0 == high && [429, 503, 504].contains(&r.1)).count();
            println!(
                "| {name:<8} | {:>14} | {refused:>21} | {:>15.2} | {:>15.2} |",
                ok.len(),
                percentile(&ok, 0.5).as_secs_f64(),
                percentile(&ok, 0.99).as_secs_f64()
            );
        }
        let improper = results.iter().filter(|r| ![200, 429, 503, 504].contains(&r.1)).count();
        println!();
        println!("requests without a proper answer: {improper}");
        if let (Some(before), Some(peak), Some(after)) = (rss_before, rss_kib("VmHWM:"), rss_kib("VmRSS:")) {
            println!("memory (server and load generator, one process): RSS before {} MiB, after {} MiB, peak {} MiB", before / 1024, after / 1024, peak / 1024);
        }
    });
}
