//! Continuous batching does not change results, priorities hold under KV
//! pressure, and every request ends with its tokens or a distinct error.

mod support;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use levee_gpu::{
    Engine, EngineConfig, EngineError, EngineHandle, GenerationRequest, KvBudget, SamplingParams, TokenEvent,
};

const NEW_TOKENS: usize = 24;

fn ids(engine: &EngineHandle, request: GenerationRequest) -> (Vec<u32>, u32) {
    let (tokens, done) = engine.submit(request).expect("accepted").blocking_collect().expect("completes");
    (tokens.iter().map(|t| t.id).collect(), done.timing.preemptions)
}

fn requests(engine: &EngineHandle) -> Vec<GenerationRequest> {
    support::prompts(16)
        .iter()
        .map(|p| {
            let mut r = GenerationRequest::new(engine.tokenizer().encode(p), NEW_TOKENS);
            // Never stop early, so every sequence runs its full length.
            r.sampling.ignore_eos = true;
            r
        })
        .collect()
}

/// Stats once the engine is idle (they are published once per step, just
/// after that step's events reach the clients).
fn settled(engine: &EngineHandle) -> levee_gpu::EngineStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    while (engine.stats().running > 0 || engine.stats().kv_used_blocks > 0) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
    }
    engine.stats()
}

/// Runs all requests at once, each on its own thread; returns ids and preemption counts.
fn concurrently(engine: &EngineHandle, requests: Vec<GenerationRequest>) -> Vec<(Vec<u32>, u32)> {
    let streams: Vec<_> = requests.into_iter().map(|r| engine.submit(r).expect("accepted")).collect();
    streams
        .into_iter()
        .map(|s| {
            let (tokens, done) = s.blocking_collect().expect("completes");
            (tokens.iter().map(|t| t.id).collect(), done.timing.preemptions)
        })
        .collect()
}

#[test]
fn handles_are_cheap_to_share_across_threads() {
    fn shareable<T: Clone + Send + Sync + 'static>() {}
    shareable::<EngineHandle>();
}

#[test]
fn greedy_results_are_the_same_alone_batched_and_after_preemption() {
    let engine = Engine::start(support::load_model(), support::small_config()).expect("engine starts");
    let reqs = requests(&engine);
    let alone: Vec<Vec<u32>> = reqs.iter().map(|r| ids(&engine, r.clone()).0).collect();
    let batched = concurrently(&engine, reqs.clone());
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a, &b.0, "request {i} differs when batched with 15 others");
    }
    let stats = settled(&engine);
    println!("stats after 32 requests: {stats:?}");
    assert_eq!(stats.sequences_started, 32);
    assert_eq!(stats.generated_tokens, 32 * NEW_TOKENS as u64);
    assert_eq!((stats.running, stats.queue_depth, stats.kv_used_blocks), (0, 0, 0));
    assert!(stats.steps > 0 && stats.kv_free_blocks == 256);

    // A cache of 12 blocks (192 positions) cannot hold 16 sequences of ~40
    // tokens: sequences are preempted, recomputed, and must not change.
    let tight = EngineConfig { kv_budget: KvBudget::Blocks(12), ..support::small_config() };
    let engine = Engine::start(support::load_model(), tight).expect("engine starts");
    let squeezed = concurrently(&engine, reqs);
    let preempted: u32 = squeezed.iter().map(|s| s.1).sum();
    println!("preemptions under a 12-block cache: {preempted}");
    assert!(preempted > 0, "the tight cache should have forced preemption");
    for (i, (a, b)) in alone.iter().zip(&squeezed).enumerate() {
        assert_eq!(a, &b.0, "request {i} differs after preemption ({} preemptions)", b.1);
    }
    assert_eq!(settled(&engine).kv_used_blocks, 0, "finished sequences return their blocks");
}

#[test]
fn chunked_prefill_under_a_small_token_budget_gives_the_same_tokens() {
    let whole = Engine::start(support::load_model(), support::small_config()).expect("engine starts");
    let reqs: Vec<GenerationRequest> = support::prompts(36)[32..]
        .iter()
        .map(|p| {
            let mut r = GenerationRequest::new(whole.tokenizer().encode(p), 12);
            r.sampling.ignore_eos = true;
            r
        })
        .collect();
    assert!(reqs.iter().all(|r| r.prompt.len() > 14), "prompts long enough to need chunks");
    let expected: Vec<Vec<u32>> = reqs.iter().map(|r| ids(&whole, r.clone()).0).collect();
    // Prompts run 7 tokens at a time within 16-token steps.
    let chunked = EngineConfig { prefill_chunk: 7, max_batch_tokens: 16, ..support::small_config() };
    let engine = Engine::start(support::load_model(), chunked).expect("engine starts");
    let got = concurrently(&engine, reqs);
    for (i, (a, b)) in expected.iter().zip(&got).enumerate() {
        assert_eq!(a, &b.0, "request {i} differs when its prompt is chunked");
    }
}

#[test]
fn high_priority_requests_finish_first_and_none_is_lost() {
    let config = EngineConfig { kv_budget: KvBudget::Blocks(10), max_batch_tokens: 64, ..support::small_config() };
    let engine = Engine::start(support::load_model(), config).expect("engine starts");
    let prompt = engine.tokenizer().encode("Write a short story about a robot who learns to paint.");
    let mut handles = Vec::new();
    let start = Instant::now();
    // Low priority first, so they hold the cache when the urgent ones arrive.
    for (i, priority) in [5, 5, 5, 5, 5, 5, 0, 0].into_iter().enumerate() {
        let mut r = GenerationRequest::new(prompt.clone(), 32);
        r.priority = priority;
        r.sampling.ignore_eos = true;
        let stream = engine.submit(r).expect("accepted");
        handles.push(thread::spawn(move || {
            let result = stream.blocking_collect();
            (i, priority, result.map(|(_, c)| c.reason), start.elapsed())
        }));
        thread::sleep(Duration::from_millis(if i == 5 { 300 } else { 5 }));
    }
    let mut results: Vec<_> = handles.into_iter().map(|h| h.join().expect("thread")).collect();
    assert!(results.iter().all(|r| r.2.is_ok()), "every request completes: {results:?}");
    results.sort_by_key(|r| r.3);
    println!("finish order (index, priority): {:?}", results.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>());
    let last_urgent = results.iter().rposition(|r| r.1 == 0).expect("urgent requests ran");
    let low_after = results.iter().skip(last_urgent).filter(|r| r.1 == 5).count();
    assert!(low_after >= 3, "urgent requests should overtake most low-priority ones: {results:?}");
    assert!(engine.stats().preemptions > 0);
}

#[test]
fn a_preempted_request_that_waits_too_long_fails_instead_of_stalling() {
    // Room for one of the two generations: when the cache runs out, the
    // low-priority one is preempted, and the urgent one then has ~90 tokens
    // to go, far longer than the 100 ms a preempted request may wait.
    let config = EngineConfig {
        kv_budget: KvBudget::Blocks(14),
        queue_timeout: Duration::from_millis(100),
        ..support::small_config()
    };
    let engine = Engine::start(support::load_model(), config).expect("engine starts");
    let prompt = engine.tokenizer().encode("Tell me about the sea.");
    let request = |priority| {
        let mut r = GenerationRequest::new(prompt.clone(), 200);
        r.priority = priority;
        r.sampling.ignore_eos = true;
        r
    };
    let mut low = engine.submit(request(5)).expect("accepted");
    assert!(matches!(low.blocking_next(), Some(Ok(TokenEvent::Token(_)))), "the low-priority request starts");
    let urgent = engine.submit(request(0)).expect("accepted");
    let low = low.blocking_collect().map(|(t, c)| (t.len(), c.timing.preemptions));
    let urgent = urgent.blocking_collect().map(|(t, _)| t.len());
    assert!(matches!(low, Err(EngineError::QueueTimeout { .. })), "{low:?}");
    assert!(matches!(urgent, Ok(200)), "{urgent:?}");
    let stats = settled(&engine);
    assert!(stats.preemptions >= 1);
    assert_eq!((stats.running, stats.kv_used_blocks), (0, 0), "{stats:?}");
}

#[test]
fn no_sequence_is_preempted_when_that_cannot_make_room() {
    // A long urgent prompt holds most of the cache and a short low-priority
    // generation a little; a middle-priority prompt that needs more than the
    // low one could ever free waits, and the low one keeps its cache.
    let config = EngineConfig { kv_budget: KvBudget::Blocks(14), ..support::small_config() };
    let engine = Engine::start(support::load_model(), config).expect("engine starts");
    let text = |words: usize| "the sea and the sky ".repeat(words / 5);
    let request = |prompt: &str, priority, n| {
        let mut r = GenerationRequest::new(engine.tokenizer().encode(prompt), n);
        r.priority = priority;
        r.sampling.ignore_eos = true;
        r
    };
    // 16-token blocks: the urgent one grows to 10 blocks, the low one to 3 (13 of 14).
    let urgent = engine.submit(request(&text(150), 0, 10)).expect("accepted");
    let mut low = engine.submit(request("Tell me about the sea.", 5, 40)).expect("accepted");
    assert!(matches!(low.blocking_next(), Some(Ok(TokenEvent::Token(_)))), "the low-priority request starts");
    let middle = engine.submit(request(&text(100), 1, 10)).expect("accepted");
    let low = low.blocking_collect().map(|(t, c)| (t.len(), c.timing.preemptions));
    assert_eq!(low.expect("completes"), (39, 0), "the low-priority request was not preempted");
    assert!(urgent.blocking_collect().is_ok() && middle.blocking_collect().is_ok());
}

#[test]
fn every_request_completes_or_gets_a_distinct_error() {
    let config = EngineConfig {
        kv_budget: KvBudget::Blocks(8),
        max_queue_requests: 3,
        max_running: 1,
        queue_timeout: Duration::from_millis(400),
        ..support::small_config()
    };
    let engine = Engine::start(support::load_model(), config).expect("engine starts");
    let prompt = engine.tokenizer().encode("Tell me about the sea.");
    let long = |n| {
        let mut r = GenerationRequest::new(prompt.clone(), n);
        r.sampling.ignore_eos = true;
        r
    };
    let mut outcomes = Vec::new();
    let mut streams = Vec::new();
    for _ in 0..6 {
        match engine.submit(long(96)) {
            Ok(s) => streams.push(s),
            Err(e) => outcomes.push(Err(e)),
        }
    }
    assert!(matches!(outcomes.first(), Some(Err(EngineError::QueueFull { .. }))), "{outcomes:?}");
    for s in streams {
        outcomes.push(s.blocking_collect().map(|(t, _)| t.len()));
    }
    println!("outcomes: {outcomes:?}");
    assert!(outcomes.iter().any(|o| matches!(o, Ok(96))), "the first request completes");
    assert!(outcomes.iter().any(|o| matches!(o, Err(EngineError::QueueTimeout { .. }))), "{outcomes:?}");
    assert_eq!(outcomes.len(), 6);

    // Invalid requests are refused up front, naming the problem.
    let too_long = engine.submit(long(10_000)).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(too_long.contains("max_tokens"), "{too_long}");
    let bad_token = engine.submit(GenerationRequest::new(vec![u32::MAX], 4)).err();
    assert!(matches!(bad_token, Some(EngineError::InvalidRequest(_))));

    // A dropped stream is aborted and its blocks freed.
    let stream = engine.submit(long(90)).expect("accepted");
    let mut stream = stream;
    assert!(matches!(stream.blocking_next(), Some(Ok(TokenEvent::Token(_)))));
    drop(stream);
    let stats = settled(&engine);
    assert_eq!((stats.running, stats.kv_used_blocks), (0, 0), "abandoned request is aborted: {stats:?}");

    // Shutting down aborts what is in flight, then refuses new work.
    let stream = engine.submit(long(90)).expect("accepted");
    engine.shutdown();
    assert!(matches!(stream.blocking_collect(), Err(EngineError::Aborted(_))));
    thread::sleep(Duration::from_millis(50));
    assert!(matches!(engine.submit(long(4)), Err(EngineError::Stopped)));
}

#[test]
fn same_seed_gives_the_same_output_and_stop_strings_do_not_leak() {
    let engine = Engine::start(support::load_model(), support::small_config()).expect("engine starts");
    let prompt = engine.tokenizer().encode("Once upon a time");
    let sampled = |seed| {
        let mut r = GenerationRequest::new(prompt.clone(), 24);
        r.sampling =
            SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 40, seed: Some(seed), ..SamplingParams::default() };
        ids(&engine, r).0
    };
    let (a, b, c) = (sampled(7), sampled(7), sampled(8));
    assert_eq!(a, b, "same seed, same tokens");
    assert_ne!(a, c, "another seed should differ");

    let shared = Arc::new(engine);
    let mut r = GenerationRequest::new(shared.tokenizer().encode("The capital of France is"), 16);
    r.sampling.stop = vec!["Paris".into()];
    r.sampling.logprobs = Some(2);
    let (tokens, done) = shared.submit(r).expect("accepted").blocking_collect().expect("completes");
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    assert!(!text.contains("Paris") && !text.contains("Par"), "stop text leaked: {text:?}");
    assert_eq!(done.reason, levee_gpu::FinishReason::Stop);
    assert!(tokens.iter().all(|t| t.logprobs.as_ref().is_some_and(|l| l.top.len() == 2 && l.logprob <= 0.0)));

    // Text held back for a stop string that never completes is released
    // when a stop token ends the stream; every sampled token is reported.
    let mut r = GenerationRequest::new(shared.tokenizer().encode("The capital of France is"), 16);
    r.sampling.stop = vec![".\n\nZ".into()];
    r.sampling.stop_token_ids = shared.tokenizer().encode("The");
    let (tokens, done) = shared.submit(r).expect("accepted").blocking_collect().expect("completes");
    let text: String = tokens.iter().map(|t| t.text.as_str()).collect();
    assert_eq!(text, " Paris.\n\n");
    assert_eq!((done.reason, tokens.len()), (levee_gpu::FinishReason::Stop, done.usage.completion_tokens));
}
