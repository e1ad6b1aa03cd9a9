//! Q5_K in [`super`]'s packed layout: Q4_K's superblocks ([`super::q4k`]: 8 sub-blocks of
//! 32 weights, a 6-bit scale `sc` and minimum `m` each, `w = d·sc·q − dmin·m`) with a fifth
//! bit per weight, q in 0..=31, for groups of 8 rows.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`: `scales[.. · 8 + l]`
//! is row `8g + l`'s `d`, `mins[.. · 8 + l]` its `dmin`; `quants[.. · GROUP_BYTES ..]` holds,
//! for each pair `p` of sub-blocks (`2p`, `2p + 1`: weights `64p..64p + 64`), 352 bytes from
//! `352p` in the order the kernel reads them (one stream for the prefetchers, as Q6_K's):
//! - the pair's scales and minimums unpacked from ggml's 12 bytes, as Q4_K's ([`scales_at`]:
//!   16 bytes of scales, row `l`'s two at `2l`, `2l + 1`, then 16 of minimums);
//! - for each `h` of 2: one load of fifth bits ([`highs_at`]), row `l`'s byte `j` at `4l + j`
//!   holding at bit `k` the fifth bit of weight `4(4h + k) + j` of sub-block `2p` and at bit
//!   `4 + k` that of sub-block `2p + 1`, so that a shift by one per load puts each load's bits
//!   at bit 4; then four loads of nibbles ([`nibbles_at`], `v` = 4h .. 4h + 4), as Q4_K's:
//!   row `l`'s ggml `qs` bytes `32p + 4v .. + 4` at `4l` (low nibbles sub-block `2p`, high
//!   `2p + 1`).
//!
//! 180 bytes a row's superblock against ggml's 176 (the scales unpacked). The kernel is
//! Q4_K's tile with its fifth bits (`q4k/x86.rs`).

use super::super::kquant::{scale_min_k4, QK_K};
use super::super::QWeight;
use super::q4k::{get_scales, put_scales};
use super::superblocks::Superblocks;
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * (QK_K / 2 + QK_K / 8 + 16);

// The pairs' 352 bytes tile the superblock exactly.
const _: () = assert!(nibbles_at(3, 7) + 32 == GROUP_BYTES);

/// Where pair `p`'s 16 bytes of scales are in a group's superblock (its minimums' 16 next).
pub(super) const fn scales_at(p: usize) -> usize {
    352 * p
}

/// Where pair `p`'s load `h` (of 2) of fifth bits is.
pub(super) const fn highs_at(p: usize, h: usize) -> usize {
    scales_at(p) + 32 + 160 * h
}

/// Where pair `p`'s load `v` (of 8) of nibbles is.
pub(super) const fn nibbles_at(p: usize, v: usize) -> usize {
    highs_at(p, v / 4) + 32 + 32 * (v % 4)
}

/// Q5_K's packed form.
pub(super) const SUPERBLOCKS: Superblocks = Superblocks {
    ggml: 176,
    group_bytes: GROUP_BYTES,
    dmin: true,
    put,
    get,
};

/// ggml's superblock `blk` (d, dmin, 12 bytes of scales, 32 of fifth bits `qh`, 128 of
/// nibbles `qs`) as lane `l` of unit `u`.
fn put(out: &mut QWeight, u: usize, l: usize, blk: &[u8]) {
    let half = |at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]);
    out.scales[u * ROWS + l] = half(0);
    out.mins[u * ROWS + l] = half(2);
    let sm = scale_min_k4(blk[4..16].try_into().expect("12 bytes"));
    let qh = &blk[16..48];
    let base = u * GROUP_BYTES;
    for p in 0..4 {
        for v in 0..8 {
            let to = base + nibbles_at(p, v) + 4 * l;
            let from = 48 + 32 * p + 4 * v;
            out.quants[to..to + 4].copy_from_slice(&blk[from..from + 4]);
        }
        for h in 0..2 {
            for j in 0..4 {
                let mut byte = 0u8;
                for k in 0..4 {
                    let q = qh[4 * (4 * h + k) + j] >> (2 * p);
                    byte |= (q & 1) << k | (q >> 1 & 1) << (4 + k);
                }
                out.quants[base + highs_at(p, h) + 4 * l + j] = byte;
            }
        }
    }
    put_scales(&mut out.quants[base..], scales_at, l, &sm);
}

/// ggml's 176 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    blk[..2].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
    blk[2..4].copy_from_slice(&w.mins[u * ROWS + l].to_le_bytes());
    blk[16..48].fill(0);
    for p in 0..4 {
        for v in 0..8 {
            let from = base + nibbles_at(p, v) + 4 * l;
            let to = 48 + 32 * p + 4 * v;
            blk[to..to + 4].copy_from_slice(&w.quants[from..from + 4]);
        }
        for h in 0..2 {
            for j in 0..4 {
                let byte = w.quants[base + highs_at(p, h) + 4 * l + j];
                for k in 0..4 {
                    let bits = (byte >> k & 1) | (byte >> (4 + k) & 1) << 1;
                    blk[16 + 4 * (4 * h + k) + j] |= bits << (2 * p);
                }
            }
        }
    }
    get_scales(&w.quants[base..], scales_at, l, &mut blk[4..16]);
}
