//! Turning a planned request into an OpenAI response: a whole JSON body, or
//! server-sent events ending with `data: [DONE]`.

use super::blocking::BlockingPool;
use super::error::ApiError;
use crate::pipeline::{Finished, Live, Plan, PlannedChoice, Source, report_completed};
use crate::plugins::bindings::{self as wit, Route};
use crate::telemetry::Telemetry;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use levee_gpu::{GeneratedToken, TokenEvent, Tokenizer};
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// One step of one choice.
enum Step {
    Token(GeneratedToken),
    Cached(String),
    Done {
        finish_reason: String,
        completion_tokens: usize,
        ttft: Option<Duration>,
        generated_here: bool,
        timing: Option<levee_gpu::Timing>,
    },
    Failed(ApiError),
}

/// A choice's events as a stream.
fn steps(
    choice: PlannedChoice,
    tokenizer: Arc<Tokenizer>,
    blocking: Arc<BlockingPool>,
) -> impl futures::Stream<Item = Step> + Send {
    enum State {
        Cached(Option<wit::Choice>, Arc<Tokenizer>, Arc<BlockingPool>),
        Live(Live),
        Over,
    }
    let state = match choice.source {
        Source::Cached(c) => State::Cached(Some(c), tokenizer, blocking),
        Source::Live(live) => State::Live(live),
    };
    futures::stream::unfold(state, |state| async move {
        match state {
            State::Cached(Some(c), tokenizer, blocking) => {
                // Counting a stored answer's tokens grows with its length: off the async workers.
                let counted = blocking.run_sized(c.text.len(), move || {
                    let tokens = tokenizer.encode(&c.text).len();
                    (c, tokens)
                });
                let (c, tokens) = match counted.await {
                    Ok(counted) => counted,
                    Err(e) => return Some((futures::stream::iter(vec![Step::Failed(e.into())]), State::Over)),
                };
                let done = Step::Done {
                    finish_reason: c.finish_reason,
                    completion_tokens: tokens,
                    ttft: None,
                    generated_here: false,
                    timing: None,
                };
                let text = Step::Cached(c.text);
                Some((futures::stream::iter(vec![text, done]), State::Over))
            }
            State::Cached(None, ..) | State::Over => None,
            State::Live(mut live) => {
                let step = match live.next().await {
                    Some(Ok(TokenEvent::Token(t))) => {
                        return Some((futures::stream::iter(vec![Step::Token(t)]), State::Live(live)));
                    }
                    Some(Ok(TokenEvent::Finished(c))) => Step::Done {
                        finish_reason: c.reason.as_str().to_string(),
                        completion_tokens: c.usage.completion_tokens,
                        ttft: Some(c.timing.time_to_first_token),
                        generated_here: live.generated_here(),
                        timing: Some(c.timing),
                    },
                    Some(Err(e)) => Step::Failed(e.into()),
                    None => {
                        Step::Failed(ApiError::Internal("the engine stopped before the generation finished".into()))
                    }
                };
                Some((futures::stream::iter(vec![step]), State::Over))
            }
        }
    })
    .flatten()
}

/// What one choice came to.
#[derive(Default)]
struct Collected {
    prompt: usize,
    text: String,
    tokens: Vec<GeneratedToken>,
    finish_reason: String,
    completion_tokens: usize,
    ttft_ms: f32,
}

/// Accounts a finished choice in the metrics.
fn account(
    telemetry: &Telemetry,
    generated_here: bool,
    completion_tokens: usize,
    prompt_tokens: usize,
    timing: Option<&levee_gpu::Timing>,
) {
    if !generated_here {
        return;
    }
    let counters = &telemetry.counters;
    counters.generation_tokens.fetch_add(completion_tokens as u64, Ordering::Relaxed);
    counters.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
    if let Some(timing) = timing {
        telemetry.generation(timing, completion_tokens);
    }
}

fn headers(plan: &Plan) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some((plugin, similarity)) = &plan.cache_hit {
        headers.insert("x-levee-cache", HeaderValue::from_static("hit"));
        if let Ok(v) = HeaderValue::from_str(&format!("{similarity:.4}")) {
            headers.insert("x-levee-cache-similarity", v);
        }
        if let Ok(v) = HeaderValue::from_str(plugin) {
            headers.insert("x-levee-cache-plugin", v);
        }
    }
    if let Some(label) = &plan.degraded
        && let Ok(v) = HeaderValue::from_str(label)
    {
        headers.insert("x-levee-degraded", v);
    }
    if plan.coalesced {
        headers.insert("x-levee-coalesced", HeaderValue::from_static("true"));
    }
    if let Ok(v) = HeaderValue::from_str(&plan.request.id) {
        headers.insert("x-request-id", v);
    }
    headers
}

fn usage_json(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({ "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens })
}

fn completion_logprobs(tokens: &[GeneratedToken], tokenizer: &Tokenizer) -> Value {
    if tokens.iter().all(|t| t.logprobs.is_none()) {
        return Value::Null;
    }
    let mut offset = 0;
    let (mut texts, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for t in tokens {
        let piece = tokenizer.decode(&[t.id]);
        offsets.push(offset);
        offset += t.text.len();
        let lp = t.logprobs.as_ref();
        lps.push(lp.map(|l| l.logprob));
        let top: serde_json::Map<String, Value> =
            lp.map(|l| l.top.iter().map(|(id, p)| (tokenizer.decode(&[*id]), json!(p))).collect()).unwrap_or_default();
        tops.push(Value::Object(top));
        texts.push(piece);
    }
    json!({ "tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets })
}

fn chat_logprobs(tokens: &[GeneratedToken], tokenizer: &Tokenizer) -> Value {
    if tokens.iter().all(|t| t.logprobs.is_none()) {
        return Value::Null;
    }
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            let piece = tokenizer.decode(&[t.id]);
            let (logprob, top) = match &t.logprobs {
                Some(l) => (
                    l.logprob,
                    l.top
                        .iter()
                        .map(|(id, p)| {
                            let text = tokenizer.decode(&[*id]);
                            json!({ "token": text, "logprob": p, "bytes": text.as_bytes() })
                        })
                        .collect(),
                ),
                None => (0.0, Vec::new()),
            };
            json!({ "token": piece, "logprob": logprob, "bytes": piece.as_bytes(), "top_logprobs": top })
        })
        .collect();
    json!({ "content": content })
}

/// The whole response as one JSON body.
pub async fn whole(
    mut plan: Plan,
    tokenizer: Arc<Tokenizer>,
    blocking: Arc<BlockingPool>,
    telemetry: Arc<Telemetry>,
) -> Result<Response, ApiError> {
    let choices = std::mem::take(&mut plan.choices);
    let collectors = choices.into_iter().map(|choice| {
        let prompt = choice.prompt;
        let prompt_tokens = plan.request.prompts[prompt].tokens.len();
        let (tokenizer, blocking, telemetry) = (tokenizer.clone(), blocking.clone(), telemetry.clone());
        async move {
            let mut out = Collected { prompt, ..Collected::default() };
            let mut steps = std::pin::pin!(steps(choice, tokenizer, blocking));
            while let Some(step) = steps.next().await {
                match step {
                    Step::Token(t) => {
                        out.text.push_str(&t.text);
                        out.tokens.push(t);
                    }
                    Step::Cached(text) => out.text = text,
                    Step::Done { finish_reason, completion_tokens, ttft, generated_here, timing } => {
                        account(&telemetry, generated_here, completion_tokens, prompt_tokens, timing.as_ref());
                        out.finish_reason = finish_reason;
                        out.completion_tokens = completion_tokens;
                        out.ttft_ms = ttft.map_or(0.0, |d| d.as_secs_f32() * 1000.0);
                    }
                    Step::Failed(e) => return Err(e),
                }
            }
            Ok(out)
        }
    });
    let collected = futures::future::try_join_all(collectors).await?;
    let prompt_tokens: usize = plan.request.prompts.iter().map(|p| p.tokens.len()).sum();
    let completion_tokens: usize = collected.iter().map(|c| c.completion_tokens).sum();
    let r = &plan.request;
    let body = match r.route {
        Route::Completions => {
            let choices: Vec<Value> = collected
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    json!({ "index": i, "text": c.text, "logprobs": completion_logprobs(&c.tokens, &tokenizer), "finish_reason": c.finish_reason })
                })
                .collect();
            json!({ "id": r.id, "object": "text_completion", "created": r.created, "model": r.model, "choices": choices,
                    "usage": usage_json(prompt_tokens, completion_tokens) })
        }
        Route::Chat => {
            let choices: Vec<Value> = collected
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    json!({ "index": i, "message": { "role": "assistant", "content": c.text },
                            "logprobs": chat_logprobs(&c.tokens, &tokenizer), "finish_reason": c.finish_reason })
                })
                .collect();
            json!({ "id": r.id, "object": "chat.completion", "created": r.created, "model": r.model, "choices": choices,
                    "usage": usage_json(prompt_tokens, completion_tokens) })
        }
    };
    finish(&plan, &collected);
    Ok((headers(&plan), axum::Json(body)).into_response())
}

/// Reports the response to `completed`.
fn finish(plan: &Plan, collected: &[Collected]) {
    let mut finished: Vec<Finished> = Vec::new();
    for c in collected {
        match finished.iter_mut().find(|f| f.prompt == c.prompt) {
            Some(f) => {
                f.choices.push(wit::Choice { text: c.text.clone(), finish_reason: c.finish_reason.clone() });
                f.completion_tokens += c.completion_tokens as u32;
            }
            None => finished.push(Finished {
                prompt: c.prompt,
                choices: vec![wit::Choice { text: c.text.clone(), finish_reason: c.finish_reason.clone() }],
                completion_tokens: c.completion_tokens as u32,
                ttft_ms: c.ttft_ms,
            }),
        }
    }
    report_completed(
        plan.chain.clone(),
        plan.records.clone(),
        finished,
        plan.cache_hit.is_some(),
        plan.coalesced,
        plan.started,
    );
}

fn chunk(plan: &Plan, choices: Value, usage: Option<Value>) -> Event {
    let r = &plan.request;
    let object = match r.route {
        Route::Completions => "text_completion",
        Route::Chat => "chat.completion.chunk",
    };
    let mut body = json!({ "id": r.id, "object": object, "created": r.created, "model": r.model, "choices": choices });
    if let Some(usage) = usage {
        body["usage"] = usage;
    }
    Event::default().data(body.to_string())
}

fn delta(plan: &Plan, index: usize, text: &str, logprobs: Value, finish_reason: Option<&str>) -> Event {
    let choice = match plan.request.route {
        Route::Completions => {
            json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason })
        }
        Route::Chat => {
            let delta = if finish_reason.is_some() && text.is_empty() { json!({}) } else { json!({ "content": text }) };
            json!({ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason })
        }
    };
    chunk(plan, json!([choice]), None)
}

/// Resolves when the server cuts responses short (its shutdown grace is over).
pub async fn cut_short(cut: &mut tokio::sync::watch::Receiver<bool>) {
    if cut.wait_for(|cut| *cut).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The error a response cut short by the shutdown ends with.
pub fn shutdown_cut() -> ApiError {
    ApiError::Unavailable("the server is shutting down and its grace period is over; retry elsewhere".into())
}

/// The response as server-sent events. The generation runs in a task that
/// stops when the client goes away, which aborts it in the engine, and ends
/// with an error event when `cut` flips (the shutdown grace is over).
pub fn streamed(
    mut plan: Plan,
    tokenizer: Arc<Tokenizer>,
    blocking: Arc<BlockingPool>,
    telemetry: Arc<Telemetry>,
    mut cut: tokio::sync::watch::Receiver<bool>,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(64);
    let headers = headers(&plan);
    tokio::spawn(async move {
        let choices = std::mem::take(&mut plan.choices);
        let prompts: Vec<usize> = choices.iter().map(|c| c.prompt).collect();
        let mut collected: Vec<Collected> =
            prompts.iter().map(|p| Collected { prompt: *p, ..Collected::default() }).collect();
        if plan.request.route == Route::Chat {
            for i in 0..choices.len() {
                let role = json!([{ "index": i, "delta": { "role": "assistant", "content": "" }, "logprobs": null, "finish_reason": null }]);
                if tx.send(chunk(&plan, role, None)).await.is_err() {
                    return;
                }
            }
        }
        let streams = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| steps(c, tokenizer.clone(), blocking.clone()).map(move |s| (i, s)).boxed());
        let mut merged = futures::stream::select_all(streams);
        loop {
            let next = tokio::select! {
                next = merged.next() => next,
                _ = cut_short(&mut cut) => Some((0, Step::Failed(shutdown_cut()))),
            };
            let Some((i, step)) = next else { break };
            let prompt_tokens = plan.request.prompts[prompts[i]].tokens.len();
            let event = match step {
                Step::Token(t) => {
                    let logprobs = match plan.request.route {
                        Route::Completions => completion_logprobs(std::slice::from_ref(&t), &tokenizer),
                        Route::Chat => chat_logprobs(std::slice::from_ref(&t), &tokenizer),
                    };
                    collected[i].text.push_str(&t.text);
                    if t.text.is_empty() && logprobs.is_null() {
                        continue;
                    }
                    delta(&plan, i, &t.text, logprobs, None)
                }
                Step::Cached(text) => {
                    collected[i].text.push_str(&text);
                    delta(&plan, i, &text, Value::Null, None)
                }
                Step::Done { finish_reason, completion_tokens, ttft, generated_here, timing } => {
                    account(&telemetry, generated_here, completion_tokens, prompt_tokens, timing.as_ref());
                    collected[i].completion_tokens = completion_tokens;
                    collected[i].ttft_ms = ttft.map_or(0.0, |d| d.as_secs_f32() * 1000.0);
                    let event = delta(&plan, i, "", Value::Null, Some(&finish_reason));
                    collected[i].finish_reason = finish_reason;
                    event
                }
                Step::Failed(e) => {
                    let _ = tx.send(Event::default().data(e.body().to_string())).await;
                    let _ = tx.send(Event::default().data("[DONE]")).await;
                    return;
                }
            };
            if tx.send(event).await.is_err() {
                return; // the client went away; dropping the streams aborts the generations
            }
        }
        if plan.request.include_usage {
            let prompt_tokens: usize = plan.request.prompts.iter().map(|p| p.tokens.len()).sum();
            let completion_tokens = collected.iter().map(|c| c.completion_tokens).sum();
            let _ = tx.send(chunk(&plan, json!([]), Some(usage_json(prompt_tokens, completion_tokens)))).await;
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
        finish(&plan, &collected);
    });
    let events =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx)) });
    (headers, Sse::new(events)).into_response()
}
