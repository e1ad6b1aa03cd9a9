//! The scores over a bf16 cache where the CPU multiplies bf16 pairs (AVX-512 BF16, Zen 4
//! and 5, Sapphire Rapids), for the query heads that read one K/V head: GQA's group, or
//! MLA's nine heads over one latent row of 128 (`mla:64,rope=64` on SmolLM2).
//!
//! The rows kernel of `simd` (the heads as rows of x, the keys as rows of W) ends each
//! (head, key) dot product in a sum across the 16 lanes of its register: for MLA's 128-wide
//! keys that sum cost as much as the products. Here 16 keys are transposed in registers, 16
//! pairs of each at a time, so that each lane holds one key and each `vdpbf16ps` adds one
//! pair of every key, times a head's pair broadcast: no sums across lanes, and the
//! transpose (64 shuffles per 16 keys × 16 pairs) is shared by all the heads. A last block of
//! fewer than 16 keys is summed from a copy padded with zeros, so a key's score is summed
//! the same way wherever it falls: a paged run, or a block of the op, adds as the whole
//! cache does, bit for bit. And as the prompt's attention does: its keys transposed in
//! memory (`prompt/fused.rs`), each lane one key, the pairs in the same order.

use super::pairs::as_bh;
use std::arch::x86_64::*;

/// Keys per block: the lanes of a register.
const KEYS: usize = 16;
/// Heads per pass at most: 16 transposed pairs and 16 sums in AVX-512's 32 registers.
const HEADS: usize = 16;

/// Blocks of keys ahead of the loads that are asked for, a line with each load, in the
/// order of their addresses. The hardware prefetcher alone followed a block's 16 rows, read
/// a line of each at a time, badly: `mla:64,rope=64`'s op over 30 layers' caches at 6000
/// positions (`probe_decode_attention`, Zen 4) took 112 us a layer before this kernel, 180
/// without the hint, 103-129 asking for each load's line 2 blocks ahead, and 100-120 asking
/// for the lines in order (at 1, 4 and 8 blocks ahead: no better; the whole block at once,
/// 64 requests in a row: 155-162).
const AHEAD: usize = 2;

/// Asks for the cache line at `p` (address arithmetic only).
#[inline(always)]
fn prefetch(p: *const u16) {
    // SAFETY: a prefetch is a hint: it never faults, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
}

/// Whether [`scores`] takes `dk`-wide keys: whole registers of pairs.
pub fn takes(dk: usize) -> bool {
    dk > 0 && dk.is_multiple_of(2 * KEYS)
}

/// `out[h·ld + j]` = q_h · k_j for the heads of `q` (bf16 bits, rows of `dk`) and every
/// row `j` of `k` (rows of `dk`), [`takes`]`(dk)`.
///
/// # Safety
/// The CPU has AVX-512F, BW, VL and BF16; `out` is valid for writes at every `h·ld + j`
/// and nothing else touches them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn scores(q: &[u16], dk: usize, k: &[u16], out: *mut f32, ld: usize) {
    assert!(
        takes(dk),
        "keys of {dk} values are not whole registers of pairs"
    );
    let (heads, n) = (q.len() / dk, k.len() / dk);
    let mut pad = Vec::new();
    let mut h = 0;
    while h < heads {
        // Balanced passes of at most HEADS heads (17 as 9 + 8).
        let g = (heads - h).div_ceil((heads - h).div_ceil(HEADS));
        let qh = &q[h * dk..(h + g) * dk];
        let mut j = 0;
        while j < n {
            let rows = (n - j).min(KEYS);
            let keys = match rows {
                KEYS => &k[j * dk..(j + KEYS) * dk],
                _ => {
                    pad.clear();
                    pad.extend_from_slice(&k[j * dk..n * dk]);
                    pad.resize(KEYS * dk, 0);
                    &pad[..]
                }
            };
            // SAFETY: AVX-512 BF16 as above; `keys` holds KEYS rows, `qh` g rows, and the
            // caller vouches for rows h..h + g of `out` at columns j..j + rows.
            unsafe {
                let at = out.add(h * ld + j);
                match g {
                    1 => block::<1>(qh, dk, keys, at, ld, rows),
                    2 => block::<2>(qh, dk, keys, at, ld, rows),
                    3 => block::<3>(qh, dk, keys, at, ld, rows),
                    4 => block::<4>(qh, dk, keys, at, ld, rows),
                    5 => block::<5>(qh, dk, keys, at, ld, rows),
                    6 => block::<6>(qh, dk, keys, at, ld, rows),
                    7 => block::<7>(qh, dk, keys, at, ld, rows),
                    8 => block::<8>(qh, dk, keys, at, ld, rows),
                    9 => block::<9>(qh, dk, keys, at, ld, rows),
                    10 => block::<10>(qh, dk, keys, at, ld, rows),
                    11 => block::<11>(qh, dk, keys, at, ld, rows),
                    12 => block::<12>(qh, dk, keys, at, ld, rows),
                    13 => block::<13>(qh, dk, keys, at, ld, rows),
                    14 => block::<14>(qh, dk, keys, at, ld, rows),
                    15 => block::<15>(qh, dk, keys, at, ld, rows),
                    _ => block::<16>(qh, dk, keys, at, ld, rows),
                }
            }
            j += rows;
        }
        h += g;
    }
}

/// G heads' scores against 16 keys (rows of `dk`), the first `rows` of them stored.
///
/// # Safety
/// AVX-512 BF16; `q` holds G rows and `k` 16 rows of `dk`; `out` is valid for writes at
/// `h·ld + j` for h < G, j < rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::needless_range_loop)] // const-bound index loops become registers
unsafe fn block<const G: usize>(
    q: &[u16],
    dk: usize,
    k: &[u16],
    out: *mut f32,
    ld: usize,
    rows: usize,
) {
    debug_assert!(q.len() == G * dk && k.len() == KEYS * dk && rows <= KEYS);
    let mut sums = [_mm512_setzero_ps(); G];
    let (qp, kp) = (q.as_ptr(), k.as_ptr());
    let ahead = kp.wrapping_add(AHEAD * KEYS * dk);
    for p0 in (0..dk / 2).step_by(KEYS) {
        // SAFETY: pairs p0..p0 + 16 of each of the 16 rows (p0 + 16 <= dk / 2).
        let rows_of = std::array::from_fn(|j| unsafe {
            prefetch(ahead.wrapping_add(KEYS * 2 * p0 + 32 * j));
            _mm512_loadu_si512(kp.add(j * dk + 2 * p0) as *const __m512i)
        });
        let pairs = transpose(rows_of);
        for i in 0..KEYS {
            let keys = as_bh(pairs[i]);
            for h in 0..G {
                // SAFETY: pair p0 + i of head h (2·(p0 + i) + 1 < dk).
                let pair =
                    unsafe { (qp.add(h * dk + 2 * (p0 + i)) as *const i32).read_unaligned() };
                sums[h] = _mm512_dpbf16_ps(sums[h], keys, as_bh(_mm512_set1_epi32(pair)));
            }
        }
    }
    let mask = match rows {
        KEYS => u16::MAX,
        _ => (1u16 << rows) - 1,
    };
    for h in 0..G {
        // SAFETY: the caller vouches for columns 0..rows of row h.
        unsafe { _mm512_mask_storeu_ps(out.add(h * ld), mask, sums[h]) };
    }
}

/// A 16 × 16 transpose of 32-bit lanes: lane j of result i is lane i of `r[j]` (pair i of
/// key j).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn transpose(r: [__m512i; 16]) -> [__m512i; 16] {
    // Within each 128-bit lane L: a[2j] = keys 2j, 2j + 1 of pairs 4L, 4L + 1 interleaved,
    // a[2j + 1] of pairs 4L + 2, 4L + 3.
    let a: [__m512i; 16] = std::array::from_fn(|i| match i % 2 {
        0 => _mm512_unpacklo_epi32(r[i], r[i + 1]),
        _ => _mm512_unpackhi_epi32(r[i - 1], r[i]),
    });
    // b[4j + c], lane L: keys 4j..4j + 4 of pair 4L + c.
    let b: [__m512i; 16] = std::array::from_fn(|i| {
        let (j, c) = (i / 4, i % 4);
        let (x, y) = (a[4 * j + c / 2], a[4 * j + 2 + c / 2]);
        match c % 2 {
            0 => _mm512_unpacklo_epi64(x, y),
            _ => _mm512_unpackhi_epi64(x, y),
        }
    });
    // Lanes 0 and 2, or 1 and 3, of two groups of keys, then of all four: pair 4L + c has
    // keys 4m..4m + 4 in lane m.
    let even = |x, y| _mm512_shuffle_i32x4::<0x88>(x, y);
    let odd = |x, y| _mm512_shuffle_i32x4::<0xDD>(x, y);
    let mut t = [_mm512_setzero_si512(); 16];
    for c in 0..4 {
        let (lo02, lo13) = (even(b[c], b[4 + c]), odd(b[c], b[4 + c]));
        let (hi02, hi13) = (even(b[8 + c], b[12 + c]), odd(b[8 + c], b[12 + c]));
        t[c] = even(lo02, hi02);
        t[8 + c] = odd(lo02, hi02);
        t[4 + c] = even(lo13, hi13);
        t[12 + c] = odd(lo13, hi13);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::linear::simd::{self, Isa};

    /// Against the plain sum in f64 of the same bf16 values: 1-17 heads (passes of 16 and
    /// less), key counts with a last block of 1-15 (and none), widths of 32 to 256, rows of
    /// scores further apart than they are long; and every score bit for bit as the keys
    /// scored in two runs split anywhere.
    #[test]
    fn transposed_scores_equal_the_plain_sum() {
        if !simd::bf16_pairs(Isa::detect()) {
            eprintln!("SKIPPED: this CPU lacks AVX-512 BF16");
            return;
        }
        let mut seed = 11u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0;
            half::bf16::from_f32(x).to_bits()
        };
        let wide = |b: u16| f32::from_bits((b as u32) << 16) as f64;
        for (heads, n, dk) in [
            (9, 100, 128),
            (3, 16, 64),
            (1, 1, 32),
            (17, 33, 256),
            (5, 47, 96),
            (16, 31, 64),
            (2, 300, 192),
        ] {
            let q: Vec<u16> = (0..heads * dk).map(|_| next()).collect();
            let k: Vec<u16> = (0..n * dk).map(|_| next()).collect();
            let ld = n + 3;
            let mut ours = vec![f32::NAN; heads * ld];
            // SAFETY: checked above; ours holds heads rows of ld >= n.
            unsafe { scores(&q, dk, &k, ours.as_mut_ptr(), ld) };
            for h in 0..heads {
                for j in 0..n {
                    let want: f64 = (0..dk)
                        .map(|i| wide(q[h * dk + i]) * wide(k[j * dk + i]))
                        .sum();
                    let got = ours[h * ld + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (dk as f64).sqrt(),
                        "{heads} heads, {n} keys of {dk}: head {h} key {j}: {got} vs {want}"
                    );
                }
                assert!(ours[h * ld + n..(h + 1) * ld].iter().all(|s| s.is_nan()));
            }
            for cut in [1, n / 2, n - 1].into_iter().filter(|&c| c > 0 && c < n) {
                let mut split = vec![0f32; heads * ld];
                // SAFETY: as above, the second run's columns from `cut`.
                unsafe {
                    scores(&q, dk, &k[..cut * dk], split.as_mut_ptr(), ld);
                    scores(&q, dk, &k[cut * dk..], split.as_mut_ptr().add(cut), ld);
                }
                for h in 0..heads {
                    let (a, b) = (&ours[h * ld..h * ld + n], &split[h * ld..h * ld + n]);
                    let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(
                        same,
                        "{heads} heads, {n} keys cut at {cut}: head {h} differs"
                    );
                }
            }
        }
    }
}
