//! Panics (a trap) in `admit`.

use levee_plugin_sdk::{Admission, Hook, Load, Policy, Request, export};

struct Trap;

impl Policy for Trap {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Trap)
    }

    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        panic!("deliberate panic for request {}", request.id)
    }
}

export!(Trap);
