//! candle-transformers' `models::llama` on a local checkpoint, timed exactly like
//! `tiny-decoder bench`: synthetic prompt ids `(i * 7919 + 13) % vocab`, one prefill forward,
//! then `--new-tokens` greedy decode steps (argmax of the last logits, one forward each)
//! with candle-transformers' own KV cache (`llama::Cache`, concatenating per step).
//!
//! usage: candle-compare --model DIR [--dtype f32|bf16] [--prompt-tokens 32] [--new-tokens 128]
//! prints one JSON object on stdout.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Llama, LlamaConfig};
use std::path::PathBuf;
use std::time::Instant;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn main() -> Result<()> {
    let mut model: Option<PathBuf> = None;
    let mut dtype = DType::F32;
    let (mut prompt_tokens, mut new_tokens) = (32usize, 128usize);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--model" => model = Some(val()?.into()),
            "--dtype" => {
                dtype = match val()?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    d => bail!("--dtype {d}: expected f32, bf16 or f16"),
                }
            }
            "--prompt-tokens" => prompt_tokens = val()?.parse()?,
            "--new-tokens" => new_tokens = val()?.parse()?,
            "--json" => {}
            _ => bail!("unknown argument {a}"),
        }
    }
    let dir = model.context("--model DIR is required")?;
    let dev = Device::Cpu;

    // transformers 5 writes `rope_parameters: {rope_theta}` instead of a top-level `rope_theta`;
    // candle-transformers' LlamaConfig only knows the latter (and would default it to 10000).
    let mut raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json"))?)?;
    if raw.get("rope_theta").is_none() {
        if let Some(t) = raw.pointer("/rope_parameters/rope_theta").cloned() {
            raw["rope_theta"] = t;
        }
    }
    let lcfg: LlamaConfig = serde_json::from_value(raw)?;
    let cfg = lcfg.into_config(false);
    let vocab = cfg.vocab_size;
    if prompt_tokens + new_tokens > cfg.max_position_embeddings {
        bail!("prompt + new tokens exceed max_position_embeddings");
    }

    let load_start = Instant::now();
    let files = vec![dir.join("model.safetensors")];
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, &dev)? };
    let llama = Llama::load(vb, &cfg)?;
    let load_s = load_start.elapsed().as_secs_f64();
    let mut cache = Cache::new(true, dtype, &cfg, &dev)?;

    let ids: Vec<u32> = (0..prompt_tokens)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let start = Instant::now();
    let input = Tensor::new(ids.as_slice(), &dev)?.unsqueeze(0)?;
    let mut logits = llama.forward(&input, 0, &mut cache)?.squeeze(0)?.to_vec1::<f32>()?;
    let prefill = start.elapsed().as_secs_f64();

    let mut out_ids = Vec::with_capacity(new_tokens);
    let start = Instant::now();
    for step in 0..new_tokens {
        let next = argmax(&logits);
        out_ids.push(next);
        let input = Tensor::new(&[next], &dev)?.unsqueeze(0)?;
        logits = llama
            .forward(&input, prompt_tokens + step, &mut cache)?
            .squeeze(0)?
            .to_vec1::<f32>()?;
    }
    let decode = start.elapsed().as_secs_f64();

    let out = serde_json::json!({
        "engine": "candle-transformers 0.11.1 llama",
        "dtype": format!("{dtype:?}").to_lowercase(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "load_s": load_s,
        "prefill_tokens_per_s": prompt_tokens as f64 / prefill.max(1e-9),
        "decode_tokens_per_s": new_tokens as f64 / decode.max(1e-9),
        "first_ids": &out_ids[..out_ids.len().min(8)],
    });
    println!("{out}");
    Ok(())
}
