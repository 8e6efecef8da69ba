//! `levee.toml`: one typed tree, deserialized with `deny_unknown_fields`.
//!
//! Sub-structs are handed to the parts that own them; relative paths in the
//! file are resolved against the file's own directory.

use serde::Deserialize;
use std::path::{Path, PathBuf};

/// The whole configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct Config {
    /// HTTP listener.
    pub server: ServerConfig,
    /// Admin API.
    pub admin: AdminConfig,
    /// Settings shared by every plugin.
    pub plugin_runtime: PluginRuntimeConfig,
    /// The policy chain, in call order.
    pub plugins: Vec<PluginConfig>,
}

/// HTTP listener settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self { listen: "127.0.0.1:8000".to_string() }
    }
}

/// Admin API settings.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct AdminConfig {
    /// Bearer token for `/admin/*`. Without one, the admin API refuses every call.
    pub token: Option<String>,
}

/// Settings of the plugin runtime as a whole.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default, rename_all = "kebab-case")]
pub struct PluginRuntimeConfig {
    /// Reload a plugin when its `.wasm` file changes on disk.
    pub watch: bool,
    /// How often the watched files are checked, in milliseconds.
    pub watch_interval_ms: u64,
    /// Granularity of deadlines: the epoch ticks this often, in microseconds.
    pub epoch_tick_us: u64,
    /// Instances all plugins together may have at once (pooling allocator slots).
    pub max_instances: u32,
    /// Idle instances kept per plugin for reuse.
    pub idle_instances: usize,
    /// Largest memory cap any plugin may ask for, in MiB.
    pub max_memory_mib: u64,
    /// Consecutive faults after which a plugin is quarantined (skipped under its `on-fault` rule).
    pub quarantine_after: u32,
    /// Time budget for `init`, in milliseconds.
    pub init_budget_ms: f64,
}

impl Default for PluginRuntimeConfig {
    fn default() -> Self {
        Self {
            watch: true,
            watch_interval_ms: 500,
            epoch_tick_us: 500,
            max_instances: 256,
            idle_instances: 8,
            max_memory_mib: 256,
            quarantine_after: 5,
            init_budget_ms: 2000.0,
        }
    }
}

/// What the host does when a plugin faults (trap, deadline, memory cap,
/// malformed decision) or is quarantined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnFault {
    /// Carry on as if the plugin had decided nothing.
    #[default]
    Open,
    /// Refuse the request with 503.
    Closed,
}

/// Whether a plugin's decisions are applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Decisions are applied.
    #[default]
    Enforce,
    /// Decisions are counted and logged, never applied.
    Shadow,
}

/// One plugin of the chain.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct PluginConfig {
    /// Name used in logs, metrics and the admin API.
    pub name: String,
    /// Path of the component (`.wasm`).
    pub path: PathBuf,
    /// The plugin's own settings, passed to its `init` as JSON.
    #[serde(default)]
    pub config: toml::Table,
    /// Fault rule.
    #[serde(default)]
    pub on_fault: OnFault,
    /// Enforce or shadow.
    #[serde(default)]
    pub mode: Mode,
    /// Time budget of one hook call, in milliseconds.
    #[serde(default = "default_time_budget_ms")]
    pub time_budget_ms: f64,
    /// Memory cap of one instance, in MiB.
    #[serde(default = "default_memory_mib")]
    pub memory_mib: u64,
}

fn default_time_budget_ms() -> f64 {
    10.0
}

fn default_memory_mib() -> u64 {
    64
}

/// A configuration that cannot be used, with a message naming the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML or has unknown or mistyped fields.
    #[error("{path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message, naming the field.
        message: String,
    },
    /// A value is out of its range.
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// Reads and validates `path`; relative plugin paths are resolved against its directory.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_owned(), source })?;
        let mut config = Self::parse(&text).map_err(|e| match e {
            ConfigError::Parse { message, .. } => ConfigError::Parse { path: path.to_owned(), message },
            other => other,
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        for plugin in &mut config.plugins {
            if plugin.path.is_relative() {
                plugin.path = base.join(&plugin.path);
            }
        }
        Ok(config)
    }

    /// Parses and validates TOML text.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let config: Config = toml::from_str(text)
            .map_err(|e| ConfigError::Parse { path: PathBuf::from("levee.toml"), message: e.to_string() })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and cross-field rules.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let runtime = &self.plugin_runtime;
        if runtime.epoch_tick_us == 0 || runtime.epoch_tick_us > 100_000 {
            return Err(ConfigError::Invalid(format!(
                "plugin-runtime.epoch-tick-us must be between 1 and 100000, got {}",
                runtime.epoch_tick_us
            )));
        }
        if runtime.max_instances == 0 {
            return Err(ConfigError::Invalid("plugin-runtime.max-instances must be at least 1".into()));
        }
        let mut names = std::collections::HashSet::new();
        for (i, plugin) in self.plugins.iter().enumerate() {
            if plugin.name.is_empty() || !plugin.name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
            {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}].name must be non-empty letters, digits, '-' or '_', got {:?}",
                    plugin.name
                )));
            }
            if !names.insert(plugin.name.as_str()) {
                return Err(ConfigError::Invalid(format!("plugins[{i}].name {:?} is used twice", plugin.name)));
            }
            if !(plugin.time_budget_ms > 0.0 && plugin.time_budget_ms <= 10_000.0) {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): time-budget-ms must be > 0 and ≤ 10000, got {}",
                    plugin.name, plugin.time_budget_ms
                )));
            }
            if plugin.memory_mib == 0 || plugin.memory_mib > runtime.max_memory_mib {
                return Err(ConfigError::Invalid(format!(
                    "plugins[{i}] ({}): memory-mib must be between 1 and plugin-runtime.max-memory-mib ({}), got {}",
                    plugin.name, runtime.max_memory_mib, plugin.memory_mib
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_chain_with_defaults() {
        let config = Config::parse(
            r#"
            [[plugins]]
            name = "limits"
            path = "limits.wasm"
            on-fault = "closed"
            config = { rpm = 60 }

            [[plugins]]
            name = "cache"
            path = "cache.wasm"
            mode = "shadow"
            time-budget-ms = 2.5
            "#,
        )
        .unwrap();
        assert_eq!(config.plugins.len(), 2);
        assert_eq!(config.plugins[0].on_fault, OnFault::Closed);
        assert_eq!(config.plugins[0].config["rpm"].as_integer(), Some(60));
        assert_eq!(config.plugins[1].mode, Mode::Shadow);
        assert_eq!(config.plugins[1].time_budget_ms, 2.5);
        assert_eq!(config.plugins[1].memory_mib, 64);
    }

    #[test]
    fn unknown_fields_and_bad_values_name_the_field() {
        let err = Config::parse("[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\nbudget = 3\n").unwrap_err();
        assert!(err.to_string().contains("budget"), "{err}");
        let err = Config::parse("[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\nmemory-mib = 100000\n").unwrap_err();
        assert!(err.to_string().contains("memory-mib"), "{err}");
        let err = Config::parse(
            "[[plugins]]\nname = \"a\"\npath = \"a.wasm\"\n[[plugins]]\nname = \"a\"\npath = \"b.wasm\"\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
    }
}
