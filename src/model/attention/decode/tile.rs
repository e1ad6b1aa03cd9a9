//! The two inner loops of decode attention after the scores: a row's softmax numerators
//! (`exp(s·scale − max)`, by a polynomial the compiler vectorizes, not libm's `expf` per
//! value) and the value sum `acc (M, Dv) += p (M, L) · v (L, Dv)` in register tiles.
//!
//! (Where the CPU multiplies bf16 pairs, a bf16 cache's value sum is `pairs`' instead.)
//!
//! Both are plain Rust over fixed-size arrays, compiled once per instruction set with
//! `target_feature`, so that LLVM keeps a tile's accumulators in registers: MR query heads ×
//! CH values of Dv, across every cached row of the block, each row of v read once per MR
//! heads. (The loop it replaces kept each head's Dv sums in memory, a load and a store per
//! multiply-add, and read v once per head: 45% of a decode step's attention time with MLA's
//! nine heads per latent.) Tested against the plain loops in `tests` below.

use super::Cached;
use crate::model::linear::simd::{Isa, IsaKind};

/// `acc (M, Dv) += p (M, L) · v (L, Dv)`, row j of v at `v[j·vs..j·vs + dv]`; M = acc / Dv
/// and L = p / M.
pub fn accumulate<T: Cached>(
    isa: Isa,
    p: &[f32],
    v: &[T],
    (dv, vs): (usize, usize),
    acc: &mut [f32],
) {
    if dv == 0 || acc.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let (Some(v), true) = (T::bf16_bits(v), crate::model::linear::simd::bf16_pairs(isa)) {
        // SAFETY: `bf16_pairs` asked the CPU for AVX-512 BF16.
        return unsafe { super::pairs::accumulate(isa, p, v, (dv, vs), acc) };
    }
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: an `Isa` of this kind exists only on a CPU with AVX-512.
        IsaKind::Avx512 => unsafe { accumulate_avx512(p, v, (dv, vs), acc) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, an `Isa` of this kind exists only with AVX2 and FMA.
        IsaKind::Avx2 => unsafe { accumulate_avx2(p, v, (dv, vs), acc) },
        #[cfg(target_arch = "aarch64")]
        IsaKind::Neon => T::accumulate_neon(p, v, (dv, vs), acc),
        _ => tiles::<T, 1, 16, false>(p, v, (dv, vs), acc),
    }
}

/// Four heads × 64 values: 16 of AVX-512's 32 registers hold the sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn accumulate_avx512<T: Cached>(p: &[f32], v: &[T], d: (usize, usize), acc: &mut [f32]) {
    tiles::<T, 4, 64, true>(p, v, d, acc)
}

/// Two heads × 32 values: 8 of AVX2's 16 registers hold the sums.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2<T: Cached>(p: &[f32], v: &[T], d: (usize, usize), acc: &mut [f32]) {
    tiles::<T, 2, 32, true>(p, v, d, acc)
}

/// The value sum in tiles of MR heads × CH values; the heads past a multiple of MR one at a
/// time, the values past a multiple of CH by the plain loop. `FMA`: fused multiply-adds
/// (Rust never fuses `a * b + c` by itself; without the FMA unit `mul_add` is a libm call).
#[inline(always)]
fn tiles<T: Cached, const MR: usize, const CH: usize, const FMA: bool>(
    p: &[f32],
    v: &[T],
    (dv, vs): (usize, usize),
    acc: &mut [f32],
) {
    let m = acc.len() / dv;
    let l = p.len() / m;
    // Heads in tiles of MR, or of MR − 1 where that divides them (nine heads as 3 × 3, not
    // 4 + 4 + 1), the rest in pairs and ones. A loop, not a closure: closures in
    // `target_feature` code are compiled without the features (`mul_add` became a call).
    let first = match !m.is_multiple_of(MR) && MR > 2 && m.is_multiple_of(MR - 1) {
        true => MR - 1,
        false => MR,
    };
    let mut h = 0;
    while h < m {
        let rows = match m - h {
            left if left >= first => first,
            left => left.min(2),
        };
        let (p, acc) = (&p[h * l..(h + rows) * l], &mut acc[h * dv..(h + rows) * dv]);
        match rows {
            4 => tile::<T, 4, CH, FMA>(p, v, (dv, vs), acc),
            3 => tile::<T, 3, CH, FMA>(p, v, (dv, vs), acc),
            2 => tile::<T, 2, CH, FMA>(p, v, (dv, vs), acc),
            _ => tile::<T, 1, CH, FMA>(p, v, (dv, vs), acc),
        }
        h += rows;
    }
}

/// MR heads (rows of p and acc) over every row of v: CH values at a time in a local tile.
/// (`tiles` calls it with MR up to its own, at most 4.)
#[inline(always)]
fn tile<T: Cached, const MR: usize, const CH: usize, const FMA: bool>(
    p: &[f32],
    v: &[T],
    (dv, vs): (usize, usize),
    acc: &mut [f32],
) {
    let l = p.len() / MR;
    let mut c = 0;
    while c + CH <= dv {
        // From acc, not 0: a block read in several runs (a paged cache) adds its rows in the
        // order of one run. (These two closures only copy and widen; it is a `mul_add` in a
        // closure that loses the target features, see `tiles`.)
        let mut sums: [[f32; CH]; MR] =
            std::array::from_fn(|r| acc[r * dv + c..][..CH].try_into().expect("CH values"));
        for j in 0..l {
            let row: &[T; CH] = v[j * vs + c..j * vs + c + CH]
                .try_into()
                .expect("CH values");
            // Widened once for the MR heads (in the loop below LLVM widened it per head).
            let row: [f32; CH] = std::array::from_fn(|i| row[i].widen());
            for (r, sum) in sums.iter_mut().enumerate() {
                let pj = p[r * l + j];
                for (s, x) in sum.iter_mut().zip(&row) {
                    *s = madd::<FMA>(pj, *x, *s);
                }
            }
        }
        for (r, sum) in sums.iter().enumerate() {
            acc[r * dv + c..r * dv + c + CH].copy_from_slice(sum);
        }
        c += CH;
    }
    // The last dv % CH values (none, usually: an empty pass over every row still cost a
    // fifth of the op's time).
    if c == dv {
        return;
    }
    for r in 0..MR {
        for j in 0..l {
            let pj = p[r * l + j];
            for (a, x) in acc[r * dv + c..(r + 1) * dv]
                .iter_mut()
                .zip(&v[j * vs + c..])
            {
                *a += pj * x.widen();
            }
        }
    }
}

/// a·b + c, fused when `FMA`.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    match FMA {
        true => a.mul_add(b, c),
        false => a * b + c,
    }
}

/// Replaces a row of raw scores s by `exp(s·scale − max)`; returns (max, Σ) where max is
/// the largest `s·scale`.
pub fn softmax_row(isa: Isa, row: &mut [f32], scale: f32) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    match isa.kind() {
        // SAFETY: an `Isa` of this kind exists only on a CPU with AVX-512.
        IsaKind::Avx512 => return unsafe { softmax_avx512(row, scale) },
        // SAFETY: as above, with AVX2 and FMA.
        IsaKind::Avx2 => return unsafe { softmax_avx2(row, scale) },
        _ => {}
    }
    // Elsewhere (NEON is aarch64's baseline) the plain loop, vectorized as it is.
    let _ = isa;
    softmax_plain(row, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
unsafe fn softmax_avx512(row: &mut [f32], scale: f32) -> (f32, f32) {
    softmax_plain(row, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_avx2(row: &mut [f32], scale: f32) -> (f32, f32) {
    softmax_plain(row, scale)
}

/// Sixteen lanes of partial maxima and sums, so the loops vectorize (a single running
/// value would be a chain the compiler must keep in order).
#[inline(always)]
fn softmax_plain(row: &mut [f32], scale: f32) -> (f32, f32) {
    const N: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; N];
    let mut chunks = row.chunks_exact(N);
    for c in &mut chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = m.max(x * scale);
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |a, &x| a.max(x * scale));
    let max = lanes.iter().fold(tail, |a, &m| a.max(m));
    let mut sums = [0f32; N];
    let mut chunks = row.chunks_exact_mut(N);
    for c in &mut chunks {
        for (s, x) in sums.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x * scale - max);
            *s += *x;
        }
    }
    let mut total = 0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x * scale - max);
        total += *x;
    }
    (max, total + sums.iter().sum::<f32>())
}

/// e^x for x ≤ 0 (a softmax's shifted scores), within a few ulp of libm's over [−87, 0];
/// below −87 (where e^x is subnormal or 0) it gives e^−87 ≈ 1.6e−38. Cody-Waite:
/// x = n·ln2 + r, |r| ≤ ln2/2, e^r by its degree-6 Taylor polynomial, 2^n put into the
/// exponent bits. Branch-free so that a loop of it vectorizes.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // 1.5 · 2^23: adding it rounds x·log2(e) to an integer (to nearest, ties to even) and
    // leaves that integer in the low bits, so 2^n is built with integer ops (`n as i32` is a
    // saturating cast, which LLVM does one lane at a time: a third of the softmax's time).
    const SHIFT: f32 = 12_582_912.0;
    let x = x.max(-87.0);
    let shifted = x * std::f32::consts::LOG2_E + SHIFT;
    let n = shifted - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // n is in [−126, 0]: 2^n is a normal float.
    let n_bits = shifted.to_bits().wrapping_sub(SHIFT.to_bits()); // n as i32's bits
    let two_n = f32::from_bits(n_bits.wrapping_add(127) << 23);
    p * two_n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_a_few_ulp_of_libm() {
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (ours, want) = (exp(x), x.exp());
            let err = (ours - want).abs() / want;
            assert!(err < 4.0 * f32::EPSILON, "exp({x}) = {ours}, libm {want}");
            x += 0.0137;
        }
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37);
    }

    #[test]
    fn softmax_row_matches_the_plain_formula() {
        let row: Vec<f32> = (0..37).map(|i| ((i * 7919) % 23) as f32 - 11.0).collect();
        for isa in Isa::supported() {
            let mut ours = row.clone();
            let (max, sum) = softmax_row(isa, &mut ours, 0.3);
            let want_max = row.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x * 0.3));
            assert_eq!(max, want_max);
            let want: Vec<f32> = row.iter().map(|&x| (x * 0.3 - want_max).exp()).collect();
            for (o, w) in ours.iter().zip(&want) {
                assert!((o - w).abs() <= 1e-6 * w.max(1e-30), "{o} vs {w}");
            }
            assert!((sum - want.iter().sum::<f32>()).abs() < 1e-5);
        }
    }
}
