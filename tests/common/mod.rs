//! Shared helpers for the integration tests: fixture paths and reference files.
#![allow(dead_code)]

pub mod gguf;

use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use tiny_decoder::loader::{self, Loaded};

pub const BIN: &str = env!("CARGO_BIN_EXE_tiny-decoder");

pub const FIXTURES: [&str; 9] = [
    "llama-mha-tied",
    "llama-mqa-llama3",
    "mistral-gqa-headdim",
    "qwen2-bias",
    "qwen3-qknorm",
    "llama-linear-rope",
    "llama-yarn",
    "deepseek-v2",
    "deepseek-v3",
];

pub fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

pub fn reference(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).expect("reference file");
    serde_json::from_str(&text).expect("reference json")
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("float list")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

pub fn load_dir(dir: &std::path::Path, dtype: DType) -> Loaded {
    let files = loader::resolve(dir.to_str().expect("utf-8 path")).expect("resolve");
    loader::load(&files, dtype, &Device::Cpu).expect("load")
}

/// Deterministic values in [-1, 1) from a 64-bit LCG: test data that is the same every run.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Logits (T, V) of one full-sequence forward.
pub fn full_logits(loaded: &Loaded, ids: &[u32]) -> Vec<Vec<f32>> {
    let model = &loaded.model;
    let mut cache = model.new_cache(ids.len()).unwrap();
    let input = Tensor::new(ids, model.device())
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    model
        .forward(&input, &mut cache)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap()
}

/// Logits (T, V) of `ids` fed one at a time through a cache.
pub fn step_logits(loaded: &Loaded, ids: &[u32]) -> Vec<Vec<f32>> {
    let model = &loaded.model;
    let mut cache = model.new_cache(ids.len()).unwrap();
    ids.iter()
        .map(|&id| model.next_logits(&[id], &mut cache).unwrap())
        .collect()
}

/// `-log p(target)` under `logits`, in f64.
pub fn token_nll(logits: &[f32], target: u32) -> f64 {
    let top = logits.iter().fold(f32::MIN, |a, &v| a.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - top).exp()).sum();
    top + sum.ln() - logits[target as usize] as f64
}

/// Greedy continuation through the cache, ignoring EOS.
pub fn greedy(loaded: &Loaded, prompt: &[u32], n: usize) -> Vec<u32> {
    let model = &loaded.model;
    let mut cache = model.new_cache(prompt.len() + n).unwrap();
    let mut logits = model.next_logits(prompt, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = tiny_decoder::sampling::argmax(&logits);
        out.push(next);
        logits = model.next_logits(&[next], &mut cache).unwrap();
    }
    out
}

/// A fresh copy of a fixture in the test scratch directory.
pub fn scratch(fixture: &str, case: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("scratch")
        .join(case);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture_dir(fixture)).unwrap() {
        let path = entry.unwrap().path();
        if path.file_name().unwrap() != "reference.json" {
            std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
        }
    }
    dir
}

/// Runs the CLI and returns stderr, checking the failure contract.
pub fn fails(args: &[&str], env: &[(&str, &str)], expect: &str) -> String {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("internal error"),
        "{args:?}: {stderr}"
    );
    assert_eq!(
        stderr.trim().lines().count(),
        1,
        "{args:?}: not one line: {stderr}"
    );
    assert!(
        stderr.contains(expect),
        "{args:?}: expected {expect:?} in {stderr}"
    );
    stderr
}

pub fn edit_config(dir: &Path, edit: impl Fn(&mut Value)) {
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(path, v.to_string()).unwrap();
}

/// Rewrites the safetensors header of `dir/model.safetensors`, keeping the data bytes.
pub fn edit_header(dir: &Path, edit: impl Fn(&mut Value)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let text = header.to_string();
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(path, out).unwrap();
}

/// Runs the CLI with `args` and `--json`, checks it succeeded, and parses its stdout.
pub fn run_json(args: &[&str]) -> Value {
    let out = Command::new(BIN).args(args).arg("--json").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Where SmolLM2's files are built: `target/models` (scripts/build_smollm2.sh), or
/// `$TINY_DECODER_SMOLLM2` when set.
fn models_root() -> PathBuf {
    match std::env::var_os("TINY_DECODER_SMOLLM2") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/models"),
    }
}

/// Says on stderr that a test skips because `path` is not built, or fails when
/// TINY_DECODER_REQUIRE_SMOLLM2 is set.
fn skip(path: &Path) {
    let msg = format!(
        "SKIPPED: {} is not built (run scripts/build_smollm2.sh)",
        path.display()
    );
    assert!(
        std::env::var_os("TINY_DECODER_REQUIRE_SMOLLM2").is_none(),
        "{msg}"
    );
    // Straight to the stderr handle: libtest captures eprintln!, and a skip must show.
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// SmolLM2's directory `target/models/<name>` (scripts/build_smollm2.sh), or under `$TINY_DECODER_SMOLLM2` when set.
pub fn checkpoint(name: &str) -> Option<PathBuf> {
    let dir = models_root().join(name);
    if dir.join(".complete").is_file() {
        return Some(dir);
    }
    skip(&dir);
    None
}

/// A single file beside the SmolLM2 directories (the GGUF they were built from), with the
/// same skip/require rule as [`checkpoint`].
pub fn checkpoint_file(name: &str) -> Option<PathBuf> {
    let path = models_root().join(name);
    if path.is_file() {
        return Some(path);
    }
    skip(&path);
    None
}

/// `../shared/checkpoints/stories260K`, or `None` (said on stderr) when it is absent; a
/// failure when TINY_DECODER_REQUIRE_SHARED is set.
pub fn stories260k() -> Option<String> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/checkpoints/stories260K");
    if dir.is_dir() {
        return Some(dir.to_str().unwrap().to_string());
    }
    let msg = format!("SKIPPED: {} not found", dir.display());
    assert!(
        std::env::var_os("TINY_DECODER_REQUIRE_SHARED").is_none(),
        "{msg}"
    );
    let _ = writeln!(std::io::stderr(), "{msg}");
    None
}
