//! `bench`: prefill and decode speed on synthetic token ids, with the bytes each decode step
//! reads and the effective memory bandwidth that implies. No tokenizer needed.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::Transformer;
use crate::sampling::argmax;
use std::time::Instant;

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub kv_cache_bytes: usize,
    pub kv_bytes_per_token: usize,
    pub weight_bytes: usize,
    /// (weight bytes read per step + mean KV bytes read per step) × decode tokens/s, in
    /// GB/s. A step reads every weight but the embedding table's other rows (unless the LM
    /// head is that table).
    pub decode_read_gb_per_s: f64,
}

/// Times one prefill of `prompt_tokens` synthetic ids and `new_tokens` greedy decode steps.
/// `expanded_mla` caches MLA's up-projected K/V instead of the latent (for comparison).
pub fn run(
    model: &Transformer,
    weight_bytes: usize,
    prompt_tokens: usize,
    new_tokens: usize,
    expanded_mla: bool,
) -> Result<BenchResult> {
    let cfg = model.config();
    let capacity = prompt_tokens.saturating_add(new_tokens);
    if prompt_tokens == 0 || capacity > cfg.max_position_embeddings {
        return Err(Error::Invalid(format!(
            "--prompt-tokens ({prompt_tokens}) must be at least 1 and, with --new-tokens \
             ({new_tokens}), fit the context length ({})",
            cfg.max_position_embeddings
        )));
    }
    let (dtype, dev) = (model.dtype(), model.device());
    let mut cache = match expanded_mla {
        true => KvCache::expanded(cfg, capacity, dtype, dev)?,
        false => KvCache::new(cfg, capacity, dtype, dev)?,
    };
    // Deterministic ids spread over the vocabulary.
    let ids: Vec<u32> = (0..prompt_tokens)
        .map(|i| ((i * 7919 + 13) % cfg.vocab_size) as u32)
        .collect();
    let start = Instant::now();
    let mut logits = model.next_logits(&ids, &mut cache)?;
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..new_tokens {
        logits = model.next_logits(&[argmax(&logits)], &mut cache)?;
    }
    let decode = start.elapsed().as_secs_f64();
    let decode_tps = new_tokens as f64 / decode.max(1e-9);
    // Step i reads the cache up to prompt + i + 1 positions.
    let mean_kv_read =
        cache.bytes_per_token() as f64 * (prompt_tokens as f64 + (new_tokens as f64 + 1.0) / 2.0);
    Ok(BenchResult {
        prompt_tokens,
        new_tokens,
        prefill_tokens_per_s: prompt_tokens as f64 / prefill.max(1e-9),
        decode_tokens_per_s: decode_tps,
        kv_cache_bytes: cache.bytes_in_use(),
        kv_bytes_per_token: cache.bytes_per_token(),
        weight_bytes,
        decode_read_gb_per_s: ((weight_bytes - model.embedding_bytes_unread()) as f64
            + mean_kv_read)
            * decode_tps
            / 1e9,
    })
}

/// This machine's memory read bandwidth in GB/s, as decode can use it: every thread of the
/// pool sums its share of a 256 MiB buffer (8× a large L3), best of 3 passes. Beside
/// `decode_read_gb_per_s` it says how close decode comes to the hardware.
pub fn machine_read_gb_per_s() -> f64 {
    let data = vec![1u64; (256 << 20) / 8];
    let pool = crate::model::pool::Pool::global();
    let chunk = data.len().div_ceil(pool.threads());
    let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.threads()).map(|_| 0.into()).collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        pool.run(pool.threads(), &|t| {
            let part = data.chunks(chunk).nth(t).unwrap_or(&[]);
            // Eight lanes, so the adds vectorise and overlap.
            let mut acc = [0u64; 8];
            for c in part.chunks_exact(8) {
                for j in 0..8 {
                    acc[j] = acc[j].wrapping_add(c[j]);
                }
            }
            let sum = acc.iter().fold(0u64, |a, &b| a.wrapping_add(b));
            sums[t].store(sum, std::sync::atomic::Ordering::Relaxed);
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    // The sums are stored, so the reads cannot be optimised away.
    std::hint::black_box(&sums);
    (data.len() * 8) as f64 / best / 1e9
}

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_rss_bytes() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
