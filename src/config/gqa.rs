//! Llama, Mistral, Qwen2 and Qwen3: grouped-query attention and a dense SwiGLU everywhere.

use super::{
    positive, AttentionConfig, Error, Family, HfConfig, MlpConfig, Result, RopeConfig, MAX_SIZE,
};

/// Llama, Mistral, Qwen2, Qwen3: one GQA attention and a dense SwiGLU in every layer.
pub(super) fn resolve(
    hf: &HfConfig,
    family: Family,
) -> Result<(AttentionConfig, RopeConfig, Vec<MlpConfig>)> {
    let mlp = MlpConfig::Dense {
        intermediate_size: positive("intermediate_size", hf.intermediate_size)?,
        bias: hf.mlp_bias,
    };
    let layers = super::num_layers(hf)?;
    // MLA converted from GQA (`convert --attention mla:R,rope=W`), in DeepSeek's fields.
    if hf.deepseek.kv_lora_rank.is_some() {
        let interleave = hf.deepseek.rope_interleave.unwrap_or(false);
        let (attention, rope) = super::deepseek::attention(hf, interleave)?;
        return Ok((attention, rope, vec![mlp; layers]));
    }
    let heads = positive("num_attention_heads", hf.num_attention_heads)?;
    let num_kv_heads = match hf.num_key_value_heads {
        Some(n) => positive("num_key_value_heads", n)?,
        None => heads,
    };
    if heads % num_kv_heads != 0 {
        return Err(Error::Config(format!(
            "num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )));
    }
    let head_dim = match hf.head_dim {
        Some(d) => positive("head_dim", d)?,
        None => {
            let hidden = positive("hidden_size", hf.hidden_size)?;
            if hidden % heads != 0 {
                return Err(Error::Config(format!(
                    "hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) \
                     and no head_dim is given"
                )));
            }
            hidden / heads
        }
    };
    if head_dim % 2 != 0 {
        let msg = format!("head_dim ({head_dim}) must be even for RoPE");
        return Err(Error::Config(msg));
    }
    if heads * head_dim > MAX_SIZE as usize {
        let msg = format!("num_attention_heads × head_dim ({heads} × {head_dim}) is too large");
        return Err(Error::Config(msg));
    }
    let kv_latent_rank = match hf.kv_latent_rank {
        None => None,
        Some(r) => {
            let (r, full) = (positive("kv_latent_rank", r)?, 2 * num_kv_heads * head_dim);
            if r > full {
                return Err(Error::Config(format!(
                    "kv_latent_rank ({r}) is above the full rank of the keys and values \
                     (2 × {num_kv_heads} K/V heads × head_dim {head_dim} = {full})"
                )));
            }
            Some(r)
        }
    };
    let qwen2 = family == Family::Qwen2;
    let attention = AttentionConfig::Gqa {
        num_kv_heads,
        head_dim,
        qkv_bias: qwen2 || hf.attention_bias,
        o_bias: !qwen2 && hf.attention_bias,
        qk_norm: family == Family::Qwen3,
        kv_latent_rank,
    };
    let rope = super::rope::resolve(hf, head_dim, false)?;
    Ok((attention, rope, vec![mlp; layers]))
}

/// Mistral's window applies to every layer and is honoured by the attention mask. Qwen's
/// `use_sliding_window` mixes windowed and full layers (`max_window_layers`): rejected.
pub(super) fn sliding_window(hf: &HfConfig, family: Family, context: usize) -> Result<usize> {
    let Some(window) = hf.sliding_window else {
        return Ok(context);
    };
    let window = positive("sliding_window", window)?;
    let active = match family {
        Family::Qwen2 | Family::Qwen3 => hf.use_sliding_window,
        _ => true,
    };
    if !active || window >= context {
        return Ok(context);
    }
    if family != Family::Mistral {
        return Err(Error::Config(format!(
            "sliding_window ({window}) smaller than max_position_embeddings ({context}) is only \
             supported for mistral; set use_sliding_window to false or sliding_window to null"
        )));
    }
    Ok(window)
}
