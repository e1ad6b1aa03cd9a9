//! Q2_K in [`super`]'s packed layout: superblocks of 256 weights `w = d·sc·q − dmin·m`, q in
//! 0..=3 and a 4-bit scale `sc` and minimum `m` per 16 weights, for groups of 8 rows. The
//! kernel is Q6_K's tile (`q6k/x86.rs`) with the minimums' sums apart, as Q4_K's.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`: `scales[.. · 8 + l]`
//! is row `8g + l`'s `d`, `mins[.. · 8 + l]` its `dmin`; `quants[.. · GROUP_BYTES ..]` holds,
//! for each pair `p` of 32-weight chunks (weights `64p..64p + 64`), 160 bytes from `160p`:
//! - the scales and minimums ([`scales_at`]): row `l`'s ggml bytes `4p..4p + 4` (`sc` low,
//!   `m` high) at `4l`;
//! - four loads of quants ([`lows_at`], `h` of 4), as Q3_K's low bits ([`super::q3k`]): row
//!   `l`'s byte `j` holds, two bits each from bit 0 up, weights `64p + 8h + j`, `+ 4`, `+ 32`
//!   and `+ 36`.
//!
//! 84 bytes a row's superblock with its `d` and `dmin`, as ggml's.

use super::super::kquant::QK_K;
use super::super::{Format, QWeight};
use super::superblocks::{all_quants, four, ggml_low_bits, low_bits, Superblocks};
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * 80;

// The pairs' 160 bytes tile the superblock exactly.
const _: () = assert!(lows_at(0, 0) == 32 && lows_at(3, 3) + 32 == GROUP_BYTES);

/// Where pair `p`'s 32 bytes of scales and minimums are in a group's superblock.
pub(super) const fn scales_at(p: usize) -> usize {
    160 * p
}

/// Where pair `p`'s load `h` (of 4) of quants is.
pub(super) const fn lows_at(p: usize, h: usize) -> usize {
    160 * p + 32 + 32 * h
}

/// Q2_K's packed form.
pub(super) const SUPERBLOCKS: Superblocks = Superblocks {
    ggml: 84,
    group_bytes: GROUP_BYTES,
    dmin: true,
    put,
    get,
};

/// ggml's superblock `blk` (16 bytes of scales and minimums, 64 of quants `qs`, d, dmin)
/// as lane `l` of unit `u`.
fn put(out: &mut QWeight, u: usize, l: usize, blk: &[u8]) {
    let half = |at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]);
    out.scales[u * ROWS + l] = half(80);
    out.mins[u * ROWS + l] = half(82);
    let q = all_quants(Format::Q2K, blk);
    let base = u * GROUP_BYTES;
    for p in 0..4 {
        let to = base + scales_at(p) + 4 * l;
        out.quants[to..to + 4].copy_from_slice(&blk[4 * p..4 * p + 4]);
        for h in 0..4 {
            for j in 0..4 {
                out.quants[base + lows_at(p, h) + 4 * l + j] = low_bits(&q, p, h, j);
            }
        }
    }
}

/// ggml's 84 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    let mut q = [0u8; QK_K];
    for p in 0..4 {
        let from = base + scales_at(p) + 4 * l;
        blk[4 * p..4 * p + 4].copy_from_slice(&w.quants[from..from + 4]);
        for h in 0..4 {
            for j in 0..4 {
                let byte = w.quants[base + lows_at(p, h) + 4 * l + j];
                for (t, at) in four(p, h, j).into_iter().enumerate() {
                    q[at] = byte >> (2 * t) & 3;
                }
            }
        }
    }
    ggml_low_bits(&q, &mut blk[16..80]);
    blk[80..82].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
    blk[82..84].copy_from_slice(&w.mins[u * ROWS + l].to_le_bytes());
}
