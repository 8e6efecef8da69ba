//! Builds a [`Model`] from a GGUF file: configuration from `{arch}.*` keys,
//! weights from the tensor directory, tokenizer from `tokenizer.ggml.*`.

use std::path::Path;

use super::chat::ChatTemplate;
use super::gguf::{GgufFile, MetaValue};
use super::tokenizer::{Tokenizer, TokenizerSpec};
use super::{LayerWeights, Model, ModelConfig, ModelError, RopeStyle, Tensor, Weights};

/// Loads a GGUF model file.
pub fn load(path: &Path) -> Result<Model, ModelError> {
    let file = GgufFile::open(path)?;
    let config = config(&file)?;
    let weights = weights(&file, &config)?;
    super::check_weights(&file.path, &config, &weights)?;
    let tokenizer = tokenizer(&file)?;
    super::check_vocab(&file.path, &config, &tokenizer)?;
    let template = file.meta("tokenizer.chat_template").and_then(MetaValue::as_str);
    let chat_template = ChatTemplate::new(template, &tokenizer);
    Ok(Model { source: file.path.clone(), config, weights, tokenizer, chat_template })
}

fn config(f: &GgufFile) -> Result<ModelConfig, ModelError> {
    let arch = f
        .meta("general.architecture")
        .and_then(MetaValue::as_str)
        .ok_or_else(|| ModelError::malformed(&f.path, "metadata key general.architecture is missing"))?
        .to_string();
    let rope_style = match arch.as_str() {
        "llama" | "mistral" => RopeStyle::Interleaved,
        "qwen2" => RopeStyle::Neox,
        other => {
            return Err(ModelError::Unsupported {
                path: f.path.clone(),
                what: format!("architecture {other} is not supported (llama, mistral and qwen2 are)"),
            });
        }
    };
    let key = |k: &str| format!("{arch}.{k}");
    let hidden = f.meta_usize(&key("embedding_length"))?;
    let n_heads = f.meta_usize(&key("attention.head_count"))?;
    let n_kv_heads = f.meta_usize(&key("attention.head_count_kv")).unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 || hidden % n_heads != 0 || n_heads % n_kv_heads != 0 {
        return Err(ModelError::malformed(
            &f.path,
            format!("{n_heads} query heads and {n_kv_heads} key/value heads do not divide width {hidden}"),
        ));
    }
    let head_dim = f.meta_usize(&key("attention.key_length")).unwrap_or(hidden / n_heads);
    if !head_dim.is_multiple_of(2) {
        return Err(ModelError::malformed(&f.path, format!("head width {head_dim} is odd; RoPE needs pairs")));
    }
    let vocab_size = match f.tensors.get("token_embd.weight") {
        Some(t) if t.dims.len() == 2 => t.dims[1],
        _ => return Err(ModelError::MissingTensor { path: f.path.clone(), tensor: "token_embd.weight".into() }),
    };
    let float = |k: &str, default: f64| f.meta(&key(k)).and_then(MetaValue::as_f64).unwrap_or(default) as f32;
    Ok(ModelConfig {
        n_layers: f.meta_usize(&key("block_count"))?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_hidden: f.meta_usize(&key("feed_forward_length"))?,
        vocab_size,
        rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta: float("rope.freq_base", 10_000.0),
        rope_style,
        max_context: f.meta_usize(&key("context_length")).unwrap_or(2048),
        architecture: arch,
    })
}

fn tensor(f: &GgufFile, name: &str) -> Result<Tensor, ModelError> {
    let info =
        f.tensors.get(name).ok_or_else(|| ModelError::MissingTensor { path: f.path.clone(), tensor: name.into() })?;
    let cols = info.dims[0];
    let rows = info.dims[1..].iter().product();
    Ok(Tensor { name: name.to_string(), dtype: info.dtype, rows, cols, data: f.bytes[info.range.clone()].to_vec() })
}

fn weights(f: &GgufFile, c: &ModelConfig) -> Result<Weights, ModelError> {
    // Not sized from the file's block count: a corrupt count must end in a
    // missing-tensor error, not an allocation failure.
    let mut layers = Vec::new();
    for i in 0..c.n_layers {
        let t = |n: &str| tensor(f, &format!("blk.{i}.{n}"));
        let qkv_bias = if f.tensors.contains_key(&format!("blk.{i}.attn_q.bias")) {
            Some([t("attn_q.bias")?, t("attn_k.bias")?, t("attn_v.bias")?])
        } else {
            None
        };
        layers.push(LayerWeights {
            attn_norm: t("attn_norm.weight")?,
            wq: t("attn_q.weight")?,
            wk: t("attn_k.weight")?,
            wv: t("attn_v.weight")?,
            qkv_bias,
            wo: t("attn_output.weight")?,
            ffn_norm: t("ffn_norm.weight")?,
            w_gate: t("ffn_gate.weight")?,
            w_up: t("ffn_up.weight")?,
            w_down: t("ffn_down.weight")?,
        });
    }
    let output = if f.tensors.contains_key("output.weight") { Some(tensor(f, "output.weight")?) } else { None };
    Ok(Weights {
        token_embd: tensor(f, "token_embd.weight")?,
        layers,
        output_norm: tensor(f, "output_norm.weight")?,
        output,
    })
}

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>, ModelError> {
    match f.meta(key) {
        Some(MetaValue::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| ModelError::malformed(&f.path, format!("{key} holds a non-string entry"))),
        _ => Err(ModelError::malformed(&f.path, format!("metadata key {key} is missing or not an array"))),
    }
}

fn tokenizer(f: &GgufFile) -> Result<Tokenizer, ModelError> {
    let model = f.meta("tokenizer.ggml.model").and_then(MetaValue::as_str).unwrap_or("");
    if model != "gpt2" {
        return Err(ModelError::Unsupported {
            path: f.path.clone(),
            what: format!("tokenizer model {model:?} is not supported yet (byte-level BPE, \"gpt2\", is)"),
        });
    }
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let merges = strings(f, "tokenizer.ggml.merges")?;
    let types: Vec<u64> = match f.meta("tokenizer.ggml.token_type") {
        Some(MetaValue::Array(items)) => items.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    // Types 3 (control) and 4 (user-defined) are matched whole in text.
    let special: Vec<u32> =
        types.iter().enumerate().filter(|(_, t)| matches!(t, 3 | 4)).map(|(i, _)| i as u32).collect();
    let id = |k: &str| f.meta(k).and_then(MetaValue::as_u64).map(|v| v as u32);
    let pre = f.meta("tokenizer.ggml.pre").and_then(MetaValue::as_str).unwrap_or("default");
    let spec = TokenizerSpec {
        tokens,
        merges: merges
            .into_iter()
            .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_string(), b.to_string())))
            .collect(),
        special,
        bos: id("tokenizer.ggml.bos_token_id"),
        eos: id("tokenizer.ggml.eos_token_id"),
        add_bos: f.meta("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(false),
        split_digits: matches!(pre, "smollm" | "starcoder" | "refact" | "deepseek-coder"),
    };
    Tokenizer::new(spec).map_err(|source| ModelError::Tokenizer { path: f.path.clone(), source })
}
