//! `--attention SPEC` on the command line: the conversion request from the flags, its
//! progress on a terminal, and what it did as a line of text or JSON fields.

use super::args::{self, Placement};
use super::placement;
use anyhow::{Context, Result};
use serde_json::json;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use tiny_decoder::loader::{self, Loaded};
use tiny_decoder::model::Transformer;
use tiny_decoder::{convert, kv_cache};

/// [`super::load`], with what the conversion did when `--attention` was given.
pub(super) fn load_reported(
    model: &str,
    p: &Placement,
) -> Result<(Loaded, Option<convert::Report>)> {
    let (dtype, device) = placement(p)?;
    let source = loader::open(model)?;
    let (mut loaded, report) = match &p.attention {
        None => (source.load(dtype, &device)?, None),
        Some(spec) => {
            let request = request(spec, &p.calibration, &p.heal)?;
            let bar = progress_bar();
            let (loaded, report) =
                convert::load(&source, dtype, &device, &request, |stage, done, total| {
                    show_progress(&bar, stage, done, total)
                })?;
            bar.finish_and_clear();
            (loaded, Some(report))
        }
    };
    set_kv_dtype(&mut loaded.model, p)?;
    Ok((loaded, report))
}

/// `--kv-dtype` on a loaded model.
pub(super) fn set_kv_dtype(model: &mut Transformer, p: &Placement) -> Result<()> {
    Ok(model.set_cache_dtype(kv_cache::parse_dtype(&p.kv_dtype)?)?)
}

/// A progress bar on a terminal, hidden elsewhere.
pub(super) fn progress_bar() -> indicatif::ProgressBar {
    match std::io::stderr().is_terminal() {
        true => indicatif::ProgressBar::new(0),
        false => indicatif::ProgressBar::hidden(),
    }
}

/// A conversion's progress on `bar`.
pub(super) fn show_progress(
    bar: &indicatif::ProgressBar,
    stage: convert::Stage,
    done: usize,
    total: usize,
) {
    bar.set_message(match stage {
        convert::Stage::Calibrating => "calibrating (tokens)",
        convert::Stage::Writing => "writing calibration text (tokens)",
        convert::Stage::Healing => "healing (layers)",
        convert::Stage::Distilling => "healing end to end (steps)",
        convert::Stage::Converting => "converting (tensors)",
    });
    bar.set_length(total as u64);
    bar.set_position(done as u64);
}

/// Most bytes of calibration text read in all: far more than a fit or a heal uses (32k
/// tokens is about 130 KB), checked from the files' sizes before anything is read.
const CALIBRATION_BYTES: u64 = 64 << 20;

/// The text of `--calibration`: each file, or every file under a directory (by name, into
/// subdirectories, hidden ones skipped), in the order given, joined by blank lines.
fn calibration_text(paths: &[PathBuf]) -> Result<String> {
    let mut files = Vec::new();
    for path in paths {
        collect_files(path, &mut files)
            .with_context(|| format!("--calibration {}: cannot read", path.display()))?;
    }
    if files.is_empty() {
        anyhow::bail!("--calibration: no files in {}", paths[0].display());
    }
    let mut total = 0u64;
    for f in &files {
        total += std::fs::metadata(f)
            .with_context(|| format!("--calibration {}: cannot read", f.display()))?
            .len();
        if total > CALIBRATION_BYTES {
            anyhow::bail!(
                "--calibration: more than {} MiB of text at {} (a fit uses a few hundred KB)",
                CALIBRATION_BYTES >> 20,
                f.display()
            );
        }
    }
    let texts = (files.iter())
        .map(|f| {
            std::fs::read_to_string(f).with_context(|| {
                format!("--calibration {}: cannot read as UTF-8 text", f.display())
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(texts.join("\n\n"))
}

/// `path` if it is a file, else the files under it, sorted by name: hidden ones skipped,
/// and no link to a directory followed inside one (no loops).
fn collect_files(path: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if !std::fs::metadata(path)?.is_dir() {
        out.push(path.to_path_buf());
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<_>>()?;
    entries.sort();
    for entry in entries {
        let hidden = entry
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        let link = std::fs::symlink_metadata(&entry)?.is_symlink();
        if hidden || (link && std::fs::metadata(&entry)?.is_dir()) {
            continue;
        }
        collect_files(&entry, out)?;
    }
    Ok(())
}

/// `--attention SPEC` with the text of `--calibration PATH...` and `--heal`.
pub(super) fn request(
    spec: &str,
    calibration: &[PathBuf],
    heal: &args::HealArgs,
) -> Result<convert::Request> {
    let calibration = match calibration {
        [] => None,
        paths => Some(calibration_text(paths)?),
    };
    if heal.heal && heal.heal_steps == 0 {
        anyhow::bail!(
            "--heal-steps 0: give at least 1 (the default is {})",
            convert::heal::STEPS
        );
    }
    if let Some(lr) = heal.heal_lr.filter(|lr| !(lr.is_finite() && *lr > 0.0)) {
        anyhow::bail!(
            "--heal-lr {lr}: give a finite learning rate above 0 (the default is {}, {} for \
             mla:R and lowrank:R)",
            convert::heal::E2E_LR,
            convert::heal::E2E_LR_LATENT
        );
    }
    let least = 2 * convert::heal::WINDOW;
    if heal.heal && heal.heal_e2e_steps > 0 && calibration.is_none() && heal.heal_tokens < least {
        anyhow::bail!(
            "--heal-tokens {}: give at least {least} (two windows of {}; the default is {})",
            heal.heal_tokens,
            convert::heal::WINDOW,
            convert::heal::TOKENS
        );
    }
    Ok(convert::Request {
        spec: spec.parse()?,
        calibration,
        heal: heal.heal.then_some(convert::heal::Heal {
            layer_steps: heal.heal_steps,
            steps: heal.heal_e2e_steps,
            lr: heal.heal_lr,
            tokens: heal.heal_tokens,
        }),
    })
}

/// `exact` when every new K/V head copies an original one, else the method's name.
pub(super) fn conversion_method(r: &convert::Report) -> &'static str {
    match r.plan.is_exact() {
        true => "exact",
        false => r.plan.method.name(),
    }
}

/// The attention a JSON report ran with, and the conversion that made it.
pub(super) fn add_conversion(
    out: &mut serde_json::Value,
    loaded: &Loaded,
    report: Option<&convert::Report>,
) {
    let cfg = loaded.model.config();
    out["attention"] = json!(cfg.attention_kind());
    let kv = loaded.model.cache_dtype();
    out["kv_bytes_per_token"] = json!(cfg.kv_bytes_per_token(kv.size_in_bytes()));
    out["kv_dtype"] = json!(loader::dtype_name(kv));
    if let Some(r) = report {
        out["attention_spec"] = json!(r.plan.spec.to_string());
        out["conversion_method"] = json!(conversion_method(r));
        out["conversion_secs"] = json!(r.secs);
        if let Some(h) = &r.heal {
            add_heal(out, h);
        }
    }
}

/// `--heal`'s figures in a JSON report.
pub(super) fn add_heal(out: &mut serde_json::Value, h: &convert::HealReport) {
    let (before, after) = h.mean_error();
    out["heal_secs"] = json!(h.secs);
    out["heal_steps"] = json!(h.steps);
    out["heal_tokens"] = json!(h.tokens);
    out["heal_error_before"] = json!(before);
    out["heal_error_after"] = json!(after);
    if let Some(d) = &h.end_to_end {
        out["heal_e2e_steps"] = json!(d.steps);
        out["heal_e2e_lr"] = json!(d.lr);
        out["heal_e2e_tokens"] = json!(d.tokens);
        out["heal_e2e_secs"] = json!(d.secs);
        out["heal_e2e_loss_before"] = json!(d.before);
        out["heal_e2e_loss_after"] = json!(d.after);
    }
}

/// One line on what a conversion did.
pub(super) fn conversion_line(r: &convert::Report) -> String {
    let p = &r.plan;
    let calibration = match r.calibration_tokens {
        0 => String::new(),
        n => format!(", calibrated on {n} tokens"),
    };
    let shape = match p.latent {
        Some(l) => format!(
            "{} K/V heads through a rank-{} latent of {}",
            p.to_kv_heads, l.rank, l.full
        ),
        None => format!("{} -> {} K/V heads", p.from_kv_heads, p.to_kv_heads),
    };
    let heal = match &r.heal {
        Some(h) => {
            let (before, after) = h.mean_error();
            format!(
                ", healed in {:.1} s ({} steps per layer on {} tokens: relative output error \
                 {before:.4} -> {after:.4})",
                h.secs, h.steps, h.tokens
            )
        }
        None => String::new(),
    };
    format!(
        "attention converted to {} ({shape}, method {}{calibration}{heal}) in {:.2} s",
        p.spec,
        conversion_method(r),
        r.secs
    )
}
