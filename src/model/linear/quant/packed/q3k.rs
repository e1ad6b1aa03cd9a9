//! Q3_K in [`super`]'s packed layout: superblocks of 256 weights `w = d·sc·(q − 4)`, q in
//! 0..=7 (two low bits and a high one) and a 6-bit scale `sc` (stored 32 too large) per 16
//! weights, for groups of 8 rows. The kernel is Q6_K's tile (`q6k/x86.rs`), whose 16-weight
//! sub-blocks and signed scales these are, with its quants unpacked from fewer bits.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`: `scales[.. · 8 + l]`
//! is row `8g + l`'s `d`; `quants[.. · GROUP_BYTES ..]` holds, for each pair `p` of 32-weight
//! chunks (weights `64p..64p + 64`), 224 bytes from `224p` in the order the kernel reads
//! them (one stream for the prefetchers, as Q6_K's):
//! - the scales ([`scales_at`]): row `l`'s `sc[4p..4p + 4] − 32` as `i8` at `4l`;
//! - for each `m` of 2: one load of high bits ([`highs_at`]), then two loads of low bits
//!   ([`lows_at`], `h` = 2m and 2m + 1). Row `l`'s byte `j` of load `h` of low bits holds,
//!   two bits each from bit 0 up, weights `64p + 8h + j`, `+ 4`, `+ 32` and `+ 36` (the
//!   order of Q6_K's four vectors a load); its byte `j` of high bits holds those weights'
//!   third bits, `h` = 2m at bits 0-3 and `h` = 2m + 1 at bits 4-7, so that shifts and a
//!   mask put each at bit 2.
//!
//! 114 bytes a row's superblock with its `d` against ggml's 110 (the scales unpacked).

use super::super::kquant::{q3k_scales, QK_K};
use super::super::{Format, QWeight};
use super::superblocks::{all_quants, four, ggml_low_bits, low_bits, Superblocks};
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * 112;

// The pairs' 224 bytes tile the superblock exactly.
const _: () = assert!(highs_at(0, 0) == 32 && lows_at(3, 3) + 32 == GROUP_BYTES);

/// Where pair `p`'s 32 bytes of scales are in a group's superblock.
pub(super) const fn scales_at(p: usize) -> usize {
    224 * p
}

/// Where pair `p`'s load `m` (of 2) of high bits is.
pub(super) const fn highs_at(p: usize, m: usize) -> usize {
    224 * p + 32 + 96 * m
}

/// Where pair `p`'s load `h` (of 4) of low bits is.
pub(super) const fn lows_at(p: usize, h: usize) -> usize {
    highs_at(p, h / 2) + 32 + 32 * (h % 2)
}

/// Q3_K's packed form.
pub(super) const SUPERBLOCKS: Superblocks = Superblocks {
    ggml: 110,
    group_bytes: GROUP_BYTES,
    dmin: false,
    put,
    get,
};

/// ggml's superblock `blk` (32 bytes of high bits `hmask`, 64 of low bits `qs`, 12 of
/// scales, d) as lane `l` of unit `u`.
fn put(out: &mut QWeight, u: usize, l: usize, blk: &[u8]) {
    out.scales[u * ROWS + l] = f16::from_le_bytes([blk[108], blk[109]]);
    let q = all_quants(Format::Q3K, blk);
    let sc = q3k_scales(blk[96..108].try_into().expect("12 bytes"));
    let base = u * GROUP_BYTES;
    for p in 0..4 {
        for k in 0..4 {
            out.quants[base + scales_at(p) + 4 * l + k] = sc[4 * p + k].wrapping_sub(32);
        }
        for h in 0..4 {
            for j in 0..4 {
                let third = four(p, h, j)
                    .into_iter()
                    .enumerate()
                    .fold(0u8, |acc, (t, at)| acc | (q[at] >> 2) << t);
                out.quants[base + lows_at(p, h) + 4 * l + j] = low_bits(&q, p, h, j);
                // h = 2m's third bits at bits 0-3, 2m + 1's at 4-7 (the unit starts zero).
                out.quants[base + highs_at(p, h / 2) + 4 * l + j] |= third << (4 * (h % 2));
            }
        }
    }
}

/// ggml's 110 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    let mut q = [0u8; QK_K];
    let mut sc = [0u8; 16];
    for p in 0..4 {
        for k in 0..4 {
            sc[4 * p + k] = w.quants[base + scales_at(p) + 4 * l + k].wrapping_add(32);
        }
        for h in 0..4 {
            for j in 0..4 {
                let lows = w.quants[base + lows_at(p, h) + 4 * l + j];
                let third = w.quants[base + highs_at(p, h / 2) + 4 * l + j] >> (4 * (h % 2));
                for (t, at) in four(p, h, j).into_iter().enumerate() {
                    q[at] = (lows >> (2 * t) & 3) | (third >> t & 1) << 2;
                }
            }
        }
    }
    // ggml's `hmask` (weight 32k + i's third bit at bit k of byte i), then `qs`
    // (`quantize_row_q3_K_ref`).
    blk[..32].fill(0);
    for (at, &q) in q.iter().enumerate() {
        blk[at % 32] |= (q >> 2) << (at / 32);
    }
    ggml_low_bits(&q, &mut blk[32..96]);
    blk[96..108].copy_from_slice(&q3k_scales_bytes(&sc));
    blk[108..].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
}

/// The 16 six-bit scales in ggml's 12 bytes ([`q3k_scales`] read backwards: the low nibbles
/// of scales 0-7 and 8-15 in bytes 0-7, the top two bits of scale `j` at bits `2(j / 4)` of
/// byte `8 + j % 4`).
fn q3k_scales_bytes(sc: &[u8; 16]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for (j, &s) in sc.iter().enumerate() {
        out[j % 8] |= (s & 15) << (4 * (j / 8));
        out[8 + j % 4] |= (s >> 4) << (2 * (j / 4));
    }
    out
}
