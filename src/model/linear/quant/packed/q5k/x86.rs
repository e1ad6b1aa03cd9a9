//! [`super`]'s kernel on AVX2, AVX-512 VNNI and AVX-VNNI: the packed kernel's tile
//! (`packed/x86.rs`) for Q5_K.

use super::super::super::kquant::QK_K;
use super::super::super::{QRows, QWeight, BLOCK};
use super::super::x86::{bcast, dpbusd, half8, store, x_rows, MADD};
use super::super::ROWS;
use super::{highs_at, nibbles_at, GROUP_BYTES, MINS, SCALES};
use std::arch::x86_64::*;

three_forms!(pub(in crate::model::linear::quant) tile_in<const R: usize>);

/// The packed kernel's tile for Q5_K: Q4_K's (`q4k/x86.rs`) with a fifth bit. Per pair of
/// sub-blocks, each load of fifth bits serves the next four loads of nibbles: shifted right
/// by one more each time, its bits `k` (of the pair's first sub-block, after a first shift
/// left by 4) and `4 + k` (of the second) reach bit 4 of the nibble bytes, where a mask and
/// an `or` put them. On AVX2, `maddubs` sums in 16 bits over four loads (at most 4 · 2 · 31
/// · 127 = 31,496), then `madd` by the rows' 6-bit scales into 32 bits; with VNNI (`V` is
/// `EVEX` or `VEX`) `vpdpbusd` sums each sub-block's 8 loads in 32-bit lanes and `vpmulld`
/// scales them. The minimums and `d · dx`, `dmin · dx` as Q4_K's. The body of `tile`,
/// `tile_vnni` and `tile_avx_vnni` (`three_forms!`).
///
/// # Safety
/// The CPU runs AVX2, FMA and F16C, and the VNNI that `V` names; `w` is packed Q5_K and its
/// planes fit its shape (`Superblocks::fits`); group `g` and rows `i0..i0 + R` of x (of
/// `w`'s width) exist; `y` is valid for writes at `(i0 + j) · w.rows + r` for j < R and the
/// group's real rows r, which nothing else touches meanwhile.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_in<const R: usize, const V: u8>(
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
        // u · 8 and GROUP_BYTES of quants from u · GROUP_BYTES (`Superblocks::fits`); x's rows
        // i0..i0 + R hold n superblocks.
        let (d, dmin, base) = unsafe {
            (
                half8(w.scales.as_ptr().add(u * ROWS)),
                half8(w.mins.as_ptr().add(u * ROWS)),
                w.quants.as_ptr().add(u * GROUP_BYTES),
            )
        };
        let xs = x_rows::<R>(x, i0, c * QK_K);
        let mut isum = [_mm256_setzero_si256(); R];
        let mut msum = [_mm256_setzero_si256(); R];
        for p in 0..4 {
            // SAFETY: 16 bytes of scales and of minimums of pair p, within the superblock.
            let (sc, mp) = unsafe {
                (
                    _mm256_cvtepu8_epi16(_mm_loadu_si128(
                        base.add(SCALES + 16 * p) as *const __m128i
                    )),
                    _mm256_cvtepu8_epi16(
                        _mm_loadu_si128(base.add(MINS + 16 * p) as *const __m128i),
                    ),
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
            // AVX2: 16-bit sums per sub-block over 4 loads; VNNI: 32-bit ones over 8.
            let (mut s_lo, mut s_hi) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for h in 0..2 {
                // SAFETY: see above.
                let bits =
                    unsafe { _mm256_loadu_si256(base.add(highs_at(p, h)) as *const __m256i) };
                let (mut a, mut b) = (_mm256_slli_epi16(bits, 4), bits);
                for k in 0..4 {
                    let v = 4 * h + k;
                    // SAFETY: see above.
                    let raw =
                        unsafe { _mm256_loadu_si256(base.add(nibbles_at(p, v)) as *const __m256i) };
                    // 16-bit shifts: bit 4 of each byte comes from its own byte (k < 4).
                    let lo =
                        _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(a, fifth));
                    let hi = _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(raw, 4), low),
                        _mm256_and_si256(b, fifth),
                    );
                    (a, b) = (_mm256_srli_epi16(a, 1), _mm256_srli_epi16(b, 1));
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
                if V == MADD {
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
