//! DeepSeek's multi-head latent attention (MLA).
//!
//! Keys and values are up-projections of a shared latent `c_kv` (width kv_lora_rank), plus a
//! small RoPE key `k_pe` shared by all heads. The cache holds only `c_kv` and `k_pe`. With one
//! new token the up-projection is folded into the query and the output ("absorbed"):
//! `q_lat = q_nope · W_UK`, `scores = q_lat · Cᵀ + q_pe · K_peᵀ`, `o = (p · C) · W_UV`, so the
//! per-head K and V are never built: all heads attend over the cached rows `[c_kv | k_pe]`
//! as over one K/V head (the fused decode op of `sdpa`). A prompt takes the expanded form:
//! up-project C into per-head K and V and run ordinary attention. The two are tested equal.
//!
//! `kv_b_proj` is split at load into its key rows W_UK and value rows W_UV, and only the
//! halves are kept: both forms use them (two products up-project, where the checkpoint's
//! matrix made one), so the layer holds each weight once. Where it makes them no larger
//! (MLA converted from GQA), the halves are instead folded into `q_proj` and `o_proj`
//! ([`UpProj::Folded`]) and every span takes the absorbed form.

use super::{join, sdpa, sdpa_spans, Span};

mod forms;
use crate::config::{AttentionConfig, MlaConfig, ModelConfig};
use crate::kv_cache::{LayerCache, LayerView};
use crate::model::linear::quantize_all;
use crate::model::linear::Quantizer;
use crate::model::linear::{linear_b, linear_no_bias, Linear};
use crate::model::norm::RmsNorm;
use crate::model::rope::Rotation;
use crate::model::{activation_dtype, rms_norm};
use candle_core::{DType, Error, Module, Result, Tensor, D};
use candle_nn::VarBuilder;

/// The eps of the latent norms (`q_a_layernorm`, `kv_a_layernorm`).
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// How the query is produced: directly, or through a low-rank bottleneck (q-LoRA).
#[derive(Debug, Clone)]
enum QueryProj {
    Direct {
        q_proj: Linear,
    },
    LowRank {
        q_a_proj: Linear,
        q_a_layernorm: RmsNorm,
        q_b_proj: Linear,
    },
}

/// Which form of attention to run over the latent cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaForm {
    /// Up-project the cached latents into per-head K and V.
    Expanded,
    /// Fold `kv_b_proj` into the query and the output; attend over the latents directly.
    Absorbed,
}

/// Where `kv_b_proj` went at load.
#[derive(Debug, Clone)]
enum UpProj {
    /// Split per head, multiplied at every step: the absorbed form's `q_nope · W_UK` and
    /// `o_lat · W_UVᵀ`, the expanded form's up-projections.
    PerHead {
        /// kv_b_proj's key rows per head, (H, qk_nope_head_dim, kv_lora_rank), contiguous:
        /// on CPU as stored when bf16 (our kernels read bf16 as it is), else in the
        /// activations' dtype.
        w_uk: Tensor,
        /// kv_b_proj's value rows per head, (H, v_head_dim, kv_lora_rank), contiguous.
        w_uv: Tensor,
    },
    /// Folded into the weights around it (when that makes them no larger: kv_lora_rank at
    /// most qk_nope_head_dim and v_head_dim, as in MLA converted from GQA): `q_proj` yields
    /// each head's `[q_nope · W_UK, q_pe]` (H·(r + rope) rows) and `o_proj` reads each
    /// head's latent output (H·r columns), so a step has no per-head products at all and
    /// prompts take the absorbed form too. The up-projected K/V can no longer be built.
    Folded,
}

#[derive(Debug, Clone)]
pub struct MlaAttention {
    /// With [`UpProj::Folded`], `q_proj` of H·(r + rope) rows.
    query: QueryProj,
    kv_a_proj_with_mqa: Linear,
    /// `None` when the config says `latent_norm: false` (a converted GQA checkpoint's).
    kv_a_layernorm: Option<RmsNorm>,
    up: UpProj,
    /// With [`UpProj::Folded`], H·r columns.
    o_proj: Linear,
    num_heads: usize,
    cfg: MlaConfig,
}

impl MlaAttention {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let AttentionConfig::Mla(m) = &cfg.attention else {
            return Err(Error::Msg("MlaAttention needs an MLA config".into()));
        };
        let (h, hidden) = (cfg.num_attention_heads, cfg.hidden_size);
        // transformers builds q_a_layernorm and kv_a_layernorm with RMSNorm's default eps,
        // not the config's rms_norm_eps (DeepSeek's own configs say 1e-6 for both).
        let eps = LATENT_NORM_EPS;
        let qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim;
        let query = match m.q_lora_rank {
            0 => QueryProj::Direct {
                q_proj: linear_no_bias(hidden, h * qk_head_dim, vb.pp("q_proj"))?,
            },
            r => QueryProj::LowRank {
                q_a_proj: linear_b(hidden, r, m.bias, vb.pp("q_a_proj"))?,
                q_a_layernorm: rms_norm(r, eps, vb.pp("q_a_layernorm"))?,
                q_b_proj: linear_no_bias(r, h * qk_head_dim, vb.pp("q_b_proj"))?,
            },
        };
        let (r, nope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
        // Split kv_b_proj at load (rows of head i are [W_UK_i; W_UV_i]) and drop it.
        let kv_b_proj = linear_no_bias(r, h * (nope + v), vb.pp("kv_b_proj"))?;
        let w = kv_b_proj
            .weight()
            .ok_or_else(|| Error::Msg("kv_b_proj is quantized".into()))?;
        // Kept bf16 on CPU, where a decode step's per-head products (`forms::per_head`) read
        // all of it: as f32 it was twice the bytes, 26 MB a token for `mla:192,rope=64` on
        // SmolLM2. Elsewhere in the activations' dtype.
        let w = w.reshape((h, nope + v, r))?;
        let w = match w.device().is_cpu() && w.dtype() == DType::BF16 {
            true => w,
            false => w.to_dtype(activation_dtype(w.dtype(), w.device()))?,
        };
        let w_uk = w.narrow(1, 0, nope)?.contiguous()?; // (H, nope, r)
        let w_uv = w.narrow(1, nope, v)?.contiguous()?; // (H, v, r)
        let o_proj = linear_b(h * m.v_head_dim, hidden, m.bias, vb.pp("o_proj"))?;
        let (query, up, o_proj) = match (query, r <= nope && r <= v) {
            (QueryProj::Direct { q_proj }, true) if q_proj.weight().is_some() => {
                let (q_proj, o_proj) = forms::fold(m, h, (&q_proj, &o_proj), (&w_uk, &w_uv))?;
                (QueryProj::Direct { q_proj }, UpProj::Folded, o_proj)
            }
            (query, _) => (query, UpProj::PerHead { w_uk, w_uv }, o_proj),
        };
        Ok(Self {
            query,
            kv_a_proj_with_mqa: linear_b(
                hidden,
                r + m.qk_rope_head_dim,
                m.bias,
                vb.pp("kv_a_proj_with_mqa"),
            )?,
            kv_a_layernorm: match m.latent_norm {
                true => Some(rms_norm(r, eps, vb.pp("kv_a_layernorm"))?),
                false => None,
            },
            up,
            o_proj,
            num_heads: h,
            cfg: m.clone(),
        })
    }

    /// Quantizes the projections; the per-head up-projections W_UK and W_UV, where they are
    /// kept, stay as they are. Returns the bytes saved.
    pub fn quantize(&mut self, q: &dyn Quantizer) -> Result<usize> {
        let mut linears = vec![&mut self.kv_a_proj_with_mqa, &mut self.o_proj];
        match &mut self.query {
            QueryProj::Direct { q_proj } => linears.push(q_proj),
            QueryProj::LowRank {
                q_a_proj, q_b_proj, ..
            } => linears.extend([q_a_proj, q_b_proj]),
        }
        quantize_all(&mut linears, q)
    }

    /// x: (1, N, C), the packed tokens of `spans` (see [`Span`]). A span of one new token
    /// takes the absorbed form, a prompt chunk the expanded one (the absorbed one too with
    /// `kv_b_proj` folded). With a [`LayerCache::Kv`] (see [`crate::KvCache::expanded`]) the
    /// up-projected K/V are cached.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &Rotation,
        spans: &[Span],
        caches: &[LayerView],
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let m = &self.cfg;
        let (h, r, nope, rope_dim) = (
            self.num_heads,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
        );
        // 1. Query: (1, H, N, nope + rope), split into its two parts (folded: the first part
        //    is already the latent query, r wide)
        let (nope, out) = match self.up {
            UpProj::Folded => (r, r),
            UpProj::PerHead { .. } => (nope, m.v_head_dim),
        };
        let q = match &self.query {
            QueryProj::Direct { q_proj } => q_proj.forward(x)?,
            QueryProj::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => q_b_proj.forward(&q_a_layernorm.forward(&q_a_proj.forward(x)?)?)?,
        };
        let q = q.reshape((b, n, h, nope + rope_dim))?.transpose(1, 2)?;
        let q_nope = q.narrow(D::Minus1, 0, nope)?;
        // (1, H, N, rope)
        let q_pe = self.rotate(rope, &q.narrow(D::Minus1, nope, rope_dim)?)?;
        // 2. Latent and shared RoPE key: (1, 1, N, r) and (1, 1, N, rope)
        let kv = self.kv_a_proj_with_mqa.forward(x)?;
        let c_kv = kv.narrow(D::Minus1, 0, r)?;
        let c_kv = match &self.kv_a_layernorm {
            Some(norm) => norm.forward(&c_kv)?,
            None => c_kv,
        };
        let c_kv = c_kv.unsqueeze(1)?;
        let k_pe = self.rotate(rope, &kv.narrow(D::Minus1, r, rope_dim)?.unsqueeze(1)?)?;
        // 3-4. Folded, over the latent cache on CPU: every span absorbed, the single new
        //      tokens of a batched step in one loop (`sdpa_spans`)
        let latent = caches
            .iter()
            .all(|c| matches!(c.layer(), LayerCache::Latent { .. }));
        if matches!(self.up, UpProj::Folded) && latent && x.device().is_cpu() {
            let at: Vec<_> = spans.iter().map(|s| (s.start, s.len, s.pos)).collect();
            let helds = LayerView::write_held_all(caches, &c_kv, &k_pe, &at)?;
            let q = forms::cat_last(&[&q_nope, &q_pe.to_dtype(q_nope.dtype())?])?;
            let y = sdpa_spans(&q, &helds, spans, m.softmax_scale)?; // (1, N, H·r)
            return self.o_proj.forward(&y.to_dtype(x.dtype())?);
        }
        // 3-4. Otherwise per sequence: cache, then attend: (1, H, len, v_head_dim)
        let ys = spans
            .iter()
            .zip(caches)
            .map(|(span, cache)| {
                let (q_nope, q_pe) = (span.rows(&q_nope, 2)?, span.rows(&q_pe, 2)?);
                let (c_kv, k_pe) = (span.rows(&c_kv, 2)?, span.rows(&k_pe, 2)?);
                let form = match (span.len, &self.up) {
                    (1, _) | (_, UpProj::Folded) => MlaForm::Absorbed,
                    _ => MlaForm::Expanded,
                };
                let y = self.attend_span((&q_nope, &q_pe), (&c_kv, &k_pe), span, cache, form)?;
                y.transpose(1, 2)?.reshape((b, span.len, h * out))
            })
            .collect::<Result<Vec<_>>>()?;
        // 5. Heads merged, output projection over every token
        self.o_proj.forward(&join(ys)?)
    }

    /// RoPE on x (B, H, N, qk_rope_head_dim): as one head, or as `rope_groups` heads each.
    fn rotate(&self, rope: &Rotation, x: &Tensor) -> Result<Tensor> {
        let k = self.cfg.rope_groups;
        if k == 1 {
            return rope.apply(x);
        }
        let (b, h, n, w) = x.dims4()?;
        let x = x.reshape((b, h, n, k, w / k))?.transpose(2, 3)?; // (B, H, k, N, w/k)
        let x = rope.apply(&x.reshape((b, h * k, n, w / k))?)?;
        x.reshape((b, h, k, n, w / k))?
            .transpose(2, 3)?
            .reshape((b, h, n, w))
    }

    /// One sequence's attention in the given form: writes its latent and RoPE key into
    /// `cache` at `span.pos` and returns (1, H, len, v_head_dim).
    fn attend_span(
        &self,
        (q_nope, q_pe): (&Tensor, &Tensor),
        (c_kv, k_pe): (&Tensor, &Tensor),
        span: &Span,
        cache: &LayerView,
        form: MlaForm,
    ) -> Result<Tensor> {
        let (m, mask, pos) = (&self.cfg, span.mask.as_ref(), span.pos);
        let q_full = || forms::cat_last(&[q_nope, q_pe]);
        match (cache.layer(), form) {
            // The latent cache: only rows [c_kv | k_pe] are stored; read back all S positions.
            (LayerCache::Latent { .. }, MlaForm::Absorbed) => {
                let rows = cache.write_held(c_kv, k_pe, pos)?; // (1, 1, S, r + rope)
                self.absorbed(q_nope, q_pe, &rows, mask)
            }
            (LayerCache::Latent { .. }, MlaForm::Expanded) => {
                let (c_kv, k_pe) = cache.write(c_kv, k_pe, pos)?;
                let (k, v) = self.up_project(&c_kv.contiguous()?, &k_pe)?;
                sdpa(&q_full()?, &k, &v, m.softmax_scale, mask)
            }
            // For comparison only: cache the up-projected per-head K and V, as MHA would.
            (LayerCache::Kv { .. }, _) => {
                let (k, v) = self.up_project(c_kv, k_pe)?;
                let (k, v) = cache.write(&k, &v, pos)?; // (1, H, S, nope + rope), (1, H, S, v)
                sdpa(&q_full()?, &k, &v, m.softmax_scale, mask)
            }
        }
    }
}
