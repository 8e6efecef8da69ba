//! CUDA benchmark: one run on one GPU, printed as one table.
//!
//! - decode tokens/s at batch 1, 16, 64 and 256 (greedy, ids picked on the
//!   device), each step's time split into device time (CUDA events around
//!   the step's launches) and host time (the rest of the step's wall time);
//! - the memory-bandwidth bound at the same batch: a device-to-device copy's
//!   bandwidth, measured in the same run, over the bytes a decode step must
//!   read (every weight once, each sequence's cached keys and values), times
//!   the batch; and the fraction of it reached;
//! - time to first token through the engine (one request alone, and the
//!   median of 64 arriving at once) and the engine's own decode tokens/s
//!   at 64 sequences (batcher and streaming included).
//!
//! Lines starting `LEVEE ` are for `scripts/gpu/run.sh`, which sets them
//! beside PyTorch's figures. Without a device it prints why and exits 0.
//!
//! Run: `cargo bench -p levee-gpu --bench cuda` (`LEVEE_BENCH_STEPS` decode
//! steps per batch, 64 by default).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use levee_gpu::backend::cuda::{self, CudaBackend, CudaOptions, KV_ELEM_BYTES, sizing};
use levee_gpu::backend::{Backend, BackendKind, SeqChunk, StepBatch};
use levee_gpu::kv::{BlockPool, BlockTable, KvBudget, KvLayout};
use levee_gpu::{Engine, EngineConfig, GenerationRequest, Model};

const BATCHES: [usize; 4] = [1, 16, 64, 256];
const WARMUP: usize = 4;
/// Most prompt tokens in one prefill step.
const PREFILL_TOKENS: usize = 4096;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(reason) = cuda::probe() {
        println!("skipping: no CUDA device ({reason})");
        return Ok(());
    }
    // LEVEE_MODEL: the binary runs on another machine (scripts/gpu/run.sh).
    let path = std::env::var_os("LEVEE_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let model = Model::load(&path).map_err(|e| format!("{e} (run scripts/fetch-model.sh)"))?;
    let steps: usize = std::env::var("LEVEE_BENCH_STEPS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let text = "The history of science is the study of the development of science and scientific knowledge, \
        including both the natural and social sciences. Science is a body of empirical, theoretical, and \
        practical knowledge about the natural world.";
    let prompt = model.tokenizer.encode(text);
    let max_len = prompt.len() + WARMUP + steps + 1;

    let per_seq = max_len.div_ceil(16);
    let layout = KvLayout::with_elem_bytes(&model.config, 16, KvBudget::Blocks(per_seq * 256), KV_ELEM_BYTES)
        .ok_or("no KV layout")?;
    let options = CudaOptions { max_batch_tokens: PREFILL_TOKENS, max_seqs: 256, ..CudaOptions::default() };
    let mut gpu = CudaBackend::new(&model, &layout, &options)?;
    println!("backend: {}", gpu.name());
    let bandwidth = gpu.copy_bandwidth(2 << 30)?;
    let weights = gpu.weight_bytes_per_step();
    println!(
        "model: {} ({} layers, hidden {}), {} MB of weights read per step; prompt {} tokens, {steps} decode steps per batch",
        model.source,
        model.config.n_layers,
        model.config.hidden,
        weights / 1_000_000,
        prompt.len()
    );
    println!("device-to-device copy bandwidth (read + write): {:.0} GB/s\n", bandwidth / 1e9);
    println!("LEVEE bandwidth bytes_per_s={bandwidth:.0}");
    println!("LEVEE prompt_ids={}", join(&prompt));

    println!(
        "| batch | decode tokens/s | step ms | device ms | host ms | MB read per step | bound tokens/s | of bound |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut ttft_alone = Duration::ZERO;
    for &b in &BATCHES {
        let r = decode(&mut gpu, &layout, &prompt, b, steps)?;
        if b == 1 {
            ttft_alone = r.prefill;
            println!("LEVEE greedy_ids={}", join(&r.first_tokens));
        }
        let mid = prompt.len() + WARMUP + steps / 2;
        let bytes = sizing::decode_bytes_per_step(weights, layout.token_bytes(), &vec![mid; b]);
        let bound = sizing::bound_tokens_per_s(bandwidth, bytes, b);
        let per = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
        println!(
            "| {b} | {:.0} | {:.3} | {:.3} | {:.3} | {:.1} | {:.0} | {:.0}% |",
            r.tokens_per_s,
            per(r.wall),
            per(r.device),
            per(r.wall.saturating_sub(r.device)),
            bytes as f64 / 1e6,
            bound,
            100.0 * r.tokens_per_s / bound
        );
        println!(
            "LEVEE decode batch={b} tokens_per_s={:.1} bound_tokens_per_s={bound:.1} device_ms={:.4} host_ms={:.4}",
            r.tokens_per_s,
            per(r.device),
            per(r.wall.saturating_sub(r.device))
        );
    }
    println!(
        "\nprefill of one {}-token prompt on the backend (time to first token, no queue): {:.2} ms",
        prompt.len(),
        ttft_alone.as_secs_f64() * 1e3
    );
    drop(gpu);
    engine_figures(model, &prompt)?;
    Ok(())
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

struct Decode {
    /// The first 16 generated tokens of sequence 0.
    first_tokens: Vec<u32>,
    tokens_per_s: f64,
    wall: Duration,
    device: Duration,
    prefill: Duration,
}

/// Prefills `batch` copies of `prompt`, then times `steps` greedy decode steps of all of them.
fn decode(
    gpu: &mut CudaBackend,
    layout: &KvLayout,
    prompt: &[u32],
    batch: usize,
    steps: usize,
) -> Result<Decode, Box<dyn std::error::Error>> {
    let mut pool = BlockPool::new(layout.num_blocks);
    let total = prompt.len() + WARMUP + steps + 1;
    let tables: Vec<BlockTable> = (0..batch)
        .map(|_| {
            let mut t = BlockTable::default();
            t.reserve(layout, &mut pool, total).then_some(t).ok_or("KV pool too small")
        })
        .collect::<Result<_, _>>()?;
    let mut seqs: Vec<Vec<u32>> = vec![prompt.to_vec(); batch];
    let mut picked = Vec::new();
    let per_step = (PREFILL_TOKENS / prompt.len()).max(1);
    let started = Instant::now();
    for group in (0..batch).collect::<Vec<_>>().chunks(per_step) {
        let chunks = group
            .iter()
            .map(|&i| SeqChunk { tokens: &seqs[i], start_pos: 0, block_table: tables[i].blocks(), wants_logits: true })
            .collect();
        gpu.forward_greedy(&StepBatch { seqs: chunks }, &mut picked)?;
        for (&i, &t) in group.iter().zip(&picked) {
            seqs[i].push(t);
        }
    }
    let prefill = started.elapsed();
    let (mut wall, mut device) = (Duration::ZERO, Duration::ZERO);
    for step in 0..WARMUP + steps {
        let chunks = seqs
            .iter()
            .zip(&tables)
            .map(|(s, t)| SeqChunk {
                tokens: &s[s.len() - 1..],
                start_pos: s.len() - 1,
                block_table: t.blocks(),
                wants_logits: true,
            })
            .collect();
        let t0 = Instant::now();
        gpu.forward_greedy(&StepBatch { seqs: chunks }, &mut picked)?;
        if step >= WARMUP {
            wall += t0.elapsed();
            device += gpu.last_step_device_time().unwrap_or_default();
        }
        for (s, &t) in seqs.iter_mut().zip(&picked) {
            s.push(t);
        }
    }
    let first_tokens = seqs[0][prompt.len()..].iter().take(16).copied().collect();
    Ok(Decode { first_tokens, tokens_per_s: (batch * steps) as f64 / wall.as_secs_f64(), wall, device, prefill })
}

/// Time to first token and decode tokens/s through the engine (batcher,
/// sampling and streaming included).
fn engine_figures(model: Model, prompt: &[u32]) -> Result<(), Box<dyn std::error::Error>> {
    let config = EngineConfig {
        backend: BackendKind::Cuda,
        kv_budget: KvBudget::Bytes(2 << 30),
        max_running: 64,
        max_batch_tokens: 4096,
        prefill_chunk: 512,
        ..EngineConfig::default()
    };
    let engine = Engine::start(model, config)?;
    let request = |n: usize| {
        let mut r = GenerationRequest::new(prompt.to_vec(), n);
        r.sampling.ignore_eos = true;
        r
    };
    let mut alone = Duration::MAX;
    for _ in 0..5 {
        let (_, done) = engine.submit(request(1))?.blocking_collect()?;
        alone = alone.min(done.timing.time_to_first_token);
    }
    let new_tokens = 128;
    let started = Instant::now();
    let streams = (0..64).map(|_| engine.submit(request(new_tokens))).collect::<Result<Vec<_>, _>>()?;
    let mut ttft: Vec<Duration> = Vec::new();
    for s in streams {
        ttft.push(s.blocking_collect()?.1.timing.time_to_first_token);
    }
    let elapsed = started.elapsed();
    ttft.sort();
    let p50 = ttft[ttft.len() / 2];
    let tps = (64 * new_tokens) as f64 / elapsed.as_secs_f64();
    println!("engine, time to first token, one request alone (best of 5): {:.2} ms", alone.as_secs_f64() * 1e3);
    println!("engine, time to first token, median of 64 arriving at once: {:.2} ms", p50.as_secs_f64() * 1e3);
    println!("engine, 64 requests of {new_tokens} tokens, output tokens/s (prefill included): {tps:.0}");
    println!("LEVEE ttft_ms alone={:.3} p50_of_64={:.3}", alone.as_secs_f64() * 1e3, p50.as_secs_f64() * 1e3);
    println!("LEVEE engine batch=64 tokens_per_s={tps:.1}");
    Ok(())
}
