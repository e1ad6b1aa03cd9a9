//! The sampler against a naive reference (softmax, sort the whole vocabulary, filter), on
//! random logits with ties, and an ignored benchmark at Qwen's vocabulary size:
//! `cargo test --release --test sampling -- --ignored --nocapture`.

use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::Instant;
use tiny_decoder::sampling::{filtered_probs, Sampler, SamplingParams};

/// The sampler's filters as they were first written: sort everything, then truncate.
fn naive_filtered_probs(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
) -> Vec<(u32, f32)> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l - max) / temperature).exp()))
        .collect();
    let total: f32 = probs.iter().map(|(_, p)| p).sum();
    probs.iter_mut().for_each(|(_, p)| *p /= total);
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

/// The reference sampler: one uniform draw per token, walked down the sorted survivors.
fn naive_draws(logits: &[f32], p: &SamplingParams, n: usize) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(p.seed);
    (0..n)
        .map(|_| {
            let probs = naive_filtered_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p);
            let mut u: f32 = rng.random::<f32>() * probs.iter().map(|(_, p)| p).sum::<f32>();
            for &(id, p) in &probs {
                if u < p {
                    return id;
                }
                u -= p;
            }
            probs.last().map_or(0, |&(id, _)| id)
        })
        .collect()
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

fn is_filtered(n: usize, top_k: usize, top_p: f32, min_p: f32) -> bool {
    (top_k > 0 && top_k < n) || top_p < 1.0 || min_p > 0.0
}

#[test]
fn filters_equal_the_naive_reference_on_random_logits() {
    let mut rng = StdRng::seed_from_u64(1);
    for (n, scale, step) in [(3000, 1.0, 0.0), (3000, 4.0, 0.125), (700, 8.0, 0.5)] {
        let logits = random_logits(&mut rng, n, scale, step);
        for (t, k, p, m) in SETTINGS {
            let want = naive_filtered_probs(&logits, t, k, p, m);
            let mut got = filtered_probs(&logits, t, k, p, m);
            let case = format!("n={n} scale={scale} t={t} k={k} p={p} m={m}");
            if !is_filtered(n, k, p, m) {
                // Unfiltered, the order is free: compare as sets.
                got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            }
            assert_eq!(got.len(), want.len(), "{case}");
            assert!(got == want, "{case}: survivors or probabilities differ");
        }
    }
}

#[test]
fn seeded_draws_equal_the_naive_reference() {
    let mut rng = StdRng::seed_from_u64(2);
    let logits = random_logits(&mut rng, 2000, 3.0, 0.25);
    for (t, k, p, m) in SETTINGS {
        if !is_filtered(logits.len(), k, p, m) {
            continue; // unfiltered draws walk the tokens in another order
        }
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
        assert_eq!(
            got,
            naive_draws(&logits, &params, 200),
            "t={t} k={k} p={p} m={m}"
        );
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
