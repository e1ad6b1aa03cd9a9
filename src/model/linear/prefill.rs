//! The product `y = x · Wᵀ` for a prompt chunk of many rows of x on AVX2 (+ FMA), where the
//! registers hold a tile of only 2 rows of x (AVX-512 holds 4 or 6 and reads W once per 64 rows,
//! `simd::tiles_rows`), and for f32 prompts of 128 rows and more on CPUs whose AVX-512 units
//! are 512 bits wide, where `gemm`'s AVX-512 micro-kernels beat that tile
//! ([`F32_GEMM_ROWS_AVX512`]).
//!
//! Why: without it, prompt products went to candle's CPU matmul, which has no bf16 kernel
//! and widens the whole weight matrix into a new f32 buffer, on one thread, on every call
//! (Qwen2.5-1.5B bf16 prefill ran at 0.9 tok/s on a 4-token prompt). Two options, timed on
//! the AVX2 host (Zen 3, 2 cores, shared) over one Qwen2.5-1.5B layer's seven matrices,
//! medians of 5 in one run (`tests/kernel.rs`'s probe times the op against candle's matmul):
//!
//! | rows of x | f32: candle / tile / gemm (ms) | bf16: candle / tile / gemm (ms) |
//! |---|---|---|
//! | 4 | 50 / 24 / 45 | 223 / 17 / 31 |
//! | 16 | 94 / 76 / 85 | 342 / 52 / 67 |
//! | 24 | 112 / 108 / 100 | 344 / 74 / 83 |
//! | 40 | 137 / 170 / 129 | 378 / 122 / 120 |
//! | 64 | 192 / 265 / 177 | 474 / 197 / 173 |
//! | 512 | 898 / 1687 / 933 | 1096 / 1133 / 820 |
//!
//! - the register tile (`simd`, 4 weight rows × 2 x rows) reads W once per pair of x rows:
//!   fastest while reading W bounds the product, up to about 16 rows in f32 and 24-32 in
//!   bf16 (half the bytes, widened in registers);
//! - the `gemm` crate (the GEMM under candle's matmul) on blocks of W is compute-bound and
//!   wins beyond. For f32 it matches candle's own call of it at 512 rows (within the
//!   run-to-run noise: 705 against 939 ms in another run) and beats it below, and keeps
//!   candle's rayon threads from competing with the pool's for the same two cores, so it
//!   replaces candle's matmul on AVX2 for every row count.
//!
//! [`by_gemm`] picks. Here the rows of `W` are split into chunks that the [`Pool`] runs in
//! parallel, and a chunk goes through `gemm` single-threaded. bf16 weights go one block of
//! `BLOCK_ROWS` × `BLOCK_K` at a time, widened and transposed (`widen`) into a small
//! per-thread f32 buffer that stays in L2: read from memory once, as bf16, the f32 copy
//! never leaving the cache. f32 weights are copied the same way below
//! [`F32_IN_PLACE_ROWS`] rows of x, and go to `gemm` in place from there.

mod widen;

use super::matvec::CHUNKS_PER_THREAD;
use super::quant::{self, QWeight};
use super::simd::{self, Isa, IsaKind};
use crate::model::pool::Pool;
use gemm::{gemm, Parallelism};
use std::cell::RefCell;

/// Weight rows per `gemm` call on bf16: a multiple of its AVX2 f32 micro-tile (16 rows of W
/// by 6 rows of x), so no call runs a narrow tail tile except at the end of the matrix.
const BLOCK_ROWS: usize = 96;
/// Columns of a bf16 block: 96 × 512 f32 are 192 KiB, under half of Zen 3's 512 KiB L2.
/// (48-192 rows × 256-1024 columns timed the same within noise.)
const BLOCK_K: usize = 512;
/// From this many rows of x, f32 products go to `gemm`, and bf16 from [`BF16_GEMM_ROWS`].
const F32_GEMM_ROWS: usize = 17;
const BF16_GEMM_ROWS: usize = 32;
/// On AVX-512 with full-width units, f32 products go to `gemm` (its AVX-512 micro-kernels,
/// gemm's `x86-v4`) from this many rows of x. SmolLM2-135M f32 prefill (Zen 5, 2 threads,
/// 2-3 alternating runs, tok/s, the 4 × 4 tile / gemm): 20 tokens 711-745 / 471-476, 64:
/// 1053-1100 / 962-980, 128: 872-1173 / 1262-1270, 256: 1219-1296 / 1258-1488, 512:
/// 1167-1223 / 1450-1467 (the 4 × 6 tile is untimed there). Where 512-bit operations run as
/// two halves (Zen 4), the 4 × 6 tile wins or ties at every size: the 1.7B shape's f32 prefill 512
/// 44.3-44.9 tok/s through `gemm`, 50.2-51.7 on the tile, SmolLM2-135M's 640-734 / 628-717
/// (2 threads, alternating runs); `probe_rows_throughput` at 128-512 rows, 8192 × 2048
/// weights 163 / 207 GFLOP/s, SmolLM2's 1536 × 576 155-171 / 197-199. bf16 stays on the
/// tile (`vdpbf16ps`) at every size on both.
const F32_GEMM_ROWS_AVX512: usize = 128;
/// From this many rows of x, f32 weights go to `gemm` as they are; below, transposed into
/// blocks as bf16 is (`widen`), for `gemm` gathers a row-major block element by element and
/// fewer rows of x pay for it less. Zen 3 (AVX2, 2 threads; `probe_rows_throughput`, two
/// runs, GFLOP/s in place / copied): 64 × 2048 · (8192 × 2048)ᵀ 62-45 / 81-79, 64 × 8192 ·
/// (2048 × 8192)ᵀ 65-55 / 75-81, 32 rows 42-40 / 48-59; 128 × 2048 · (2048 × 2048)ᵀ 89-78 /
/// 72-89 and 512 rows 94-100 / 85-106 (a tie). The 1.7B shape's f32 prefill of 64 tokens
/// 18.7-20.2 -> 24.7-26.8 tok/s (2 alternating runs); SmolLM2-135M's 64 and 512 tokens
/// within noise (5 alternating runs each, medians 320 / 319 and 399 / 391 tok/s).
const F32_IN_PLACE_ROWS: usize = 128;

/// From this many rows of x, products with block-format weights (`--dtype q8_0|q4_0`, a
/// GGUF's blocks) go to `gemm` too, each block dequantized into the f32 buffer as bf16 is
/// widened; below, our integer kernels (`quant`: the tile kernel from 2 rows) run them.
/// Where they cross, on SmolLM2's Q5_0 and Q4_K_M files (Zen 5, medians of 3 noisy runs):
/// the tile ran 64-row prompts at 235 tok/s against 191-224 through `gemm`, and `gemm` 256
/// and 512 rows at 380-430 against 230-285. Measured again on Zen 5 on 2026-11-27
/// (`probe_blocks_prefill`), the row layout's VNNI tile beat `gemm` at every size, so on
/// AVX-512 with VNNI block formats never come here ([`by_gemm`]).
const BLOCKS_GEMM_ROWS: usize = 128;

/// The weights of a product: f32 as stored, bf16 as raw bits, or in a block format.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Blocks(&'a QWeight),
}

impl Weights<'_> {
    fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::Blocks(w) => w.rows() * w.cols(),
        }
    }
}

/// `y`'s base pointer, shared by chunks that each write their own disjoint columns.
struct Out(*mut f32);
// SAFETY: chunks write disjoint columns of `y`, and `Pool::run` returns only after all have
// finished, while `y` is still mutably borrowed by `product`.
unsafe impl Sync for Out {}

thread_local! {
    /// A pool thread's widened bf16 block ([`BLOCK_ROWS`] × [`BLOCK_K`] at most).
    static BLOCK: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Whether a product with `m` rows of x and weights `w` runs here rather than in the
/// register tile: on AVX2 with enough rows (see the file's header), f32 on full-width
/// AVX-512 from [`F32_GEMM_ROWS_AVX512`]; block formats on AVX2 and AVX-512 without VNNI
/// (on NEON they stay on the integer dots: untimed there).
pub fn by_gemm(m: usize, w: Weights<'_>) -> bool {
    let isa = Isa::current().kind();
    match w {
        Weights::F32(_) => match isa {
            IsaKind::Avx2 => m >= F32_GEMM_ROWS,
            IsaKind::Avx512 => m >= F32_GEMM_ROWS_AVX512 && simd::full_width_512(),
            IsaKind::Neon | IsaKind::Scalar => false,
        },
        Weights::Bf16(_) => isa == IsaKind::Avx2 && m >= BF16_GEMM_ROWS,
        // Packed weights' kernel beat `gemm` at every size (Zen 3: 58-96 GMAC/s at 64-512
        // rows against 25-59, `probe_packed`), and so does the row layout's VNNI tile (Zen
        // 5, 2 threads, `probe_blocks_prefill`: Q2_K, Q3_K and Q5_K at 193-209 GMAC/s from
        // 128 to 512 rows against 87-117). Every block format is packed on x86 with AVX2
        // (Q2_K and Q3_K last: on Zen 4 in AVX2's forms their files prefill 512 tokens at
        // 79-87 tok/s against 50-64 here), so this route serves only weights kept in rows
        // (`QWeight::repacked(false)`: the tests and probes that compare the two).
        Weights::Blocks(q) => {
            !q.is_packed()
                && (isa == IsaKind::Avx2 || (isa == IsaKind::Avx512 && !quant::vnni()))
                && m >= BLOCKS_GEMM_ROWS
        }
    }
}

/// `y (M, N) = x (M, K) · wᵀ` for `w` (N, K), every operand dense and row-major.
///
/// # Panics
/// If x, w and y are not M × K, N × K and M × N.
pub fn product(x: &[f32], k: usize, w: Weights<'_>, y: &mut [f32]) {
    if k == 0 {
        return y.fill(0.0);
    }
    let (m, n) = (x.len() / k, w.len() / k);
    assert!(
        x.len() == m * k && w.len() == n * k && y.len() == m * n,
        "prefill: x ({}), w ({}) and y ({}) are not rows of width {k}",
        x.len(),
        w.len(),
        y.len()
    );
    let pool = Pool::global();
    let rows = n
        .div_ceil(pool.threads() * CHUNKS_PER_THREAD)
        .next_multiple_of(BLOCK_ROWS);
    let out = &Out(y.as_mut_ptr());
    pool.run(n.div_ceil(rows), &|i| {
        let (r0, r1) = (i * rows, ((i + 1) * rows).min(n));
        // SAFETY: chunk i alone writes columns r0..r1 of y (M rows of N), all inside y.
        unsafe { chunk(x, k, w, (r0, r1), out.0, n) };
    });
}

/// Columns `r0..r1` of `y` (row stride `ldy`) from weight rows `r0..r1`.
///
/// # Safety
/// `x` is M rows of width `k`, `r1` rows of `w` exist, and `y` is valid for writes at every
/// `m·ldy + r` for m < M and r0 <= r < r1, which nothing else touches meanwhile.
unsafe fn chunk(
    x: &[f32],
    k: usize,
    w: Weights<'_>,
    (r0, r1): (usize, usize),
    y: *mut f32,
    ldy: usize,
) {
    let m = x.len() / k;
    match w {
        // SAFETY: rows r0..r1 of w are inside it; the caller vouches for x and y.
        Weights::F32(w) if m >= F32_IN_PLACE_ROWS => unsafe {
            gemm_block(
                m,
                (r1 - r0, k),
                (x.as_ptr(), k),
                (w[r0 * k..].as_ptr(), k, 1),
                y.add(r0),
                ldy,
                false,
            )
        },
        _ => BLOCK.with_borrow_mut(|buf| {
            // Equal column blocks of at most BLOCK_K (576 is 2 × 288, not 512 + 64), whole
            // blocks of a block format.
            let width = k
                .div_ceil(k.div_ceil(BLOCK_K))
                .next_multiple_of(quant::BLOCK);
            for b0 in (r0..r1).step_by(BLOCK_ROWS) {
                let rows = BLOCK_ROWS.min(r1 - b0);
                for c0 in (0..k).step_by(width) {
                    let cols = width.min(k - c0);
                    let block = match w {
                        Weights::Blocks(q) => q.dequantize_transposed((b0, rows), (c0, cols), buf),
                        Weights::Bf16(w) => widen::transposed(w, k, (b0, rows), (c0, cols), buf),
                        Weights::F32(w) => widen::transposed(w, k, (b0, rows), (c0, cols), buf),
                    };
                    // SAFETY: block is W[r, c] at c·rows + r for the block's rows × cols;
                    // x's columns c0..c0 + cols exist; y as above.
                    unsafe {
                        gemm_block(
                            m,
                            (rows, cols),
                            (x[c0..].as_ptr(), k),
                            (block.as_ptr(), 1, rows),
                            y.add(b0),
                            ldy,
                            c0 > 0,
                        )
                    }
                }
            }
        }),
    }
}

/// `y (M, rows) (+)= x (M, cols) · wᵀ` for w (rows, cols), single-threaded. x is a pointer
/// and its row stride, w a pointer and the strides of its rows and columns (`w[r, c]` at
/// `r·rs + c·cs`). `accumulate` adds to what y holds instead of overwriting.
///
/// # Safety
/// Every `w[r, c]` and `x[i, c]` is readable, y is writable at `i·ldy + r`.
pub(crate) unsafe fn gemm_block(
    m: usize,
    (rows, cols): (usize, usize),
    (x, ldx): (*const f32, usize),
    (w, rs, cs): (*const f32, usize, usize),
    y: *mut f32,
    ldy: usize,
    accumulate: bool,
) {
    // dst (M, rows) = lhs x (M, cols) · rhs wᵀ (cols, rows): wᵀ[c, r] is w[r, c].
    // SAFETY: the caller's contract; gemm reads and writes only inside these extents.
    unsafe {
        gemm(
            m,
            rows,
            cols,
            y,
            1,
            ldy as isize,
            accumulate,
            x,
            1,
            ldx as isize,
            w,
            rs as isize,
            cs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests;
