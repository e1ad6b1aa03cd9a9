//! `tiny-decoder convert`: the directory it writes loads back here with the greedy ids and
//! mean NLL of the `--attention` load of the original (exact and lossy specs, a bundled
//! model and stories260K), transformers computes the same NLL on it (when a Python with
//! transformers is given), and bad input is one line with nothing left behind.

mod common;

use candle_core::Device;
use common::{checkpoint, fails, greedy, stories260k, BIN};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use tiny_decoder::convert::{self, Request};
use tiny_decoder::eval;
use tiny_decoder::loader::{self, DTypeArg, Loaded};

const STORY: &str = "Once upon a time, there was a little girl named Lily. She loved to play \
                     outside in the sun. One day, she saw a big tree with a red ball in it. She \
                     wanted the ball, so she asked her mom for help.\n";

/// A fresh, absent directory under the tests' scratch space.
fn scratch(case: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("convert_out");
    std::fs::create_dir_all(&root).unwrap();
    let dir = root.join(case);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `convert --json` and returns its report.
fn convert_cli(model: &str, spec: &str, out: &Path) -> Value {
    let out = Command::new(BIN)
        .args([
            "convert",
            "-m",
            model,
            "--attention",
            spec,
            "--json",
            "--out",
        ])
        .arg(out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "convert {model} {spec}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn nll(loaded: &Loaded, text: &str) -> f64 {
    let ids = loaded.tokenizer.as_ref().unwrap().encode(text).unwrap();
    eval::evaluate(&loaded.model, &ids).unwrap().mean()
}

fn header_names(dir: &Path) -> Vec<(String, String)> {
    let infos = loader::headers::read_file(&dir.join("model.safetensors")).unwrap();
    let mut names: Vec<_> = infos.into_iter().map(|t| (t.name, t.dtype)).collect();
    names.sort();
    names
}

/// Converts `model` by `spec` into a directory and checks that it reloads with the results
/// of `--attention spec` on the original: greedy ids of `prompt`, mean NLL of `text` within
/// 1e-4, the tensors' names and dtypes of the original, the config's K/V heads.
fn assert_round_trip(model: &str, spec: &str, kv_heads: usize, prompt: &str, text: &str) {
    let out = scratch(&format!("{}-{spec}", model.rsplit('/').next().unwrap()));
    let report = convert_cli(model, spec, &out);
    assert_eq!(report["num_key_value_heads"], kv_heads, "{model} {spec}");

    let source = loader::open(model).unwrap();
    let req = Request {
        spec: spec.parse().unwrap(),
        calibration: None,
        heal: None,
    };
    let (want, _) =
        convert::load(&source, DTypeArg::Auto, &Device::Cpu, &req, |_, _, _| {}).unwrap();
    let got = loader::open(out.to_str().unwrap())
        .unwrap()
        .load(DTypeArg::Auto, &Device::Cpu)
        .unwrap();

    let ids = want.tokenizer.as_ref().unwrap().encode(prompt).unwrap();
    assert_eq!(
        greedy(&got, &ids, 24),
        greedy(&want, &ids, 24),
        "{model} {spec}"
    );
    let (a, b) = (nll(&got, text), nll(&want, text));
    assert!((a - b).abs() < 1e-4, "{model} {spec}: NLL {a} vs {b}");

    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    if !spec.starts_with("mla:") {
        assert_eq!(config["num_key_value_heads"], kv_heads);
    }
    assert!(config["rope_theta"].as_f64().unwrap() > 0.0);
    let deepseek = spec.starts_with("mla:") && !spec.contains("layout=ours") && kv_heads == 1;
    if !deepseek {
        let original = loader::open(model).unwrap().stored().unwrap();
        assert_eq!(config["model_type"], original.config["model_type"]);
    }
    if let Some(rank) = spec.strip_prefix("lowrank:") {
        // Our layout: the latent's rank in config.json, kv_down/k_up/v_up for k/v_proj.
        let rank: u64 = rank.split(',').next().unwrap().parse().unwrap();
        assert_eq!(config["kv_latent_rank"], rank);
        let names = header_names(&out);
        let has = |tail: &str| names.iter().filter(|(n, _)| n.ends_with(tail)).count();
        assert_eq!(
            has("kv_down.weight"),
            has("q_proj.weight"),
            "{model} {spec}"
        );
        assert_eq!(has("v_up.weight"), has("q_proj.weight"), "{model} {spec}");
        assert_eq!(has("k_proj.weight") + has("v_proj.weight"), 0);
    } else if let Some(rank) = spec.strip_prefix("mla:") {
        let rank: u64 = rank.split(',').next().unwrap().parse().unwrap();
        let names = header_names(&out);
        let has = |tail: &str| names.iter().filter(|(n, _)| n.ends_with(tail)).count();
        let layers = has("o_proj.weight");
        if deepseek {
            // DeepSeek-V3's class and tensors: the anchor channel beside the latent.
            assert_eq!(config["model_type"], "deepseek_v3");
            assert_eq!(config["architectures"][0], "DeepseekV3ForCausalLM");
            assert_eq!(config["kv_lora_rank"], rank);
            assert_eq!(config["first_k_dense_replace"], config["num_hidden_layers"]);
            assert_eq!(config["attention_bias"], true);
            assert!(config.get("kv_latent_norm").is_none() && config.get("rope_groups").is_none());
            assert_eq!(has("kv_a_layernorm.weight"), layers);
            assert_eq!(has("kv_a_proj_with_mqa.bias"), layers);
            assert_eq!(has("o_proj.bias"), layers);
        } else {
            // DeepSeek's fields and tensors in the original's config, and two of ours.
            assert_eq!(config["kv_lora_rank"], rank);
            assert_eq!(config["kv_latent_norm"], false);
        }
        assert_eq!(has("kv_a_proj_with_mqa.weight"), layers);
        assert_eq!(has("kv_b_proj.weight"), layers);
        assert_eq!(has("k_proj.weight") + has("v_proj.weight"), 0);
    } else if let loader::Source::Files(files) = &source {
        let original = Path::new(&files.source);
        assert_eq!(header_names(&out), header_names(original), "{model} {spec}");
    }
    assert!(out.join("tokenizer.json").is_file());
}

#[test]
fn converted_bundled_model_reloads_with_the_same_results() {
    let text: String = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/shakespeare-heldout.txt"),
    )
    .unwrap()
    .chars()
    .take(3000)
    .collect();
    assert_round_trip("tiny-gqa", "mha", 4, "ROMEO:", &text);
    assert_round_trip("tiny-gqa", "mqa,method=mean", 1, "ROMEO:", &text);
    assert_round_trip("tiny-gqa", "lowrank:64,method=svd", 2, "ROMEO:", &text);
    // Two RoPE heads of 32 dims: 2 as "num_key_value_heads" of the report; our layout.
    assert_round_trip("tiny-gqa", "mla:64,rope=64,method=svd", 2, "ROMEO:", &text);
    // One RoPE head: DeepSeek's layout, lossy and at full rank.
    assert_round_trip("tiny-gqa", "mla:64,rope=32,method=svd", 1, "ROMEO:", &text);
    assert_round_trip("tiny-gqa", "mla:128,rope=32", 1, "ROMEO:", &text);
}

/// Qwen2 (q/k/v biases) to MLA: DeepSeek's layout holds the biases (the query's through
/// q-LoRA) and its latent norm through the anchor channel, so that a one-K/V-head Qwen2 (the
/// fixture made MQA first) converts exactly at full rank (2·D + 1).
#[test]
fn qwen2_converts_to_deepseek_mla() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen2-bias");
    let mqa = scratch("qwen2-mqa");
    convert_cli(fixture.to_str().unwrap(), "mqa,method=mean", &mqa);
    let mqa = mqa.to_str().unwrap();
    let ids: Vec<u32> = (1..40).map(|i| (i * 37 % 390) as u32).collect();
    let original = loader::open(mqa)
        .unwrap()
        .load(DTypeArg::Auto, &Device::Cpu)
        .unwrap();
    let want = eval::evaluate(&original.model, &ids).unwrap().mean();
    let out = scratch("qwen2-mla");
    let report = convert_cli(mqa, "mla:33,rope=16", &out);
    assert_eq!(report["num_key_value_heads"], 1);
    let got = loader::open(out.to_str().unwrap())
        .unwrap()
        .load(DTypeArg::Auto, &Device::Cpu)
        .unwrap();
    let nll = eval::evaluate(&got.model, &ids).unwrap().mean();
    assert!(
        (nll - want).abs() < 1e-4,
        "qwen2 -> mla:33,rope=16 NLL {nll} vs {want}"
    );
    assert_eq!(
        greedy(&got, &ids[..8], 16),
        greedy(&original, &ids[..8], 16)
    );
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    let config: Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["q_lora_rank"], 65);
    assert_eq!(config["model_type"], "deepseek_v3");
    // Our layout has no biases: refused with the way out.
    let args = [
        "convert",
        "-m",
        mqa,
        "--attention",
        "mla:32,rope=16,layout=ours",
    ];
    let taken = scratch("qwen2-ours");
    fails(
        &[&args[..], &["--out", taken.to_str().unwrap()]].concat(),
        &[],
        "layout=deepseek",
    );
}

/// Entries of `dir` (to see that a failed convert left nothing there).
fn entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn convert_refuses_bad_input_in_one_line_and_leaves_nothing() {
    let root = scratch("bad");
    std::fs::create_dir_all(root.join("taken")).unwrap();
    std::fs::write(root.join("taken/keep.txt"), "mine").unwrap();
    std::fs::write(root.join("a-file"), "not a directory").unwrap();
    let gguf =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf/bytelevel-qwen2.gguf");
    let before = entries(&root);
    let out = |name: &str| root.join(name).to_str().unwrap().to_string();
    let convert = |model: &str, spec: &str, dir: &str, expect: &str| {
        let args = ["convert", "-m", model, "--attention", spec, "--out", dir];
        fails(&args, &[], expect);
        assert_eq!(entries(&root), before, "{args:?} left something behind");
    };
    convert(
        "tiny-gqa",
        "mqa",
        &out("taken"),
        "already exists and is not an empty directory",
    );
    assert_eq!(
        std::fs::read_to_string(root.join("taken/keep.txt")).unwrap(),
        "mine"
    );
    convert(
        "tiny-gqa",
        "mqa,method=mean",
        &out("a-file/out"),
        "cannot make --out's parent",
    );
    convert(gguf.to_str().unwrap(), "mha", &out("new"), "not GGUF files");
    convert("tiny-gqa", "gqa:3", &out("new"), "gqa:3");
    let args = [
        "convert",
        "-m",
        "tiny-gqa",
        "--attention",
        "mha",
        "--dtype",
        "q8_0",
    ];
    fails(
        &[&args[..], &["--out", &out("new")]].concat(),
        &[],
        "writes f32, f16 or bf16",
    );
    assert_eq!(entries(&root), before);
}

/// The Python that runs scripts/check_convert_hf.py: `$TINY_DECODER_PYTHON`, else a visible
/// skip (a failure when TINY_DECODER_REQUIRE_TRANSFORMERS is set, as in .ci/run).
fn python() -> Option<String> {
    if let Ok(p) = std::env::var("TINY_DECODER_PYTHON") {
        return Some(p);
    }
    let msg = "SKIPPED: set TINY_DECODER_PYTHON to a Python with torch and transformers \
               (scripts/requirements-smollm2-reference.txt) for the transformers round trip";
    assert!(
        std::env::var_os("TINY_DECODER_REQUIRE_TRANSFORMERS").is_none(),
        "{msg}"
    );
    let _ = writeln!(std::io::stderr(), "{msg}");
    None
}

/// Runs scripts/check_convert_hf.py on a converted directory; returns its report.
fn check_hf(python: &str, dir: &Path, original: &str, text: &Path) -> Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_convert_hf.py");
    let out = Command::new(python)
        .arg(script)
        .args([dir, text])
        .args(["--original", original, "--bin", BIN, "--tol", "2e-4"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "check_convert_hf.py {}: {stderr}",
        dir.display()
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let _ = writeln!(std::io::stderr(), "{report}");
    report
}

/// GQA → MQA (mean-pooled, so fast in a debug build) on stories260K and on SmolLM2: the
/// written directory scores the same mean NLL in transformers as here, within 2e-4.
#[test]
fn convert_round_trips_through_transformers() {
    let Some(python) = python() else { return };
    let text = scratch("story.txt");
    std::fs::write(&text, STORY).unwrap();
    let mut models: Vec<String> = stories260k().into_iter().collect();
    if let Some(dir) = checkpoint("smollm2-135m-instruct") {
        models.push(dir.to_str().unwrap().to_string());
    }
    for model in models {
        let name = model.rsplit('/').next().unwrap().to_string();
        let out = scratch(&format!("hf-{name}-mqa"));
        convert_cli(&model, "mqa,method=mean", &out);
        let report = check_hf(&python, &out, &model, &text);
        let diff = report["abs_diff"].as_f64().unwrap();
        assert!(diff <= 2e-4, "{name}: {report}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// MLA in DeepSeek's layout loads in transformers' `DeepseekV3ForCausalLM` as written and
/// scores the mean NLL we do: SmolLM2 (Llama), stories260K, and the Qwen2 fixture (biases).
#[test]
fn deepseek_mla_round_trips_through_transformers() {
    let Some(python) = python() else { return };
    let text = scratch("story-mla.txt");
    std::fs::write(&text, STORY).unwrap();
    let qwen2 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen2-bias");
    let mut cases = vec![(qwen2.to_str().unwrap().to_string(), "mla:48,rope=16")];
    if let Some(dir) = stories260k() {
        // kv_lora_rank 8 = qk_nope_head_dim: kv_b_proj folded into q_proj and o_proj here.
        cases.push((dir, "mla:8,rope=8,method=svd"));
    }
    if let Some(dir) = checkpoint("smollm2-135m-instruct") {
        cases.push((
            dir.to_str().unwrap().to_string(),
            "mla:64,rope=64,method=svd",
        ));
    }
    for (model, spec) in cases {
        let name = model.rsplit('/').next().unwrap().to_string();
        let out = scratch(&format!("hf-{name}-mla"));
        convert_cli(&model, spec, &out);
        let report = check_hf(&python, &out, &model, &text);
        let diff = report["abs_diff"].as_f64().unwrap();
        assert!(diff <= 2e-4, "{name} {spec}: {report}");
        let _ = std::fs::remove_dir_all(&out);
    }
}
