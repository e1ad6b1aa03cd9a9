//! The KV cache: per layer, one preallocated pool of positions in blocks of [`BLOCK`]
//! ([`KvPool`]), and per sequence a [`KvCache`], the table of blocks that holds its
//! positions in order, owned by the caller and passed into `forward`.
//!
//! A cache of its own (`generate`, `chat`, `eval`, `bench`: [`KvCache::new`]) is a pool of
//! exactly its capacity whose blocks are all its own, in order: its positions are one run,
//! read as views, as a flat cache would be. The server's sequences share one pool sized by
//! memory (`serve --kv-memory`, vLLM's paged attention): a sequence takes a block when it
//! needs one, gives its blocks back when it ends, and shares the full blocks of a prefix
//! another sequence cached ([`blocks`]). Reading a paged sequence's positions, the fused
//! decode op follows the table ([`Pages`]); everything else gathers them first.
//!
//! Every entry is allocated once and written in place (on the CPU in one pass a tensor,
//! `put.rs`; elsewhere with `slice_set`): no `Tensor::cat` per step. (candle-nn's
//! `kv_cache::Cache` allocates on first use and grows by concatenation past its capacity; we
//! want a hard capacity and an error.)

mod blocks;
mod dtype;
mod pages;
mod pool;
mod put;
#[cfg(test)]
mod tests;

pub use blocks::Usage;
pub use dtype::{choose_dtype, dtype_for, parse_dtype};
pub use pages::{Held, LayerView, Pages};
pub use pool::{KvPool, LayerCache};

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use candle_core::{DType, Device};
use pool::{build, Pool};
use std::sync::Arc;

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Positions per block: small enough that a sequence wastes at most 31 positions, large
/// enough that a block's rows are long runs for the decode op (vLLM uses 16).
pub const BLOCK: usize = 32;

/// One sequence's cache: the blocks that hold its positions, in order, the tokens it holds,
/// and how many positions are filled.
///
/// Not `Clone`: candle tensors are reference-counted and the cache writes them in place, so a
/// derived clone would share every buffer, and writing to one would corrupt the other.
#[derive(Debug)]
pub struct KvCache {
    pool: Arc<Pool>,
    /// Block ids; block i holds positions i·BLOCK..(i + 1)·BLOCK. Blocks past `len` are
    /// kept for the next positions.
    table: Vec<u32>,
    /// The token at each filled position.
    ids: Vec<u32>,
    capacity: usize,
    /// Leading blocks of `table` that are indexed (or were found in the index).
    indexed: usize,
}

impl KvCache {
    /// A cache of its own for `capacity` positions (at most the model's context length),
    /// every position allocated now.
    pub fn new(cfg: &ModelConfig, capacity: usize, dtype: DType, dev: &Device) -> Result<Self> {
        Self::private(cfg, capacity, dtype, dev, false)
    }

    /// For MLA models, a cache of the up-projected per-head K and V instead of the latent,
    /// the memory MHA with the same heads would need. For comparisons only (`bench
    /// --mla-cache expanded`); other models get their usual cache.
    pub fn expanded(
        cfg: &ModelConfig,
        capacity: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        Self::private(cfg, capacity, dtype, dev, true)
    }

    fn private(
        cfg: &ModelConfig,
        capacity: usize,
        dtype: DType,
        dev: &Device,
        expanded: bool,
    ) -> Result<Self> {
        if capacity == 0 || capacity > cfg.max_position_embeddings {
            return Err(Error::Invalid(format!(
                "cache capacity {capacity} must be between 1 and the context length ({})",
                cfg.max_position_embeddings
            )));
        }
        let blocks = capacity.div_ceil(BLOCK);
        let pool = build(cfg, blocks, capacity, dtype, dev, expanded, false)?;
        // Every block, in order: one run of positions, read as views.
        let table = (0..blocks)
            .map(|_| pool.blocks().take().expect("a fresh pool of this size"))
            .collect();
        Ok(Self::in_pool(Arc::new(pool), table, capacity))
    }

    fn in_pool(pool: Arc<Pool>, table: Vec<u32>, capacity: usize) -> Self {
        Self {
            pool,
            table,
            ids: Vec::new(),
            capacity,
            indexed: 0,
        }
    }

    /// Positions filled so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The tokens the filled positions hold, in order.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Bytes one token occupies over all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.pool.bytes_per_token
    }

    /// Bytes holding cached tokens now.
    pub fn bytes_in_use(&self) -> usize {
        self.len() * self.pool.bytes_per_token
    }

    /// Bytes of the blocks this cache holds (a cache of its own: its whole capacity).
    pub fn bytes_allocated(&self) -> usize {
        (self.table.len() * BLOCK).min(self.pool.positions) * self.pool.bytes_per_token
    }

    /// Forgets every cached token. A cache of its own keeps its memory for reuse; a
    /// sequence of a shared pool gives its blocks back (those of a cached prefix stay
    /// indexed).
    pub fn reset(&mut self) {
        self.truncate(0);
    }

    /// Keeps only the first `len` positions (no-op when it holds fewer): the next token goes
    /// at `len`. A chat turn keeps the prefix it shares. In a shared pool, the blocks past
    /// `len` go back to it.
    pub fn truncate(&mut self, len: usize) {
        let len = self.len().min(len);
        self.ids.truncate(len);
        self.indexed = self.indexed.min(len / BLOCK);
        if self.shared() {
            let keep = len.div_ceil(BLOCK);
            let mut blocks = self.pool.blocks();
            for b in self.table.drain(keep..) {
                blocks.release(b);
            }
        }
    }

    /// With an empty cache in a shared pool: takes the indexed blocks that hold the longest
    /// prefix of `ids[..limit]` and returns the positions it now holds (none in a cache of
    /// its own). Shared blocks are copied before the cache writes into one.
    pub fn reuse_prefix(&mut self, ids: &[u32], limit: usize) -> usize {
        if !self.is_empty() || !self.shared() {
            return 0;
        }
        self.reset(); // blocks a failed step took but never filled go back
        let mut blocks = self.pool.blocks();
        let (found, n) = blocks.lookup(ids, limit.min(self.capacity));
        for &b in &found {
            blocks.hold(b);
        }
        drop(blocks);
        self.table = found;
        self.indexed = n / BLOCK;
        self.ids = ids[..n].to_vec();
        n
    }

    /// Gives every block back to a shared pool, indexing the last, partly filled one first
    /// (its full ones are indexed already): a later prompt that begins with all this cache
    /// held reuses every position (the next turn of a conversation; a preempted request
    /// resuming). The cache is then empty.
    pub fn release(&mut self) {
        let (len, full) = (self.len(), self.len() / BLOCK);
        if self.shared() && self.indexed == full && len % BLOCK != 0 {
            let parent = full.checked_sub(1).map(|p| self.table[p]);
            let tail = &self.ids[full * BLOCK..];
            self.pool.blocks().register(self.table[full], parent, tail);
        }
        self.truncate(0);
    }

    /// Whether this cache's pool is shared (the server's), not its own.
    fn shared(&self) -> bool {
        self.pool.sharing
    }

    /// Blocks this cache would take to write `t` more tokens (0 in a cache of its own).
    pub fn blocks_needed(&self, t: usize) -> usize {
        (self.len() + t)
            .div_ceil(BLOCK)
            .saturating_sub(self.table.len())
            + self.shared_tail(t)
    }

    /// 1 when the block the next token goes into must be copied first.
    fn shared_tail(&self, t: usize) -> usize {
        let i = self.len() / BLOCK;
        let tail = self.table.get(i).copied();
        match tail {
            Some(b) if t > 0 && self.pool.blocks().must_copy(b) => 1,
            _ => 0,
        }
    }

    /// Checks that `t` more tokens fit, and takes the blocks they need, before any layer
    /// writes: blocks past the table from the pool, and a shared block that would be
    /// written replaced by a copy of its own (copy on write; [`blocks::Blocks::own`]).
    pub(crate) fn reserve(&mut self, t: usize) -> Result<()> {
        if self.len() + t > self.capacity {
            return Err(Error::Invalid(format!(
                "cache full: {} cached + {t} new tokens exceed its capacity of {}",
                self.len(),
                self.capacity
            )));
        }
        let full = || {
            Error::Invalid(format!(
                "the KV pool is full: {} more positions need blocks of {BLOCK} and none is \
                 free (serve --kv-memory)",
                t
            ))
        };
        let first = self.len() / BLOCK;
        if let Some(&b) = self.table.get(first).filter(|_| t > 0) {
            let mut blocks = self.pool.blocks();
            if !blocks.own(b) {
                let copy = blocks.take().ok_or_else(full)?;
                drop(blocks);
                let copied = (self.pool.layers.iter())
                    .try_for_each(|layer| layer.copy_block(b as usize, copy as usize));
                let mut blocks = self.pool.blocks();
                if let Err(e) = copied {
                    blocks.release(copy);
                    return Err(e.into());
                }
                blocks.release(b);
                self.table[first] = copy;
            }
            self.indexed = self.indexed.min(first);
        }
        let need = (self.len() + t).div_ceil(BLOCK);
        let mut blocks = self.pool.blocks();
        while self.table.len() < need {
            let b = blocks.take().ok_or_else(full)?;
            self.table.push(b);
        }
        Ok(())
    }

    /// Where positions `0..len` are, for a step that fills them up to `len` (after
    /// [`KvCache::reserve`]).
    pub(crate) fn pages(&self, len: usize) -> Pages {
        Pages::new(&self.table[..len.div_ceil(BLOCK)], len)
    }

    /// Layer `i` of the pool, read through `pages`.
    pub(crate) fn layer<'a>(&'a self, i: usize, pages: &'a Pages) -> LayerView<'a> {
        LayerView::new(&self.pool.layers[i], pages)
    }

    /// Marks `ids` as written after what the cache held, once every layer has written
    /// them; in a shared pool, indexes the blocks they fill.
    pub(crate) fn advance(&mut self, ids: &[u32]) {
        self.ids.extend_from_slice(ids);
        if !self.shared() {
            return;
        }
        let mut blocks = self.pool.blocks();
        while (self.indexed + 1) * BLOCK <= self.ids.len() {
            let i = self.indexed;
            let parent = i.checked_sub(1).map(|p| self.table[p]);
            blocks.register(self.table[i], parent, &self.ids[i * BLOCK..(i + 1) * BLOCK]);
            self.indexed += 1;
        }
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        self.release();
        let mut blocks = self.pool.blocks();
        for &b in &self.table {
            blocks.release(b);
        }
    }
}
