//! [`super`]'s dot product on AVX2: a chunk's quants unpacked to 32 unsigned bytes in
//! registers (shifts and masks of ggml's bit planes), a superblock's scales unpacked to
//! 16-bit lanes by byte shuffles ([`lanes`]), `maddubs` with x's bytes, `madd` with the two
//! halves' scales, summed in integers over the superblock (x has one scale per superblock
//! against a K-quant) and one FMA by `d·dx`. The format is a constant, so each format's
//! kernel is compiled with no branch on it inside its loops.
//!
//! Over 300 lines on purpose: the unpacking of every format's quants and scales is shared
//! by this kernel and the tile kernel (`quant::tile`), and is read most easily in one place.

use super::super::simd::x86::{hsum, widen};
use super::{q3k_scales, scale_min_k4, Format, QRows, QWeight, BLOCK, QK_K};
use half::f16;
use std::arch::x86_64::*;

// The formats as constants (the tile kernel, `quant::tile`, adds the split formats' 7-9).
pub(in crate::model::linear::quant) const Q5_0: u8 = 0;
pub(in crate::model::linear::quant) const Q5_1: u8 = 1;
pub(in crate::model::linear::quant) const Q2K: u8 = 2;
pub(in crate::model::linear::quant) const Q3K: u8 = 3;
pub(in crate::model::linear::quant) const Q4K: u8 = 4;
pub(in crate::model::linear::quant) const Q5K: u8 = 5;
pub(in crate::model::linear::quant) const Q6K: u8 = 6;

/// 32 bytes at `p`, shifted right by `by` bits (within 16-bit lanes: the bits that cross
/// into a byte from its neighbour are masked off) and masked with `mask`.
///
/// # Safety
/// AVX2; 32 bytes at `p` are readable.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn bits(p: *const u8, by: usize, mask: i8) -> __m256i {
    // SAFETY: the caller's.
    let v = unsafe { _mm256_loadu_si256(p as *const __m256i) };
    let v = _mm256_srl_epi16(v, _mm_cvtsi32_si128(by as i32));
    _mm256_and_si256(v, _mm256_set1_epi8(mask))
}

/// `lo | hi << 4`, or `<< 2` with `by` = 2, for bytes whose sum cannot cross a byte.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn join<const BY: i32>(lo: __m256i, hi: __m256i) -> __m256i {
    _mm256_or_si256(lo, _mm256_slli_epi16::<BY>(hi))
}

/// Bit l of `mask` as byte l, 0xFF or 0 (llama.cpp's `bytes_from_bits_32`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn bytes_from_bits(mask: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(mask as i32),
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0,
        ),
    );
    let others = _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
}

/// Chunk `c`'s 32 quants of the block at `p`, as [`super::quants`] gives them.
///
/// # Safety
/// AVX2; `p` is a whole block of format F, and c one of its chunks.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::model::linear::quant) unsafe fn quants<const F: u8>(
    p: *const u8,
    c: usize,
) -> __m256i {
    let (n, j) = (c / 4, c % 4);
    // SAFETY: every read below lies inside the block (ggml-common.h's layouts: the offsets
    // of the fields, plus 32 bytes, are at most the block's size).
    unsafe {
        match F {
            Q4K => bits(p.add(16 + 32 * (c / 2)), 4 * (c % 2), 0x0F),
            Q5K => join::<4>(
                bits(p.add(48 + 32 * (c / 2)), 4 * (c % 2), 0x0F),
                bits(p.add(16), c, 1),
            ),
            Q6K => join::<4>(
                bits(p.add(64 * n + 32 * (j % 2)), 4 * (j / 2), 0x0F),
                bits(p.add(128 + 32 * n), 2 * j, 3),
            ),
            Q3K => join::<2>(bits(p.add(32 + 32 * n), 2 * j, 3), bits(p, c, 1)),
            Q2K => bits(p.add(16 + 32 * n), 2 * j, 3),
            _ => {
                let (qh, qs) = if F == Q5_0 { (2, 6) } else { (4, 8) };
                let v = _mm_loadu_si128(p.add(qs) as *const __m128i);
                let nibbles = _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16(v, 4), v),
                    _mm256_set1_epi8(0x0F),
                );
                let mask = (p.add(qh) as *const u32).read_unaligned();
                let fifth = _mm256_and_si256(bytes_from_bits(mask), _mm256_set1_epi8(0x10));
                _mm256_or_si256(nibbles, fifth)
            }
        }
    }
}

/// Weight row `r` times rows `i0..i0 + R` of x.
///
/// # Safety
/// AVX2, FMA and F16C; `r` is a row of `w`, rows `i0..i0 + R` of `x` exist, of `w`'s width,
/// rounded for its format ([`QRows::quantize_for`]); `w`'s blocks match its shape
/// (`QWeight::product` checks it).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot<const R: usize>(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; R] {
    debug_assert!(w.format.block_weights() != QK_K || x.span == QK_K);
    // SAFETY: the caller's.
    unsafe {
        match w.format {
            Format::Q5_0 => dot_5::<Q5_0, R>(w, r, x, i0),
            Format::Q5_1 => dot_5::<Q5_1, R>(w, r, x, i0),
            Format::Q2K => dot_in::<Q2K, R>(w, r, x, i0),
            Format::Q3K => dot_in::<Q3K, R>(w, r, x, i0),
            Format::Q4K => dot_in::<Q4K, R>(w, r, x, i0),
            Format::Q5K => dot_in::<Q5K, R>(w, r, x, i0),
            Format::Q6K => dot_in::<Q6K, R>(w, r, x, i0),
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => {
                unreachable!("{:?} has its own kernel", w.format)
            }
        }
    }
}

/// A K-quant superblock's scales in registers: [`super::Scales`] with `s` and `m` as 16
/// 16-bit lanes, unpacked by byte shuffles and widenings rather than one lane at a time.
pub(in crate::model::linear::quant) struct Lanes {
    pub d: f32,
    pub dmin: f32,
    pub s: __m256i,
    pub m: __m256i,
}

/// The scales of superblock `b` (its ggml bytes) of K-quant format F.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::model::linear::quant) fn lanes<const F: u8>(b: &[u8]) -> Lanes {
    let half = |at: usize| widen(f16::from_le_bytes([b[at], b[at + 1]]));
    let bytes = |v: &[u8]| {
        let v: &[u8; 16] = v[..16].try_into().expect("16 bytes");
        // SAFETY: 16 bytes.
        unsafe { _mm_loadu_si128(v.as_ptr() as *const __m128i) }
    };
    match F {
        Q6K => {
            let s = _mm256_cvtepi8_epi16(bytes(&b[192..]));
            let d = half(208);
            let m = _mm256_slli_epi16::<5>(s);
            Lanes { d, dmin: d, s, m }
        }
        Q3K => {
            let raw = q3k_scales(b[96..108].try_into().expect("12 bytes"));
            let s = _mm256_sub_epi16(_mm256_cvtepu8_epi16(bytes(&raw)), _mm256_set1_epi16(32));
            let d = half(108);
            let m = _mm256_slli_epi16::<2>(s);
            Lanes { d, dmin: d, s, m }
        }
        Q2K => {
            let v = bytes(b);
            let low = _mm_set1_epi8(0x0F);
            Lanes {
                d: half(80),
                dmin: half(82),
                s: _mm256_cvtepu8_epi16(_mm_and_si128(v, low)),
                m: _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16::<4>(v), low)),
            }
        }
        _ => {
            // Q4_K, Q5_K: one scale and minimum per 32, each twice (per 16).
            let v = bytes(&scale_min_k4(b[4..16].try_into().expect("12 bytes")));
            Lanes {
                d: half(0),
                dmin: half(2),
                s: _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v)),
                m: _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(v, v)),
            }
        }
    }
}

/// The two halves' scales of each chunk of a superblock, as `madd` multiplies them: chunk
/// c's lanes 0-7 hold `s[2c]`, lanes 8-15 `s[2c + 1]` (one byte shuffle of the 16 scales per
/// chunk, rather than two broadcasts from memory).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(in crate::model::linear::quant) fn chunk_scales(all: __m256i) -> [__m256i; QK_K / BLOCK] {
    let (lo, hi) = (
        _mm256_broadcastsi128_si256(_mm256_castsi256_si128(all)),
        _mm256_broadcastsi128_si256(_mm256_extracti128_si256::<1>(all)),
    );
    // A loop, not `from_fn`: a closure is compiled without this function's target features.
    let mut out = [_mm256_setzero_si256(); QK_K / BLOCK];
    for (c, out) in out.iter_mut().enumerate() {
        // Bytes 4c', 4c' + 1 (scale 2c', c' = c mod 4) in the low lane, 4c' + 2 and 4c' + 3
        // in the high one.
        let at = 4 * (c % 4) as i8;
        let (a, b) = (at, at + 1);
        let (e, f) = (at + 2, at + 3);
        let pick = _mm256_setr_epi8(
            a, b, a, b, a, b, a, b, a, b, a, b, a, b, a, b, e, f, e, f, e, f, e, f, e, f, e, f, e,
            f, e, f,
        );
        *out = _mm256_shuffle_epi8(if c < 4 { lo } else { hi }, pick);
    }
    out
}

/// [`dot`] for one format. x has one scale per superblock ([`QRows::quantize_for`]), so a
/// superblock sums in integers: per chunk and x row `maddubs`, `madd` by the halves' scales
/// and an add; per superblock one FMA by `d·dx`, and the minimums as one `madd` of the 16
/// `m` by x's 16 half sums and an FMA by `dmin·dx`.
///
/// # Safety
/// As [`dot`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_in<const F: u8, const R: usize>(
    w: &QWeight,
    r: usize,
    x: &QRows,
    i0: usize,
) -> [f32; R] {
    let format = w.format;
    let bytes = format.ggml_bytes();
    const CHUNKS: usize = QK_K / BLOCK;
    let (blocks, xblocks) = (w.cols / QK_K, w.cols / BLOCK);
    let mut acc = [_mm256_setzero_ps(); R];
    let mut mins = [_mm256_setzero_ps(); R];
    for b in 0..blocks {
        let blk = &w.quants[(r * blocks + b) * bytes..][..bytes];
        let s = lanes::<F>(blk);
        let sv = chunk_scales(s.s);
        let mut dots = [_mm256_setzero_si256(); R];
        for (c, sv) in sv.into_iter().enumerate() {
            // SAFETY: blk is a whole block of this format (sliced, so checked), c < 8.
            let u = unsafe { quants::<F>(blk.as_ptr(), c) };
            for (k, dots) in dots.iter_mut().enumerate() {
                let xb = (i0 + k) * xblocks + b * CHUNKS + c;
                // SAFETY: block xb of x exists (the caller's rows, of w's width).
                let xv = unsafe {
                    _mm256_loadu_si256(x.quants.as_ptr().add(xb * BLOCK) as *const __m256i)
                };
                let d = _mm256_madd_epi16(_mm256_maddubs_epi16(u, xv), sv);
                *dots = _mm256_add_epi32(*dots, d);
            }
        }
        for k in 0..R {
            let xb = (i0 + k) * xblocks + b * CHUNKS;
            // SAFETY: the superblock's scale and 16 half sums of x exist.
            let (dx, sums) = unsafe {
                (
                    *x.scales.get_unchecked(xb),
                    _mm256_loadu_si256(x.isums16.as_ptr().add(2 * xb) as *const __m256i),
                )
            };
            let dots = _mm256_cvtepi32_ps(dots[k]);
            acc[k] = _mm256_fmadd_ps(dots, _mm256_set1_ps(s.d * dx), acc[k]);
            let m = _mm256_cvtepi32_ps(_mm256_madd_epi16(s.m, sums));
            mins[k] = _mm256_fmadd_ps(m, _mm256_set1_ps(s.dmin * dx), mins[k]);
        }
    }
    std::array::from_fn(|k| hsum(_mm256_sub_ps(acc[k], mins[k])))
}

/// [`dot`] for the 5-bit formats, whose blocks are a single chunk with one scale: the
/// per-block work of [`dot_in`] (decoding a superblock's scales) would cost as much as the
/// chunk itself. The quants go through `maddubs` unsigned (0..=31), and the block's offset
/// multiplies the x block's sum once: Q5_1's minimum, Q5_0's −16·d (w = d·(q − 16)).
///
/// # Safety
/// As [`dot`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_5<const F: u8, const R: usize>(
    w: &QWeight,
    r: usize,
    x: &QRows,
    i0: usize,
) -> [f32; R] {
    let bytes = w.format.ggml_bytes();
    let blocks = w.cols / BLOCK;
    // Two accumulators per x row, for even and odd blocks, so that consecutive blocks' FMAs
    // do not wait on each other (one block is a dozen instructions, the FMA's latency 4
    // cycles).
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut mins = [0f32; R];
    let row = &w.quants[r * blocks * bytes..(r + 1) * blocks * bytes];
    macro_rules! block {
        ($b:expr, $h:literal) => {{
            let b = $b;
            let blk = &row[b * bytes..(b + 1) * bytes];
            // SAFETY: blk is a whole block of this format.
            let q = unsafe { quants::<F>(blk.as_ptr(), 0) };
            let d = widen(f16::from_le_bytes([blk[0], blk[1]]));
            let m = match F {
                Q5_1 => widen(f16::from_le_bytes([blk[2], blk[3]])),
                _ => -16.0 * d,
            };
            for k in 0..R {
                let xb = (i0 + k) * blocks + b;
                // SAFETY: block xb of x exists (the caller's rows, of w's width), with its
                // scale and sum.
                let (xv, dx, sum) = unsafe {
                    (
                        _mm256_loadu_si256(x.quants.as_ptr().add(xb * BLOCK) as *const __m256i),
                        *x.scales.get_unchecked(xb),
                        *x.sums.get_unchecked(xb),
                    )
                };
                let dots = _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
                let scale = _mm256_set1_ps(d * dx);
                acc[k][$h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), scale, acc[k][$h]);
                mins[k] += m * sum;
            }
        }};
    }
    let mut b = 0;
    while b + 2 <= blocks {
        block!(b, 0);
        block!(b + 1, 1);
        b += 2;
    }
    if b < blocks {
        block!(b, 0);
    }
    std::array::from_fn(|k| hsum(_mm256_add_ps(acc[k][0], acc[k][1])) + mins[k])
}
