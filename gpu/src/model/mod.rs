//! The model: configuration, weights, tokenizer and chat template of a
//! Llama-family decoder (Llama, SmolLM, Qwen2, Mistral shapes), loaded from a
//! GGUF file or from a safetensors directory with `config.json`.

mod chat;
mod dtype;
mod from_gguf;
mod from_safetensors;
mod gguf;
mod pretokenize;
mod tokenizer;

use std::path::Path;

pub use chat::{ChatError, ChatMessage, ChatTemplate};
pub use dtype::{DType, f16_to_f32};
pub use tokenizer::{Decoder, Tokenizer, TokenizerError};

/// A model that cannot be loaded, naming the file and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File that failed.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The file is not what its format promises.
    #[error("{path} is malformed: {what}")]
    Malformed {
        /// File that failed.
        path: String,
        /// What is wrong.
        what: String,
    },
    /// A tensor type this engine cannot run.
    #[error(
        "{path}: tensor {tensor} has type {dtype}, which Levee does not support yet (use F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K)"
    )]
    UnsupportedTensorType {
        /// File that failed.
        path: String,
        /// Tensor name.
        tensor: String,
        /// Its type's name.
        dtype: String,
    },
    /// A model architecture or feature this engine cannot run.
    #[error("{path}: {what}")]
    Unsupported {
        /// File that failed.
        path: String,
        /// What is unsupported.
        what: String,
    },
    /// A required tensor is absent.
    #[error("{path} has no tensor {tensor}; is this a Llama-family decoder?")]
    MissingTensor {
        /// File that failed.
        path: String,
        /// Tensor name.
        tensor: String,
    },
    /// A tensor's shape does not match the configuration.
    #[error("{path}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    Shape {
        /// File that failed.
        path: String,
        /// Tensor name.
        tensor: String,
        /// Shape found, rows then columns.
        found: (usize, usize),
        /// Shape expected, rows then columns.
        expected: (usize, usize),
    },
    /// The tokenizer could not be built.
    #[error("{path}: {source}")]
    Tokenizer {
        /// File that failed.
        path: String,
        /// Underlying error.
        source: TokenizerError,
    },
}

impl ModelError {
    fn malformed(path: &str, what: impl Into<String>) -> ModelError {
        ModelError::Malformed { path: path.to_string(), what: what.into() }
    }
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF Llama files, whose Q/K rows are permuted for it.
    Interleaved,
    /// Halves `(i, i + d/2)`: Hugging Face checkpoints, Qwen2.
    Neox,
}

/// Shape and hyper-parameters of a decoder.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Architecture name as the file states it (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Width of the SwiGLU inner layer.
    pub ffn_hidden: usize,
    /// Vocabulary size (rows of the embedding table).
    pub vocab_size: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// RoPE pairing.
    pub rope_style: RopeStyle,
    /// Longest context the model was trained for.
    pub max_context: usize,
}

impl ModelConfig {
    /// Width of all query heads together.
    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// One stored tensor, as a row-major matrix of `rows` rows of `cols` elements.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// Name in the source file.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Rows (output features for a weight matrix; 1 for a vector).
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Raw bytes, `rows * row_bytes()`.
    pub data: Vec<u8>,
}

impl Tensor {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// Raw bytes of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.data[r * n..(r + 1) * n]
    }

    /// All elements as `f32`, row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dtype.dequantize_row(self.row(r), o);
        }
        out
    }
}

/// Weights of one transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm before attention.
    pub attn_norm: Tensor,
    /// Query projection.
    pub wq: Tensor,
    /// Key projection.
    pub wk: Tensor,
    /// Value projection.
    pub wv: Tensor,
    /// Optional query/key/value biases (Qwen2).
    pub qkv_bias: Option<[Tensor; 3]>,
    /// Attention output projection.
    pub wo: Tensor,
    /// RMSNorm before the feed-forward block.
    pub ffn_norm: Tensor,
    /// SwiGLU gate projection.
    pub w_gate: Tensor,
    /// SwiGLU up projection.
    pub w_up: Tensor,
    /// SwiGLU down projection.
    pub w_down: Tensor,
}

/// All weights of a decoder.
#[derive(Debug, Clone)]
pub struct Weights {
    /// Token embedding table, `vocab_size x hidden`.
    pub token_embd: Tensor,
    /// Transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm.
    pub output_norm: Tensor,
    /// LM head; `None` when tied to the embedding table.
    pub output: Option<Tensor>,
}

/// A loaded model, ready to hand to [`crate::Engine::start`].
pub struct Model {
    /// Where it came from, for logs and errors.
    pub source: String,
    /// Shape and hyper-parameters.
    pub config: ModelConfig,
    /// Weights, in the file's own types.
    pub weights: Weights,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// Chat template.
    pub chat_template: ChatTemplate,
}

impl Model {
    /// Loads a model from a `.gguf` file, or from a directory holding
    /// `config.json`, `tokenizer.json` and `*.safetensors`.
    pub fn load(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        let path = path.as_ref();
        if path.is_dir() { from_safetensors::load(path) } else { from_gguf::load(path) }
    }

    /// Renders a conversation with the model's chat template, ending with the
    /// assistant's turn.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, chat::ChatError> {
        self.chat_template.render(messages)
    }
}

/// Checks a tensor's shape against what the configuration requires.
fn expect_shape(path: &str, t: &Tensor, rows: usize, cols: usize) -> Result<(), ModelError> {
    if (t.rows, t.cols) == (rows, cols) {
        Ok(())
    } else {
        Err(ModelError::Shape {
            path: path.to_string(),
            tensor: t.name.clone(),
            found: (t.rows, t.cols),
            expected: (rows, cols),
        })
    }
}

/// Checks that every token the tokenizer can produce has a row in the
/// embedding table (a tokenizer from another model would otherwise index
/// past it).
fn check_vocab(path: &str, config: &ModelConfig, tokenizer: &Tokenizer) -> Result<(), ModelError> {
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::malformed(
            path,
            format!(
                "the tokenizer has {} tokens but the embedding table only {} rows; are they from the same model?",
                tokenizer.vocab_size(),
                config.vocab_size
            ),
        ));
    }
    Ok(())
}

/// Checks every tensor of `weights` against `config`.
fn check_weights(path: &str, config: &ModelConfig, w: &Weights) -> Result<(), ModelError> {
    let (h, q, kv, f) = (config.hidden, config.q_width(), config.kv_width(), config.ffn_hidden);
    expect_shape(path, &w.token_embd, config.vocab_size, h)?;
    expect_shape(path, &w.output_norm, 1, h)?;
    if let Some(o) = &w.output {
        expect_shape(path, o, config.vocab_size, h)?;
    }
    for l in &w.layers {
        expect_shape(path, &l.attn_norm, 1, h)?;
        expect_shape(path, &l.wq, q, h)?;
        expect_shape(path, &l.wk, kv, h)?;
        expect_shape(path, &l.wv, kv, h)?;
        expect_shape(path, &l.wo, h, q)?;
        expect_shape(path, &l.ffn_norm, 1, h)?;
        expect_shape(path, &l.w_gate, f, h)?;
        expect_shape(path, &l.w_up, f, h)?;
        expect_shape(path, &l.w_down, h, f)?;
        if let Some([bq, bk, bv]) = &l.qkv_bias {
            expect_shape(path, bq, 1, q)?;
            expect_shape(path, bk, 1, kv)?;
            expect_shape(path, bv, 1, kv)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::tokenizer::TokenizerSpec;
    use super::*;

    fn config(vocab_size: usize) -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            n_layers: 1,
            hidden: 8,
            n_heads: 2,
            n_kv_heads: 1,
            head_dim: 4,
            ffn_hidden: 16,
            vocab_size,
            rms_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_style: RopeStyle::Neox,
            max_context: 64,
        }
    }

    #[test]
    fn a_tokenizer_larger_than_the_embedding_table_is_refused() {
        let tokenizer =
            Tokenizer::new(TokenizerSpec::plain(["a", "b", "c"].map(String::from).to_vec())).expect("tokenizer");
        assert!(check_vocab("m/tokenizer.json", &config(3), &tokenizer).is_ok());
        assert!(check_vocab("m/tokenizer.json", &config(4), &tokenizer).is_ok(), "padded tables are fine");
        let err = check_vocab("m/tokenizer.json", &config(2), &tokenizer).expect_err("refused").to_string();
        assert!(err.contains("m/tokenizer.json") && err.contains("3 tokens") && err.contains("2 rows"), "{err}");
    }
}
