//! `--heal`: on stories260K (a real trained checkpoint, small enough for a debug build),
//! healing a lossy conversion lowers its NLL on held-out text the calibration never saw;
//! `convert --heal` writes what `--attention --heal` runs; what healing cannot do is a
//! one-line error.

mod common;

use candle_core::Device;
use common::{fails, run_json, stories260k};
use std::path::PathBuf;
use tiny_decoder::convert::heal::Heal;
use tiny_decoder::convert::{self, Request};
use tiny_decoder::eval;
use tiny_decoder::loader::{self, DTypeArg, Loaded};

fn heldout() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories-heldout.txt");
    std::fs::read_to_string(path).unwrap()
}

/// Layer-wise healing only: `layer_steps` per layer, no end-to-end training.
fn layer_wise(layer_steps: usize) -> Option<Heal> {
    Some(Heal {
        layer_steps,
        steps: 0,
        lr: None,
        tokens: 0,
    })
}

fn convert(model: &str, spec: &str, heal: Option<Heal>) -> (Loaded, convert::Report) {
    let source = loader::open(model).unwrap();
    let req = Request {
        spec: spec.parse().unwrap(),
        calibration: None,
        heal,
    };
    convert::load(&source, DTypeArg::Auto, &Device::Cpu, &req, |_, _, _| {}).unwrap()
}

fn nll(loaded: &Loaded, text: &str) -> f64 {
    let ids = loaded.tokenizer.as_ref().unwrap().encode(text).unwrap();
    eval::evaluate(&loaded.model, &ids).unwrap().mean()
}

/// The calibration text is the default technical prose; the NLL is on a TinyStories
/// passage. stories260K's MQA conversion costs it +1.7 nats there, lowrank:16 (a quarter of
/// full rank) +1.4, MLA with a latent of 16 and one RoPE head of 8 (DeepSeek's layout) +1.6;
/// 30 steps per layer recover a good part of each.
#[test]
fn healing_lowers_the_nll_of_lossy_conversions_on_held_out_text() {
    let Some(dir) = stories260k() else { return };
    let text = heldout();
    for spec in ["mqa", "lowrank:16", "mla:16,rope=8"] {
        let (plain, plain_report) = convert(&dir, spec, None);
        assert!(plain_report.heal.is_none());
        let (healed, report) = convert(&dir, spec, layer_wise(30));
        let h = report.heal.expect("a heal report");
        assert_eq!(h.layers.len(), 5, "{spec}");
        assert_eq!(h.steps, 30);
        assert!(h.end_to_end.is_none());
        let (before, after) = h.mean_error();
        assert!(after < before, "{spec}: output error {before} -> {after}");
        let (a, b) = (nll(&plain, &text), nll(&healed, &text));
        eprintln!("{spec}: NLL {a:.4} -> {b:.4}, output error {before:.4} -> {after:.4}");
        assert!(b < a - 0.1, "{spec}: healing moved NLL {a} -> {b}");
    }
}

/// End to end after the layer-wise fit, on text stories260K writes itself (no calibration
/// text given): the held-out windows' loss falls, and so does the NLL on a passage neither
/// saw, below the layer-wise fit's.
#[test]
fn healing_end_to_end_beats_the_layer_wise_fit() {
    let Some(dir) = stories260k() else { return };
    let text = heldout();
    let (layered, _) = convert(&dir, "mqa", layer_wise(30));
    let heal = Heal {
        layer_steps: 30,
        steps: 40,
        lr: None,
        tokens: 8192,
    };
    let (whole, report) = convert(&dir, "mqa", Some(heal));
    let h = report.heal.expect("a heal report");
    let d = h.end_to_end.expect("an end-to-end report");
    assert_eq!(d.steps, 40);
    assert!(d.tokens >= 6000, "{} tokens trained on", d.tokens);
    assert!(
        d.after < d.before,
        "held-out loss {} -> {}",
        d.before,
        d.after
    );
    let (a, b) = (nll(&layered, &text), nll(&whole, &text));
    eprintln!(
        "mqa: NLL layer-wise {a:.4}, end to end {b:.4}; held-out loss {:.4} -> {:.4}",
        d.before, d.after
    );
    assert!(b < a - 0.05, "end to end {b} against layer-wise {a}");
}

/// An exact conversion has nothing to heal: `--heal` leaves it exact and says so by
/// reporting no healing.
#[test]
fn exact_conversions_are_not_healed() {
    let Some(dir) = stories260k() else { return };
    let (_, report) = convert(&dir, "mha", layer_wise(5));
    assert!(report.plan.is_exact());
    assert!(report.heal.is_none());
}

/// `convert --out target/tmp/heal/NAME ARGS` and `eval ARGS` on the held-out TinyStories
/// passage: the written checkpoint must score what the live conversion scores (1e-4).
/// Returns convert's report, the live eval's, and the output directory.
fn written_as_run(name: &str, args: &[&str]) -> (serde_json::Value, serde_json::Value, PathBuf) {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("heal")
        .join(name);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let o = out.to_str().unwrap();
    let written = run_json(&[&["convert", "--out", o][..], args].concat());
    assert!(
        written["heal_error_after"].as_f64().unwrap()
            < written["heal_error_before"].as_f64().unwrap()
    );
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories-heldout.txt");
    let f = file.to_str().unwrap();
    let live = run_json(&[&["eval", "--file", f][..], args].concat());
    let back = run_json(&["eval", "--file", f, "-m", o]);
    let (a, b) = (
        live["mean_nll"].as_f64().unwrap(),
        back["mean_nll"].as_f64().unwrap(),
    );
    assert!((a - b).abs() < 1e-4, "eval --heal {a}, written {b}");
    (written, live, out)
}

/// `convert --heal` writes the healed tensors (q_proj and o_proj too): the written
/// checkpoint scores what `eval --attention --heal` scores.
#[test]
fn convert_writes_the_healed_model() {
    let Some(dir) = stories260k() else { return };
    let args = [
        "-m",
        &dir,
        "--attention",
        "lowrank:16",
        "--heal",
        "--heal-steps",
        "5",
        "--heal-e2e-steps",
        "4",
        "--heal-tokens",
        "2048",
    ];
    let (written, live, out) = written_as_run("stories260K-lowrank16", &args);
    assert_eq!(written["heal_steps"], 5);
    assert_eq!(written["heal_e2e_steps"], 4);
    assert_eq!(written["heal_e2e_lr"], convert::heal::E2E_LR_LATENT);
    assert!(live["heal_secs"].as_f64().unwrap() > 0.0);
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories-heldout.txt");
    let f = file.to_str().unwrap();
    // The text the original wrote is kept beside the model, and heals again as given text.
    assert!(written["files"]
        .as_array()
        .unwrap()
        .contains(&"heal_calibration.txt".into()));
    let text = out.join("heal_calibration.txt");
    let kept = std::fs::read_to_string(&text).unwrap();
    assert!(kept.len() > 2048, "{} bytes of text", kept.len());
    let again = run_json(
        &[
            &["eval", "--file", f, "--calibration", text.to_str().unwrap()][..],
            &args[..],
        ]
        .concat(),
    );
    assert!(again["heal_e2e_tokens"].as_u64().unwrap() > 0);
}

/// MLA heals too, and `convert` writes what `eval --heal` ran: in DeepSeek's layout (one
/// RoPE head), the healed output projection and latent among its tensors.
#[test]
fn convert_writes_a_healed_mla_model() {
    let Some(dir) = stories260k() else { return };
    let prose = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/passage.txt");
    let args = [
        "-m",
        &dir,
        "--attention",
        "mla:16,rope=8",
        "--calibration",
        prose.to_str().unwrap(),
        "--heal",
        "--heal-steps",
        "5",
        "--heal-e2e-steps",
        "4",
    ];
    let (written, live, out) = written_as_run("stories260K-mla16", &args);
    assert_eq!(written["heal_e2e_lr"], convert::heal::E2E_LR_LATENT);
    let a = live["mean_nll"].as_f64().unwrap();
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories-heldout.txt");
    let f = file.to_str().unwrap();
    let plain = run_json(&[
        "eval",
        "--file",
        f,
        "-m",
        &dir,
        "--attention",
        "mla:16,rope=8",
    ]);
    let p = plain["mean_nll"].as_f64().unwrap();
    eprintln!("mla:16,rope=8: NLL {p:.4} unhealed, {a:.4} healed (5 + 4 steps)");
    assert!(a < p, "healing moved NLL {p} -> {a}");
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(config.contains("DeepseekV3ForCausalLM"), "{config}");
}

/// Healing has no q/k norms in its forms: a Qwen3-style model is refused, in one line.
#[test]
fn healing_a_model_with_q_k_norms_is_refused() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let (model, file) = (
        root.join("tests/fixtures/qwen3-qknorm"),
        root.join("tests/data/stories-heldout.txt"),
    );
    let (m, f) = (model.to_str().unwrap(), file.to_str().unwrap());
    fails(
        &["eval", "--file", f, "-m", m, "--attention", "mqa", "--heal"],
        &[],
        "--heal: heals conversions of models without q/k norms",
    );
}

#[test]
fn what_healing_cannot_do_is_a_one_line_error() {
    let Some(dir) = stories260k() else { return };
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/stories-heldout.txt");
    let f = file.to_str().unwrap();
    let eval = |extra: &[&str]| -> Vec<String> {
        let base = ["eval", "--file", f, "-m", &dir];
        base.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let fails = |args: Vec<String>, env: &[(&str, &str)], expect: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails(&args, env, expect)
    };
    // clap's own usage error (several lines), exit 2.
    let out = std::process::Command::new(common::BIN)
        .args(eval(&["--attention", "mqa", "--heal-steps", "3"]))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--heal"));
    fails(
        eval(&["--attention", "mqa", "--heal", "--heal-steps", "0"]),
        &[],
        "--heal-steps 0",
    );
    for lr in ["0", "NaN", "inf"] {
        fails(
            eval(&["--attention", "mqa", "--heal", "--heal-lr", lr]),
            &[],
            &format!("--heal-lr {lr}: give a finite learning rate above 0"),
        );
    }
    fails(
        eval(&["--attention", "mqa", "--heal", "--heal-tokens", "100"]),
        &[],
        "--heal-tokens 100: give at least 1024",
    );
    // About 200 tokens: enough for the aware fit (64, the hidden size), not for healing.
    let short = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("heal-short.txt");
    std::fs::write(&short, "Once upon a time there was a cat. ".repeat(20)).unwrap();
    let s = short.to_str().unwrap();
    fails(
        eval(&["--attention", "mqa", "--heal", "--calibration", s]),
        &[],
        "--heal: the calibration text",
    );
}
