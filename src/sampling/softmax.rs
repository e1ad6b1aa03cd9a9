//! The softmax over a whole vocabulary, in passes written to vectorise: the largest logit,
//! the exponentials (a polynomial `exp`, compiled for AVX2 as well), their sum. At 152k
//! entries `f32::exp` alone took 0.5 ms, as long as all of sampling should.

/// Probabilities at `temperature` (> 0), in id order.
pub fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let mut probs = vec![0.0; logits.len()];
    exps(logits, max_of(logits), temperature, &mut probs);
    let total = sum_of(&probs);
    probs.iter_mut().for_each(|p| *p /= total);
    probs
}

/// The largest value (NaN never wins; -inf for none).
pub(super) fn max_of(xs: &[f32]) -> f32 {
    let bigger = |m: f32, x: f32| if x > m { x } else { m };
    fold_lanes(xs, f32::NEG_INFINITY, bigger, bigger)
}

/// The sum (over 8 lanes: not the running sum's rounding).
pub(super) fn sum_of(xs: &[f32]) -> f32 {
    fold_lanes(xs, 0.0, |sum, x| sum + x, |a, b| a + b)
}

/// Folds `xs` with `step` into 8 independent lanes, then merges the lanes: a single running
/// value would chain every step on the one before and not vectorise.
fn fold_lanes(
    xs: &[f32],
    init: f32,
    step: impl Fn(f32, f32) -> f32,
    merge: impl Fn(f32, f32) -> f32,
) -> f32 {
    let mut lanes = [init; 8];
    let chunks = xs.chunks_exact(8);
    let rest = chunks.remainder().iter().fold(init, |a, &x| step(a, x));
    for chunk in chunks {
        for (lane, &x) in lanes.iter_mut().zip(chunk) {
            *lane = step(*lane, x);
        }
    }
    lanes.into_iter().fold(rest, merge)
}

/// `out[i] = e^((logits[i] - max) / temperature)`, compiled for the baseline (SSE2, 4 lanes)
/// and for AVX2 (8 lanes, twice as fast here), picked at run time. Same results from both.
pub(super) fn exps(logits: &[f32], max: f32, temperature: f32, out: &mut [f32]) {
    #[inline(always)]
    fn run(logits: &[f32], max: f32, temperature: f32, out: &mut [f32]) {
        for (o, &l) in out.iter_mut().zip(logits) {
            *o = exp((l - max) / temperature);
        }
    }
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn avx2(logits: &[f32], max: f32, temperature: f32, out: &mut [f32]) {
        run(logits, max, temperature, out)
    }
    #[cfg(target_arch = "x86_64")]
    if crate::model::linear::simd::Isa::current().has_avx2() {
        // SAFETY: this CPU has AVX2 (and TINY_DECODER_ISA did not rule it out).
        return unsafe { avx2(logits, max, temperature, out) };
    }
    run(logits, max, temperature, out)
}

/// e^x for x <= 0, within about 1 ulp of `f32::exp`, 0 below -87 (where f32 runs out),
/// branch-free so that it vectorises: Cephes' expf, e^x = 2^n · e^f with |f| <= ln 2 / 2.
#[inline(always)]
fn exp(x: f32) -> f32 {
    // 1.5 · 2^23: adding it rounds to an integer, which lands in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    let big = x * std::f32::consts::LOG2_E + SHIFT;
    let n = big - SHIFT;
    let f = x - n * 0.693_359_4 + n * 2.121_944_4e-4; // x - n · ln 2, in two parts
    let p = ((((1.987_569_1e-4 * f + 1.398_2e-3) * f + 8.333_452e-3) * f + 4.166_579_6e-2) * f
        + 0.166_666_65)
        * f
        + 0.5;
    let e = p * f * f + f + 1.0;
    let two_n = big.to_bits().wrapping_sub(SHIFT.to_bits()) << 23; // n into the exponent field
    if x >= -87.0 {
        f32::from_bits(e.to_bits().wrapping_add(two_n))
    } else if x < -87.0 {
        0.0
    } else {
        x // NaN
    }
}
