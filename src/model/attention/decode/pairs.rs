//! The value sum over a bf16 cache where the CPU multiplies bf16 pairs (AVX-512 BF16, Zen 4
//! and 5, Sapphire Rapids): `acc (M, Dv) += p (M, L) · v (L, Dv)` with two cached rows per
//! `vdpbf16ps`, against the weights of those two positions rounded to bf16.
//!
//! The widening tile (`tile`) spends one f32 multiply-add per weight and value, plus the
//! widening of each value; here one `vdpbf16ps` takes two positions' values of 16 columns:
//! rows j and j + 1 interleaved by `vpunpck{l,h}wd` (each 32-bit lane a pair of one column),
//! times the pair (p_j, p_j+1) broadcast to every lane. The unpacks order a tile's columns
//! within 128-bit lanes ([`UNPERMUTE`] puts them back once per tile). MLA's absorbed decode
//! makes the value sum as heavy as the scores (nine heads over one latent row of 192 for
//! `mla:192,rope=64`); this halves its multiply-adds.
//!
//! The weights are rounded to bf16 (to nearest, ties to even), as the query already is for
//! the keys on such a CPU ([`super::query`]) and as transformers' bf16 attention rounds its
//! softmax (`softmax(..).to(bf16)` before the product with V): a relative error below 2⁻⁸
//! per weight, random in sign, in sums kept in f32 (llama.cpp's CPU flash attention sums an
//! f16 cache's values in f16). An odd last row and the columns past a multiple of 32 are
//! summed in f32, of the same rounded weights.
//!
//! Zen 4, the decode op alone (`probe_decode_attention`, 2 threads, alternating rounds):
//! `mla:192,rope=64`'s 30 layers at 6000 positions 303-367 -> 243-258 us a layer,
//! `mla:64,rope=64` 132-144 -> 113-117, GQA 9/3 203-264 -> 202-212. Tiles of 32 columns
//! for three heads had been slower than the widening tile on GQA's cache (two passes over
//! each row's two cache lines); the widths now follow the heads ([`SUMS`]).

use crate::model::linear::simd::{self, Isa};
use std::arch::x86_64::*;

/// Heads per tile, and sums per tile: ROWS heads × CH chunks of 32 columns keep 2·ROWS·CH
/// sums in registers (24 of AVX-512's 32 at most), enough independent chains to hide
/// `vdpbf16ps`'s latency.
const MR: usize = 6;
const SUMS: usize = 24;

/// Lanes of the (low, high) unpack results, in column order: columns 0-3 of each 8 are in the
/// low result's 128-bit lane, 4-7 in the high result's. Indices into `permutex2var(lo, hi)`
/// for columns 0-15 and 16-31.
const UNPERMUTE: [[i32; 16]; 2] = [
    [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23],
    [8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31],
];
/// The other way: the low and high results' lanes from columns 0-15 and 16-31.
const PERMUTE: [[i32; 16]; 2] = [
    [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
    [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31],
];

/// `acc (M, Dv) += p (M, L) · v (L, Dv)`, row j of v at `v[j·vs..j·vs + dv]` (raw bf16
/// bits); M = acc / Dv and L = p / M; p rounded to bf16 as `isa` rounds it.
///
/// # Safety
/// The CPU has AVX-512F, BW, VL and BF16, and `simd::bf16_pairs(isa)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn accumulate(isa: Isa, p: &[f32], v: &[u16], dv: (usize, usize), acc: &mut [f32]) {
    let pb = simd::bf16_bits_of(isa, p);
    // SAFETY: the caller's contract.
    unsafe { accumulate_bits(&pb, v, dv, acc) }
}

/// [`accumulate`] for p already in bf16 (raw bits): a prompt's query rows against its keys
/// transposed (`prompt/fused.rs`).
///
/// # Safety
/// As for [`accumulate`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
pub unsafe fn accumulate_bits(pb: &[u16], v: &[u16], (dv, vs): (usize, usize), acc: &mut [f32]) {
    if dv == 0 || acc.is_empty() {
        return;
    }
    let m = acc.len() / dv;
    let l = pb.len() / m;
    assert!(
        l == 0 || (l - 1) * vs + dv <= v.len(),
        "the value rows are inside v"
    );
    let (pairs, chunks) = (l / 2, dv / 32);
    let mut h = 0;
    while h < m {
        // Balanced tiles of at most MR heads (nine as 5 + 4), each over as many columns as
        // its sums allow (one pass over a row of 64 values for three heads: with 32 at a
        // time, a second pass read a cache's other line of each row again).
        let rows = (m - h).div_ceil((m - h).div_ceil(MR));
        let (w, a) = (
            &pb[h * l..(h + rows) * l],
            &mut acc[h * dv..(h + rows) * dv],
        );
        let mut c = 0;
        while c < chunks {
            let at = (32 * c, vs, pairs);
            // SAFETY: AVX-512 BF16 as above; the tile reads 32·CH values from column 32c
            // (CH <= chunks - c: within dv) of rows < 2·pairs <= l.
            c += unsafe {
                match rows {
                    6 => heads::<6>(chunks - c, w, l, v, at, dv, a),
                    5 => heads::<5>(chunks - c, w, l, v, at, dv, a),
                    4 => heads::<4>(chunks - c, w, l, v, at, dv, a),
                    3 => heads::<3>(chunks - c, w, l, v, at, dv, a),
                    2 => heads::<2>(chunks - c, w, l, v, at, dv, a),
                    _ => heads::<1>(chunks - c, w, l, v, at, dv, a),
                }
            };
        }
        h += rows;
    }
    // The columns past the tiles in every row, and the odd last row in the tiles' columns,
    // in f32 (of the same rounded weights).
    let (widen, body) = (|b: u16| f32::from_bits((b as u32) << 16), 32 * chunks);
    let rows = match body < dv {
        true => 0..l,
        false => 2 * pairs..l, // the odd last row, if any
    };
    for (r, sums) in acc.chunks_exact_mut(dv).enumerate() {
        for j in rows.clone() {
            let (pj, from) = (widen(pb[r * l + j]), if j == 2 * pairs { 0 } else { body });
            for (s, &x) in sums[from..].iter_mut().zip(&v[j * vs + from..j * vs + dv]) {
                *s += pj * widen(x);
            }
        }
    }
}

/// [`tile`] of ROWS heads over as many of the `left` (> 0) chunks of 32 columns as its sums
/// allow (4, 2 or 1); returns how many it summed.
///
/// # Safety
/// As for [`tile`], for `left` chunks from column c.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn heads<const ROWS: usize>(
    left: usize,
    w: &[u16],
    l: usize,
    v: &[u16],
    at: (usize, usize, usize),
    dv: usize,
    acc: &mut [f32],
) -> usize {
    // SAFETY: the caller's contract; each tile reads at most `left` chunks.
    unsafe {
        match left {
            4.. if 2 * ROWS * 4 <= SUMS => tile::<ROWS, 4>(w, l, v, at, dv, acc),
            2.. if 2 * ROWS * 2 <= SUMS => tile::<ROWS, 2>(w, l, v, at, dv, acc),
            _ => tile::<ROWS, 1>(w, l, v, at, dv, acc),
        }
    }
}

/// ROWS heads (rows of `w`, bf16 weights `l` apart) × CH·32 columns from c, over the first
/// 2·`pairs` rows of v, added into `acc` (ROWS rows of `dv`).
///
/// # Safety
/// AVX-512 BF16; row 2·pairs − 1 of v has CH·32 values from column c.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[allow(clippy::needless_range_loop)] // const-bound index loops become registers
unsafe fn tile<const ROWS: usize, const CH: usize>(
    w: &[u16],
    l: usize,
    v: &[u16],
    (c, vs, pairs): (usize, usize, usize),
    dv: usize,
    acc: &mut [f32],
) -> usize {
    // From acc, not 0 (as `tile`'s sums): a paged block's runs add their rows in one chain,
    // so it sums as the same rows in one run (runs are whole pool blocks, an even number of
    // rows, but the last).
    let (into, back) = (PERMUTE.map(|i| indices(i)), UNPERMUTE.map(|i| indices(i)));
    let (mut lo, mut hi) = (
        [[_mm512_setzero_ps(); CH]; ROWS],
        [[_mm512_setzero_ps(); CH]; ROWS],
    );
    for r in 0..ROWS {
        for k in 0..CH {
            let at = &acc[r * dv + c + 32 * k..][..32];
            // SAFETY: `at` holds 32 values.
            let (x, y) = unsafe {
                (
                    _mm512_loadu_ps(at.as_ptr()),
                    _mm512_loadu_ps(at[16..].as_ptr()),
                )
            };
            lo[r][k] = _mm512_permutex2var_ps(x, into[0], y);
            hi[r][k] = _mm512_permutex2var_ps(x, into[1], y);
        }
    }
    let (vp, wp) = (v.as_ptr(), w.as_ptr());
    for i in 0..pairs {
        // Rows 2i and 2i + 1 interleaved, chunk by chunk (each 32-bit lane a column's pair).
        let mut a = [as_bh(_mm512_setzero_si512()); CH];
        let mut b = a;
        for k in 0..CH {
            // SAFETY: rows 2i and 2i + 1 have CH·32 values from c (the caller's contract).
            unsafe {
                let at = |row: usize| vp.add(row * vs + c + 32 * k) as *const __m512i;
                let (r0, r1) = (
                    _mm512_loadu_si512(at(2 * i)),
                    _mm512_loadu_si512(at(2 * i + 1)),
                );
                a[k] = as_bh(_mm512_unpacklo_epi16(r0, r1));
                b[k] = as_bh(_mm512_unpackhi_epi16(r0, r1));
            }
        }
        for r in 0..ROWS {
            // SAFETY: weight pair i of head r is inside w (2i + 1 < l).
            let pair = unsafe { (wp.add(r * l + 2 * i) as *const i32).read_unaligned() };
            let pw = as_bh(_mm512_set1_epi32(pair));
            for k in 0..CH {
                lo[r][k] = _mm512_dpbf16_ps(lo[r][k], a[k], pw);
                hi[r][k] = _mm512_dpbf16_ps(hi[r][k], b[k], pw);
            }
        }
    }
    for r in 0..ROWS {
        for k in 0..CH {
            for (half, idx) in back.iter().enumerate() {
                let at = &mut acc[r * dv + c + 32 * k + 16 * half..][..16];
                let sums = _mm512_permutex2var_ps(lo[r][k], *idx, hi[r][k]);
                // SAFETY: `at` holds 16 values.
                unsafe { _mm512_storeu_ps(at.as_mut_ptr(), sums) };
            }
        }
    }
    CH
}

/// A permutation's 16 lane indices in a register.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
fn indices(i: [i32; 16]) -> __m512i {
    // SAFETY: 16 i32 are 64 readable bytes.
    unsafe { _mm512_loadu_epi32(i.as_ptr()) }
}

/// 32 bf16 lanes of an integer vector, as the pair instructions type them.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
#[inline]
pub(super) fn as_bh(x: __m512i) -> __m512bh {
    // SAFETY: both types are 64 bytes of lanes.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the plain sum in f64 of the same bf16-rounded weights: odd and even row
    /// counts (a last row alone), 1-9 and 17 heads (tiles of 6 and less), widths with a tail
    /// past 32 columns, and value rows further apart than they are wide.
    #[test]
    fn pairs_equal_the_plain_sum_of_rounded_weights() {
        if !simd::bf16_pairs(Isa::detect()) {
            eprintln!("SKIPPED: this CPU lacks AVX-512 BF16");
            return;
        }
        let bf = |x: f32| half::bf16::from_f32(x);
        let dev = candle_core::Device::Cpu;
        let randn = |n: usize| {
            candle_core::Tensor::randn(0f32, 1.0, n, &dev)
                .and_then(|t| t.to_vec1::<f32>())
                .expect("random values")
        };
        for (m, l, dv, vs) in [
            (9, 256, 192, 256),
            (3, 7, 64, 64),
            (1, 1, 32, 32),
            (5, 33, 40, 72),
            (17, 64, 96, 96),
            (2, 2, 129, 160),
        ] {
            let p: Vec<f32> = randn(m * l).iter().map(|x| x.abs()).collect();
            let v: Vec<u16> = randn((l - 1) * vs + dv)
                .iter()
                .map(|&x| bf(x).to_bits())
                .collect();
            let start = randn(m * dv);
            let mut ours = start.clone();
            // SAFETY: checked above.
            unsafe { accumulate(Isa::detect(), &p, &v, (dv, vs), &mut ours) };
            for r in 0..m {
                for c in 0..dv {
                    let mut want = start[r * dv + c] as f64;
                    for j in 0..l {
                        let pj = bf(p[r * l + j]).to_f32(); // every weight rounded to bf16
                        want += pj as f64 * half::bf16::from_bits(v[j * vs + c]).to_f64();
                    }
                    let got = ours[r * dv + c] as f64;
                    assert!(
                        (got - want).abs() < 1e-5 * (1.0 + want.abs()) * (l as f64).sqrt(),
                        "m={m} l={l} dv={dv}: head {r} column {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
