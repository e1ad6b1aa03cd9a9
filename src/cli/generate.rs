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
use tiny_decoder::config::GenerationConfig;
use tiny_decoder::generate::{self, Generation, Options, StopReason};
use tiny_decoder::grammar::{Grammars, Spec};
use tiny_decoder::loader::{bundled, Loaded, TextTokenizer};
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

/// `--json-schema` or `--grammar`, read and parsed before the model loads, with the flag
/// and file its errors name.
fn grammar_spec(a: &GenerateArgs) -> Result<Option<(Spec, String)>> {
    if let Some(path) = &a.json_schema {
        let label = format!("--json-schema {}", path.display());
        let text =
            std::fs::read_to_string(path).with_context(|| format!("{label}: cannot read"))?;
        let schema = serde_json::from_str(&text).with_context(|| format!("{label}: not JSON"))?;
        return Ok(Some((Spec::JsonSchema(schema), label)));
    }
    if let Some(path) = &a.grammar {
        let label = format!("--grammar {}", path.display());
        let text =
            std::fs::read_to_string(path).with_context(|| format!("{label}: cannot read"))?;
        return Ok(Some((Spec::Lark(text), label)));
    }
    Ok(None)
}

/// Returns the process's exit status: 0, or [`EXIT_INTERRUPTED`]. Several prompts
/// (`--prompt` repeated, or `--prompt-file` with one per line) run as one batch.
pub fn run_generate(a: GenerateArgs) -> Result<i32> {
    let requested = a.sampling.requested();
    // The flags' own errors before a long load (the defaults filled in are valid).
    Sampler::new(&requested.resolve(&GenerationConfig::default()))?;
    check_stops(&a.stop)?;
    let spec = grammar_spec(&a)?;
    let texts = prompt_texts(&a)?;
    // Before loading, so a Ctrl-C during a long load stops as cleanly as one mid-stream.
    catch_interrupt();
    let model_name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    let loaded = load(model_name, &a.placement)?;
    let tok = tokenizer(&loaded, model_name)?;
    let prompts = texts
        .into_iter()
        .map(|text| prompt_ids(&loaded, tok, model_name, &a, text))
        .collect::<Result<Vec<_>>>()?;
    let params = requested.resolve(&loaded.generation);
    if loaded.model.config().eos_token_ids.is_empty() {
        eprintln!(
            "note: {model_name} names no end-of-sequence token (generation_config.json, \
             config.json or tokenizer_config.json): generating until --max-new-tokens"
        );
    }
    let model = &loaded.model;
    let mut caches = prompts
        .iter()
        .map(|(ids, _)| generate::cache_for(model, ids.len(), a.max_new_tokens))
        .collect::<tiny_decoder::Result<Vec<_>>>()?;
    // Each prompt gets the sampler (and seed) it would have alone, so its output is the same.
    let mut samplers = prompts
        .iter()
        .map(|_| Sampler::new(&params))
        .collect::<tiny_decoder::Result<Vec<_>>>()?;
    let opts = Options {
        max_new_tokens: a.max_new_tokens,
        stop: &a.stop,
        interrupt: Some(&INTERRUPTED),
        ignore_eos: false,
        logprobs: None,
    };
    let mut seqs = caches
        .iter_mut()
        .zip(samplers.iter_mut())
        .zip(&prompts)
        .enumerate()
        .map(|(i, ((cache, sampler), (ids, _)))| {
            generate::Sequence::new(model, tok.inner(), cache, ids, opts, sampler)
                .with_context(|| format!("prompt {}", i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    if let Some((spec, label)) = &spec {
        let cfg = model.config();
        let grammars = Grammars::new(tok.inner(), cfg.vocab_size, &cfg.eos_token_ids)
            .with_context(|| label.clone())?;
        for seq in &mut seqs {
            seq.constrain(grammars.compile(spec).with_context(|| label.clone())?);
        }
    }
    let mut stdout = std::io::stdout().lock();
    // One prompt streams its text as it comes; a batch prints each text at the end.
    let stream = !a.json && seqs.len() == 1;
    generate::run(model, &mut seqs, opts.interrupt, |_, text| {
        if stream {
            // A closed pipe (`| head`) ends the output, not the program with a panic.
            let _ = stdout
                .write_all(text.as_bytes())
                .and_then(|_| stdout.flush());
        }
    })?;
    let gens = seqs
        .into_iter()
        .map(|s| s.finish())
        .collect::<tiny_decoder::Result<Vec<Generation>>>()?;
    let dtype = loaded.dtype_label();
    let peak = tiny_decoder::bench::peak_rss_bytes();
    for (i, (g, (_, applied))) in gens.iter().zip(&prompts).enumerate() {
        if a.json {
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
                "batch_size": gens.len(),
            });
            let _ = writeln!(stdout, "{out}");
            continue;
        }
        if !stream {
            let _ = writeln!(stdout, "--- {} of {} ---\n{}", i + 1, gens.len(), g.text);
        } else {
            let _ = writeln!(stdout);
        }
        eprintln!("{}", statistics(g, a.max_new_tokens, dtype, peak));
    }
    if !a.json {
        eprintln!("{}", sampling_line(&params, prompts[0].1));
    }
    let interrupted = gens
        .iter()
        .any(|g| g.stop_reason == StopReason::Interrupted);
    Ok(match interrupted {
        true => EXIT_INTERRUPTED,
        false => 0,
    })
}

/// An empty stop string would end every generation before its first token.
pub fn check_stops(stops: &[String]) -> Result<()> {
    if stops.iter().any(|s| s.is_empty()) {
        bail!("--stop: a stop string must not be empty");
    }
    Ok(())
}

/// The prompts: each `--prompt TEXT` (`-` reads stdin), or each non-empty line of
/// `--prompt-file FILE`; one `None` with `--messages`.
fn prompt_texts(a: &GenerateArgs) -> Result<Vec<Option<String>>> {
    let texts = match (a.prompt.as_slice(), &a.prompt_file) {
        ([], Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("{}: cannot read as UTF-8 text", file.display()))?
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect(),
        ([], None) => return Ok(vec![None]),
        (prompts, _) => prompts
            .iter()
            .map(|p| match p.as_str() {
                "-" => {
                    let mut text = String::new();
                    std::io::stdin()
                        .read_to_string(&mut text)
                        .context("--prompt -: cannot read stdin as UTF-8 text")?;
                    Ok(text)
                }
                _ => Ok(p.clone()),
            })
            .collect::<Result<Vec<_>>>()?,
    };
    if texts.is_empty() || texts.iter().any(String::is_empty) {
        match &a.prompt_file {
            Some(file) if a.prompt.is_empty() => bail!("{}: no prompt in it", file.display()),
            _ => bail!("the prompt is empty"),
        }
    }
    Ok(texts.into_iter().map(Some).collect())
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
