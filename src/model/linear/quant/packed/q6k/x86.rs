//! [`super`]'s kernel on AVX2, AVX-512 VNNI and AVX-VNNI: the packed kernel's tile
//! (`packed/x86.rs`) for Q6_K, Q3_K ([`super::super::q3k`]) and Q2_K ([`super::super::q2k`]):
//! superblocks of 16-weight sub-blocks with 8-bit scales (Q2_K's 4-bit, and a minimum
//! each) and unsigned quants (Q6_K's and Q3_K's with an offset), which differ in how a load's
//! quants and a pair's scales are unpacked.
//!
//! Over 300 lines on purpose: one tile body for the three formats and its three unpackings,
//! which are nothing apart.

use super::super::super::kquant::QK_K;
use super::super::super::{QRows, QWeight, BLOCK};
use super::super::avx512::prefetch_one;
use super::super::x86::{bcast, dpbusd, half8, store, x_rows, MADD};
use super::super::ROWS;
use super::super::{q2k, q3k};
use super::{highs_at, nibbles_at, scales_at, GROUP_BYTES};
use std::arch::x86_64::*;

/// Byte masks for `_mm256_shuffle_epi8`: byte k of each 32-bit lane into the high byte of
/// both its 16-bit halves (an arithmetic shift by 8 then sign-extends it).
pub(super) const TWICE: [[i8; 32]; 4] = [masks(0, 0), masks(1, 1), masks(2, 2), masks(3, 3)];

/// Bytes k and k + 1 of each 32-bit lane into the high bytes of its two halves.
pub(super) const PAIRS: [[i8; 32]; 2] = [masks(0, 1), masks(2, 3)];

/// The mask putting bytes `a` and `b` of each lane in the high bytes of its halves; the
/// low bytes zero (index −128).
const fn masks(a: i8, b: i8) -> [i8; 32] {
    let mut m = [-128i8; 32];
    let mut t = 0;
    while t < 8 {
        let lane = 4 * (t % 4) as i8;
        m[4 * t + 1] = lane + a;
        m[4 * t + 3] = lane + b;
        t += 1;
    }
    m
}

three_forms!(pub(in crate::model::linear::quant) tile_in<const R: usize, const BITS: u8>);

/// The formats of [`tile_in`] (its `BITS`): Q6_K, Q3_K, Q2_K.
pub(in crate::model::linear::quant) const Q6: u8 = 6;
pub(in crate::model::linear::quant) const Q3: u8 = 3;
pub(in crate::model::linear::quant) const Q2: u8 = 2;

/// A group's bytes of one superblock in the packed layout of `bits` ([`Q6`], [`Q3`], [`Q2`]).
pub(super) const fn group_bytes(bits: u8) -> usize {
    match bits {
        Q3 => q3k::GROUP_BYTES,
        Q2 => q2k::GROUP_BYTES,
        _ => GROUP_BYTES,
    }
}

/// The packed kernel's tile for Q6_K, Q3_K and Q2_K (`BITS`: [`Q6`], [`Q3`], [`Q2`]): per
/// pair of 32-weight chunks, Q6_K's two nibble loads and one load of high bits make the
/// 6-bit quants of 4 weights of each chunk twice over (the high bits to bits 4-5 by one
/// shift and a mask); Q3_K's one load of low bits and half a load of high bits make its
/// 3-bit quants of as many ([`unpack_q3`]), Q2_K's one load its 2-bit quants. Then
/// `maddubs` against x, two loads' products summed in 16 bits (at most 2 · 2 · 63 · 127 =
/// 32,004), then to 32 bits by `madd` with the 8 rows' scale of their 16 weights. q's offset
/// (32, Q3_K's 4) is `offset · Σ sc · Σx` per 16 weights, and Q2_K's minimums `Σ m · Σx`,
/// by `madd` of the rows' scale (minimum) pairs against x's sums. Then `d · dx` (and Q2_K's
/// `dmin · dx`) once per superblock.
///
/// With VNNI (`V` is `EVEX` or `VEX`) a chunk's two loads of products are summed straight
/// into 32-bit lanes by `vpdpbusd`, then multiplied by the rows' 8-bit scale (`vpmulld`), in
/// place of two `maddubs`, a 16-bit add and the `madd` by the scales. The body of `tile`,
/// `tile_vnni` and `tile_avx_vnni` (`three_forms!`).
///
/// # Safety
/// The CPU runs AVX2, FMA and F16C, and the VNNI that `V` names; `w` is packed in the
/// format `BITS` names and its planes fit its shape (`Superblocks::fits`); group `g` and rows
/// `i0..i0 + R` of x (of `w`'s width) exist; `y` is valid for writes at `(i0 + j) · w.rows +
/// r` for j < R and the group's real rows r, which nothing else touches meanwhile.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_in<const R: usize, const BITS: u8, const V: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    // The intrinsics are unsafe calls here (this body has no target features of its own):
    // it is only ever inlined into `tile` and its VNNI forms, whose CPUs run them.
    const { assert!(matches!(BITS, Q2 | Q3 | Q6)) };
    let (n, nb) = (w.cols / QK_K, w.cols / BLOCK);
    let group = group_bytes(BITS);
    let low = _mm256_set1_epi8(0x0F);
    // SAFETY: 32 bytes each.
    let (each, both) = unsafe {
        (
            [0, 1, 2, 3].map(|k| _mm256_loadu_si256(TWICE[k].as_ptr() as *const __m256i)),
            [0, 1].map(|k| _mm256_loadu_si256(PAIRS[k].as_ptr() as *const __m256i)),
        )
    };
    let mut acc = [_mm256_setzero_ps(); R];
    for c in 0..n {
        let u = g * n + c;
        // SAFETY (every weight load below): superblock u holds 8 scales (Q2_K's 8
        // minimums too) from u · 8 and `group` bytes of quants from u · group
        // (`Superblocks::fits`); x's rows i0..i0 + R hold n superblocks.
        let (d, dmin, base) = unsafe {
            (
                half8(w.scales.as_ptr().add(u * ROWS)),
                match BITS {
                    Q2 => half8(w.mins.as_ptr().add(u * ROWS)),
                    _ => _mm256_setzero_ps(),
                },
                w.quants.as_ptr().add(u * group),
            )
        };
        if R > 1 {
            prefetch_one(base, group);
        }
        let xs = x_rows::<R>(x, i0, c * QK_K);
        let mut isum = [_mm256_setzero_si256(); R];
        let mut osum = [_mm256_setzero_si256(); R];
        for p in 0..4 {
            let at = match BITS {
                Q3 => q3k::scales_at(p),
                Q2 => q2k::scales_at(p),
                _ => scales_at(p),
            };
            // SAFETY: the pair's 32 bytes of scales.
            let raw = unsafe { _mm256_loadu_si256(base.add(at) as *const __m256i) };
            // Q2_K's scale in a byte's low nibble, its minimum in the high one.
            let (scales, mins) = match BITS {
                Q2 => (
                    _mm256_and_si256(raw, low),
                    _mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                ),
                _ => (raw, raw),
            };
            // The scales of the pair's four 16-weight sub-blocks, each in both halves of a
            // lane, and the scales (Q2_K's minimums) as pairs (4p, 4p + 1), (4p + 2, 4p + 3).
            let mut sc = [_mm256_setzero_si256(); 4];
            for k in 0..4 {
                sc[k] = _mm256_srai_epi16(_mm256_shuffle_epi8(scales, each[k]), 8);
            }
            let pairs = [
                _mm256_srai_epi16(_mm256_shuffle_epi8(mins, both[0]), 8),
                _mm256_srai_epi16(_mm256_shuffle_epi8(mins, both[1]), 8),
            ];
            for h in 0..4 {
                // SAFETY: see above.
                let [lo0, lo1, hi0, hi1] = unsafe {
                    match BITS {
                        Q3 => unpack_q3(base, p, h),
                        Q2 => unpack_q2(base, p, h),
                        _ => unpack_q6(base, p, h),
                    }
                };
                // Weights 8h.. of the pair's first chunk are sub-block 4p + h / 2, of its
                // second 4p + 2 + h / 2.
                let (s_lo, s_hi) = (sc[h / 2], sc[2 + h / 2]);
                for j in 0..R {
                    let at = 64 * p + 8 * h;
                    // SAFETY: 4 bytes at 64p + 8h (+ 4, + 32, + 36) < 256 of x's superblock.
                    let (x0, x1, x2, x3) = unsafe {
                        (
                            bcast(xs[j].add(at)),
                            bcast(xs[j].add(at + 4)),
                            bcast(xs[j].add(at + 32)),
                            bcast(xs[j].add(at + 36)),
                        )
                    };
                    let sum = if V != MADD {
                        // 32-bit sums of 8 products (at most 8 · 63 · 127) times the scale
                        // (the high half of each lane of `sc`, sign-extended).
                        let zero = _mm256_setzero_si256();
                        let t_lo = dpbusd::<V>(dpbusd::<V>(zero, lo0, x0), lo1, x1);
                        let t_hi = dpbusd::<V>(dpbusd::<V>(zero, hi0, x2), hi1, x3);
                        _mm256_add_epi32(
                            _mm256_mullo_epi32(t_lo, _mm256_srai_epi32(s_lo, 16)),
                            _mm256_mullo_epi32(t_hi, _mm256_srai_epi32(s_hi, 16)),
                        )
                    } else {
                        let t_lo = _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo0, x0),
                            _mm256_maddubs_epi16(lo1, x1),
                        );
                        let t_hi = _mm256_add_epi16(
                            _mm256_maddubs_epi16(hi0, x2),
                            _mm256_maddubs_epi16(hi1, x3),
                        );
                        _mm256_add_epi32(
                            _mm256_madd_epi16(t_lo, s_lo),
                            _mm256_madd_epi16(t_hi, s_hi),
                        )
                    };
                    isum[j] = _mm256_add_epi32(isum[j], sum);
                }
            }
            for j in 0..R {
                // SAFETY: x's sums of its 16-value halves 16c + 4p .. + 4 of row i0 + j.
                let (x01, x23) = unsafe {
                    let s = x.isums16.as_ptr().add(2 * ((i0 + j) * nb + 8 * c) + 4 * p);
                    (bcast(s as *const u8), bcast(s.add(2) as *const u8))
                };
                let o = _mm256_add_epi32(
                    _mm256_madd_epi16(pairs[0], x01),
                    _mm256_madd_epi16(pairs[1], x23),
                );
                osum[j] = _mm256_add_epi32(osum[j], o);
            }
        }
        for j in 0..R {
            // SAFETY: block 8c of row i0 + j of x: its superblock's scale.
            let dx = unsafe { _mm256_broadcast_ss(x.scales.get_unchecked((i0 + j) * nb + 8 * c)) };
            let ddx = _mm256_mul_ps(d, dx);
            acc[j] = match BITS {
                Q2 => {
                    let sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), ddx, acc[j]);
                    let mins = _mm256_mul_ps(dmin, dx);
                    _mm256_fnmadd_ps(_mm256_cvtepi32_ps(osum[j]), mins, sums)
                }
                // Q3_K's offset of 4, Q6_K's of 32.
                Q3 => {
                    let q = _mm256_sub_epi32(isum[j], _mm256_slli_epi32(osum[j], 2));
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), ddx, acc[j])
                }
                _ => {
                    let q = _mm256_sub_epi32(isum[j], _mm256_slli_epi32(osum[j], 5));
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), ddx, acc[j])
                }
            };
        }
    }
    // SAFETY: the caller's.
    unsafe { store(&acc, g, w.rows, i0, y) };
}

/// Q6_K's quants of pair `p`'s loads `h` (of 4) for the 8 rows: weights `64p + 8h + j`,
/// `+ 4`, `+ 32`, `+ 36` of each row at byte `4l + j` of the four vectors.
///
/// # Safety
/// AVX2; `base` is a group's superblock of packed Q6_K.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q6(base: *const u8, p: usize, h: usize) -> [__m256i; 4] {
    let (low, top) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    // SAFETY: within the superblock (the caller's).
    let (n0, n1, hb) = unsafe {
        (
            _mm256_loadu_si256(base.add(nibbles_at(p, 2 * h)) as *const __m256i),
            _mm256_loadu_si256(base.add(nibbles_at(p, 2 * h + 1)) as *const __m256i),
            _mm256_loadu_si256(base.add(highs_at(p, h)) as *const __m256i),
        )
    };
    let lo0 = _mm256_or_si256(
        _mm256_and_si256(n0, low),
        _mm256_and_si256(_mm256_slli_epi16(hb, 4), top),
    );
    let hi0 = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(n0, 4), low),
        _mm256_and_si256(_mm256_slli_epi16(hb, 2), top),
    );
    let lo1 = _mm256_or_si256(_mm256_and_si256(n1, low), _mm256_and_si256(hb, top));
    let hi1 = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi16(n1, 4), low),
        _mm256_and_si256(_mm256_srli_epi16(hb, 2), top),
    );
    [lo0, lo1, hi0, hi1]
}

/// Q2_K's quants (0..=3) of pair `p`'s load `h` (of 4), as [`unpack_q6`]'s.
///
/// # Safety
/// AVX2; `base` is a group's superblock of packed Q2_K.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q2(base: *const u8, p: usize, h: usize) -> [__m256i; 4] {
    let three = _mm256_set1_epi8(3);
    // SAFETY: within the superblock (the caller's).
    let q = unsafe { _mm256_loadu_si256(base.add(q2k::lows_at(p, h)) as *const __m256i) };
    [
        _mm256_and_si256(q, three),
        _mm256_and_si256(_mm256_srli_epi16(q, 2), three),
        _mm256_and_si256(_mm256_srli_epi16(q, 4), three),
        _mm256_and_si256(_mm256_srli_epi16(q, 6), three),
    ]
}

/// Q3_K's quants (0..=7) of pair `p`'s loads `h` (of 4), as [`unpack_q6`]'s: the two low
/// bits at bits `2t` of one load, the third at bit `t` (`h` even) or `4 + t` (odd) of the
/// load of high bits, each moved to bit 2 (16-bit shifts: what a byte takes from its
/// neighbour is masked away).
///
/// # Safety
/// AVX2; `base` is a group's superblock of packed Q3_K.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q3(base: *const u8, p: usize, h: usize) -> [__m256i; 4] {
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    // SAFETY: within the superblock (the caller's).
    let (lows, highs) = unsafe {
        (
            _mm256_loadu_si256(base.add(q3k::lows_at(p, h)) as *const __m256i),
            _mm256_loadu_si256(base.add(q3k::highs_at(p, h / 2)) as *const __m256i),
        )
    };
    let hb = match h % 2 {
        0 => highs,
        _ => _mm256_srli_epi16(highs, 4),
    };
    let third = [
        _mm256_slli_epi16(hb, 2),
        _mm256_slli_epi16(hb, 1),
        hb,
        _mm256_srli_epi16(hb, 1),
    ];
    let two = [
        lows,
        _mm256_srli_epi16(lows, 2),
        _mm256_srli_epi16(lows, 4),
        _mm256_srli_epi16(lows, 6),
    ];
    // A loop, not `array::from_fn`: a closure is compiled without this function's features.
    let mut out = [_mm256_setzero_si256(); 4];
    for t in 0..4 {
        out[t] = _mm256_or_si256(
            _mm256_and_si256(two[t], three),
            _mm256_and_si256(third[t], four),
        );
    }
    out
}
