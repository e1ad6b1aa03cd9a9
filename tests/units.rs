//! Exact unit tests on tiny tensors and hand-made inputs: the causal mask, the sampler's
//! filters and seeding, the cache's in-place writes, grouped sdpa against the per-head
//! reference, and config validation.

mod common;

use candle_core::{DType, Device, Tensor};
use tiny_decoder::config::HfConfig;
use tiny_decoder::kv_cache::LayerCache;
use tiny_decoder::model::attention::{causal_mask, decode, naive_attention, sdpa};
use tiny_decoder::sampling::{apply_repeat_penalty, filtered_probs, Sampler, SamplingParams};
use tiny_decoder::KvCache;

const NEG: f32 = f32::NEG_INFINITY;

#[test]
fn causal_mask_drawn_as_a_matrix() {
    // 2 new queries after 2 cached keys.
    let m = causal_mask(2, 4, usize::MAX, DType::F32, &Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(m, vec![vec![0., 0., 0., NEG], vec![0., 0., 0., 0.]]);
    // Sliding window of 2: each query sees itself and one key back.
    let m = causal_mask(3, 3, 2, DType::F32, &Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(
        m,
        vec![vec![0., NEG, NEG], vec![0., 0., NEG], vec![NEG, 0., 0.]]
    );
}

#[test]
fn filters_keep_exactly_the_expected_tokens() {
    // probs at temperature 1: softmax of ln([0.5, 0.25, 0.15, 0.1])
    let logits: Vec<f32> = [0.5f32, 0.25, 0.15, 0.1].iter().map(|p| p.ln()).collect();
    let ids = |v: Vec<(u32, f32)>| v.into_iter().map(|(i, _)| i).collect::<Vec<_>>();
    assert_eq!(
        ids(filtered_probs(&logits, 1.0, 0, 1.0, 0.0)),
        vec![0, 1, 2, 3]
    );
    assert_eq!(ids(filtered_probs(&logits, 1.0, 2, 1.0, 0.0)), vec![0, 1]);
    // top-p 0.7: 0.5 < 0.7, 0.75 >= 0.7 -> two tokens; 0.76 needs the third.
    assert_eq!(ids(filtered_probs(&logits, 1.0, 0, 0.7, 0.0)), vec![0, 1]);
    assert_eq!(
        ids(filtered_probs(&logits, 1.0, 0, 0.76, 0.0)),
        vec![0, 1, 2]
    );
    // min-p 0.25: threshold 0.125 keeps 0.5, 0.25, 0.15.
    assert_eq!(
        ids(filtered_probs(&logits, 1.0, 0, 1.0, 0.25)),
        vec![0, 1, 2]
    );
    // top-k 3 renormalises before top-p: 0.5/0.9 = 0.556 < 0.6 -> two tokens.
    assert_eq!(ids(filtered_probs(&logits, 1.0, 3, 0.6, 0.0)), vec![0, 1]);
    // Temperature 0.5 squares the probabilities: 0.25 / (0.25 + 0.0625 + 0.0225 + 0.01).
    let p = filtered_probs(&logits, 0.5, 0, 1.0, 0.0);
    assert!((p[0].1 - 0.25 / 0.345).abs() < 1e-5);
}

#[test]
fn repeat_penalty_as_transformers() {
    let mut logits = vec![2.0, -2.0, 1.0];
    apply_repeat_penalty(&mut logits, &[0, 1, 1], 2.0);
    assert_eq!(logits, vec![1.0, -4.0, 1.0]);
}

#[test]
fn greedy_and_seeded_sampling() {
    let logits = vec![0.1, 3.0, 0.2, 2.9];
    let mut greedy = Sampler::new(&SamplingParams::default()).unwrap();
    assert_eq!(greedy.sample(&logits, &[]), 1);
    let params = SamplingParams {
        temperature: 1.0,
        seed: 7,
        ..Default::default()
    };
    let draw = |p: &SamplingParams| {
        let mut s = Sampler::new(p).unwrap();
        (0..64).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
    };
    let a = draw(&params);
    assert_eq!(a, draw(&params), "same seed, same tokens");
    assert_ne!(
        a,
        draw(&SamplingParams {
            seed: 8,
            ..params.clone()
        }),
        "another seed differs"
    );
    assert!(
        a.contains(&1) && a.contains(&3),
        "both likely tokens are drawn"
    );
    // top-k 1 is greedy whatever the seed.
    let top1 = SamplingParams { top_k: 1, ..params };
    assert!(draw(&top1).iter().all(|&t| t == 1));
}

#[test]
fn sampler_rejects_bad_flags() {
    for p in [
        SamplingParams {
            temperature: -1.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        SamplingParams {
            top_p: 1.5,
            ..Default::default()
        },
        SamplingParams {
            min_p: -0.1,
            ..Default::default()
        },
        SamplingParams {
            repeat_penalty: 0.0,
            ..Default::default()
        },
    ] {
        let err = Sampler::new(&p).err().expect("rejected").to_string();
        assert!(err.starts_with("--"), "{err}");
    }
}

/// (That a layer's writes land in the preallocated buffers, in place and through a block
/// table, is tested beside the cache: `kv_cache::tests`.)
#[test]
fn cache_reports_its_bytes_and_resets() {
    let dev = Device::Cpu;
    let cfg = HfConfig::from_file(&common::fixture_dir("llama-mha-tied").join("config.json"))
        .unwrap()
        .validate()
        .unwrap();
    let mut cache = KvCache::new(&cfg, 8, DType::F32, &dev).unwrap();
    assert_eq!(cache.bytes_per_token(), 2 * 2 * 4 * 16 * 4); // layers · (K, V) · heads · dim · f32
    assert_eq!(cache.bytes_in_use(), 0);
    cache.reset();
    assert!(cache.is_empty());
    assert!(KvCache::new(&cfg, cfg.max_position_embeddings + 1, DType::F32, &dev).is_err());
}

/// Neither cache is `Clone`: a clone shared the preallocated buffers (candle tensors are
/// reference-counted, the cache writes in place), so a clone reset and refilled overwrote the
/// keys and values of the original. This fails to compile if `Clone` comes back.
#[test]
fn caches_are_not_clone() {
    // Two blanket impls make `check` ambiguous, a compile error, exactly for a Clone type.
    trait AmbiguousIfClone<A> {
        fn check() {}
    }
    impl<T: ?Sized> AmbiguousIfClone<()> for T {}
    struct IsClone;
    impl<T: Clone> AmbiguousIfClone<IsClone> for T {}
    <KvCache as AmbiguousIfClone<_>>::check();
    <LayerCache as AmbiguousIfClone<_>>::check();
}

#[test]
fn grouped_sdpa_equals_per_head_reference() {
    let dev = Device::Cpu;
    for (h, g, t, s) in [(4, 4, 3, 3), (4, 2, 3, 5), (6, 1, 1, 7), (8, 2, 4, 4)] {
        let q = Tensor::randn(0f32, 1.0, (1, h, t, 8), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (1, g, s, 8), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, g, s, 5), &dev).unwrap();
        let mask = causal_mask(t, s, usize::MAX, DType::F32, &dev).unwrap();
        let mask = (t > 1).then_some(&mask);
        let ours = sdpa(&q, &k, &v, 0.3, mask)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let want = naive_attention(&q, &k, &v, 0.3, mask)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let diff = common::max_abs_diff(&ours, &want);
        assert!(diff < 1e-5, "h={h} g={g}: {diff}");
        // bf16 in, bf16 out, the same values within bf16's rounding.
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let mask = mask.map(bf);
        let ours = sdpa(&bf(&q), &bf(&k), &bf(&v), 0.3, mask.as_ref()).unwrap();
        assert_eq!(ours.dtype(), DType::BF16);
        let ours = ours.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let diff = common::max_abs_diff(&ours.to_vec1::<f32>().unwrap(), &want);
        assert!(diff < 3e-2, "bf16 h={h} g={g}: {diff}");
    }
}

/// One new token over a cache view (a narrowed, longer buffer), long enough for several of
/// the decode op's blocks, in f32 and bf16, against the per-head reference in f32: through
/// `sdpa` (which must pick the op on AVX2, AVX-512 and NEON) and through the op itself.
#[test]
fn decode_attention_over_cache_views_equals_reference() {
    let dev = Device::Cpu;
    #[cfg(target_arch = "x86_64")]
    let vector = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
    #[cfg(target_arch = "aarch64")]
    let vector = true; // NEON is aarch64's baseline
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let vector = false;
    // 4500 positions: blocks of 1024, the last partial.
    for (h, g, s, dk, dv) in [
        (6, 2, 600, 40, 24),
        (4, 4, 1, 16, 16),
        (9, 3, 257, 64, 64),
        (3, 1, 4500, 32, 40),
    ] {
        let q = Tensor::randn(0f32, 1.0, (1, h, 1, dk), &dev).unwrap();
        let cache_k = Tensor::randn(0f32, 1.0, (1, g, s + 9, dk), &dev).unwrap();
        let cache_v = Tensor::randn(0f32, 1.0, (1, g, s + 9, dv), &dev).unwrap();
        let (k, v) = (
            cache_k.narrow(2, 0, s).unwrap(),
            cache_v.narrow(2, 0, s).unwrap(),
        );
        let want = naive_attention(&q, &k, &v, 0.2, None).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
            let cast = |t: &Tensor| t.to_dtype(dtype).unwrap();
            let (q, k, v) = (cast(&q), cast(&cache_k), cast(&cache_v));
            let (k, v) = (k.narrow(2, 0, s).unwrap(), v.narrow(2, 0, s).unwrap());
            assert_eq!(
                decode::takes(&q),
                vector,
                "{dtype:?}: sdpa's choice of the op"
            );
            let op = decode::DecodeAttention {
                scale: 0.2,
                pages: None,
            };
            let direct = q.apply_op3_no_bwd(&k, &v, &op).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (how, ours) in [
                ("sdpa", sdpa(&q, &k, &v, 0.2, None).unwrap()),
                ("op", direct),
            ] {
                assert_eq!(ours.dims(), &[1, h, 1, dv]);
                let ours = ours.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                let diff = common::max_abs_diff(&ours.to_vec1::<f32>().unwrap(), &want);
                assert!(diff < tol, "{how} {dtype:?} h={h} g={g} s={s}: {diff}");
            }
        }
    }
}

/// MLA's absorbed decode through the op: one latent "head" whose cached rows are the keys
/// and whose first columns are the values (rows further apart than the values are wide),
/// against the per-head reference; head counts that tile as 3 + 3 + 3, 4 + 1 and 3 + 3, and
/// value widths that leave a tail past the register tiles.
#[test]
fn decode_attention_reads_values_as_a_view_of_the_keys() {
    let dev = Device::Cpu;
    for (h, s, dk, dv) in [(9, 600, 128, 64), (5, 300, 72, 40), (6, 257, 144, 129)] {
        let q = Tensor::randn(0f32, 1.0, (1, h, 1, dk), &dev).unwrap();
        let rows = Tensor::randn(0f32, 1.0, (1, 1, s + 7, dk), &dev).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
            let rows = rows.to_dtype(dtype).unwrap().narrow(2, 0, s).unwrap();
            let v = rows.narrow(3, 0, dv).unwrap();
            let f32 = |t: &Tensor| t.to_dtype(DType::F32).unwrap().contiguous().unwrap();
            let want = naive_attention(&q, &f32(&rows), &f32(&v), 0.1, None).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let ours = sdpa(&q, &rows, &v, 0.1, None).unwrap();
            assert_eq!(ours.dims(), &[1, h, 1, dv]);
            let ours = ours.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let diff = common::max_abs_diff(&ours.to_vec1::<f32>().unwrap(), &want);
            assert!(diff < tol, "{dtype:?} h={h} s={s} dk={dk} dv={dv}: {diff}");
        }
    }
}

fn config_error(edit: impl Fn(&mut serde_json::Value)) -> String {
    let path = common::fixture_dir("llama-mha-tied").join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut v);
    let hf: HfConfig = match serde_json::from_value(v) {
        Ok(hf) => hf,
        Err(e) => return e.to_string(),
    };
    hf.validate()
        .expect_err("invalid config accepted")
        .to_string()
}

#[test]
fn impossible_configs_name_the_field() {
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "num_key_value_heads",
            Box::new(|v| v["num_key_value_heads"] = 3.into()),
        ),
        ("hidden_size", Box::new(|v| v["hidden_size"] = 0.into())),
        (
            "num_hidden_layers",
            Box::new(|v| v["num_hidden_layers"] = (-1).into()),
        ),
        ("model_type", Box::new(|v| v["model_type"] = "gpt2".into())),
        (
            "rope_type",
            Box::new(|v| v["rope_parameters"]["rope_type"] = "dynamic".into()),
        ),
        (
            "sliding_window",
            Box::new(|v| {
                v["model_type"] = "qwen2".into();
                v["use_sliding_window"] = true.into();
                v["sliding_window"] = 16.into();
            }),
        ),
        ("hidden_act", Box::new(|v| v["hidden_act"] = "gelu".into())),
    ];
    for (field, edit) in cases {
        let err = config_error(edit);
        assert!(err.contains(field), "{field}: {err}");
    }
}

#[test]
fn both_rope_layouts_resolve_alike() {
    // llama-mqa-llama3 is stored in the older layout; its new-layout twin is in reference.json.
    let dir = common::fixture_dir("llama-mqa-llama3");
    let old = HfConfig::from_file(&dir.join("config.json"))
        .unwrap()
        .validate()
        .unwrap();
    let r = common::reference(&dir.join("reference.json"));
    let new: HfConfig = serde_json::from_value(r["config_new_layout"].clone()).unwrap();
    assert_eq!(old.rope, new.validate().unwrap().rope);
    assert!(matches!(
        old.rope.scaling,
        tiny_decoder::config::RopeScaling::Llama3 { .. }
    ));
}

/// The decode op through a block table (a paged pool, blocks shuffled) gives exactly what it
/// gives over the same rows in order, in f32 and bf16: a block read in several runs adds its
/// rows in the order of one run, so a paged sequence's step equals its step over a cache of
/// its own. Values as wide as the register tiles and with a tail; positions over two of the
/// op's blocks, ending mid-way through a pool block (an odd last run: a row outside the bf16
/// pairs).
#[test]
fn decode_attention_through_a_block_table_equals_in_order() {
    use tiny_decoder::kv_cache::{Pages, BLOCK};
    let dev = Device::Cpu;
    for (h, g, dk, dv) in [(9, 3, 64, 64), (4, 1, 112, 72)] {
        let s: usize = 301;
        let blocks = s.div_ceil(BLOCK) | 1;
        // Block i at 7i mod n: a permutation while 7 does not divide n.
        assert!(!blocks.is_multiple_of(7));
        let table: Vec<u32> = (0..blocks).map(|i| (i * 7 % blocks) as u32).collect();
        let pages = Pages::new(&table, s);
        let q = Tensor::randn(0f32, 1.0, (1, h, 1, dk), &dev).unwrap();
        let pool_k = Tensor::randn(0f32, 1.0, (1, g, blocks * BLOCK, dk), &dev).unwrap();
        let pool_v = Tensor::randn(0f32, 1.0, (1, g, blocks * BLOCK, dv), &dev).unwrap();
        let in_order = |pool: &Tensor| {
            let rows: Vec<Tensor> = (0..s)
                .map(|p| {
                    let at = table[p / BLOCK] as usize * BLOCK + p % BLOCK;
                    pool.narrow(2, at, 1).unwrap()
                })
                .collect();
            Tensor::cat(&rows, 2).unwrap()
        };
        for dtype in [DType::F32, DType::BF16] {
            let (k, v) = (
                pool_k.to_dtype(dtype).unwrap(),
                pool_v.to_dtype(dtype).unwrap(),
            );
            let paged = decode::DecodeAttention {
                scale: 0.2,
                pages: Some(&pages),
            };
            let ours = q.apply_op3_no_bwd(&k, &v, &paged).unwrap();
            let op = decode::DecodeAttention {
                scale: 0.2,
                pages: None,
            };
            let want = q
                .apply_op3_no_bwd(&in_order(&k), &in_order(&v), &op)
                .unwrap();
            let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(flat(ours), flat(want), "{dtype:?} h={h} g={g} dv={dv}");
        }
    }
}

/// Over a bf16 cache, the decode op and a prompt's last row (`sdpa` with its mask) both give
/// the attention of the query rounded to bf16 where the CPU multiplies bf16 pairs (AVX-512
/// BF16), and of the query as it is elsewhere: within 1e-5 of the f32 reference over that
/// query (met by the other query, the prompt row and the step miss it by 4e-4 and 8e-4).
/// Where it multiplies pairs, both also sum the values with their softmax weights rounded to
/// bf16 (as transformers' bf16 attention does, `softmax(..).to(bf16)`), both the weights'
/// numerators, divided by their sum after: within 1e-5 of that reference, which the f32
/// weights miss by 4e-4.
///
/// The inputs come from a fixed seed: drawn afresh (`randn`), about one run in 150 put a
/// numerator so near a bf16 rounding boundary that the prompt's sums, added in another order
/// than the reference's, rounded it to the neighbouring bf16 value (1.3e-5 to 7.8e-5 off).
#[test]
fn a_bf16_cache_meets_the_query_rounded_where_the_cpu_multiplies_pairs() {
    use tiny_decoder::model::linear::simd::{self, Isa};
    let dev = Device::Cpu;
    // Fewer positions than the decode op's block (256): one softmax maximum per head.
    let (h, g, s, d) = (6, 2, 250, 64);
    let q = seeded_normal((1, h, s, d), 1);
    let k = seeded_normal((1, g, s, d), 2);
    let v = seeded_normal((1, g, s, d), 3);
    let bf16 = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
    let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
    let (kb, vb) = (bf16(&k), bf16(&v));
    let pairs = simd::bf16_pairs(Isa::current());
    let q_met = match pairs {
        true => wide(&bf16(&q)),
        false => q.clone(),
    };
    let mask = causal_mask(s, s, usize::MAX, DType::F32, &dev).unwrap();
    let want = naive_attention(&q_met, &wide(&kb), &wide(&vb), 0.125, Some(&mask)).unwrap();
    let want = want.narrow(2, s - 1, 1).unwrap().flatten_all().unwrap();
    let want = want.to_vec1::<f32>().unwrap();
    // The last row again, each weight e = exp(score − max) taken as `weight(e, Σe)`.
    let rows = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (qm, kw, vw) = (rows(&q_met), rows(&wide(&kb)), rows(&wide(&vb)));
    let last_row = |weight: &dyn Fn(f32, f32) -> f32| {
        let mut out = vec![0f32; h * d];
        for (head, out) in out.chunks_exact_mut(d).enumerate() {
            let (qh, kv) = (&qm[(head * s + s - 1) * d..][..d], head / (h / g) * s * d);
            let score = |j: usize| (0..d).map(|i| qh[i] * kw[kv + j * d + i]).sum::<f32>() * 0.125;
            let top = (0..s).map(score).fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = (0..s).map(|j| (score(j) - top).exp()).collect();
            let total: f32 = e.iter().sum();
            for (j, ej) in e.iter().enumerate() {
                for (o, x) in out.iter_mut().zip(&vw[kv + j * d..][..d]) {
                    *o += weight(*ej, total) * x;
                }
            }
        }
        out
    };
    let round = |x: f32| half::bf16::from_f32(x).to_f32();
    let wants = match pairs {
        true => last_row(&|e, total| round(e) / total),
        false => want,
    };
    let prompt = sdpa(&q, &kb, &vb, 0.125, Some(&mask)).unwrap();
    let prompt = prompt.narrow(2, s - 1, 1).unwrap().flatten_all().unwrap();
    let q_last = q.narrow(2, s - 1, 1).unwrap().contiguous().unwrap();
    let step = sdpa(&q_last, &kb, &vb, 0.125, None).unwrap();
    for (how, got, wants) in [
        ("prompt", prompt, &wants),
        ("decode", step.flatten_all().unwrap(), &wants),
    ] {
        let diff = common::max_abs_diff(&got.to_vec1::<f32>().unwrap(), wants);
        assert!(diff < 1e-5, "{how}, pairs {pairs}: {diff}");
    }
}

/// Values of mean 0 and variance 1 (the sum of three of `common::values`, each uniform in
/// [-1, 1)) from `seed`, the same every run.
fn seeded_normal(shape: (usize, usize, usize, usize), seed: u64) -> Tensor {
    let n = shape.0 * shape.1 * shape.2 * shape.3;
    let u = common::values(3 * n, seed);
    let data: Vec<f32> = u.chunks_exact(3).map(|t| t[0] + t[1] + t[2]).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}
