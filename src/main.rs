//! The `tiny-decoder` command line: generate, eval, info, bench. Errors end here as one line
//! on stderr and a non-zero exit.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};
use tiny_decoder::loader::{self, bundled, Loaded};
use tiny_decoder::sampling::{Sampler, SamplingParams};
use tiny_decoder::{bench, eval, generate, ModelConfig};

#[derive(Parser)]
#[command(
    name = "tiny-decoder",
    version,
    about = "A small, readable decoder-only transformer engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streams to stdout, statistics to stderr).
    Generate(GenerateArgs),
    /// Mean negative log-likelihood and perplexity of a text file.
    Eval {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Describe a model: family, attention variant, sizes, KV bytes per token.
    Info {
        #[command(flatten)]
        model: ModelArgs,
        #[arg(long)]
        json: bool,
    },
    /// Time prefill and decode on synthetic ids (a checkpoint, or random weights from a config).
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    model: Option<String>,
    /// A config.json: random weights, no checkpoint needed.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value_t = 32)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// MLA models: cache `latent` (default) or the up-projected per-head K/V (`expanded`).
    #[arg(long, default_value = "latent", value_parser = ["latent", "expanded"])]
    mla_cache: String,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ModelArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model name (tiny-gqa, ...).
    #[arg(long)]
    model: String,
    /// f32 (default on CPU), f16 or bf16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// cpu, or cuda in a build with `--features cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Args)]
struct GenerateArgs {
    /// A local directory, a Hugging Face repo id, or a bundled model: tiny-mha, tiny-gqa
    /// (the default), tiny-mqa, tiny-mla.
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 256)]
    max_new_tokens: usize,
    /// 0 is greedy decoding.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    #[arg(long, default_value = "f32")]
    dtype: String,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    json: bool,
}

/// `--dtype` and `--device`.
fn parse_placement(dtype: &str, device: &str) -> Result<(DType, Device)> {
    Ok((loader::parse_dtype(dtype)?, loader::parse_device(device)?))
}

/// A directory, a hub id, or the name of a bundled model (`tiny-gqa`, ...).
fn load(model: &str, dtype: &str, device: &str) -> Result<Loaded> {
    let (dtype, device) = parse_placement(dtype, device)?;
    if let (false, Some(b)) = (Path::new(model).exists(), bundled::find(model)) {
        return Ok(loader::load_bundled(b, dtype, &device)?);
    }
    let files = loader::resolve(model)?;
    Ok(loader::load(&files, dtype, &device)?)
}

fn tokenizer<'a>(loaded: &'a Loaded, model: &str) -> Result<&'a tokenizers::Tokenizer> {
    loaded
        .tokenizer
        .as_ref()
        .with_context(|| format!("{model}: missing tokenizer.json"))
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    let params = SamplingParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        seed: a.seed,
    };
    let mut sampler = Sampler::new(&params)?;
    let model_name = a.model.as_deref().unwrap_or(bundled::DEFAULT);
    let loaded = load(model_name, &a.dtype, &a.device)?;
    let tok = tokenizer(&loaded, model_name)?;
    let prompt = tok
        .encode(a.prompt.as_str(), true)
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let mut stdout = std::io::stdout().lock();
    let json_mode = a.json;
    let g = generate::generate(
        &loaded.model,
        tok,
        prompt.get_ids(),
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
    )?;
    if json_mode {
        let out = json!({
            "prompt_token_ids": g.prompt_token_ids,
            "token_ids": g.token_ids,
            "text": g.text,
            "stop_reason": g.stop_reason.as_str(),
            "context_full": g.stop_reason == generate::StopReason::Context,
            "prefill_tokens_per_s": g.prefill_tokens_per_s(),
            "decode_tokens_per_s": g.decode_tokens_per_s(),
            "kv_cache_bytes": g.kv_cache_bytes,
            "kv_bytes_per_token": g.kv_bytes_per_token,
        });
        let _ = writeln!(stdout, "{out}");
    } else {
        let _ = writeln!(stdout);
        let stop = match g.stop_reason {
            generate::StopReason::Eos => "end-of-sequence token".to_string(),
            generate::StopReason::Length => format!("--max-new-tokens {}", a.max_new_tokens),
            generate::StopReason::Context => "end of the context".to_string(),
        };
        eprintln!(
            "prompt: {} tokens, {:.1} tok/s | generated: {} tokens, {:.1} tok/s | stopped at: {stop} | KV cache: {} bytes ({} per token)",
            g.prompt_token_ids.len(),
            g.prefill_tokens_per_s(),
            g.token_ids.len(),
            g.decode_tokens_per_s(),
            g.kv_cache_bytes,
            g.kv_bytes_per_token
        );
    }
    Ok(())
}

fn run_eval(m: ModelArgs, file: PathBuf, json_mode: bool) -> Result<()> {
    let bytes = std::fs::read(&file).with_context(|| format!("{}: cannot read", file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", file.display()))?;
    if text.trim().is_empty() {
        bail!("{}: the file is empty", file.display());
    }
    let loaded = load(&m.model, &m.dtype, &m.device)?;
    let tok = tokenizer(&loaded, &m.model)?;
    let ids = tok
        .encode(text.as_str(), true)
        .map_err(|e| anyhow::anyhow!("tokenizer: {e}"))?;
    let nll = eval::evaluate(&loaded.model, ids.get_ids())?;
    if json_mode {
        println!(
            "{}",
            json!({"tokens": nll.tokens, "mean_nll": nll.mean(), "perplexity": nll.perplexity()})
        );
    } else {
        println!(
            "tokens: {}  mean NLL: {:.6} nats  perplexity: {:.4}",
            nll.tokens,
            nll.mean(),
            nll.perplexity()
        );
    }
    Ok(())
}

fn run_info(m: ModelArgs, json_mode: bool) -> Result<()> {
    let loaded = load(&m.model, &m.dtype, &m.device)?;
    let cfg = loaded.model.config();
    let size = loaded.model.dtype().size_in_bytes();
    let kv_heads = match &cfg.attention {
        tiny_decoder::config::AttentionConfig::Gqa { num_kv_heads, .. } => *num_kv_heads,
        tiny_decoder::config::AttentionConfig::Mla(_) => 1,
    };
    let info = json!({
        "model_type": cfg.family.model_type(),
        "attention": cfg.attention_kind(),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": kv_heads,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_parameters": loaded.num_parameters,
        "dtype": format!("{:?}", loaded.model.dtype()).to_lowercase(),
        "kv_bytes_per_token": cfg.kv_bytes_per_token(size),
        "mha_kv_bytes_per_token": cfg.num_hidden_layers * cfg.mha_values_per_token_per_layer() * size,
    });
    if json_mode {
        println!("{info}");
    } else if let Some(map) = info.as_object() {
        for (k, v) in map {
            println!("{k:>26}: {v}");
        }
    }
    Ok(())
}

fn run_bench(b: BenchArgs) -> Result<()> {
    let loaded = match (&b.model, &b.config) {
        (Some(m), _) => load(m, &b.dtype, &b.device)?,
        (None, Some(c)) => {
            let (dtype, device) = parse_placement(&b.dtype, &b.device)?;
            loader::random(&ModelConfig::from_file(c)?, dtype, &device)?
        }
        (None, None) => bail!("bench needs --model or --config"),
    };
    let expanded = b.mla_cache == "expanded";
    let r = bench::run(
        &loaded.model,
        loaded.weight_bytes,
        b.prompt_tokens,
        b.new_tokens,
        expanded,
    )?;
    let mut out = serde_json::to_value(&r)?;
    out["peak_rss_bytes"] = json!(bench::peak_rss_bytes());
    out["num_parameters"] = json!(loaded.num_parameters);
    out["attention"] = json!(loaded.model.config().attention_kind());
    if b.json {
        println!("{out}");
    } else {
        println!(
            "prefill {:.1} tok/s | decode {:.1} tok/s | {:.1} GB/s read | weights {} MB | KV {} bytes | peak RSS {} MB",
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            r.decode_read_gb_per_s,
            r.weight_bytes / 1_000_000,
            r.kv_cache_bytes,
            bench::peak_rss_bytes().unwrap_or(0) / 1_000_000
        );
    }
    Ok(())
}

fn run() -> Result<()> {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version
        Err(e) => {
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("invalid arguments");
            eprintln!("{first} (try --help)");
            std::process::exit(2);
        }
    };
    match cli.command {
        Command::Generate(a) => run_generate(a),
        Command::Eval { model, file, json } => run_eval(model, file, json),
        Command::Info { model, json } => run_info(model, json),
        Command::Bench(b) => run_bench(b),
    }
}

/// candle asks for its thread count on every matmul and, unless `RAYON_NUM_THREADS` is set,
/// works it out again by parsing /proc/cpuinfo: about 60 times per decode step here, 10% of
/// decode time on a 135M model. Count once, before any thread exists, and pin the answer.
fn pin_thread_count() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = candle_core::utils::get_num_threads();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

fn main() {
    pin_thread_count();
    std::panic::set_hook(Box::new(|info| {
        eprintln!(
            "error: internal error: {}",
            info.to_string().replace('\n', " ")
        );
    }));
    if let Err(e) = run() {
        eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
        std::process::exit(1);
    }
}
