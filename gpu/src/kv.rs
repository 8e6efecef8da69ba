//! Paged KV cache bookkeeping: fixed-size blocks, a free list, and a block
//! table per sequence. The memory itself belongs to the backend; this module
//! decides which block holds which positions.

use crate::model::ModelConfig;

/// How much memory the KV cache may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvBudget {
    /// A number of bytes (rounded down to whole blocks).
    Bytes(usize),
    /// A number of blocks.
    Blocks(usize),
}

/// Geometry of the paged cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    /// Token positions per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Bytes one block takes over all layers, keys and values.
    pub block_bytes: usize,
}

/// Bytes one stored element takes on the CPU backend (keys and values are kept as `f32`).
pub const KV_ELEM_BYTES: usize = 4;

impl KvLayout {
    /// The layout `budget` allows for `config` with `f32` elements (the CPU
    /// backend's), or `None` if it holds no block.
    pub fn new(config: &ModelConfig, block_size: usize, budget: KvBudget) -> Option<KvLayout> {
        KvLayout::with_elem_bytes(config, block_size, budget, KV_ELEM_BYTES)
    }

    /// The layout `budget` allows for `config` when one stored key or value
    /// element takes `elem_bytes` (2 on the CUDA backend), or `None` if it
    /// holds no block.
    pub fn with_elem_bytes(
        config: &ModelConfig,
        block_size: usize,
        budget: KvBudget,
        elem_bytes: usize,
    ) -> Option<KvLayout> {
        let block_bytes = config.n_layers * 2 * config.kv_width() * block_size.max(1) * elem_bytes;
        let num_blocks = match budget {
            KvBudget::Bytes(b) => b / block_bytes.max(1),
            KvBudget::Blocks(n) => n,
        };
        (num_blocks > 0 && block_size > 0).then_some(KvLayout { block_size, num_blocks, block_bytes })
    }

    /// Bytes one token position takes.
    pub fn token_bytes(&self) -> usize {
        self.block_bytes / self.block_size
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// The free list of blocks.
#[derive(Debug)]
pub struct BlockPool {
    free: Vec<u32>,
    total: usize,
}

impl BlockPool {
    /// A pool of `total` free blocks.
    pub fn new(total: usize) -> BlockPool {
        // Reversed so that blocks are handed out in ascending order.
        BlockPool { free: (0..total as u32).rev().collect(), total }
    }

    /// Free blocks.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks in use.
    pub fn used(&self) -> usize {
        self.total - self.free.len()
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }
}

/// The blocks of one sequence, in position order.
#[derive(Debug, Default, Clone)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// Block ids, in position order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Grows the table to hold `tokens` positions. All or nothing: returns
    /// `false` and takes no block when the pool is short.
    pub fn reserve(&mut self, layout: &KvLayout, pool: &mut BlockPool, tokens: usize) -> bool {
        let needed = layout.blocks_for(tokens).saturating_sub(self.blocks.len());
        if needed > pool.free.len() {
            return false;
        }
        let at = pool.free.len() - needed;
        self.blocks.extend(pool.free.drain(at..).rev());
        true
    }

    /// Blocks `tokens` more positions would need beyond those held.
    pub fn shortfall(&self, layout: &KvLayout, tokens: usize) -> usize {
        layout.blocks_for(tokens).saturating_sub(self.blocks.len())
    }

    /// Returns every block to the pool.
    pub fn release(&mut self, pool: &mut BlockPool) {
        pool.free.extend(self.blocks.drain(..).rev());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { block_size: 4, num_blocks: 5, block_bytes: 64 }
    }

    #[test]
    fn tables_take_whole_blocks_and_give_them_back() {
        let l = layout();
        let mut pool = BlockPool::new(l.num_blocks);
        let (mut a, mut b) = (BlockTable::default(), BlockTable::default());
        assert!(a.reserve(&l, &mut pool, 9));
        assert_eq!(a.blocks().len(), 3);
        assert!(!b.reserve(&l, &mut pool, 9), "only two blocks are left");
        assert_eq!(pool.free(), 2, "a failed reserve takes nothing");
        assert!(b.reserve(&l, &mut pool, 8));
        assert_eq!(pool.used(), 5);
        a.release(&mut pool);
        assert_eq!(pool.free(), 3);
        assert!(b.reserve(&l, &mut pool, 12));
        assert_eq!(b.shortfall(&l, 13), 1);
    }
}
