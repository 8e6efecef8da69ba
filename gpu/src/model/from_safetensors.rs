//! Builds a [`Model`] from a Hugging Face checkpoint directory:
//! `config.json`, `tokenizer.json` (+ optional `tokenizer_config.json`) and
//! one or more `*.safetensors` files with F32, F16 or BF16 tensors.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::chat::ChatTemplate;
use super::dtype::DType;
use super::tokenizer::{Tokenizer, TokenizerSpec};
use super::{LayerWeights, Model, ModelConfig, ModelError, RopeStyle, Tensor, Weights};

/// Loads a checkpoint directory.
pub fn load(dir: &Path) -> Result<Model, ModelError> {
    let config_path = dir.join("config.json");
    let json = read_json(&config_path)?;
    let config = config(&config_path, &json)?;
    let mut tensors = HashMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| ModelError::Io { path: dir.display().to_string(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::malformed(&dir.display().to_string(), "the directory holds no .safetensors file"));
    }
    for file in &files {
        read_safetensors(file, &mut tensors)?;
    }
    let shown = dir.display().to_string();
    let weights = weights(&shown, &config, &json, &mut tensors)?;
    super::check_weights(&shown, &config, &weights)?;

    let tok_path = dir.join("tokenizer.json");
    let mut spec = TokenizerSpec::from_tokenizer_json(&read_json(&tok_path)?)
        .map_err(|source| ModelError::Tokenizer { path: tok_path.display().to_string(), source })?;
    let id = |v: &Value| {
        v.as_u64().or_else(|| v.as_array().and_then(|a| a.first()).and_then(Value::as_u64)).map(|v| v as u32)
    };
    spec.bos = id(&json["bos_token_id"]);
    spec.eos = id(&json["eos_token_id"]);
    let tokenizer = Tokenizer::new(spec)
        .map_err(|source| ModelError::Tokenizer { path: tok_path.display().to_string(), source })?;
    super::check_vocab(&tok_path.display().to_string(), &config, &tokenizer)?;
    let tok_config = read_json(&dir.join("tokenizer_config.json")).ok();
    let template = tok_config.as_ref().and_then(|c| c["chat_template"].as_str());
    let chat_template = ChatTemplate::new(template, &tokenizer);
    Ok(Model { source: shown, config, weights, tokenizer, chat_template })
}

fn read_json(path: &Path) -> Result<Value, ModelError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io { path: shown.clone(), source })?;
    serde_json::from_str(&text).map_err(|e| ModelError::malformed(&shown, format!("invalid JSON: {e}")))
}

fn config(path: &Path, j: &Value) -> Result<ModelConfig, ModelError> {
    let shown = path.display().to_string();
    let arch = j["model_type"].as_str().unwrap_or("llama").to_string();
    if !matches!(arch.as_str(), "llama" | "mistral" | "qwen2") {
        return Err(ModelError::Unsupported {
            path: shown,
            what: format!("model_type {arch} is not supported (llama, mistral and qwen2 are)"),
        });
    }
    let int = |k: &str| {
        j[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::malformed(&shown, format!("{k} is missing or not an integer")))
    };
    let hidden = int("hidden_size")?;
    let n_heads = int("num_attention_heads")?;
    let n_kv_heads = int("num_key_value_heads").unwrap_or(n_heads);
    if n_heads == 0 || n_kv_heads == 0 || hidden % n_heads != 0 || n_heads % n_kv_heads != 0 {
        return Err(ModelError::malformed(
            &shown,
            format!("{n_heads} heads and {n_kv_heads} key/value heads do not divide width {hidden}"),
        ));
    }
    let head_dim = int("head_dim").unwrap_or(hidden / n_heads);
    Ok(ModelConfig {
        n_layers: int("num_hidden_layers")?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        ffn_hidden: int("intermediate_size")?,
        vocab_size: int("vocab_size")?,
        rms_eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        rope_theta: j["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
        rope_style: RopeStyle::Neox,
        max_context: int("max_position_embeddings").unwrap_or(2048),
        architecture: arch,
    })
}

fn read_safetensors(path: &Path, out: &mut HashMap<String, Tensor>) -> Result<(), ModelError> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io { path: shown.clone(), source })?;
    let header_len = bytes
        .get(..8)
        .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as usize)
        .filter(|&n| n <= bytes.len() - 8)
        .ok_or_else(|| ModelError::malformed(&shown, "too short for a safetensors header"))?;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len])
        .map_err(|e| ModelError::malformed(&shown, format!("header is not JSON: {e}")))?;
    let data = &bytes[8 + header_len..];
    let Some(entries) = header.as_object() else {
        return Err(ModelError::malformed(&shown, "header is not a JSON object"));
    };
    for (name, entry) in entries {
        if name == "__metadata__" {
            continue;
        }
        let dtype = match entry["dtype"].as_str() {
            Some("F32") => DType::F32,
            Some("F16") => DType::F16,
            Some("BF16") => DType::BF16,
            other => {
                return Err(ModelError::UnsupportedTensorType {
                    path: shown,
                    tensor: name.clone(),
                    dtype: format!("{other:?}"),
                });
            }
        };
        let shape: Vec<usize> =
            entry["shape"].as_array().into_iter().flatten().filter_map(Value::as_u64).map(|v| v as usize).collect();
        let offsets: Vec<usize> = entry["data_offsets"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_u64)
            .map(|v| v as usize)
            .collect();
        let (cols, rows) = match shape.as_slice() {
            [n] => (*n, 1),
            [r, c] => (*c, *r),
            _ => return Err(ModelError::malformed(&shown, format!("tensor {name} has shape {shape:?}"))),
        };
        let expected = dtype.bytes_for(rows * cols);
        let range = match offsets.as_slice() {
            [s, e] if *e <= data.len() && s <= e && Some(e - s) == expected => *s..*e,
            _ => {
                return Err(ModelError::malformed(
                    &shown,
                    format!("tensor {name} has data offsets {offsets:?} that do not fit its shape"),
                ));
            }
        };
        out.insert(name.clone(), Tensor { name: name.clone(), dtype, rows, cols, data: data[range].to_vec() });
    }
    Ok(())
}

fn weights(path: &str, c: &ModelConfig, json: &Value, t: &mut HashMap<String, Tensor>) -> Result<Weights, ModelError> {
    let mut take = |n: &str| {
        t.remove(n).ok_or_else(|| ModelError::MissingTensor { path: path.to_string(), tensor: n.to_string() })
    };
    // Not sized from the configuration: a corrupt layer count must end in a
    // missing-tensor error, not an allocation failure.
    let mut layers = Vec::new();
    for i in 0..c.n_layers {
        let p = format!("model.layers.{i}");
        let qkv_bias = match take(&format!("{p}.self_attn.q_proj.bias")) {
            Ok(bq) => {
                Some([bq, take(&format!("{p}.self_attn.k_proj.bias"))?, take(&format!("{p}.self_attn.v_proj.bias"))?])
            }
            Err(_) => None,
        };
        layers.push(LayerWeights {
            attn_norm: take(&format!("{p}.input_layernorm.weight"))?,
            wq: take(&format!("{p}.self_attn.q_proj.weight"))?,
            wk: take(&format!("{p}.self_attn.k_proj.weight"))?,
            wv: take(&format!("{p}.self_attn.v_proj.weight"))?,
            qkv_bias,
            wo: take(&format!("{p}.self_attn.o_proj.weight"))?,
            ffn_norm: take(&format!("{p}.post_attention_layernorm.weight"))?,
            w_gate: take(&format!("{p}.mlp.gate_proj.weight"))?,
            w_up: take(&format!("{p}.mlp.up_proj.weight"))?,
            w_down: take(&format!("{p}.mlp.down_proj.weight"))?,
        });
    }
    let tied = json["tie_word_embeddings"].as_bool().unwrap_or(false);
    let output = if tied { None } else { take("lm_head.weight").ok() };
    Ok(Weights {
        token_embd: take("model.embed_tokens.weight")?,
        layers,
        output_norm: take("model.norm.weight")?,
        output,
    })
}
