//! Refuses every configuration in `init`.

use levee_plugin_sdk::{Hook, Policy, export};

struct InitFail;

impl Policy for InitFail {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Err("this plugin refuses every configuration".to_string())
    }
}

export!(InitFail);
