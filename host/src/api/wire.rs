//! The OpenAI-compatible request bodies, as clients send them; values are
//! checked in `validate`. As with OpenAI, a field this server does not know is
//! refused, not ignored; so is a known field asking for something Levee does
//! not do (tools, a JSON response format, logit bias, ...), unless its value
//! asks for nothing.

use serde::Deserialize;

/// `prompt`: one text, several texts, or token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    /// One prompt.
    Text(String),
    /// Several prompts.
    Texts(Vec<String>),
    /// One prompt as token ids.
    Tokens(Vec<u32>),
    /// Several prompts as token ids.
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one sequence or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    /// One stop sequence.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// Send a last chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by both routes (parsed from the same body as the
/// route's own fields, so that an error names its field).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    /// Model name.
    #[serde(default)]
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Newer spelling of `max_tokens` (chat only: the completions route
    /// refuses it as an unknown field).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature, 0 to 2.
    pub temperature: Option<f32>,
    /// Nucleus sampling, (0, 1].
    pub top_p: Option<f32>,
    /// Top-k sampling (vLLM extension); -1 or 0 keeps all.
    pub top_k: Option<i64>,
    /// Choices to generate.
    pub n: Option<i64>,
    /// Stop sequences.
    pub stop: Option<StopInput>,
    /// Sampler seed.
    pub seed: Option<i64>,
    /// -2 to 2.
    pub presence_penalty: Option<f32>,
    /// -2 to 2.
    pub frequency_penalty: Option<f32>,
    /// vLLM extension, > 0 (1 = off).
    pub repetition_penalty: Option<f32>,
    /// End-user id (accepted for compatibility; tenants come from API keys).
    pub user: Option<String>,
    /// Token ids that end generation (vLLM extension).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past the end-of-sequence token (vLLM extension).
    pub ignore_eos: Option<bool>,
    /// Scheduling priority (vLLM extension): lower runs first.
    pub priority: Option<i64>,
    /// Server-sent events.
    #[serde(default)]
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionBody {
    /// The prompt(s).
    pub prompt: PromptInput,
    /// Top log-probabilities per token, 0 to 20.
    pub logprobs: Option<i64>,
}

/// A chat message's content: text, or parts of which the text ones count.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// Content parts.
    Parts(Vec<ContentPart>),
}

/// One content part.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContentPart {
    /// `text` (others are refused).
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a `text` part.
    #[serde(default)]
    pub text: Option<String>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WireMessage {
    /// `system`, `user`, `assistant` (or `developer`, `tool`).
    pub role: String,
    /// The content; may be null for assistant messages.
    #[serde(default)]
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatBody {
    /// The conversation.
    pub messages: Vec<WireMessage>,
    /// Return log-probabilities.
    pub logprobs: Option<bool>,
    /// Top alternatives per token, 0 to 20.
    pub top_logprobs: Option<i64>,
}

/// `POST /tokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizeBody {
    /// Model name (optional).
    #[serde(default)]
    pub model: Option<String>,
    /// Text to tokenize.
    #[serde(default)]
    pub prompt: Option<String>,
    /// Or a conversation, rendered with the chat template first.
    #[serde(default)]
    pub messages: Option<Vec<WireMessage>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DetokenizeBody {
    /// Model name (optional).
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// Fields both generation routes read.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "n",
    "stop",
    "stop_token_ids",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "user",
    "ignore_eos",
    "priority",
    "stream",
    "stream_options",
];

/// Fields `POST /v1/completions` reads besides the common ones.
pub const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs"];

/// Fields `POST /v1/chat/completions` reads besides the common ones.
pub const CHAT_FIELDS: &[&str] = &["messages", "logprobs", "top_logprobs", "max_completion_tokens"];

/// Whether `value` of a known OpenAI (or vLLM) field that Levee does not
/// implement asks for nothing, so that the request means the same without
/// it; `None` for a field this server does not know at all.
fn asks_for_nothing(field: &str, value: &serde_json::Value) -> Option<bool> {
    use serde_json::Value;
    let empty_object = |v: &Value| v.as_object().is_some_and(|o| o.is_empty());
    let empty_array = |v: &Value| v.as_array().is_some_and(|a| a.is_empty());
    Some(
        value.is_null()
            || match field {
                "logit_bias" => empty_object(value),
                "tools" | "functions" => empty_array(value),
                "tool_choice" | "function_call" => value.as_str() == Some("none"),
                "response_format" => value.get("type").and_then(Value::as_str) == Some("text"),
                "echo" | "store" => value.as_bool() == Some(false),
                "suffix" => value.as_str() == Some(""),
                "best_of" => value.as_i64() == Some(1),
                "min_tokens" => value.as_i64() == Some(0),
                // Metadata that changes no output.
                "parallel_tool_calls" | "metadata" | "service_tier" => true,
                _ => return None,
            },
    )
}

/// Refuses a field this server does not read, naming it: unknown fields,
/// and known ones (tools, response formats, ...) that ask for something
/// Levee does not do.
fn check_fields(
    fields: &serde_json::Map<String, serde_json::Value>,
    route_fields: &[&str],
) -> Result<(), super::error::ApiError> {
    for (name, value) in fields {
        if COMMON_FIELDS.contains(&name.as_str()) || route_fields.contains(&name.as_str()) {
            continue;
        }
        let message = match asks_for_nothing(name, value) {
            Some(true) => continue,
            Some(false) => format!("`{name}` is not supported by this server"),
            None => format!("unrecognized request argument `{name}`"),
        };
        return Err(super::error::ApiError::Invalid { message, param: Some(name.clone()) });
    }
    Ok(())
}

/// Parses a generation body once: the common fields and the route's own
/// (`route_fields` names them), after refusing any field neither reads.
pub fn parse_generation<R: serde::de::DeserializeOwned>(
    body: &[u8],
    route_fields: &[&str],
) -> Result<(CommonFields, R), super::error::ApiError> {
    let value: serde_json::Value = parse(body)?;
    let Some(fields) = value.as_object() else {
        return Err(super::error::ApiError::Invalid { message: "the body must be a JSON object".into(), param: None });
    };
    check_fields(fields, route_fields)?;
    Ok((from_value(&value)?, from_value(&value)?))
}

/// What a field of several accepted shapes must be, for errors that serde
/// would word with the name of a Rust type.
fn expected_shape(path: &str) -> &'static str {
    match path.rsplit('.').next().unwrap_or(path) {
        "prompt" => "a string, a list of strings, a list of token ids or a list of lists of token ids",
        "stop" => "a string or a list of strings",
        field if field.starts_with("content") => "a string or a list of content parts",
        _ => "of another shape",
    }
}

/// Turns a serde error at `path` into the API's error naming the field.
fn field_error(path: String, inner: impl std::fmt::Display) -> super::error::ApiError {
    let inner = inner.to_string();
    let inner = if inner.contains("untagged enum") {
        format!("it must be {}", expected_shape(&path))
    } else {
        // "expected struct StreamOptions" -> "expected an object"; serde puts
        // this last, after any quoted value the client sent.
        match inner.rfind("expected struct ").map(|at| at + "expected ".len()) {
            Some(at) => {
                let name = at + "struct ".len();
                let end =
                    inner[name..].find(|c: char| !c.is_alphanumeric() && c != '_').map_or(inner.len(), |e| name + e);
                format!("{}an object{}", &inner[..at], &inner[end..])
            }
            None => inner,
        }
    };
    let message = if path == "." || path.is_empty() {
        format!("the body is not a valid request: {inner}")
    } else {
        format!("`{path}` is invalid: {inner}")
    };
    super::error::ApiError::Invalid { message, param: (path != "." && !path.contains('?')).then_some(path) }
}

fn from_value<T: serde::de::DeserializeOwned>(value: &serde_json::Value) -> Result<T, super::error::ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| field_error(e.path().to_string(), e.into_inner()))
}

/// Parses a JSON body, naming the field of the first error. Bytes after
/// the JSON value (other than white space) are refused, not ignored.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, super::error::ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() { not_json(inner) } else { field_error(path, inner) }
    })?;
    deserializer.end().map_err(not_json)?;
    Ok(value)
}

/// A body that is not one JSON value: no field to name.
fn not_json(inner: serde_json::Error) -> super::error::ApiError {
    super::error::ApiError::Invalid { message: format!("the body is not valid JSON: {inner}"), param: None }
}
