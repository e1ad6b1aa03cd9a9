//! What the packed K-quants ([`super::q2k`], [`super::q3k`], [`super::q4k`], [`super::q5k`],
//! [`super::q6k`]) share: a
//! superblock of 256 weights of 8 rows at a time (a *unit*: group `g`, superblock `c` of the
//! row's `n`, at `g · n + c`), its `d` (and `dmin`) in `scales` (`mins`) at
//! `unit · 8 + lane`, its quants at `unit · group_bytes` in an order of the format's own; and
//! the moves between ggml's blocks and that layout, one superblock at a time, by the format's
//! `put` and `get`.

use super::super::kquant::QK_K;
use super::super::{Format, QWeight};
use super::ROWS;
use half::f16;

/// One packed K-quant format.
pub(in crate::model::linear::quant) struct Superblocks {
    /// ggml's bytes of one superblock.
    pub ggml: usize,
    /// Bytes of one unit's quants (8 rows' superblocks).
    pub group_bytes: usize,
    /// Whether it keeps a `dmin` per superblock (in `mins`).
    pub dmin: bool,
    /// Writes ggml's superblock `blk` as lane `l` of unit `u` of a packed weight.
    pub put: fn(&mut QWeight, usize, usize, &[u8]),
    /// ggml's bytes of lane `l` of unit `u` of a packed weight, into `blk`.
    pub get: fn(&QWeight, usize, usize, &mut [u8]),
}

impl Superblocks {
    /// The packed form of `format`, if it is a packed K-quant.
    pub fn of(format: Format) -> Option<&'static Superblocks> {
        match format {
            Format::Q2K => Some(&super::q2k::SUPERBLOCKS),
            Format::Q3K => Some(&super::q3k::SUPERBLOCKS),
            Format::Q4K => Some(&super::q4k::SUPERBLOCKS),
            Format::Q5K => Some(&super::q5k::SUPERBLOCKS),
            Format::Q6K => Some(&super::q6k::SUPERBLOCKS),
            _ => None,
        }
    }

    /// `w` (in ggml's blocks) packed, its rows padded to a multiple of 8 with zeros.
    pub fn pack(&self, w: &QWeight) -> QWeight {
        let (n, units) = (w.cols / QK_K, units(w));
        let mut out = QWeight {
            scales: vec![f16::ZERO; units * ROWS],
            mins: vec![f16::ZERO; if self.dmin { units * ROWS } else { 0 }],
            quants: vec![0; units * self.group_bytes],
            packed: true,
            ..w.clone_shape()
        };
        for r in 0..w.rows {
            for c in 0..n {
                let (u, l) = place(w, r, c);
                (self.put)(
                    &mut out,
                    u,
                    l,
                    &w.quants[(r * n + c) * self.ggml..][..self.ggml],
                );
            }
        }
        out
    }

    /// A packed `w` back in ggml's blocks.
    pub fn unpack(&self, w: &QWeight) -> QWeight {
        let n = w.cols / QK_K;
        let mut quants = vec![0; w.rows * n * self.ggml];
        for (at, blk) in quants.chunks_exact_mut(self.ggml).enumerate() {
            let (u, l) = place(w, at / n, at % n);
            (self.get)(w, u, l, blk);
        }
        QWeight {
            quants,
            ..w.clone_shape()
        }
    }

    /// ggml's bytes of superblock `c` of row `r` of a packed `w`.
    pub fn ggml_block(&self, w: &QWeight, r: usize, c: usize) -> Vec<u8> {
        let mut blk = vec![0; self.ggml];
        let (u, l) = place(w, r, c);
        (self.get)(w, u, l, &mut blk);
        blk
    }

    /// Whether the planes of a packed `w` hold its shape (what its kernel's loads rely on).
    pub fn fits(&self, w: &QWeight) -> bool {
        let units = units(w);
        w.packed
            && w.scales.len() == units * ROWS
            && w.mins.len() == if self.dmin { units * ROWS } else { 0 }
            && w.quants.len() == units * self.group_bytes
            && w.highs.is_empty()
    }
}

/// Units of a packed weight: groups of 8 rows times superblocks a row.
fn units(w: &QWeight) -> usize {
    w.rows.div_ceil(ROWS) * (w.cols / QK_K)
}

/// Where superblock `c` of row `r` lies: its unit, its lane.
fn place(w: &QWeight, r: usize, c: usize) -> (usize, usize) {
    (r / ROWS * (w.cols / QK_K) + c, r % ROWS)
}

/// The offsets from `64p + 8h + j` of the four weights whose two low bits a byte `j` of
/// Q3_K's and Q2_K's load `h` of pair `p` holds, from bit 0 up (the order of Q6_K's four
/// vectors a load).
const FOUR: [usize; 4] = [0, 4, 32, 36];

/// Byte `j` of load `h` of pair `p` of two-bit quants: the low bits of 256 quants `q`.
pub(super) fn low_bits(q: &[u8; QK_K], p: usize, h: usize, j: usize) -> u8 {
    let at = 64 * p + 8 * h + j;
    (0..4).fold(0, |byte, t| byte | (q[at + FOUR[t]] & 3) << (2 * t))
}

/// The weights `64p + 8h + j + FOUR[t]` (t = 0..4) of load `h` of pair `p`, into which
/// [`low_bits`] and the like put bit `t` (Q3_K's third bits) or bits `2t`.
pub(super) fn four(p: usize, h: usize, j: usize) -> [usize; 4] {
    FOUR.map(|o| 64 * p + 8 * h + j + o)
}

/// The two low bits of 256 quants as ggml's Q3_K and Q2_K `qs` (64 bytes): weight
/// `128n + 32k + i`'s at bits `2k` of byte `32n + i`.
pub(super) fn ggml_low_bits(q: &[u8; QK_K], qs: &mut [u8]) {
    qs[..64].fill(0);
    for (at, &q) in q.iter().enumerate() {
        qs[32 * (at / 128) + at % 32] |= (q & 3) << (2 * (at % 128 / 32));
    }
}

/// The 256 unsigned quants of ggml's superblock `blk` of a K-quant, in order.
pub(super) fn all_quants(format: Format, blk: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for (k, chunk) in q.chunks_exact_mut(32).enumerate() {
        chunk.copy_from_slice(&super::super::kquant::quants(format, blk, k));
    }
    q
}
