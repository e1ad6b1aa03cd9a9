//! `eval` over windows through the KV cache: the NLL equals a brute-force full forward per
//! window (transformers' perplexity guide, every token scored once), across prefill-chunk
//! boundaries, and its peak memory does not grow with the length of the file.

mod common;

use candle_core::{DType, Device};
use common::{edit_config, full_logits, run_json, scratch};
use std::path::PathBuf;
use tiny_decoder::eval::{self, Windows};
use tiny_decoder::loader::{self, Loaded};

fn heldout() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/shakespeare-heldout.txt");
    std::fs::read_to_string(path).unwrap()
}

/// The definition, computed the slow way: one full forward per window.
fn brute_force(loaded: &Loaded, ids: &[u32], context: usize, stride: usize) -> (f64, usize) {
    let (mut sum, mut n, mut begin, mut prev_end) = (0f64, 0, 0, 0);
    loop {
        let end = (begin + context).min(ids.len());
        let logits = full_logits(loaded, &ids[begin..end]);
        for j in prev_end.max(begin + 1)..end {
            let row = &logits[j - 1 - begin];
            let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&x| (x as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            sum += lse - row[ids[j] as usize] as f64;
            n += 1;
        }
        if end == ids.len() {
            return (sum / n as f64, n);
        }
        prev_end = end;
        begin += stride;
    }
}

/// A fixture with a 2048-token context, so windows cross the 512-token prefill chunks.
fn long_context_fixture(case: &str) -> PathBuf {
    let dir = scratch("llama-mha-tied", case);
    edit_config(&dir, |v| v["max_position_embeddings"] = 8192.into());
    dir
}

#[test]
fn windows_equal_a_full_forward_per_window() {
    let dir = long_context_fixture("eval-windows");
    let files = loader::resolve(dir.to_str().unwrap()).unwrap();
    let loaded = loader::load(&files, DType::F32, &Device::Cpu).unwrap();
    let ids = loaded
        .tokenizer
        .as_ref()
        .unwrap()
        .encode(&heldout())
        .unwrap();
    let ids = &ids[..2500];
    for (context, stride) in [(1100, 700), (600, 600), (300, 100), (2500, 2499), (64, 63)] {
        let w = Windows { context, stride };
        let got = eval::evaluate_windows(&loaded.model, ids, w, |_, _| {}).unwrap();
        let (want, n) = brute_force(&loaded, ids, context, stride);
        assert_eq!(got.tokens, n, "{w:?}: tokens scored");
        assert!(
            (got.mean() - want).abs() < 1e-5,
            "{w:?}: mean NLL {} vs {want}",
            got.mean()
        );
    }
    // The default scores every token after the first, as one window would when it fits.
    let whole = eval::evaluate(&loaded.model, ids).unwrap();
    assert_eq!(whole.tokens, ids.len() - 1);
    let bad = Windows {
        context: 100,
        stride: 101,
    };
    let err = eval::evaluate_windows(&loaded.model, ids, bad, |_, _| {}).unwrap_err();
    assert!(err.to_string().contains("--stride"), "{err}");
}

/// `eval --json`'s peak RSS on a file of `chars` characters of the held-out text.
fn peak_rss(dir: &std::path::Path, chars: usize, context: usize) -> (u64, u64) {
    let text: String = heldout().chars().cycle().take(chars).collect();
    let file = dir.join(format!("text-{chars}.txt"));
    std::fs::write(&file, text).unwrap();
    let (d, f, c) = (
        dir.to_str().unwrap(),
        file.to_str().unwrap(),
        context.to_string(),
    );
    let v = run_json(&["eval", "-m", d, "--file", f, "--context", &c]);
    (
        v["peak_rss_bytes"].as_u64().unwrap(),
        v["tokens"].as_u64().unwrap(),
    )
}

#[test]
fn eval_memory_does_not_grow_with_the_file() {
    let dir = long_context_fixture("eval-memory");
    // One 4096-token window, then the same window size over ~6x the text.
    let (short, short_tokens) = peak_rss(&dir, 12_000, 4096);
    let (long, long_tokens) = peak_rss(&dir, 80_000, 4096);
    eprintln!("peak RSS {short} B for {short_tokens} tokens, {long} B for {long_tokens} tokens");
    assert!(long_tokens > 5 * short_tokens);
    assert!(
        long < short + (32 << 20),
        "peak RSS grew from {short} to {long} bytes with the file"
    );
    // A whole-window forward would hold 4 heads × 4096² scores per layer (268 MB) at once.
    // A CUDA build loads cuBLAS and the other CUDA libraries at start, even to run on CPU:
    // 367 MB peak for one 4096-token window in such a build (2-core host, no GPU).
    let libraries: u64 = if cfg!(feature = "cuda") { 256 << 20 } else { 0 };
    assert!(long < (200 << 20) + libraries, "peak RSS {long} bytes");
}
