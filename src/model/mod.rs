//! The decoder-only transformer: embedding, a stack of [`block::DecoderLayer`]s, final norm
//! and LM head. Stateless: the caller owns the [`KvCache`] and the position comes from it.

pub mod attention;
pub mod block;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod pool;
pub mod rope;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use attention::causal_mask;
use block::DecoderLayer;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{embedding, Embedding, RmsNorm, VarBuilder};
use linear::{Linear, Quantizer};
use rope::Rope;

/// Prompt tokens per forward: bounds the (heads, chunk, context) attention scores a long
/// prompt materialises, as llama.cpp's micro-batches do.
pub const PREFILL_CHUNK: usize = 512;

/// The dtype activations run in between the products: f32 on CPU whatever the weights, the
/// weights' own elsewhere (CUDA). As in llama.cpp, a CPU product reads bf16 weights and
/// widens them in registers, so f32 activations cost it nothing, while candle's element-wise
/// bf16 ops (norms, RoPE, SiLU, residual adds) convert every element both ways: on the AVX2
/// host, SmolLM2-135M bf16 prefill of 512 tokens ran at 0.84x f32's with bf16 activations.
/// The KV cache stays in the weights' dtype (its bytes are what the cache reports).
pub fn activation_dtype(weights: DType, dev: &Device) -> DType {
    match dev.is_cpu() {
        true => DType::F32,
        false => weights,
    }
}

/// candle_nn's RMSNorm (same loading and initialisation) with its weight in the
/// [`activation_dtype`].
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    let act = activation_dtype(vb.dtype(), vb.device());
    let weight = candle_nn::rms_norm(size, eps, vb)?
        .into_inner()
        .weight()
        .to_dtype(act)?;
    Ok(RmsNorm::new(weight, eps))
}

/// One sequence of a batched step: the tokens to feed after what its cache holds.
pub struct Feed<'a> {
    pub ids: &'a [u32],
    pub cache: &'a mut KvCache,
}

#[derive(Debug, Clone)]
pub struct Transformer {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// The embedding matrix itself when `tie_word_embeddings` is set.
    lm_head: Linear,
    rope: Rope,
    cfg: ModelConfig,
    /// The block format of the layers' projections, and the bytes it saved against the
    /// dense weights (less a tied LM head's blocks, kept beside the embedding); `None` when
    /// they are dense.
    quantized: Option<(GgmlDType, isize)>,
}

impl Transformer {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_quantized(cfg, vb, None)
    }

    /// The model with each layer's projections and the LM head in the blocks `quant` gives
    /// (Q8_0, Q4_0, a GGUF file's own...), replaced layer by layer as they load, so the dense
    /// weights of only one layer are in memory at a time. Embeddings and norms keep `vb`'s
    /// dtype; a tied LM head gets its own blocks beside the embedding (the lookup reads one
    /// row, the head all of them). A projection whose rows are not whole blocks stays dense.
    pub fn new_quantized(
        cfg: &ModelConfig,
        vb: VarBuilder,
        quant: Option<&dyn Quantizer>,
    ) -> Result<Self> {
        let vb_m = vb.pp("model");
        let embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, vb_m.pp("embed_tokens"))?;
        let mut saved = 0;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let mut layer = DecoderLayer::new(cfg, i, vb_m.pp("layers").pp(i))?;
            if let Some(q) = quant {
                saved += layer.quantize(q)? as isize;
            }
            layers.push(layer);
        }
        let mut lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None).named("model.embed_tokens.weight")
        } else {
            linear::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        if let Some(q) = quant {
            // A tied head's dense weight is the embedding's, counted already.
            let before = match cfg.tie_word_embeddings {
                true => 0,
                false => lm_head.weight_bytes() as isize,
            };
            if lm_head.quantize(q)? {
                saved += before - lm_head.weight_bytes() as isize;
            }
        }
        let act = activation_dtype(vb.dtype(), vb.device());
        let rope = Rope::new(&cfg.rope, act, vb.device())?;
        Ok(Self {
            embed_tokens,
            layers,
            norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?,
            lm_head,
            rope,
            cfg: cfg.clone(),
            quantized: quant.map(|q| (q.label(), saved)),
        })
    }

    /// Bytes of the embedding table a decode step does not read (it reads one row): all of
    /// them, unless the LM head multiplies by that very table (tied and not quantized).
    pub fn embedding_bytes_unread(&self) -> usize {
        let table = self.embed_tokens.embeddings();
        // A tied head is built on the table itself, until quantized into its own blocks.
        match self.cfg.tie_word_embeddings && self.lm_head.weight().is_some() {
            true => 0,
            false => table.elem_count() * table.dtype().size_in_bytes(),
        }
    }

    /// The block format of the layers' projections, if quantized.
    pub fn quantization(&self) -> Option<GgmlDType> {
        self.quantized.map(|(q, _)| q)
    }

    /// Bytes quantization saved against the dense weights (0 when dense; it can be negative
    /// for a small model whose tied LM head's blocks outweigh what the projections saved).
    pub fn quantization_saved_bytes(&self) -> isize {
        self.quantized.map_or(0, |(_, saved)| saved)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn device(&self) -> &candle_core::Device {
        self.embed_tokens.embeddings().device()
    }

    /// The dtype of the weights and the cache (activations: [`activation_dtype`]).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.embeddings().dtype()
    }

    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// Runs `ids` (B, T) through the stack after the tokens already in `cache`, writes their
    /// keys and values into it, and returns the final hidden states (B, T, C).
    fn hidden(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (_, t) = ids.dims2()?;
        cache.reserve(t)?;
        let pos = cache.len();
        // An id past the vocabulary is an error from candle's index_select, not a panic.
        let act = activation_dtype(self.dtype(), self.device());
        let mut x = self.embed_tokens.forward(ids)?.to_dtype(act)?;
        // A single new token sees every cached key unless a sliding window hides some.
        let s = pos + t;
        let mask = match t > 1 || s > self.cfg.sliding_window {
            true => Some(causal_mask(
                t,
                s,
                self.cfg.sliding_window,
                x.dtype(),
                x.device(),
            )?),
            false => None,
        };
        let rotation = self.rope.at(pos, t)?;
        for (layer, entry) in self.layers.iter().zip(cache.layers()) {
            x = layer.forward(&x, &rotation, mask.as_ref(), entry, pos)?;
        }
        cache.advance(t);
        Ok(self.norm.forward(&x)?)
    }

    /// Logits (B, T, vocab) in f32 for every position of `ids`.
    pub fn forward(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let t = ids.dim(1)?;
        self.forward_tail(ids, cache, t)?
            .ok_or_else(|| Error::Invalid("no tokens to run".into()))
    }

    /// Runs `ids` (B, T) and returns the logits (B, keep, vocab) in f32 of its last `keep`
    /// positions only (the LM head runs on those), or `None` when `keep` is 0.
    pub fn forward_tail(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        keep: usize,
    ) -> Result<Option<Tensor>> {
        let x = self.hidden(ids, cache)?;
        let t = x.dim(1)?;
        if keep == 0 {
            return Ok(None);
        }
        let x = x.narrow(1, t - keep.min(t), keep.min(t))?;
        Ok(Some(self.lm_head.forward(&x)?.to_dtype(DType::F32)?))
    }

    /// Logits (B, vocab) in f32 for the last position only: the LM head runs once.
    pub fn forward_last(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let logits = self.forward_tail(ids, cache, 1)?;
        let logits = logits.ok_or_else(|| Error::Invalid("no tokens to run".into()))?;
        Ok(logits.squeeze(1)?) // (B, vocab)
    }

    /// Feeds each sequence's ids after what its own cache holds and returns each one's
    /// last-position logits, in order: the step of a batch (`generate` with several prompts,
    /// `bench --batch`, the server's scheduler). Ids of different lengths are allowed (a
    /// prompt chunk beside decode tokens); none may be empty.
    pub fn next_logits_batch(&self, feeds: &mut [Feed<'_>]) -> Result<Vec<Vec<f32>>> {
        // First form: one sequence after another (same results as the packed step to come).
        feeds
            .iter_mut()
            .map(|f| self.next_logits(f.ids, f.cache))
            .collect()
    }

    /// Feeds `ids` after what `cache` holds (a whole prompt in chunks of [`PREFILL_CHUNK`], or
    /// one decode token) and returns the last position's logits: the one step of prefill and
    /// decode alike.
    pub fn next_logits(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let mut logits = None;
        for chunk in ids.chunks(PREFILL_CHUNK) {
            let input = Tensor::new(chunk, self.device())?.unsqueeze(0)?; // (1, T)
            logits = Some(self.forward_last(&input, cache)?);
        }
        match logits {
            Some(logits) => Ok(logits.squeeze(0)?.to_vec1::<f32>()?),
            None => Err(Error::Invalid("no tokens to run".into())),
        }
    }
}
