//! Rejects with status 200: a decision that breaks the contract.

use levee_plugin_sdk::{Admission, Hook, Load, Policy, Rejection, Request, export};

struct Malformed;

impl Policy for Malformed {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Malformed)
    }

    fn admit(&mut self, _request: &Request, _load: &Load) -> Admission {
        Admission::Reject(Rejection { status: 200, retry_after_secs: None, message: "not a refusal".into() })
    }
}

export!(Malformed);
