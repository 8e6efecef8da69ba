//! Local vector stores: one per namespace, bounded in entries and bytes,
//! least recently used evicted first, nearest-k by cosine similarity.
//!
//! Small namespaces are scanned exactly. Large ones keep one sign bit per
//! dimension beside each vector: a search ranks every entry by the Hamming
//! distance of those bits (48 bytes an entry for 384 dimensions, a few
//! hundred microseconds for 100,000 entries) and re-ranks the best few
//! hundred by their exact cosine. The benchmark reports how often this finds
//! the exact nearest entry.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Limits of each namespace, and of all of them together: plugins name
/// namespaces from request fields, so their number is bounded too, the least
/// recently used namespace going first.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Entries per namespace.
    pub max_entries: usize,
    /// Bytes (vectors, payloads and what each entry costs) per namespace.
    pub max_bytes: usize,
    /// Namespaces one plugin holds at once (unless it has its own bound).
    pub max_namespaces: usize,
    /// Bytes one plugin's namespaces hold together (unless it has its own bound).
    pub max_total_bytes: usize,
}

impl Default for Bounds {
    fn default() -> Self {
        Self { max_entries: 100_000, max_bytes: 512 << 20, max_namespaces: 1024, max_total_bytes: 1 << 30 }
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

/// What one entry costs besides its vector and payload: the entry itself,
/// two heap allocations and its sign-bit code.
const ENTRY_OVERHEAD: usize = 128;

impl Entry {
    fn bytes(&self) -> usize {
        self.vector.len() * 4 + self.payload.len() + ENTRY_OVERHEAD
    }

    fn live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }
}

/// Namespaces up to this size are searched exactly; larger ones through the
/// sign-bit prefilter and an exact re-rank of its best candidates.
pub const EXACT_SEARCH_ENTRIES: usize = 4096;
/// Candidates the prefilter passes to the exact re-rank (at least; more when `k` is larger).
const RERANK_CANDIDATES: usize = 512;
/// Inserts between two sweeps for expired entries (a full namespace sweeps on every insert).
const SWEEP_EVERY: u64 = 1024;

#[derive(Default)]
struct Namespace {
    entries: Vec<Entry>,
    /// Sign bits of each entry's vector, `words` u64s per entry, parallel to `entries`.
    codes: Vec<u64>,
    words: usize,
    bytes: usize,
    clock: u64,
    inserts: u64,
    /// Last insert or search, for evicting whole namespaces.
    touched: Option<Instant>,
}

impl Namespace {
    fn remove(&mut self, i: usize) {
        let evicted = self.entries.swap_remove(i);
        self.bytes -= evicted.bytes();
        let (w, last) = (self.words, self.entries.len());
        if i != last {
            self.codes.copy_within(last * w..(last + 1) * w, i * w);
        }
        self.codes.truncate(last * w);
    }

    fn sweep(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.entries.len() {
            if self.entries[i].live(now) { i += 1 } else { self.remove(i) }
        }
    }

    /// Indices of the entries whose sign bits are nearest the query's.
    fn prefilter(&self, query: &[u64], candidates: usize) -> Vec<usize> {
        let w = self.words;
        let mut distances: Vec<(u32, u32)> = self
            .codes
            .chunks_exact(w)
            .enumerate()
            .map(|(i, code)| (code.iter().zip(query).map(|(a, b)| (a ^ b).count_ones()).sum::<u32>(), i as u32))
            .collect();
        if distances.len() > candidates {
            distances.select_nth_unstable(candidates);
            distances.truncate(candidates);
        }
        distances.into_iter().map(|(_, i)| i as usize).collect()
    }
}

/// One bit per dimension: set where the component is positive.
fn sign_bits(vector: &[f32]) -> Vec<u64> {
    let mut bits = vec![0u64; vector.len().div_ceil(64)];
    for (d, x) in vector.iter().enumerate() {
        if *x > 0.0 {
            bits[d / 64] |= 1 << (d % 64);
        }
    }
    bits
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent sums, so the compiler can keep them in vector lanes.
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Vector stores by namespace. A namespace `plugin:name` belongs to its
/// plugin: each plugin's namespaces sit behind a lock of their own, the
/// count and byte bounds hold per plugin, and making room evicts only that
/// plugin's namespaces. One plugin's inserts and searches never wait on
/// another's.
pub struct LocalVectors {
    bounds: Bounds,
    owners: Mutex<HashMap<String, Arc<Owner>>>,
}

/// One plugin's namespaces and what it may hold.
struct Owner {
    /// `(namespaces, bytes)` it may hold.
    bounds: Mutex<(usize, usize)>,
    namespaces: Mutex<HashMap<String, Namespace>>,
}

impl Owner {
    fn bounds(&self) -> (usize, usize) {
        *self.bounds.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Namespace>> {
        self.namespaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The plugin a namespace belongs to (its name up to the first `:`).
pub fn owner(namespace: &str) -> &str {
    namespace.split_once(':').map_or(namespace, |(owner, _)| owner)
}

/// Most dimensions a vector may have (embedding models have at most a few thousand).
pub const MAX_DIMENSIONS: usize = 8192;

/// Most results one search returns.
pub const MAX_RESULTS: u32 = 256;

fn unit(vector: &[f32]) -> Result<Vec<f32>, String> {
    if vector.len() > MAX_DIMENSIONS {
        return Err(format!("vectors may have at most {MAX_DIMENSIONS} dimensions, got {}", vector.len()));
    }
    let norm = vector.iter().map(|x| x * x).sum::<f32>().sqrt();
    if vector.is_empty() || !norm.is_finite() || norm == 0.0 {
        return Err("vector must be non-empty, finite and non-zero".to_string());
    }
    Ok(vector.iter().map(|x| x / norm).collect())
}

impl LocalVectors {
    /// Empty stores with `bounds` per namespace.
    pub fn new(bounds: Bounds) -> Self {
        Self { bounds, owners: Mutex::new(HashMap::new()) }
    }

    /// The namespaces of `plugin`, made on first use with the default bounds.
    fn owner(&self, plugin: &str) -> Arc<Owner> {
        let mut owners = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        owners
            .entry(plugin.to_string())
            .or_insert_with(|| {
                Arc::new(Owner {
                    bounds: Mutex::new((self.bounds.max_namespaces, self.bounds.max_total_bytes)),
                    namespaces: Mutex::default(),
                })
            })
            .clone()
    }

    /// Gives `plugin` its own bounds: namespaces held at once and their bytes together.
    pub fn set_owner_bounds(&self, plugin: &str, namespaces: usize, bytes: usize) {
        *self.owner(plugin).bounds.lock().unwrap_or_else(|p| p.into_inner()) = (namespaces, bytes);
    }

    /// Evicts whole namespaces of the plugin other than `namespace`, least
    /// recently used first, until a new namespace fits the plugin's count
    /// and `incoming` bytes fit its total.
    fn make_room(
        namespaces: &mut HashMap<String, Namespace>,
        bounds: (usize, usize),
        namespace: &str,
        incoming: usize,
    ) {
        let (max_namespaces, max_bytes) = bounds;
        let is_new = !namespaces.contains_key(namespace);
        loop {
            let total: usize = namespaces.values().map(|n| n.bytes).sum();
            let over_count = is_new && namespaces.len() >= max_namespaces;
            if !over_count && total + incoming <= max_bytes {
                return;
            }
            let victim = namespaces
                .iter()
                .filter(|(name, _)| *name != namespace)
                .min_by_key(|(_, n)| n.touched)
                .map(|(k, _)| k.clone());
            match victim {
                Some(name) => {
                    namespaces.remove(&name);
                }
                None => return,
            }
        }
    }

    /// Whether [`LocalVectors::insert`] would take `vector` with a payload
    /// of `payload_bytes` into `namespace` (its values, its size against
    /// the plugin's bounds, its dimensions against the namespace's).
    pub fn check(&self, namespace: &str, vector: &[f32], payload_bytes: usize) -> Result<(), String> {
        unit(vector)?;
        let plugin = self.owner(owner(namespace));
        let max_bytes = self.bounds.max_bytes.min(plugin.bounds().1);
        let bytes = vector.len() * 4 + payload_bytes + ENTRY_OVERHEAD;
        if bytes > max_bytes {
            return Err(format!("entry of {bytes} bytes exceeds the namespace bound of {max_bytes} bytes"));
        }
        if let Some(dims) = plugin.lock().get(namespace).and_then(|ns| ns.entries.first()).map(|e| e.vector.len())
            && dims != vector.len()
        {
            return Err(format!("namespace `{namespace}` holds {dims}-dimensional vectors, got {}", vector.len()));
        }
        Ok(())
    }

    /// Stores `vector` (normalised) with `payload` for `ttl_ms` (0 = no expiry).
    pub fn insert(&self, namespace: &str, vector: &[f32], payload: Vec<u8>, ttl_ms: u64) -> Result<(), String> {
        let vector = unit(vector)?;
        let now = Instant::now();
        let code = sign_bits(&vector);
        let entry = Entry {
            vector,
            payload,
            expires_at: (ttl_ms > 0).then(|| now + Duration::from_millis(ttl_ms)),
            last_used: 0,
        };
        // A namespace holds at most what its plugin may hold in all.
        let plugin = self.owner(owner(namespace));
        let bounds = plugin.bounds();
        let max_bytes = self.bounds.max_bytes.min(bounds.1);
        if entry.bytes() > max_bytes {
            return Err(format!("entry of {} bytes exceeds the namespace bound of {max_bytes} bytes", entry.bytes()));
        }
        let mut namespaces = plugin.lock();
        Self::make_room(&mut namespaces, bounds, namespace, entry.bytes());
        let ns = namespaces.entry(namespace.to_string()).or_default();
        ns.touched = Some(now);
        if let Some(dims) = ns.entries.first().map(|e| e.vector.len())
            && dims != entry.vector.len()
        {
            return Err(format!(
                "namespace `{namespace}` holds {dims}-dimensional vectors, got {}",
                entry.vector.len()
            ));
        }
        ns.words = code.len();
        ns.inserts += 1;
        let full = ns.entries.len() >= self.bounds.max_entries || ns.bytes + entry.bytes() > max_bytes;
        if full || ns.inserts.is_multiple_of(SWEEP_EVERY) {
            ns.sweep(now);
        }
        while !ns.entries.is_empty()
            && (ns.entries.len() >= self.bounds.max_entries || ns.bytes + entry.bytes() > max_bytes)
        {
            let oldest = ns.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i).unwrap_or(0);
            ns.remove(oldest);
        }
        ns.clock += 1;
        ns.bytes += entry.bytes();
        ns.entries.push(Entry { last_used: ns.clock, ..entry });
        ns.codes.extend_from_slice(&code);
        Ok(())
    }

    /// The `k` nearest live entries with score ≥ `min_score`, best first.
    /// Exact up to [`EXACT_SEARCH_ENTRIES`] entries; above, the entries
    /// whose sign bits are nearest the query's are re-ranked exactly.
    pub fn search(&self, namespace: &str, vector: &[f32], k: u32, min_score: f32) -> Result<Vec<Hit>, String> {
        if k > MAX_RESULTS {
            return Err(format!("a search returns at most {MAX_RESULTS} results, asked for {k}"));
        }
        let query = unit(vector)?;
        let now = Instant::now();
        let plugin = self.owner(owner(namespace));
        let mut namespaces = plugin.lock();
        let Some(ns) = namespaces.get_mut(namespace) else { return Ok(Vec::new()) };
        ns.touched = Some(now);
        if ns.entries.first().is_some_and(|e| e.vector.len() != query.len()) {
            return Ok(Vec::new());
        }
        let candidates: Vec<usize> = if ns.entries.len() <= EXACT_SEARCH_ENTRIES {
            (0..ns.entries.len()).collect()
        } else {
            ns.prefilter(&sign_bits(&query), RERANK_CANDIDATES.max(k as usize * 8))
        };
        let mut scored: Vec<(f32, usize)> = candidates
            .into_iter()
            .filter(|&i| ns.entries[i].live(now))
            .map(|i| (dot(&ns.entries[i].vector, &query), i))
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

    /// Entries held in `namespace` (live or not yet swept).
    pub fn len(&self, namespace: &str) -> usize {
        self.owner(owner(namespace)).lock().get(namespace).map_or(0, |ns| ns.entries.len())
    }

    /// The exact `k` nearest, for measuring the prefilter's recall.
    pub fn search_exact(&self, namespace: &str, vector: &[f32], k: u32) -> Result<Vec<Hit>, String> {
        let query = unit(vector)?;
        let plugin = self.owner(owner(namespace));
        let namespaces = plugin.lock();
        let Some(ns) = namespaces.get(namespace) else { return Ok(Vec::new()) };
        let mut scored: Vec<(f32, usize)> =
            ns.entries.iter().enumerate().map(|(i, e)| (dot(&e.vector, &query), i)).collect();
        scored.sort_by(|a, b| b.0.total_cmp(&a.0));
        scored.truncate(k as usize);
        Ok(scored.into_iter().map(|(score, i)| Hit { score, payload: ns.entries[i].payload.clone() }).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_bounded_in_number_and_bytes_per_plugin_least_recently_used_first() {
        let store = LocalVectors::new(Bounds { max_namespaces: 2, ..Bounds::default() });
        store.insert("p:a", &[1.0, 0.0], b"a".to_vec(), 0).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        store.insert("p:b", &[1.0, 0.0], b"b".to_vec(), 0).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        assert_eq!(store.search("p:a", &[1.0, 0.0], 1, 0.0).unwrap().len(), 1, "a search touches `a`");
        // Another plugin's namespaces count against its own bound only.
        for i in 0..10 {
            store.insert(&format!("q:{i}"), &[1.0, 0.0], b"q".to_vec(), 0).unwrap();
        }
        assert_eq!((store.len("p:a"), store.len("p:b")), (1, 1), "q's flood evicted nothing of p's");
        store.insert("p:c", &[1.0, 0.0], b"c".to_vec(), 0).unwrap();
        assert_eq!(store.len("p:b"), 0, "`b` was the least recently used");
        assert_eq!((store.len("p:a"), store.len("p:c")), (1, 1));

        // Two 2-dimensional entries with 1-byte payloads (137 bytes each with
        // their overhead) fit; a third evicts the plugin's oldest namespace.
        let store = LocalVectors::new(Bounds::default());
        store.set_owner_bounds("p", 1024, 280);
        store.insert("p:x", &[1.0, 0.0], b"x".to_vec(), 0).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        store.insert("p:y", &[1.0, 0.0], b"y".to_vec(), 0).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        store.insert("p:z", &[1.0, 0.0], b"z".to_vec(), 0).unwrap();
        assert_eq!((store.len("p:x"), store.len("p:y"), store.len("p:z")), (0, 1, 1));

        // One namespace alone is held to its plugin's bound too.
        let store = LocalVectors::new(Bounds::default());
        store.set_owner_bounds("p", 1024, 280);
        for i in 0..10 {
            store.insert("p:only", &[1.0, 0.0], vec![b'x'], 0).unwrap_or_else(|e| panic!("insert {i}: {e}"));
        }
        assert_eq!(store.len("p:only"), 2);
        assert!(store.search("p:only", &[1.0, 0.0], MAX_RESULTS + 1, 0.0).unwrap_err().contains("at most"));
        assert!(
            store.insert("p:wide", &vec![1.0; MAX_DIMENSIONS + 1], Vec::new(), 0).unwrap_err().contains("dimensions")
        );
        assert!(store.insert("p:only", &[1.0, 0.0], vec![0; 1000], 0).unwrap_err().contains("280 bytes"));
    }

    #[test]
    fn nearest_first_and_lru_bounded() {
        let store = LocalVectors::new(Bounds { max_entries: 2, max_bytes: 1 << 20, ..Bounds::default() });
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

    #[test]
    fn large_namespaces_find_the_exact_nearest_through_the_prefilter() {
        let store = LocalVectors::new(Bounds { max_entries: 20_000, max_bytes: 1 << 30, ..Bounds::default() });
        let mut state = 7u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let vectors: Vec<Vec<f32>> = (0..10_000).map(|_| (0..64).map(|_| next()).collect()).collect();
        for (i, v) in vectors.iter().enumerate() {
            store.insert("big", v, i.to_string().into_bytes(), 0).unwrap();
        }
        assert!(store.len("big") > EXACT_SEARCH_ENTRIES);
        // A slightly perturbed copy of a stored vector finds that vector.
        for target in [3usize, 777, 9_999] {
            let query: Vec<f32> = vectors[target].iter().map(|x| x + 0.02 * next()).collect();
            let hits = store.search("big", &query, 1, 0.5).unwrap();
            assert_eq!(hits[0].payload, target.to_string().into_bytes());
            assert_eq!(hits, store.search_exact("big", &query, 1).unwrap());
        }
    }

    #[test]
    fn expired_entries_are_neither_found_nor_kept() {
        let store = LocalVectors::new(Bounds { max_entries: 2, max_bytes: 1 << 20, ..Bounds::default() });
        store.insert("ns", &[1.0, 0.0], b"old".to_vec(), 1).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(store.search("ns", &[1.0, 0.0], 1, 0.0).unwrap().is_empty());
        store.insert("ns", &[0.0, 1.0], b"a".to_vec(), 0).unwrap();
        store.insert("ns", &[0.6, 0.8], b"b".to_vec(), 0).unwrap();
        assert_eq!(store.len("ns"), 2, "the expired entry made room");
        assert_eq!(store.search("ns", &[0.0, 1.0], 1, 0.0).unwrap()[0].payload, b"a");
    }
}
