//! GGUF input without the real checkpoint: three fixtures of tests/fixtures (Llama tied,
//! Llama untied with attention biases and linear RoPE scaling, Qwen2 with q/k/v biases)
//! written as llama.cpp's converter writes them (`common::gguf`), loaded back and compared
//! with the directory they came from; and bad files, each refused in one line.

mod common;

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device};
use common::gguf::{set, to_gguf, without, Edit};
use common::{fails, fixture_dir, full_logits, load_dir, max_abs_diff};
use std::path::{Path, PathBuf};
use tiny_decoder::loader::{self, gguf::GgufFile, DTypeArg, Loaded};

fn load_gguf(path: &Path) -> Loaded {
    let source = loader::open(path.to_str().unwrap()).unwrap();
    source.load(DTypeArg::Auto, &Device::Cpu).unwrap()
}

const TEXTS: [&str; 4] = [
    "ROMEO: But soft, what light",
    "  two  spaces\nand a line",
    "<s>literal special</s> tokens",
    "",
];

#[test]
fn gguf_fixtures_load_as_their_directories() {
    for fixture in ["llama-mha-tied", "llama-linear-rope", "qwen2-bias"] {
        let path = to_gguf(fixture, &format!("{fixture}.gguf"), |_| {});
        let dir = fixture_dir(fixture);
        let (ours, theirs) = (load_gguf(&path), load_dir(&dir, DType::F32));
        // The metadata's rms_norm_eps is an f32 (1e-6 rounded); all else is equal.
        let mut cfg = ours.model.config().clone();
        assert!((cfg.rms_norm_eps - theirs.model.config().rms_norm_eps).abs() < 1e-12);
        cfg.rms_norm_eps = theirs.model.config().rms_norm_eps;
        assert_eq!(&cfg, theirs.model.config(), "{fixture}: config");
        assert_eq!(ours.num_parameters, theirs.num_parameters, "{fixture}");
        let (tok, want) = (
            ours.tokenizer.as_ref().unwrap(),
            theirs.tokenizer.as_ref().unwrap(),
        );
        for text in TEXTS {
            assert_eq!(
                tok.encode(text).unwrap(),
                want.encode(text).unwrap(),
                "{fixture}: {text:?}"
            );
        }
        let r = common::reference(&dir.join("reference.json"));
        let prompt = common::ids(&r["prompt_ids"]);
        assert_eq!(
            tok.encode(r["prompt"].as_str().unwrap()).unwrap(),
            prompt,
            "{fixture}"
        );
        let (a, b) = (full_logits(&ours, &prompt), full_logits(&theirs, &prompt));
        for (x, y) in a.iter().zip(&b) {
            assert!(max_abs_diff(x, y) < 1e-4, "{fixture}: logits differ");
        }
        let want = common::ids(&r["greedy_ids"]);
        assert_eq!(
            common::greedy(&ours, &prompt, want.len()),
            want,
            "{fixture}: greedy"
        );
    }
}

#[test]
fn gguf_info_and_generate_run_from_the_cli() {
    let path = to_gguf("qwen2-bias", "cli-qwen2.gguf", |_| {});
    let arg = path.to_str().unwrap();
    let info = common::run_json(&["info", "-m", arg]);
    assert_eq!(info["model_type"], "qwen2");
    assert_eq!(info["dtype"], "f32");
    assert_eq!(info["checkpoint_dtype"], "f32");
    let out = common::run_json(&[
        "generate", "-m", arg, "-p", "ROMEO:", "-n", "4", "-t", "0", "--dtype", "bf16",
    ]);
    assert_eq!(out["dtype"], "bf16");
    assert!(out["token_ids"].as_array().unwrap().len() <= 4);
}

/// Tokenizer-only GGUFs against transformers' tokenizer for the same file
/// (scripts/gguf_tokenizer_reference.py): a SentencePiece-style (`llama`) vocabulary with
/// no merges (rebuilt from the scores), and one byte-level vocabulary under three split
/// regexes (`tokenizer.ggml.pre`), with merges that only some of them let apply.
#[test]
fn gguf_tokenizers_match_transformers() {
    let data = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/gguf");
    for (name, n) in [
        ("sentencepiece-512", 10),
        ("bytelevel-default", 7),
        ("bytelevel-qwen2", 7),
        ("bytelevel-llama-bpe", 7),
    ] {
        let gguf = GgufFile::open(&data.join(format!("{name}.gguf"))).unwrap();
        let tok = gguf.tokenizer().unwrap().unwrap();
        let r = common::reference(&data.join(format!("{name}.json")));
        let cases = r["cases"].as_array().unwrap();
        assert_eq!(cases.len(), n, "{name}");
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want = common::ids(&case["ids"]);
            assert_eq!(tok.encode(text).unwrap(), want, "{name}: {text:?}");
            let decoded = tok.inner().decode(&want, true).unwrap();
            assert_eq!(
                decoded,
                case["decoded"].as_str().unwrap(),
                "{name}: {text:?}"
            );
        }
    }
}

#[test]
fn gguf_bad_files_are_one_line_naming_file_and_key() {
    let s = |x: &str| Value::String(x.into());
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "no-layers",
            Box::new(without("llama.block_count")),
            "metadata key llama.block_count is missing",
        ),
        (
            "gemma",
            Box::new(set("general.architecture", s("gemma2"))),
            "general.architecture is \"gemma2\"",
        ),
        (
            "no-arch",
            Box::new(without("general.architecture")),
            "metadata key general.architecture is missing",
        ),
        (
            "heads-str",
            Box::new(set("llama.attention.head_count", s("4"))),
            "llama.attention.head_count is a string, expected an integer",
        ),
        (
            "bert-tok",
            Box::new(set("tokenizer.ggml.model", s("bert"))),
            "tokenizer.ggml.model is \"bert\"",
        ),
        (
            "yarn",
            Box::new(set("llama.rope.scaling.type", s("yarn"))),
            "llama.rope.scaling.type is \"yarn\"",
        ),
        (
            "bad-eos",
            Box::new(set("tokenizer.ggml.eos_token_id", Value::U32(9999))),
            "tokenizer.ggml.eos_token_id is 9999",
        ),
    ];
    for (case, edit, expect) in cases {
        let path = to_gguf("llama-mha-tied", &format!("bad-{case}.gguf"), edit);
        let arg = path.to_str().unwrap();
        let stderr = fails(&["generate", "-m", arg, "-p", "hi"], &[], expect);
        assert!(stderr.contains(arg), "{case}: {stderr}");
    }
    // Truncated: inside the tensor data, and inside the metadata.
    let path = to_gguf("llama-mha-tied", "whole.gguf", |_| {});
    let bytes = std::fs::read(&path).unwrap();
    for (case, len, expect) in [
        ("data", bytes.len() - 100, "truncated or corrupt: tensor "),
        ("header", 200, "not a valid GGUF file"),
    ] {
        let cut = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("cut-{case}.gguf"));
        std::fs::write(&cut, &bytes[..len]).unwrap();
        let arg = cut.to_str().unwrap();
        for args in [
            &["info", "-m", arg][..],
            &["generate", "-m", arg, "-p", "hi"],
        ] {
            let stderr = fails(args, &[], expect);
            assert!(stderr.contains(arg), "{case}: {stderr}");
        }
    }
}
