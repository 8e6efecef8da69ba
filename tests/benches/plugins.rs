//! Plugin call costs, in one run:
//! - one hook call into a no-op plugin;
//! - a realistic decision (per-tenant token bucket) in Wasm against the same
//!   logic compiled natively, called the same way (a policy object per call);
//! - a full five-hook chain per request (admit, lookup, coalesce-key, shape,
//!   completed).
//!
//! `cargo bench -p levee-tests --bench plugins`

#[path = "../guests/bucket/src/logic.rs"]
mod logic;

use levee::plugins::bindings::{Admission, Load, Rejection, Request, Response, Usage};
use levee_tests::{guests, plugin, request, runtime_settings, start};
use serde_json::json;
use std::hint::black_box;
use std::time::{Duration, Instant};

const WARMUP: usize = 2_000;
const SAMPLES: usize = 20_000;

struct Summary {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn summarize(mut samples: Vec<Duration>) -> Summary {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    Summary { p50: samples[samples.len() / 2], p99: samples[samples.len() * 99 / 100], mean }
}

async fn measure<F, Fut>(mut f: F) -> Summary
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..WARMUP {
        f(i).await;
    }
    let mut samples = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        let started = Instant::now();
        f(i).await;
        samples.push(started.elapsed());
    }
    summarize(samples)
}

/// The bucket guest's policy, natively: same logic, same decision shape.
struct NativeBucket {
    buckets: logic::Buckets,
}

impl NativeBucket {
    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        match self.buckets.take(&request.tenant, 1.0, now) {
            Ok(_) => Admission::Allow(None),
            Err(retry) => Admission::Reject(Rejection {
                status: 429,
                retry_after_secs: Some(retry),
                message: format!("tenant {} is over its rate", request.tenant),
            }),
        }
    }
}

fn us(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e6)
}

fn row(name: &str, s: &Summary) {
    println!("| {name:<44} | {:>9} | {:>9} | {:>9} |", us(s.p50), us(s.p99), us(s.mean));
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    runtime.block_on(async {
        let load = Load::default();
        let tenants: Vec<String> = (0..64).map(|i| format!("tenant-{i}")).collect();
        let requests: Vec<Request> = tenants.iter().map(|t| request(t, "What is the capital of France?")).collect();

        let (noop, _) =
            start(vec![plugin("noop", guests::NOOP, json!({}))], runtime_settings(false)).await.expect("noop");
        let noop_chain = noop.policies.snapshot();
        let noop_admit = measure(|i| {
            let chain = noop_chain.clone();
            let req = &requests[i % requests.len()];
            let load = &load;
            async move {
                black_box(chain.plugins()[0].admit(req, load).await.expect("noop admit"));
            }
        })
        .await;

        let (bucket, _) =
            start(vec![plugin("bucket", guests::BUCKET, json!({}))], runtime_settings(false)).await.expect("bucket");
        let bucket_chain = bucket.policies.snapshot();
        let wasm_bucket = measure(|i| {
            let chain = bucket_chain.clone();
            let req = &requests[i % requests.len()];
            let load = &load;
            async move {
                black_box(chain.plugins()[0].admit(req, load).await.expect("bucket admit"));
            }
        })
        .await;

        let mut native = NativeBucket { buckets: logic::Buckets::new(1e12, 1e9) };
        let native_ptr = &mut native as *mut NativeBucket;
        let native_bucket = measure(|i| {
            let req = &requests[i % requests.len()];
            // SAFETY: the closure runs one future at a time to completion on this thread.
            let native = unsafe { &mut *native_ptr };
            let load = &load;
            async move {
                black_box(native.admit(black_box(req), load));
            }
        })
        .await;

        let response = Response { choices: Vec::new(), completion_tokens: 16 };
        let usage = Usage {
            prompt_tokens: 7,
            completion_tokens: 16,
            ttft_ms: 5.0,
            total_ms: 50.0,
            cached: false,
            coalesced: false,
            error_status: 0,
        };
        let full_chain = measure(|i| {
            let policies = noop.policies.clone();
            let req = &requests[i % requests.len()];
            let (load, response, usage) = (&load, &response, &usage);
            async move {
                let chain = policies.snapshot();
                black_box(chain.admit(req, load).await.expect("admit"));
                black_box(chain.lookup(req).await.expect("lookup"));
                black_box(chain.coalesce_key(req).await.expect("coalesce-key"));
                black_box(chain.shape(req, load).await.expect("shape"));
                chain.completed(req, response, usage).await;
            }
        })
        .await;

        println!("Plugin call costs ({SAMPLES} samples each, after {WARMUP} warm-up calls; µs)");
        println!();
        println!("| {:<44} | {:>9} | {:>9} | {:>9} |", "measurement", "p50", "p99", "mean");
        println!("|{}|{}|{}|{}|", "-".repeat(46), "-".repeat(11), "-".repeat(11), "-".repeat(11));
        row("no-op plugin, one admit call", &noop_admit);
        row("token-bucket decision, Wasm plugin", &wasm_bucket);
        row("token-bucket decision, native twin", &native_bucket);
        row("full five-hook chain per request (no-op)", &full_chain);
        println!();
        let ratio = wasm_bucket.p50.as_secs_f64() / native_bucket.p50.as_secs_f64().max(1e-9);
        let decision = wasm_bucket.p50.saturating_sub(noop_admit.p50);
        let compute_ratio = decision.as_secs_f64() / native_bucket.p50.as_secs_f64().max(1e-9);
        println!("Wasm decision / native twin, whole call (p50): {ratio:.1}x   (goal: <= 5x)");
        println!(
            "Wasm decision / native twin, above the no-op call (p50): {} µs / {} µs = {compute_ratio:.1}x",
            us(decision),
            us(native_bucket.p50)
        );
        println!("Full chain per request (p50): {} µs   (goal: <= 50 µs)", us(full_chain.p50));
    });
}
