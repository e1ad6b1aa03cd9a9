//! A batch is the same computation as its sequences run alone: every attention variant and
//! family, prompts of different lengths packed into one step, decode tokens beside a
//! prompt chunk, and sequences that finish at different steps.

mod common;

use candle_core::{DType, Device};
use common::{fixture_dir, load_dir, max_abs_diff, FIXTURES};
use tiny_decoder::generate::{self, Options, Sequence};
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
    KvCache::new(model.config(), len, model.dtype(), model.device()).unwrap()
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
