//! Kernels for `y[m, r] = Σ_k x[m, k] · W[r, k]` over a slice of the rows of `W` (row-major,
//! width `k`) and one or more rows of `x`, with f32 weights or bf16 weights (raw `u16` bits,
//! widened to f32 in registers). Three instruction sets, chosen once at run time: AVX-512
//! (f + bw + vl), AVX2 + FMA ([`x86`]), and a portable scalar loop. Accumulation is always
//! in f32. Weights are prefetched ahead of the loads; on AVX-512 a tile of 4 weight rows × 4
//! rows of x stays in registers, so a prompt chunk reads each weight row once.
//!
//! bf16 weights are read in pairs: a 32-bit lane holding `W[r, 2i]` (low half) and
//! `W[r, 2i+1]` (high half) is two f32 values after one shift and one mask, with no
//! widening shuffle. So the bf16 kernels take `x` in [`pair_layout`]: its even-indexed
//! values, then its odd-indexed ones, split once per product instead of once per row.

/// The instruction set the kernels run with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

impl Isa {
    /// [`Isa::detect`], once per process.
    pub fn current() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(Isa::detect)
    }

    /// The best set this CPU supports.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
            {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }
}

/// How many weights ahead of the loads the kernels ask for memory to be fetched (8 KB of f32,
/// 4 KB of bf16). The hardware prefetcher alone left a quarter of the bandwidth unused:
/// SmolLM-135M decode went from 24.6 to 29.8 tok/s in f32 and from 32.2 to 43.4 in bf16
/// (medians of alternating runs; 0, 4, 8 and 16 KB ahead were tried).
const PREFETCH_AHEAD: usize = 2048;

/// Widens bf16 bits to f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// The rows of `x` (width `k`) rearranged for [`rows_bf16`], each as `x[0], x[2], x[4], ..`
/// then `x[1], x[3], ..`, with `f` applied to every value (a widening, or the identity).
pub fn pair_layout<T: Copy>(x: &[T], k: usize, f: impl Fn(T) -> f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(k.max(1)) {
        out.extend(row.iter().step_by(2).map(|&v| f(v)));
        out.extend(row.iter().skip(1).step_by(2).map(|&v| f(v)));
    }
    out
}

/// `x[j]` read from its [`pair_layout`] `xp` (the even values come first, `ceil(k / 2)`).
#[inline(always)]
fn paired(xp: &[f32], j: usize) -> f32 {
    match j % 2 {
        0 => xp[j / 2],
        _ => xp[xp.len().div_ceil(2) + j / 2],
    }
}

/// `y (M, R) = x (M, K) · wᵀ` for f32 `w` (R, K), every operand dense and row-major.
pub fn rows_f32(isa: Isa, x: &[f32], k: usize, w: &[f32], y: &mut [f32]) {
    let r = check_shapes(x.len(), k, w.len(), y.len());
    // SAFETY: `check_shapes` proved y holds M·R values, so every write at m·R + r is inside.
    unsafe { rows_f32_strided(isa, x, k, w, y.as_mut_ptr(), r) }
}

/// [`rows_f32`] for bf16 `w` (raw bits), with each row of `x` in [`pair_layout`].
pub fn rows_bf16(isa: Isa, xp: &[f32], k: usize, w: &[u16], y: &mut [f32]) {
    let r = check_shapes(xp.len(), k, w.len(), y.len());
    // SAFETY: as in `rows_f32`.
    unsafe { rows_bf16_strided(isa, xp, k, w, y.as_mut_ptr(), r) }
}

/// Panics unless x is M rows and w is R rows of width k and y is M·R; returns R.
fn check_shapes(x: usize, k: usize, w: usize, y: usize) -> usize {
    let ok = k > 0 && x.is_multiple_of(k) && w.is_multiple_of(k) && y == (x / k) * (w / k);
    assert!(
        ok,
        "x ({x}) and w ({w}) are not rows of width {k} making y ({y})"
    );
    w / k
}

/// `y[m·ldy + r] = Σ_j x[m·K + j] · w[r·K + j]` for every row m of x and r of w: the form
/// a parallel caller uses to write its own columns of a shared output.
///
/// # Safety
/// `x.len()` and `w.len()` are multiples of `k > 0`, `y` is valid for writes at every
/// `m·ldy + r` above and nothing else touches those places meanwhile, and `isa` is
/// supported by this CPU (it is whenever it came from [`Isa::detect`]).
pub unsafe fn rows_f32_strided(isa: Isa, x: &[f32], k: usize, w: &[f32], y: *mut f32, ldy: usize) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's.
        Isa::Avx512 => unsafe { x86::f32_avx512(x, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::f32_avx2(x, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(x, k, w, y, ldy, dot_f32) },
    }
}

/// [`rows_f32_strided`] for bf16 weights and x rows in [`pair_layout`].
///
/// # Safety
/// As for [`rows_f32_strided`].
pub unsafe fn rows_bf16_strided(
    isa: Isa,
    xp: &[f32],
    k: usize,
    w: &[u16],
    y: *mut f32,
    ldy: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's.
        Isa::Avx512 => unsafe { x86::bf16_avx512(xp, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::bf16_avx2(xp, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(xp, k, w, y, ldy, dot_bf16) },
    }
}

/// Whether `isa` keeps a tile of several x rows in registers (AVX-512's 32 registers hold
/// 4 weight rows × 4 x rows), so that a product of many rows reads `w` once per 64 rows.
/// Elsewhere each row of x is a pass over `w`, and candle's GEMM is the better choice.
pub fn tiles_rows(isa: Isa) -> bool {
    isa == Isa::Avx512
}

/// The portable path: one dot product per (row of x, row of w).
///
/// # Safety
/// As for [`rows_f32_strided`].
unsafe fn rows_scalar<W>(
    x: &[f32],
    k: usize,
    w: &[W],
    y: *mut f32,
    ldy: usize,
    dot: fn(&[f32], &[W], usize) -> f32,
) {
    for (m, xr) in x.chunks_exact(k).enumerate() {
        for (r, wr) in w.chunks_exact(k).enumerate() {
            // SAFETY: the caller vouches for every m·ldy + r.
            unsafe { *y.add(m * ldy + r) = dot(xr, wr, 0) };
        }
    }
}

/// `Σ x[j] · row[j]` for `j >= from`, with eight independent sums so the adds can overlap.
fn dot_f32(x: &[f32], row: &[f32], from: usize) -> f32 {
    let (x, row) = (&x[from..], &row[from..]);
    let mut acc = [0f32; 8];
    let (xb, wb) = (x.chunks_exact(8), row.chunks_exact(8));
    let tail: f32 = xb
        .remainder()
        .iter()
        .zip(wb.remainder())
        .map(|(a, b)| a * b)
        .sum();
    for (xc, wc) in xb.zip(wb) {
        for j in 0..8 {
            acc[j] = wc[j].mul_add(xc[j], acc[j]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// [`dot_f32`] for a bf16 row and x in [`pair_layout`], pair by pair.
fn dot_bf16(xp: &[f32], row: &[u16], from: usize) -> f32 {
    let k = row.len();
    let (even, odd) = xp.split_at(k.div_ceil(2));
    let mut acc = [0f32; 8];
    let pairs = (from.div_ceil(2)..k / 2)
        .map(|i| (i, bf16_to_f32(row[2 * i]), bf16_to_f32(row[2 * i + 1])));
    for (i, lo, hi) in pairs {
        acc[i % 8] = lo.mul_add(even[i], hi.mul_add(odd[i], acc[i % 8]));
    }
    // An odd `from` starts on a pair's high half, an odd `k` ends on a lone low half.
    let first = if from % 2 == 1 {
        bf16_to_f32(row[from]) * paired(xp, from)
    } else {
        0.0
    };
    let last = if k % 2 == 1 && from < k {
        bf16_to_f32(row[k - 1]) * even[k / 2]
    } else {
        0.0
    };
    acc.iter().sum::<f32>() + first + last
}

#[cfg(target_arch = "x86_64")]
mod x86;
