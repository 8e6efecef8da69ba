//! Local vector stores: one per namespace, bounded in entries and bytes,
//! least recently used evicted first, nearest-k by cosine similarity.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Limits of each namespace.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Entries per namespace.
    pub max_entries: usize,
    /// Bytes (vectors + payloads) per namespace.
    pub max_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self { max_entries: 100_000, max_bytes: 512 << 20 }
    }
}

/// One search result.
#[derive(Debug, Clone, PartialEq)]
pub struct Hit {
    /// Cosine similarity.
    pub score: f32,
    /// Stored payload.
    pub payload: Vec<u8>,
}

struct Entry {
    vector: Vec<f32>,
    payload: Vec<u8>,
    expires_at: Option<Instant>,
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.vector.len() * 4 + self.payload.len()
    }
}

#[derive(Default)]
struct Namespace {
    entries: Vec<Entry>,
    bytes: usize,
    clock: u64,
}

/// Vector stores by namespace.
pub struct LocalVectors {
    bounds: Bounds,
    namespaces: Mutex<HashMap<String, Namespace>>,
}

fn unit(vector: &[f32]) -> Result<Vec<f32>, String> {
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if vector.is_empty() || !norm.is_finite() || norm == 0.0 {
        return Err("vector must be non-empty, finite and non-zero".to_string());
    }
    Ok(vector.iter().map(|x| x / norm).collect())
}

impl LocalVectors {
    /// Empty stores with `bounds` per namespace.
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds, namespaces: Mutex::new(HashMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Namespace>> {
        self.namespaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Stores `vector` (normalised) with `payload` for `ttl_ms` (0 = no expiry).
    pub fn insert(&self, namespace: &str, vector: &[f32], payload: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        let vector = unit(vector)?;
        let now = Instant::now();
        let entry = Entry {
            vector,
            payload,
            expires_at: (ttl_ms > 0).then(|| now + Duration::from_millis(ttl_ms)),
            last_used: 0,
        };
        if entry.bytes() > self.bounds.max_bytes {
            return Err(format!(
                "entry of {} bytes exceeds the namespace bound of {} bytes",
                entry.bytes(),
                self.bounds.max_bytes
            ));
        }
        let mut namespaces = self.lock();
        let ns = namespaces.entry(namespace.to_string()).or_default();
        if let Some(dims) = ns.entries.first().map(|e| e.vector.len())
            && dims != entry.vector.len()
        {
            return Err(format!(
                "namespace `{namespace}` holds {dims}-dimensional vectors, got {}",
                entry.vector.len()
            ));
        }
        ns.entries.retain(|e| e.expires_at.is_none_or(|at| at > now));
        ns.bytes = ns.entries.iter().map(Entry::bytes).sum();
        while !ns.entries.is_empty()
            && (ns.entries.len() >= self.bounds.max_entries || ns.bytes + entry.bytes() > self.bounds.max_bytes)
        {
            let oldest = ns.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i).unwrap_or(0);
            let evicted = ns.entries.swap_remove(oldest);
            ns.bytes -= evicted.bytes();
        }
        ns.clock += 1;
        ns.bytes += entry.bytes();
        ns.entries.push(Entry { last_used: ns.clock, ..entry });
        Ok(())
    }

    /// The `k` nearest live entries with score ≥ `min_score`, best first.
    pub fn search(&self, namespace: &str, vector: &[f32], k: u32, min_score: f32) -> Result<Vec<Hit>, String> {
        let query = unit(vector)?;
        let now = Instant::now();
        let mut namespaces = self.lock();
        let Some(ns) = namespaces.get_mut(namespace) else { return Ok(Vec::new()) };
        let mut scored: Vec<(f32, usize)> = ns
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.expires_at.is_none_or(|at| at > now) && e.vector.len() == query.len())
            .map(|(i, e)| (e.vector.iter().zip(&query).map(|(a, b)| a * b).sum::<f32>(), i))
            .filter(|(score, _)| *score >= min_score)
            .collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.truncate(k as usize);
        ns.clock += 1;
        let clock = ns.clock;
        Ok(scored
            .into_iter()
            .map(|(score, i)| {
                ns.entries[i].last_used = clock;
                Hit { score, payload: ns.entries[i].payload.clone() }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_first_and_lru_bounded() {
        let store = LocalVectors::new(Bounds { max_entries: 2, max_bytes: 1 << 20 });
        store.insert("ns", &[1.0, 0.0], b"x".to_vec(), 0).unwrap();
        store.insert("ns", &[0.0, 1.0], b"y".to_vec(), 0).unwrap();
        let hits = store.search("ns", &[1.0, 0.1], 1, -1.0).unwrap();
        assert_eq!(hits[0].payload, b"x");
        // "y" is now least recently used and goes first.
        store.insert("ns", &[0.7, 0.7], b"z".to_vec(), 0).unwrap();
        let payloads: Vec<_> =
            store.search("ns", &[0.0, 1.0], 5, -1.0).unwrap().into_iter().map(|h| h.payload).collect();
        assert_eq!(payloads, vec![b"z".to_vec(), b"x".to_vec()]);
        assert!(store.search("ns", &[1.0, 0.0], 5, 0.99).unwrap().len() == 1);
        assert!(store.insert("ns", &[1.0, 0.0, 0.0], vec![], 0).unwrap_err().contains("2-dimensional"));
    }
}
