//! Weights in ggml's block formats and their product with f32 rows, on our pool: the CPU
//! path of `--dtype q8_0|q4_0` and of every block format a GGUF file holds.
//!
//! A block is 32 consecutive weights of a row with one f16 scale `d`: Q8_0 stores
//! `round(w / d)` as i8 (d = max|w| / 127), Q4_0 stores `w / d + 8` as 4-bit values
//! (d = the weight of largest magnitude / -8), low nibbles holding weights 0-15 of the block
//! and high nibbles 16-31, as ggml does. Q4_1 (GGUF files) adds an f16 minimum `m` per block:
//! `w = d · q + m` with q in 0..=15. Rows of x are quantized to Q8_0 (f32 scales) and each
//! block's dot product is an integer one, scaled by `d_w · d_x` (plus `m_w` times the x
//! block's sum for Q4_1) (`simd`: AVX2's `maddubs`, as llama.cpp; a scalar loop elsewhere).
//!
//! The formats with integer sub-scales (the K-quants Q2_K ... Q6_K) and the 5-bit ones
//! (Q5_0, Q5_1) are kept as ggml stores them and go through one kernel of their own
//! (`quant/kquant.rs`), against the same Q8_0 rows of x.
//!
//! On x86 CPUs (AVX2 and AVX-512), every block format is repacked at load into groups of 8
//! interleaved rows (`quant/packed.rs`) and every product of theirs, decode and prompt, goes
//! through the packed kernel instead.
//!
//! Over 300 lines on purpose: the formats' table, the constructors that establish what the
//! kernels' unchecked loads rely on, and the product that checks it once belong together.
//!
//! Why not candle's `QMatMul`: it runs on its own spinning thread pool, which on a 2-core
//! host fights ours and any other process; SmolLM2-135M Q8_0 decode spent 48% of its time
//! spinning in candle's barrier and 7% in the dot product (1.3 tok/s against f32's 7.0 in
//! the same loaded minute, AVX2 host). candle's kernels stay for CUDA.

mod kquant;
mod packed;
mod round;
mod simd;
mod tile;

use crate::model::pool::Pool;
use half::f16;
use round::{quantize_q4, quantize_q4_1, quantize_q8};

/// Weights per block.
pub const BLOCK: usize = 32;

/// The block formats we multiply on CPU: every one of ggml's that GGUF files people
/// download are made of (llama.cpp's `_S/_M/_L` mixes are these per tensor).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    /// Whether the format's scales are kept apart from its quants (Q8_0, Q4_0, Q4_1, which
    /// we also quantize to); the others stay in ggml's blocks ([`kquant`]).
    fn split(self) -> bool {
        matches!(self, Format::Q8_0 | Format::Q4_0 | Format::Q4_1)
    }

    /// Weights per block in ggml's layout: 32, or 256 for a K-quant's superblock.
    pub fn block_weights(self) -> usize {
        match self {
            Format::Q2K | Format::Q3K | Format::Q4K | Format::Q5K | Format::Q6K => kquant::QK_K,
            _ => BLOCK,
        }
    }

    /// Bytes of one block in ggml's layout (ggml's `type_size`).
    fn ggml_bytes(self) -> usize {
        match self {
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q5_0 => 22,
            Format::Q5_1 => 24,
            Format::Q2K => 84,
            Format::Q3K => 110,
            Format::Q4K => 144,
            Format::Q5K => 176,
            Format::Q6K => 210,
        }
    }

    /// Bytes of quants per block of a split format (its scales are apart).
    fn quant_bytes(self) -> usize {
        match self {
            Format::Q8_0 => BLOCK,
            _ => BLOCK / 2,
        }
    }

    /// The f16 values ahead of a block's quants in ggml's layout: d, and m for Q4_1.
    fn halves(self) -> usize {
        match self {
            Format::Q4_1 => 2,
            _ => 1,
        }
    }
}

/// A (rows, cols) weight matrix in a block format; `cols` is a multiple of [`BLOCK`].
#[derive(Debug, Clone)]
///
/// Its fields are private: the kernels' unchecked loads rely on `scales`, `mins`,
/// `quants` and `highs` holding exactly `rows · cols` weights in their layout (packed: rows
/// padded to a multiple of 8), which only the constructors establish and `product` checks.
pub struct QWeight {
    format: Format,
    rows: usize,
    cols: usize,
    /// One scale per block, row-major (packed: [`packed`]'s order; the K-quants: their `d`
    /// per superblock).
    scales: Vec<f16>,
    /// Q4_1: one minimum per block (packed: Q5_1's too, and Q2_K's, Q4_K's and Q5_K's
    /// `dmin`); empty otherwise.
    mins: Vec<f16>,
    /// Q8_0: one i8 per weight; Q4_0, Q4_1: one byte per two weights; the other formats:
    /// ggml's blocks as the file stores them, scales included (packed: [`packed`]'s).
    quants: Vec<u8>,
    /// Packed Q5_0 and Q5_1: the fifth bits of each block (see [`packed`]); empty
    /// otherwise.
    highs: Vec<u32>,
    /// Whether scales, minimums, quants and highs are in [`packed`]'s layout (groups of 8
    /// rows) rather than row-major.
    packed: bool,
}

/// Rows of x in Q8_0 with f32 scales: the other operand of every dot product. Against a
/// K-quant weight, one scale spans a superblock's 256 values (llama.cpp's Q8_K), repeated
/// for each of its 32-value blocks, so that the kernels sum a superblock in integers.
pub struct QRows {
    cols: usize,
    /// Values per scale: [`BLOCK`], or [`kquant::QK_K`].
    // Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    span: usize,
    scales: Vec<f32>,
    /// Per block, `d · Σ q`: what a Q4_1 weight block's minimum multiplies.
    sums: Vec<f32>,
    /// The same per half block (16 values): what the sub-block minimums of [`kquant`]'s
    /// formats multiply.
    sums16: Vec<f32>,
    /// `Σ q` per half block, in integers: the K-quant kernels' minimums.
    // Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    isums16: Vec<i16>,
    /// `Σ q` per block, in integers: the packed Q4_K kernel's minimums (rounded per
    /// superblock only; empty otherwise).
    // Read by the x86 kernels only.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    isums32: Vec<i16>,
    quants: Vec<i8>,
}

impl QWeight {
    /// Quantizes `w` (rows × cols, row-major); `None` when cols is not whole blocks, or for
    /// a format we only read (all but Q8_0, Q4_0 and Q4_1).
    pub fn quantize(format: Format, w: &[f32], cols: usize) -> Option<Self> {
        if !format.split()
            || cols == 0
            || !cols.is_multiple_of(BLOCK)
            || !w.len().is_multiple_of(cols)
        {
            return None;
        }
        let blocks = w.len() / BLOCK;
        let per_block = format.quant_bytes();
        let (mut scales, mut mins) = (Vec::with_capacity(blocks), Vec::new());
        let mut quants = vec![0u8; blocks * per_block];
        for (x, q) in w
            .chunks_exact(BLOCK)
            .zip(quants.chunks_exact_mut(per_block))
        {
            let d = match format {
                Format::Q8_0 => quantize_q8(x, q),
                Format::Q4_0 => quantize_q4(x, q),
                Format::Q4_1 => {
                    let (d, m) = quantize_q4_1(x, q);
                    mins.push(f16::from_f32(m));
                    d
                }
                _ => unreachable!("{format:?} is refused above"),
            };
            scales.push(f16::from_f32(d));
        }
        let w = Self {
            format,
            rows: w.len() / cols,
            cols,
            scales,
            mins,
            quants,
            highs: Vec::new(),
            packed: false,
        };
        Some(w.repacked(packed::wanted(format)))
    }

    /// A (rows, cols) matrix from ggml's bytes for it, as GGUF files store them: for Q8_0,
    /// Q4_0 and Q4_1 blocks of f16 `d` (and `m` for Q4_1) followed by the quants, split here
    /// into scales and quants; the other formats' blocks are kept as they are. `None` when
    /// the sizes disagree (by checked arithmetic: a size from a file may be anything).
    pub fn from_ggml(format: Format, rows: usize, cols: usize, bytes: &[u8]) -> Option<Self> {
        let block_bytes = format.ggml_bytes();
        if cols == 0 || !cols.is_multiple_of(format.block_weights()) {
            return None;
        }
        let blocks = rows.checked_mul(cols)? / format.block_weights();
        if blocks.checked_mul(block_bytes) != Some(bytes.len()) {
            return None;
        }
        if !packed::wanted(format) || rows == 0 {
            return Some(Self::ggml_rows(format, rows, cols, bytes));
        }
        // Packed, a group of rows' planes are contiguous: they are built a group at a time,
        // so that the load never holds the whole weight in ggml's rows beside its packed
        // form (a tied head's embedding is a third of SmolLM2's Q4_0 file).
        let (row_bytes, groups) = (bytes.len() / rows, rows.div_ceil(packed::ROWS));
        let mut out: Option<QWeight> = None;
        for group in bytes.chunks(packed::ROWS * row_bytes) {
            let part = Self::ggml_rows(format, group.len() / row_bytes, cols, group).repacked(true);
            let out = out.get_or_insert_with(|| QWeight {
                scales: Vec::with_capacity(part.scales.len() * groups),
                mins: Vec::with_capacity(part.mins.len() * groups),
                quants: Vec::with_capacity(part.quants.len() * groups),
                highs: Vec::with_capacity(part.highs.len() * groups),
                rows,
                packed: true,
                ..part.clone_shape()
            });
            out.scales.extend_from_slice(&part.scales);
            out.mins.extend_from_slice(&part.mins);
            out.quants.extend_from_slice(&part.quants);
            out.highs.extend_from_slice(&part.highs);
        }
        out
    }

    /// [`Self::from_ggml`]'s checked bytes in the row layout.
    fn ggml_rows(format: Format, rows: usize, cols: usize, bytes: &[u8]) -> Self {
        let mut w = Self {
            format,
            rows,
            cols,
            scales: Vec::new(),
            mins: Vec::new(),
            quants: Vec::new(),
            highs: Vec::new(),
            packed: false,
        };
        if !format.split() {
            w.quants = bytes.to_vec();
            return w;
        }
        let (block_bytes, blocks) = (format.ggml_bytes(), bytes.len() / format.ggml_bytes());
        let half = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]);
        w.scales.reserve_exact(blocks);
        w.quants.reserve_exact(blocks * format.quant_bytes());
        for block in bytes.chunks_exact(block_bytes) {
            w.scales.push(half(block));
            if format == Format::Q4_1 {
                w.mins.push(half(&block[2..]));
            }
            w.quants.extend_from_slice(&block[2 * format.halves()..]);
        }
        w
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes held: quants, scales, minimums and fifth bits (ggml's: 34 per Q8_0 block, 18
    /// per Q4_0 block, 20 per Q4_1 block, and the file's own for the other formats; packed,
    /// the same but for Q3_K's, Q4_K's and Q5_K's 114, 148 and 180 bytes a superblock
    /// instead of 110, 144 and 176, and rows padded to 8).
    pub fn bytes(&self) -> usize {
        self.quants.len() + 2 * (self.scales.len() + self.mins.len()) + 4 * self.highs.len()
    }

    /// The signed integer value of weight `i` of block `b` (the tests' reference).
    #[cfg(test)]
    fn quant(&self, b: usize, i: usize) -> i32 {
        let p = self.parts(b);
        let offset = match self.format {
            Format::Q4_0 => 8,
            Format::Q5_0 => 16,
            _ => 0,
        };
        p.quant(self.format, i) - offset
    }

    /// `y (M, rows) = x (M, cols) · Wᵀ` on the integer kernels, the weight rows split over
    /// the pool (prompt-sized products go to `gemm` instead: `linear::blocks_product`).
    pub fn product(&self, x: &[f32], y: &mut [f32]) {
        let m = x.len() / self.cols;
        self.check(x.len(), y.len());
        let pool = Pool::global();
        #[cfg(target_arch = "x86_64")]
        if self.packed && crate::model::linear::simd::Isa::current().has_avx2() {
            return packed::product_each(&[self], x, &mut [y]);
        }
        if m >= 2 && tile::available() {
            let rows =
                (self.rows.div_ceil(pool.threads() * 4).max(1)).next_multiple_of(tile::tile_rows());
            // A block of x rows at a time, each through every weight row.
            let block = tile::x_block_rows(self.cols);
            let blocks = x
                .chunks(block * self.cols)
                .zip(y.chunks_mut(block * self.rows));
            for (x, y) in blocks {
                let xq = QRows::quantize_for(self.format, x, self.cols);
                let out = &Out(y.as_mut_ptr());
                pool.run(self.rows.div_ceil(rows), &|c| {
                    let (r0, r1) = (c * rows, ((c + 1) * rows).min(self.rows));
                    // SAFETY: the tile kernel is available; chunk c alone writes columns
                    // r0..r1 of y (this block's rows); x holds them at our width; the
                    // blocks were checked.
                    unsafe { tile::rows(self, (r0, r1), &xq, out.0) };
                });
            }
            return;
        }
        let xq = QRows::quantize_for(self.format, x, self.cols);
        debug_assert_eq!(xq.scales.len(), m * self.cols / BLOCK);
        // A packed weight here is read through `simd`'s scalar loop (the CPU lacks AVX2
        // only where a test packed it), which reads either layout.
        let out = Out(y.as_mut_ptr());
        let out = &out;
        let rows = self.rows.div_ceil(pool.threads() * 4).max(1);
        pool.run(self.rows.div_ceil(rows), &|c| {
            let (r0, r1) = (c * rows, ((c + 1) * rows).min(self.rows));
            // SAFETY (the writes): chunk c alone writes columns r0..r1 of y (M rows).
            let put = |i: usize, r: usize, v: f32| unsafe { *out.0.add(i * self.rows + r) = v };
            for r in r0..r1 {
                let mut i = 0;
                while i + 4 <= m {
                    // SAFETY: r < rows, i + 4 <= m rows of xq, of our width; the blocks
                    // were checked against the shape above.
                    let dots = unsafe { simd::dot4(self, r, &xq, i) };
                    for (j, v) in dots.into_iter().enumerate() {
                        put(i + j, r, v);
                    }
                    i += 4;
                }
                for i in i..m {
                    // SAFETY: as for dot4, for row i < m.
                    put(i, r, unsafe { simd::dot(self, r, &xq, i) });
                }
            }
        });
    }

    /// Asserts that x (`xs` values) and y (`ys`) fit this weight, and what the kernels'
    /// unchecked loads rely on: that the blocks match the shape. Once per product.
    fn check(&self, xs: usize, ys: usize) {
        let m = xs / self.cols;
        assert!(
            xs == m * self.cols && ys == m * self.rows,
            "quantized product: x ({xs}) and y ({ys}) do not fit a {}x{} weight",
            self.rows,
            self.cols
        );
        let ggml_blocks = self.rows * self.cols / self.format.block_weights();
        let fits = match self.format.split() {
            _ if self.packed => self.packed_fits(),
            true => {
                let blocks = self.stored_blocks();
                self.scales.len() == blocks
                    && self.quants.len() == blocks * self.format.quant_bytes()
                    && self.mins.len()
                        == if self.format == Format::Q4_1 {
                            blocks
                        } else {
                            0
                        }
            }
            false => {
                self.cols.is_multiple_of(self.format.block_weights())
                    && self.quants.len() == ggml_blocks * self.format.ggml_bytes()
            }
        };
        assert!(
            fits,
            "quantized product: a {}x{} weight whose blocks do not match its shape",
            self.rows, self.cols
        );
    }

    /// [`product`](Self::product) of the same x with each of `ws` into each of `ys`, as one
    /// product where it can (a layer's q, k and v; its gate and up): packed weights of one
    /// width that round x alike share one rounding of x and one pass over the pool, their
    /// groups of rows split over it as if they were one weight's. Any other, each alone.
    pub fn products(ws: &[&QWeight], x: &[f32], ys: &mut [&mut [f32]]) {
        assert_eq!(
            ws.len(),
            ys.len(),
            "quantized products: weights and outputs"
        );
        for (w, y) in ws.iter().zip(ys.iter()) {
            w.check(x.len(), y.len());
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(first) = ws.first() {
            let shared = ws.iter().all(|w| {
                w.packed
                    && w.cols == first.cols
                    && QRows::span_for(w.format, w.cols) == QRows::span_for(first.format, w.cols)
            });
            if shared && crate::model::linear::simd::Isa::current().has_avx2() {
                return packed::product_each(ws, x, ys);
            }
        }
        for (w, y) in ws.iter().zip(ys.iter_mut()) {
            w.product(x, y);
        }
    }
}

/// Whether this CPU runs the VNNI kernels (AVX-512 VNNI, and `TINY_DECODER_ISA` allows
/// AVX-512).
pub fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return crate::model::linear::simd::Isa::current().kind()
        == crate::model::linear::simd::IsaKind::Avx512
        && tile::vnni::available();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// How the packed tiles multiply bytes on this CPU: `amx` (AMX's tile products over 16 rows
/// of x and more, `avx512-vnni`'s below), `avx512-vnni`, `avx-vnni` or `avx2`;
/// `none` where no weight is packed (off x86, or below AVX2).
pub fn packed_products() -> &'static str {
    packed::products()
}

/// `y`'s base pointer, shared by chunks that write disjoint columns.
struct Out(*mut f32);
// SAFETY: chunks write disjoint places of y; `Pool::run` returns after all have finished.
unsafe impl Sync for Out {}

#[cfg(test)]
mod tests;
