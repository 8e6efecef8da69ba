//! API keys → tenants. With no keys configured every request is the
//! `anonymous` tenant; with keys, `Authorization: Bearer <key>` is required.

use crate::api::error::ApiError;
use crate::config::ApiKey;
use axum::http::HeaderMap;
use std::collections::HashMap;

/// Who a request comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Tenant name.
    pub name: String,
    /// Its tier, if configured.
    pub tier: Option<String>,
}

/// The configured keys.
pub struct Tenancy {
    keys: HashMap<String, Tenant>,
}

impl Tenancy {
    /// From the configuration's `api-keys`.
    pub fn new(keys: &[ApiKey]) -> Self {
        Self {
            keys: keys
                .iter()
                .map(|k| (k.key.clone(), Tenant { name: k.tenant.clone(), tier: k.tier.clone() }))
                .collect(),
        }
    }

    /// The tenant behind a request's `Authorization` header.
    pub fn resolve(&self, headers: &HeaderMap) -> Result<Tenant, ApiError> {
        if self.keys.is_empty() {
            return Ok(Tenant { name: "anonymous".to_string(), tier: None });
        }
        let key = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(|| {
                ApiError::Unauthorized("an API key is required: send `Authorization: Bearer <key>`".into())
            })?;
        self.keys.get(key).cloned().ok_or_else(|| ApiError::Unauthorized("the API key is not valid".into()))
    }
}
