//! The NEON forms of [`super::dot`] and [`super::dot4`] (aarch64), without the offsets the
//! caller adds: each block's 32 stored integers (Q8_0's signed bytes, the nibble formats'
//! 0..=15) as signed bytes against 32 bytes of a Q8_0 row of x, summed in 32-bit integers,
//! then scaled in f32. With the `dotprod` extension (Armv8.2+, asked of the CPU at run time) by
//! `sdot`, as llama.cpp's `vdotq_s32` (the intrinsic is not stable in Rust, so one
//! instruction of inline assembly); without it by `vmull_s8` and `vpadalq_s16`, the
//! products widened to 16 bits and added pairwise into 32. Tested under qemu-user against
//! the scalar loop (correctness only), not timed on ARM hardware.

use super::super::{Format, QRows, QWeight, BLOCK};
use std::arch::aarch64::*;

/// How a block's integer dot product is formed: `Σ w·x` of 32 signed bytes, as 4 lanes.
trait BlockDot {
    /// # Safety
    /// The CPU has the instructions of the form (NEON; `sdot` for [`Sdot`]).
    unsafe fn block(w: [int8x16_t; 2], x: [int8x16_t; 2]) -> int32x4_t;
}

/// Armv8.0: widening multiplies, 8 bytes × 8 bytes into 8 i16 (|w·x| <= 2^14 fits), each
/// added pairwise into the 32-bit lanes before two could overflow.
struct Mull;

impl BlockDot for Mull {
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn block(w: [int8x16_t; 2], x: [int8x16_t; 2]) -> int32x4_t {
        let mut acc = vdupq_n_s32(0);
        for (w, x) in w.into_iter().zip(x) {
            acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
            acc = vpadalq_s16(acc, vmull_high_s8(w, x));
        }
        acc
    }
}

/// Armv8.2 `dotprod`: `sdot` adds four products of bytes into each 32-bit lane.
struct Sdot;

impl BlockDot for Sdot {
    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn block(w: [int8x16_t; 2], x: [int8x16_t; 2]) -> int32x4_t {
        let mut acc = vdupq_n_s32(0);
        for (w, x) in w.into_iter().zip(x) {
            // SAFETY: register-only arithmetic, on a CPU with `dotprod` (the caller's).
            unsafe {
                std::arch::asm!("sdot {acc:v}.4s, {w:v}.16b, {x:v}.16b",
                    acc = inout(vreg) acc, w = in(vreg) w, x = in(vreg) x,
                    options(pure, nomem, nostack, preserves_flags))
            }
        }
        acc
    }
}

/// Block `b` of weight row `r`'s stored integers as 32 signed bytes.
///
/// # Safety
/// Block b of row r exists.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn weights(w: &QWeight, r: usize, b: usize) -> [int8x16_t; 2] {
    let at = r * (w.cols / BLOCK) + b;
    match w.format {
        // SAFETY: block `at` is 32 bytes of quants.
        Format::Q8_0 => unsafe {
            let p = w.quants.as_ptr().add(at * BLOCK) as *const i8;
            [vld1q_s8(p), vld1q_s8(p.add(16))]
        },
        // SAFETY: 16 bytes of nibbles; low nibbles are weights 0-15, high 16-31. They stay
        // 0..=15 (signed bytes all the same): Q4_0's -8 and Q4_1's minimum are `offsets`.
        Format::Q4_0 | Format::Q4_1 => unsafe {
            let v = vld1q_u8(w.quants.as_ptr().add(at * BLOCK / 2));
            let (lo, hi) = (vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v));
            [vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi)]
        },
        _ => unreachable!("{:?} goes to kquant", w.format),
    }
}

/// Block `b` of row `i` of x.
///
/// # Safety
/// The block exists.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn activations(x: &QRows, i: usize, b: usize) -> [int8x16_t; 2] {
    // SAFETY: the caller's bounds: 32 bytes at row i, block b.
    unsafe {
        let p = x.quants.as_ptr().add(i * x.cols + b * BLOCK);
        [vld1q_s8(p), vld1q_s8(p.add(16))]
    }
}

/// The dot product with `B`'s block form. Always inlined, into a function compiled with
/// the features `B` needs ([`dot_mull`], [`dot_sdot`]), so that `B::block` inlines too.
///
/// # Safety
/// `r` and `i` are rows of `w` and `x`, which have the same width, and the CPU has `B`'s
/// instructions.
#[inline(always)]
unsafe fn dot_with<B: BlockDot>(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    let blocks = w.cols / BLOCK;
    debug_assert_eq!(x.cols, w.cols);
    // SAFETY (the block): the caller's CPU features, which include NEON.
    let mut acc = unsafe { vdupq_n_f32(0.0) };
    for b in 0..blocks {
        let d = w.scales[r * blocks + b].to_f32() * x.scales[i * blocks + b];
        // SAFETY: block b of row r of w and of row i of x exist; the caller's features.
        unsafe {
            let (wv, xv) = (weights(w, r, b), activations(x, i, b));
            acc = vfmaq_n_f32(acc, vcvtq_f32_s32(B::block(wv, xv)), d);
        }
    }
    // SAFETY: NEON, as above.
    unsafe { vaddvq_f32(acc) }
}

/// [`dot_with`] for rows `i0..i0 + 4` of x: each weight block is loaded (and its nibbles
/// unpacked) once for the four.
///
/// # Safety
/// As [`dot_with`], for rows `i0..i0 + 4` of x.
#[inline(always)]
unsafe fn dot4_with<B: BlockDot>(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    let blocks = w.cols / BLOCK;
    // SAFETY (every block): the caller's CPU features, which include NEON.
    let mut acc = [unsafe { vdupq_n_f32(0.0) }; 4];
    for b in 0..blocks {
        let dw = w.scales[r * blocks + b].to_f32();
        // SAFETY: block b of row r of w exists.
        let wv = unsafe { weights(w, r, b) };
        for (j, acc) in acc.iter_mut().enumerate() {
            let (i, d) = (i0 + j, dw * x.scales[(i0 + j) * blocks + b]);
            // SAFETY: row i of x exists (the caller's bound).
            unsafe {
                let xv = activations(x, i, b);
                *acc = vfmaq_n_f32(*acc, vcvtq_f32_s32(B::block(wv, xv)), d);
            }
        }
    }
    // SAFETY: NEON.
    acc.map(|a| unsafe { vaddvq_f32(a) })
}

/// # Safety
/// As [`dot_with`].
#[target_feature(enable = "neon")]
unsafe fn dot_mull(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    // SAFETY: the caller's contract.
    unsafe { dot_with::<Mull>(w, r, x, i) }
}

/// # Safety
/// As [`dot4_with`].
#[target_feature(enable = "neon")]
unsafe fn dot4_mull(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    // SAFETY: the caller's contract.
    unsafe { dot4_with::<Mull>(w, r, x, i0) }
}

/// # Safety
/// As [`dot_with`], on a CPU with `dotprod`.
#[target_feature(enable = "neon,dotprod")]
unsafe fn dot_sdot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    // SAFETY: the caller's contract.
    unsafe { dot_with::<Sdot>(w, r, x, i) }
}

/// # Safety
/// As [`dot4_with`], on a CPU with `dotprod`.
#[target_feature(enable = "neon,dotprod")]
unsafe fn dot4_sdot(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    // SAFETY: the caller's contract.
    unsafe { dot4_with::<Sdot>(w, r, x, i0) }
}

/// Whether this CPU has `sdot` (std caches the answer).
fn has_dotprod() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}

/// # Safety
/// `r` and `i` are rows of `w` and `x`, which have the same width.
pub unsafe fn dot(w: &QWeight, r: usize, x: &QRows, i: usize) -> f32 {
    match has_dotprod() {
        // SAFETY: the caller's bounds, and the CPU has `dotprod`.
        true => unsafe { dot_sdot(w, r, x, i) },
        // SAFETY: the caller's bounds.
        false => unsafe { dot_mull(w, r, x, i) },
    }
}

/// # Safety
/// As [`dot`], for rows `i0..i0 + 4` of x.
pub unsafe fn dot4(w: &QWeight, r: usize, x: &QRows, i0: usize) -> [f32; 4] {
    match has_dotprod() {
        // SAFETY: the caller's bounds, and the CPU has `dotprod`.
        true => unsafe { dot4_sdot(w, r, x, i0) },
        // SAFETY: the caller's bounds.
        false => unsafe { dot4_mull(w, r, x, i0) },
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::{Format, QRows, QWeight, BLOCK};
    use super::*;

    /// Values in [-1, 1) from an LCG, every 37th one 8 times larger (the scales' outliers).
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        };
        (0..n)
            .map(|j| next() * if j % 37 == 0 { 8.0 } else { 1.0 })
            .collect()
    }

    /// Both integer forms (`sdot` where this CPU has it: qemu's `-cpu max` does), one row
    /// and four rows of x at a time, against the scalar loop, for every block format.
    #[test]
    fn neon_block_dots_equal_the_scalar_loop() {
        let (rows, cols, m) = (7, 5 * BLOCK, 6);
        let (w, x) = (data(rows * cols, 1), data(m * cols, 2));
        let xq = QRows::quantize(&x, cols);
        for format in [Format::Q8_0, Format::Q4_0, Format::Q4_1] {
            let q = QWeight::quantize(format, &w, cols).unwrap();
            for (r, i) in (0..rows).flat_map(|r| (0..m).map(move |i| (r, i))) {
                let want = super::super::scalar(&q, r, &xq, i);
                // Rows i0..i0 + 4 that hold row i, whose j-th result is row i's.
                let (i0, j) = (i.min(m - 4), i - i.min(m - 4));
                // SAFETY (every call): row r of q and rows i0..i0 + 4 <= m of xq exist;
                // the `sdot` forms only run where the CPU has `dotprod`.
                let mut got = unsafe {
                    vec![
                        ("mull", dot_mull(&q, r, &xq, i)),
                        ("mull x4", dot4_mull(&q, r, &xq, i0)[j]),
                        ("dispatch", dot(&q, r, &xq, i)),
                        ("dispatch x4", dot4(&q, r, &xq, i0)[j]),
                    ]
                };
                if has_dotprod() {
                    got.push(("sdot", unsafe { dot_sdot(&q, r, &xq, i) }));
                    got.push(("sdot x4", unsafe { dot4_sdot(&q, r, &xq, i0)[j] }));
                }
                for (how, got) in got {
                    let tol = 1e-5 * want.abs().max(1.0);
                    let what = format!("{format:?} {how} w row {r}, x row {i}");
                    assert!((got - want).abs() <= tol, "{what}: {got} vs {want}");
                }
            }
        }
    }
}
