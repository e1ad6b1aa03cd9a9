//! The aarch64 kernels behind [`super`]: NEON (Advanced SIMD, baseline on every aarch64 CPU),
//! f32 weights and bf16 weights widened in registers (a shift and a mask per pair, as on
//! x86; no BFDOT, which stable Rust does not expose).
//!
//! NEON has 32 vector registers of 4 f32, as many as AVX-512 has, so a tile of 4 weight rows
//! × 4 rows of x fits: 16 sums, 4 weight registers (8 for bf16's halves) and 1 or 2 for x,
//! 26 at most. That is why [`super::tiles_rows`] says yes here. It is sized by counting
//! registers, not by timing: these kernels are tested under qemu-user on x86 (correctness
//! only) and have not been timed on ARM hardware.

use super::{dot_bf16, dot_f32};
use std::arch::aarch64::*;

/// How many weights ahead of the loads to ask for memory, as on x86 (`x86::PREFETCH_AHEAD`,
/// untimed here).
const PREFETCH_AHEAD: usize = 2048;

/// Rows of x per block: a block of x (64 × K) stays in L2 while the weight rows pass.
const M_BLOCK: usize = 64;

/// Rows of x per tile.
const X_ROWS: usize = 4;

/// Four f32 zeros, as a constant (no intrinsic is `const`).
// SAFETY: float32x4_t is 16 bytes, the size of [f32; 4], and any bits are valid f32 lanes.
const ZERO: float32x4_t = unsafe { std::mem::transmute([0f32; 4]) };

/// Asks for the cache line [`PREFETCH_AHEAD`] weights past `p` (address arithmetic only).
#[inline(always)]
fn prefetch<T>(p: *const T) {
    let p = p.wrapping_add(PREFETCH_AHEAD);
    // SAFETY: `prfm` is a hint: it never faults, whatever the address, and writes nothing.
    unsafe {
        std::arch::asm!("prfm pldl1keep, [{p}]", p = in(reg) p,
            options(nostack, readonly, preserves_flags))
    }
}

/// One weight type's step: `ELEMS` weights of a row (`load_w`), the same columns of a row
/// of x (`load_x`), their products added to 4 f32 sums (`mac`), and the scalar loop for
/// the last `k % ELEMS` columns (`tail`). (The methods are `unsafe` because a trait method
/// with `#[target_feature]` must be; only the loads have a contract beyond NEON.)
trait Step {
    type W: Copy;
    type Wv: Copy;
    type Xv: Copy;
    const ELEMS: usize;
    const W_ZERO: Self::Wv;
    /// # Safety
    /// NEON, and `ELEMS` weights are readable at `w`.
    unsafe fn load_w(w: *const Self::W) -> Self::Wv;
    /// # Safety
    /// NEON, `x` is a row of width `k` and `i + ELEMS <= k`.
    unsafe fn load_x(x: *const f32, k: usize, i: usize) -> Self::Xv;
    /// # Safety
    /// NEON.
    unsafe fn mac(acc: float32x4_t, w: Self::Wv, x: Self::Xv) -> float32x4_t;
    fn tail(x: &[f32], row: &[Self::W], from: usize) -> f32;
}

/// f32 weights, 4 per step.
struct F32;

impl Step for F32 {
    type W = f32;
    type Wv = float32x4_t;
    type Xv = float32x4_t;
    const ELEMS: usize = 4;
    const W_ZERO: float32x4_t = ZERO;

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load_w(w: *const f32) -> float32x4_t {
        prefetch(w);
        // SAFETY: the caller guarantees 4 readable f32 at w.
        unsafe { vld1q_f32(w) }
    }

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load_x(x: *const f32, _k: usize, i: usize) -> float32x4_t {
        // SAFETY: i + 4 <= k (the caller's contract).
        unsafe { vld1q_f32(x.add(i)) }
    }

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn mac(acc: float32x4_t, w: float32x4_t, x: float32x4_t) -> float32x4_t {
        vfmaq_f32(acc, w, x)
    }

    fn tail(x: &[f32], row: &[f32], from: usize) -> f32 {
        dot_f32(x, row, from)
    }
}

/// bf16 weights, 8 per step (4 pairs): the low and high halves of each 32-bit pair as f32,
/// against the 4 even and 4 odd x values of the same columns ([`super::pair_layout`]).
struct Bf16;

impl Step for Bf16 {
    type W = u16;
    type Wv = (float32x4_t, float32x4_t);
    type Xv = (float32x4_t, float32x4_t);
    const ELEMS: usize = 8;
    const W_ZERO: Self::Wv = (ZERO, ZERO);

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load_w(w: *const u16) -> Self::Wv {
        prefetch(w);
        // SAFETY: the caller guarantees 8 readable u16 at w (loaded as u16: w is only
        // 2-byte aligned), seen as 4 pairs.
        let v = vreinterpretq_u32_u16(unsafe { vld1q_u16(w) });
        let lo = vreinterpretq_f32_u32(vshlq_n_u32::<16>(v));
        let hi = vreinterpretq_f32_u32(vandq_u32(v, vdupq_n_u32(0xFFFF_0000)));
        (lo, hi)
    }

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load_x(xp: *const f32, k: usize, i: usize) -> Self::Xv {
        // SAFETY: i + 8 <= k, so i/2 + 4 <= k/2 <= ceil(k/2): both loads are in the row.
        unsafe {
            let odd = xp.add(k.div_ceil(2));
            (vld1q_f32(xp.add(i / 2)), vld1q_f32(odd.add(i / 2)))
        }
    }

    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn mac(acc: float32x4_t, (lo, hi): Self::Wv, (ev, od): Self::Xv) -> float32x4_t {
        vfmaq_f32(vfmaq_f32(acc, lo, ev), hi, od)
    }

    fn tail(xp: &[f32], row: &[u16], from: usize) -> f32 {
        dot_bf16(xp, row, from)
    }
}

/// The sums of NR weight rows × MR x rows kept in registers, written to y.
///
/// # Safety
/// As for `super::rows_f32_strided`, and `n + NR`, `m + MR` are within w and x.
#[target_feature(enable = "neon")]
#[inline]
#[allow(clippy::needless_range_loop)] // const-bound index loops become registers
unsafe fn tile<S: Step, const NR: usize, const MR: usize>(
    x: &[f32],
    k: usize,
    w: &[S::W],
    (n, m): (usize, usize),
    y: *mut f32,
    ldy: usize,
) {
    let body = k - k % S::ELEMS;
    let (xp, wp) = (x.as_ptr(), w.as_ptr());
    let mut acc = [[ZERO; MR]; NR];
    let mut wv = [S::W_ZERO; NR];
    let mut i = 0;
    while i < body {
        // SAFETY: i + ELEMS <= body <= k, n + a < rows of w and m + b < rows of x, so
        // every load is inside w or x.
        unsafe {
            for a in 0..NR {
                wv[a] = S::load_w(wp.add((n + a) * k + i));
            }
            for b in 0..MR {
                let xv = S::load_x(xp.add((m + b) * k), k, i);
                for a in 0..NR {
                    acc[a][b] = S::mac(acc[a][b], wv[a], xv);
                }
            }
        }
        i += S::ELEMS;
    }
    for b in 0..MR {
        let mut sums = [0f32; 4];
        if NR == 4 {
            // [Σa, Σb, Σc, Σd] in two pairwise adds. (`a % NR` keeps the indices in bounds
            // in the NR = 1 instance, where this is not taken.)
            let r = |a: usize| acc[a % NR][b];
            let four = vpaddq_f32(vpaddq_f32(r(0), r(1)), vpaddq_f32(r(2), r(3)));
            // SAFETY: `sums` holds 4 f32.
            unsafe { vst1q_f32(sums.as_mut_ptr(), four) };
        } else {
            for a in 0..NR {
                sums[a] = vaddvq_f32(acc[a][b]);
            }
        }
        for a in 0..NR {
            if body < k {
                let xr = &x[(m + b) * k..(m + b + 1) * k];
                sums[a] += S::tail(xr, &w[(n + a) * k..(n + a + 1) * k], body);
            }
            // SAFETY: the caller vouches for this place in y.
            unsafe { *y.add((m + b) * ldy + n + a) = sums[a] };
        }
    }
}

/// Covers x and w with tiles of at most 4 × [`X_ROWS`], x in blocks of [`M_BLOCK`] rows.
///
/// # Safety
/// As for `super::rows_f32_strided`.
#[target_feature(enable = "neon")]
unsafe fn rows<S: Step>(x: &[f32], k: usize, w: &[S::W], y: *mut f32, ldy: usize) {
    let (rows_x, rows_w) = (x.len() / k, w.len() / k);
    for m0 in (0..rows_x).step_by(M_BLOCK) {
        let m1 = (m0 + M_BLOCK).min(rows_x);
        let mut n = 0;
        while n < rows_w {
            let mut m = m0;
            // SAFETY (every call): n + NR <= rows_w and m + MR <= m1 <= rows_x.
            unsafe {
                if n + 4 <= rows_w {
                    while m1 - m >= X_ROWS {
                        tile::<S, 4, X_ROWS>(x, k, w, (n, m), y, ldy);
                        m += X_ROWS;
                    }
                    for m in m..m1 {
                        tile::<S, 4, 1>(x, k, w, (n, m), y, ldy);
                    }
                    n += 4;
                } else {
                    for m in m..m1 {
                        tile::<S, 1, 1>(x, k, w, (n, m), y, ldy);
                    }
                    n += 1;
                }
            }
        }
    }
}

/// `super::rows_f32_strided` on NEON.
///
/// # Safety
/// As for `super::rows_f32_strided`.
#[target_feature(enable = "neon")]
pub unsafe fn f32_neon(x: &[f32], k: usize, w: &[f32], y: *mut f32, ldy: usize) {
    // SAFETY: the caller's contract.
    unsafe { rows::<F32>(x, k, w, y, ldy) }
}

/// `super::rows_bf16_strided` on NEON, x in [`super::pair_layout`].
///
/// # Safety
/// As for `super::rows_f32_strided`.
#[target_feature(enable = "neon")]
pub unsafe fn bf16_neon(xp: &[f32], k: usize, w: &[u16], y: *mut f32, ldy: usize) {
    // SAFETY: the caller's contract.
    unsafe { rows::<Bf16>(xp, k, w, y, ldy) }
}
