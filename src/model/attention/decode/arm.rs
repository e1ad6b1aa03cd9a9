//! The value sum of decode attention on NEON (aarch64): `acc (M, Dv) += p (M, L) · v (L, Dv)`
//! with v in f32 or in bf16 (raw bits, widened by a shift into the top half of each lane).
//! Tested under qemu-user (correctness only), not timed on ARM hardware.

use std::arch::aarch64::*;

/// One cached element type's 4 values of a row of v, as f32.
pub(super) trait Lanes: Copy {
    /// # Safety
    /// NEON, and 4 values are readable at `v`.
    unsafe fn load4(v: *const Self) -> float32x4_t;
    fn to_f32(self) -> f32;
}

impl Lanes for f32 {
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load4(v: *const f32) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable f32.
        unsafe { vld1q_f32(v) }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Lanes for u16 {
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load4(v: *const u16) -> float32x4_t {
        // SAFETY: the caller guarantees 4 readable u16 (8 bytes).
        let bits = unsafe { vld1_u16(v) };
        // bf16 is the top half of an f32: widen each u16 to u32 shifted left by 16.
        vreinterpretq_f32_u32(vshll_n_u16::<16>(bits))
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
}

/// `acc (M, Dv) += p (M, L) · v (L, Dv)` (row j of v at `j·vs`), 8 columns of a row of v
/// per step (two independent multiply-adds), then 4, then one at a time.
#[target_feature(enable = "neon")]
pub(super) fn accumulate<T: Lanes>(p: &[f32], v: &[T], (dv, vs): (usize, usize), acc: &mut [f32]) {
    if dv == 0 {
        return;
    }
    let l = p.len() / (acc.len() / dv).max(1);
    for (pm, am) in p.chunks_exact(l.max(1)).zip(acc.chunks_exact_mut(dv)) {
        for (j, &pj) in pm.iter().enumerate() {
            let vj = &v[j * vs..j * vs + dv];
            let (a, vp) = (am.as_mut_ptr(), vj.as_ptr());
            let mut i = 0;
            // SAFETY: i + 8 (or 4) <= dv, the length of both `am` and `vj`; NEON (this
            // function's).
            unsafe {
                while i + 8 <= dv {
                    let lo = vfmaq_n_f32(vld1q_f32(a.add(i)), T::load4(vp.add(i)), pj);
                    let hi = vfmaq_n_f32(vld1q_f32(a.add(i + 4)), T::load4(vp.add(i + 4)), pj);
                    vst1q_f32(a.add(i), lo);
                    vst1q_f32(a.add(i + 4), hi);
                    i += 8;
                }
                if i + 4 <= dv {
                    let s = vfmaq_n_f32(vld1q_f32(a.add(i)), T::load4(vp.add(i)), pj);
                    vst1q_f32(a.add(i), s);
                    i += 4;
                }
            }
            for (a, &x) in am[i..].iter_mut().zip(&vj[i..]) {
                *a += pj * x.to_f32();
            }
        }
    }
}
