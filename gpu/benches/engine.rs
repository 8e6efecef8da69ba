//! Engine benchmark: one run, one engine configuration, one variable-length
//! workload, printed as a table of ratios.
//!
//! - output tokens/s with continuous batching vs static batching (a batch
//!   runs until its longest member finishes: members are padded to the
//!   longest length, padding counted as work but not as output) vs one
//!   request at a time;
//! - time to first token p50/p99 under continuous batching;
//! - sequences the paged KV cache holds vs contiguous max-length allocation
//!   of the same memory;
//! - single-stream decode and prompt tokens/s.
//!
//! Run: `scripts/fetch-model.sh && cargo bench -p levee-gpu --bench engine`
//! (`LEVEE_BENCH_REQUESTS` sets the workload size, 24 by default).

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
    let requests: usize = std::env::var("LEVEE_BENCH_REQUESTS").ok().and_then(|v| v.parse().ok()).unwrap_or(24);
    let config = EngineConfig {
        threads: 2,
        max_running: CONCURRENCY,
        max_context: Some(MAX_CONTEXT),
        kv_budget: KvBudget::Bytes(256 << 20),
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, config)?;
    println!("backend: {}", engine.model().backend);
    println!("load average before the run: {}", std::fs::read_to_string("/proc/loadavg").unwrap_or_default().trim());
    let jobs = workload(&engine, requests);
    let useful: usize = jobs.iter().map(|j| j.output).sum();
    println!(
        "workload: {requests} requests, prompts {}-{} tokens, outputs {}-{} tokens ({useful} output tokens in all), concurrency {CONCURRENCY}\n",
        jobs.iter().map(|j| j.prompt.len()).min().unwrap_or(0),
        jobs.iter().map(|j| j.prompt.len()).max().unwrap_or(0),
        jobs.iter().map(|j| j.output).min().unwrap_or(0),
        jobs.iter().map(|j| j.output).max().unwrap_or(0),
    );

    let started = Instant::now();
    let done = run_all(&engine, &jobs, |j| j.output)?;
    let continuous = useful as f64 / started.elapsed().as_secs_f64();
    let mut ttft: Vec<Duration> = done.iter().map(|c| c.timing.time_to_first_token).collect();
    ttft.sort();

    let started = Instant::now();
    for batch in jobs.chunks(CONCURRENCY) {
        let longest = batch.iter().map(|j| j.output).max().unwrap_or(1);
        run_all(&engine, batch, |_| longest)?;
    }
    let static_tps = useful as f64 / started.elapsed().as_secs_f64();

    let started = Instant::now();
    for job in &jobs {
        run_all(&engine, std::slice::from_ref(job), |j| j.output)?;
    }
    let single_tps = useful as f64 / started.elapsed().as_secs_f64();

    let (decode_tps, prompt_tps) = single_stream(&engine)?;

    println!("| measure | value |");
    println!("|---|---|");
    println!("| continuous batching, output tokens/s | {continuous:.1} |");
    println!("| static batching (batches of {CONCURRENCY}), output tokens/s | {static_tps:.1} |");
    println!("| one request at a time, output tokens/s | {single_tps:.1} |");
    println!("| continuous / static | {:.2}x |", continuous / static_tps);
    println!("| continuous / one at a time | {:.2}x |", continuous / single_tps);
    println!(
        "| time to first token p50 / p99 (continuous) | {:.0} ms / {:.0} ms |",
        pct(&ttft, 0.50),
        pct(&ttft, 0.99)
    );
    let (paged, contiguous) = capacity(&engine, &jobs);
    println!("| sequences held, paged KV (16-token blocks) | {paged} |");
    println!("| sequences held, contiguous {MAX_CONTEXT}-token allocation | {contiguous} |");
    println!("| paged / contiguous | {:.1}x |", paged as f64 / contiguous.max(1) as f64);
    println!("| single-stream decode, tokens/s | {decode_tps:.1} |");
    println!("| single-stream prompt processing, tokens/s | {prompt_tps:.1} |");
    println!("| candle-transformers quantized_llama, single-stream decode, tokens/s | {candle_tps:.1} |");
    Ok(())
}

/// Prompts of ~10 to ~130 tokens and outputs of 16 to 256 tokens, fixed by a simple generator.
fn workload(engine: &EngineHandle, n: usize) -> Vec<Job> {
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
            Job { prompt: engine.tokenizer().encode(&prompt_text.join(" ")), output: 16 + next(241) }
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
