//! `generate`: load, encode, stream or collect, report. Ctrl-C stops generation cleanly:
//! what was generated is printed (`stop_reason: "interrupted"` with `--json`) with the
//! statistics, and the process exits 130; a second Ctrl-C kills it at once.

use super::args::GenerateArgs;
use super::{chat_template, load, tokenizer};
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::io::{Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use tiny_decoder::chat::{self, Message};
use tiny_decoder::generate::{self, Generation, Options, StopReason};
use tiny_decoder::loader::{bundled, GenerationConfig, Loaded, TextTokenizer};
use tiny_decoder::sampling::{Sampler, SamplingParams};

/// Set by the first Ctrl-C; generation stops at its next step.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The exit status after an interrupt, as a shell reports a SIGINT death (128 + 2).
pub const EXIT_INTERRUPTED: i32 = 130;

/// Turns Ctrl-C into a stop request; a second one exits at once.
pub fn catch_interrupt() {
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
    let requested = a.sampling.requested();
    // The flags' own errors before a long load (the defaults filled in are valid).
    Sampler::new(&requested.resolve(&GenerationConfig::default()))?;
    check_stops(&a.stop)?;
    let text = prompt_text(&a)?;
    // Before loading, so a Ctrl-C during a long load stops as cleanly as one mid-stream.
    catch_interrupt();
    let model_name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    let loaded = load(model_name, &a.placement)?;
    let tok = tokenizer(&loaded, model_name)?;
    let (prompt, applied) = prompt_ids(&loaded, tok, model_name, &a, text)?;
    let params = requested.resolve(&loaded.generation);
    let mut sampler = Sampler::new(&params)?;
    if loaded.model.config().eos_token_ids.is_empty() {
        eprintln!(
            "note: {model_name} names no end-of-sequence token (generation_config.json, \
             config.json or tokenizer_config.json): generating until --max-new-tokens"
        );
    }
    let mut stdout = std::io::stdout().lock();
    let json_mode = a.json;
    let mut cache = generate::cache_for(&loaded.model, prompt.len(), a.max_new_tokens)?;
    let opts = Options {
        max_new_tokens: a.max_new_tokens,
        stop: &a.stop,
        interrupt: Some(&INTERRUPTED),
    };
    let g = generate::generate_in(
        &loaded.model,
        tok.inner(),
        &mut cache,
        &prompt,
        opts,
        &mut sampler,
        |text| {
            if !json_mode {
                // A closed pipe (`| head`) ends the output, not the program with a panic.
                let _ = stdout
                    .write_all(text.as_bytes())
                    .and_then(|_| stdout.flush());
            }
        },
    )?;
    let dtype = loaded.dtype_label();
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
            "seed": params.seed,
            "chat_template_applied": applied,
            "sampling": sampling_json(&params),
        });
        let _ = writeln!(stdout, "{out}");
    } else {
        let _ = writeln!(stdout);
        eprintln!("{}", statistics(&g, a.max_new_tokens, dtype, peak));
        eprintln!("{}", sampling_line(&params, applied));
    }
    Ok(match g.stop_reason {
        StopReason::Interrupted => EXIT_INTERRUPTED,
        _ => 0,
    })
}

/// An empty stop string would end every generation before its first token.
pub fn check_stops(stops: &[String]) -> Result<()> {
    if stops.iter().any(|s| s.is_empty()) {
        bail!("--stop: a stop string must not be empty");
    }
    Ok(())
}

/// `--prompt TEXT`, `--prompt -` (stdin) or `--prompt-file FILE`; `None` with `--messages`.
fn prompt_text(a: &GenerateArgs) -> Result<Option<String>> {
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) if p == "-" => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("--prompt -: cannot read stdin as UTF-8 text")?;
            text
        }
        (Some(p), _) => p.clone(),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("{}: cannot read as UTF-8 text", file.display()))?,
        (None, None) => return Ok(None),
    };
    if text.is_empty() {
        bail!("the prompt is empty");
    }
    Ok(Some(text))
}

/// The prompt's ids, and whether the model's chat template made them: the template when the
/// model has one (unless `--raw`), the plain text otherwise.
fn prompt_ids(
    loaded: &Loaded,
    tok: &TextTokenizer,
    model: &str,
    a: &GenerateArgs,
    text: Option<String>,
) -> Result<(Vec<u32>, bool)> {
    let template = match a.raw {
        true => None,
        false => chat_template(loaded)?,
    };
    let Some(template) = template else {
        if a.messages.is_some() || a.system.is_some() {
            bail!(
                "{model} has no chat template (chat_template.jinja or tokenizer_config.json): \
                 --messages and --system need one"
            );
        }
        return Ok((tok.encode(text.as_deref().unwrap_or_default())?, false));
    };
    let messages = match (&a.messages, text) {
        (Some(file), _) => chat::read_messages(file)?,
        (None, text) => {
            let message = |role: &str, content: &str| Message {
                role: role.into(),
                content: content.into(),
            };
            let system = a.system.iter().map(|s| message("system", s));
            let user = message("user", text.as_deref().unwrap_or_default());
            system.chain([user]).collect()
        }
    };
    let rendered = template.render(&messages, true)?;
    Ok((tok.encode_plain(&rendered)?, true))
}

/// The sampling parameters in `--json`.
pub fn sampling_json(p: &SamplingParams) -> serde_json::Value {
    json!({"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p,
           "min_p": p.min_p, "repeat_penalty": p.repeat_penalty})
}

/// The stderr line that says how tokens were picked, with the seed to repeat the run.
pub fn sampling_line(p: &SamplingParams, applied: bool) -> String {
    let how = match p.temperature {
        0.0 => "greedy".to_string(),
        t => format!(
            "temperature {t}, top-k {}, top-p {}, min-p {}",
            p.top_k, p.top_p, p.min_p
        ),
    };
    let template = match applied {
        true => "chat template applied",
        false => "raw prompt",
    };
    format!(
        "sampling: {how}, repeat penalty {} | seed {} (--seed {} repeats this run) | {template}",
        p.repeat_penalty, p.seed, p.seed
    )
}

/// The stderr line after a streamed generation.
fn statistics(g: &Generation, max_new_tokens: usize, dtype: &str, peak: Option<usize>) -> String {
    let stop = match g.stop_reason {
        StopReason::Eos => "end-of-sequence token".to_string(),
        StopReason::Length => format!("--max-new-tokens {max_new_tokens}"),
        StopReason::Context => "end of the context".to_string(),
        StopReason::Interrupted => "interrupted (Ctrl-C)".to_string(),
        StopReason::Stop => "a stop string".to_string(),
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
