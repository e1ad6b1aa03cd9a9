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
use super::ROWS;
use half::f16;

/// Bytes of one group's superblock in `quants`.
pub(super) const GROUP_BYTES: usize = ROWS * (QK_K / 2 + 16);

/// ggml's bytes of one Q4_K superblock.
const GGML: usize = 144;

/// Where superblock `c` of row `r` lies: its index among the groups' superblocks, its lane.
fn place(w: &QWeight, r: usize, c: usize) -> (usize, usize) {
    (r / ROWS * (w.cols / QK_K) + c, r % ROWS)
}

/// `w` (Q4_K in ggml's blocks) packed, its rows padded to a multiple of 8 with zeros.
pub(super) fn pack(w: &QWeight) -> QWeight {
    let n = w.cols / QK_K;
    let units = w.rows.div_ceil(ROWS) * n;
    let mut out = QWeight {
        scales: vec![f16::ZERO; units * ROWS],
        mins: vec![f16::ZERO; units * ROWS],
        quants: vec![0; units * GROUP_BYTES],
        highs: Vec::new(),
        packed: true,
        ..w.clone_shape()
    };
    for r in 0..w.rows {
        for c in 0..n {
            let blk = &w.quants[(r * n + c) * GGML..][..GGML];
            let (u, l) = place(w, r, c);
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
    }
    out
}

/// ggml's 144 bytes of superblock `c` of row `r` of a packed Q4_K weight.
pub(in crate::model::linear::quant) fn ggml_block(w: &QWeight, r: usize, c: usize) -> [u8; GGML] {
    let (u, l) = place(w, r, c);
    let base = u * GROUP_BYTES;
    let mut blk = [0u8; GGML];
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
    // ggml's 6-bit packing (`get_scale_min_k4` read backwards).
    for j in 0..4 {
        blk[4 + j] = sc[j] | (sc[j + 4] >> 4) << 6;
        blk[8 + j] = m[j] | (m[j + 4] >> 4) << 6;
        blk[12 + j] = (sc[j + 4] & 0x0F) | (m[j + 4] & 0x0F) << 4;
    }
    blk
}

/// A packed Q4_K weight back in ggml's blocks.
pub(super) fn unpack(w: &QWeight) -> QWeight {
    let n = w.cols / QK_K;
    let mut quants = Vec::with_capacity(w.rows * n * GGML);
    for r in 0..w.rows {
        for c in 0..n {
            quants.extend_from_slice(&ggml_block(w, r, c));
        }
    }
    QWeight {
        scales: Vec::new(),
        mins: Vec::new(),
        quants,
        highs: Vec::new(),
        packed: false,
        ..w.clone_shape()
    }
}

/// Whether the planes of a packed Q4_K weight hold its shape.
pub(super) fn fits(w: &QWeight) -> bool {
    let units = w.rows.div_ceil(ROWS) * (w.cols / QK_K);
    w.scales.len() == units * ROWS
        && w.mins.len() == units * ROWS
        && w.quants.len() == units * GROUP_BYTES
        && w.highs.is_empty()
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86;
