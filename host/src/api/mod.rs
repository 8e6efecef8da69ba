//! The OpenAI-compatible HTTP API: `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models`, `/tokenize`, `/detokenize`, and
//! the operational routes `/health`, `/ready` and `/metrics`.

pub mod error;
pub mod respond;
pub mod validate;
pub mod wire;

use crate::capabilities::Capabilities;
use crate::config::ServerConfig;
use crate::pipeline::Pipeline;
use crate::tenancy::Tenancy;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use error::ApiError;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the engine may hold work without taking a step before `/ready` fails.
const STALL_LIMIT: Duration = Duration::from_secs(30);

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
    stepping: Mutex<(u64, Instant)>,
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
        Self {
            pipeline,
            tenancy,
            limits,
            caps,
            scaling,
            draining: AtomicBool::new(false),
            stepping: Mutex::new((0, Instant::now())),
        }
    }

    /// Why the server is not ready, if it is not: draining, or an engine that
    /// holds work but has not stepped for a while.
    pub fn not_ready(&self) -> Option<String> {
        if self.draining.load(Ordering::Relaxed) {
            return Some("draining: the server is shutting down".into());
        }
        let stats = self.pipeline.engine.stats();
        let mut stepping = self.stepping.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let busy = stats.queue_depth + stats.running > 0;
        if stats.steps != stepping.0 || !busy {
            *stepping = (stats.steps, now);
            return None;
        }
        let stalled = now.duration_since(stepping.1);
        (stalled > STALL_LIMIT).then(|| format!("the engine has held work for {stalled:?} without taking a step"))
    }
}

type AppState = State<Arc<App>>;

/// A request body as axum hands it over (too large, or not readable).
type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// The body's bytes, or 413 / 400.
fn body_bytes(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::BodyTooLarge(limit)
        } else {
            ApiError::invalid("body", e.body_text())
        }
    })
}

/// Checks the caller's API key, reads the body and parses it as `T`.
fn authorized<T: serde::de::DeserializeOwned>(app: &App, headers: &HeaderMap, body: Body) -> Result<T, ApiError> {
    app.tenancy.resolve(headers)?;
    wire::parse(&body_bytes(body, app.limits.max_body_bytes)?)
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
    let body = body_bytes(body, app.limits.max_body_bytes)?;
    let policy_headers = validate::policy_headers(&headers);
    let engine = &app.pipeline.engine;
    let request = if chat {
        let (fields, route) = wire::parse_generation(&body, wire::CHAT_FIELDS)?;
        validate::chat(fields, route, engine, &app.pipeline.model, &app.limits, tenant, policy_headers)?
    } else {
        let (fields, route) = wire::parse_generation(&body, wire::COMPLETION_FIELDS)?;
        validate::completion(fields, route, engine, &app.pipeline.model, &app.limits, tenant, policy_headers)?
    };
    let stream = request.stream;
    let plan = app.pipeline.plan(request).await?;
    let tokenizer = engine.tokenizer().clone();
    let telemetry = app.pipeline.telemetry.clone();
    if stream {
        Ok(respond::streamed(plan, tokenizer, telemetry))
    } else {
        respond::whole(plan, tokenizer, telemetry).await
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

async fn models(State(app): AppState, headers: HeaderMap) -> Response {
    let started = Instant::now();
    let result = app.tenancy.resolve(&headers).map(|_| {
        let created =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Json(json!({ "object": "list", "data": [{
            "id": app.pipeline.model, "object": "model", "created": created, "owned_by": "levee",
            "max_model_len": app.pipeline.engine.max_context(),
        }]}))
        .into_response()
    });
    answered(&app, "/v1/models", started, result).await
}

async fn tokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = (|| {
        let body: wire::TokenizeBody = authorized(&app, &headers, body)?;
        validate::check_model(body.model.as_deref(), &app.pipeline.model)?;
        let engine = &app.pipeline.engine;
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
    })();
    answered(&app, "/tokenize", started, result).await
}

async fn detokenize(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let result = (|| {
        let body: wire::DetokenizeBody = authorized(&app, &headers, body)?;
        validate::check_model(body.model.as_deref(), &app.pipeline.model)?;
        let tokenizer = app.pipeline.engine.tokenizer();
        let vocab = tokenizer.vocab_size() as u32;
        if let Some(bad) = body.tokens.iter().find(|t| **t >= vocab) {
            return Err(ApiError::invalid(
                "tokens",
                format!("tokens holds token id {bad}, outside the vocabulary of {vocab} tokens"),
            ));
        }
        Ok(Json(json!({ "prompt": tokenizer.decode(&body.tokens) })).into_response())
    })();
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
    let mut out = String::new();
    let stats = app.pipeline.engine.stats();
    app.pipeline.telemetry.render(&stats, &mut out);
    crate::server::render_plugin_metrics(&app.pipeline.policies, &app.caps, &mut out);
    app.scaling.render(&mut out);
    if let Some(remote) = app.pipeline.flights.remote() {
        use std::fmt::Write as _;
        let followed = remote.followed.load(Ordering::Relaxed);
        let taken_over = remote.taken_over.load(Ordering::Relaxed);
        crate::metrics::header(
            &mut out,
            "levee_flights_followed_total",
            "counter",
            "Coalesced requests that followed another replica's generation.",
        );
        let _ = writeln!(out, "levee_flights_followed_total {followed}");
        crate::metrics::header(
            &mut out,
            "levee_flights_taken_over_total",
            "counter",
            "Followed generations finished here after the owner stalled or left.",
        );
        let _ = writeln!(out, "levee_flights_taken_over_total {taken_over}");
    }
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

/// The API router.
pub fn router(app: Arc<App>) -> Router {
    let limit = app.limits.max_body_bytes;
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/scaling", get(scaling))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}
