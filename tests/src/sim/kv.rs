//! The KV cache: a fixed pool of blocks of [`BLOCK_TOKENS`] tokens, and a prefix cache that
//! finds the blocks of a prompt's leading tokens that an earlier request already computed.
//!
//! Modelled on vLLM's paged KV cache with automatic prefix caching:
//! - A full block of prompt tokens is identified by a hash chain: each block's hash covers
//!   its own tokens and, through its parent's hash, every token before it. Two prompts share
//!   a cached block only if they agree on everything up to its end.
//! - A block is referenced by every running sequence that uses it. Unreferenced blocks are
//!   free; those that hold a computed prefix stay findable in the prefix cache until a new
//!   allocation needs them, oldest-freed first (LRU). Usage counts referenced blocks only, so
//!   an idle server shows about 0 % while still holding warm prefixes.

use std::collections::{BTreeMap, HashMap};

use super::text::fnv1a_extend;

/// Tokens per KV block, as vLLM's default `--block-size` on GPUs.
pub const BLOCK_TOKENS: usize = 16;

pub type BlockId = u32;

/// The hash chain of the full blocks of `tokens` (a trailing partial block has none: it is
/// never shared).
pub fn block_hashes(tokens: &[u64]) -> Vec<u64> {
    let mut parent = 0u64;
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            let mut hash = fnv1a_extend(0xcbf2_9ce4_8422_2325, &parent.to_le_bytes());
            for token in block {
                hash = fnv1a_extend(hash, &token.to_le_bytes());
            }
            parent = hash;
            hash
        })
        .collect()
}

/// Blocks needed to hold `tokens` tokens.
pub fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(BLOCK_TOKENS)
}

#[derive(Debug, Default)]
struct Block {
    refs: u32,
    /// The prefix this block holds, while it is in the prefix cache.
    hash: Option<u64>,
    /// Position in the free queue, while unreferenced.
    freed_at: Option<u64>,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    /// Unreferenced blocks by the time they were freed: allocation takes the oldest, so the
    /// prefix cache evicts least recently used blocks first.
    free: BTreeMap<u64, BlockId>,
    clock: u64,
    cached: HashMap<u64, BlockId>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: (0..num_blocks).map(|_| Block::default()).collect(),
            free: BTreeMap::new(),
            clock: 0,
            cached: HashMap::new(),
        };
        for id in 0..num_blocks {
            pool.push_free(BlockId::try_from(id).expect("block count fits u32"));
        }
        pool
    }

    pub fn total(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks not referenced by any sequence, cached prefixes included.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// Referenced blocks as a fraction of all blocks, 0 to 1.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        self.used() as f64 / self.total() as f64
    }

    /// Blocks that hold a computed prefix (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// How many leading entries of `hashes` are in the prefix cache.
    pub fn cached_prefix(&self, hashes: &[u64]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// References the cached blocks of `hashes[..hits]` and `fresh` new blocks, in that order;
    /// `None`, and nothing taken, when the free blocks do not suffice. `hits` must not exceed
    /// [`BlockPool::cached_prefix`].
    pub fn allocate(&mut self, hashes: &[u64], hits: usize, fresh: usize) -> Option<Vec<BlockId>> {
        let hit_ids: Vec<BlockId> = hashes[..hits].iter().map(|h| self.cached[h]).collect();
        // Taking an unreferenced cached block uses up a free block as well.
        let hits_free = hit_ids
            .iter()
            .filter(|&&id| self.blocks[id as usize].refs == 0)
            .count();
        if fresh + hits_free > self.free() {
            return None;
        }
        for &id in &hit_ids {
            self.take_ref(id);
        }
        let mut ids = hit_ids;
        for _ in 0..fresh {
            ids.push(self.allocate_one().expect("counted above"));
        }
        Some(ids)
    }

    /// One new, empty block; evicts the least recently freed cached prefix if it must.
    pub fn allocate_one(&mut self) -> Option<BlockId> {
        let (_, id) = self.free.pop_first()?;
        let block = &mut self.blocks[id as usize];
        block.freed_at = None;
        block.refs = 1;
        if let Some(hash) = block.hash.take() {
            self.cached.remove(&hash);
        }
        Some(id)
    }

    /// Puts a computed full block in the prefix cache under `hash`. If another block already
    /// holds that prefix (two requests computed it at once), this one stays a private copy.
    pub fn publish(&mut self, id: BlockId, hash: u64) {
        if self.blocks[id as usize].hash.is_none() && !self.cached.contains_key(&hash) {
            self.cached.insert(hash, id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    /// Drops one reference to each of `ids`. A sequence's blocks are freed last to first, so
    /// that its tail is evicted before the prefix that other prompts are likelier to share.
    pub fn release(&mut self, ids: &[BlockId]) {
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id as usize];
            block.refs = block
                .refs
                .checked_sub(1)
                .expect("released a block that is not referenced");
            if block.refs == 0 {
                self.push_free(id);
            }
        }
    }

    fn take_ref(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if let Some(at) = block.freed_at.take() {
            self.free.remove(&at);
        }
        block.refs += 1;
    }

    fn push_free(&mut self, id: BlockId) {
        self.clock += 1;
        self.blocks[id as usize].freed_at = Some(self.clock);
        self.free.insert(self.clock, id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(range: std::ops::Range<u64>) -> Vec<u64> {
        range.collect()
    }

    #[test]
    fn hashes_cover_everything_before() {
        let a = block_hashes(&tokens(0..40));
        assert_eq!(a.len(), 2, "the partial third block has no hash");
        let mut other_start = tokens(0..40);
        other_start[0] = 999;
        let b = block_hashes(&other_start);
        // The second block's own tokens are equal, but what comes before is not.
        assert_ne!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        assert_eq!(block_hashes(&tokens(0..32)), a);
    }

    #[test]
    fn prefixes_are_found_shared_and_evicted_least_recently_freed_first() {
        let mut pool = BlockPool::new(4);
        let a = block_hashes(&tokens(0..32));
        let b = block_hashes(&tokens(100..132));

        let blocks_a = pool.allocate(&a, 0, 2).unwrap();
        pool.publish(blocks_a[0], a[0]);
        pool.publish(blocks_a[1], a[1]);
        assert_eq!(pool.used(), 2);
        // A second user of the same prefix shares the blocks.
        assert_eq!(pool.cached_prefix(&a), 2);
        let shared = pool.allocate(&a, 2, 0).unwrap();
        assert_eq!(shared, blocks_a);
        assert_eq!(pool.used(), 2);
        pool.release(&shared);
        pool.release(&blocks_a);
        assert_eq!((pool.used(), pool.usage()), (0, 0.0));
        assert_eq!(
            pool.cached_prefix(&a),
            2,
            "unreferenced prefixes stay cached"
        );

        let blocks_b = pool.allocate(&b, 0, 2).unwrap();
        pool.publish(blocks_b[0], b[0]);
        pool.publish(blocks_b[1], b[1]);
        pool.release(&blocks_b);
        assert_eq!(pool.cached_blocks(), 4);
        // Touch a again so that b is now the least recently used.
        let again = pool.allocate(&a, 2, 0).unwrap();
        pool.release(&again);
        pool.allocate(&[], 0, 2).unwrap();
        assert_eq!(pool.cached_prefix(&a), 2, "recently used prefix kept");
        assert_eq!(
            pool.cached_prefix(&b),
            0,
            "least recently used prefix evicted"
        );
    }

    #[test]
    fn allocation_is_all_or_nothing_and_counts_cached_free_blocks() {
        let mut pool = BlockPool::new(3);
        let a = block_hashes(&tokens(0..32));
        let blocks = pool.allocate(&a, 0, 2).unwrap();
        pool.publish(blocks[0], a[0]);
        pool.publish(blocks[1], a[1]);
        pool.release(&blocks);
        // Three free blocks, two of them the cached prefix: reusing the prefix leaves one.
        assert_eq!(pool.allocate(&a, 2, 2), None);
        assert_eq!(pool.free(), 3, "a failed allocation takes nothing");
        assert!(pool.allocate(&a, 2, 1).is_some());
        assert_eq!(pool.free(), 0);
        assert_eq!(pool.allocate_one(), None);
    }
}
