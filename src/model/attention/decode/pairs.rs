//! The value sum of a bf16 cache as bf16 pairs, on AVX-512 BF16: `acc (M, Dv) += p (M, L) ·
//! v (L, Dv)` with the weights p rounded to bf16, two rows of v per `vdpbf16ps` (each f32
//! lane adds `p_j · v_j[d] + p_{j+1} · v_{j+1}[d]`, both products exact), where
//! [`super::tile::accumulate`] widens v and multiplies in f32: half the instructions. The
//! weights are rounded as PyTorch's CPU attention rounds them for a bf16 model before its
//! `P · V`; the prompt's attention rounds them alike (`super::super::sdpa`).
//!
//! Two rows of 32 values are interleaved by `vpunpcklwd`/`vpunpckhwd`, which work within
//! 128-bit lanes: the sums of columns 8k..8k+3 land in lanes 4k..4k+3 of one register and
//! those of 8k+4..8k+7 in the other ([`LANES`]), put back in order once per tile
//! ([`ORDER`]). A tile's sums start from `acc`, not from 0, so that a block read in several
//! runs (a paged cache) adds its rows in the order of one run: a paged sequence's step
//! equals its step over a cache of its own.

use crate::model::linear::simd::{self, Isa};
use std::arch::x86_64::*;

/// Values per tile: two registers of 16 sums.
const CH: usize = 32;

/// The columns of `acc` (0..16, then 16..32 in `vpermt2ps`' second source) that lanes
/// 0..16 of the (lo, hi) sums hold.
const LANES: [[i32; 16]; 2] = [
    [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
    [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31],
];

/// Where output column c of a tile's 32 comes from in (lo, hi) = lanes 0..16, 16..32 of
/// `vpermt2ps`' two sources: columns 0..16, then 16..32.
const ORDER: [[i32; 16]; 2] = [
    [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23],
    [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31],
];

/// [`super::tile::accumulate`] for a bf16 cache (raw bits), with p rounded to bf16.
///
/// # Panics
/// Unless `isa` multiplies bf16 pairs ([`simd::bf16_pairs`]), or if v is shorter than its
/// L rows.
pub fn accumulate(isa: Isa, p: &[f32], v: &[u16], (dv, vs): (usize, usize), acc: &mut [f32]) {
    assert!(simd::bf16_pairs(isa), "the CPU multiplies bf16 pairs");
    if dv == 0 || acc.is_empty() {
        return;
    }
    let m = acc.len() / dv;
    let l = p.len() / m;
    if l == 0 {
        return;
    }
    assert!(
        v.len() >= (l - 1) * vs + dv && vs >= dv,
        "v holds L rows of Dv"
    );
    // Each head's weights as bf16, its row padded to an even length with a 0 (the weight of
    // the zero row that pairs with an odd last row).
    let l2 = l + l % 2;
    let mut pb = vec![0u16; m * l2];
    for (row, out) in simd::bf16_bits_of(isa, p)
        .chunks_exact(l)
        .zip(pb.chunks_exact_mut(l2))
    {
        out[..l].copy_from_slice(row);
    }
    // Heads in tiles of 4, or of 3 where that divides them (nine heads as 3 × 3).
    let first = match !m.is_multiple_of(4) && m.is_multiple_of(3) {
        true => 3,
        false => 4,
    };
    let mut h = 0;
    while h < m {
        let rows = (m - h).min(first);
        let (pb, acc) = (
            &pb[h * l2..(h + rows) * l2],
            &mut acc[h * dv..(h + rows) * dv],
        );
        // SAFETY: `bf16_pairs` asked the CPU for AVX-512 BF16; v's L rows hold Dv values.
        unsafe {
            match rows {
                4 => heads::<4>(pb, v, (l, dv, vs), acc),
                3 => heads::<3>(pb, v, (l, dv, vs), acc),
                2 => heads::<2>(pb, v, (l, dv, vs), acc),
                _ => heads::<1>(pb, v, (l, dv, vs), acc),
            }
        }
        h += rows;
    }
}

/// MR heads: their weights `pb` (rows of L rounded up to even), every row of v, in tiles
/// of [`CH`] values; the last Dv % CH values one at a time.
///
/// # Safety
/// The CPU has AVX-512 BF16, and v holds L rows of Dv values `vs` apart.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn heads<const MR: usize>(
    pb: &[u16],
    v: &[u16],
    (l, dv, vs): (usize, usize, usize),
    acc: &mut [f32],
) {
    let l2 = pb.len() / MR;
    let mut c = 0;
    while c + CH <= dv {
        let mut sums = [[_mm512_setzero_ps(); 2]; MR];
        for (r, sum) in sums.iter_mut().enumerate() {
            let out = &acc[r * dv + c..][..CH];
            for (s, lanes) in sum.iter_mut().zip(&LANES) {
                // SAFETY: 32 f32 read from `out`.
                unsafe {
                    let idx = _mm512_loadu_si512(lanes.as_ptr() as *const __m512i);
                    let (a0, a1) = (
                        _mm512_loadu_ps(out.as_ptr()),
                        _mm512_loadu_ps(out.as_ptr().add(16)),
                    );
                    *s = _mm512_permutex2var_ps(a0, idx, a1);
                }
            }
        }
        let mut j = 0;
        while j < l {
            // SAFETY: rows j and j + 1 < L hold values c..c + 32 (c + 32 <= Dv); an odd last
            // row pairs with zeros. Pair (j, j + 1) of each head's weights is inside its
            // padded row.
            unsafe {
                let a = _mm512_loadu_si512(v.as_ptr().add(j * vs + c) as *const __m512i);
                let b = match j + 1 < l {
                    true => _mm512_loadu_si512(v.as_ptr().add((j + 1) * vs + c) as *const __m512i),
                    false => _mm512_setzero_si512(),
                };
                let lo = bh(_mm512_unpacklo_epi16(a, b));
                let hi = bh(_mm512_unpackhi_epi16(a, b));
                for (r, sum) in sums.iter_mut().enumerate() {
                    let pair = (pb.as_ptr().add(r * l2 + j) as *const i32).read_unaligned();
                    let w = bh(_mm512_set1_epi32(pair));
                    sum[0] = _mm512_dpbf16_ps(sum[0], lo, w);
                    sum[1] = _mm512_dpbf16_ps(sum[1], hi, w);
                }
            }
            j += 2;
        }
        for (r, [lo, hi]) in sums.into_iter().enumerate() {
            for (half, order) in ORDER.iter().enumerate() {
                let out = &mut acc[r * dv + c + 16 * half..][..16];
                // SAFETY: 16 lanes in, 16 f32 written in `out`.
                unsafe {
                    let idx = _mm512_loadu_si512(order.as_ptr() as *const __m512i);
                    _mm512_storeu_ps(out.as_mut_ptr(), _mm512_permutex2var_ps(lo, idx, hi));
                }
            }
        }
        c += CH;
    }
    let widen = |b: u16| f32::from_bits((b as u32) << 16);
    for r in 0..MR {
        for j in 0..l {
            let pj = widen(pb[r * l2 + j]);
            for (a, x) in acc[r * dv + c..(r + 1) * dv]
                .iter_mut()
                .zip(&v[j * vs + c..])
            {
                *a += pj * widen(*x);
            }
        }
    }
}

/// 32 bf16 as AVX-512 BF16's operand type.
#[inline(always)]
fn bh(x: __m512i) -> __m512bh {
    // SAFETY: both types are 64 bytes of lanes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sum of rounded weights times values, at odd L and a Dv that leaves
    /// a tail, for 1 to 9 heads (tiles of 4, 3, 2 and 1).
    #[test]
    fn pairs_value_sum_equals_the_plain_sum() {
        let isa = Isa::current();
        if !simd::bf16_pairs(isa) {
            eprintln!("SKIPPED: this CPU has no AVX-512 BF16");
            return;
        }
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        for (m, l, dv, vs) in [
            (9, 37, 64, 128),
            (5, 8, 70, 70),
            (1, 1, 32, 40),
            (6, 17, 192, 256),
        ] {
            let p: Vec<f32> = (0..m * l)
                .map(|i| ((i * 37 % 101) as f32) / 101.0)
                .collect();
            let v: Vec<u16> = (0..(l - 1) * vs + dv)
                .map(|i| half::bf16::from_f32(((i * 53 % 97) as f32 - 48.0) / 16.0).to_bits())
                .collect();
            let start = |i: usize| (i % 13) as f32 / 4.0; // what acc held before
            let mut ours: Vec<f32> = (0..m * dv).map(start).collect();
            accumulate(isa, &p, &v, (dv, vs), &mut ours);
            for h in 0..m {
                for d in 0..dv {
                    let want: f32 = start(h * dv + d)
                        + (0..l)
                            .map(|j| {
                                round(p[h * l + j]) * f32::from_bits((v[j * vs + d] as u32) << 16)
                            })
                            .sum::<f32>();
                    let got = ours[h * dv + d];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{m} {l} {dv}: [{h}][{d}] {got} vs {want}"
                    );
                }
            }
        }
    }
}
