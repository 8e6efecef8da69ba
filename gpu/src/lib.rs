//! Levee's inference engine: a Llama-family model served with continuous
//! batching over a paged KV cache. The engine knows nothing about HTTP or Wasm.
