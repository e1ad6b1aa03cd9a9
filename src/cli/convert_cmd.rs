//! `convert`: an attention conversion written as a Hugging Face directory, with progress on
//! a terminal and one line (or JSON object) on what was written.

use super::args::ConvertArgs;
use super::conversion::{
    add_heal, conversion_line, conversion_method, progress_bar, request, show_progress,
};
use anyhow::{bail, Result};
use serde_json::json;
use tiny_decoder::convert;
use tiny_decoder::loader::{self, DTypeArg};

pub fn run_convert(a: ConvertArgs) -> Result<()> {
    let dtype = match DTypeArg::parse(&a.dtype)? {
        DTypeArg::Auto => None,
        DTypeArg::Fixed(d) => Some(d),
        DTypeArg::Quantized(_) => {
            bail!(
                "convert --dtype {}: writes f32, f16 or bf16 (quantize at load instead)",
                a.dtype
            )
        }
    };
    let req = request(&a.attention, &a.calibration, &a.heal)?;
    let device = loader::parse_device(&a.device)?;
    let source = loader::open(&a.model)?;
    let bar = progress_bar();
    let written = convert::write(
        &source,
        &req,
        dtype,
        &a.out,
        &device,
        |stage, done, total| show_progress(&bar, stage, done, total),
    )?;
    bar.finish_and_clear();
    let r = &written.report;
    if a.json {
        let mut out = json!({
            "out": a.out,
            "attention_spec": r.plan.spec.to_string(),
            "num_key_value_heads": r.plan.to_kv_heads,
            "original_num_key_value_heads": r.plan.from_kv_heads,
            "conversion_method": conversion_method(r),
            "conversion_secs": r.secs,
            "calibration_tokens": r.calibration_tokens,
            "calibration_text_secs": r.text_secs,
            "calibration_secs": r.calibration_secs,
            "tensors": written.tensors,
            "tensor_bytes": written.bytes,
            "files": written.files,
        });
        if let Some(l) = r.plan.latent {
            out["kv_latent_rank"] = json!(l.rank);
        }
        if let Some(h) = &r.heal {
            add_heal(&mut out, h);
        }
        println!("{out}");
    } else {
        eprintln!("{}", conversion_line(r));
        println!(
            "wrote {}: {} tensors ({:.1} MB), {}",
            a.out.display(),
            written.tensors,
            written.bytes as f64 / 1e6,
            written.files.join(", ")
        );
    }
    Ok(())
}
