//! Memory arithmetic of the CUDA backend, kept apart from any device call so
//! that it is tested everywhere: how much KV cache a fraction of free device
//! memory buys, and how many bytes a decode step must read (the
//! memory-bandwidth bound the benchmark compares against).

/// Device memory left aside, beyond weights and workspace, for what is
/// allocated later and is not ours to size (cuBLAS's workspace, the driver's
/// own growth).
pub const HEADROOM_BYTES: usize = 256 << 20;

/// KV cache bytes when the cache takes `fraction` of the `free` device
/// memory left once weights and workspace are allocated (less
/// [`HEADROOM_BYTES`]).
pub fn kv_bytes_from_free(free: usize, fraction: f32) -> Result<usize, String> {
    if !(fraction > 0.0 && fraction <= 1.0) {
        return Err(format!("kv_device_fraction must be in (0, 1], got {fraction}"));
    }
    Ok((free.saturating_sub(HEADROOM_BYTES) as f64 * f64::from(fraction)) as usize)
}

/// Bytes one decode step reads from device memory at the least: every
/// weight once (whatever the batch), plus, for each sequence, the keys and
/// values of all its positions (`contexts[i]` positions for sequence `i`,
/// the new one included).
pub fn decode_bytes_per_step(weight_bytes: usize, kv_token_bytes: usize, contexts: &[usize]) -> usize {
    weight_bytes + contexts.iter().map(|c| c * kv_token_bytes).sum::<usize>()
}

/// Decode tokens/s that a device reading `bandwidth` bytes/s could reach if
/// a step of `batch` sequences were bound by reading `bytes_per_step` only.
pub fn bound_tokens_per_s(bandwidth: f64, bytes_per_step: usize, batch: usize) -> f64 {
    if bytes_per_step == 0 {
        return 0.0;
    }
    bandwidth / bytes_per_step as f64 * batch as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_takes_the_fraction_of_what_is_free_after_the_headroom() {
        let gib = 1usize << 30;
        assert_eq!(kv_bytes_from_free(10 * gib + HEADROOM_BYTES, 0.5), Ok(5 * gib));
        assert_eq!(kv_bytes_from_free(HEADROOM_BYTES / 2, 0.9), Ok(0), "nothing free is no cache, not an underflow");
        assert!(kv_bytes_from_free(gib, 0.0).is_err());
        assert!(kv_bytes_from_free(gib, 1.5).unwrap_err().contains("1.5"));
        assert!(kv_bytes_from_free(gib, f32::NAN).is_err());
    }

    #[test]
    fn the_bound_counts_weights_once_and_each_sequences_cache() {
        // 100 MB of weights, 10 kB of KV per position, two sequences of 100 and 300 positions.
        let bytes = decode_bytes_per_step(100_000_000, 10_000, &[100, 300]);
        assert_eq!(bytes, 104_000_000);
        // 4 TB/s over 104 MB is ~38.5k steps/s, two tokens a step.
        let bound = bound_tokens_per_s(4e12, bytes, 2);
        assert!((bound - 76_923.0).abs() < 1.0, "{bound}");
        assert_eq!(bound_tokens_per_s(4e12, 0, 2), 0.0);
    }
}
