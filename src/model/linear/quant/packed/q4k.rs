//! Q4_K in [`super`]'s packed layout: superblocks of 256 weights (8 sub-blocks of 32, each
//! with a 6-bit scale `sc` and minimum `m`; `w = d·sc·q − dmin·m`) for groups of 8 rows.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`:
//! - `scales[.. · 8 + l]`: row `8g + l`'s `d`; `mins[.. · 8 + l]`: its `dmin`;
//! - `quants[.. · GROUP_BYTES ..]`: per pair of sub-blocks `2p, 2p + 1`, 288 bytes from
//!   `288p` in the order the kernel reads them (one stream for the prefetchers, as Q6_K's):
//!   the pair's scales and minimums unpacked from ggml's 12 bytes ([`scales_at`]: 16 bytes
//!   of scales, row `l`'s `sc[2p]` and `sc[2p + 1]` at `2l` and `2l + 1`, so that widened
//!   to 16 bits lane `l` of a vector of 32-bit lanes holds the pair; then 16 of minimums
//!   alike), then its quants as ggml's `qs` (32 bytes a pair: low nibbles the first
//!   sub-block, high the second), 4 bytes of each row per 32-byte load: load `v` (of 8,
//!   [`nibbles_at`]) holds row `l`'s bytes `32p + 4v .. + 4` at `4l`.
//!
//! 148 bytes a row's superblock with its `d` and `dmin` against ggml's 144 (the scales
//! unpacked).

use super::super::kquant::{scale_min_k4, QK_K};
use super::super::QWeight;
use super::superblocks::Superblocks;
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * (QK_K / 2 + 16);

/// Where pair `p`'s 16 bytes of scales are in a group's superblock (its minimums' 16 next).
pub(super) const fn scales_at(p: usize) -> usize {
    288 * p
}

/// Where pair `p`'s load `v` (of 8) of nibbles is.
pub(super) const fn nibbles_at(p: usize, v: usize) -> usize {
    scales_at(p) + 32 + 32 * v
}

// The pairs' 288 bytes tile the superblock exactly.
const _: () = assert!(nibbles_at(3, 7) + 32 == GROUP_BYTES);

/// Q4_K's packed form.
pub(super) const SUPERBLOCKS: Superblocks = Superblocks {
    ggml: 144,
    group_bytes: GROUP_BYTES,
    dmin: true,
    put,
    get,
};

/// ggml's superblock `blk` as lane `l` of unit `u`.
fn put(out: &mut QWeight, u: usize, l: usize, blk: &[u8]) {
    let half = |at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]);
    out.scales[u * ROWS + l] = half(0);
    out.mins[u * ROWS + l] = half(2);
    let sm = scale_min_k4(blk[4..16].try_into().expect("12 bytes"));
    let base = u * GROUP_BYTES;
    for p in 0..4 {
        for v in 0..8 {
            let to = base + nibbles_at(p, v) + 4 * l;
            let from = 16 + 32 * p + 4 * v;
            out.quants[to..to + 4].copy_from_slice(&blk[from..from + 4]);
        }
    }
    put_scales(&mut out.quants[base..], scales_at, l, &sm);
}

/// Row `l`'s 8 scales and 8 minimums (`sm`, unpacked) into a group's superblock `group`:
/// per pair `p` of sub-blocks 16 bytes of scales at `at(p)` and 16 of minimums after them,
/// the row's two at `2l`. Q4_K's layout and Q5_K's.
pub(super) fn put_scales(group: &mut [u8], at: fn(usize) -> usize, l: usize, sm: &[u8; 16]) {
    for p in 0..4 {
        for k in 0..2 {
            group[at(p) + 2 * l + k] = sm[2 * p + k];
            group[at(p) + 16 + 2 * l + k] = sm[8 + 2 * p + k];
        }
    }
}

/// [`put_scales`] read back: row `l`'s 8 scales and minimums in ggml's 12 bytes (`out`).
pub(super) fn get_scales(group: &[u8], at: fn(usize) -> usize, l: usize, out: &mut [u8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for p in 0..4 {
        for k in 0..2 {
            sc[2 * p + k] = group[at(p) + 2 * l + k];
            m[2 * p + k] = group[at(p) + 16 + 2 * l + k];
        }
    }
    ggml_scales(&sc, &m, out);
}

/// ggml's 144 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    blk[..2].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
    blk[2..4].copy_from_slice(&w.mins[u * ROWS + l].to_le_bytes());
    for p in 0..4 {
        for v in 0..8 {
            let from = base + nibbles_at(p, v) + 4 * l;
            let to = 16 + 32 * p + 4 * v;
            blk[to..to + 4].copy_from_slice(&w.quants[from..from + 4]);
        }
    }
    get_scales(&w.quants[base..], scales_at, l, &mut blk[4..16]);
}

/// The 8 six-bit scales and minimums in ggml's 12 bytes (`get_scale_min_k4` read
/// backwards): Q4_K's and Q5_K's.
fn ggml_scales(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        out[4 + j] = m[j] | (m[j + 4] >> 4) << 6;
        out[8 + j] = (sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4;
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512;
#[cfg(target_arch = "x86_64")]
pub(super) mod x86;
