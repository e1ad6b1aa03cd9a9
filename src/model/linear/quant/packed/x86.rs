//! The packed layout's kernel on AVX2 ([`super`]): per group of 8 weight rows and block of
//! 32 columns, the integer sums of the 8 rows are one vector, for `RX` rows of x at once.
//!
//! Nibbles: each 32-byte load is 4 quant bytes of each of the 8 rows; its low nibbles
//! (weights `4v..4v + 4`) and high nibbles (`16 + 4v..`) go through `maddubs` against x's
//! matching 4 bytes, broadcast to every lane, and the block's 8 products add up in 16 bits
//! (at most 8 · 2 · 15 · 127 = 30,480), then pairs to 32 bits once per block; Q5's fifth
//! bits are put at bit 4 of each byte first (one shift and one mask per load, from their
//! rearranged word), and its sums go to 32 bits every second load. Q8_0: the
//! weights are signed, so `maddubs` takes |w| and sign(w)·x (llama.cpp's sign trick), and
//! its 16-bit pairs (up to 2 · 128 · 127) go to 32 bits after each load.
//! Then one FMA by the 8 rows' `d` times `dx`, and one by their minimum (Q4_0's `-8d`,
//! Q5_0's `-16d`, Q4_1's and Q5_1's `m`) times x's block sum `dx · Σq`.

use super::super::{Format, QRows, QWeight, BLOCK};
use super::ROWS;
use std::arch::x86_64::*;

const Q8_0: u8 = 0;
const Q4_0: u8 = 1;
const Q4_1: u8 = 2;
const Q5_0: u8 = 3;
const Q5_1: u8 = 4;
const Q4K: u8 = 5;
const Q6K: u8 = 6;

/// Rows of x a tile takes at once.
const RX: usize = 4;

/// Groups `g0..g1` of 8 weight rows of `y (M, w.rows) = x · wᵀ`, every row of x.
///
/// # Safety
/// AVX2, FMA and F16C; `w` is packed and its blocks match its shape (`QWeight::product`
/// checks it); `g0 <= g1 <=` its groups; `x` holds M rows of `w`'s width; `y` is valid for
/// writes at `i · w.rows + r` for i < M and `8 · g0 <= r < min(8 · g1, w.rows)`, which
/// nothing else touches meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows(w: &QWeight, groups: (usize, usize), x: &QRows, y: *mut f32) {
    debug_assert!(w.packed && x.cols == w.cols);
    // SAFETY: the caller's.
    unsafe {
        match w.format {
            Format::Q8_0 => rows_in::<Q8_0>(w, groups, x, y),
            Format::Q4_0 => rows_in::<Q4_0>(w, groups, x, y),
            Format::Q4_1 => rows_in::<Q4_1>(w, groups, x, y),
            Format::Q5_0 => rows_in::<Q5_0>(w, groups, x, y),
            Format::Q5_1 => rows_in::<Q5_1>(w, groups, x, y),
            Format::Q4K => rows_in::<Q4K>(w, groups, x, y),
            Format::Q6K => rows_in::<Q6K>(w, groups, x, y),
            _ => unreachable!("{:?} is never packed", w.format),
        }
    }
}

/// [`rows`] for one format.
///
/// # Safety
/// As [`rows`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_in<const F: u8>(w: &QWeight, (g0, g1): (usize, usize), x: &QRows, y: *mut f32) {
    let m = x.quants.len() / w.cols;
    for g in g0..g1 {
        let mut i = 0;
        while i + RX <= m {
            // SAFETY: rows i..i + RX of x exist; group g is the caller's.
            unsafe {
                match F {
                    Q4K => super::q4k::x86::tile::<RX>(w, g, x, i, y),
                    Q6K => super::q6k::x86::tile::<RX>(w, g, x, i, y),
                    _ => tile::<F, RX>(w, g, x, i, y),
                }
            }
            i += RX;
        }
        for i in i..m {
            // SAFETY: row i of x exists; group g is the caller's.
            unsafe {
                match F {
                    Q4K => super::q4k::x86::tile::<1>(w, g, x, i, y),
                    Q6K => super::q6k::x86::tile::<1>(w, g, x, i, y),
                    _ => tile::<F, 1>(w, g, x, i, y),
                }
            }
        }
    }
}

/// Group `g` against rows `i0..i0 + R` of x, written to `y`.
///
/// # Safety
/// As [`rows`], for group `g` and rows `i0..i0 + R` of x.
// The tile's loops index the accumulators and x's rows together.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile<const F: u8, const R: usize>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    let (nb, qb) = (w.cols / BLOCK, w.format.quant_bytes());
    let first = g * nb * ROWS;
    // SAFETY (every load below): group g's blocks hold nb · 8 scales (and minimums) from
    // `first` and nb · 8 · qb quant bytes from `first · qb`; x's rows i0..i0 + R hold nb
    // blocks each.
    let (quants, scales) = unsafe {
        (
            w.quants.as_ptr().add(first * qb),
            w.scales.as_ptr().add(first),
        )
    };
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); R];
    for c in 0..nb {
        // SAFETY (the block's loads): see above.
        let d = unsafe { half8(scales.add(c * ROWS)) };
        let min = match F {
            Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
            Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
            // SAFETY: Q4_1 and Q5_1 keep a minimum per scale.
            Q4_1 | Q5_1 => unsafe { half8(w.mins.as_ptr().add(first + c * ROWS)) },
            _ => _mm256_setzero_ps(),
        };
        // Q5's fifth bits of the 8 rows, one lane each (`spread`).
        let highs = match F {
            // SAFETY: Q5 keeps a word of fifth bits per scale.
            Q5_0 | Q5_1 => unsafe {
                _mm256_loadu_si256(w.highs.as_ptr().add(first + c * ROWS) as *const __m256i)
            },
            _ => _mm256_setzero_si256(),
        };
        // SAFETY: see above.
        let p = unsafe { quants.add(c * ROWS * qb) };
        let xs = x_rows::<R>(x, i0, c * BLOCK);
        let mut sums = [_mm256_setzero_si256(); R];
        if F == Q8_0 {
            for v in 0..BLOCK / 4 {
                // SAFETY: the block's 8 · 32 bytes.
                let wv = unsafe { _mm256_loadu_si256(p.add(32 * v) as *const __m256i) };
                let a = _mm256_sign_epi8(wv, wv);
                for j in 0..R {
                    // SAFETY: 4 bytes of x's block c at 4v < 32.
                    let s = _mm256_sign_epi8(unsafe { bcast(xs[j].add(4 * v)) }, wv);
                    let pairs = _mm256_maddubs_epi16(a, s);
                    sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(pairs, ones));
                }
            }
        } else {
            let mut s16 = [_mm256_setzero_si256(); R];
            let fifth = _mm256_set1_epi8(0x10);
            for v in 0..BLOCK / 8 {
                // SAFETY: the block's 8 · 16 bytes.
                let raw = unsafe { _mm256_loadu_si256(p.add(32 * v) as *const __m256i) };
                let mut lo = _mm256_and_si256(raw, low);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                if matches!(F, Q5_0 | Q5_1) {
                    // Bits 8j + v and 8j + 4 + v to bit 4 of byte j.
                    let up = _mm256_sll_epi32(highs, _mm_cvtsi32_si128(4 - v as i32));
                    let down = _mm256_srl_epi32(highs, _mm_cvtsi32_si128(v as i32));
                    lo = _mm256_or_si256(lo, _mm256_and_si256(up, fifth));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(down, fifth));
                }
                for j in 0..R {
                    // SAFETY: 4 bytes of x's block c at 4v and 16 + 4v < 32.
                    let both = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, unsafe { bcast(xs[j].add(4 * v)) }),
                        _mm256_maddubs_epi16(hi, unsafe { bcast(xs[j].add(16 + 4 * v)) }),
                    );
                    s16[j] = _mm256_add_epi16(s16[j], both);
                }
                // 5-bit quants: two loads' products at most in 16 bits (2 · 4 · 31 · 127).
                if matches!(F, Q5_0 | Q5_1) && v % 2 == 1 {
                    for j in 0..R {
                        let pairs = _mm256_madd_epi16(s16[j], ones);
                        sums[j] = _mm256_add_epi32(sums[j], pairs);
                        s16[j] = _mm256_setzero_si256();
                    }
                }
            }
            if !matches!(F, Q5_0 | Q5_1) {
                for j in 0..R {
                    sums[j] = _mm256_madd_epi16(s16[j], ones);
                }
            }
        }
        for j in 0..R {
            let xb = (i0 + j) * nb + c;
            // SAFETY: block xb of x exists.
            let (dx, sum) = unsafe {
                (
                    _mm256_broadcast_ss(x.scales.get_unchecked(xb)),
                    _mm256_broadcast_ss(x.sums.get_unchecked(xb)),
                )
            };
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(d, dx), acc[j]);
            if F != Q8_0 {
                acc[j] = _mm256_fmadd_ps(min, sum, acc[j]);
            }
        }
    }
    // SAFETY: the caller's.
    unsafe { store(&acc, g, w.rows, i0, y) };
}

/// Writes a tile's sums: `acc[j]` to row `i0 + j` of `y` (`n` columns), columns `8g..` of
/// the group's real rows.
///
/// # Safety
/// AVX2; `y` is valid for writes at `(i0 + j) · n + r` for j < R and `8g <= r < min(8g + 8,
/// n)`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn store<const R: usize>(
    acc: &[__m256; R],
    g: usize,
    n: usize,
    i0: usize,
    y: *mut f32,
) {
    let r0 = g * ROWS;
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: row i0 + j of y, columns r0.. of this group (the caller's).
        let out = unsafe { y.add((i0 + j) * n + r0) };
        match r0 + ROWS <= n {
            // SAFETY: 8 columns of this group.
            true => unsafe { _mm256_storeu_ps(out, *acc) },
            false => {
                let mut lanes = [0f32; ROWS];
                // SAFETY: 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
                for (k, &v) in lanes.iter().enumerate().take(n - r0) {
                    // SAFETY: column r0 + k < n, this group's.
                    unsafe { *out.add(k) = v };
                }
            }
        }
    }
}

/// Where rows `i0..i0 + R` of x are at column `at` (the tile reads them from there on).
pub(super) fn x_rows<const R: usize>(x: &QRows, i0: usize, at: usize) -> [*const u8; R] {
    // Addresses only (wrapping: nothing is read here); the tiles' loads stay within the rows
    // their callers vouch for.
    std::array::from_fn(|j| x.quants.as_ptr().wrapping_add((i0 + j) * x.cols + at) as *const u8)
}

/// 4 bytes at `p`, in every 32-bit lane. Functions, not closures: a closure is compiled
/// without its caller's target features, and its vectors would go through memory.
///
/// # Safety
/// AVX2; 4 bytes at `p`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn bcast(p: *const u8) -> __m256i {
    // SAFETY: the caller's.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// 8 f16 at `p` as f32.
///
/// # Safety
/// AVX2 and F16C; 8 f16 at `p`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn half8(p: *const half::f16) -> __m256 {
    // SAFETY: the caller's.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}
