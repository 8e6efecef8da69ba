//! The OpenAI-compatible HTTP API: `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`, and
//! the operational routes `/health`, `/ready` and `/metrics`.

pub mod blocking;
pub mod error;
pub mod respond;
pub mod validate;
pub mod wire;

use crate::capabilities::Capabilities;
use crate::config::ServerConfig;
use crate::pipeline::Pipeline;
use crate::tenancy::Tenancy;
use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use blocking::BlockingPool;
use error::ApiError;
use futures::StreamExt;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Everything the API routes share.
pub struct App {
    /// Policy chain and engine.
    pub pipeline: Pipeline,
    /// API keys.
    pub tenancy: Tenancy,
    /// Request limits.
    pub limits: ServerConfig,
    /// Host capabilities (plugin metrics).
    pub caps: Arc<Capabilities>,
    /// Set on SIGTERM: `/ready` fails and new requests are refused.
    pub draining: AtomicBool,
    /// The scale ticker's latest decision.
    pub scaling: Arc<crate::scaling::Scaler>,
    /// Threads for work that grows with the input (parsing, templates, tokenizing).
    pub blocking: Arc<BlockingPool>,
    /// Connections and requests in flight, kept by the listener.
    pub connections: Arc<crate::listener::ConnectionStats>,
    /// Flips to `true` with `draining`, waking bodies still being read.
    drain_signal: tokio::sync::watch::Sender<bool>,
    /// Flips to `true` when the shutdown grace is over: responses still
    /// running end with an error (a last event, for streams) instead of
    /// being cut mid-way.
    cut_signal: tokio::sync::watch::Sender<bool>,
}

impl App {
    /// The shared state of the API.
    pub fn new(
        pipeline: Pipeline,
        tenancy: Tenancy,
        limits: ServerConfig,
        caps: Arc<Capabilities>,
        scaling: Arc<crate::scaling::Scaler>,
    ) -> Self {
        let blocking = Arc::new(BlockingPool::new(limits.prepare_threads, limits.prepare_queue));
        Self {
            pipeline,
            tenancy,
            limits,
            caps,
            scaling,
            blocking,
            connections: Arc::default(),
            draining: AtomicBool::new(false),
            drain_signal: tokio::sync::watch::Sender::new(false),
            cut_signal: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Ends the responses still running (the shutdown grace is over): each
    /// gets a 503 error, as its last event when streamed.
    pub fn cut(&self) {
        self.cut_signal.send_replace(true);
    }

    /// Starts draining (on SIGTERM): `/ready` fails, new requests get 503,
    /// and requests whose body is still arriving end with 503 at once.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
        self.drain_signal.send_replace(true);
    }

    /// Why the server is not ready, if it is not: draining, or an engine
    /// that holds work and has shown no progress (no step since the work
    /// arrived, or since its last step) for `ready-stall-secs`.
    pub fn not_ready(&self) -> Option<String> {
        if self.draining.load(Ordering::Relaxed) {
            return Some("draining: the server is shutting down".into());
        }
        let stats = self.pipeline.engine.stats();
        let busy = stats.queue_depth + stats.running > 0 || stats.stepping;
        let limit = Duration::from_secs_f64(self.limits.ready_stall_secs);
        (busy && stats.since_progress > limit)
            .then(|| format!("the engine has held work for {:?} without taking a step", stats.since_progress))
    }

    /// Reads a request body within the configured limits: a declared length
    /// over the limit is refused before reading; a pause longer than
    /// `body-read-timeout-secs`, or a body that after that long averages less
    /// than `min-body-bytes-per-sec`, ends with 408; draining ends it with 503.
    pub async fn read_body(&self, headers: &HeaderMap, body: axum::body::Body) -> Result<Bytes, ApiError> {
        let limit = self.limits.max_body_bytes;
        let declared = headers.get(CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::BodyTooLarge(limit));
        }
        let pause = Duration::from_secs_f64(self.limits.body_read_timeout_secs);
        let rate = self.limits.min_body_bytes_per_sec as f64;
        let started = tokio::time::Instant::now();
        let mut drain = self.drain_signal.subscribe();
        let mut stream = body.into_data_stream();
        // Grown as bytes arrive: a declared length reserves nothing up front.
        let mut bytes = Vec::with_capacity(declared.unwrap_or(0).min(64 << 10) as usize);
        loop {
            // The next piece must come within `pause`, and before the average
            // since the first `pause` falls under the minimum rate.
            let behind = started + pause + Duration::from_secs_f64(bytes.len() as f64 / rate);
            let wait = behind.min(tokio::time::Instant::now() + pause);
            let next = tokio::select! {
                next = tokio::time::timeout_at(wait, stream.next()) => next,
                _ = drain.wait_for(|draining| *draining) => {
                    return Err(ApiError::Unavailable("the server is shutting down".into()));
                }
            };
            match next {
                Err(_) => {
                    return Err(ApiError::BodyTimeout(format!(
                        "the request body did not arrive in time ({} bytes received in {:.1} s; a body may pause at \
                         most {} s and must average {} bytes/s or more)",
                        bytes.len(),
                        started.elapsed().as_secs_f64(),
                        pause.as_secs_f64(),
                        self.limits.min_body_bytes_per_sec
                    )));
                }
                Ok(None) => return Ok(Bytes::from(bytes)),
                Ok(Some(Ok(chunk))) => {
                    if bytes.len() + chunk.len() > limit {
                        return Err(ApiError::BodyTooLarge(limit));
                    }
                    bytes.extend_from_slice(&chunk);
                }
                Ok(Some(Err(e))) => return Err(ApiError::invalid("body", format!("the body could not be read: {e}"))),
            }
        }
    }
}

type AppState = State<Arc<App>>;

/// A request body as it arrives.
type Body = axum::body::Body;

/// Checks the caller's API key, reads the body and parses it as `T` on the
/// blocking pool.
async fn authorized<T: serde::de::DeserializeOwned + Send + 'static>(
    app: &App,
    headers: &HeaderMap,
    body: Body,
) -> Result<(T, usize), ApiError> {
    app.tenancy.resolve(headers)?;
    let body = app.read_body(headers, body).await?;
    let size = body.len();
    Ok((app.blocking.run_sized(size, move || wire::parse(&body)).await??, size))
}

async fn answered(app: &App, route: &'static str, started: Instant, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(IntoResponse::into_response);
    app.pipeline.telemetry.answered(route, response.status().as_u16(), started.elapsed());
    response
}

async fn generate(app: Arc<App>, headers: HeaderMap, body: Body, chat: bool) -> Result<Response, ApiError> {
    if app.draining.load(Ordering::Relaxed) {
        return Err(ApiError::Unavailable("the server is shutting down".into()));
    }
    app.pipeline.telemetry.arrival();
    let tenant = app.tenancy.resolve(&headers)?;
    let body = app.read_body(&headers, body).await?;
    let policy_headers = validate::policy_headers(&headers);
    let prepared = app.clone();
    let request = app
        .blocking
        .run_sized(body.len(), move || {
            let (app, engine) = (&prepared, &prepared.pipeline.engine);
            if chat {
                let (fields, route) = wire::parse_generation(&body, wire::CHAT_FIELDS)?;
                validate::chat(fields, route, engine, &app.pipeline.model, &app.limits, tenant, policy_headers)
            } else {
                let (fields, route) = wire::parse_generation(&body, wire::COMPLETION_FIELDS)?;
                validate::completion(fields, route, engine, &app.pipeline.model, &app.limits, tenant, policy_headers)
            }
        })
        .await??;
    let stream = request.stream;
    let plan = app.pipeline.plan(request).await?;
    let tokenizer = app.pipeline.engine.tokenizer().clone();
    let telemetry = app.pipeline.telemetry.clone();
    let blocking = app.blocking.clone();
    let mut cut = app.cut_signal.subscribe();
    if stream {
        Ok(respond::streamed(plan, tokenizer, blocking, telemetry, cut))
    } else {
        tokio::select! {
            response = respond::whole(plan, tokenizer, blocking, telemetry) => response,
            _ = respond::cut_short(&mut cut) => Err(respond::shutdown_cut()),
        }
    }
}

async fn completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = generate(app.clone(), headers, body, false).await;
    answered(&app, "/v1/completions", started, result).await
}

async fn chat_completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = generate(app.clone(), headers, body, true).await;
    answered(&app, "/v1/chat/completions", started, result).await
}

/// One served model as `/v1/models` lists it.
fn model_card(app: &App) -> serde_json::Value {
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    json!({
        "id": app.pipeline.model, "object": "model", "created": created, "owned_by": "levee",
        "max_model_len": app.pipeline.engine.max_context(),
    })
}

async fn models(State(app): AppState, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let result = app
        .tenancy
        .resolve(&headers)
        .map(|_| Json(json!({ "object": "list", "data": [model_card(&app)] })).into_response());
    answered(&app, "/v1/models", started, result).await
}

/// `GET /v1/models/{id}`: the model if it is served here, else 404.
async fn model(
    State(app): AppState,
    headers: HeaderMap,
    id: Result<Path<String>, axum::extract::rejection::PathRejection>,
) -> Response {
    let started = Instant::now();
    let result = app.tenancy.resolve(&headers).and_then(|_| {
        let Path(id) =
            id.map_err(|e| ApiError::invalid("model", format!("the model id is invalid: {}", e.body_text())))?;
        validate::check_model(Some(&id), &app.pipeline.model)?;
        Ok(Json(model_card(&app)).into_response())
    });
    answered(&app, "/v1/models/{id}", started, result).await
}

async fn tokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = async {
        let (body, size): (wire::TokenizeBody, _) = authorized(&app, &headers, body).await?;
        validate::check_model(body.model.as_deref(), &app.pipeline.model)?;
        let engine = app.pipeline.engine.clone();
        app.blocking
            .run_sized(size, move || {
                let text = match (body.prompt, body.messages) {
                    (Some(prompt), None) => prompt,
                    (None, Some(messages)) => engine
                        .render_chat(&validate::messages(messages)?)
                        .map_err(|e| ApiError::invalid("messages", e.to_string()))?,
                    _ => return Err(ApiError::invalid("prompt", "give exactly one of prompt or messages")),
                };
                let tokens = engine.tokenizer().encode(&text);
                Ok(Json(json!({ "tokens": tokens, "count": tokens.len(), "max_model_len": engine.max_context() }))
                    .into_response())
            })
            .await?
    }
    .await;
    answered(&app, "/tokenize", started, result).await
}

async fn detokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = async {
        let (body, size): (wire::DetokenizeBody, _) = authorized(&app, &headers, body).await?;
        validate::check_model(body.model.as_deref(), &app.pipeline.model)?;
        let engine = app.pipeline.engine.clone();
        let context = engine.max_context();
        if body.tokens.len() > context {
            return Err(ApiError::invalid(
                "tokens",
                format!("tokens may hold at most {context} ids (this model's context), got {}", body.tokens.len()),
            ));
        }
        app.blocking
            .run_sized(size, move || {
                let tokenizer = engine.tokenizer();
                let vocab = tokenizer.vocab_size() as u32;
                if let Some(bad) = body.tokens.iter().find(|t| **t >= vocab) {
                    return Err(ApiError::invalid(
                        "tokens",
                        format!("tokens holds token id {bad}, outside the vocabulary of {vocab} tokens"),
                    ));
                }
                Ok(Json(json!({ "prompt": tokenizer.decode(&body.tokens) })).into_response())
            })
            .await?
    }
    .await;
    answered(&app, "/detokenize", started, result).await
}

async fn health() -> &'static str {
    "ok"
}

async fn ready(State(app): AppState) -> Response {
    match app.not_ready() {
        None => (StatusCode::OK, "ready").into_response(),
        Some(reason) => ApiError::Unavailable(reason).into_response(),
    }
}

async fn metrics(State(app): AppState) -> Response {
    let out = crate::metrics::render(&app);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// `GET /v1/scaling`: the latest scale decision, its reason and signals,
/// in a shape KEDA's metrics-api scaler reads (`valueLocation: desiredReplicas`).
async fn scaling(State(app): AppState) -> Response {
    match app.scaling.decision() {
        Some(decision) => Json(decision).into_response(),
        None => ApiError::Unavailable("no scale decision yet; the first comes within one scaling interval".into())
            .into_response(),
    }
}

/// 404 for a path no route serves, in OpenAI's error shape.
pub async fn no_route(request: Request) -> Response {
    ApiError::NoRoute { method: request.method().to_string(), path: request.uri().path().to_string() }.into_response()
}

/// 405 for a route asked with a method it does not take (the router adds
/// `Allow`).
pub async fn wrong_method(request: Request) -> Response {
    ApiError::MethodNotAllowed { method: request.method().to_string(), path: request.uri().path().to_string() }
        .into_response()
}

/// The API router.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/scaling", get(scaling))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(app)
}
