//! The packed kernel's tile of one group for the 32-weight formats ([`super`]), AVX2's,
//! AVX-512 VNNI's and AVX-VNNI's forms of one body.
//!
//! Nibbles: each 32-byte load is 4 quant bytes of each of the 8 rows; its low nibbles
//! (weights `4v..4v + 4`) and high nibbles (`16 + 4v..`) go through `maddubs` against x's
//! matching 4 bytes, broadcast to every lane, and the block's 8 products add up in 16 bits
//! (at most 8 · 2 · 15 · 127 = 30,480), then pairs to 32 bits once per block; Q5's fifth
//! bits are put at bit 4 of each byte first (one shift and one mask per load, from their
//! rearranged word), and its sums go to 32 bits every second load. Q8_0: the
//! weights are signed, so `maddubs` takes |w| and sign(w)·x (llama.cpp's sign trick), and
//! its 16-bit pairs (up to 2 · 128 · 127) go to 32 bits after each load; with VNNI, whose
//! sums do not saturate, it takes w + 128 as unsigned bytes instead (one `xor` a load for
//! all rows of x, where the sign trick costs one `vpsignb` a row) and subtracts 128 · Σx.
//! Then one FMA by the 8 rows' `d` times `dx`, and one by their minimum (Q4_0's `-8d`,
//! Q5_0's `-16d`, Q8_0's `-128d` with VNNI, Q4_1's and Q5_1's `m`) times x's block sum
//! `dx · Σq`.

use super::super::super::{QRows, QWeight, BLOCK};
use super::super::avx512::{prefetch_at, prefetch_one, PREFETCH};
use super::super::ROWS;
use super::{bcast, dpbusd, half8, store, x_rows, MADD, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use std::arch::x86_64::*;

three_forms!(pub(super) tile_in<const F: u8, const R: usize>);

/// Group `g` against rows `i0..i0 + R` of x, written to `y`: the body of `tile` (`V` is
/// `MADD`), `tile_vnni` and `tile_avx_vnni`. With VNNI each 4-byte product and its sums are one
/// `vpdpbusd` (unsigned quants times x's signed bytes, summed by four into the 8 rows'
/// 32-bit lanes), so the nibble formats need no 16-bit stage (nor Q5's flush every second
/// load) and Q8_0's sign trick ends in one instruction instead of `maddubs` + `madd` + add.
/// `tile_vnni` takes a group alone (an odd one out of the pairs `avx512`'s tile takes).
///
/// # Safety
/// As `tile`, and `tile_vnni`'s or `tile_avx_vnni`'s for their `V`.
// The tile's loops index the accumulators and x's rows together.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_in<const F: u8, const R: usize, const V: u8>(
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
    // SAFETY (every intrinsic below): the caller's CPU runs AVX2, FMA and F16C, and the
    // VNNI of its V.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let (low, fifth) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        let mut acc = [_mm256_setzero_ps(); R];
        for c in 0..nb {
            let d = half8(scales.add(c * ROWS));
            let min = match F {
                Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
                // Q4_1 and Q5_1 keep a minimum per scale.
                Q4_1 | Q5_1 => half8(w.mins.as_ptr().add(first + c * ROWS)),
                // With VNNI, Q8_0's weights go in as w + 128 (unsigned).
                Q8_0 if V != MADD => _mm256_mul_ps(d, _mm256_set1_ps(-128.0)),
                _ => _mm256_setzero_ps(),
            };
            // Q5's fifth bits of the 8 rows, one lane each (`spread`): a word per scale.
            let highs = match F {
                Q5_0 | Q5_1 => {
                    _mm256_loadu_si256(w.highs.as_ptr().add(first + c * ROWS) as *const __m256i)
                }
                _ => _mm256_setzero_si256(),
            };
            let p = quants.add(c * ROWS * qb);
            if R > 1 {
                // Several rows of x: the tile computes long enough per block for the streams
                // to want asking for ahead, as the 16-row tiles' (`avx512::PREFETCH`).
                prefetch_one(p, ROWS * qb);
                let ahead = first + c * ROWS + PREFETCH / qb;
                prefetch_at(w.scales.as_ptr().wrapping_add(ahead));
                if matches!(F, Q5_0 | Q5_1) {
                    prefetch_at(w.highs.as_ptr().wrapping_add(ahead));
                }
            }
            let xs = x_rows::<R>(x, i0, c * BLOCK);
            let mut sums = [_mm256_setzero_si256(); R];
            if F == Q8_0 {
                // The block's 8 · 32 bytes; x's 4 bytes at 4v < 32.
                for v in 0..BLOCK / 4 {
                    let wv = _mm256_loadu_si256(p.add(32 * v) as *const __m256i);
                    if V != MADD {
                        // w + 128 as an unsigned byte (the sign bit flipped): `vpdpbusd`
                        // does not saturate, and the 128 · Σx it adds goes with `min`.
                        let a = _mm256_xor_si256(wv, _mm256_set1_epi8(i8::MIN));
                        for j in 0..R {
                            sums[j] = dpbusd::<V>(sums[j], a, bcast(xs[j].add(4 * v)));
                        }
                        continue;
                    }
                    let a = _mm256_sign_epi8(wv, wv);
                    for j in 0..R {
                        let s = _mm256_sign_epi8(bcast(xs[j].add(4 * v)), wv);
                        let pairs = _mm256_maddubs_epi16(a, s);
                        sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(pairs, ones));
                    }
                }
            } else {
                let mut s16 = [_mm256_setzero_si256(); R];
                // The block's 8 · 16 bytes; x's 4 bytes at 4v and 16 + 4v < 32.
                for v in 0..BLOCK / 8 {
                    let raw = _mm256_loadu_si256(p.add(32 * v) as *const __m256i);
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
                        let (xl, xh) = (bcast(xs[j].add(4 * v)), bcast(xs[j].add(16 + 4 * v)));
                        if V != MADD {
                            sums[j] = dpbusd::<V>(sums[j], lo, xl);
                            sums[j] = dpbusd::<V>(sums[j], hi, xh);
                        } else {
                            let both = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, xl),
                                _mm256_maddubs_epi16(hi, xh),
                            );
                            s16[j] = _mm256_add_epi16(s16[j], both);
                        }
                    }
                    // AVX2, 5-bit quants: two loads' products at most in 16 bits
                    // (2 · 4 · 31 · 127).
                    if V == MADD && matches!(F, Q5_0 | Q5_1) && v % 2 == 1 {
                        for j in 0..R {
                            let pairs = _mm256_madd_epi16(s16[j], ones);
                            sums[j] = _mm256_add_epi32(sums[j], pairs);
                            s16[j] = _mm256_setzero_si256();
                        }
                    }
                }
                if V == MADD && !matches!(F, Q5_0 | Q5_1) {
                    for j in 0..R {
                        sums[j] = _mm256_madd_epi16(s16[j], ones);
                    }
                }
            }
            for j in 0..R {
                // Block (i0 + j) · nb + c of x exists.
                let xb = (i0 + j) * nb + c;
                let dx = _mm256_broadcast_ss(x.scales.get_unchecked(xb));
                let sum = _mm256_broadcast_ss(x.sums.get_unchecked(xb));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(d, dx), acc[j]);
                if F != Q8_0 || V != MADD {
                    acc[j] = _mm256_fmadd_ps(min, sum, acc[j]);
                }
            }
        }
        // The caller's.
        store(&acc, g, w.rows, i0, y);
    }
}
