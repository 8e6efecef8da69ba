//! Plugin call costs, in one run:
//! - one hook call into a no-op plugin;
//! - a realistic decision (per-tenant token bucket) in Wasm against the same
//!   logic compiled natively, called the same way (a policy object per call);
//! - a full five-hook chain per request (admit, lookup, coalesce-key, shape,
//!   completed);
//! - the floor under all of these: the same `admit` export of the same two
//!   components called directly through wasmtime, synchronously (no fiber,
//!   no deadline, no pool, no counters): what the component boundary costs
//!   before Levee adds anything.
//!
//! `cargo bench -p levee-tests --bench plugins`

#[path = "../guests/bucket/src/logic.rs"]
mod logic;

use levee::plugins::bindings::{
    Admission, Hook, Load, Manifest, Rejection, Request, Response, ScaleDecision, ScaleSignals, Usage,
};
use levee_tests::{guests, plugin, request, runtime_settings, start};
use serde_json::json;
use std::hint::black_box;
use std::time::{Duration, Instant};

const WARMUP: usize = 2_000;
const SAMPLES: usize = 20_000;
/// Every measurement is taken in this many interleaved rounds, so that a
/// burst of noise on the machine falls on all of them alike.
const ROUNDS: usize = 10;

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

/// `n` timed calls of `f` after `WARMUP / ROUNDS` untimed ones.
async fn measure<F, Fut>(n: usize, mut f: F) -> Vec<Duration>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    for i in 0..WARMUP / ROUNDS {
        f(i).await;
    }
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        f(i).await;
        samples.push(started.elapsed());
    }
    samples
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

/// Store data of the direct calls: an empty WASI context, nothing granted.
struct Bare {
    wasi: wasmtime_wasi::WasiCtx,
    table: wasmtime::component::ResourceTable,
}

impl wasmtime_wasi::WasiView for Bare {
    fn ctx(&mut self) -> wasmtime_wasi::WasiCtxView<'_> {
        wasmtime_wasi::WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
    }
}

/// Samples of `call`, synchronous, after the warm-up.
fn sample_sync(n: usize, mut call: impl FnMut(usize) -> wasmtime::Result<()>) -> wasmtime::Result<Vec<Duration>> {
    for i in 0..WARMUP / ROUNDS {
        call(i)?;
    }
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        call(i)?;
        samples.push(started.elapsed());
    }
    Ok(samples)
}

/// A component instantiated directly, without Levee's runtime: a plain
/// engine, a synchronous store, WASI with nothing granted.
struct Direct {
    store: wasmtime::Store<Bare>,
    admit: wasmtime::component::TypedFunc<(&'static Request, Load), (Admission,)>,
    scale: Option<wasmtime::component::TypedFunc<(ScaleSignals,), (ScaleDecision,)>>,
}

impl Direct {
    fn new(path: &str) -> wasmtime::Result<Direct> {
        use wasmtime::component::{Component, Linker};
        let mut config = wasmtime::Config::new();
        config.wasm_component_model(true);
        let engine = wasmtime::Engine::new(&config)?;
        let mut linker: Linker<Bare> = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
        linker.instance("levee:policy/runtime@0.1.0")?.func_wrap("now-ms", |_, (): ()| {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            Ok((now.as_millis() as u64,))
        })?;
        // The guests' standard library seeds its hash maps from here.
        linker
            .instance("wasi:random/insecure-seed@0.2.6")?
            .func_wrap("insecure-seed", |_, (): ()| Ok(((7u64, 11u64),)))?;
        let component = Component::from_file(&engine, path)?;
        linker.define_unknown_imports_as_traps(&component)?;
        let bare = Bare { wasi: wasmtime_wasi::WasiCtx::builder().build(), table: Default::default() };
        let mut store = wasmtime::Store::new(&engine, bare);
        let instance = linker.instantiate(&mut store, &component)?;
        let init = instance.get_typed_func::<(&str,), (Result<Manifest, String>,)>(&mut store, "init")?;
        let manifest = init.call(&mut store, ("{}",))?.0.map_err(wasmtime::Error::msg)?;
        let admit = instance.get_typed_func(&mut store, "admit")?;
        let scale = match manifest.hooks.contains(&Hook::Scale) {
            true => Some(instance.get_typed_func(&mut store, "scale")?),
            false => None,
        };
        Ok(Direct { store, admit, scale })
    }

    fn admits(&mut self, n: usize, requests: &'static [Request], load: Load) -> wasmtime::Result<Vec<Duration>> {
        let (store, admit) = (&mut self.store, &self.admit);
        sample_sync(n, |i| {
            black_box(admit.call(&mut *store, (&requests[i % requests.len()], load))?);
            Ok(())
        })
    }

    fn scales(&mut self, n: usize, signals: ScaleSignals) -> wasmtime::Result<Vec<Duration>> {
        let (store, scale) = (&mut self.store, self.scale.as_ref().expect("the guest declares scale"));
        sample_sync(n, |_| {
            black_box(scale.call(&mut *store, (signals,))?);
            Ok(())
        })
    }
}

fn us(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1e6)
}

fn row(name: &str, s: &Summary) {
    println!("| {name:<46} | {:>9} | {:>9} | {:>9} |", us(s.p50), us(s.p99), us(s.mean));
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime");
    runtime.block_on(async {
        let load = Load::default();
        let tenants: Vec<String> = (0..64).map(|i| format!("tenant-{i}")).collect();
        // The chain takes requests shared (as the pipeline holds them); the bare calls take them plain.
        let shared: &'static [std::sync::Arc<Request>] =
            tenants.iter().map(|t| request(t, "What is the capital of France?")).collect::<Vec<_>>().leak();
        let requests: &'static [Request] = shared.iter().map(|r| (**r).clone()).collect::<Vec<_>>().leak();

        let (noop, _) =
            start(vec![plugin("noop", guests::NOOP, json!({}))], runtime_settings(false)).await.expect("noop");
        let noop_chain = noop.policies.snapshot();
        let (bucket, _) =
            start(vec![plugin("bucket", guests::BUCKET, json!({}))], runtime_settings(false)).await.expect("bucket");
        let bucket_chain = bucket.policies.snapshot();
        let mut native = NativeBucket { buckets: logic::Buckets::new(1e12, 1e9) };
        let native_ptr = &mut native as *mut NativeBucket;
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
        let mut direct_noop = Direct::new(guests::NOOP).expect("direct no-op instance");
        let mut direct_bucket = Direct::new(guests::BUCKET).expect("direct bucket instance");
        let signals = levee_tests::signals(load);

        let n = SAMPLES / ROUNDS;
        let mut all: [Vec<Duration>; 7] = Default::default();
        for _ in 0..ROUNDS {
            for (slot, chain) in [(0, &noop_chain), (1, &bucket_chain)] {
                all[slot].extend(
                    measure(n, |i| {
                        let chain = chain.clone();
                        let req = &shared[i % shared.len()];
                        let load = &load;
                        async move {
                            black_box(chain.plugins()[0].admit(req, load).await.expect("admit"));
                        }
                    })
                    .await,
                );
            }
            all[2].extend(
                measure(n, |i| {
                    let req = &requests[i % requests.len()];
                    // SAFETY: the closure runs one future at a time to completion on this thread.
                    let native = unsafe { &mut *native_ptr };
                    let load = &load;
                    async move {
                        black_box(native.admit(black_box(req), load));
                    }
                })
                .await,
            );
            all[3].extend(
                measure(n, |i| {
                    let policies = noop.policies.clone();
                    let req = &shared[i % shared.len()];
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
                .await,
            );
            all[4].extend(direct_noop.admits(n, requests, load).expect("direct no-op admit"));
            all[5].extend(direct_bucket.admits(n, requests, load).expect("direct bucket admit"));
            all[6].extend(direct_noop.scales(n, signals).expect("direct no-op scale"));
        }
        let [noop_admit, wasm_bucket, native_bucket, full_chain, floor_noop, floor_bucket, floor_scale] =
            all.map(summarize);

        println!(
            "Plugin call costs ({SAMPLES} samples each in {ROUNDS} interleaved rounds, after {WARMUP} warm-up calls; µs)"
        );
        println!();
        println!("| {:<46} | {:>9} | {:>9} | {:>9} |", "measurement", "p50", "p99", "mean");
        println!("|{}|{}|{}|{}|", "-".repeat(48), "-".repeat(11), "-".repeat(11), "-".repeat(11));
        row("no-op plugin, one admit call", &noop_admit);
        row("token-bucket decision, Wasm plugin", &wasm_bucket);
        row("token-bucket decision, native twin", &native_bucket);
        row("full five-hook chain per request (no-op)", &full_chain);
        row("floor: no-op admit, bare wasmtime call", &floor_noop);
        row("floor: token-bucket admit, bare wasmtime call", &floor_bucket);
        row("floor: no-op scale (numbers in), bare call", &floor_scale);
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
        println!(
            "At the floor (bare synchronous wasmtime call, p50): no-op admit {} µs = {:.1}x the native decision, token bucket {} µs = {:.1}x, no-op scale {} µs = {:.1}x",
            us(floor_noop.p50),
            floor_noop.p50.as_secs_f64() / native_bucket.p50.as_secs_f64().max(1e-9),
            us(floor_bucket.p50),
            floor_bucket.p50.as_secs_f64() / native_bucket.p50.as_secs_f64().max(1e-9),
            us(floor_scale.p50),
            floor_scale.p50.as_secs_f64() / native_bucket.p50.as_secs_f64().max(1e-9),
        );
        println!(
            "Levee's runtime above the floor (p50): no-op {} µs, token bucket {} µs",
            us(noop_admit.p50.saturating_sub(floor_noop.p50)),
            us(wasm_bucket.p50.saturating_sub(floor_bucket.p50))
        );
        println!("Full chain per request (p50): {} µs   (goal: <= 50 µs)", us(full_chain.p50));
    });
}
