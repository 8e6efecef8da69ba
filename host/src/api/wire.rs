//! The OpenAI-compatible request bodies, as clients send them. Unknown
//! fields are ignored, as OpenAI does; values are checked in `validate`.

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
    /// Newer spelling of `max_tokens` (chat).
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
    /// End-user id.
    pub user: Option<String>,
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
pub struct DetokenizeBody {
    /// Model name (optional).
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids.
    pub tokens: Vec<u32>,
}

/// Parses a JSON body, naming the field of the first error.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, super::error::ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if path == "." || path.is_empty() {
            format!("the body is not a valid request: {inner}")
        } else {
            format!("`{path}` is invalid: {inner}")
        };
        super::error::ApiError::Invalid { message, param: (path != ".").then_some(path) }
    })
}
