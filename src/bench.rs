//! `bench`: prefill and decode speed on synthetic token ids, with the bytes each decode step
//! reads and the effective memory bandwidth that implies. No tokenizer needed.

use crate::error::{Error, Result};
use crate::kv_cache::KvCache;
use crate::model::{Feed, Transformer};
use crate::sampling::argmax;
use std::time::Instant;

#[derive(Debug, Clone, serde::Serialize)]
pub struct BenchResult {
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Sequences run together: each step feeds one token of each.
    pub batch: usize,
    /// Prompt tokens of all sequences per second of their one batched prefill.
    pub prefill_tokens_per_s: f64,
    /// Tokens generated per second, all sequences together.
    pub decode_tokens_per_s: f64,
    /// Tokens per second each sequence sees (`decode_tokens_per_s / batch`).
    pub decode_tokens_per_s_per_sequence: f64,
    /// Bytes all the caches hold at the end.
    pub kv_cache_bytes: usize,
    pub kv_bytes_per_token: usize,
    pub weight_bytes: usize,
    /// (weight bytes read per step + mean KV bytes read per step, every sequence's) × steps
    /// per second, in GB/s. A step reads every weight but the embedding table's other rows
    /// (unless the LM head is that table), once for the whole batch.
    pub decode_read_gb_per_s: f64,
}

/// Times one prefill of `prompt_tokens` synthetic ids in each of `batch` sequences, then
/// `new_tokens` greedy decode steps of all of them together. `expanded_mla` caches MLA's
/// up-projected K/V instead of the latent (for comparison).
pub fn run(
    model: &Transformer,
    weight_bytes: usize,
    prompt_tokens: usize,
    new_tokens: usize,
    batch: usize,
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
    if batch == 0 {
        return Err(Error::Invalid("--batch must be at least 1".into()));
    }
    let (dtype, dev) = (model.cache_dtype(), model.device());
    let mut caches = (0..batch)
        .map(|_| match expanded_mla {
            true => KvCache::expanded(cfg, capacity, dtype, dev),
            false => KvCache::new(cfg, capacity, dtype, dev),
        })
        .collect::<Result<Vec<_>>>()?;
    // Deterministic ids spread over the vocabulary, different in each sequence.
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..prompt_tokens)
                .map(|i| ((i * 7919 + b * 104_729 + 13) % cfg.vocab_size) as u32)
                .collect()
        })
        .collect();
    let feeds = |ids: &[Vec<u32>], caches: &mut [KvCache]| -> Result<Vec<Vec<f32>>> {
        let mut feeds: Vec<Feed> = (ids.iter().zip(caches))
            .map(|(ids, cache)| Feed { ids, cache })
            .collect();
        model.next_logits_batch(&mut feeds)
    };
    let start = Instant::now();
    let mut logits = feeds(&prompts, &mut caches)?;
    let prefill = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for _ in 0..new_tokens {
        let next: Vec<Vec<u32>> = logits.iter().map(|l| vec![argmax(l)]).collect();
        logits = feeds(&next, &mut caches)?;
    }
    let decode = start.elapsed().as_secs_f64();
    let steps_per_s = new_tokens as f64 / decode.max(1e-9);
    let per_token = caches[0].bytes_per_token();
    // Step i reads each cache up to prompt + i + 1 positions.
    let mean_kv_read =
        (batch * per_token) as f64 * (prompt_tokens as f64 + (new_tokens as f64 + 1.0) / 2.0);
    Ok(BenchResult {
        prompt_tokens,
        new_tokens,
        batch,
        prefill_tokens_per_s: (batch * prompt_tokens) as f64 / prefill.max(1e-9),
        decode_tokens_per_s: steps_per_s * batch as f64,
        decode_tokens_per_s_per_sequence: steps_per_s,
        kv_cache_bytes: caches.iter().map(KvCache::bytes_in_use).sum(),
        kv_bytes_per_token: per_token,
        weight_bytes,
        decode_read_gb_per_s: ((weight_bytes - model.embedding_bytes_unread()) as f64
            + mean_kv_read)
            * steps_per_s
            / 1e9,
    })
}

/// The buffer [`machine_read_gb_per_s`] reads: 256 MiB (8× a large L3). The caller may
/// place it as it places the weights (the CLI: in huge pages) before the read.
pub fn read_probe_buffer() -> Vec<u64> {
    vec![1u64; (256 << 20) / 8]
}

/// This machine's memory read bandwidth in GB/s, as decode can use it: every thread of the
/// pool sums its share of `data` ([`read_probe_buffer`]), best of 3 passes. Beside
/// `decode_read_gb_per_s` it says how close decode comes to the hardware.
pub fn machine_read_gb_per_s(data: &[u64]) -> f64 {
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
