//! Engine benchmark: one run, one engine configuration, two variable-length
//! workloads (outputs of 16 to 256 tokens, and long-tailed chat-like outputs
//! of 8 to 768 tokens), printed as tables of ratios.
//!
//! - for each workload, output tokens/s with continuous batching vs static batching (a batch
//!   runs until its longest member finishes: members are padded to the
//!   longest length, padding counted as work but not as output) vs one
//!   request at a time;
//! - time to first token p50/p99 under continuous batching;
//! - sequences the paged KV cache holds vs contiguous max-length allocation
//!   of the same memory;
//! - single-stream decode and prompt tokens/s, against candle-transformers'
//!   `quantized_llama` and (when `scripts/bench/install-llama-cpp.sh` has
//!   built it) llama.cpp on the same file, measured before Levee starts.
//!
//! Run: `scripts/fetch-model.sh && cargo bench -p levee-gpu --bench engine`
//! (`LEVEE_BENCH_REQUESTS` sets the size of each workload, 32 by default).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use levee_gpu::{Completion, Engine, EngineConfig, EngineHandle, GenerationRequest, KvBudget, Model};

const CONCURRENCY: usize = 16;
const MAX_CONTEXT: usize = 2048;

struct Job {
    prompt: Vec<u32>,
    output: usize,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let model = Model::load(&path).map_err(|e| format!("{e} (run scripts/fetch-model.sh)"))?;
    // Before Levee's threads exist, so the two runtimes never share the cores.
    let candle_tps = candle_decode(&path)?;
    let llama_cpp = llama_cpp_speed(&path);
    let requests: usize = std::env::var("LEVEE_BENCH_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(32);
    let config = EngineConfig {
        threads: 2,
        max_running: CONCURRENCY,
        max_context: Some(MAX_CONTEXT),
        // Room for a whole static batch of the longest chat-like outputs
        // (16 x ~730 tokens x 45 KiB), so that no mode is slowed by preemption.
        kv_budget: KvBudget::Bytes(768 << 20),
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, config)?;
    println!("backend: {}", engine.model().backend);
    println!("load average before the run: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    let narrow = workload(&engine, requests, |u| 16 + (u * 241.0) as usize);
    // Long-tailed, as response lengths of chat traffic are: log-uniform from 8 to 768.
    let chat = workload(&engine, requests, |u| (8.0 * 96f64.powf(u)).round() as usize);
    let mut runs = Vec::new();
    for (name, jobs) in [("narrow", &narrow), ("chat-like", &chat)] {
        let useful: usize = jobs.iter().map(|j| j.output).sum();
        println!(
            "workload {name}: {requests} requests, prompts {}-{} tokens, outputs {}-{} tokens (mean {:.0}, {useful} in all), concurrency {CONCURRENCY}",
            jobs.iter().map(|j| j.prompt.len()).min().unwrap_or(0),
            jobs.iter().map(|j| j.prompt.len()).max().unwrap_or(0),
            jobs.iter().map(|j| j.output).min().unwrap_or(0),
            jobs.iter().map(|j| j.output).max().unwrap_or(0),
            useful as f64 / jobs.len().max(1) as f64,
        );
        runs.push(measure(&engine, jobs)?);
    }
    println!();
    let (decode_tps, prompt_tps) = single_stream(&engine)?;

    println!("| measure | narrow | chat-like |");
    println!("|---|---|---|");
    let row = |what: &str, f: &dyn Fn(&Run) -> String| println!("| {what} | {} | {} |", f(&runs[0]), f(&runs[1]));
    row("continuous batching, output tokens/s", &|r| format!("{:.1}", r.continuous));
    row(&format!("static batching (batches of {CONCURRENCY}), output tokens/s"), &|r| format!("{:.1}", r.static_tps));
    row("one request at a time, output tokens/s", &|r| format!("{:.1}", r.single));
    row("continuous / static", &|r| format!("{:.2}x", r.continuous / r.static_tps));
    row("continuous / one at a time", &|r| format!("{:.2}x", r.continuous / r.single));
    row("time to first token p50 / p99 (continuous)", &|r| {
        format!("{:.0} ms / {:.0} ms", pct(&r.ttft, 0.50), pct(&r.ttft, 0.99))
    });
    row("preemptions (all three modes)", &|r| r.preemptions.to_string());
    println!();
    println!("| measure | value |");
    println!("|---|---|");
    let (paged, contiguous) = capacity(&engine, &narrow);
    println!("| sequences held, paged KV (16-token blocks) | {paged} |");
    println!("| sequences held, contiguous {MAX_CONTEXT}-token allocation | {contiguous} |");
    println!("| paged / contiguous | {:.1}x |", paged as f64 / contiguous.max(1) as f64);
    println!("| single-stream decode, tokens/s | {decode_tps:.1} |");
    println!("| single-stream prompt processing, tokens/s | {prompt_tps:.1} |");
    println!("| candle-transformers quantized_llama, single-stream decode, tokens/s | {candle_tps:.1} |");
    match llama_cpp {
        Ok(l) => {
            println!(
                "| llama.cpp (llama-cpp-python {}, 2 threads), single-stream decode, tokens/s | {:.1} |",
                l.version, l.decode_tps
            );
            println!(
                "| llama.cpp (llama-cpp-python {}, 2 threads), prompt processing, tokens/s | {:.1} |",
                l.version, l.prompt_tps
            );
            println!("| Levee / llama.cpp, decode | {:.2}x |", decode_tps / l.decode_tps);
            println!("| Levee / llama.cpp, prompt processing | {:.2}x |", prompt_tps / l.prompt_tps);
        }
        Err(why) => println!("\nllama.cpp not measured: {why}"),
    }
    Ok(())
}

/// Throughput of one workload three ways, and time to first token under continuous batching.
struct Run {
    continuous: f64,
    static_tps: f64,
    single: f64,
    ttft: Vec<Duration>,
    /// Preemptions during the three measurements.
    preemptions: u64,
}

/// The engine's preemption count once the last step's figures are published.
fn preemptions(engine: &EngineHandle) -> u64 {
    std::thread::sleep(Duration::from_millis(50));
    engine.stats().preemptions
}

fn measure(engine: &EngineHandle, jobs: &[Job]) -> Result<Run, Box<dyn std::error::Error>> {
    let useful: usize = jobs.iter().map(|j| j.output).sum();
    let preempted_before = preemptions(engine);
    let started = Instant::now();
    let done = run_all(engine, jobs, |j| j.output)?;
    let continuous = useful as f64 / started.elapsed().as_secs_f64();
    let mut ttft: Vec<Duration> = done.iter().map(|c| c.timing.time_to_first_token).collect();
    ttft.sort();

    let started = Instant::now();
    for batch in jobs.chunks(CONCURRENCY) {
        let longest = batch.iter().map(|j| j.output).max().unwrap_or(1);
        run_all(engine, batch, |_| longest)?;
    }
    let static_tps = useful as f64 / started.elapsed().as_secs_f64();

    let started = Instant::now();
    for job in jobs {
        run_all(engine, std::slice::from_ref(job), |j| j.output)?;
    }
    let single = useful as f64 / started.elapsed().as_secs_f64();
    let preemptions = preemptions(engine) - preempted_before;
    Ok(Run { continuous, static_tps, single, ttft, preemptions })
}

/// Prompts of ~10 to ~130 tokens; each output length is `output(u)` for `u`
/// uniform in [0, 1), all fixed by a simple generator.
fn workload(engine: &EngineHandle, n: usize, output: impl Fn(f64) -> usize) -> Vec<Job> {
    let text = "The history of science is the study of the development of science and scientific knowledge, \
        including both the natural and social sciences. Science is a body of empirical, theoretical, and \
        practical knowledge about the natural world, produced by scientists who emphasize the observation, \
        explanation, and prediction of real-world phenomena. ";
    let words: Vec<&str> = text.split(' ').collect();
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |m: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % m as u64) as usize
    };
    (0..n)
        .map(|_| {
            let words_n = 4 + next(96);
            let prompt_text: Vec<&str> = words.iter().cycle().take(words_n).copied().collect();
            let u = next(1 << 20) as f64 / (1 << 20) as f64;
            Job { prompt: engine.tokenizer().encode(&prompt_text.join(" ")), output: output(u) }
        })
        .collect()
}

/// Submits every job at once and waits for all; `len` gives each job's generation length.
fn run_all(
    engine: &EngineHandle,
    jobs: &[Job],
    len: impl Fn(&Job) -> usize,
) -> Result<Vec<Completion>, Box<dyn std::error::Error>> {
    let streams = jobs
        .iter()
        .map(|j| {
            let mut r = GenerationRequest::new(j.prompt.clone(), len(j));
            r.sampling.ignore_eos = true;
            engine.submit(r)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(streams.into_iter().map(|s| s.blocking_collect().map(|r| r.1)).collect::<Result<Vec<_>, _>>()?)
}

/// Decode tokens/s (after the first token) and prompt tokens/s of one stream.
fn single_stream(engine: &EngineHandle) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let short = engine.tokenizer().encode("Write a long story about the sea.");
    let mut r = GenerationRequest::new(short, 128);
    r.sampling.ignore_eos = true;
    let (_, done) = engine.submit(r)?.blocking_collect()?;
    let decode = 1.0 / done.timing.time_per_output_token.as_secs_f64();
    let long_text = "The quick brown fox jumps over the lazy dog. ".repeat(50);
    let long = engine.tokenizer().encode(&long_text);
    let n = long.len();
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let (_, done) = engine.submit(GenerationRequest::new(long.clone(), 1))?.blocking_collect()?;
        best = best.min(done.timing.time_to_first_token);
    }
    Ok((decode, n as f64 / best.as_secs_f64()))
}

/// Decode tokens/s of candle-transformers' `quantized_llama` on the same file
/// (same machine, same moment): the reference CPU runtime at hand.
fn candle_decode(path: &std::path::Path) -> Result<f64, Box<dyn std::error::Error>> {
    use candle_core::quantized::gguf_file;
    use candle_core::{Device, Tensor};
    use candle_transformers::models::quantized_llama::ModelWeights;
    let mut file = std::fs::File::open(path)?;
    let content = gguf_file::Content::read(&mut file)?;
    let mut model = ModelWeights::from_gguf(content, &mut file, &Device::Cpu)?;
    let prompt = [504u32, 3575, 282, 4649, 314];
    let mut logits = model.forward(&Tensor::new(&prompt[..], &Device::Cpu)?.unsqueeze(0)?, 0)?;
    let steps = 64;
    let started = Instant::now();
    for i in 0..steps {
        let next = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
        logits = model.forward(&Tensor::new(&[next], &Device::Cpu)?.unsqueeze(0)?, prompt.len() + i)?;
    }
    Ok(steps as f64 / started.elapsed().as_secs_f64())
}

/// llama.cpp's single-stream speed on the same file, through
/// `scripts/bench/llama_cpp_speed.py` in the environment that
/// `scripts/bench/install-llama-cpp.sh` builds (or `LEVEE_LLAMA_CPP_PYTHON`).
struct LlamaCpp {
    version: String,
    decode_tps: f64,
    prompt_tps: f64,
}

fn llama_cpp_speed(model: &std::path::Path) -> Result<LlamaCpp, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = std::env::var_os("LEVEE_LLAMA_CPP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv-bench/bin/python"));
    if !python.exists() {
        return Err(format!("{} is missing (run scripts/bench/install-llama-cpp.sh)", python.display()));
    }
    let out = std::process::Command::new(&python)
        .arg(root.join("scripts/bench/llama_cpp_speed.py"))
        .arg(model)
        .arg("2")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!("llama_cpp_speed.py failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value =
        serde_json::from_str(line.trim()).map_err(|e| format!("llama_cpp_speed.py printed {line:?}: {e}"))?;
    let number = |k: &str| json[k].as_f64().ok_or_else(|| format!("llama_cpp_speed.py printed no {k}"));
    Ok(LlamaCpp {
        version: json["version"].as_str().unwrap_or("?").to_string(),
        decode_tps: number("decode_tps")?,
        prompt_tps: number("prompt_tps")?,
    })
}

/// Sequences of this workload that fit in the engine's KV memory: paged
/// (whole blocks per actual length) vs contiguous (max context each).
fn capacity(engine: &EngineHandle, jobs: &[Job]) -> (usize, usize) {
    let stats = engine.stats();
    let blocks = stats.kv_used_blocks + stats.kv_free_blocks;
    let bs = stats.kv_block_size;
    let mean_blocks =
        jobs.iter().map(|j| (j.prompt.len() + j.output).div_ceil(bs)).sum::<usize>() as f64 / jobs.len() as f64;
    let paged = (blocks as f64 / mean_blocks) as usize;
    let contiguous = blocks * bs / MAX_CONTEXT;
    (paged, contiguous)
}

fn pct(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}
