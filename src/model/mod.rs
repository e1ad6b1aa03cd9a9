//! The decoder-only transformer: embedding, a stack of [`block::DecoderLayer`]s, final norm
//! and LM head. Stateless: the caller owns the [`KvCache`] and the position comes from it.

pub mod attention;
pub mod block;
mod cpu;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod pool;
pub mod rope;
pub mod swiglu;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, LayerView, Pages};
use attention::Span;
use block::DecoderLayer;
use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::VarBuilder;
use embedding::TokenEmbedding;
use linear::{Blocks, Linear, Quantizer};
use norm::RmsNorm;
use rope::Rope;

/// The embedding's name in a checkpoint (and its tied LM head's).
const EMBEDDING: &str = "model.embed_tokens.weight";

/// Prompt tokens per forward: bounds the (heads, chunk, context) attention scores a long
/// prompt materialises, as llama.cpp's micro-batches do.
pub const PREFILL_CHUNK: usize = 512;

/// The dtype activations run in between the products: f32 on CPU whatever the weights, the
/// weights' own elsewhere (CUDA). As in llama.cpp, a CPU product reads bf16 weights and
/// widens them in registers, so f32 activations cost it nothing, while candle's element-wise
/// bf16 ops (norms, RoPE, SiLU, residual adds) convert every element both ways: on the AVX2
/// host, SmolLM2-135M bf16 prefill of 512 tokens ran at 0.84x f32's with bf16 activations.
/// The KV cache stays in the weights' dtype, except for blocks on CPU
/// ([`crate::kv_cache::dtype_for`]).
pub fn activation_dtype(weights: DType, dev: &Device) -> DType {
    match dev.is_cpu() {
        true => DType::F32,
        false => weights,
    }
}

/// RMSNorm (candle_nn's loading and initialisation) with its weight in the
/// [`activation_dtype`].
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> candle_core::Result<RmsNorm> {
    let act = activation_dtype(vb.dtype(), vb.device());
    let weight = candle_nn::rms_norm(size, eps, vb)?
        .into_inner()
        .weight()
        .to_dtype(act)?;
    Ok(RmsNorm::new(weight, eps))
}

/// What [`Transformer::visit_attention_inputs`] calls with each layer's index and input.
pub type Visit<'a> = dyn FnMut(usize, &Tensor) -> Result<()> + 'a;

/// One sequence of a batched step: the tokens to feed after what its cache holds.
pub struct Feed<'a> {
    pub ids: &'a [u32],
    pub cache: &'a mut KvCache,
}

#[derive(Debug, Clone)]
pub struct Transformer {
    embed_tokens: TokenEmbedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// The embedding matrix itself when `tie_word_embeddings` is set.
    lm_head: Linear,
    rope: Rope,
    device: Device,
    cfg: ModelConfig,
    /// The block format of the layers' projections, and the bytes it saved against the
    /// dense weights (less a tied LM head's blocks, kept beside the embedding); `None` when
    /// they are dense.
    quantized: Option<(GgmlDType, isize)>,
    /// The KV cache's dtype ([`crate::kv_cache::dtype_for`] unless set).
    cache_dtype: DType,
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
        let mut saved = 0;
        // A file's own blocks for the embedding (a GGUF's, on CPU) are kept as they are.
        let stored = match quant
            .map(|q| q.blocks(Some(EMBEDDING)))
            .transpose()?
            .flatten()
        {
            Some(Blocks::Stored(t)) if vb.device().is_cpu() => linear::stored_weight(&t)?,
            _ => None,
        };
        if let Some(table) = &stored {
            let want = (cfg.vocab_size, cfg.hidden_size);
            if (table.rows(), table.cols()) != want {
                return Err(Error::Weights(format!(
                    "{EMBEDDING}: stored blocks of {}x{} do not match the config's {}x{}",
                    table.rows(),
                    table.cols(),
                    want.0,
                    want.1
                )));
            }
        }
        let embed_tokens = match stored {
            Some(table) => {
                let dense = cfg.vocab_size * cfg.hidden_size * vb.dtype().size_in_bytes();
                saved += dense as isize - table.bytes() as isize;
                TokenEmbedding::Blocks {
                    table,
                    dtype: vb.dtype(),
                }
            }
            None => TokenEmbedding::Dense(candle_nn::embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                vb_m.pp("embed_tokens"),
            )?),
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let mut layer = DecoderLayer::new(cfg, i, vb_m.pp("layers").pp(i))?;
            if let Some(q) = quant {
                saved += layer.quantize(q)? as isize;
            }
            layers.push(layer);
        }
        let mut lm_head = match (&embed_tokens, cfg.tie_word_embeddings) {
            // Tied to the embedding's blocks: the same ones, counted once.
            (TokenEmbedding::Blocks { table, .. }, true) => {
                Linear::from_blocks(table.clone(), EMBEDDING)
            }
            (TokenEmbedding::Dense(e), true) => {
                Linear::new(e.embeddings().clone(), None).named(EMBEDDING)
            }
            (_, false) => {
                linear::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
            }
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
        let quantized = quant.map(|q| (q.label(), saved));
        let cache_dtype =
            crate::kv_cache::dtype_for(vb.dtype(), quantized.map(|q| q.0), vb.device());
        Ok(Self {
            embed_tokens,
            layers,
            norm: rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?,
            lm_head,
            rope,
            device: vb.device().clone(),
            cfg: cfg.clone(),
            quantized,
            cache_dtype,
        })
    }

    /// Bytes of the embedding table a decode step does not read (it reads one row): all of
    /// them, unless the LM head multiplies by that very table (tied, not quantized to blocks).
    pub fn embedding_bytes_unread(&self) -> usize {
        let shared = match &self.embed_tokens {
            TokenEmbedding::Dense(_) => self.lm_head.weight().is_some(),
            TokenEmbedding::Blocks { .. } => true,
        };
        match self.cfg.tie_word_embeddings && shared {
            true => 0,
            false => self.embed_tokens.bytes(),
        }
    }

    /// The embedding's parameters when it is held in a file's blocks (it is not read as a
    /// dense tensor then), else 0.
    pub fn embedding_elements_in_blocks(&self) -> usize {
        match &self.embed_tokens {
            TokenEmbedding::Blocks { table, .. } => table.rows() * table.cols(),
            TokenEmbedding::Dense(_) => 0,
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

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The dtype of the weights (activations: [`activation_dtype`]; the cache:
    /// [`Self::cache_dtype`]).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// The dtype a [`KvCache`] for this model holds its keys and values in.
    pub fn cache_dtype(&self) -> DType {
        self.cache_dtype
    }

    /// A cache of its own for `capacity` positions of this model, in [`Self::cache_dtype`]:
    /// the one door every caller takes, so none picks another dtype.
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        KvCache::new(&self.cfg, capacity, self.cache_dtype, &self.device)
    }

    /// Sets [`Self::cache_dtype`] (`--kv-dtype`): `None` for the default, else a dtype
    /// [`crate::kv_cache::choose_dtype`] allows on this device.
    pub fn set_cache_dtype(&mut self, asked: Option<DType>) -> Result<()> {
        let (weights, quant) = (self.dtype(), self.quantization());
        self.cache_dtype = crate::kv_cache::choose_dtype(asked, weights, quant, &self.device)?;
        Ok(())
    }

    pub fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }

    /// Runs every feed's ids, packed one sequence after another into (1, N), through the
    /// stack after what that sequence's cache holds, writes their keys and values into it,
    /// and returns the final hidden states (1, N, C) with each sequence's [`Span`] in them.
    fn hidden(&self, feeds: &mut [Feed<'_>]) -> Result<(Tensor, Vec<Span>)> {
        self.hidden_visiting(feeds, None)
    }

    /// Runs `ids` (one sequence) after what `cache` holds and hands `visit` each layer's
    /// index and attention input (1, T, C), the normed hidden state: what a conversion's
    /// calibration measures (`convert::calibrate`).
    pub fn visit_attention_inputs(
        &self,
        ids: &[u32],
        cache: &mut KvCache,
        visit: &mut Visit,
    ) -> Result<()> {
        self.hidden_visiting(&mut [Feed { ids, cache }], Some(visit))
            .map(|_| ())
    }

    /// [`Self::hidden`], handing each layer's attention input to `visit` when given.
    fn hidden_visiting(
        &self,
        feeds: &mut [Feed<'_>],
        mut visit: Option<&mut Visit>,
    ) -> Result<(Tensor, Vec<Span>)> {
        let dev = self.device();
        let (mut ids, mut positions, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        for f in feeds.iter_mut() {
            let (t, pos) = (f.ids.len(), f.cache.len());
            if t == 0 {
                return Err(Error::Invalid("no tokens to run".into()));
            }
            // Blocks for the new positions, before any layer writes.
            f.cache.reserve(t)?;
            // A single new token sees every cached key unless a sliding window hides some.
            spans.push(Span::new(ids.len(), t, pos, self.cfg.sliding_window, dev)?);
            positions.extend((pos..pos + t).map(|p| p as u32));
            ids.extend_from_slice(f.ids);
        }
        // An id past the vocabulary is an error from candle's index_select, not a panic.
        let act = activation_dtype(self.dtype(), dev);
        let input = Tensor::new(ids.as_slice(), dev)?.unsqueeze(0)?; // (1, N)
        let mut x = self.embed_tokens.forward(&input)?.to_dtype(act)?;
        let rotation = self.rope.at_positions(&positions)?;
        let pages: Vec<Pages> = (feeds.iter())
            .map(|f| f.cache.pages(f.cache.len() + f.ids.len()))
            .collect();
        for (i, layer) in self.layers.iter().enumerate() {
            let caches: Vec<LayerView> = (feeds.iter().zip(&pages))
                .map(|(f, pages)| f.cache.layer(i, pages))
                .collect();
            if let Some(visit) = visit.as_mut() {
                visit(i, &layer.attention_input(&x)?)?;
            }
            x = layer.forward(&x, &rotation, &spans, &caches)?;
        }
        for f in feeds.iter_mut() {
            f.cache.advance(f.ids);
        }
        Ok((self.norm.forward(&x)?, spans))
    }

    /// Logits (1, T, vocab) in f32 for every position of `ids` (1, T).
    pub fn forward(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let t = ids.dim(1)?;
        self.forward_tail(ids, cache, t)?
            .ok_or_else(|| Error::Invalid("no tokens to run".into()))
    }

    /// Runs `ids` (1, T), one sequence, and returns the logits (1, keep, vocab) in f32 of its
    /// last `keep` positions only (the LM head runs on those), or `None` when `keep` is 0.
    pub fn forward_tail(
        &self,
        ids: &Tensor,
        cache: &mut KvCache,
        keep: usize,
    ) -> Result<Option<Tensor>> {
        let rows = ids.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let [ids] = rows.as_slice() else {
            return Err(Error::Invalid(format!(
                "one sequence per cache: got {} rows of ids",
                rows.len()
            )));
        };
        let (x, _) = self.hidden(&mut [Feed { ids, cache }])?;
        let t = x.dim(1)?;
        if keep == 0 {
            return Ok(None);
        }
        let x = x.narrow(1, t - keep.min(t), keep.min(t))?;
        Ok(Some(self.lm_head.forward(&x)?.to_dtype(DType::F32)?))
    }

    /// Feeds `ids` after what `cache` holds (a whole prompt in chunks of [`PREFILL_CHUNK`], or
    /// one decode token) and returns the last position's logits: the one step of prefill and
    /// decode alike.
    pub fn next_logits(&self, ids: &[u32], cache: &mut KvCache) -> Result<Vec<f32>> {
        let mut logits = self.next_logits_batch(&mut [Feed { ids, cache }])?;
        Ok(logits.pop().expect("one sequence in, one out"))
    }

    /// Feeds each sequence's ids after what its own cache holds and returns each one's
    /// last-position logits, in order: the step of every caller, one sequence or a batch
    /// (`generate` with several prompts, `bench --batch`, the server's scheduler). Ids may
    /// differ in length (a prompt chunk beside decode tokens); none may be empty. Prompts
    /// run in rounds of at most [`PREFILL_CHUNK`] tokens per sequence; the LM head runs on
    /// each sequence's last position only.
    pub fn next_logits_batch(&self, feeds: &mut [Feed<'_>]) -> Result<Vec<Vec<f32>>> {
        if feeds.is_empty() || feeds.iter().any(|f| f.ids.is_empty()) {
            return Err(Error::Invalid("no tokens to run".into()));
        }
        let longest = feeds.iter().map(|f| f.ids.len()).max().unwrap_or(0);
        let mut logits = vec![Vec::new(); feeds.len()];
        for from in (0..longest).step_by(PREFILL_CHUNK) {
            let (mut round, mut which) = (Vec::new(), Vec::new());
            for (i, f) in feeds.iter_mut().enumerate() {
                let ids = f.ids;
                if from < ids.len() {
                    let to = (from + PREFILL_CHUNK).min(ids.len());
                    round.push(Feed {
                        ids: &ids[from..to],
                        cache: &mut *f.cache,
                    });
                    which.push(i);
                }
            }
            let (x, spans) = self.hidden(&mut round)?;
            let last: Vec<u32> = spans.iter().map(|s| (s.start + s.len - 1) as u32).collect();
            let last = Tensor::new(last.as_slice(), self.device())?;
            let x = x.index_select(&last, 1)?; // (1, sequences, C)
            let out = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
            for (i, row) in which.into_iter().zip(out.squeeze(0)?.to_vec2::<f32>()?) {
                logits[i] = row;
            }
        }
        Ok(logits)
    }
}
