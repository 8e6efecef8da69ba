//! Levee: an LLM inference server whose traffic decisions are sandboxed,
//! hot-swappable WebAssembly policy plugins.

pub mod admin;
pub mod api;
pub mod capabilities;
pub mod cli;
pub mod coalesce;
pub mod config;
pub mod listener;
pub mod metrics;
pub mod pipeline;
pub mod plugins;
pub mod scaling;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod tenancy;
