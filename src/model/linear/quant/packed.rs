//! Weights repacked at load for the kernel that reads them, as llama.cpp's CPU "repack"
//! buffers (its `q4_0_8x8`, `q4_K_8x8`): every block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
//! Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) in groups of [`ROWS`] rows, so that one 32-byte load holds 4
//! bytes of each of 8 rows and a vector lane is a weight row (the K-quants' superblocks:
//! [`q2k`], [`q3k`], [`q4k`], [`q5k`], [`q6k`]).
//!
//! In the row layout each dot product of 32 weights ends in a conversion, a scale and an
//! FMA of its own, and each row in a horizontal sum: the float work outweighed the integer
//! work (on Zen 3, 8 `maddubs` + 8 `madd` against 24 float operations per 256 products).
//! Packed, a block of 8 rows is one vector of 8 integer sums, scaled by one vector of the 8
//! rows' `d` and x's `dx`: the float work is per 8 rows, and no row ends in a horizontal sum.
//!
//! The layout, for the group of rows `8g..8g + 8` and the block `c` (columns `32c..32c + 32`)
//! of a format with `qb` quant bytes per block (32 for Q8_0, 16 for the nibbles):
//! - `scales[(g · blocks + c) · 8 + l]`: row `8g + l`'s `d` (and `mins` likewise for Q4_1
//!   and Q5_1, `highs` for Q5's fifth bits, rearranged by [`spread`]);
//! - `quants[(g · blocks + c) · 8 · qb + 32v + 4l ..][..4]`: row `8g + l`'s quant bytes
//!   `4v..4v + 4` of its block, as ggml stores them (a nibble byte `i` holds weight `i` low
//!   and `i + 16` high).
//!
//! A weight whose rows are not a multiple of 8 is padded with rows of zeros, never written
//! out. x86 CPUs pack ([`wanted`]); the kernel is AVX2's (`x86`), and where the CPU has
//! AVX-512 VNNI every tile takes a VNNI form, and the 32-weight formats a 16-row one of two
//! groups side by side too (`avx512`); with AVX-VNNI (and no AVX-512), its VEX form. On
//! Zen 5 (2 threads, `probe_packed`) the packed kernel on AVX2's tiles alone already ran
//! 1.5-2× the row layout's VNNI tile at 64-512 rows of x and 2-5× at 1-8 rows, except Q6_K
//! from 128 rows (160-193 against 195-224 GMAC/s; 194-246 in its VNNI form). ARM keeps its
//! `sdot` rows.

#[cfg(target_arch = "x86_64")]
use super::{tile, Out, QRows};
use super::{Format, QWeight, BLOCK};
#[cfg(target_arch = "x86_64")]
use crate::model::pool::Pool;
use half::f16;
pub(super) use parts::Parts;
use parts::{spread, unspread};
use superblocks::Superblocks;

/// Pieces per pool thread in [`product_each`], through [`Pool::run_shares`]: each thread
/// reads its run of them as one stream still (one chunk a thread, as the other products:
/// `matvec::CHUNKS_PER_THREAD`), and the first done takes over the other's last pieces.
/// SmolLM2-135M's Q4_K_M file (Zen 5, 2 threads), the caller's wait for the helper at the
/// end of a job: 11% of a batched step's jobs (`bench --batch 8`) -> 3.5%; batch 8 decode +1%
/// (12 alternating rounds, median of the pairs' ratios), and with a busy loop on one of the
/// two cores 835 -> 894 tok/s (3 rounds); prompts within noise.
#[cfg(target_arch = "x86_64")]
const PIECES_PER_THREAD: usize = 16;

/// Rows per group: the lanes of an AVX2 vector of f32.
pub(super) const ROWS: usize = 8;

/// [`super::packed_products`].
pub(super) fn products() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    if wanted(Format::Q4_0) {
        return match x86::form() {
            x86::EVEX if crate::model::linear::simd::amx() => "amx",
            x86::EVEX => "avx512-vnni",
            x86::VEX => "avx-vnni",
            _ => "avx2",
        };
    }
    "none"
}

/// Whether a weight in `format` is packed on this CPU (see the file's header).
pub(super) fn wanted(format: Format) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::model::linear::simd::{Isa, IsaKind};
        packs(format) && matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = format;
        false
    }
}

/// Whether `format` has a packed layout.
pub(super) fn packs(format: Format) -> bool {
    matches!(
        format,
        Format::Q8_0
            | Format::Q4_0
            | Format::Q4_1
            | Format::Q5_0
            | Format::Q5_1
            | Format::Q2K
            | Format::Q3K
            | Format::Q4K
            | Format::Q5K
            | Format::Q6K
    )
}

/// The formats with a minimum per block (`mins`).
fn has_mins(format: Format) -> bool {
    matches!(format, Format::Q4_1 | Format::Q5_1)
}

/// Bytes ahead of Q5's fifth bits in ggml's block: d, and m for Q5_1.
fn ggml_head(format: Format) -> usize {
    if has_mins(format) {
        4
    } else {
        2
    }
}

/// The formats with fifth bits (`highs`).
fn has_highs(format: Format) -> bool {
    matches!(format, Format::Q5_0 | Format::Q5_1)
}

/// `QWeight::products` of packed weights on x86 (`QWeight::product` of one): the groups of
/// 8 rows of all of them, in turn, split over the pool as one weight's; x in blocks of rows
/// that stay in the near caches ([`tile::x_block_rows`]), each rounded once for all.
///
/// The caller (`QWeight::products`) checked AVX2, each weight's planes against its shape
/// and x and y against it, and that all have x's width and round x alike.
#[cfg(target_arch = "x86_64")]
pub(super) fn product_each(ws: &[&QWeight], x: &[f32], ys: &mut [&mut [f32]]) {
    let Some(first) = ws.first().filter(|_| !x.is_empty()) else {
        return;
    };
    let (cols, pool) = (first.cols, Pool::global());
    // Where each weight's groups start in the groups of all, and where the last ends.
    let mut bounds = vec![0];
    for w in ws {
        bounds.push(bounds[bounds.len() - 1] + w.rows.div_ceil(ROWS));
    }
    let groups = bounds[ws.len()];
    if groups == 0 {
        return;
    }
    // Whole pairs of groups a piece where the CPU has the 16-row tiles. One row of x (a
    // decode step): one piece a thread, through `run`; more: a few pieces a thread, through
    // `run_shares`, whose hand-out costs a product ~0.3 us more (2 threads, Zen 5), which
    // decode's small products did not earn back (SmolLM2-135M Q4_0, 8 alternating rounds:
    // -1.5% and -2.6% at 16 pieces a thread, -4.5% at one).
    let step = if super::vnni() { 2 } else { 1 };
    let rows_of_x = x.len() / cols;
    let pieces = pool.threads() * if rows_of_x > 1 { PIECES_PER_THREAD } else { 1 };
    let per = groups.div_ceil(pieces).next_multiple_of(step);
    let block = match crate::model::linear::simd::amx() {
        true => amx::x_block_rows(cols),
        false => tile::x_block_rows(cols),
    };
    for (b, x) in x.chunks(block * cols).enumerate() {
        let xq = QRows::quantize_for(first.format, x, cols);
        // This block's rows of each y.
        let outs: Vec<Out> = (ys.iter_mut().zip(ws))
            .map(|(y, w)| Out(y[b * block * w.rows..].as_mut_ptr()))
            .collect();
        let piece = |c: usize| {
            let (c0, c1) = (c * per, ((c + 1) * per).min(groups));
            for ((w, bound), out) in ws.iter().zip(bounds.windows(2)).zip(&outs) {
                let (start, end) = (bound[0], bound[1]);
                let (g0, g1) = (c0.max(start), c1.min(end));
                if g0 < g1 {
                    // SAFETY: the caller's checks (above); chunk c alone writes the columns of
                    // w's groups g0..g1 (of this block's rows of its y); x holds this
                    // block's rows at w's width, rounded for its format.
                    unsafe { x86::rows(w, (g0 - start, g1 - start), &xq, out.0) };
                }
            }
        };
        match rows_of_x {
            1 => pool.run(groups.div_ceil(per), &piece),
            _ => pool.run_shares(groups.div_ceil(per), &piece),
        }
    }
}

impl QWeight {
    /// This weight in the packed layout (`true`) or as it was read (`false`: rows, Q5's in
    /// ggml's blocks); the same weights either way. The constructors choose by [`wanted`];
    /// tests and probes choose here. The other formats stay as they are.
    pub fn repacked(self, packed: bool) -> Self {
        if packed == self.packed || !packs(self.format) {
            return self;
        }
        if let Some(k) = Superblocks::of(self.format) {
            return match packed {
                true => k.pack(&self),
                false => k.unpack(&self),
            };
        }
        let (nb, qb) = (self.cols / BLOCK, self.format.quant_bytes());
        let mut out = Self {
            packed,
            ..self.clone_shape()
        };
        let blocks = out.stored_blocks();
        if packed || self.format.split() {
            out.scales = vec![f16::ZERO; blocks];
            out.mins = vec![f16::ZERO; if has_mins(self.format) { blocks } else { 0 }];
            out.quants = vec![0u8; blocks * qb];
        } else {
            out.quants = vec![0u8; blocks * self.format.ggml_bytes()];
        }
        if packed && has_highs(self.format) {
            out.highs = vec![0u32; blocks];
        }
        for b in 0..self.rows * nb {
            out.put(b, self.parts(b));
        }
        out
    }

    /// This weight's format and shape with no planes: what a layout's planes are put into.
    pub(super) fn clone_shape(&self) -> QWeight {
        QWeight {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            scales: Vec::new(),
            mins: Vec::new(),
            quants: Vec::new(),
            highs: Vec::new(),
            packed: false,
        }
    }

    /// ggml's bytes of superblock `c` of row `r` of a packed K-quant weight.
    pub(super) fn ggml_superblock(&self, r: usize, c: usize) -> Vec<u8> {
        let k = Superblocks::of(self.format);
        k.map_or_else(Vec::new, |k| k.ggml_block(self, r, c))
    }

    /// Whether the blocks are in the packed layout.
    pub fn is_packed(&self) -> bool {
        self.packed
    }

    /// Row-major block `b` of a packable format, in either layout.
    pub(super) fn parts(&self, b: usize) -> Parts {
        let (nb, qb) = (self.cols / BLOCK, self.format.quant_bytes());
        let mut qs = [0u8; BLOCK];
        if !self.packed && !self.format.split() {
            // Q5_0 and Q5_1 as ggml stores them: d, (m), qh, qs.
            let n = self.format.ggml_bytes();
            let blk = &self.quants[b * n..(b + 1) * n];
            let half = |at: usize| f16::from_le_bytes([blk[at], blk[at + 1]]);
            let h = ggml_head(self.format);
            qs[..16].copy_from_slice(&blk[h + 4..h + 20]);
            return Parts {
                d: half(0),
                m: if has_mins(self.format) {
                    half(2)
                } else {
                    f16::ZERO
                },
                qs,
                qh: u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]),
            };
        }
        for v in 0..qb / 4 {
            let from = unit_at(self.packed, nb, qb, b, v);
            qs[4 * v..4 * v + 4].copy_from_slice(&self.quants[from..from + 4]);
        }
        let at = block_at(self.packed, nb, b);
        Parts {
            d: self.scales[at],
            m: self.mins.get(at).copied().unwrap_or(f16::ZERO),
            qs,
            qh: self.highs.get(at).map_or(0, |&h| unspread(h)),
        }
    }

    /// Writes row-major block `b` in this weight's layout (whose planes are allocated).
    fn put(&mut self, b: usize, p: Parts) {
        let (nb, qb) = (self.cols / BLOCK, self.format.quant_bytes());
        if !self.packed && !self.format.split() {
            let n = self.format.ggml_bytes();
            let blk = &mut self.quants[b * n..(b + 1) * n];
            blk[..2].copy_from_slice(&p.d.to_le_bytes());
            if has_mins(self.format) {
                blk[2..4].copy_from_slice(&p.m.to_le_bytes());
            }
            let h = ggml_head(self.format);
            blk[h..h + 4].copy_from_slice(&p.qh.to_le_bytes());
            blk[h + 4..h + 20].copy_from_slice(&p.qs[..16]);
            return;
        }
        let at = block_at(self.packed, nb, b);
        self.scales[at] = p.d;
        if let Some(m) = self.mins.get_mut(at) {
            *m = p.m;
        }
        if let Some(h) = self.highs.get_mut(at) {
            *h = spread(p.qh);
        }
        for v in 0..qb / 4 {
            let to = unit_at(self.packed, nb, qb, b, v);
            self.quants[to..to + 4].copy_from_slice(&p.qs[4 * v..4 * v + 4]);
        }
    }

    /// How many blocks (scales) a packable format's weight of this shape holds in its
    /// layout, padding rows included.
    pub(super) fn stored_blocks(&self) -> usize {
        lengths(self.packed, self.rows, self.cols)
    }

    /// Whether the planes of a packed weight hold its shape (what the kernel's unchecked
    /// loads rely on).
    pub(super) fn packed_fits(&self) -> bool {
        if let Some(k) = Superblocks::of(self.format) {
            return k.fits(self);
        }
        let blocks = self.stored_blocks();
        let expect = |yes: bool| if yes { blocks } else { 0 };
        self.packed
            && self.scales.len() == blocks
            && self.quants.len() == blocks * self.format.quant_bytes()
            && self.mins.len() == expect(has_mins(self.format))
            && self.highs.len() == expect(has_highs(self.format))
    }
}

/// Blocks of a `rows x cols` weight in a layout, padding rows included.
fn lengths(packed: bool, rows: usize, cols: usize) -> usize {
    let rows = match packed {
        true => rows.next_multiple_of(ROWS),
        false => rows,
    };
    rows * (cols / BLOCK)
}

/// Where row-major block `b` (of rows of `nb` blocks) keeps its scale, in a layout.
fn block_at(packed: bool, nb: usize, b: usize) -> usize {
    match packed {
        false => b,
        true => {
            let (r, c) = (b / nb, b % nb);
            (r / ROWS * nb + c) * ROWS + r % ROWS
        }
    }
}

/// Where block `b`'s quant bytes `4v..4v + 4` lie, for `qb` quant bytes a block.
fn unit_at(packed: bool, nb: usize, qb: usize, b: usize, v: usize) -> usize {
    let at = block_at(packed, nb, b);
    match packed {
        false => at * qb + 4 * v,
        true => (at - at % ROWS) * qb + 32 * v + 4 * (at % ROWS),
    }
}

// `x86` first: its `three_forms!` makes the tiles of `q4k` (Q4_K and Q5_K) and `q6k` (Q6_K,
// Q3_K and Q2_K) too.
#[cfg(target_arch = "x86_64")]
#[macro_use]
pub(super) mod x86;
#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod parts;
pub(super) mod q2k;
pub(super) mod q3k;
pub(super) mod q4k;
pub(super) mod q5k;
pub(super) mod q6k;
mod superblocks;

#[cfg(test)]
mod tests;
