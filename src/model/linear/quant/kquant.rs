//! The formats whose blocks carry integer sub-scales, read as ggml stores them: the K-quants
//! (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K: superblocks of 256 weights with 4-, 6- or 8-bit scales per
//! 16 or 32 of them) and the 5-bit formats (Q5_0, Q5_1: 32 weights and a 32-bit mask of
//! fifth bits).
//!
//! All of them decode one way, 32 weights (a chunk) at a time: unsigned quants q (0..=63),
//! an integer scale s and an integer m per 16 weights, and the block's f32 `d` and `dmin`,
//! so that `w = d·s·q − dmin·m`. A format with signed quants folds its offset into m
//! (Q6_K's q − 32: dmin = d, m = 32·s; Q3_K's q − 4; Q5_0's q − 16), and Q5_1's minimum is
//! dmin = −m with m = 1. Against a row of x in 8-bit blocks (scale `dx`, `sums16` per 16 values)
//! a chunk's share of the dot product is `d·dx·Σ_h s_h·Σ q·x_q − dmin·Σ_h m_h·sums16_h`:
//! unsigned bytes times signed ones, `maddubs` on AVX2 (q ≤ 63, so the pairs cannot
//! saturate), then the halves' scales by `madd` ([`x86`]). Against a K-quant, x has one
//! scale per superblock (llama.cpp's Q8_K, [`QRows::quantize_for`]), so that a superblock
//! sums in integers and `d·dx` multiplies once. The layouts are ggml's
//! (`ggml-common.h`); [`quants`] and [`scales`] are the reference the SIMD form is tested
//! against, and the product of a CPU without AVX2 (NEON has no form of its own yet).

use super::{Format, QRows, QWeight, BLOCK};
#[cfg(target_arch = "x86_64")]
use crate::model::linear::simd::{Isa, IsaKind};
use half::f16;

/// Weights per K-quant superblock (ggml's `QK_K`).
pub const QK_K: usize = 256;

/// A block's scales, decoded once for all its chunks: `w = d·s[j]·q − dmin·m[j]` for the
/// weights `16·j .. 16·j + 16` of the block (the first two only for 32-weight blocks).
#[derive(Clone, Copy, Debug)]
pub(super) struct Scales {
    pub d: f32,
    pub dmin: f32,
    pub s: [i16; 16],
    pub m: [i16; 16],
}

fn half(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q4_K's and Q5_K's 8 six-bit scales and 8 minimums from their 12 packed bytes, all at
/// once in 32-bit words (llama.cpp's `utmp` form of `get_scale_min_k4`: scales are bytes
/// 0-7 of the result, minimums 8-15).
pub(super) fn scale_min_k4(q: &[u8; 12]) -> [u8; 16] {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let word = |k: usize| u32::from_le_bytes([q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]]);
    let (u0, u1, u2) = (word(0), word(1), word(2));
    let out = [
        u0 & KMASK1,
        (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4),
        u1 & KMASK1,
        ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4),
    ];
    let mut bytes = [0u8; 16];
    for (b, w) in bytes.chunks_exact_mut(4).zip(out) {
        b.copy_from_slice(&w.to_le_bytes());
    }
    bytes
}

/// Q3_K's 16 six-bit scales from their 12 packed bytes, as stored (32 too large: ggml's
/// `dequantize_row_q3_K`).
pub(super) fn q3k_scales(b: &[u8; 12]) -> [u8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let word = |k: usize| u32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]]);
    let (a0, a1, tmp) = (word(0), word(1), word(2));
    let aux = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    std::array::from_fn(|j| ((aux[j / 4] >> (8 * (j % 4))) & 0xFF) as u8)
}

/// The scales of block `b` (its ggml bytes) of a format kept in ggml's blocks.
pub(super) fn scales(format: Format, b: &[u8]) -> Scales {
    let mut out = Scales {
        d: 0.0,
        dmin: 0.0,
        s: [0; 16],
        m: [0; 16],
    };
    let mut offset = |d: f32, s: [i16; 16], by: i16| {
        out.d = d;
        out.dmin = d;
        out.s = s;
        out.m = s.map(|s| s * by);
    };
    match format {
        Format::Q6K => offset(
            half(b, 208),
            std::array::from_fn(|j| b[192 + j] as i8 as i16),
            32,
        ),
        Format::Q3K => {
            let raw = q3k_scales(b[96..108].try_into().expect("12 bytes"));
            offset(half(b, 108), raw.map(|s| s as i16 - 32), 4)
        }
        Format::Q5_0 => offset(half(b, 0), [1; 16], 16),
        Format::Q5_1 => {
            (out.d, out.dmin) = (half(b, 0), -half(b, 2));
            (out.s, out.m) = ([1; 16], [1; 16]);
        }
        Format::Q2K => {
            (out.d, out.dmin) = (half(b, 80), half(b, 82));
            out.s = std::array::from_fn(|j| (b[j] & 0x0F) as i16);
            out.m = std::array::from_fn(|j| (b[j] >> 4) as i16);
        }
        Format::Q4K | Format::Q5K => {
            (out.d, out.dmin) = (half(b, 0), half(b, 2));
            let sm = scale_min_k4(b[4..16].try_into().expect("12 bytes"));
            out.s = std::array::from_fn(|j| sm[j / 2] as i16);
            out.m = std::array::from_fn(|j| sm[8 + j / 2] as i16);
        }
        Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => {
            unreachable!("{format:?} keeps its scales apart")
        }
    }
    out
}

/// The unsigned quants of chunk `c` (weights `32·c .. 32·c + 32`) of block `b`.
pub(super) fn quants(format: Format, b: &[u8], c: usize) -> [u8; BLOCK] {
    // K-quants: a half of 128 weights, and the chunk's place in it.
    let (n, j) = (c / 4, c % 4);
    // One plane of bits per weight: `plane[l] >> shift & mask`, then the next above it.
    let bits = |plane: &[u8], shift: usize, mask: u8| -> [u8; BLOCK] {
        let plane: &[u8; BLOCK] = plane[..BLOCK].try_into().expect("32 bytes");
        plane.map(|v| (v >> shift) & mask)
    };
    let join = |lo: [u8; BLOCK], hi: [u8; BLOCK], by: u8| -> [u8; BLOCK] {
        std::array::from_fn(|l| lo[l] | (hi[l] << by))
    };
    match format {
        Format::Q4K => bits(&b[16 + 32 * (c / 2)..], 4 * (c % 2), 0x0F),
        Format::Q5K => join(
            bits(&b[48 + 32 * (c / 2)..], 4 * (c % 2), 0x0F),
            bits(&b[16..], c, 1),
            4,
        ),
        Format::Q6K => join(
            bits(&b[64 * n + 32 * (j % 2)..], 4 * (j / 2), 0x0F),
            bits(&b[128 + 32 * n..], 2 * j, 3),
            4,
        ),
        Format::Q3K => join(bits(&b[32 + 32 * n..], 2 * j, 3), bits(b, c, 1), 2),
        Format::Q2K => bits(&b[16 + 32 * n..], 2 * j, 3),
        Format::Q5_0 | Format::Q5_1 => {
            let (qh, qs) = if format == Format::Q5_0 {
                (2, 6)
            } else {
                (4, 8)
            };
            let mask = u32::from_le_bytes([b[qh], b[qh + 1], b[qh + 2], b[qh + 3]]);
            let mut q = [0u8; BLOCK];
            for l in 0..16 {
                q[l] = b[qs + l] & 0x0F;
                q[l + 16] = b[qs + l] >> 4;
            }
            for (l, q) in q.iter_mut().enumerate() {
                *q |= (((mask >> l) & 1) as u8) << 4;
            }
            q
        }
        Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => {
            unreachable!("{format:?} is not read here")
        }
    }
}

/// Block `b` of weight row `r`: its ggml bytes.
fn block(w: &QWeight, r: usize, b: usize) -> &[u8] {
    let bytes = w.format.ggml_bytes();
    let at = (r * (w.cols / w.format.block_weights()) + b) * bytes;
    &w.quants[at..at + bytes]
}

/// The b-th 32 weights of the row-major matrix, in f32.
pub(super) fn values(w: &QWeight, b: usize) -> [f32; BLOCK] {
    let chunks = w.format.block_weights() / BLOCK;
    let (per_row, c) = (w.cols / w.format.block_weights(), b % chunks);
    values_of(
        w.format,
        block(w, b / chunks / per_row, b / chunks % per_row),
        c,
    )
}

/// Chunk `c` (32 weights) of the block whose ggml bytes are `blk`, in f32.
pub(super) fn values_of(format: Format, blk: &[u8], c: usize) -> [f32; BLOCK] {
    let (s, q) = (scales(format, blk), quants(format, blk, c));
    std::array::from_fn(|l| {
        let h = 2 * c + l / 16;
        s.d * s.s[h] as f32 * q[l] as f32 - s.dmin * s.m[h] as f32
    })
}

/// `W[r0 + r, c0 + c]` at `out[c · rows + r]` ([`QWeight::dequantize_transposed`], which
/// checked the bounds): each block's scales decoded once, not once per chunk.
pub(super) fn dequantize_transposed(
    w: &QWeight,
    (r0, rows): (usize, usize),
    (c0, cols): (usize, usize),
    out: &mut [f32],
) {
    let per = w.format.block_weights();
    for r in 0..rows {
        let mut decoded: Option<(usize, Scales)> = None;
        for c in (c0..c0 + cols).step_by(BLOCK) {
            let (b, chunk) = (c / per, c % per / BLOCK);
            let blk = block(w, r0 + r, b);
            let s = match decoded {
                Some((at, s)) if at == b => s,
                _ => decoded.insert((b, scales(w.format, blk))).1,
            };
            let q = quants(w.format, blk, chunk);
            for h in 0..2 {
                let (scale, min) = (
                    s.d * s.s[2 * chunk + h] as f32,
                    s.dmin * s.m[2 * chunk + h] as f32,
                );
                for l in 16 * h..16 * h + 16 {
                    out[(c - c0 + l) * rows + r] = scale * q[l] as f32 - min;
                }
            }
        }
    }
}

/// Weight row `r` times row `i` of x: on AVX2 (and AVX-512 CPUs) by [`x86`], else by
/// [`scalar`].
///
/// # Safety
/// `r` is a row of `w` and `i` a row of `x`, of `w`'s width; `w`'s blocks match its shape.
pub(super) unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
        // SAFETY: Isa::current() says this CPU has AVX2, FMA and F16C; the rest is ours.
        return unsafe { x86::dot::<1>(w, r, x, i) }[0];
    }
    scalar(w, r, x, i)
}

/// [`dot`] for rows `i0..i0 + 4` of x, each chunk unpacked once for the four.
///
/// # Safety
/// As [`dot`], for rows `i0..i0 + 4` of `x`.
pub(super) unsafe fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    if matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512) {
        // SAFETY: as in `dot`.
        return unsafe { x86::dot::<4>(w, r, x, i0) };
    }
    std::array::from_fn(|k| scalar(w, r, x, i0 + k))
}

/// The dot product as the file's header says, chunk by chunk in integers.
pub(super) fn scalar(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let chunks = w.format.block_weights() / BLOCK;
    let mut y = 0.0;
    for b in 0..w.cols / w.format.block_weights() {
        let blk = block(w, r, b);
        let s = scales(w.format, blk);
        for c in 0..chunks {
            let q = quants(w.format, blk, c);
            let xb = (i * w.cols) / BLOCK + b * chunks + c;
            let xq = &x.quants[xb * BLOCK..(xb + 1) * BLOCK];
            let half = |h: usize| -> i32 {
                let dot: i32 = (16 * h..16 * h + 16)
                    .map(|l| q[l] as i32 * xq[l] as i32)
                    .sum();
                s.s[2 * c + h] as i32 * dot
            };
            let mins: f32 = (0..2)
                .map(|h| s.m[2 * c + h] as f32 * x.sums16[2 * xb + h])
                .sum();
            y += s.d * x.scales[xb] * (half(0) + half(1)) as f32 - s.dmin * mins;
        }
    }
    y
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86;

#[cfg(test)]
mod tests;
