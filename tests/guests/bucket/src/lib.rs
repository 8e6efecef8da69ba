//! A realistic admission decision computed in the guest: per-tenant token
//! buckets kept in the instance's own memory.

mod logic;

use levee_plugin_sdk::{Admission, Hook, Load, Policy, Rejection, Request, export, host};

struct Bucket {
    buckets: logic::Buckets,
}

impl Policy for Bucket {
    const HOOKS: &'static [Hook] = &[Hook::Admit];

    fn init(_config: &str) -> Result<Self, String> {
        Ok(Bucket { buckets: logic::Buckets::new(1e12, 1e9) })
    }

    fn admit(&mut self, request: &Request, _load: &Load) -> Admission {
        match self.buckets.take(&request.tenant, 1.0, host::now_ms()) {
            Ok(_) => Admission::Allow(None),
            Err(retry) => Admission::Reject(Rejection {
                status: 429,
                retry_after_secs: Some(retry),
                message: format!("tenant {} is over its rate", request.tenant),
            }),
        }
    }
}

export!(Bucket);
