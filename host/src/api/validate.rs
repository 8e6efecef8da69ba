//! Wire request → `ValidRequest`: prompts rendered and tokenized, every
//! value checked against its limit, with messages that name the field.

use super::error::ApiError;
use super::wire::{ChatBody, CommonFields, CompletionBody, MessageContent, PromptInput, StopInput, WireMessage};
use crate::config::ServerConfig;
use crate::plugins::bindings::Route;
use crate::tenancy::Tenant;
use levee_gpu::{ChatMessage, EngineHandle, SamplingParams};

/// Most log-probability alternatives per token.
const MAX_LOGPROBS: i64 = 20;

pub use crate::pipeline::{Prompt, ValidRequest};

/// Headers that policies may read.
const POLICY_HEADERS: &[&str] =
    &["cache-control", "x-levee-cache-ttl", "x-levee-no-cache", "x-request-id", "user-agent", "x-levee-priority"];

/// The subset of request headers passed to policies, lower-case.
pub fn policy_headers(headers: &axum::http::HeaderMap) -> Vec<(String, String)> {
    POLICY_HEADERS
        .iter()
        .filter_map(|name| headers.get(*name).and_then(|v| v.to_str().ok()).map(|v| (name.to_string(), v.to_string())))
        .collect()
}

/// Longest stop sequence, bytes: each is matched against the tail of the
/// text after every token.
const MAX_STOP_BYTES: usize = 1024;

/// Most stop token ids one request may name.
const MAX_STOP_TOKEN_IDS: usize = 256;

fn range_f32(param: &str, value: Option<f32>, default: f32, min: f32, max: f32) -> Result<f32, ApiError> {
    let value = value.unwrap_or(default);
    if !(value.is_finite() && value >= min && value <= max) {
        return Err(ApiError::invalid(param, format!("{param} must be between {min} and {max}, got {value}")));
    }
    Ok(value)
}

/// Checks the requested model against the served one.
pub fn check_model(requested: Option<&str>, served: &str) -> Result<(), ApiError> {
    match requested {
        None | Some("") => Ok(()),
        Some(name) if name == served => Ok(()),
        Some(name) => Err(ApiError::ModelNotFound(name.to_string())),
    }
}

struct Common {
    max_tokens: Option<u32>,
    /// The field `max_tokens` came from, to name in errors.
    max_tokens_param: &'static str,
    n: u32,
    sampling: SamplingParams,
    priority: i32,
    stream: bool,
    include_usage: bool,
}

fn common(fields: &CommonFields, limits: &ServerConfig) -> Result<Common, ApiError> {
    let max_tokens = match (fields.max_completion_tokens, fields.max_tokens) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!("max_tokens ({b}) and max_completion_tokens ({a}) disagree; send one of them"),
            ));
        }
        (Some(v), _) => Some(("max_completion_tokens", v)),
        (None, Some(v)) => Some(("max_tokens", v)),
        (None, None) => None,
    };
    let max_tokens_param = max_tokens.map_or("max_tokens", |(param, _)| param);
    let max_tokens = match max_tokens {
        Some((param, v)) if !(1..=i64::from(u32::MAX)).contains(&v) => {
            return Err(ApiError::invalid(param, format!("{param} must be between 1 and {}, got {v}", u32::MAX)));
        }
        Some((_, v)) => Some(v as u32),
        None => None,
    };
    let n = fields.n.unwrap_or(1);
    if !(1..=i64::from(limits.max_n)).contains(&n) {
        return Err(ApiError::invalid("n", format!("n must be between 1 and {}, got {n}", limits.max_n)));
    }
    let stop = match &fields.stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => v.clone(),
    };
    if stop.len() > limits.max_stop {
        return Err(ApiError::invalid(
            "stop",
            format!("stop may hold at most {} sequences, got {}", limits.max_stop, stop.len()),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid("stop", "stop sequences must not be empty"));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::invalid(
            "stop",
            format!("stop sequences must be at most {MAX_STOP_BYTES} bytes, got one of {} bytes", long.len()),
        ));
    }
    if let Some(ids) = &fields.stop_token_ids
        && ids.len() > MAX_STOP_TOKEN_IDS
    {
        return Err(ApiError::invalid(
            "stop_token_ids",
            format!("stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {}", ids.len()),
        ));
    }
    let top_k = match fields.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if (1..=100_000).contains(&k) => k as usize,
        Some(k) => {
            return Err(ApiError::invalid("top_k", format!("top_k must be -1 (off) or between 1 and 100000, got {k}")));
        }
    };
    let seed = match fields.seed {
        Some(s) if s < 0 => return Err(ApiError::invalid("seed", format!("seed must be ≥ 0, got {s}"))),
        other => other.map(|s| s as u64),
    };
    let priority = match fields.priority {
        Some(p) if i32::try_from(p).is_err() => {
            return Err(ApiError::invalid("priority", format!("priority must fit in 32 bits, got {p}")));
        }
        other => other.unwrap_or(0) as i32,
    };
    let top_p = range_f32("top_p", fields.top_p, 1.0, 0.0, 1.0)?;
    if top_p == 0.0 {
        return Err(ApiError::invalid("top_p", "top_p must be greater than 0, got 0"));
    }
    let repetition_penalty = fields.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty.is_finite() && (0.01..=10.0).contains(&repetition_penalty)) {
        return Err(ApiError::invalid(
            "repetition_penalty",
            format!("repetition_penalty must be between 0.01 and 10, got {repetition_penalty}"),
        ));
    }
    let temperature = range_f32("temperature", fields.temperature, 1.0, 0.0, 2.0)?;
    let sampling = SamplingParams {
        // As in vLLM, a temperature this small is greedy decoding (dividing
        // logits by it would overflow).
        temperature: if temperature < levee_gpu::sampling::GREEDY_BELOW { 0.0 } else { temperature },
        top_k,
        top_p,
        seed,
        repetition_penalty,
        frequency_penalty: range_f32("frequency_penalty", fields.frequency_penalty, 0.0, -2.0, 2.0)?,
        presence_penalty: range_f32("presence_penalty", fields.presence_penalty, 0.0, -2.0, 2.0)?,
        stop,
        stop_token_ids: fields.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: fields.ignore_eos.unwrap_or(false),
        ..SamplingParams::default()
    };
    let stream = fields.stream.unwrap_or(false);
    let include_usage = fields.stream_options.as_ref().is_some_and(|o| o.include_usage);
    if include_usage && !stream {
        return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"));
    }
    Ok(Common { max_tokens, max_tokens_param, n: n as u32, sampling, priority, stream, include_usage })
}

impl Common {
    fn into_request(
        self,
        route: Route,
        served: &str,
        prompts: Vec<Prompt>,
        max_tokens: u32,
        tenant: Tenant,
        headers: Vec<(String, String)>,
    ) -> ValidRequest {
        let prefix = match route {
            Route::Completions => "cmpl",
            Route::Chat => "chatcmpl",
        };
        ValidRequest {
            id: new_id(prefix),
            created: unix_now(),
            route,
            model: served.to_string(),
            prompts,
            max_tokens,
            n: self.n,
            sampling: self.sampling,
            priority: self.priority,
            stream: self.stream,
            include_usage: self.include_usage,
            tenant,
            headers,
        }
    }
}

fn logprobs_count(param: &str, value: Option<i64>) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(v) if (0..=MAX_LOGPROBS).contains(&v) => Ok(Some(v as usize)),
        Some(v) => Err(ApiError::invalid(param, format!("{param} must be between 0 and {MAX_LOGPROBS}, got {v}"))),
    }
}

/// "the messages come" or "the prompt comes".
fn comes(prompt_param: &str) -> &'static str {
    if prompt_param == "messages" { "the messages come" } else { "the prompt comes" }
}

/// The prompt of `tokens` tokens (at least) leaves no room in the context.
fn too_long(prompt_param: &str, tokens: usize, at_least: bool, context: usize) -> ApiError {
    let count = if at_least { format!("at least {tokens}") } else { tokens.to_string() };
    ApiError::ContextLength {
        message: format!(
            "this model's maximum context length is {context} tokens, and {} to {count} tokens; shorten the {prompt_param}",
            comes(prompt_param)
        ),
        param: prompt_param.to_string(),
    }
}

/// Refuses, before tokenizing it, a text that cannot fit the context
/// whatever its tokens turn out to be.
fn check_length(engine: &EngineHandle, prompt_param: &str, text: &str) -> Result<(), ApiError> {
    let fewest = engine.tokenizer().fewest_tokens(text);
    if fewest >= engine.max_context() {
        return Err(too_long(prompt_param, fewest, true, engine.max_context()));
    }
    Ok(())
}

/// Checks the prompt's length against the context and picks `max_tokens`;
/// `prompt_param` is `prompt` or `messages`.
fn fit(
    engine: &EngineHandle,
    prompt_param: &str,
    prompts: &[Prompt],
    c: &Common,
    default: u32,
) -> Result<u32, ApiError> {
    let context = engine.max_context();
    if let Some(i) = prompts.iter().position(|p| p.tokens.is_empty()) {
        let which = if prompts.len() > 1 { format!("prompt {i} of {}", prompts.len()) } else { "the prompt".into() };
        return Err(ApiError::invalid(prompt_param, format!("{which} is empty")));
    }
    let longest = prompts.iter().map(|p| p.tokens.len()).max().unwrap_or(0);
    if longest >= context {
        return Err(too_long(prompt_param, longest, false, context));
    }
    let room = (context - longest) as u32;
    match c.max_tokens {
        Some(m) if m > room => {
            let param = c.max_tokens_param;
            Err(ApiError::ContextLength {
                message: format!(
                    "this model's maximum context length is {context} tokens; {} to {longest} tokens, so {param} \
                     must be ≤ {room}, got {m}",
                    comes(prompt_param)
                ),
                param: param.to_string(),
            })
        }
        Some(m) => Ok(m),
        None => Ok(default.min(room)),
    }
}

/// Refuses stop token ids outside the vocabulary.
fn check_stop_tokens(engine: &EngineHandle, sampling: &SamplingParams) -> Result<(), ApiError> {
    let vocab = engine.tokenizer().vocab_size() as u32;
    match sampling.stop_token_ids.iter().find(|t| **t >= vocab) {
        Some(bad) => Err(ApiError::invalid(
            "stop_token_ids",
            format!("stop_token_ids holds {bad}, outside the vocabulary of {vocab} tokens"),
        )),
        None => Ok(()),
    }
}

/// Refuses a request that the engine's queue could never hold, even empty:
/// every prompt times `n` is one queued sequence.
fn check_capacity(engine: &EngineHandle, prompts: &[Prompt], n: u32) -> Result<(), ApiError> {
    let config = engine.config();
    let sequences = prompts.len() * n as usize;
    if sequences > config.max_queue_requests {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} prompts x n = {n} make {sequences} sequences; this server queues at most {}",
                prompts.len(),
                config.max_queue_requests
            ),
        ));
    }
    let tokens: usize = prompts.iter().map(|p| p.tokens.len()).sum::<usize>() * n as usize;
    if tokens > config.max_queued_tokens {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "the prompts times n come to {tokens} prompt tokens; this server queues at most {}",
                config.max_queued_tokens
            ),
        ));
    }
    Ok(())
}

fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{prefix}-{:x}{:04x}", nanos & 0xffff_ffff_ffff, NEXT.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Validates a completions body.
pub fn completion(
    fields: CommonFields,
    body: CompletionBody,
    engine: &EngineHandle,
    served: &str,
    limits: &ServerConfig,
    tenant: Tenant,
    headers: Vec<(String, String)>,
) -> Result<ValidRequest, ApiError> {
    check_model(fields.model.as_deref(), served)?;
    let mut c = common(&fields, limits)?;
    c.sampling.logprobs = logprobs_count("logprobs", body.logprobs)?;
    let tokenizer = engine.tokenizer();
    let vocab = tokenizer.vocab_size() as u32;
    let count = match &body.prompt {
        PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
        PromptInput::Texts(texts) => texts.len(),
        PromptInput::TokenLists(lists) => lists.len(),
    };
    if count == 0 || count > limits.max_prompts {
        return Err(ApiError::invalid(
            "prompt",
            format!("prompt must hold between 1 and {} prompts, got {count}", limits.max_prompts),
        ));
    }
    // What cannot fit is refused before the work of tokenizing or decoding it.
    let context = engine.max_context();
    match &body.prompt {
        PromptInput::Text(text) => check_length(engine, "prompt", text)?,
        PromptInput::Texts(texts) => texts.iter().try_for_each(|text| check_length(engine, "prompt", text))?,
        PromptInput::Tokens(tokens) if tokens.len() >= context => {
            return Err(too_long("prompt", tokens.len(), false, context));
        }
        PromptInput::TokenLists(lists) => {
            if let Some(long) = lists.iter().find(|l| l.len() >= context) {
                return Err(too_long("prompt", long.len(), false, context));
            }
        }
        PromptInput::Tokens(_) => {}
    }
    let prompts: Vec<Prompt> = match body.prompt {
        PromptInput::Text(text) => vec![Prompt { tokens: tokenizer.encode(&text), text }],
        PromptInput::Texts(texts) => {
            texts.into_iter().map(|text| Prompt { tokens: tokenizer.encode(&text), text }).collect()
        }
        PromptInput::Tokens(tokens) => vec![Prompt { text: tokenizer.decode(&tokens), tokens }],
        PromptInput::TokenLists(lists) => {
            lists.into_iter().map(|tokens| Prompt { text: tokenizer.decode(&tokens), tokens }).collect()
        }
    };
    if let Some(bad) = prompts.iter().flat_map(|p| &p.tokens).find(|t| **t >= vocab) {
        return Err(ApiError::invalid(
            "prompt",
            format!("prompt holds token id {bad}, outside the vocabulary of {vocab} tokens"),
        ));
    }
    let max_tokens = fit(engine, "prompt", &prompts, &c, limits.default_completion_max_tokens)?;
    check_capacity(engine, &prompts, c.n)?;
    check_stop_tokens(engine, &c.sampling)?;
    Ok(c.into_request(Route::Completions, served, prompts, max_tokens, tenant, headers))
}

/// Turns wire messages into chat messages.
pub fn messages(wire: Vec<WireMessage>) -> Result<Vec<ChatMessage>, ApiError> {
    if wire.is_empty() {
        return Err(ApiError::invalid("messages", "messages must hold at least one message"));
    }
    wire.into_iter()
        .enumerate()
        .map(|(i, m)| {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid(
                    &format!("messages[{i}].role"),
                    format!("messages[{i}].role must be system, developer, user, assistant or tool; got {:?}", m.role),
                ));
            }
            let content = match m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t,
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.into_iter().enumerate() {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!("messages[{i}].content[{j}]: only text parts are supported, got {kind:?}"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            let role = if m.role == "developer" { "system".to_string() } else { m.role };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// Validates a chat body.
pub fn chat(
    fields: CommonFields,
    body: ChatBody,
    engine: &EngineHandle,
    served: &str,
    limits: &ServerConfig,
    tenant: Tenant,
    headers: Vec<(String, String)>,
) -> Result<ValidRequest, ApiError> {
    check_model(fields.model.as_deref(), served)?;
    let mut c = common(&fields, limits)?;
    let top = logprobs_count("top_logprobs", body.top_logprobs)?;
    c.sampling.logprobs = match (body.logprobs.unwrap_or(false), top) {
        (true, top) => Some(top.unwrap_or(0)),
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs set to true")),
        (false, None) => None,
    };
    let messages = messages(body.messages)?;
    let text = engine.render_chat(&messages).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
    check_length(engine, "messages", &text)?;
    let prompts = vec![Prompt { tokens: engine.tokenizer().encode(&text), text }];
    let max_tokens = fit(engine, "messages", &prompts, &c, limits.default_chat_max_tokens)?;
    check_capacity(engine, &prompts, c.n)?;
    check_stop_tokens(engine, &c.sampling)?;
    Ok(c.into_request(Route::Chat, served, prompts, max_tokens, tenant, headers))
}
