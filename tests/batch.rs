//! A batch is the same computation as its sequences run alone: every attention variant and
//! family, prompts of different lengths packed into one step, decode tokens beside a
//! prompt chunk, and sequences that finish at different steps.

mod common;

use candle_core::{DType, Device};
use common::{fixture_dir, load_dir, max_abs_diff, FIXTURES};
use tiny_decoder::generate::{self, Options, Sequence};
use tiny_decoder::kv_cache::{KvPool, BLOCK};
use tiny_decoder::loader::{bundled, load_bundled, Loaded};
use tiny_decoder::model::Feed;
use tiny_decoder::sampling::{Sampler, SamplingParams};
use tiny_decoder::{KvCache, Transformer};

/// Prompts of 1 to 13 tokens from a simple generator over the vocabulary.
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    [5, 1, 13, 8]
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            (0..n)
                .map(|i| ((p * 7919 + i * 104_729 + 17) % vocab) as u32)
                .collect()
        })
        .collect()
}

fn cache(model: &Transformer, len: usize) -> KvCache {
    model.new_cache(len).unwrap()
}

/// Greedy generation of each prompt alone, then all of them in one batch where the second
/// stops after 3 tokens: the ids must be the same.
fn check(name: &str, loaded: &Loaded) {
    let model = &loaded.model;
    let tok = loaded.tokenizer.as_ref().expect("a tokenizer").inner();
    let prompts = prompts(model.config().vocab_size);
    let budgets = [12, 3, 12, 9];
    let greedy = SamplingParams::default();
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .zip(budgets)
        .map(|(p, n)| {
            let mut sampler = Sampler::new(&greedy).unwrap();
            let mut cache = cache(model, 32);
            let opts = Options::new(n);
            let g = generate::generate_in(model, tok, &mut cache, p, opts, &mut sampler, |_| {});
            g.unwrap().token_ids
        })
        .collect();

    let mut caches: Vec<KvCache> = prompts.iter().map(|_| cache(model, 32)).collect();
    let mut samplers: Vec<Sampler> = prompts
        .iter()
        .map(|_| Sampler::new(&greedy).unwrap())
        .collect();
    let mut seqs: Vec<Sequence> = caches
        .iter_mut()
        .zip(samplers.iter_mut())
        .zip(prompts.iter().zip(budgets))
        .map(|((cache, sampler), (p, n))| {
            Sequence::new(model, tok, cache, p, Options::new(n), sampler).unwrap()
        })
        .collect();
    generate::run(model, &mut seqs, None, |_, _| {}).unwrap();
    for (i, (seq, want)) in seqs.into_iter().zip(&alone).enumerate() {
        let got = seq.finish().unwrap().token_ids;
        assert_eq!(&got, want, "{name}: sequence {i} differs in a batch");
    }
}

#[test]
fn batched_greedy_ids_equal_each_sequence_alone() {
    for b in &bundled::MODELS {
        check(b.name, &load_bundled(b, DType::F32, &Device::Cpu).unwrap());
    }
    for name in FIXTURES {
        check(name, &load_dir(&fixture_dir(name), DType::F32));
    }
    // Converted checkpoints: low-rank K/V (latents cached, keys rebuilt per sequence), MLA
    // from GQA in our layout (two RoPE groups, no latent norm, absorbed decode per
    // sequence), and in DeepSeek's with kv_b_proj folded into q_proj and o_proj (rank 32 =
    // head_dim: prompts take the absorbed form too).
    let source = tiny_decoder::loader::open("tiny-gqa").unwrap();
    for (spec, kind) in [
        ("lowrank:48,method=svd", "lowrank"),
        ("mla:48,rope=64,method=svd", "mla"),
        ("mla:32,rope=32,method=svd", "mla"),
    ] {
        let req = tiny_decoder::convert::Request {
            spec: spec.parse().unwrap(),
            calibration: None,
            heal: None,
        };
        let f32 = tiny_decoder::loader::DTypeArg::Fixed(DType::F32);
        let (conv, _) =
            tiny_decoder::convert::load(&source, f32, &Device::Cpu, &req, |_, _, _| {}).unwrap();
        assert_eq!(conv.model.config().attention_kind(), kind);
        check(&format!("tiny-gqa {spec}"), &conv);
    }
}

/// One step with a prompt chunk of 6 tokens beside two sequences decoding one token each:
/// each sequence's logits equal those of the same step run alone.
#[test]
fn a_prompt_chunk_beside_decode_tokens_changes_neither() {
    for name in [
        "llama-mha-tied",
        "mistral-gqa-headdim",
        "deepseek-v2",
        "deepseek-v3",
    ] {
        let loaded = load_dir(&fixture_dir(name), DType::F32);
        let model = &loaded.model;
        let p = prompts(model.config().vocab_size);
        // Two sequences already hold their prompts; the third is new.
        let mut caches: Vec<KvCache> = (0..3).map(|_| cache(model, 32)).collect();
        let mut alone_caches: Vec<KvCache> = (0..3).map(|_| cache(model, 32)).collect();
        for (i, c) in [0, 2].into_iter().enumerate() {
            model.next_logits(&p[c], &mut caches[i]).unwrap();
            model.next_logits(&p[c], &mut alone_caches[i]).unwrap();
        }
        let step: [&[u32]; 3] = [&[3], &[11], &p[3][..6]];
        let mut feeds: Vec<Feed> = caches
            .iter_mut()
            .zip(step)
            .map(|(cache, ids)| Feed { ids, cache })
            .collect();
        let batched = model.next_logits_batch(&mut feeds).unwrap();
        for (i, (cache, ids)) in alone_caches.iter_mut().zip(step).enumerate() {
            let alone = model.next_logits(ids, cache).unwrap();
            let diff = max_abs_diff(&alone, &batched[i]);
            assert!(
                diff < 1e-4,
                "{name}: sequence {i} moved by {diff} in the batch"
            );
        }
    }
}

#[test]
fn an_empty_feed_is_an_error_not_a_panic() {
    let loaded = load_bundled(&bundled::MODELS[0], DType::F32, &Device::Cpu).unwrap();
    let model = &loaded.model;
    let mut c = cache(model, 8);
    let err = model
        .next_logits_batch(&mut [Feed {
            ids: &[],
            cache: &mut c,
        }])
        .unwrap_err();
    assert!(err.to_string().contains("no tokens"), "{err}");
}

fn json_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(common::BIN)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// `generate` with several prompts (repeated `--prompt`, or `--prompt-file` lines) prints one
/// JSON line per prompt, in input order, each equal to that prompt run alone.
#[test]
fn several_prompts_run_as_one_batch_in_input_order() {
    let prompts = ["ROMEO:", "JULIET: O Romeo"];
    let greedy = ["-m", "tiny-mla", "-t", "0", "-n", "16", "--json"];
    let alone: Vec<serde_json::Value> = prompts
        .iter()
        .map(|p| json_lines(&[&["generate", "-p", p], &greedy[..]].concat()).remove(0))
        .collect();
    let mut args = vec!["generate"];
    for p in &prompts {
        args.extend(["-p", p]);
    }
    let file = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("batch-prompts.txt");
    std::fs::write(&file, format!("{}\n\n{}\n", prompts[0], prompts[1])).unwrap();
    let from_flags = json_lines(&[&args[..], &greedy[..]].concat());
    let from_file = json_lines(
        &[
            &["generate", "--prompt-file", file.to_str().unwrap()],
            &greedy[..],
        ]
        .concat(),
    );
    for batch in [&from_flags, &from_file] {
        assert_eq!(batch.len(), 2);
        for (got, want) in batch.iter().zip(&alone) {
            assert_eq!(got["prompt_token_ids"], want["prompt_token_ids"]);
            assert_eq!(got["token_ids"], want["token_ids"]);
            assert_eq!(got["text"], want["text"]);
            assert_eq!(got["batch_size"], 2);
        }
    }
}

#[test]
fn bench_batch_reports_aggregate_and_per_sequence_speed() {
    let r = json_lines(&[
        "bench",
        "-m",
        "tiny-gqa",
        "--batch",
        "3",
        "--prompt-tokens",
        "8",
        "--new-tokens",
        "4",
        "--json",
    ])
    .remove(0);
    assert_eq!(r["batch"], 3);
    let (all, each) = (
        r["decode_tokens_per_s"].as_f64().unwrap(),
        r["decode_tokens_per_s_per_sequence"].as_f64().unwrap(),
    );
    assert!((all - 3.0 * each).abs() < 1e-6 * all, "{all} vs 3 × {each}");
    assert_eq!(
        r["kv_cache_bytes"],
        3 * 12 * r["kv_bytes_per_token"].as_u64().unwrap()
    );
}

/// Models of every attention form: the fixtures' MHA, GQA, MQA and DeepSeek MLA, and tiny-gqa
/// converted to low-rank K/V and to MLA in both layouts.
fn every_form(dtype: DType) -> Vec<(String, Loaded)> {
    let mut models: Vec<(String, Loaded)> = ["llama-mha-tied", "mistral-gqa-headdim"]
        .iter()
        .chain(&[
            "llama-mqa-llama3",
            "qwen3-qknorm",
            "deepseek-v2",
            "deepseek-v3",
        ])
        .map(|name| (name.to_string(), load_dir(&fixture_dir(name), dtype)))
        .collect();
    let source = tiny_decoder::loader::open("tiny-gqa").unwrap();
    for spec in [
        "lowrank:48,method=svd",
        "mla:48,rope=64,method=svd",
        "mla:32,rope=32,method=svd",
    ] {
        let req = tiny_decoder::convert::Request {
            spec: spec.parse().unwrap(),
            calibration: None,
            heal: None,
        };
        let dt = tiny_decoder::loader::DTypeArg::Fixed(dtype);
        let (conv, _) =
            tiny_decoder::convert::load(&source, dt, &Device::Cpu, &req, |_, _, _| {}).unwrap();
        models.push((format!("tiny-gqa {spec}"), conv));
    }
    models
}

/// Three sequences growing in turn in one shared pool hold interleaved blocks (sequence 0
/// holds blocks 0, 3, 6...), so every read goes through a block table: prompt chunks that
/// cross blocks (gathered), then decode tokens (the decode op following the table). Each
/// step's logits equal those of the same sequence in a cache of its own, in f32 and bf16.
#[test]
fn a_paged_cache_answers_as_a_cache_of_its_own() {
    for (dtype, tol) in [(DType::F32, 1e-4), (DType::BF16, 2e-3)] {
        for (name, loaded) in every_form(dtype) {
            let model = &loaded.model;
            let cfg = model.config();
            let per_token = cfg.kv_bytes_per_token(dtype.size_in_bytes());
            let pool = KvPool::new(cfg, 3 * 96 * per_token, dtype, model.device()).unwrap();
            let mut paged: Vec<KvCache> = (0..3).map(|_| pool.sequence(96)).collect();
            let mut own: Vec<KvCache> = (0..3).map(|_| cache(model, 96)).collect();
            let vocab = cfg.vocab_size;
            // Chunks of 13, 21, then 1 token at a time up to 80 positions.
            let mut lens = vec![13, 21];
            lens.resize(48, 1);
            let mut pos = 0;
            for n in lens {
                for s in 0..3 {
                    let ids: Vec<u32> = (pos..pos + n)
                        .map(|i| ((s * 7919 + i * 104_729 + 17) % vocab) as u32)
                        .collect();
                    let a = model.next_logits(&ids, &mut paged[s]).unwrap();
                    let b = model.next_logits(&ids, &mut own[s]).unwrap();
                    let diff = max_abs_diff(&a, &b);
                    assert!(
                        diff < tol,
                        "{name} {dtype:?}: sequence {s} at {pos}+{n} moved by {diff} when paged"
                    );
                }
                pos += n;
            }
            assert_eq!(pool.usage().held, 3 * pos.div_ceil(BLOCK));
        }
    }
}

/// A prompt that begins with what another sequence cached shares its blocks: whole blocks
/// while that sequence runs, and its last, partly filled one once it ended. Writing after a
/// shared position copies the block first: neither sequence's answers move.
#[test]
fn a_shared_prefix_answers_as_if_prefilled_and_is_never_overwritten() {
    for (name, loaded) in every_form(DType::F32) {
        shared_prefix(&name, &loaded.model);
    }
}

fn shared_prefix(name: &str, model: &Transformer) {
    let cfg = model.config();
    let pool = KvPool::new(
        cfg,
        40 * BLOCK * cfg.kv_bytes_per_token(4),
        DType::F32,
        model.device(),
    )
    .unwrap();
    let vocab = cfg.vocab_size as u32;
    let ids =
        |from: u32, n: u32| -> Vec<u32> { (from..from + n).map(|i| i * 31 % vocab).collect() };
    let run = |cache: &mut KvCache, ids: &[u32]| model.next_logits(ids, cache).unwrap();
    let alone = |ids: &[u32]| run(&mut cache(model, 200), ids);
    // A holds 70 positions: two whole blocks, indexed as they filled.
    let a_ids = ids(0, 70);
    let mut a = pool.sequence(200);
    run(&mut a, &a_ids);
    // B: the same 64 + 6 others. It takes A's two blocks and prefills only its 6.
    let mut b_ids = a_ids[..64].to_vec();
    b_ids.extend(ids(500, 6));
    let mut b = pool.sequence(200);
    assert_eq!(b.reuse_prefix(&b_ids, b_ids.len() - 1), 64);
    let got = run(&mut b, &b_ids[64..]);
    assert!(max_abs_diff(&got, &alone(&b_ids)) < 1e-4, "{name}");
    // A goes on, unharmed by B.
    let mut a_next = a_ids.clone();
    a_next.push(9);
    assert!(
        max_abs_diff(&run(&mut a, &[9]), &alone(&a_next)) < 1e-4,
        "{name}"
    );
    // A ends: its 71 positions, the last block partly filled, are found whole by C and D,
    // who then write into that block: the first copies it, the second writes in place.
    drop(a);
    let prompts: Vec<Vec<u32>> = (3..5)
        .map(|n| [a_next.clone(), ids(800, n)].concat())
        .collect();
    let mut both: Vec<KvCache> = (0..2).map(|_| pool.sequence(200)).collect();
    for (cache, prompt) in both.iter_mut().zip(&prompts) {
        assert_eq!(cache.reuse_prefix(prompt, prompt.len() - 1), 71);
    }
    for (cache, prompt) in both.iter_mut().zip(&prompts) {
        let got = run(cache, &prompt[71..]);
        assert!(
            max_abs_diff(&got, &alone(prompt)) < 1e-4,
            "{name}: {prompt:?}"
        );
    }
    // B's answer to its next token is still its own.
    let mut b_next = b_ids.clone();
    b_next.push(5);
    assert!(
        max_abs_diff(&run(&mut b, &[5]), &alone(&b_next)) < 1e-4,
        "{name}"
    );
}
