//! The packed kernel's tile on AMX (Intel since Sapphire Rapids) for the 32-weight formats:
//! two adjacent groups of 8 weight rows (16 rows, as `avx512`'s pair tile) against 16 rows
//! of x, one tile product a block. Per block of 32 columns, the weights' bytes go into a
//! 512-byte tile of 8 rows × 16 weight rows × 4 bytes, which is the packed layout's own
//! order ([`super`]: one 32-byte unit holds 4 bytes of each of 8 rows), the two groups' units
//! joined and the nibbles unpacked; x's 16 rows load as they are (16 rows × 32 bytes, x's row
//! stride), and one `tdpbssd` (`tdpbsud` for the unsigned quants of Q4_1 and Q5_1) makes the
//! 16 × 16 integer sums that 128 `vpdpbusd` make in `avx512`'s tile. The sums are stored,
//! and each x row's scaled into its accumulator as there (a conversion, a multiply, an FMA;
//! the minimums' FMA for Q4_1 and Q5_1): that float work, per block and x row, is what
//! bounds the tile now, as it bounds llama.cpp's AMX kernels (`ggml-cpu/amx/mmq.cpp`, the
//! same 32-column step). Q4_0 and Q5_0 go in signed (q − 8, q − 16) and Q8_0 as it is, so
//! they need no minimum.
//!
//! The tile registers are configured once per run of tiles ([`Config`]); the tiles assume
//! it. Tile instructions are written in `asm!`: Rust's AMX intrinsics are not stable.

use super::super::{QRows, QWeight, BLOCK};
use super::avx512::{halves16, join, nibbles, prefetch_at, prefetch_pair, store, PREFETCH};
use super::x86::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::ROWS;
use std::arch::asm;
use std::arch::x86_64::*;

/// Rows of x a tile takes: a tile register's 16 rows.
pub(super) const RX: usize = 16;

/// Bytes of 8-bit x that a product takes at once where AMX's tiles run (the VNNI tiles'
/// 64 KiB: `tile::x_block_rows`): each pair of groups is unpacked once per block of x, so
/// that more rows of x share it; the tiles load x from L2.
const X_BLOCK_BYTES: usize = 256 << 10;

/// Rows of x a product takes at once for a weight of `cols` columns: whole tiles.
pub(super) fn x_block_rows(cols: usize) -> usize {
    (X_BLOCK_BYTES / cols.max(1))
        .clamp(RX, 1024)
        .next_multiple_of(RX)
}

/// The tile registers' shapes (palette 1): `tmm0` 16 rows of x × 32 bytes (a block),
/// `tmm1` the weights' 8 rows × 64 bytes, `tmm2` and `tmm3` the sums, 16 × 16 i32 (two, so
/// that a block's product need not wait for the last one's sums to be read).
#[repr(C, align(64))]
struct Shapes {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// The tile registers configured for [`tile`] on this thread, released when dropped
/// (`tilerelease`: the OS then saves no tile state for it at a switch).
pub(super) struct Config(());

impl Config {
    /// Configures this thread's tile registers.
    ///
    /// # Safety
    /// The CPU and OS run AMX and this process may use it (`simd::amx`).
    pub(super) unsafe fn load() -> Config {
        let mut s = Shapes {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for (t, (colsb, rows)) in [(BLOCK, RX), (64, BLOCK / 4), (64, RX), (64, RX)]
            .into_iter()
            .enumerate()
        {
            (s.colsb[t], s.rows[t]) = (colsb as u16, rows as u8);
        }
        // SAFETY: the caller's; `s` is a valid palette-1 configuration, 64 bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &s, options(nostack, readonly)) };
        Config(())
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: a `Config` exists only where `load` ran, so the CPU has AMX.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// 64-byte aligned scratch for a tile: the weights of a block, or its sums.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Scratch<T: Copy, const N: usize>([T; N]);

/// Groups `g` and `g + 1` against rows `i0..` of x in whole tiles of 16, written to `y`;
/// returns the rows of x it took (the rest are the VNNI tiles'). The two groups' weights are
/// unpacked into tiles once, then each 16 rows of x go over them: unpacked again for every
/// 16 rows, a Q4_0 1536 × 576 product of 512 rows ran at 263 GMAC/s (2 threads, Sapphire
/// Rapids-class Xeon), `avx512`'s tile at 278.
///
/// # Safety
/// As `x86::rows` for both groups (each exists), for rows `i0..` of x; the CPU has AVX-512
/// (F, BW, VL, VNNI) and AMX, and this thread's tiles are configured ([`Config`]).
pub(super) unsafe fn tiles<const F: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) -> usize {
    let (nb, m) = (w.cols / BLOCK, x.quants.len() / x.cols.max(1));
    let whole = (m - i0) / RX * RX;
    if whole == 0 {
        return 0;
    }
    WEIGHTS.with_borrow_mut(|wt| {
        if wt.len() < nb {
            wt.resize(nb, Scratch([0u8; 512]));
        }
        // SAFETY: the caller's; the scratch is this thread's. (A closure is compiled without
        // this function's target features: `unpacked` has them.)
        unsafe { unpacked::<F>(w, g, x, (i0, i0 + whole), &mut wt[..nb], y) }
    });
    whole
}

/// [`tiles`] over rows `i0..i1` of x (whole tiles), the pair's blocks unpacked into `wt`.
///
/// # Safety
/// As [`tiles`]; `wt` holds a tile for each block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn unpacked<const F: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    (i0, i1): (usize, usize),
    wt: &mut [Scratch<u8, 512>],
    y: *mut f32,
) {
    // SAFETY (every call below): the caller's, for blocks c < nb of both groups and x's
    // rows i0..i1; each block's tile written before it is read.
    unsafe {
        for (c, b) in wt.iter_mut().enumerate() {
            unpack::<F>(w, g, c, b.0.as_mut_ptr());
        }
        for i in (i0..i1).step_by(RX) {
            tile::<F>(w, g, x, i, wt, y);
        }
    }
}

thread_local! {
    /// A pool thread's unpacked weights of a pair of groups, a tile a block ([`tiles`]):
    /// kept, not allocated and zeroed for every pair (16 rows of x, a batched step of 16
    /// sequences, run over a pair's tiles once).
    static WEIGHTS: std::cell::RefCell<Vec<Scratch<u8, 512>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Groups `g` and `g + 1` (their blocks unpacked in `wt`) against rows `i0..i0 + 16` of x.
///
/// Software-pipelined over the blocks: block c's product is issued before block c − 1's
/// sums are read back, so that the vector loads do not wait for the tile store beside them
/// (one block at a time, 2 threads: 217 against 263 GMAC/s, the case above).
///
/// # Safety
/// As [`tiles`], for rows `i0..i0 + 16`; `wt` holds the two groups' blocks.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
unsafe fn tile<const F: u8>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    wt: &[Scratch<u8, 512>],
    y: *mut f32,
) {
    let nb = wt.len();
    let mut sums = [Scratch([0i32; RX * 16]), Scratch([0i32; RX * 16])];
    // SAFETY: the caller's, for blocks c < nb; the scratch is this function's.
    unsafe {
        let mut acc = [_mm512_setzero_ps(); RX];
        for c in 0..nb {
            // 1. Block c's 16 × 16 sums (x rows × weight rows).
            let xs = x.quants.as_ptr().add(i0 * x.cols + c * BLOCK);
            let s = sums[c % 2].0.as_mut_ptr();
            product::<F>(c % 2 == 1, xs, x.cols, wt[c].0.as_ptr(), s);
            // 2. Block c − 1's sums scaled into the accumulators.
            if c > 0 {
                scale::<F>(&mut acc, w, g, x, i0, c - 1, sums[(c - 1) % 2].0.as_ptr());
            }
        }
        scale::<F>(&mut acc, w, g, x, i0, nb - 1, sums[(nb - 1) % 2].0.as_ptr());
        store(&acc, g, w.rows, i0, y);
    }
}

/// Block `c` of groups `g` and `g + 1` as the weights' tile at `b`: 8 rows of 16 weight rows
/// × 4 bytes, Q4_0 and Q5_0 signed (q − 8, q − 16), Q4_1 and Q5_1 unsigned.
///
/// # Safety
/// As [`tile`], for block c; 512 bytes at `b`, 64-byte aligned.
#[inline(always)]
unsafe fn unpack<const F: u8>(w: &QWeight, g: usize, c: usize, b: *mut u8) {
    let (nb, qb) = (w.cols / BLOCK, w.format.quant_bytes());
    // As in `avx512::tile`: the two groups' block c at `at` and `at + next`.
    let (at, next) = (g * nb * ROWS + c * ROWS, nb * ROWS);
    // SAFETY: the caller's.
    unsafe {
        let p = w.quants.as_ptr().add(at * qb);
        prefetch_pair(p, ROWS * qb, next * qb);
        let ahead = at + PREFETCH / qb;
        for at in [ahead, ahead + next] {
            prefetch_at(w.scales.as_ptr().wrapping_add(at));
            if matches!(F, Q5_0 | Q5_1) {
                prefetch_at(w.highs.as_ptr().wrapping_add(at));
            }
        }
        if F == Q8_0 {
            for v in 0..BLOCK / 4 {
                _mm512_store_si512(b.add(64 * v) as *mut _, join(p.add(32 * v), next * qb));
            }
            return;
        }
        // Q4_0 and Q5_0 signed (q − 8, q − 16); Q4_1 and Q5_1 as they are.
        let offset = _mm512_set1_epi8(match F {
            Q4_0 => 8,
            Q5_0 => 16,
            _ => 0,
        });
        let highs = match F {
            Q5_0 | Q5_1 => join(w.highs.as_ptr().add(at) as *const u8, 4 * next),
            _ => _mm512_setzero_si512(),
        };
        for v in 0..BLOCK / 8 {
            let (lo, hi) = nibbles::<F>(join(p.add(32 * v), next * qb), highs, v);
            // Weights 4v.. of the block, and 16 + 4v.. (a nibble byte's high half).
            _mm512_store_si512(b.add(64 * v) as *mut _, _mm512_sub_epi8(lo, offset));
            _mm512_store_si512(b.add(64 * (v + 4)) as *mut _, _mm512_sub_epi8(hi, offset));
        }
    }
}

/// Block `c`'s sums at `s` (16 x rows × 16 weight rows) scaled into `acc`, a row of x each:
/// `acc += sum · d · dx`, and for Q4_1 and Q5_1 `+ m · Σx`.
///
/// # Safety
/// As [`tile`], for block c; 1 KB of sums at `s`, 64-byte aligned.
#[inline(always)]
unsafe fn scale<const F: u8>(
    acc: &mut [__m512; RX],
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    c: usize,
    s: *const i32,
) {
    let nb = w.cols / BLOCK;
    let (at, next) = (g * nb * ROWS + c * ROWS, nb * ROWS);
    // SAFETY: the caller's.
    unsafe {
        let d = halves16(w.scales.as_ptr().add(at), next);
        let min = match F {
            Q4_1 | Q5_1 => halves16(w.mins.as_ptr().add(at), next),
            _ => _mm512_setzero_ps(),
        };
        for (j, acc) in acc.iter_mut().enumerate() {
            let xb = (i0 + j) * nb + c;
            let dx = _mm512_set1_ps(*x.scales.get_unchecked(xb));
            let sum = _mm512_cvtepi32_ps(_mm512_load_si512(s.add(16 * j) as *const _));
            *acc = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, dx), *acc);
            if matches!(F, Q4_1 | Q5_1) {
                let xsum = _mm512_set1_ps(*x.sums.get_unchecked(xb));
                *acc = _mm512_fmadd_ps(min, xsum, *acc);
            }
        }
    }
}

/// One block's tile product: x's 16 rows into `tmm0`, the weights' tile into `tmm1`, their
/// sums by `$dp` into `$c` (zeroed first), stored at `$s`.
macro_rules! block_product {
    ($dp:literal, $c:literal, $x:expr, $stride:expr, $b:expr, $s:expr) => {
        asm!(
            "tileloadd tmm0, [{x} + {stride} * 1]",
            "tileloadd tmm1, [{b} + {w} * 1]",
            concat!("tilezero ", $c),
            concat!($dp, " ", $c, ", tmm0, tmm1"),
            concat!("tilestored [{s} + {w} * 1], ", $c),
            x = in(reg) $x, stride = in(reg) $stride, b = in(reg) $b, s = in(reg) $s,
            w = in(reg) 64usize, options(nostack),
        )
    };
}

/// `s (16 × 16 i32) = x (16 rows × 32 bytes at stride `stride`) · b`, `b` the weights'
/// tile (8 rows × 64 bytes); in `tmm3` where `odd`, else `tmm2`.
///
/// # Safety
/// The tiles are configured ([`Config`]); 16 rows of 32 bytes at `x` by `stride`, 512
/// bytes at `b`, and 1 KB at `s` to write.
#[inline(always)]
unsafe fn product<const F: u8>(odd: bool, x: *const i8, stride: usize, b: *const u8, s: *mut i32) {
    // Q4_1's and Q5_1's quants are unsigned (`tdpbsud`: x signed, weights unsigned).
    let unsigned = matches!(F, Q4_1 | Q5_1);
    // SAFETY: the caller's.
    unsafe {
        match (odd, unsigned) {
            (false, false) => block_product!("tdpbssd", "tmm2", x, stride, b, s),
            (true, false) => block_product!("tdpbssd", "tmm3", x, stride, b, s),
            (false, true) => block_product!("tdpbsud", "tmm2", x, stride, b, s),
            (true, true) => block_product!("tdpbsud", "tmm3", x, stride, b, s),
        }
    }
}
