//! The 16-row tile of Q4_K and Q5_K on AVX-512 with VNNI: `x86.rs`'s `tile_in` (its VNNI
//! form) in 512-bit registers, two adjacent groups of 8 rows side by side, as
//! `q6k/avx512.rs` does for Q6_K, Q3_K and Q2_K (why: there). A lane does what the 8-row
//! tile's does, in the same order.

use super::super::super::kquant::QK_K;
use super::super::super::{QRows, QWeight, BLOCK};
use super::super::avx512::{bcast, halves16, join, prefetch_pair, store};
use super::super::q5k;
use super::super::x86::x_rows;
use super::super::ROWS;
use super::x86::group_bytes;
use super::{nibbles_at, scales_at};
use std::arch::x86_64::*;

/// Groups `g` and `g + 1` of Q4_K (of Q5_K with `FIFTH`) against rows `i0..i0 + R` of x,
/// written to `y`.
///
/// # Safety
/// As `x86::rows` for both groups (each exists), for rows `i0..i0 + R` of x; the CPU has
/// AVX-512F, BW, VL and VNNI (`quant::vnni`).
#[allow(clippy::needless_range_loop)] // the loops index the accumulators and x's rows
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(in crate::model::linear::quant) unsafe fn tile<const R: usize, const FIFTH: bool>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    let (n, nb) = (w.cols / QK_K, w.cols / BLOCK);
    debug_assert_eq!(x.isums32.len(), x.scales.len(), "x rounded per superblock");
    let group = group_bytes(FIFTH);
    // Group g + 1's superblock c is n superblocks after group g's.
    let next = n * group;
    // SAFETY (every load below): both groups' superblocks hold 8 scales and minimums from
    // u · 8 and `group` bytes of quants from u · group (`Superblocks::fits`); x's rows
    // i0..i0 + R hold n superblocks; the stores are the caller's.
    unsafe {
        let (low, fifth, zero) = (
            _mm512_set1_epi8(0x0F),
            _mm512_set1_epi8(0x10),
            _mm512_setzero_si512(),
        );
        let mut acc = [_mm512_setzero_ps(); R];
        for c in 0..n {
            let u = g * n + c;
            let d = halves16(w.scales.as_ptr().add(u * ROWS), n * ROWS);
            let dmin = halves16(w.mins.as_ptr().add(u * ROWS), n * ROWS);
            let base = w.quants.as_ptr().add(u * group);
            prefetch_pair(base, group, next);
            let xs = x_rows::<R>(x, i0, c * QK_K);
            let mut isum = [zero; R];
            let mut msum = [zero; R];
            for p in 0..4 {
                let sm_at = match FIFTH {
                    true => q5k::scales_at(p),
                    false => scales_at(p),
                };
                // The pair's two scales (minimums) of each row, as 16-bit halves of its lane.
                let (sc, mp) = (
                    wide16(base.add(sm_at), next),
                    wide16(base.add(sm_at + 16), next),
                );
                let (sc0, sc1) = (
                    _mm512_and_si512(sc, _mm512_set1_epi32(0xFFFF)),
                    _mm512_srli_epi32::<16>(sc),
                );
                let (mut s_lo, mut s_hi) = ([zero; R], [zero; R]);
                for h in 0..2 {
                    // Q5_K: the fifth bits of loads 4h .. 4h + 4.
                    let (mut a, mut b) = match FIFTH {
                        true => {
                            let bits = join(base.add(q5k::highs_at(p, h)), next);
                            (_mm512_slli_epi16::<4>(bits), bits)
                        }
                        false => (zero, zero),
                    };
                    for k in 0..4 {
                        let v = 4 * h + k;
                        let at = match FIFTH {
                            true => q5k::nibbles_at(p, v),
                            false => nibbles_at(p, v),
                        };
                        let raw = join(base.add(at), next);
                        let mut lo = _mm512_and_si512(raw, low);
                        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
                        if FIFTH {
                            lo = _mm512_or_si512(lo, _mm512_and_si512(a, fifth));
                            hi = _mm512_or_si512(hi, _mm512_and_si512(b, fifth));
                            (a, b) = (_mm512_srli_epi16::<1>(a), _mm512_srli_epi16::<1>(b));
                        }
                        for j in 0..R {
                            let x = xs[j] as *const i8;
                            let (xl, xh) = (
                                bcast(x.add(64 * p + 4 * v)),
                                bcast(x.add(64 * p + 32 + 4 * v)),
                            );
                            s_lo[j] = _mm512_dpbusd_epi32(s_lo[j], lo, xl);
                            s_hi[j] = _mm512_dpbusd_epi32(s_hi[j], hi, xh);
                        }
                    }
                }
                for j in 0..R {
                    let both = _mm512_add_epi32(
                        _mm512_mullo_epi32(s_lo[j], sc0),
                        _mm512_mullo_epi32(s_hi[j], sc1),
                    );
                    isum[j] = _mm512_add_epi32(isum[j], both);
                    // Sub-blocks 8c + 2p and 8c + 2p + 1 of row i0 + j of x.
                    let s = x.isums32.as_ptr().add((i0 + j) * nb + 8 * c + 2 * p);
                    let xsum = bcast(s as *const i8);
                    msum[j] = _mm512_add_epi32(msum[j], _mm512_madd_epi16(mp, xsum));
                }
            }
            for j in 0..R {
                // Block 8c of row i0 + j of x: its superblock's scale.
                let dx = _mm512_set1_ps(*x.scales.get_unchecked((i0 + j) * nb + 8 * c));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[j]), _mm512_mul_ps(d, dx), acc[j]);
                acc[j] =
                    _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[j]), _mm512_mul_ps(dmin, dx), acc[j]);
            }
        }
        store(&acc, g, w.rows, i0, y);
    }
}

/// The 16 bytes at `p` and the 16 at `p + next`, each widened to 16 bits.
///
/// # Safety
/// AVX-512BW; 16 bytes at each.
#[target_feature(enable = "avx2,avx512f,avx512bw")]
#[inline]
unsafe fn wide16(p: *const u8, next: usize) -> __m512i {
    // SAFETY: the caller's.
    unsafe {
        let (a, b) = (
            _mm_loadu_si128(p as *const __m128i),
            _mm_loadu_si128(p.add(next) as *const __m128i),
        );
        _mm512_cvtepu8_epi16(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
    }
}
