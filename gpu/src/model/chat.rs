//! Chat templates: the model's own Jinja template from its metadata, or a
//! built-in ChatML rendering when the model has none (or one that cannot run).

use super::tokenizer::Tokenizer;

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The turn's text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and text.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

/// A conversation could not be rendered.
#[derive(Debug, thiserror::Error)]
#[error("the model's chat template failed on this conversation: {0}")]
pub struct ChatError(String);

/// How a conversation becomes a prompt.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: Option<String>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// Uses `source` (a Jinja template) when it renders a sample conversation,
    /// ChatML otherwise.
    pub fn new(source: Option<&str>, tokenizer: &Tokenizer) -> ChatTemplate {
        let text = |id: Option<u32>| id.map(|i| tokenizer.decode(&[i])).unwrap_or_default();
        let mut t =
            ChatTemplate { source: source.map(str::to_string), bos: text(tokenizer.bos()), eos: text(tokenizer.eos()) };
        let sample =
            [ChatMessage::new("system", "s"), ChatMessage::new("user", "u"), ChatMessage::new("assistant", "a")];
        if t.source.is_some() && t.render(&sample).is_err() {
            t.source = None;
        }
        t
    }

    /// The built-in ChatML template.
    pub fn chatml() -> ChatTemplate {
        ChatTemplate { source: None, bos: String::new(), eos: String::new() }
    }

    /// Whether the model's own template is in use (not the ChatML fallback).
    pub fn is_model_template(&self) -> bool {
        self.source.is_some()
    }

    /// Renders `messages` and opens the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatError> {
        let Some(source) = &self.source else {
            return Ok(render_chatml(messages));
        };
        let mut env = minijinja::Environment::new();
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
        };
        env.render_str(source, ctx).map_err(|e| ChatError(e.to_string()))
    }
}

fn render_chatml(messages: &[ChatMessage]) -> String {
    let mut out = String::new();
    for m in messages {
        out.push_str("<|im_start|>");
        out.push_str(&m.role);
        out.push('\n');
        out.push_str(&m.content);
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_fallback_opens_the_assistant_turn() {
        let text = ChatTemplate::chatml().render(&[ChatMessage::new("user", "Hi")]).ok();
        assert_eq!(text.as_deref(), Some("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    }
}
