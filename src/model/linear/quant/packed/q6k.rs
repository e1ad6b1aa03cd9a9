//! Q6_K in [`super`]'s packed layout: superblocks of 256 weights `w = d·sc·(q − 32)`, q in
//! 0..=63 and a signed 8-bit scale `sc` per 16 weights, for groups of 8 rows.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`: `scales[.. · 8 + l]`
//! is row `8g + l`'s `d`; `quants[.. · GROUP_BYTES ..]` holds, for each pair `p` of 32-weight
//! chunks (weights `64p..64p + 64`), 416 bytes from `416p` in the order the kernel reads
//! them (from memory, its prefetchers then follow one stream):
//! - the scales ([`scales_at`]): row `l`'s `sc[4p..4p + 4]` at `4l`;
//! - for each `h` of 4: two loads of low nibbles ([`nibbles_at`], `v` = 2h and 2h + 1), row
//!   `l`'s 4 bytes at `4l`, byte `j` holding weight `64p + 4v + j`'s low 4 bits low and
//!   `64p + 32 + 4v + j`'s high; then one load of high bits ([`highs_at`]), row `l`'s byte
//!   `j` holding the 2 high bits of weights `64p + 8h + j`, `64p + 32 + 8h + j`,
//!   `64p + 8h + 4 + j` and `64p + 32 + 8h + 4 + j`, from its low bits up, so that one shift
//!   and a mask put a load's bits at bits 4-5 of the matching nibble bytes.

use super::super::kquant::QK_K;
use super::super::{Format, QWeight};
use super::superblocks::{all_quants, Superblocks};
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * 208;

// The pairs' 416 bytes tile the superblock exactly.
const _: () = assert!(nibbles_at(0, 0) == 32 && highs_at(3, 3) + 32 == GROUP_BYTES);

/// Where pair `p`'s 32 bytes of scales are in a group's superblock.
pub(super) const fn scales_at(p: usize) -> usize {
    416 * p
}

/// Where pair `p`'s load `v` (of 8) of low nibbles is.
pub(super) const fn nibbles_at(p: usize, v: usize) -> usize {
    416 * p + 32 + 96 * (v / 2) + 32 * (v % 2)
}

/// Where pair `p`'s load `h` (of 4) of high bits is.
pub(super) const fn highs_at(p: usize, h: usize) -> usize {
    416 * p + 96 + 96 * h
}

/// Q6_K's packed form.
pub(super) const SUPERBLOCKS: Superblocks = Superblocks {
    ggml: 210,
    group_bytes: GROUP_BYTES,
    dmin: false,
    put,
    get,
};

/// ggml's superblock `blk` as lane `l` of unit `u`.
fn put(out: &mut QWeight, u: usize, l: usize, blk: &[u8]) {
    out.scales[u * ROWS + l] = f16::from_le_bytes([blk[208], blk[209]]);
    let q = all_quants(Format::Q6K, blk);
    let base = u * GROUP_BYTES;
    for p in 0..4 {
        for v in 0..8 {
            for j in 0..4 {
                let (a, b) = (q[64 * p + 4 * v + j], q[64 * p + 32 + 4 * v + j]);
                out.quants[base + nibbles_at(p, v) + 4 * l + j] = (a & 15) | (b & 15) << 4;
            }
        }
        for h in 0..4 {
            for j in 0..4 {
                let at = 64 * p + 8 * h + j;
                let bits = [q[at], q[at + 32], q[at + 4], q[at + 36]];
                let byte = (0..4).fold(0u8, |acc, k| acc | (bits[k] >> 4) << (2 * k));
                out.quants[base + highs_at(p, h) + 4 * l + j] = byte;
            }
        }
        for k in 0..4 {
            out.quants[base + scales_at(p) + 4 * l + k] = blk[192 + 4 * p + k];
        }
    }
}

/// ggml's 210 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    let mut q = [0u8; QK_K];
    for p in 0..4 {
        for v in 0..8 {
            for j in 0..4 {
                let byte = w.quants[base + nibbles_at(p, v) + 4 * l + j];
                q[64 * p + 4 * v + j] = byte & 15;
                q[64 * p + 32 + 4 * v + j] = byte >> 4;
            }
        }
        for h in 0..4 {
            for j in 0..4 {
                let byte = w.quants[base + highs_at(p, h) + 4 * l + j];
                let at = 64 * p + 8 * h + j;
                for (k, to) in [at, at + 32, at + 4, at + 36].into_iter().enumerate() {
                    q[to] |= (byte >> (2 * k) & 3) << 4;
                }
            }
        }
        for k in 0..4 {
            blk[192 + 4 * p + k] = w.quants[base + scales_at(p) + 4 * l + k];
        }
    }
    // ggml's `ql`/`qh` (`dequantize_row_q6_K` read backwards).
    for half in 0..2 {
        for i in 0..32 {
            let at = 128 * half + i;
            let [q1, q2, q3, q4] = [q[at], q[at + 32], q[at + 64], q[at + 96]];
            blk[64 * half + i] = (q1 & 15) | (q3 & 15) << 4;
            blk[64 * half + i + 32] = (q2 & 15) | (q4 & 15) << 4;
            blk[128 + 32 * half + i] = q1 >> 4 | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6;
        }
    }
    blk[208..].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(super) mod x86;
