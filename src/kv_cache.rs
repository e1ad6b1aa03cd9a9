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
    /// MLA: per position one row `[c_kv | k_pe]`, the normalised latent (width `rank`,
    /// kv_lora_rank) and then the rotated shared key (width qk_rope_head_dim), as one "head"
    /// (1, 1, capacity, rank + rope). One row, not two tensors, so that the absorbed decode
    /// reads it as the keys of one K/V head and its first `rank` values as the values (see
    /// [`LayerCache::write_latent`]). Low-rank K/V (`kv_latent_rank`): the latent, no `k_pe`.
    Latent { rows: Tensor, rank: usize },
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
        let (k, v) = match self {
            LayerCache::Kv { k, v } => (k, v),
            LayerCache::Latent { rank, .. } => {
                let rows = self.write_latent(a, b, pos)?;
                let width = rows.dim(3)?;
                return Ok((
                    rows.narrow(3, 0, *rank)?,
                    rows.narrow(3, *rank, width - rank)?,
                ));
            }
        };
        let len = pos + a.dim(2)?;
        k.slice_set(&a.to_dtype(k.dtype())?.contiguous()?, 2, pos)?;
        v.slice_set(&b.to_dtype(v.dtype())?.contiguous()?, 2, pos)?;
        Ok((k.narrow(2, 0, len)?, v.narrow(2, 0, len)?))
    }

    /// The latent cache's [`LayerCache::write`]: writes `c_kv` (1, 1, T, rank) and `k_pe`
    /// (1, 1, T, rope) as rows `[c_kv | k_pe]` at `pos` and returns the rows of positions
    /// `0..pos + T`, (1, 1, S, rank + rope), a view.
    pub fn write_latent(
        &self,
        c_kv: &Tensor,
        k_pe: &Tensor,
        pos: usize,
    ) -> candle_core::Result<Tensor> {
        let LayerCache::Latent { rows, .. } = self else {
            return Err(candle_core::Error::Msg(
                "write_latent on a K/V cache".into(),
            ));
        };
        let new = match k_pe.elem_count() {
            0 => c_kv.to_dtype(rows.dtype())?,
            _ => Tensor::cat(
                &[c_kv.to_dtype(rows.dtype())?, k_pe.to_dtype(rows.dtype())?],
                3,
            )?,
        };
        rows.slice_set(&new.contiguous()?, 2, pos)?;
        rows.narrow(2, 0, pos + c_kv.dim(2)?)
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
                let zeros = |heads, width| Tensor::zeros((1, heads, capacity, width), dtype, dev);
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

    /// Makes this cache hold `from`'s first `n` positions (a copy: the two stay
    /// independent), for a prompt that begins with what another sequence has cached. Both
    /// caches must be of the same model and dtype; `n` at most `from.len()` and this
    /// cache's capacity.
    pub fn copy_prefix(&mut self, from: &KvCache, n: usize) -> Result<()> {
        if n > from.len || n > self.capacity || self.layers.len() != from.layers.len() {
            return Err(Error::Invalid(format!(
                "cannot copy {n} positions from a cache of {} ({} layers) into one of capacity \
                 {} ({} layers)",
                from.len,
                from.layers.len(),
                self.capacity,
                self.layers.len()
            )));
        }
        self.len = 0; // nothing is trusted until every layer is copied
        let copy =
            |dst: &Tensor, src: &Tensor| dst.slice_set(&src.narrow(2, 0, n)?.contiguous()?, 2, 0);
        for (dst, src) in self.layers.iter().zip(&from.layers) {
            match (dst, src) {
                (LayerCache::Kv { k, v }, LayerCache::Kv { k: k2, v: v2 }) => {
                    copy(k, k2)?;
                    copy(v, v2)?;
                }
                (LayerCache::Latent { rows, .. }, LayerCache::Latent { rows: r2, .. }) => {
                    copy(rows, r2)?
                }
                _ => {
                    return Err(Error::Invalid(
                        "cannot copy between caches of two layouts".into(),
                    ))
                }
            }
        }
        self.len = n;
        Ok(())
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
