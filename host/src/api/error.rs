//! `ApiError`: every way a request can fail, mapped in one place to an HTTP
//! status and an OpenAI-shaped body (`error.message`, `type`, `param`, `code`).

use crate::plugins::Refusal;
use axum::Json;
use axum::http::{HeaderValue, StatusCode, header::RETRY_AFTER};
use axum::response::{IntoResponse, Response};
use levee_gpu::EngineError;
use serde_json::json;

/// A request that cannot be served, and why.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// Bad input: the message names the field and the limit.
    #[error("{message}")]
    Invalid {
        /// What is wrong.
        message: String,
        /// The offending field.
        param: Option<String>,
    },
    /// The prompt, or the prompt plus the tokens asked for, does not fit the
    /// context: `param` is the field to change (`prompt`, `messages`,
    /// `max_tokens` or `max_completion_tokens`).
    #[error("{message}")]
    ContextLength {
        /// What does not fit, with the figures.
        message: String,
        /// The field to change.
        param: String,
    },
    /// No route at this path.
    #[error("no route {method} {path}")]
    NoRoute {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The route exists but not with this method.
    #[error("{path} does not take {method} (the Allow header lists what it takes)")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The body did not arrive in time.
    #[error("{0}")]
    BodyTimeout(String),
    /// No or an unknown API key.
    #[error("{0}")]
    Unauthorized(String),
    /// The caller may not do this.
    #[error("{0}")]
    Forbidden(String),
    /// The model asked for is not served here.
    #[error("the model `{0}` does not exist")]
    ModelNotFound(String),
    /// The body is larger than the configured limit.
    #[error("the request body is larger than the limit of {0} bytes")]
    BodyTooLarge(usize),
    /// A policy plugin refused the request (rate limit, shedding, a fault
    /// under `on-fault = closed`).
    #[error("{}", .0.message)]
    Refused(Refusal),
    /// The engine's queue is full.
    #[error("{0}")]
    QueueFull(String),
    /// The request waited too long for the engine.
    #[error("{0}")]
    QueueTimeout(String),
    /// The server is starting, draining or its engine has stopped.
    #[error("{0}")]
    Unavailable(String),
    /// Something failed inside the server.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// Bad input in `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        ApiError::Invalid { message: message.into(), param: Some(param.to_string()) }
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Invalid { .. } | ApiError::ContextLength { .. } => StatusCode::BAD_REQUEST,
            ApiError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) => StatusCode::FORBIDDEN,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BodyTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Refused(r) => StatusCode::from_u16(r.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            ApiError::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::QueueTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind_and_code(&self) -> (&'static str, Option<&'static str>) {
        match self {
            ApiError::Invalid { .. } => ("invalid_request_error", None),
            ApiError::ContextLength { .. } => ("invalid_request_error", Some("context_length_exceeded")),
            ApiError::NoRoute { .. } => ("invalid_request_error", Some("unknown_url")),
            ApiError::MethodNotAllowed { .. } => ("invalid_request_error", Some("method_not_allowed")),
            ApiError::BodyTimeout(_) => ("invalid_request_error", Some("request_timeout")),
            ApiError::Unauthorized(_) => ("authentication_error", Some("invalid_api_key")),
            ApiError::Forbidden(_) => ("permission_error", None),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::BodyTooLarge(_) => ("invalid_request_error", Some("request_too_large")),
            ApiError::Refused(r) if r.status == 429 => ("rate_limit_error", Some("rate_limit_exceeded")),
            ApiError::Refused(r) if r.status >= 500 => ("service_unavailable", Some("overloaded")),
            ApiError::Refused(_) => ("invalid_request_error", Some("policy_refused")),
            ApiError::QueueFull(_) => ("rate_limit_error", Some("queue_full")),
            ApiError::QueueTimeout(_) => ("timeout_error", Some("queue_timeout")),
            ApiError::Unavailable(_) => ("service_unavailable", None),
            ApiError::Internal(_) => ("server_error", None),
        }
    }

    fn retry_after(&self) -> Option<u32> {
        match self {
            ApiError::Refused(r) => r.retry_after_secs,
            ApiError::QueueFull(_) | ApiError::Unavailable(_) => Some(1),
            _ => None,
        }
    }
}

impl From<crate::pipeline::PipelineError> for ApiError {
    fn from(error: crate::pipeline::PipelineError) -> Self {
        match error {
            crate::pipeline::PipelineError::Refused(refusal) => ApiError::Refused(refusal),
            crate::pipeline::PipelineError::Engine(error) => error.into(),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(error: EngineError) -> Self {
        let message = error.to_string();
        match error {
            EngineError::QueueFull { .. } => ApiError::QueueFull(message),
            EngineError::QueueTimeout { .. } => ApiError::QueueTimeout(message),
            EngineError::InvalidRequest(_) => ApiError::Invalid { message, param: None },
            EngineError::Stopped | EngineError::Start(_) => ApiError::Unavailable(message),
            EngineError::Aborted(_) | EngineError::Backend(_) => ApiError::Internal(message),
        }
    }
}

impl ApiError {
    /// The OpenAI-shaped body, `{"error": {message, type, param, code}}`:
    /// the same whether the error ends a whole response or a stream.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code) = self.kind_and_code();
        let param = match self {
            ApiError::Invalid { param, .. } => param.as_deref(),
            ApiError::ContextLength { param, .. } => Some(param.as_str()),
            _ => None,
        };
        json!({ "error": { "message": clipped(self.to_string()), "type": kind, "param": param.map(clipped_str), "code": code } })
    }

    /// Whether the request's body may still be unread, so that the
    /// connection must close after the response.
    fn body_unread(&self) -> bool {
        matches!(self, ApiError::BodyTooLarge(_) | ApiError::BodyTimeout(_))
    }
}

/// Longest message or param an error carries: they quote what the client
/// sent (a model name, a value), which must not come back megabytes long.
const MAX_ERROR_TEXT: usize = 1024;

fn clipped(mut text: String) -> String {
    if text.len() > MAX_ERROR_TEXT {
        let mut end = MAX_ERROR_TEXT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

fn clipped_str(text: &str) -> String {
    clipped(text.chars().take(MAX_ERROR_TEXT + 1).collect())
}

impl From<super::blocking::BlockingError> for ApiError {
    fn from(error: super::blocking::BlockingError) -> Self {
        match error {
            super::blocking::BlockingError::Busy(_) => ApiError::Unavailable(error.to_string()),
            super::blocking::BlockingError::Failed(_) => ApiError::Internal(error.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), Json(self.body())).into_response();
        if self.body_unread() {
            response.headers_mut().insert(axum::http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(secs) = self.retry_after() {
            response.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
        }
        if let ApiError::Refused(r) = &self
            && let Ok(value) = HeaderValue::from_str(&r.plugin)
        {
            response.headers_mut().insert("x-levee-refused-by", value);
        }
        response
    }
}
