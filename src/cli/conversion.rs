//! `--attention SPEC` on the command line: the conversion request from the flags, its
//! progress on a terminal, and what it did as a line of text or JSON fields.

use super::args::{self, Placement};
use super::placement;
use anyhow::{Context, Result};
use serde_json::json;
use std::io::IsTerminal;
use tiny_decoder::convert;
use tiny_decoder::loader::{self, Loaded};

/// [`super::load`], with what the conversion did when `--attention` was given.
pub(super) fn load_reported(
    model: &str,
    p: &Placement,
) -> Result<(Loaded, Option<convert::Report>)> {
    let (dtype, device) = placement(p)?;
    let source = loader::open(model)?;
    let Some(spec) = &p.attention else {
        return Ok((source.load(dtype, &device)?, None));
    };
    let request = request(spec, p.calibration.as_deref(), &p.heal)?;
    let bar = progress_bar();
    let (loaded, report) =
        convert::load(&source, dtype, &device, &request, |stage, done, total| {
            show_progress(&bar, stage, done, total)
        })?;
    bar.finish_and_clear();
    Ok((loaded, Some(report)))
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

/// `--attention SPEC` with the text of `--calibration FILE` and `--heal`.
pub(super) fn request(
    spec: &str,
    calibration: Option<&std::path::Path>,
    heal: &args::HealArgs,
) -> Result<convert::Request> {
    let calibration = match calibration {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("--calibration {}: cannot read", path.display()))?,
        ),
        None => None,
    };
    if heal.heal && heal.heal_steps == 0 {
        anyhow::bail!(
            "--heal-steps 0: give at least 1 (the default is {})",
            convert::heal::STEPS
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
    out["kv_bytes_per_token"] = json!(cfg.kv_bytes_per_token(loaded.model.dtype().size_in_bytes()));
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
