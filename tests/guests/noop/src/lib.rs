//! Declares every hook and decides nothing: the cost of the call itself.

use levee_plugin_sdk::{Hook, Policy, export};

struct Noop;

impl Policy for Noop {
    const HOOKS: &'static [Hook] =
        &[Hook::Admit, Hook::Lookup, Hook::CoalesceKey, Hook::Shape, Hook::Completed, Hook::Scale];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Noop)
    }
}

export!(Noop);
