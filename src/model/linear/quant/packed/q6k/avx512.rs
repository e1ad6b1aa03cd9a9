//! The 16-row tile of the K-quants with 16-weight sub-blocks (Q6_K, Q3_K, Q2_K) on AVX-512
//! with VNNI: `x86.rs`'s `tile_in` (its VNNI form) in 512-bit registers, two adjacent groups
//! of 8 rows side by side (group `g` in lanes 0-7, `g + 1` in lanes 8-15), as
//! `packed/avx512.rs` does for the 32-weight formats. Each load is the two groups' 32-byte
//! units joined; a lane does what the 8-row tile's does, in the same order, so a row's sums
//! are the same either way.
//!
//! Why: on Zen 5, whose vector units are 512 bits wide, a 256-bit tile used half of each
//! instruction; the 1.7B shape's Q6_K file prefilled 512 tokens at 0.6× llama.cpp's rate.

use super::super::super::kquant::QK_K;
use super::super::super::{QRows, QWeight, BLOCK};
use super::super::avx512::{bcast, halves16, join, prefetch_pair, store};
use super::super::x86::x_rows;
use super::super::ROWS;
use super::super::{q2k, q3k};
use super::x86::{group_bytes, PAIRS, Q2, Q3, Q6, TWICE};
use super::{highs_at, nibbles_at, scales_at};
use std::arch::x86_64::*;

/// Groups `g` and `g + 1` (of the format `BITS` names: [`Q6`], [`Q3`], [`Q2`]) against rows
/// `i0..i0 + R` of x, written to `y`.
///
/// # Safety
/// As `x86::rows` for both groups (each exists), for rows `i0..i0 + R` of x; the CPU has
/// AVX-512F, BW, VL and VNNI (`quant::vnni`).
#[allow(clippy::needless_range_loop)] // the loops index the accumulators and x's rows
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in crate::model::linear::quant) unsafe fn tile<const R: usize, const BITS: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    const { assert!(matches!(BITS, Q2 | Q3 | Q6)) };
    let (n, nb) = (w.cols / QK_K, w.cols / BLOCK);
    let group = group_bytes(BITS);
    // Group g + 1's superblock c is n superblocks after group g's.
    let next = n * group;
    // SAFETY (every load below): both groups' superblocks hold 8 scales (Q2_K's 8 minimums
    // too) from u · 8 and `group` bytes of quants from u · group (`Superblocks::fits`); x's
    // rows i0..i0 + R hold n superblocks; the stores are the caller's.
    unsafe {
        let (low, zero) = (_mm512_set1_epi8(0x0F), _mm512_setzero_si512());
        // Loops, not `array::map`: a closure is compiled without this function's features.
        let (mut each, mut both) = ([zero; 4], [zero; 2]);
        for k in 0..4 {
            each[k] = _mm512_broadcast_i64x4(_mm256_loadu_si256(TWICE[k].as_ptr() as *const _));
        }
        for k in 0..2 {
            both[k] = _mm512_broadcast_i64x4(_mm256_loadu_si256(PAIRS[k].as_ptr() as *const _));
        }
        let mut acc = [_mm512_setzero_ps(); R];
        for c in 0..n {
            let u = g * n + c;
            let d = halves16(w.scales.as_ptr().add(u * ROWS), n * ROWS);
            let dmin = match BITS {
                Q2 => halves16(w.mins.as_ptr().add(u * ROWS), n * ROWS),
                _ => _mm512_setzero_ps(),
            };
            let base = w.quants.as_ptr().add(u * group);
            prefetch_pair(base, group, next);
            let xs = x_rows::<R>(x, i0, c * QK_K);
            let mut isum = [zero; R];
            let mut osum = [zero; R];
            for p in 0..4 {
                let at = match BITS {
                    Q3 => q3k::scales_at(p),
                    Q2 => q2k::scales_at(p),
                    _ => scales_at(p),
                };
                let raw = join(base.add(at), next);
                let (scales, mins) = match BITS {
                    Q2 => (
                        _mm512_and_si512(raw, low),
                        _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low),
                    ),
                    _ => (raw, raw),
                };
                // The four sub-blocks' scales as 32-bit lanes (sign-extended), and the scales
                // (Q2_K's minimums) as 16-bit pairs (4p, 4p + 1), (4p + 2, 4p + 3).
                let mut sc = [zero; 4];
                for k in 0..4 {
                    let twice = _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(scales, each[k]));
                    sc[k] = _mm512_srai_epi32::<16>(twice);
                }
                let pairs = [
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(mins, both[0])),
                    _mm512_srai_epi16::<8>(_mm512_shuffle_epi8(mins, both[1])),
                ];
                for h in 0..4 {
                    let [lo0, lo1, hi0, hi1] = match BITS {
                        Q3 => unpack_q3(base, next, p, h),
                        Q2 => unpack_q2(base, next, p, h),
                        _ => unpack_q6(base, next, p, h),
                    };
                    let (s_lo, s_hi) = (sc[h / 2], sc[2 + h / 2]);
                    for j in 0..R {
                        let at = 64 * p + 8 * h;
                        let x = xs[j] as *const i8;
                        let (x0, x1) = (bcast(x.add(at)), bcast(x.add(at + 4)));
                        let (x2, x3) = (bcast(x.add(at + 32)), bcast(x.add(at + 36)));
                        let t_lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, lo0, x0), lo1, x1);
                        let t_hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, hi0, x2), hi1, x3);
                        let sum = _mm512_add_epi32(
                            _mm512_mullo_epi32(t_lo, s_lo),
                            _mm512_mullo_epi32(t_hi, s_hi),
                        );
                        isum[j] = _mm512_add_epi32(isum[j], sum);
                    }
                }
                for j in 0..R {
                    // x's sums of its 16-value halves 16c + 4p .. + 4 of row i0 + j.
                    let s = x.isums16.as_ptr().add(2 * ((i0 + j) * nb + 8 * c) + 4 * p);
                    let (x01, x23) = (bcast(s as *const i8), bcast(s.add(2) as *const i8));
                    let o = _mm512_add_epi32(
                        _mm512_madd_epi16(pairs[0], x01),
                        _mm512_madd_epi16(pairs[1], x23),
                    );
                    osum[j] = _mm512_add_epi32(osum[j], o);
                }
            }
            for j in 0..R {
                let dx = _mm512_set1_ps(*x.scales.get_unchecked((i0 + j) * nb + 8 * c));
                let ddx = _mm512_mul_ps(d, dx);
                acc[j] = match BITS {
                    Q2 => {
                        let sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), ddx, acc[j]);
                        let mins = _mm512_mul_ps(dmin, dx);
                        _mm512_fnmadd_ps(_mm512_cvtepi32_ps(osum[j]), mins, sums)
                    }
                    // Q3_K's offset of 4, Q6_K's of 32.
                    Q3 => {
                        let q = _mm512_sub_epi32(isum[j], _mm512_slli_epi32::<2>(osum[j]));
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), ddx, acc[j])
                    }
                    _ => {
                        let q = _mm512_sub_epi32(isum[j], _mm512_slli_epi32::<5>(osum[j]));
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), ddx, acc[j])
                    }
                };
            }
        }
        store(&acc, g, w.rows, i0, y);
    }
}

/// `x86.rs`'s `unpack_q6` for the two groups (the second `next` bytes on).
///
/// # Safety
/// AVX-512BW; `base` is a group's superblock of packed Q6_K, and `base + next` the next's.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q6(base: *const u8, next: usize, p: usize, h: usize) -> [__m512i; 4] {
    let (low, top) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
    // SAFETY: within the superblocks (the caller's).
    let (n0, n1, hb) = unsafe {
        (
            join(base.add(nibbles_at(p, 2 * h)), next),
            join(base.add(nibbles_at(p, 2 * h + 1)), next),
            join(base.add(highs_at(p, h)), next),
        )
    };
    // (a & 0x0F) | (b & 0x30) per byte; not a closure, which would be compiled without
    // this function's features.
    let mut out = [
        n0,
        n1,
        _mm512_srli_epi16::<4>(n0),
        _mm512_srli_epi16::<4>(n1),
    ];
    let highs = [
        _mm512_slli_epi16::<4>(hb),
        hb,
        _mm512_slli_epi16::<2>(hb),
        _mm512_srli_epi16::<2>(hb),
    ];
    for t in 0..4 {
        out[t] = _mm512_or_si512(
            _mm512_and_si512(out[t], low),
            _mm512_and_si512(highs[t], top),
        );
    }
    out
}

/// `x86.rs`'s `unpack_q2` for the two groups.
///
/// # Safety
/// AVX-512BW; `base` is a group's superblock of packed Q2_K, and `base + next` the next's.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q2(base: *const u8, next: usize, p: usize, h: usize) -> [__m512i; 4] {
    let three = _mm512_set1_epi8(3);
    // SAFETY: within the superblocks (the caller's).
    let q = unsafe { join(base.add(q2k::lows_at(p, h)), next) };
    [
        _mm512_and_si512(q, three),
        _mm512_and_si512(_mm512_srli_epi16::<2>(q), three),
        _mm512_and_si512(_mm512_srli_epi16::<4>(q), three),
        _mm512_and_si512(_mm512_srli_epi16::<6>(q), three),
    ]
}

/// `x86.rs`'s `unpack_q3` for the two groups.
///
/// # Safety
/// AVX-512BW; `base` is a group's superblock of packed Q3_K, and `base + next` the next's.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn unpack_q3(base: *const u8, next: usize, p: usize, h: usize) -> [__m512i; 4] {
    let (three, four) = (_mm512_set1_epi8(3), _mm512_set1_epi8(4));
    // SAFETY: within the superblocks (the caller's).
    let (lows, highs) = unsafe {
        (
            join(base.add(q3k::lows_at(p, h)), next),
            join(base.add(q3k::highs_at(p, h / 2)), next),
        )
    };
    let hb = match h % 2 {
        0 => highs,
        _ => _mm512_srli_epi16::<4>(highs),
    };
    let third = [
        _mm512_slli_epi16::<2>(hb),
        _mm512_slli_epi16::<1>(hb),
        hb,
        _mm512_srli_epi16::<1>(hb),
    ];
    let two = [
        lows,
        _mm512_srli_epi16::<2>(lows),
        _mm512_srli_epi16::<4>(lows),
        _mm512_srli_epi16::<6>(lows),
    ];
    let mut out = [_mm512_setzero_si512(); 4];
    for t in 0..4 {
        out[t] = _mm512_or_si512(
            _mm512_and_si512(two[t], three),
            _mm512_and_si512(third[t], four),
        );
    }
    out
}
