//! Attention conversion (`--attention`): exact conversions (GQA → MHA, X → X) reproduce the
//! original's greedy ids and mean NLL on a bundled model, stories260K and SmolLM2; the aware
//! merge is exact where the merged heads are equal; low-rank K/V at full rank is exact; the
//! lossy MQA and low-rank conversions of SmolLM2 land where the issue says; bad specs are one-line errors that say what would work.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{
    checkpoint, full_logits, greedy, max_abs_diff, step_logits, stories260k, token_nll, BIN,
};
use std::io::Write;
use std::path::PathBuf;
use std::process::Command;
use tiny_decoder::config::AttentionConfig;
use tiny_decoder::convert::gqa::{self, Heads, Projections};
use tiny_decoder::convert::{self, Request};
use tiny_decoder::eval;
use tiny_decoder::loader::{self, DTypeArg, Loaded};

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn convert(model: &str, spec: &str, calibration: Option<String>) -> (Loaded, convert::Report) {
    let source = loader::open(model).unwrap();
    let req = Request {
        spec: spec.parse().unwrap(),
        calibration,
        heal: None,
    };
    convert::load(&source, DTypeArg::Auto, &Device::Cpu, &req, |_, _, _| {}).unwrap()
}

fn original(model: &str) -> Loaded {
    loader::open(model)
        .unwrap()
        .load(DTypeArg::Auto, &Device::Cpu)
        .unwrap()
}

/// Mean NLL of `text`.
fn nll(loaded: &Loaded, text: &str) -> f64 {
    let ids = loaded.tokenizer.as_ref().unwrap().encode(text).unwrap();
    eval::evaluate(&loaded.model, &ids).unwrap().mean()
}

/// Converts `model` by each spec, which must be exact: same greedy continuation of `prompt`
/// and mean NLL on `text` within 1e-4, with the K/V heads the spec asks for.
fn assert_exact(model: &str, specs: &[(&str, usize)], prompt: &str, text: &str) {
    let base = original(model);
    let ids = base.tokenizer.as_ref().unwrap().encode(prompt).unwrap();
    let (want_ids, want_nll) = (greedy(&base, &ids, 24), nll(&base, text));
    for &(spec, kv_heads) in specs {
        let (conv, report) = convert(model, spec, None);
        assert!(report.plan.is_exact(), "{model} {spec}");
        assert_eq!(report.plan.to_kv_heads, kv_heads, "{model} {spec}");
        // K/V heads, or (MLA) the RoPE heads the keys were merged into.
        match &conv.model.config().attention {
            AttentionConfig::Gqa { num_kv_heads, .. } => assert_eq!(*num_kv_heads, kv_heads),
            AttentionConfig::Mla(m) => assert_eq!(m.rope_groups, kv_heads, "{model} {spec}"),
        }
        assert_eq!(
            greedy(&conv, &ids, 24),
            want_ids,
            "{model} {spec}: greedy ids"
        );
        let got = nll(&conv, text);
        assert!(
            (got - want_nll).abs() < 1e-4,
            "{model} {spec}: NLL {got} vs {want_nll}"
        );
    }
}

fn heldout(chars: usize) -> String {
    let text = std::fs::read_to_string(data("shakespeare-heldout.txt")).unwrap();
    text.chars().take(chars).collect()
}

#[test]
fn exact_conversions_of_bundled_models_reproduce_them() {
    let text = heldout(6000);
    // tiny-gqa: 4 query heads over 2 K/V heads.
    assert_exact(
        "tiny-gqa",
        &[
            ("mha", 4),
            ("gqa:4", 4),
            ("gqa:2", 2),
            ("lowrank:128", 2),
            ("mla:128,rope=64", 2),
        ],
        "ROMEO:",
        &text,
    );
    // Full rank: 2 × K/V heads × head_dim 32.
    let specs = [("mqa", 1), ("mha", 4), ("lowrank:64", 1)];
    assert_exact("tiny-mqa", &specs, "ROMEO:", &text);
    assert_exact("tiny-mha", &[("mha", 4)], "ROMEO:", &text);
}

#[test]
fn exact_conversions_of_stories260k_reproduce_it() {
    let Some(dir) = stories260k() else { return };
    let text = "Once upon a time, there was a little girl named Lily. She loved to play outside \
                in the sun. One day, she saw a big tree with a red ball in it.";
    // 8 query heads over 4 K/V heads.
    assert_exact(
        &dir,
        &[
            ("mha", 8),
            ("gqa:8", 8),
            ("gqa:4", 4),
            ("lowrank:64", 4),
            ("mla:64,rope=32", 4),
        ],
        "Once upon a time",
        text,
    );
}

#[test]
fn exact_conversions_of_smollm2_reproduce_it() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let text = std::fs::read_to_string(data("passage.txt")).unwrap();
    // 9 query heads over 3 K/V heads.
    let specs = [
        ("mha", 9),
        ("gqa:3,method=aware", 3),
        ("lowrank:384", 3),
        ("mla:384,rope=192", 3),
    ];
    assert_exact(
        dir.to_str().unwrap(),
        &specs,
        "The capital of France is",
        &text,
    );
}

/// The issue's bar for SmolLM2 → MQA: aware ΔNLL ≤ +2.2 nats on held-out text, calibrated
/// on the default text (data/calibration.txt); mean-pooling far worse.
#[test]
fn smollm2_to_mqa_aware_beats_mean_pooling_within_the_issue_bound() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let dir = dir.to_str().unwrap();
    let text = std::fs::read_to_string(data("passage.txt")).unwrap();
    let base = nll(&original(dir), &text);
    let (mean, _) = convert(dir, "mqa,method=mean", None);
    let mean = nll(&mean, &text) - base;
    let (aware, report) = convert(dir, "mqa", None);
    assert_eq!(report.plan.method, convert::Method::Aware);
    assert!(
        report.calibration_tokens > 3000,
        "{}",
        report.calibration_tokens
    );
    let aware = nll(&aware, &text) - base;
    let _ = writeln!(
        std::io::stderr(),
        "SmolLM2 -> MQA on passage.txt: ΔNLL mean {mean:+.3}, aware {aware:+.3} (original {base:.4})"
    );
    assert!(aware <= 2.2, "aware ΔNLL {aware}");
    assert!(mean > aware + 2.0, "mean ΔNLL {mean} vs aware {aware}");
}

/// The issue's bars for SmolLM2's low-rank K/V, calibrated on the default text and scored on
/// held-out prose: `lowrank:128` (a third of the cache) ΔNLL ≤ +0.9 and `lowrank:256` ≤
/// +0.15, with the weight-only SVD far behind; and the converted model's cache (latents,
/// keys rebuilt each step) gives the logits of a full forward.
#[test]
fn smollm2_lowrank_within_the_issue_bounds() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let dir = dir.to_str().unwrap();
    let text = std::fs::read_to_string(data("passage.txt")).unwrap();
    let base = nll(&original(dir), &text);
    let delta = |spec: &str| {
        let (conv, report) = convert(dir, spec, None);
        assert_eq!(conv.model.config().attention_kind(), "lowrank");
        (nll(&conv, &text) - base, report, conv)
    };
    let (svd, ..) = delta("lowrank:128,method=svd");
    let (r256, ..) = delta("lowrank:256");
    let (r128, report, conv) = delta("lowrank:128");
    assert_eq!(report.plan.method, convert::Method::Aware);
    let _ = writeln!(
        std::io::stderr(),
        "SmolLM2 low-rank K/V on passage.txt: ΔNLL lowrank:128 svd {svd:+.3}, aware {r128:+.3}; \
         lowrank:256 aware {r256:+.3} (original {base:.4})"
    );
    assert!(r128 <= 0.9, "lowrank:128 ΔNLL {r128}");
    assert!(r256 <= 0.15, "lowrank:256 ΔNLL {r256}");
    assert!(svd > r128 + 1.0, "svd ΔNLL {svd} vs aware {r128}");
    assert_decode_matches_forward(&conv, &text);
}

/// The issue's bar for SmolLM2 as cacheable MLA with a 64-wide RoPE key and a rank-64
/// latent (128 values per token and layer, MQA's cache): ΔNLL ≤ +2.1, the weight-only
/// baseline (mean RoPE key, SVD latent) far behind; the absorbed decode through the latent
/// cache gives the logits of a full forward.
#[test]
fn smollm2_to_mla_within_the_issue_bound() {
    let Some(dir) = checkpoint("smollm2-135m-instruct") else {
        return;
    };
    let dir = dir.to_str().unwrap();
    let text = std::fs::read_to_string(data("passage.txt")).unwrap();
    let base = nll(&original(dir), &text);
    let (svd, _) = convert(dir, "mla:64,rope=64,method=svd", None);
    let svd = nll(&svd, &text) - base;
    let (conv, report) = convert(dir, "mla:64,rope=64", None);
    assert_eq!(report.plan.method, convert::Method::Aware);
    assert_eq!(conv.model.config().attention_kind(), "mla");
    let aware = nll(&conv, &text) - base;
    let _ = writeln!(
        std::io::stderr(),
        "SmolLM2 -> mla:64,rope=64 on passage.txt: ΔNLL svd {svd:+.3}, aware {aware:+.3} \
         (original {base:.4})"
    );
    assert!(aware <= 2.1, "mla:64,rope=64 ΔNLL {aware}");
    assert!(svd > aware + 1.0, "svd ΔNLL {svd} vs aware {aware}");
    assert_decode_matches_forward(&conv, &text);
}

/// Token-by-token decode through the cache gives each position's full-forward logits.
fn assert_decode_matches_forward(conv: &Loaded, text: &str) {
    let ids = conv.tokenizer.as_ref().unwrap().encode(text).unwrap();
    let ids = &ids[..40];
    let (full, steps) = (full_logits(conv, ids), step_logits(conv, ids));
    for (t, (step, full)) in steps.iter().zip(&full).enumerate() {
        let diff = max_abs_diff(step, full);
        assert!(diff < 1e-3, "position {t}: decode vs full forward {diff}");
    }
}

/// Random projections for 4 query heads over 4 K/V heads where heads 0 = 1 and 2 = 3: the
/// aware merge to 2 heads loses nothing, so every query·key product under any rotation and
/// every head's W_o·W_v must survive it.
#[test]
fn aware_merge_of_equal_heads_is_exact() {
    let (h, d, c) = (4, 8, 24);
    let dev = Device::Cpu;
    let rand = |r: usize, cols: usize| Tensor::randn(0f64, 1.0, (r, cols), &dev).unwrap();
    let pairs = |t: Tensor| {
        // Rows of heads 0 and 2, each repeated: (4·d, c + 1).
        let a = t.narrow(0, 0, d).unwrap();
        let b = t.narrow(0, d, d).unwrap();
        Tensor::cat(&[&a, &a, &b, &b], 0).unwrap()
    };
    let w = Projections {
        q: rand(h * d, c + 1),
        k: pairs(rand(2 * d, c + 1)),
        v: pairs(rand(2 * d, c + 1)),
        o: rand(c, h * d),
    };
    // The moment of random inputs with a constant 1 appended.
    let x = Tensor::cat(
        &[
            &rand(200, c),
            &Tensor::ones((200, 1), DType::F64, &dev).unwrap(),
        ],
        1,
    )
    .unwrap();
    let moment = (x.t().unwrap().matmul(&x).unwrap() / 200.0).unwrap();
    let mut cfg = loader::open("tiny-mha")
        .unwrap()
        .describe(DTypeArg::Auto, &dev)
        .unwrap()
        .cfg;
    cfg.num_attention_heads = h;
    let plan = "gqa:2"
        .parse::<convert::Spec>()
        .unwrap()
        .plan(&cfg)
        .unwrap();
    let heads = Heads {
        d,
        interleaved: false,
    };
    let out = gqa::convert(&plan, heads, &w, Some(&moment)).unwrap();
    assert_eq!(out.k.dims(), &[2 * d, c + 1]);
    let rotate = |t: &Tensor, angle: f64| {
        // Rotates each pair (i, i + d/2) of each head's rows by `angle · (i + 1)`.
        let rows = t.to_vec2::<f64>().unwrap();
        let mut out = rows.clone();
        for (r, row) in rows.iter().enumerate() {
            let (head, i) = (r / d, r % d);
            if i >= d / 2 {
                continue;
            }
            let (a, b) = (head * d + i, head * d + i + d / 2);
            let th = angle * (i + 1) as f64;
            for k in 0..row.len() {
                out[a][k] = th.cos() * rows[a][k] - th.sin() * rows[b][k];
                out[b][k] = th.sin() * rows[a][k] + th.cos() * rows[b][k];
            }
        }
        Tensor::new(out, &dev).unwrap()
    };
    for (tq, tk) in [(0.0, 0.0), (0.7, 0.2), (3.0, -1.1)] {
        for q in 0..h {
            let score = |wq: &Tensor, wk: &Tensor, g: usize| {
                let q = rotate(wq, tq).narrow(0, q * d, d).unwrap();
                let k = rotate(wk, tk).narrow(0, g * d, d).unwrap();
                q.t().unwrap().matmul(&k).unwrap() // (c + 1, c + 1): the bilinear form
            };
            let want = score(&w.q, &w.k, q);
            let got = score(&out.q, &out.k, q / 2);
            let diff = (want - got).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f64>().unwrap() < 1e-8, "head {q}");
        }
    }
    for q in 0..h {
        let ov = |o: &Tensor, v: &Tensor, g: usize| {
            o.narrow(1, q * d, d)
                .unwrap()
                .matmul(&v.narrow(0, g * d, d).unwrap())
                .unwrap()
        };
        let diff = (ov(&w.o, &w.v, q) - ov(&out.o, &out.v, q / 2)).unwrap();
        let diff = diff
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(diff < 1e-8, "head {q}: W_o·W_v differs by {diff}");
    }
}

/// stderr of a failing run: one line, with every hint in `wants`.
fn fails_with(args: &[&str], wants: &[&str]) {
    let out = Command::new(BIN).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert_eq!(stderr.trim_end().lines().count(), 1, "{args:?}: {stderr}");
    for want in wants {
        assert!(stderr.contains(want), "{args:?}: {stderr} lacks {want:?}");
    }
}

#[test]
fn bad_attention_specs_say_what_would_work() {
    let info = |spec: &'static str| ["info", "-m", "tiny-gqa", "--attention", spec];
    fails_with(
        &info("gqa:3"),
        &["does not divide the 4 query heads", "1, 2, 4"],
    );
    fails_with(&info("gqa:8"), &["more than the 4 query heads", "gqa:4"]);
    fails_with(&info("gqa:0"), &["positive integer"]);
    fails_with(&info("mqa,method=best"), &["unknown method", "mean"]);
    fails_with(
        &info("mqa,method=svd"),
        &["mla and lowrank", "mean or aware"],
    );
    fails_with(
        &info("mla:64,rope=48"),
        &["whole heads of 32 dims", "rope=32, rope=64, rope=128"],
    );
    fails_with(
        &info("mla:129,rope=64"),
        &["above the full rank", "at most 128"],
    );
    // tiny-gqa's keys and values: 2 K/V heads × head_dim 32, twice.
    fails_with(
        &info("lowrank:129"),
        &["above the full rank", "at most 128"],
    );
    fails_with(
        &info("lowrank:64,method=mean"),
        &["method=mean applies to", "svd or aware"],
    );
    fails_with(&info("sliding"), &["mha, mqa, gqa:G"]);
    fails_with(
        &info("mla:64,rope=64,layout=deepseek"),
        &["one RoPE key head", "rope=32", "layout=ours"],
    );
    // What DeepSeek-V3's class cannot hold is refused, not dropped: a sliding window, MLP
    // biases (the fixture with each edited in).
    for (name, key, value, spec, what) in [
        (
            "mistral-gqa-headdim",
            "sliding_window",
            64,
            "mla:32,rope=32",
            "a sliding window",
        ),
        (
            "llama-mha-tied",
            "mlp_bias",
            1,
            "mla:32,rope=16",
            "MLP biases",
        ),
    ] {
        let value = match key {
            "mlp_bias" => serde_json::json!(true),
            _ => serde_json::json!(value),
        };
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("mla-{key}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fixture = common::fixture_dir(name);
        for f in ["model.safetensors", "tokenizer.json"] {
            std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
        }
        let config = std::fs::read_to_string(fixture.join("config.json")).unwrap();
        let mut config: serde_json::Value = serde_json::from_str(&config).unwrap();
        config[key] = value;
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let args = ["info", "-m", dir.to_str().unwrap(), "--attention", spec];
        fails_with(&args, &[what, "layout=ours"]);
    }
    let mla = ["info", "-m", "tiny-mla", "--attention", "mqa"];
    fails_with(&mla, &["MLA attention", "MHA/GQA/MQA checkpoints"]);
    let short = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("short-calibration.txt");
    std::fs::write(&short, "Too short to calibrate on.").unwrap();
    let args = [
        "info",
        "-m",
        "tiny-gqa",
        "--attention",
        "mqa",
        "--calibration",
    ];
    let mut args = args.to_vec();
    args.push(short.to_str().unwrap());
    fails_with(&args, &["needs at least", "method=mean"]);
}

#[test]
fn info_eval_and_bench_report_the_converted_attention() {
    let info = common::run_json(&["info", "-m", "tiny-gqa", "--attention", "mqa,method=mean"]);
    assert_eq!(info["attention"], "mqa");
    assert_eq!(info["num_key_value_heads"], 1);
    assert_eq!(info["original_num_key_value_heads"], 2);
    assert_eq!(info["conversion_method"], "mean");
    assert!(info["conversion_secs"].as_f64().unwrap() > 0.0);
    let plain = common::run_json(&["info", "-m", "tiny-gqa"]);
    // Half the K/V heads: half the cache, and 2 of 4 layers' K/V rows fewer parameters.
    let kv = |v: &serde_json::Value| v["kv_bytes_per_token"].as_u64().unwrap();
    assert_eq!(2 * kv(&info), kv(&plain));
    // What 1 GB of cache holds: twice the tokens, twice the 4k sequences.
    for v in [&info, &plain] {
        assert_eq!(v["kv_tokens_per_gb"], 1_000_000_000 / kv(v));
        assert_eq!(v["kv_sequences_4k_per_gb"], 1_000_000_000 / kv(v) / 4096);
    }
    let (h, d, layers) = (128u64, 32u64, 4u64);
    let params = |v: &serde_json::Value| v["num_parameters"].as_u64().unwrap();
    assert_eq!(params(&plain) - params(&info), layers * 2 * d * h);
    let heldout = data("shakespeare-heldout.txt");
    let file = heldout.to_str().unwrap();
    let e = common::run_json(&[
        "eval",
        "-m",
        "tiny-gqa",
        "--file",
        file,
        "--attention",
        "mha",
    ]);
    assert_eq!(e["attention"], "mha");
    assert_eq!(e["conversion_method"], "exact");
    let b = common::run_json(&[
        "bench",
        "-m",
        "tiny-gqa",
        "--attention",
        "mqa,method=mean",
        "--new-tokens",
        "4",
    ]);
    assert_eq!(b["attention"], "mqa");
    assert_eq!(b["kv_bytes_per_token"], kv(&info));

    // A rank-64 latent caches 64 values per token and layer where GQA caches 2 × 2 × 32;
    // kv_down (64 × 128) and k_up, v_up (64 each × 64) hold as many weights as k_proj, v_proj.
    let low = common::run_json(&[
        "info",
        "-m",
        "tiny-gqa",
        "--attention",
        "lowrank:64,method=svd",
    ]);
    assert_eq!(low["attention"], "lowrank");
    assert_eq!(low["kv_latent_rank"], 64);
    assert_eq!(low["num_key_value_heads"], 2);
    assert_eq!(low["conversion_method"], "svd");
    assert_eq!(2 * kv(&low), kv(&plain));
    assert_eq!(params(&low), params(&plain));
}

/// `--calibration` takes a directory (its files by name, hidden ones skipped) or several
/// paths: the same text as one file of them all joined by blank lines, so the same fit.
#[test]
fn calibration_from_a_directory_or_several_files_is_their_text_joined() {
    let text = std::fs::read_to_string(data("shakespeare-heldout.txt")).unwrap();
    let (a, b) = text.split_at(text.len() / 2);
    let a = &a[..a.rfind('\n').unwrap()];
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("calibration-dir");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("dir/more")).unwrap();
    std::fs::write(root.join("dir/1.txt"), a).unwrap();
    std::fs::write(root.join("dir/more/2.txt"), b).unwrap();
    std::fs::write(root.join("dir/.hidden"), "never read").unwrap();
    std::fs::write(root.join("joined.txt"), format!("{a}\n\n{b}")).unwrap();
    let path = |p: &str| root.join(p).to_str().unwrap().to_string();
    let heldout = data("stories-heldout.txt");
    let nll = |calibration: &[String]| {
        let mut args = vec![
            "eval",
            "-m",
            "tiny-gqa",
            "--file",
            heldout.to_str().unwrap(),
        ];
        args.extend(["--attention", "mqa"]);
        for c in calibration {
            args.extend(["--calibration", c.as_str()]);
        }
        common::run_json(&args)["mean_nll"].as_f64().unwrap()
    };
    let joined = nll(&[path("joined.txt")]);
    assert_eq!(nll(&[path("dir")]), joined);
    assert_eq!(nll(&[path("dir/1.txt"), path("dir/more")]), joined);
    assert_ne!(
        nll(&[path("dir/1.txt")]),
        joined,
        "half the text fits differently"
    );
    std::fs::create_dir_all(root.join("empty")).unwrap();
    let args = [
        "info",
        "-m",
        "tiny-gqa",
        "--attention",
        "mqa",
        "--calibration",
    ];
    fails_with(&[&args[..], &[&path("empty")]].concat(), &["no files in"]);
    fails_with(&[&args[..], &[&path("absent")]].concat(), &["cannot read"]);
}

/// Token-by-token decode gives the full forward's NLL in SmolLM2's bf16 weights and cache,
/// original and MLA (`mla:64` with kv_b_proj folded into q_proj and o_proj, `mla:192` with it
/// kept per head in bf16: `forms::per_head`'s bf16 products): the mean NLL of 127 next
/// tokens within 1e-2 (as the bf16 NLL against transformers). bf16 products round their inputs to bf16, so an f32 sum in another order
/// (a prompt's tile against a decode step's) can move a rounding: single logits of the two
/// differ by up to ~0.6, below 0.75. (Zen 5 with AVX-512 BF16, 2026-11-27: 1.4e-3 for both;
/// 4.5e-3 for the original before either attention rounded its query to bf16 on such a host.
/// Zen 4, 2026-11-29, the scores on keys transposed in registers: the original 2.3e-3 and
/// 0.59 at most, `mla:64` 9.6e-4 and 0.33, `mla:192` 6.6e-4 and 0.38; before, 4.2e-3 and
/// 0.40, 5.6e-4 and 0.34, 3.6e-3 and 0.37: one logit of 127 × 49152 moved by a flip.)
#[test]
fn smollm2_bf16_decode_matches_forward_original_and_mla() {
    let Some(dir) = checkpoint("smollm2-135m-instruct-bf16") else {
        return;
    };
    let dir = dir.to_str().unwrap();
    let text = std::fs::read_to_string(data("passage.txt")).unwrap();
    let base = original(dir);
    let (conv, _) = convert(dir, "mla:64,rope=64", None);
    let (wide, _) = convert(dir, "mla:192,rope=64", None);
    let models = [
        ("original", &base),
        ("mla:64,rope=64", &conv),
        ("mla:192,rope=64", &wide),
    ];
    for (name, loaded) in models {
        assert_eq!(loaded.model.dtype(), DType::BF16);
        let ids = loaded.tokenizer.as_ref().unwrap().encode(&text).unwrap();
        let ids = &ids[..128];
        let (full, steps) = (full_logits(loaded, ids), step_logits(loaded, ids));
        let worst = (steps.iter().zip(&full)).fold(0f32, |w, (s, f)| w.max(max_abs_diff(s, f)));
        let mean = |logits: &[Vec<f32>]| {
            let total: f64 = (1..ids.len())
                .map(|t| token_nll(&logits[t - 1], ids[t]))
                .sum();
            total / (ids.len() - 1) as f64
        };
        let (full_nll, step_nll) = (mean(&full), mean(&steps));
        let _ = writeln!(
            std::io::stderr(),
            "SmolLM2 bf16 {name}: mean NLL decode {step_nll:.5}, full forward {full_nll:.5}, \
             logits at most {worst:.3} apart"
        );
        assert!(
            (step_nll - full_nll).abs() < 1e-2,
            "{name}: {step_nll} vs {full_nll}"
        );
        assert!(worst < 0.75, "{name}: logits {worst} apart");
    }
}
