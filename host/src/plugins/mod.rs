//! The plugin runtime: policy plugins are WebAssembly components of the
//! `levee:policy@0.1.0` world, compiled once, instantiated from an
//! `InstancePre` with the pooling allocator, and called under an epoch
//! deadline and a memory cap, with no filesystem, network or environment.
//!
//! Instances are pooled and reused across requests, so a plugin's own
//! memory lives as long as one instance: it may vanish at any reload or
//! fault. State that must be shared or must last goes through the host's
//! key-value, token-bucket and vector imports.

pub mod bindings;
pub mod chain;
pub mod instance;
pub mod logs;
pub mod reload;
pub mod runtime;
pub mod state;
pub mod stats;

pub use chain::{Chain, Policies, Refusal, ServedHit};
pub use instance::LoadedPlugin;
pub use reload::{PluginSystem, ReloadHandle, ReloadReport};
pub use runtime::{PluginError, PluginRuntime};
pub use stats::{FAULT_KINDS, Fault, PluginStats};
