//! The CUDA backend against the CPU backend, on the default model and the
//! engine's correctness prompts (those of `reference.rs` and `paris.rs`).
//!
//! Every test first asks [`cuda::probe`] for a device and, without one,
//! prints `skipping: no CUDA device (...)` and passes, except the one that
//! checks what `--device cuda` and `--device auto` do on such a machine.
//!
//! With a device, allowing for bf16 (the CPU keeps f32 weights' exact
//! dequantized values and 8-bit activations, the GPU bf16 weights and
//! activations): fed the CPU's greedy tokens, the GPU picks the same next
//! token at >= 98% of positions; free-running greedy output is identical on
//! most prompts (the count is printed); batched results equal unbatched ones.

mod support;

use levee_gpu::backend::cuda::{self, CudaBackend, CudaOptions, KV_ELEM_BYTES};
use levee_gpu::backend::{self, Backend, BackendKind};
use levee_gpu::kv::{KvBudget, KvLayout};
const TOKENS: usize = 32;

use levee_gpu::{ChatMessage, Engine, EngineConfig, EngineError, GenerationRequest, Model};

/// Top-2 logit margin under which the GPU and the CPU may part on batching
/// noise: cuBLAS may sum in another order when the batch changes shape.
const NEAR_TIE: f32 = 0.02;

/// Whether a CUDA device can be used; prints why not when it cannot.
fn have_cuda(test: &str) -> bool {
    match cuda::probe() {
        Ok(found) => {
            println!("{test}: {found}");
            true
        }
        Err(reason) => {
            println!("skipping: no CUDA device ({reason})");
            false
        }
    }
}

/// The correctness prompts of `reference.rs` and `paris.rs`, tokenized.
fn correctness_prompts(model: &Model) -> Vec<Vec<u32>> {
    let chat = |q: &str| model.render_chat(&[ChatMessage::new("user", q)]).expect("template renders");
    let texts = [
        "The capital of France is".to_string(),
        "Once upon a time, in a small village by the sea, there lived".to_string(),
        chat("What is the capital of France?"),
        chat("Write a haiku about the ocean."),
        chat("Explain photosynthesis in one sentence."),
        chat("List three colors."),
    ];
    texts.iter().map(|t| model.tokenizer.encode(t)).collect()
}

fn layout(model: &Model, elem_bytes: usize) -> KvLayout {
    KvLayout::with_elem_bytes(&model.config, 16, KvBudget::Blocks(256), elem_bytes).expect("layout")
}

#[test]
fn device_cuda_fails_clearly_without_a_device_and_auto_falls_back() {
    let model = support::load_model();
    let config = |backend| EngineConfig { backend, ..support::small_config() };
    match cuda::probe() {
        Err(reason) => {
            println!("no CUDA device ({reason}): checking the errors and the fallback");
            let err = Engine::start(support::load_model(), config(BackendKind::Cuda)).err();
            let Some(EngineError::Start(message)) = err else { panic!("--device cuda must fail to start: {err:?}") };
            println!("--device cuda: {message}");
            assert!(message.contains("no CUDA device can be used"), "{message}");
            let engine = Engine::start(model, config(BackendKind::Auto)).expect("auto starts on the CPU");
            println!("--device auto: {} [{}]", engine.model().backend, engine.model().device_choice);
            assert!(engine.model().backend.starts_with("cpu"));
            assert!(engine.model().device_choice.contains("so the CPU backend runs"));
        }
        Ok(found) => {
            println!("{found}");
            let engine = Engine::start(model, config(BackendKind::Auto)).expect("auto starts");
            println!("--device auto: {} [{}]", engine.model().backend, engine.model().device_choice);
            assert!(engine.model().backend.starts_with("cuda:0"), "{}", engine.model().backend);
        }
    }
}

#[test]
fn teacher_forced_top1_agrees_with_the_cpu_and_greedy_output_matches_on_most_prompts() {
    if !have_cuda("teacher-forced agreement") {
        return;
    }
    let model = support::load_model();
    let vocab = model.config.vocab_size;
    let prompts = correctness_prompts(&model);

    let cpu_layout = layout(&model, levee_gpu::kv::KV_ELEM_BYTES);
    let mut cpu = backend::create(BackendKind::Cpu, &model, &cpu_layout, 0).expect("cpu backend");
    let cpu_free = support::forced_choices(cpu.as_mut(), &cpu_layout, vocab, &prompts, &[], TOKENS);
    let cpu_tokens: Vec<Vec<u32>> = cpu_free.iter().map(|r| r.iter().map(|t| t.0).collect()).collect();

    let gpu_layout = layout(&model, KV_ELEM_BYTES);
    let mut gpu = CudaBackend::new(&model, &gpu_layout, &CudaOptions::default()).expect("cuda backend");
    println!("backend: {}", gpu.name());
    let forced = support::forced_choices(&mut gpu, &gpu_layout, vocab, &prompts, &cpu_tokens, TOKENS);
    let (mut agree, mut total) = (0, 0);
    for (p, (want, got)) in cpu_free.iter().zip(&forced).enumerate() {
        for (i, (w, g)) in want.iter().zip(got).enumerate() {
            total += 1;
            if w.0 == g.0 {
                agree += 1;
            } else {
                println!("prompt {p} token {i}: cpu {} (margin {:.3}), cuda {} (margin {:.3})", w.0, w.1, g.0, g.1);
            }
        }
    }
    let rate = agree as f64 / total as f64;
    println!("teacher-forced top-1 agreement: {agree} of {total} ({:.1}%)", rate * 100.0);

    let gpu_free = support::forced_choices(&mut gpu, &gpu_layout, vocab, &prompts, &[], TOKENS);
    let identical =
        gpu_free.iter().zip(&cpu_tokens).filter(|(g, c)| g.iter().map(|t| t.0).eq(c.iter().copied())).count();
    for (p, (g, c)) in gpu_free.iter().zip(&cpu_tokens).enumerate() {
        let g: Vec<u32> = g.iter().map(|t| t.0).collect();
        let text = model.tokenizer.decode(&g);
        match g.iter().zip(c).position(|(a, b)| a != b) {
            None => println!("prompt {p}: identical: {text:?}"),
            Some(i) => println!("prompt {p}: parts at token {i} (cuda margin {:.3}): {text:?}", gpu_free[p][i].1),
        }
    }
    println!("free-running greedy: {identical} of {} prompts identical to the CPU over {TOKENS} tokens", prompts.len());
    assert!(rate >= 0.98, "teacher-forced top-1 agreement {:.1}% is under 98%", rate * 100.0);
    assert!(2 * identical > prompts.len(), "only {identical} of {} prompts are identical", prompts.len());
}

#[test]
fn batched_results_equal_unbatched_ones_on_cuda() {
    if !have_cuda("batched vs unbatched") {
        return;
    }
    let config =
        EngineConfig { backend: BackendKind::Cuda, kv_budget: KvBudget::Blocks(512), ..EngineConfig::default() };
    let engine = Engine::start(support::load_model(), config).expect("engine starts on CUDA");
    println!("backend: {} [{}]", engine.model().backend, engine.model().device_choice);
    let requests: Vec<GenerationRequest> = support::prompts(16)
        .iter()
        .map(|p| {
            let mut r = GenerationRequest::new(engine.tokenizer().encode(p), 24);
            r.sampling.ignore_eos = true;
            r
        })
        .collect();
    // Alone, with log-probabilities: logits come back and the host picks.
    let alone: Vec<_> = requests
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.sampling.logprobs = Some(2);
            engine.submit(r).expect("accepted").blocking_collect().expect("completes").0
        })
        .collect();
    // All at once, plain greedy: the device picks and only ids come back.
    let streams: Vec<_> = requests.iter().map(|r| engine.submit(r.clone()).expect("accepted")).collect();
    let batched: Vec<Vec<u32>> = streams
        .into_iter()
        .map(|s| s.blocking_collect().expect("completes").0.iter().map(|t| t.id).collect())
        .collect();
    let mut equal = 0;
    let mut not_ties = Vec::new();
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        let ids: Vec<u32> = a.iter().map(|t| t.id).collect();
        match ids.iter().zip(b).position(|(x, y)| x != y) {
            None => equal += 1,
            Some(at) => {
                let margin = a[at].logprobs.as_ref().map_or(f32::NAN, |l| l.top[0].1 - l.top[1].1);
                println!(
                    "request {i} parts at token {at}: alone {} (top-2 margin {margin:.4}), batched {}",
                    ids[at], b[at]
                );
                if margin.is_nan() || margin >= NEAR_TIE {
                    not_ties.push((i, at, margin));
                }
            }
        }
    }
    println!("batched == unbatched: {equal} of {} requests", alone.len());
    assert!(not_ties.is_empty(), "batched results differ where the choice is not a near-tie: {not_ties:?}");
    let stats = engine.stats();
    println!("stats: {stats:?}");
    assert_eq!(
        stats.kv_block_bytes,
        support::shared_model().config.n_layers * 2 * support::shared_model().config.kv_width() * 16 * KV_ELEM_BYTES
    );
}

#[test]
fn kv_cache_takes_the_configured_fraction_of_free_device_memory() {
    if !have_cuda("KV sizing") {
        return;
    }
    let config = EngineConfig { backend: BackendKind::Cuda, kv_device_fraction: Some(0.05), ..EngineConfig::default() };
    let engine = Engine::start(support::load_model(), config).expect("engine starts on CUDA");
    let stats = engine.stats();
    let bytes = (stats.kv_free_blocks + stats.kv_used_blocks) * stats.kv_block_bytes;
    println!("KV cache: {} blocks of {} bytes = {} MiB", stats.kv_free_blocks, stats.kv_block_bytes, bytes >> 20);
    assert!(bytes > 64 << 20, "5% of a GPU's free memory is more than 64 MiB: {stats:?}");
    let prompt = engine.tokenizer().encode("The capital of France is");
    let (tokens, _) =
        engine.submit(GenerationRequest::new(prompt, 8)).expect("accepted").blocking_collect().expect("completes");
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    println!("completion: {text:?}");
    assert!(text.contains("Paris"), "completion was {text:?}");
}
