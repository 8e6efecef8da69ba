//! The safetensors path: a Hugging Face checkpoint directory (`config.json`,
//! `tokenizer.json`, `tokenizer_config.json`, sharded BF16 `*.safetensors`)
//! written from the default GGUF, then loaded back through `Model::load`.
//!
//! The checkpoint is what a Hugging Face export of the same weights looks
//! like: Hugging Face tensor names, query/key rows in the rotate-half order
//! (GGUF files permute them for interleaved RoPE), the tokenizer as
//! `tokenizer.json`. It must run exactly like the GGUF weights it came from:
//! the same tokens for the same text, the same chat rendering, and the same
//! greedy output as a model holding the same BF16 values in GGUF layout.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{self, Value as Meta};
use levee_gpu::model::{ChatMessage, DType, RopeStyle, Tensor};
use levee_gpu::{Engine, GenerationRequest, Model};
use serde_json::{Value, json};

/// A directory removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `x` rounded to the nearest BF16 value, as its bits.
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

fn bf16_value(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// Rows of a GGUF query or key matrix back in Hugging Face order: GGUF row
/// `h*d + 2i + j` is Hugging Face row `h*d + j*d/2 + i`.
fn unpermute(values: &[f32], cols: usize, heads: usize) -> Vec<f32> {
    let rows = values.len() / cols;
    let d = rows / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..d / 2 {
            for j in 0..2 {
                let from = h * d + 2 * i + j;
                let to = h * d + j * d / 2 + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// Writes `tensors` (name, shape, values) as one BF16 safetensors file.
fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> anyhow::Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in values {
            data.extend_from_slice(&bf16_bits(*v).to_le_bytes());
        }
        header.insert(name.clone(), json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()]}));
    }
    let mut header = serde_json::to_vec(&Value::Object(header))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    std::fs::write(path, file)?;
    Ok(())
}

fn meta_strings(meta: &std::collections::HashMap<String, Meta>, key: &str) -> Vec<String> {
    match meta.get(key) {
        Some(Meta::Array(items)) => items.iter().filter_map(|v| v.to_string().ok().cloned()).collect(),
        _ => panic!("the GGUF has no {key}"),
    }
}

/// Writes the Hugging Face form of the default model into `dir`.
fn export(model: &Model, dir: &Path) -> anyhow::Result<()> {
    let mut file = std::fs::File::open(support::model_path())?;
    let meta = gguf_file::Content::read(&mut file)?.metadata;
    let tokens = meta_strings(&meta, "tokenizer.ggml.tokens");
    let merges = meta_strings(&meta, "tokenizer.ggml.merges");
    let types: Vec<u32> = match meta.get("tokenizer.ggml.token_type") {
        Some(Meta::Array(items)) => items.iter().map(|v| v.to_i32().map(|t| t as u32).unwrap_or(1)).collect(),
        _ => vec![1; tokens.len()],
    };
    let vocab: BTreeMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let added: Vec<Value> = types
        .iter()
        .enumerate()
        .filter(|(_, t)| matches!(t, 3 | 4))
        .map(|(i, _)| json!({"id": i, "content": tokens[i], "special": true}))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "added_tokens": added,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        ]},
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges},
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer)?)?;
    let template = meta.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()).expect("chat template");
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_vec(&json!({"chat_template": template}))?)?;

    let c = &model.config;
    let w = &model.weights;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_context,
        "tie_word_embeddings": w.output.is_none(),
        "bos_token_id": model.tokenizer.bos(),
        "eos_token_id": model.tokenizer.eos(),
        "torch_dtype": "bfloat16",
    });
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;

    let matrix = |name: String, t: &Tensor| (name, vec![t.rows, t.cols], t.to_f32());
    let vector = |name: String, t: &Tensor| (name, vec![t.cols], t.to_f32());
    let mut first = vec![matrix("model.embed_tokens.weight".into(), &w.token_embd)];
    let mut second = vec![vector("model.norm.weight".into(), &w.output_norm)];
    if let Some(o) = &w.output {
        second.push(matrix("lm_head.weight".into(), o));
    }
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let shard = if i < c.n_layers / 2 { &mut first } else { &mut second };
        let (q, k) = (l.wq.to_f32(), l.wk.to_f32());
        shard.push((
            format!("{p}.self_attn.q_proj.weight"),
            vec![l.wq.rows, l.wq.cols],
            unpermute(&q, c.hidden, c.n_heads),
        ));
        shard.push((
            format!("{p}.self_attn.k_proj.weight"),
            vec![l.wk.rows, l.wk.cols],
            unpermute(&k, c.hidden, c.n_kv_heads),
        ));
        shard.push(matrix(format!("{p}.self_attn.v_proj.weight"), &l.wv));
        shard.push(matrix(format!("{p}.self_attn.o_proj.weight"), &l.wo));
        shard.push(matrix(format!("{p}.mlp.gate_proj.weight"), &l.w_gate));
        shard.push(matrix(format!("{p}.mlp.up_proj.weight"), &l.w_up));
        shard.push(matrix(format!("{p}.mlp.down_proj.weight"), &l.w_down));
        shard.push(vector(format!("{p}.input_layernorm.weight"), &l.attn_norm));
        shard.push(vector(format!("{p}.post_attention_layernorm.weight"), &l.ffn_norm));
    }
    write_safetensors(&dir.join("model-00001-of-00002.safetensors"), &first)?;
    write_safetensors(&dir.join("model-00002-of-00002.safetensors"), &second)?;
    Ok(())
}

/// `t` as F32 holding the BF16-rounded values the checkpoint stores.
fn as_bf16_values(t: &mut Tensor) {
    let values: Vec<u8> = t.to_f32().into_iter().flat_map(|v| bf16_value(v).to_le_bytes()).collect();
    t.dtype = DType::F32;
    t.data = values;
}

/// The default model with every weight replaced by its BF16-rounded value,
/// still in GGUF layout (permuted query/key rows, interleaved RoPE).
fn gguf_with_bf16_values() -> Model {
    let mut model = support::load_model();
    let w = &mut model.weights;
    as_bf16_values(&mut w.token_embd);
    as_bf16_values(&mut w.output_norm);
    if let Some(o) = &mut w.output {
        as_bf16_values(o);
    }
    for l in &mut w.layers {
        for t in [
            &mut l.attn_norm,
            &mut l.wq,
            &mut l.wk,
            &mut l.wv,
            &mut l.wo,
            &mut l.ffn_norm,
            &mut l.w_gate,
            &mut l.w_up,
            &mut l.w_down,
        ] {
            as_bf16_values(t);
        }
    }
    model
}

/// Greedy tokens of every prompt, all submitted at once.
fn greedy(model: Model, prompts: &[Vec<u32>], tokens: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let engine = Engine::start(model, support::small_config())?;
    let streams = prompts
        .iter()
        .map(|p| {
            let mut r = GenerationRequest::new(p.clone(), tokens);
            r.sampling.ignore_eos = true;
            engine.submit(r)
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(streams
        .into_iter()
        .map(|s| s.blocking_collect().map(|(t, _)| t.iter().map(|t| t.id).collect()))
        .collect::<Result<_, _>>()?)
}

#[test]
fn a_hugging_face_checkpoint_runs_like_the_gguf_it_came_from() -> anyhow::Result<()> {
    let dir = Scratch(std::env::temp_dir().join(format!("levee-safetensors-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0)?;
    let gguf = support::load_model();
    export(&gguf, &dir.0)?;

    let hf = Model::load(&dir.0)?;
    assert_eq!(hf.config.rope_style, RopeStyle::Neox);
    assert_eq!(
        (hf.config.n_layers, hf.config.hidden, hf.config.n_heads, hf.config.n_kv_heads, hf.config.vocab_size),
        (gguf.config.n_layers, gguf.config.hidden, gguf.config.n_heads, gguf.config.n_kv_heads, gguf.config.vocab_size)
    );
    assert!(hf.weights.output.is_none(), "tied embeddings stay tied");
    assert_eq!(hf.weights.layers[0].wq.dtype, DType::BF16);

    // The tokenizer from tokenizer.json is the one from the GGUF metadata.
    let texts = [
        "The capital of France is",
        "In 1969, 3 astronauts flew 384400 km.",
        "naïve café — 東京 🚀",
        "<|im_start|>user\nHi<|im_end|>",
        "  leading spaces and\ttabs\n\nnew lines",
    ];
    for text in texts {
        let ids = gguf.tokenizer.encode(text);
        assert_eq!(hf.tokenizer.encode(text), ids, "tokens of {text:?}");
        assert_eq!(hf.tokenizer.decode(&ids), gguf.tokenizer.decode(&ids), "text of {text:?}");
    }
    assert_eq!((hf.tokenizer.bos(), hf.tokenizer.eos()), (gguf.tokenizer.bos(), gguf.tokenizer.eos()));
    let chat = [ChatMessage::new("user", "What is the capital of France?")];
    assert_eq!(hf.render_chat(&chat)?, gguf.render_chat(&chat)?, "chat template from tokenizer_config.json");

    let prompts: Vec<Vec<u32>> = [
        "The capital of France is".to_string(),
        "Once upon a time, in a small village by the sea, there lived".to_string(),
        gguf.render_chat(&chat)?,
    ]
    .iter()
    .map(|p| gguf.tokenizer.encode(p))
    .collect();
    drop(gguf);
    let from_hf = greedy(hf, &prompts, 24)?;
    let from_gguf = greedy(gguf_with_bf16_values(), &prompts, 24)?;
    for (i, (a, b)) in from_hf.iter().zip(&from_gguf).enumerate() {
        println!("prompt {i}: {a:?}");
        assert_eq!(a, b, "prompt {i}: the checkpoint and the GGUF layout of the same values disagree");
    }
    let tokenizer = support::load_model().tokenizer;
    let paris = tokenizer.decode(&from_hf[0]);
    println!("safetensors completion: {paris:?}");
    assert!(paris.contains("Paris"), "completion was {paris:?}");
    Ok(())
}
