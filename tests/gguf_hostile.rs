//! GGUF files a stranger could hand us, refused in one line as llama.cpp's `gguf.cpp`
//! refuses them (or sooner): tensor data misaligned, overlapping or relabelled with another
//! type, a dimension of 2^62, `general.alignment` 0, a float key stored as an integer, a NaN
//! epsilon, a 1,000,000-byte token and a huge array; each in bounded time. A large array the
//! loader never reads is skipped, and the file still loads.

mod common;

use candle_core::quantized::gguf_file::Value;
use common::gguf::{set, table, to_gguf, u64_at, Edit};
use common::{fails, BIN};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// A change to a file's bytes.
type Patch<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;

fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// `generate` and `info` on `path` fail with `expect` in one line naming the file, in
/// bounded time (20 s here, loose for a loaded CI host: unbounded, the long token took 39 s
/// and the large array aborted; measured without load, each is refused in well under 5 s).
fn refused(path: &std::path::Path, expect: &str) {
    refused_by(path, expect, &["info", "generate"]);
}

fn refused_by(path: &std::path::Path, expect: &str, commands: &[&str]) {
    let arg = path.to_str().unwrap();
    for &command in commands {
        let args = match command {
            "generate" => vec![command, "-m", arg, "-p", "hi", "-n", "1"],
            _ => vec![command, "-m", arg],
        };
        let start = Instant::now();
        let stderr = fails(&args, &[], expect);
        assert!(stderr.contains(arg), "{stderr}");
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{args:?} took {:?}",
            start.elapsed()
        );
    }
}

#[test]
fn tensor_data_that_llama_cpp_refuses_is_refused() {
    let whole = std::fs::read(to_gguf("llama-mha-tied", "hostile-whole.gguf", |_| {})).unwrap();
    let t = table(&whole);
    assert!(t.len() > 3);
    let ffn = t.iter().find(|e| e.name == "blk.0.ffn_up.weight").unwrap();
    let set_u64 =
        |b: &mut Vec<u8>, at: usize, v: u64| b[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let set_u32 =
        |b: &mut Vec<u8>, at: usize, v: u32| b[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let cases: Vec<(&str, Patch, &str)> = vec![
        (
            "misaligned",
            Box::new(|b| set_u64(b, t[2].offset_at, u64_at(b, t[2].offset_at) + 1)),
            "expected",
        ),
        (
            "overlap",
            Box::new(|b| set_u64(b, t[2].offset_at, 0)),
            "expected",
        ),
        // F32 relabelled F16 and Q8_0: the sizes no longer add up to the next offset.
        (
            "as-f16",
            Box::new(|b| set_u32(b, t[1].type_at, 1)),
            "expected",
        ),
        (
            "as-q8_0",
            Box::new(|b| set_u32(b, t[1].type_at, 8)),
            "expected",
        ),
        (
            "bad-type",
            Box::new(|b| set_u32(b, t[1].type_at, 99)),
            "type 99",
        ),
        // A type llama.cpp has and we do not run: named.
        (
            "iq-type",
            Box::new(|b| set_u32(b, t[1].type_at, 23)),
            "type IQ4_XS (23) is not supported",
        ),
        // Found by tests/fuzz_load.rs: an empty tensor reached candle's unaligned read.
        (
            "zero-dim",
            Box::new(|b| set_u64(b, t[1].dims_at, 0)),
            "a dimension is 0",
        ),
        (
            "huge-dim",
            Box::new(|b| set_u64(b, t[1].dims_at, 1 << 62)),
            "tensor ",
        ),
        (
            "huger-dim",
            Box::new(|b| set_u64(b, t[1].dims_at, 1 << 63)),
            "tensor ",
        ),
    ];
    for (case, edit, expect) in cases {
        let mut b = whole.clone();
        edit(&mut b);
        refused(&write(&format!("hostile-{case}.gguf"), &b), expect);
    }
    // Same bytes, another shape: checked against the config's when the model is built
    // (`info` reads the table only, and shows it).
    let mut b = whole.clone();
    let (d0, d1) = (u64_at(&b, ffn.dims_at), u64_at(&b, ffn.dims_at + 8));
    set_u64(&mut b, ffn.dims_at, d1);
    set_u64(&mut b, ffn.dims_at + 8, d0);
    let path = write("hostile-transposed.gguf", &b);
    let expect = "shape mismatch for model.layers.0.mlp.up_proj.weight";
    refused_by(&path, expect, &["generate"]);
}

#[test]
fn metadata_that_llama_cpp_refuses_is_refused() {
    let theta = "llama.rope.freq_base";
    let eps = "llama.attention.layer_norm_rms_epsilon";
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "align-0",
            Box::new(set("general.alignment", Value::U32(0))),
            "general.alignment",
        ),
        (
            "align-3",
            Box::new(set("general.alignment", Value::U32(3))),
            "general.alignment",
        ),
        (
            "align-i32",
            Box::new(set("general.alignment", Value::I32(32))),
            "general.alignment",
        ),
        // 10000.0's bits read as an integer: another number.
        (
            "theta-int",
            Box::new(set(theta, Value::I32(1176256512))),
            "expected a finite float",
        ),
        (
            "eps-nan",
            Box::new(set(eps, Value::F32(f32::NAN))),
            "not finite",
        ),
        (
            "eps-inf",
            Box::new(set(eps, Value::F32(f32::INFINITY))),
            "not finite",
        ),
        (
            "nested",
            Box::new(set(
                "general.nested",
                Value::Array(vec![Value::Array(vec![])]),
            )),
            "an array inside an array",
        ),
        (
            "huge-scores",
            Box::new(set(
                "tokenizer.ggml.scores",
                Value::Array(vec![Value::U8(0); 3_000_000]),
            )),
            "tokenizer.ggml.scores: an array of 3000000 elements",
        ),
    ];
    for (case, edit, expect) in cases {
        let path = to_gguf("llama-mha-tied", &format!("hostile-{case}.gguf"), edit);
        refused(&path, expect);
    }
}

#[test]
fn a_large_array_the_loader_never_reads_is_skipped() {
    let junk = Value::Array(vec![Value::U8(7); 5_000_000]);
    let path = to_gguf(
        "llama-mha-tied",
        "hostile-junk.gguf",
        set("general.junk", junk),
    );
    let start = Instant::now();
    let out = Command::new(BIN)
        .args([
            "generate",
            "-m",
            path.to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "2",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn a_million_byte_token_is_refused_before_the_merges_are_rebuilt() {
    let edit = |meta: &mut Vec<(String, Value)>| {
        for (k, v) in meta.iter_mut() {
            if let (true, Value::Array(tokens)) = (k == "tokenizer.ggml.tokens", v) {
                tokens[5] = Value::String("a".repeat(1_000_000));
            }
        }
    };
    let path = to_gguf("llama-mha-tied", "hostile-long-token.gguf", edit);
    // `info` builds no tokenizer: only `generate` meets the token.
    let expect = "tokenizer.ggml.tokens has token 5 of 1000000 bytes, more than 1024";
    refused_by(&path, expect, &["generate"]);
}

#[test]
fn merges_from_scores_are_bounded_before_they_are_rebuilt() {
    // A SentencePiece vocabulary of 300 tokens of 1,000 bytes: each under the length limit,
    // but the splits to look up (Σ len²) are over the budget.
    let edit = |meta: &mut Vec<(String, Value)>| {
        meta.retain(|(k, _)| !k.starts_with("tokenizer."));
        let tokens: Vec<Value> = (0..300)
            .map(|i| Value::String(format!("{i:04}{}", "a".repeat(996))))
            .collect();
        meta.push(("tokenizer.ggml.model".into(), Value::String("llama".into())));
        meta.push(("tokenizer.ggml.tokens".into(), Value::Array(tokens)));
        let scores = vec![Value::F32(0.0); 300];
        meta.push(("tokenizer.ggml.scores".into(), Value::Array(scores)));
    };
    let path = to_gguf("llama-mha-tied", "hostile-merge-work.gguf", edit);
    refused_by(&path, "too long to rebuild merges from", &["generate"]);
}
