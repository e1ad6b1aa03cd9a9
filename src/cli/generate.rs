//! `generate`: load, encode, stream or collect, report. Ctrl-C stops generation cleanly:
//! what was generated is printed (`stop_reason: "interrupted"` with `--json`) with the
//! statistics, and the process exits 130; a second Ctrl-C kills it at once.

use super::args::GenerateArgs;
use super::{load, tokenizer};
use anyhow::Result;
use serde_json::json;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use tiny_decoder::generate::{self, Generation, StopReason};
use tiny_decoder::loader::{bundled, dtype_name};
use tiny_decoder::sampling::{Sampler, SamplingParams};

/// Set by the first Ctrl-C; generation stops at its next step.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The exit status after an interrupt, as a shell reports a SIGINT death (128 + 2).
pub const EXIT_INTERRUPTED: i32 = 130;

/// Turns Ctrl-C into a stop request; a second one exits at once.
fn catch_interrupt() {
    let installed = ctrlc::set_handler(|| {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            std::process::exit(EXIT_INTERRUPTED);
        }
    });
    if let Err(e) = installed {
        eprintln!("warning: Ctrl-C will end the process without output: {e}");
    }
}

/// Returns the process's exit status: 0, or [`EXIT_INTERRUPTED`].
pub fn run_generate(a: GenerateArgs) -> Result<i32> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed: a.seed,
    };
    let mut sampler = Sampler::new(&params)?;
    // Before loading, so a Ctrl-C during a long load stops as cleanly as one mid-stream.
    catch_interrupt();
    let model_name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    let loaded = load(model_name, &a.placement)?;
    let tok = tokenizer(&loaded, model_name)?;
    let prompt = tok.encode(&a.prompt)?;
    if loaded.model.config().eos_token_ids.is_empty() {
        eprintln!(
            "note: {model_name} names no end-of-sequence token (generation_config.json, \
             config.json or tokenizer_config.json): generating until --max-new-tokens"
        );
    }
    let mut stdout = std::io::stdout().lock();
    let json_mode = a.json;
    let g = generate::generate_until(
        &loaded.model,
        tok.inner(),
        &prompt,
        a.max_new_tokens,
        &mut sampler,
        |text| {
            if !json_mode {
                // A closed pipe (`| head`) ends the output, not the program with a panic.
                let _ = stdout
                    .write_all(text.as_bytes())
                    .and_then(|_| stdout.flush());
            }
        },
        &INTERRUPTED,
    )?;
    let dtype = dtype_name(loaded.model.dtype());
    let peak = tiny_decoder::bench::peak_rss_bytes();
    if json_mode {
        let out = json!({
            "prompt_token_ids": g.prompt_token_ids,
            "token_ids": g.token_ids,
            "text": g.text,
            "stop_reason": g.stop_reason.as_str(),
            "context_full": g.stop_reason == StopReason::Context,
            "prefill_tokens_per_s": g.prefill_tokens_per_s(),
            "decode_tokens_per_s": g.decode_tokens_per_s(),
            "kv_cache_bytes": g.kv_cache_bytes,
            "kv_bytes_per_token": g.kv_bytes_per_token,
            "dtype": dtype,
            "peak_rss_bytes": peak,
        });
        let _ = writeln!(stdout, "{out}");
    } else {
        let _ = writeln!(stdout);
        eprintln!("{}", statistics(&g, a.max_new_tokens, dtype, peak));
    }
    Ok(match g.stop_reason {
        StopReason::Interrupted => EXIT_INTERRUPTED,
        _ => 0,
    })
}

/// The stderr line after a streamed generation.
fn statistics(g: &Generation, max_new_tokens: usize, dtype: &str, peak: Option<usize>) -> String {
    let stop = match g.stop_reason {
        StopReason::Eos => "end-of-sequence token".to_string(),
        StopReason::Length => format!("--max-new-tokens {max_new_tokens}"),
        StopReason::Context => "end of the context".to_string(),
        StopReason::Interrupted => "interrupted (Ctrl-C)".to_string(),
    };
    format!(
        "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | stopped at: {stop} | {dtype} | KV cache: {} bytes ({} per token) | peak RSS {} MB",
        g.prompt_token_ids.len(),
        g.prefill_tokens_per_s(),
        g.token_ids.len(),
        g.decode_tokens_per_s(),
        g.kv_cache_bytes,
        g.kv_bytes_per_token,
        peak.unwrap_or(0) / 1_000_000
    )
}
