// Shared by the version-N guests; `VERSION` is defined by each of them.

use levee_plugin_sdk::{export, Admission, Hook, Load, Policy, Request};

struct Versioned;

impl Policy for Versioned {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Versioned)
    }

    fn admit(&mut self, _request: &Request, _load: &Load) -> Admission {
        Admission::Allow(Some(VERSION))
    }
}

export!(Versioned);
