//! Q4_K in [`super`]'s packed layout: superblocks of 256 weights (8 sub-blocks of 32, each
//! with a 6-bit scale `sc` and minimum `m`; `w = d·sc·q − dmin·m`) for groups of 8 rows.
//!
//! Per group `g` and superblock `c` (of `n` a row), at `(g · n + c)`:
//! - `scales[.. · 8 + l]`: row `8g + l`'s `d`; `mins[.. · 8 + l]`: its `dmin`;
//! - `quants[.. · GROUP_BYTES ..]`: 1024 bytes of quants, then 64 of scales, then 64 of
//!   minimums. The quants as ggml's `qs` (32 bytes per pair of sub-blocks `2p, 2p + 1`:
//!   low nibbles the first, high the second), 4 bytes of each row per 32-byte load: load
//!   `8p + v` holds row `l`'s bytes `32p + 4v .. + 4` at `4l`. The scales and minimums
//!   unpacked from ggml's 12 bytes, per pair: 16 bytes at `16p`, row `l`'s `sc[2p]` and
//!   `sc[2p + 1]` at `2l` and `2l + 1` (so that widened to 16 bits, lane `l` of a vector
//!   of 32-bit lanes holds the pair).

use super::super::kquant::{scale_min_k4, QK_K};
use super::super::QWeight;
use super::superblocks::Superblocks;
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * (QK_K / 2 + 16);

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
            let to = base + (8 * p + v) * 32 + 4 * l;
            let from = 16 + 32 * p + 4 * v;
            out.quants[to..to + 4].copy_from_slice(&blk[from..from + 4]);
        }
        for k in 0..2 {
            out.quants[base + 1024 + 16 * p + 2 * l + k] = sm[2 * p + k];
            out.quants[base + 1088 + 16 * p + 2 * l + k] = sm[8 + 2 * p + k];
        }
    }
}

/// ggml's 144 bytes of lane `l` of unit `u`, into `blk`.
fn get(w: &QWeight, u: usize, l: usize, blk: &mut [u8]) {
    let base = u * GROUP_BYTES;
    blk[..2].copy_from_slice(&w.scales[u * ROWS + l].to_le_bytes());
    blk[2..4].copy_from_slice(&w.mins[u * ROWS + l].to_le_bytes());
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for p in 0..4 {
        for v in 0..8 {
            let from = base + (8 * p + v) * 32 + 4 * l;
            let to = 16 + 32 * p + 4 * v;
            blk[to..to + 4].copy_from_slice(&w.quants[from..from + 4]);
        }
        for k in 0..2 {
            sc[2 * p + k] = w.quants[base + 1024 + 16 * p + 2 * l + k];
            m[2 * p + k] = w.quants[base + 1088 + 16 * p + 2 * l + k];
        }
    }
    ggml_scales(&sc, &m, &mut blk[4..16]);
}

/// The 8 six-bit scales and minimums in ggml's 12 bytes (`get_scale_min_k4` read
/// backwards): Q4_K's and Q5_K's.
pub(super) fn ggml_scales(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        out[4 + j] = m[j] | (m[j + 4] >> 4) << 6;
        out[8 + j] = (sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4;
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86;
