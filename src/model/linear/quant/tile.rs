//! Products of two rows of x and more (prompts, batches) with a block-format weight: a
//! register tile of weight rows × x rows over the integer dot products ([`x86`]), so that
//! each weight chunk is unpacked once for several x rows and each x chunk loaded once for
//! several weight rows. On a CPU without AVX2 the row-by-row kernels run instead.

#[cfg(target_arch = "x86_64")]
use super::Format;
use super::{QRows, QWeight};
#[cfg(target_arch = "x86_64")]
use crate::model::linear::simd::{Isa, IsaKind};

/// Whether this CPU has the tile kernel (AVX2 or AVX-512).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    return matches!(Isa::current().kind(), IsaKind::Avx2 | IsaKind::Avx512);
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Weight rows per tile: what a pool chunk's row count is a multiple of.
pub fn tile_rows() -> usize {
    #[cfg(target_arch = "x86_64")]
    if Isa::current().kind() == IsaKind::Avx512 {
        return 4;
    }
    // AVX2 tiles of 3 and 4 weight rows (`rows`).
    12
}

/// Bytes of 8-bit x that [`rows`] is given at once (see [`x_block_rows`]).
const X_BLOCK_BYTES: usize = 64 << 10;

/// Rows of x that [`rows`] is given at once for a weight of `cols` columns
/// (`QWeight::product` splits x into them): every tile of weight rows goes over all of them,
/// so they must stay in the near caches (8-bit x of about 64 KiB). On Zen 3, one thread, a 576 × 1536 Q4_K or Q6_K product of 512 rows of x
/// ran at 38-40 GMAC/s in blocks of 256 rows and 42-44 in blocks of 113 (this size), as
/// fast as at 128 rows; 32 KiB and 128 KiB measured the same within noise.
pub fn x_block_rows(cols: usize) -> usize {
    (X_BLOCK_BYTES / cols).clamp(4, 256).next_multiple_of(4)
}

/// Rows `r0..r1` of `y (M, w.rows) = x · wᵀ` for every row of `x`.
///
/// # Safety
/// [`available`]; `r0 <= r1 <= w.rows`; `x` holds M rows of `w`'s width, rounded for its
/// format ([`QRows::quantize_for`]); `y` is valid for
/// writes at `i · w.rows + r` for i < M and r0 <= r < r1, which nothing else touches
/// meanwhile; `w`'s blocks match its shape (`QWeight::product` checks it).
pub unsafe fn rows(w: &QWeight, r: (usize, usize), x: &QRows, y: *mut f32) {
    debug_assert!(!w.packed, "the tile reads rows, not the packed layout");
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller's; Isa::current() says which of the two this CPU runs.
    unsafe {
        match Isa::current().kind() {
            IsaKind::Avx512 if vnni::available() => vnni::rows::<4, 4>(w, r, x, y),
            IsaKind::Avx512 => x86::rows_512::<4, 4>(w, r, x, y),
            // Measured on Zen 3, one thread, 64 x rows (GMAC/s, 2 × 4 before): Q8_0 26 -> 29
            // at 3 × 4 (its sign trick takes a register), Q4_0 27 -> 31, Q5_0 28 -> 30, Q4_K
            // and Q6_K 40 -> 43 at 4 × 3.
            _ if w.format == Format::Q8_0 => x86::rows::<3, 4>(w, r, x, y),
            _ => x86::rows::<4, 3>(w, r, x, y),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no tile kernel on this CPU: {w:?} {r:?} {} {y:?}", x.cols)
}

#[cfg(target_arch = "x86_64")]
mod group;
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni;
#[cfg(target_arch = "x86_64")]
pub(super) mod x86;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests;
