//! The sampler against a naive reference (softmax with `f32::exp`, sort the whole vocabulary,
//! filter: the sampler as first written), on random logits with ties, and an ignored
//! benchmark at Qwen's vocabulary size:
//! `cargo test --release --test sampling -- --ignored --nocapture`.

use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;
use tiny_decoder::sampling::{filtered_probs, softmax, Sampler, SamplingParams};

/// Softmax as first written: `f32::exp` and one running sum.
fn naive_softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits
        .iter()
        .map(|&l| ((l - max) / temperature).exp())
        .collect();
    let total: f32 = exps.iter().sum();
    exps.iter().map(|e| e / total).collect()
}

/// The filters as first written: sort every token, then truncate.
fn naive_filter(probs: &[f32], top_k: usize, top_p: f32, min_p: f32) -> Vec<(u32, f32)> {
    let mut probs: Vec<(u32, f32)> = (0u32..).zip(probs.iter().copied()).collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if top_k > 0 && top_k < probs.len() {
        probs.truncate(top_k);
        let kept: f32 = probs.iter().map(|(_, p)| p).sum();
        probs.iter_mut().for_each(|(_, p)| *p /= kept);
    }
    if top_p < 1.0 {
        let mut mass = 0.0;
        let n = probs
            .iter()
            .take_while(|(_, p)| {
                let before = mass;
                mass += p;
                before < top_p
            })
            .count();
        probs.truncate(n.max(1));
    }
    if min_p > 0.0 {
        let threshold = min_p * probs[0].1;
        probs.retain(|&(_, p)| p >= threshold);
    }
    probs
}

/// The reference sampler on `probs`: per token one uniform draw times `mass(survivors)`,
/// walked down all the survivors sorted. As first written, `mass` was the running sum.
fn naive_draws(
    probs: &[f32],
    p: &SamplingParams,
    n: usize,
    mass: impl Fn(&[(u32, f32)]) -> f32,
) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let kept = naive_filter(probs, p.top_k, p.top_p, p.min_p);
    (0..n)
        .map(|_| {
            let mut u: f32 = rng.random::<f32>() * mass(&kept);
            for &(id, p) in &kept {
                if u < p {
                    return id;
                }
                u -= p;
            }
            kept.last().map_or(0, |&(id, _)| id)
        })
        .collect()
}

fn running_sum(kept: &[(u32, f32)]) -> f32 {
    kept.iter().map(|(_, p)| p).sum()
}

/// How the sampler sums all the probabilities when no filter is on: in id order, over 8
/// lanes. (Any sum is a valid scale for the draw; this one makes the draws comparable.)
fn lane_sum(probs: &[f32]) -> f32 {
    let chunks = probs.chunks_exact(8);
    let rest: f32 = chunks.remainder().iter().fold(0.0, |a, &x| a + x);
    let mut lanes = [0.0f32; 8];
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane += x;
        }
    }
    lanes.into_iter().fold(rest, |a, b| a + b)
}

/// `n` normally distributed logits of spread `scale`, rounded to multiples of `step` so that
/// many tokens tie, as bf16 logits do.
fn random_logits(rng: &mut StdRng, n: usize, scale: f32, step: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            // Box-Muller; 1 - u keeps the logarithm finite.
            let (u, v) = (1.0 - rng.random::<f32>(), rng.random::<f32>());
            let l = (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos() * scale;
            match step {
                0.0 => l,
                s => (l / s).round() * s,
            }
        })
        .collect()
}

/// (temperature, top_k, top_p, min_p) covering each filter alone and together.
const SETTINGS: [(f32, usize, f32, f32); 14] = [
    (1.0, 0, 1.0, 0.0),
    (0.8, 40, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.9, 0.0),
    (0.7, 0, 0.5, 0.0),
    (1.5, 0, 0.999, 0.0),
    (1.0, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 1e-6),
    (0.8, 40, 0.95, 0.05),
    (1.0, 0, 0.9, 0.05),
    (1.0, 500, 0.9, 0.0),
    (1.0, 5000, 1.0, 0.0),
    (2.0, 0, 0.99, 1e-4),
    (1.0, 3, 0.0001, 1.0),
];

/// Random logits: several spreads, some rounded so that many tokens tie, one long enough for
/// hundreds of the top-k blocks.
fn logit_sets() -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(1);
    [
        (3000, 1.0, 0.0),
        (3000, 4.0, 0.125),
        (700, 8.0, 0.5),
        (20_000, 3.0, 0.0),
    ]
    .into_iter()
    .map(|(n, scale, step)| random_logits(&mut rng, n, scale, step))
    .collect()
}

/// The filters keep exactly what sorting the whole vocabulary keeps, with the same
/// probabilities, from the same softmax.
#[test]
fn filters_equal_sorting_everything() {
    for logits in logit_sets() {
        let n = logits.len();
        for (t, k, p, m) in SETTINGS {
            let want = naive_filter(&softmax(&logits, t), k, p, m);
            let got = filtered_probs(&logits, t, k, p, m);
            assert!(
                got == want,
                "n={n} t={t} k={k} p={p} m={m}: survivors differ"
            );
        }
    }
}

/// The vectorised softmax is the exact one (in f64) to float rounding, as `f32::exp` with
/// one running sum is; -inf logits get exactly 0.
#[test]
fn softmax_equals_f64_reference() {
    for mut logits in logit_sets() {
        logits[5] = f32::NEG_INFINITY;
        logits[6] = logits[7] - 200.0;
        for t in [0.3, 1.0, 2.0] {
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let exps: Vec<f64> = logits
                .iter()
                .map(|&l| ((l as f64 - max) / t as f64).exp())
                .collect();
            let total: f64 = exps.iter().sum();
            let got = softmax(&logits, t);
            assert_eq!((got[5], got[6]), (0.0, 0.0));
            let worst = |probs: &[f32]| {
                let errs = probs.iter().zip(&exps).filter(|(_, &e)| e / total > 1e-30);
                errs.map(|(&p, &e)| (p as f64 / (e / total) - 1.0).abs())
                    .fold(0.0, f64::max)
            };
            let (new, old) = (worst(&got), worst(&naive_softmax(&logits, t)));
            assert!(
                new < 1e-5,
                "t={t}: relative error {new:e} (f32::exp: {old:e})"
            );
        }
    }
}

/// Old against new, end to end: the sampler as first written (`f32::exp`, sort everything)
/// and the filters now draw from the same distribution, to float rounding (which can move a
/// top-p or min-p boundary by a token of tiny probability, hence a total variation bound).
#[test]
fn same_distribution_as_first_written() {
    for logits in logit_sets() {
        for (t, k, p, m) in SETTINGS {
            let old = naive_filter(&naive_softmax(&logits, t), k, p, m);
            let new = filtered_probs(&logits, t, k, p, m);
            // Draws are proportional to the survivors' probabilities.
            let mut dist = vec![0.0f64; logits.len()];
            for (survivors, sign) in [(&old, 1.0), (&new, -1.0)] {
                let mass: f32 = survivors.iter().map(|(_, p)| p).sum();
                for &(id, p) in survivors.iter() {
                    dist[id as usize] += sign * (p / mass) as f64;
                }
            }
            let tv = dist.iter().map(|d| d.abs()).sum::<f64>() / 2.0;
            let case = format!("n={} t={t} k={k} p={p} m={m}", logits.len());
            assert!(tv < 1e-4, "{case}: total variation {tv:e}");
        }
    }
}

/// Same seed, same tokens as the reference sampler, filtered or not (unfiltered, the draw
/// sorts only as far down as it walks).
#[test]
fn seeded_draws_equal_the_naive_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    for logits in [
        random_logits(&mut rng, 2000, 3.0, 0.25),
        random_logits(&mut rng, 5000, 1.0, 0.0),
    ] {
        for (t, k, p, m) in SETTINGS {
            let params = SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                min_p: m,
                seed: 11,
                ..Default::default()
            };
            let mut sampler = Sampler::new(&params).unwrap();
            let got: Vec<u32> = (0..200).map(|_| sampler.sample(&logits, &[])).collect();
            let probs = softmax(&logits, t);
            let filtered = (k > 0 && k < logits.len()) || p < 1.0 || m > 0.0;
            let mass = |kept: &[(u32, f32)]| match filtered {
                true => running_sum(kept),
                false => lane_sum(&probs),
            };
            let want = naive_draws(&probs, &params, 200, mass);
            assert_eq!(got, want, "t={t} k={k} p={p} m={m}");
        }
    }
}

/// The draws of tests/units.rs' seeded test, token for token those of the sampler as first
/// written (`f32::exp`, every token sorted).
#[test]
fn unit_test_draws_as_first_written() {
    let logits = [0.1, 3.0, 0.2, 2.9];
    for (seed, top_k) in [(7, 0), (8, 0), (7, 1), (7, 3)] {
        let params = SamplingParams {
            temperature: 1.0,
            top_k,
            seed,
            ..Default::default()
        };
        let mut sampler = Sampler::new(&params).unwrap();
        let got: Vec<u32> = (0..64).map(|_| sampler.sample(&logits, &[])).collect();
        let want = naive_draws(&naive_softmax(&logits, 1.0), &params, 64, running_sum);
        assert_eq!(got, want, "seed {seed} top-k {top_k}");
    }
}

/// Microseconds per `sample` at a 152,064-entry vocabulary (Qwen2's), release mode.
#[test]
#[ignore = "benchmark: run with --release --ignored --nocapture"]
fn bench_sample_at_qwen_vocabulary() {
    let mut rng = StdRng::seed_from_u64(3);
    let vocab = 152_064;
    // "peaked": like a confident model, a handful of tokens far above the rest; "medium": a
    // nucleus of hundreds; "flat": a stress case, tens of thousands of tokens in the nucleus.
    let mut peaked = random_logits(&mut rng, vocab, 1.5, 0.0);
    for (i, boost) in [(17, 16.0), (4242, 15.0), (99_000, 14.0), (123, 12.0)] {
        peaked[i] += boost;
    }
    let medium = random_logits(&mut rng, vocab, 4.0, 0.0);
    let flat = random_logits(&mut rng, vocab, 2.0, 0.0);
    let runs = [
        ("greedy", 0.0, 0, 1.0, 0.0),
        ("temperature 0.8 only", 0.8, 0, 1.0, 0.0),
        ("top-p 0.9", 1.0, 0, 0.9, 0.0),
        (
            "top-k 40, top-p 0.95, min-p 0.05, t 0.8",
            0.8,
            40,
            0.95,
            0.05,
        ),
        ("min-p 0.05", 1.0, 0, 1.0, 0.05),
    ];
    for (name, logits) in [("peaked", &peaked), ("medium", &medium), ("flat", &flat)] {
        for (label, temperature, top_k, top_p, min_p) in runs {
            let params = SamplingParams {
                temperature,
                top_k,
                top_p,
                min_p,
                ..Default::default()
            };
            let kept = match temperature {
                0.0 => 1,
                t => filtered_probs(logits, t, top_k, top_p, min_p).len(),
            };
            let mut sampler = Sampler::new(&params).unwrap();
            let iters = 30;
            let mut times: Vec<f64> = (0..iters)
                .map(|_| {
                    let start = Instant::now();
                    std::hint::black_box(sampler.sample(logits, &[]));
                    start.elapsed().as_secs_f64() * 1e6
                })
                .collect();
            times.sort_by(f64::total_cmp);
            println!(
                "{name:6} {label:42} {:9.1} µs median ({:9.1} min), {kept} kept",
                times[iters / 2],
                times[0]
            );
        }
    }
}
