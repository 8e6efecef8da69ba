//! Loops forever in `admit`.

use levee_plugin_sdk::{Admission, Hook, Load, Policy, Request, export};

struct Spin;

impl Policy for Spin {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Spin)
    }

    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        let mut n = request.prompt_tokens as u64;
        loop {
            n = std::hint::black_box(n.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

export!(Spin);
