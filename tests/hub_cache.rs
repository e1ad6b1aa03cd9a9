//! The hub code path, offline: a repo id resolves from a Hugging Face cache laid out as
//! hf-hub and huggingface_hub write it (refs/main -> snapshots/<commit>/files), with
//! HF_HUB_OFFLINE=1, and generates exactly what the same files give from a directory.

mod common;

use std::path::PathBuf;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_tiny-decoder");

fn generate_json(model: &str, env: &[(&str, &str)]) -> serde_json::Value {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "generate",
        "--model",
        model,
        "--prompt",
        "The quick brown fox",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--json",
    ]);
    cmd.envs(env.iter().copied());
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn repo_id_resolves_from_the_hf_cache_offline() {
    let home = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hf-home");
    let repo = home.join("hub/models--tiny-org--llama-mqa");
    let snapshot = repo.join("snapshots/0123abcd");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123abcd").unwrap();
    let fixture = common::fixture_dir("llama-mqa-llama3");
    for name in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(fixture.join(name), snapshot.join(name)).unwrap();
    }
    let env = [("HF_HUB_OFFLINE", "1"), ("HF_HOME", home.to_str().unwrap())];
    let from_hub = generate_json("tiny-org/llama-mqa", &env);
    let from_dir = generate_json(fixture.to_str().unwrap(), &[]);
    assert_eq!(from_hub["token_ids"], from_dir["token_ids"]);
    assert!(!from_hub["token_ids"].as_array().unwrap().is_empty());
}
