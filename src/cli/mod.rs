//! The commands behind the command line: each loads what it needs, runs the library and
//! prints (JSON with `--json`, text otherwise). anyhow lives here, at the edge, only.

pub mod args;
mod chat;
mod conversion;
mod convert_cmd;
mod generate;
mod huge_pages;
mod serve;

pub use chat::run_chat;
pub use convert_cmd::run_convert;
pub use generate::run_generate;
pub use serve::run_serve;

use anyhow::{bail, Context, Result};
use args::{BenchArgs, EvalArgs, ModelArgs, Placement};
use candle_core::{DType, Device};
use conversion::{add_conversion, conversion_line, conversion_method, load_reported};
use serde_json::json;
use std::io::IsTerminal;
use tiny_decoder::chat::ChatTemplate;
use tiny_decoder::config::AttentionConfig;
use tiny_decoder::eval::{self, Windows};
use tiny_decoder::loader::{self, dtype_label, dtype_name, DTypeArg, Loaded, TextTokenizer};
use tiny_decoder::{bench, convert, kv_cache, ModelConfig};

/// `--dtype` and `--device` (and `--kv-dtype` checked, before anything loads).
fn placement(p: &Placement) -> Result<(DTypeArg, Device)> {
    kv_cache::parse_dtype(&p.kv_dtype)?;
    Ok((DTypeArg::parse(&p.dtype)?, loader::parse_device(&p.device)?))
}

/// A directory, a hub id, or the name of a bundled model (`tiny-gqa`, ...), at `--dtype`,
/// its attention converted by `--attention` (noted on stderr).
fn load(model: &str, p: &Placement) -> Result<Loaded> {
    let (loaded, report) = load_reported(model, p)?;
    huge_pages::in_background();
    if let Some(r) = report {
        eprintln!("{}", conversion_line(&r));
    }
    Ok(loaded)
}

/// A loaded model described as `info` reports it.
fn describe_loaded(loaded: &Loaded) -> loader::Description {
    loader::Description {
        cfg: loaded.model.config().clone(),
        num_parameters: loaded.num_parameters,
        weight_bytes: loaded.weight_bytes(),
        dtype: loaded.model.dtype(),
        quantization: loaded.model.quantization(),
        checkpoint_dtype: loaded.checkpoint_dtype,
    }
}

fn tokenizer<'a>(loaded: &'a Loaded, model: &str) -> Result<&'a TextTokenizer> {
    loaded
        .tokenizer
        .as_ref()
        .with_context(|| format!("{model}: missing tokenizer.json"))
}

/// The model's chat template, with the bos/eos strings it is rendered with; `None` when the
/// checkpoint has none.
fn chat_template(loaded: &Loaded) -> Result<Option<ChatTemplate>> {
    Ok(ChatTemplate::from_meta(&loaded.meta)?)
}

/// The attention fields `info` reports: K/V heads, or MLA's latent widths.
fn attention_fields(cfg: &ModelConfig) -> serde_json::Value {
    match &cfg.attention {
        AttentionConfig::Gqa {
            num_kv_heads,
            head_dim,
            kv_latent_rank,
            ..
        } => {
            let mut v = json!({"num_key_value_heads": num_kv_heads, "head_dim": head_dim});
            if let Some(r) = kv_latent_rank {
                v["kv_latent_rank"] = json!(r);
            }
            v
        }
        AttentionConfig::Mla(m) => json!({
            "kv_lora_rank": m.kv_lora_rank,
            "qk_rope_head_dim": m.qk_rope_head_dim,
        }),
    }
}

/// 1 GB, the KV budget `info` sizes capacity by.
const GB: usize = 1_000_000_000;

pub fn run_info(m: ModelArgs, json_mode: bool) -> Result<()> {
    let (dtype, device) = placement(&m.placement)?;
    // Without --attention, from the config and headers alone; with it, the conversion runs
    // (its time is part of what info reports) and the converted model is described.
    let (d, report) = match &m.placement.attention {
        None => (loader::open(&m.model)?.describe(dtype, &device)?, None),
        Some(_) => {
            let (loaded, report) = load_reported(&m.model, &m.placement)?;
            (describe_loaded(&loaded), report)
        }
    };
    let asked = kv_cache::parse_dtype(&m.placement.kv_dtype)?;
    let kv = kv_cache::choose_dtype(asked, d.dtype, d.quantization, &device)?;
    let (cfg, size) = (&d.cfg, kv.size_in_bytes());
    let mut info = json!({
        "model_type": cfg.family.model_type(),
        "attention": cfg.attention_kind(),
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_parameters": d.num_parameters,
        "weight_bytes": d.weight_bytes,
        "dtype": dtype_label(d.dtype, d.quantization),
        "checkpoint_dtype": d.checkpoint_dtype.map(dtype_name),
        "kv_bytes_per_token": cfg.kv_bytes_per_token(size),
        "kv_dtype": dtype_name(kv),
        "mha_kv_bytes_per_token": cfg.num_hidden_layers * cfg.mha_values_per_token_per_layer() * size,
        // What a user gains from a smaller cache: context, or sequences, in 1 GB of it.
        "kv_tokens_per_gb": cfg.kv_capacity(size, GB, 1).0,
        "kv_sequences_4k_per_gb": cfg.kv_capacity(size, GB, 4096).1,
    });
    if let Some(r) = &report {
        info["attention_spec"] = json!(r.plan.spec.to_string());
        info["conversion_method"] = json!(conversion_method(r));
        info["original_num_key_value_heads"] = json!(r.plan.from_kv_heads);
        info["conversion_secs"] = json!(r.secs);
        info["calibration_tokens"] = json!(r.calibration_tokens);
        info["calibration_text_secs"] = json!(r.text_secs);
        info["calibration_secs"] = json!(r.calibration_secs);
    }
    if let (Some(map), serde_json::Value::Object(more)) =
        (info.as_object_mut(), attention_fields(cfg))
    {
        map.extend(more);
    }
    if json_mode {
        println!("{info}");
    } else if let Some(map) = info.as_object() {
        for (k, v) in map {
            println!("{k:>26}: {v}");
        }
    }
    Ok(())
}

pub fn run_eval(a: EvalArgs) -> Result<()> {
    let file = &a.file;
    let bytes = std::fs::read(file).with_context(|| format!("{}: cannot read", file.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|_| anyhow::anyhow!("{}: not UTF-8 text", file.display()))?;
    if text.trim().is_empty() {
        bail!("{}: the file is empty", file.display());
    }
    let (loaded, report) = load_reported(&a.model.model, &a.model.placement)?;
    huge_pages::in_background();
    let ids = tokenizer(&loaded, &a.model.model)?.encode(&text)?;
    let mut windows = Windows::full(&loaded.model);
    if let Some(context) = a.context {
        windows.context = context;
        windows.stride = context.saturating_sub(1).max(1);
    }
    if let Some(stride) = a.stride {
        windows.stride = stride;
    }
    let bar = match std::io::stderr().is_terminal() && !a.json {
        true => indicatif::ProgressBar::new(0),
        false => indicatif::ProgressBar::hidden(),
    };
    let nll = eval::evaluate_windows(&loaded.model, &ids, windows, |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    let peak = bench::peak_rss_bytes();
    let dtype = loaded.dtype_label();
    if a.json {
        let mut out = json!({"tokens": nll.tokens, "mean_nll": nll.mean(),
               "perplexity": nll.perplexity(), "context": windows.context,
               "stride": windows.stride, "peak_rss_bytes": peak, "dtype": dtype});
        add_conversion(&mut out, &loaded, report.as_ref());
        println!("{out}");
    } else {
        if let Some(r) = &report {
            eprintln!("{}", conversion_line(r));
        }
        println!(
            "tokens: {}  mean NLL: {:.6} nats  perplexity: {:.4}  ({dtype}, context {}, stride {}, peak RSS {} MB)",
            nll.tokens,
            nll.mean(),
            nll.perplexity(),
            windows.context,
            windows.stride,
            peak.unwrap_or(0) / 1_000_000
        );
    }
    Ok(())
}

pub fn run_bench(b: BenchArgs) -> Result<()> {
    let (loaded, report) = match (&b.model, &b.config) {
        (Some(m), _) => load_reported(m, &b.placement)?,
        (None, Some(c)) => {
            let (dtype, device) = placement(&b.placement)?;
            // Random weights have no checkpoint dtype: `auto` is f32.
            let quant = dtype.quantization();
            let dtype = dtype.resolve(None, Some(DType::F32), &device);
            // Random weights convert to nothing: they are drawn in the layout asked for.
            let mut cfg = ModelConfig::from_file(c)?;
            if let Some(spec) = &b.placement.attention {
                cfg = spec.parse::<convert::Spec>()?.plan(&cfg)?.config(&cfg);
            }
            let mut loaded = loader::random(&cfg, dtype, quant, &device)?;
            conversion::set_kv_dtype(&mut loaded.model, &b.placement)?;
            (loaded, None)
        }
        (None, None) => bail!("bench needs --model or --config"),
    };
    // Before the clock starts: the steady state is what is measured.
    huge_pages::into_huge_pages();
    let expanded = b.mla_cache == "expanded";
    let r = bench::run(
        &loaded.model,
        loaded.weight_bytes(),
        b.prompt_tokens,
        b.new_tokens,
        b.batch,
        expanded,
    )?;
    let mut out = serde_json::to_value(&r)?;
    let peak = bench::peak_rss_bytes();
    out["peak_rss_bytes"] = json!(peak);
    // Measured after the peak, which its buffer would otherwise raise.
    let probe = bench::read_probe_buffer();
    huge_pages::into_huge_pages(); // where the weights are, so that the two compare
    let machine = bench::machine_read_gb_per_s(&probe);
    out["machine_read_gb_per_s"] = json!(machine);
    out["num_parameters"] = json!(loaded.num_parameters);
    out["dtype"] = json!(loaded.dtype_label());
    add_conversion(&mut out, &loaded, report.as_ref());
    if let (Some(r), false) = (&report, b.json) {
        eprintln!("{}", conversion_line(r));
    }
    if b.json {
        println!("{out}");
    } else {
        let batch = match r.batch {
            1 => String::new(),
            n => format!(
                " ({n} sequences, {:.1} tok/s each)",
                r.decode_tokens_per_s_per_sequence
            ),
        };
        println!(
            "{} | prefill {:.1} tok/s | decode {:.1} tok/s{batch} | {:.1} GB/s read (machine {:.1} GB/s) | weights {} MB | KV {} bytes | peak RSS {} MB",
            loaded.dtype_label(),
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            r.decode_read_gb_per_s,
            machine,
            r.weight_bytes / 1_000_000,
            r.kv_cache_bytes,
            peak.unwrap_or(0) / 1_000_000
        );
    }
    Ok(())
}
