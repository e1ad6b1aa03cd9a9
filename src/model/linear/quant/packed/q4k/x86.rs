//! [`super`]'s kernel on AVX2, AVX-512 VNNI and AVX-VNNI: the packed kernel's tile
//! (`packed/x86.rs`) for Q4_K, and for Q5_K (Q4_K's with a fifth bit per weight).

use super::super::super::kquant::QK_K;
use super::super::super::{QRows, QWeight, BLOCK};
use super::super::avx512::prefetch_one;
use super::super::q5k;
use super::super::x86::{bcast, dpbusd, half8, store, x_rows, MADD};
use super::super::ROWS;
use super::{nibbles_at, scales_at, GROUP_BYTES};
use std::arch::x86_64::*;

three_forms!(pub(in crate::model::linear::quant) tile_in<const R: usize, const FIFTH: bool>);

/// A group's bytes of one superblock in the packed layout: Q5_K's (`fifth`) or Q4_K's.
pub(super) const fn group_bytes(fifth: bool) -> usize {
    match fifth {
        true => q5k::GROUP_BYTES,
        false => GROUP_BYTES,
    }
}

/// The packed kernel's tile for Q4_K, and with `FIFTH` for Q5_K (`q5k.rs`'s layout): per
/// pair of sub-blocks, 8 loads of nibbles whose low halves are the first sub-block and high
/// halves the second. Q5_K's load of fifth bits serves the next four loads of nibbles:
/// shifted right by one more each time, its bits `k` (of the pair's first sub-block, after a
/// first shift left by 4) and `4 + k` (of the second) reach bit 4 of the nibble bytes, where
/// a mask and an `or` put them (16-bit shifts: bit 4 of each byte comes from its own byte,
/// as k < 4). On AVX2, `maddubs` sums in 16 bits (Q4_K over 8 loads: at most 8 · 2 · 15 · 127
/// = 30,480; Q5_K over 4: 4 · 2 · 31 · 127 = 31,496), then `madd` with the 8 rows' 6-bit
/// scales of the sub-block (in both halves of each lane, by a byte shuffle) into 32 bits;
/// the minimums by one `madd` per pair of the rows' two `m` against x's two sub-block sums.
/// Then `d · dx` and `dmin · dx`, once per superblock (x has one scale per superblock
/// against a K-quant).
///
/// With VNNI (`V` is `EVEX` or `VEX`) each sub-block's products are summed straight into
/// 32-bit lanes by `vpdpbusd` (8 loads of 4 bytes a row: at most 32 · 31 · 127 = 125,984),
/// then multiplied by the rows' 6-bit scale (`vpmulld`), in place of `maddubs`, a 16-bit add
/// per load and the `madd` by the scales. The body of `tile`, `tile_vnni` and
/// `tile_avx_vnni` (`three_forms!`).
///
/// # Safety
/// The CPU runs AVX2, FMA and F16C, and the VNNI that `V` names; `w` is packed Q4_K (Q5_K
/// with `FIFTH`) and its planes fit its shape (`Superblocks::fits`); group `g` and rows
/// `i0..i0 + R` of x (of `w`'s width) exist; `y` is valid for writes at
/// `(i0 + j) · w.rows + r` for j < R and the group's real rows r, which nothing else
/// touches meanwhile.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_in<const R: usize, const FIFTH: bool, const V: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    // The intrinsics are unsafe calls here (this body has no target features of its own):
    // it is only ever inlined into `tile` and its VNNI forms, whose CPUs run them.
    let (n, nb) = (w.cols / QK_K, w.cols / BLOCK);
    debug_assert_eq!(x.isums32.len(), x.scales.len(), "x rounded per superblock");
    let group_bytes = group_bytes(FIFTH);
    let (low, fifth) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
    // Per 32-bit lane, its first (second) 16-bit value twice.
    let (first, second) = (
        _mm256_setr_epi8(
            0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13, 0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9,
            12, 13, 12, 13,
        ),
        _mm256_setr_epi8(
            2, 3, 2, 3, 6, 7, 6, 7, 10, 11, 10, 11, 14, 15, 14, 15, 2, 3, 2, 3, 6, 7, 6, 7, 10, 11,
            10, 11, 14, 15, 14, 15,
        ),
    );
    let mut acc = [_mm256_setzero_ps(); R];
    for c in 0..n {
        let u = g * n + c;
        // SAFETY (every weight load below): superblock u holds 8 scales and minimums from
        // u · 8 and group_bytes of quants from u · group_bytes (`Superblocks::fits`); x's
        // rows i0..i0 + R hold n superblocks.
        let (d, dmin, base) = unsafe {
            (
                half8(w.scales.as_ptr().add(u * ROWS)),
                half8(w.mins.as_ptr().add(u * ROWS)),
                w.quants.as_ptr().add(u * group_bytes),
            )
        };
        if R > 1 {
            prefetch_one(base, group_bytes);
        }
        let xs = x_rows::<R>(x, i0, c * QK_K);
        let mut isum = [_mm256_setzero_si256(); R];
        let mut msum = [_mm256_setzero_si256(); R];
        for p in 0..4 {
            let sm_at = match FIFTH {
                true => q5k::scales_at(p),
                false => scales_at(p),
            };
            // SAFETY: 16 bytes of scales and of minimums of pair p, within the superblock.
            let (sc, mp) = unsafe {
                (
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(base.add(sm_at) as *const __m128i)),
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(base.add(sm_at + 16) as *const __m128i)),
                )
            };
            let (sc_lo, sc_hi) = (
                _mm256_shuffle_epi8(sc, first),
                _mm256_shuffle_epi8(sc, second),
            );
            // VNNI: the pair's two scales of each row as 32-bit lanes.
            let (sc0, sc1) = (
                _mm256_and_si256(sc, _mm256_set1_epi32(0xFFFF)),
                _mm256_srli_epi32(sc, 16),
            );
            // AVX2: 16-bit sums per sub-block; VNNI: 32-bit ones.
            let (mut s_lo, mut s_hi) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for h in 0..2 {
                // Q5_K: the fifth bits of loads 4h .. 4h + 4.
                let (mut a, mut b) = match FIFTH {
                    true => {
                        // SAFETY: see above.
                        let bits = unsafe {
                            _mm256_loadu_si256(base.add(q5k::highs_at(p, h)) as *const __m256i)
                        };
                        (_mm256_slli_epi16(bits, 4), bits)
                    }
                    false => (_mm256_setzero_si256(), _mm256_setzero_si256()),
                };
                for k in 0..4 {
                    let v = 4 * h + k;
                    let at = match FIFTH {
                        true => q5k::nibbles_at(p, v),
                        false => nibbles_at(p, v),
                    };
                    // SAFETY: see above.
                    let raw = unsafe { _mm256_loadu_si256(base.add(at) as *const __m256i) };
                    let mut lo = _mm256_and_si256(raw, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    if FIFTH {
                        lo = _mm256_or_si256(lo, _mm256_and_si256(a, fifth));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(b, fifth));
                        (a, b) = (_mm256_srli_epi16(a, 1), _mm256_srli_epi16(b, 1));
                    }
                    for j in 0..R {
                        // SAFETY: 4 bytes at 64p + 4v and 64p + 32 + 4v < 256 of x's
                        // superblock.
                        let (xl, xh) = unsafe {
                            (
                                bcast(xs[j].add(64 * p + 4 * v)),
                                bcast(xs[j].add(64 * p + 32 + 4 * v)),
                            )
                        };
                        if V != MADD {
                            // SAFETY: the CPU has the VNNI that V names.
                            unsafe {
                                s_lo[j] = dpbusd::<V>(s_lo[j], lo, xl);
                                s_hi[j] = dpbusd::<V>(s_hi[j], hi, xh);
                            }
                        } else {
                            s_lo[j] = _mm256_add_epi16(s_lo[j], _mm256_maddubs_epi16(lo, xl));
                            s_hi[j] = _mm256_add_epi16(s_hi[j], _mm256_maddubs_epi16(hi, xh));
                        }
                    }
                }
                // AVX2: to 32 bits by the scales after 8 loads (Q5_K: after every 4).
                if V == MADD && (FIFTH || h == 1) {
                    for j in 0..R {
                        let both = _mm256_add_epi32(
                            _mm256_madd_epi16(s_lo[j], sc_lo),
                            _mm256_madd_epi16(s_hi[j], sc_hi),
                        );
                        isum[j] = _mm256_add_epi32(isum[j], both);
                        (s_lo[j], s_hi[j]) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    }
                }
            }
            for j in 0..R {
                if V != MADD {
                    let both = _mm256_add_epi32(
                        _mm256_mullo_epi32(s_lo[j], sc0),
                        _mm256_mullo_epi32(s_hi[j], sc1),
                    );
                    isum[j] = _mm256_add_epi32(isum[j], both);
                }
                // SAFETY: sub-blocks 8c + 2p and 8c + 2p + 1 of row i0 + j of x.
                let xsum = unsafe {
                    bcast(x.isums32.as_ptr().add((i0 + j) * nb + 8 * c + 2 * p) as *const u8)
                };
                msum[j] = _mm256_add_epi32(msum[j], _mm256_madd_epi16(mp, xsum));
            }
        }
        for j in 0..R {
            // SAFETY: block 8c of row i0 + j of x: its superblock's scale.
            let dx = unsafe { _mm256_broadcast_ss(x.scales.get_unchecked((i0 + j) * nb + 8 * c)) };
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[j]), _mm256_mul_ps(d, dx), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum[j]), _mm256_mul_ps(dmin, dx), acc[j]);
        }
    }
    // SAFETY: the caller's.
    unsafe { store(&acc, g, w.rows, i0, y) };
}
