//! Allocates without bound in `admit`.

use levee_plugin_sdk::{Admission, Hook, Load, Policy, Request, export};

struct Hog {
    hoard: Vec<Vec<u8>>,
}

impl Policy for Hog {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Hog { hoard: Vec::new() })
    }

    fn admit(&mut self, _request: &Request, _load: &Load) -> Admission {
        loop {
            self.hoard.push(std::hint::black_box(vec![1u8; 1 << 20]));
        }
    }
}

export!(Hog);
