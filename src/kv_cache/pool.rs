//! The storage a cache's blocks live in: per layer a [`LayerCache`] of every position,
//! allocated once ([`build`]); a [`KvPool`] shares it among the server's sequences, a cache of its own
//! ([`super::KvCache::new`]) owns one of exactly its capacity.

use super::blocks::{Blocks, Usage};
use super::put::put;
use super::{KvCache, BLOCK};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::sync::{Arc, Mutex, MutexGuard};

/// What one layer caches, for every position of the pool. Both variants are (1, heads, pool
/// positions, width) so that positions are always dimension 2. Not `Clone`: a clone would
/// share the buffers (see [`KvCache`]).
#[derive(Debug)]
pub enum LayerCache {
    /// GQA/MQA/MHA: keys and values of the `num_kv_heads` heads, after RoPE.
    Kv { k: Tensor, v: Tensor },
    /// MLA: per position one row `[c_kv | k_pe]`, the normalised latent (width `rank`,
    /// kv_lora_rank) and then the rotated shared key (width qk_rope_head_dim), as one "head"
    /// (1, 1, capacity, rank + rope). One row, not two tensors, so that the absorbed decode
    /// reads it as the keys of one K/V head and its first `rank` values as the values (see
    /// [`super::LayerView::write_held`]). Low-rank K/V (`kv_latent_rank`): the latent, no `k_pe`.
    Latent { rows: Tensor, rank: usize },
}

impl LayerCache {
    /// Writes `a` and `b` (1, heads, T, width) at pool position `at`, in the cache's dtype:
    /// K and V, or for the latent cache the rows `[a | b]` (`b` may be 0 wide).
    pub(super) fn put(&self, a: &Tensor, b: &Tensor, at: usize) -> candle_core::Result<()> {
        let t = a.dim(2)?;
        if let Some(done) = self.put_in_place(a, b, &(at..at + t).collect::<Vec<_>>()) {
            return done;
        }
        match self {
            LayerCache::Kv { k, v } => {
                k.slice_set(&a.to_dtype(k.dtype())?.contiguous()?, 2, at)?;
                v.slice_set(&b.to_dtype(v.dtype())?.contiguous()?, 2, at)
            }
            LayerCache::Latent { rows, .. } => {
                let new = match b.elem_count() {
                    0 => a.to_dtype(rows.dtype())?,
                    _ => Tensor::cat(&[a.to_dtype(rows.dtype())?, b.to_dtype(rows.dtype())?], 3)?,
                };
                rows.slice_set(&new.contiguous()?, 2, at)
            }
        }
    }

    /// [`Self::put`] on the CPU in one pass a tensor ([`super::put`]), token j of `a` and `b`
    /// at pool position `positions[j]` (a step's sequences each at its own, or one run), or
    /// `None` where that does not apply (then nothing, or what the caller writes again, was
    /// written).
    pub(super) fn put_in_place(
        &self,
        a: &Tensor,
        b: &Tensor,
        positions: &[usize],
    ) -> Option<candle_core::Result<()>> {
        match self {
            LayerCache::Kv { k, v } => match put(k, a, positions, 0)? {
                Ok(()) => put(v, b, positions, 0),
                e => Some(e),
            },
            LayerCache::Latent { rows, .. } => {
                match (put(rows, a, positions, 0)?, b.elem_count()) {
                    (Ok(()), 0) => Some(Ok(())),
                    (Ok(()), _) => Some(put(rows, b, positions, a.dim(3).ok()?)?),
                    (e, _) => Some(e),
                }
            }
        }
    }

    /// The tensors a read takes keys and values from: (K, V), or the latent rows twice.
    pub(super) fn tensors(&self) -> [&Tensor; 2] {
        match self {
            LayerCache::Kv { k, v } => [k, v],
            LayerCache::Latent { rows, .. } => [rows, rows],
        }
    }

    /// The buffers it owns, each once.
    fn buffers(&self) -> Vec<&Tensor> {
        match self {
            LayerCache::Kv { k, v } => vec![k, v],
            LayerCache::Latent { rows, .. } => vec![rows],
        }
    }

    /// Copies block `from`'s positions to block `to`.
    pub(super) fn copy_block(&self, from: usize, to: usize) -> candle_core::Result<()> {
        for t in self.buffers() {
            // `force_contiguous`, not `contiguous`: one head's narrow is contiguous already, a
            // view of the same storage, which `slice_set` refuses to write from.
            let block = t.narrow(2, from * BLOCK, BLOCK)?.force_contiguous()?;
            t.slice_set(&block, 2, to * BLOCK)?;
        }
        Ok(())
    }
}

/// The storage every cache of a pool shares: per layer a [`LayerCache`] of `positions`
/// positions, and which sequence holds which block.
#[derive(Debug)]
pub(super) struct Pool {
    pub(super) layers: Vec<LayerCache>,
    pub(super) blocks: Mutex<Blocks>,
    /// Positions per layer tensor: blocks × [`BLOCK`], or a private cache's capacity.
    pub(super) positions: usize,
    pub(super) block_count: usize,
    pub(super) bytes_per_token: usize,
    /// Whether sequences come and go (the server's pool) rather than one cache owning all.
    pub(super) sharing: bool,
}

impl Pool {
    /// The block table's state. Nothing panics while it is locked, but a poisoned lock is
    /// taken as it is rather than spread the panic.
    pub(super) fn blocks(&self) -> MutexGuard<'_, Blocks> {
        self.blocks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Blocks of positions shared by many sequences (the server's): each [`KvPool::sequence`]
/// takes blocks as it grows and gives them back when dropped; full blocks are indexed by
/// their prefix, so that a new sequence starts from what another cached
/// ([`KvCache::reuse_prefix`]).
#[derive(Debug, Clone)]
pub struct KvPool(Arc<Pool>);

impl KvPool {
    /// A pool of as many whole blocks as `bytes` holds (at least one).
    pub fn new(cfg: &ModelConfig, bytes: usize, dtype: DType, dev: &Device) -> Result<Self> {
        let per_block = cfg.cache_layout(false).values()
            * cfg.num_hidden_layers
            * dtype.size_in_bytes()
            * BLOCK;
        let blocks = bytes / per_block.max(1);
        if blocks == 0 {
            return Err(Error::Invalid(format!(
                "--kv-memory {bytes} bytes holds no block of {BLOCK} positions ({per_block} \
                 bytes for this model)"
            )));
        }
        let pool = build(cfg, blocks, blocks * BLOCK, dtype, dev, false, true)?;
        for layer in &pool.layers {
            for t in layer.buffers() {
                commit(t)?;
            }
        }
        Ok(Self(Arc::new(pool)))
    }

    /// An empty cache in this pool for at most `capacity` positions.
    pub fn sequence(&self, capacity: usize) -> KvCache {
        KvCache::in_pool(self.0.clone(), Vec::new(), capacity)
    }

    pub fn blocks(&self) -> usize {
        self.0.block_count
    }

    /// Blocks by state now.
    pub fn usage(&self) -> Usage {
        self.0.blocks().usage()
    }

    /// Blocks a sequence could take now (free, or cached and evictable).
    pub fn available(&self) -> usize {
        self.0.blocks().available()
    }

    /// How many leading positions of `ids[..max]` the index holds.
    pub fn cached(&self, ids: &[u32], max: usize) -> usize {
        self.0.blocks().lookup(ids, max).1
    }

    pub fn bytes(&self) -> usize {
        self.0.positions * self.0.bytes_per_token
    }

    pub fn bytes_per_token(&self) -> usize {
        self.0.bytes_per_token
    }
}

/// Writes zeros over all of `t`, a block at a time: the operating system hands out a fresh
/// allocation's pages at their first write, so a pool that was only allocated would grow
/// in memory as its blocks are first used. The server's pool is resident from the start, and
/// its memory stays flat after. (A cache of its own commits only the positions it uses.)
fn commit(t: &Tensor) -> Result<()> {
    let (_, heads, positions, width) = t.dims4()?;
    let zeros = Tensor::zeros((1, heads, BLOCK, width), t.dtype(), t.device())?;
    for at in (0..positions).step_by(BLOCK) {
        t.slice_set(&zeros, 2, at)?;
    }
    Ok(())
}

/// The layers' tensors of `positions` positions in `blocks` blocks.
pub(super) fn build(
    cfg: &ModelConfig,
    blocks: usize,
    positions: usize,
    dtype: DType,
    dev: &Device,
    expanded: bool,
    sharing: bool,
) -> Result<Pool> {
    let layout = cfg.cache_layout(expanded);
    let bytes_per_token = cfg.num_hidden_layers * layout.values() * dtype.size_in_bytes();
    crate::config::check_fits(
        positions.saturating_mul(bytes_per_token),
        &format!("the KV cache for {positions} positions"),
        "use fewer tokens (a shorter prompt, --max-new-tokens, --context or --kv-memory)",
    )?;
    let ((ha, wa), (hb, wb)) = (layout.a, layout.b);
    let layers = (0..cfg.num_hidden_layers)
        .map(|_| {
            let zeros = |heads, width| Tensor::zeros((1, heads, positions, width), dtype, dev);
            Ok(match layout.kv {
                true => LayerCache::Kv {
                    k: zeros(ha, wa)?,
                    v: zeros(hb, wb)?,
                },
                // One "head" each (`cache_layout`): rows of both widths side by side.
                false => LayerCache::Latent {
                    rows: zeros(1, wa + wb)?,
                    rank: wa,
                },
            })
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Pool {
        layers,
        blocks: Mutex::new(Blocks::new(blocks, BLOCK, sharing)),
        positions,
        block_count: blocks,
        bytes_per_token,
        sharing,
    })
}
