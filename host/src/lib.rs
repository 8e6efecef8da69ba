//! Levee: an LLM inference server whose traffic decisions are sandboxed,
//! hot-swappable WebAssembly policy plugins.

pub mod admin;
pub mod capabilities;
pub mod config;
pub mod metrics;
pub mod plugins;
pub mod server;
