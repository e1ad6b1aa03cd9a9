//! The per-layer KV cache, owned by the caller and passed into `forward`.
//!
//! Every entry is allocated once, for a fixed capacity, and written in place with
//! `slice_set`: no `Tensor::cat` per step. (candle-nn's `kv_cache::Cache` allocates on first
//! use and grows by concatenation past its capacity; we want a hard capacity and an error.)

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};

/// What one layer caches. Both variants are (1, heads, capacity, width) so that positions are
/// always dimension 2. Not `Clone`: a clone would share the buffers (see [`KvCache`]).
#[derive(Debug)]
pub enum LayerCache {
    /// GQA/MQA/MHA: keys and values of the `num_kv_heads` heads, after RoPE.
    Kv { k: Tensor, v: Tensor },
    /// MLA: the normalised latent `c_kv` (width kv_lora_rank) and the rotated shared key
    /// `k_pe` (width qk_rope_head_dim), as one "head" each. Low-rank K/V (`kv_latent_rank`):
    /// the latent, and a `k_pe` of width 0.
    Latent { c_kv: Tensor, k_pe: Tensor },
}

impl LayerCache {
    /// Writes `a` and `b` (1, heads, T, width) at position `pos`, in the cache's dtype, and
    /// returns views of positions `0..pos + T` of both.
    pub fn write(
        &self,
        a: &Tensor,
        b: &Tensor,
        pos: usize,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        let (dst_a, dst_b) = match self {
            LayerCache::Kv { k, v } => (k, v),
            LayerCache::Latent { c_kv, k_pe } => (c_kv, k_pe),
        };
        let len = pos + a.dim(2)?;
        dst_a.slice_set(&a.to_dtype(dst_a.dtype())?.contiguous()?, 2, pos)?;
        if b.elem_count() > 0 {
            dst_b.slice_set(&b.to_dtype(dst_b.dtype())?.contiguous()?, 2, pos)?;
        }
        Ok((dst_a.narrow(2, 0, len)?, dst_b.narrow(2, 0, len)?))
    }
}

/// One [`LayerCache`] per layer and the number of positions filled so far.
///
/// Not `Clone`: candle tensors are reference-counted and the cache writes them in place, so a
/// derived clone would share every buffer, and writing to one would corrupt the other.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// Positions written in every layer; the next token's position.
    len: usize,
    capacity: usize,
    bytes_per_token: usize,
}

impl KvCache {
    /// Allocates room for `capacity` positions (at most the model's context length).
    pub fn new(cfg: &ModelConfig, capacity: usize, dtype: DType, dev: &Device) -> Result<Self> {
        Self::build(cfg, capacity, dtype, dev, false)
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
        Self::build(cfg, capacity, dtype, dev, true)
    }

    fn build(
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
        let layout = cfg.cache_layout(expanded);
        let bytes_per_token = cfg.num_hidden_layers * layout.values() * dtype.size_in_bytes();
        crate::config::check_fits(
            capacity.saturating_mul(bytes_per_token),
            &format!("the KV cache for {capacity} positions"),
            "use fewer tokens (a shorter prompt, --max-new-tokens or --context)",
        )?;
        let ((ha, wa), (hb, wb)) = (layout.a, layout.b);
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| {
                let a = Tensor::zeros((1, ha, capacity, wa), dtype, dev)?;
                let b = Tensor::zeros((1, hb, capacity, wb), dtype, dev)?;
                Ok(match layout.kv {
                    true => LayerCache::Kv { k: a, v: b },
                    false => LayerCache::Latent { c_kv: a, k_pe: b },
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: 0,
            capacity,
            bytes_per_token,
        })
    }

    /// Positions filled so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes one token occupies over all layers.
    pub fn bytes_per_token(&self) -> usize {
        self.bytes_per_token
    }

    /// Bytes holding cached tokens now.
    pub fn bytes_in_use(&self) -> usize {
        self.len * self.bytes_per_token
    }

    /// Bytes allocated for the whole capacity.
    pub fn bytes_allocated(&self) -> usize {
        self.capacity * self.bytes_per_token
    }

    /// Forgets every cached token; the memory is kept for reuse.
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Keeps only the first `len` positions (no-op when it holds fewer): the next token goes
    /// at `len`, overwriting what was there. A chat turn keeps the prefix it shares.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Checks that `t` more tokens fit, before any layer writes.
    pub(crate) fn reserve(&self, t: usize) -> Result<()> {
        if self.len + t > self.capacity {
            return Err(Error::Invalid(format!(
                "cache full: {} cached + {t} new tokens exceed its capacity of {}",
                self.len, self.capacity
            )));
        }
        Ok(())
    }

    pub(crate) fn layers(&self) -> &[LayerCache] {
        &self.layers
    }

    /// Marks `t` positions as written, after every layer has written them.
    pub(crate) fn advance(&mut self, t: usize) {
        self.len += t;
    }
}
