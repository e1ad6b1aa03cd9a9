//! Kernels for `y[m, r] = Σ_k x[m, k] · W[r, k]` over a slice of the rows of `W` (row-major,
//! width `k`) and one or more rows of `x`, with f32 weights or bf16 weights (raw `u16` bits,
//! widened to f32 in registers). Four instruction sets, chosen once at run time ([`Isa`],
//! which [`ISA_VAR`] can force lower): AVX-512 (f + bw + vl), AVX2 + FMA (+ F16C) (`x86`),
//! NEON on aarch64 (`arm`), and a portable scalar loop, the tests' reference. Accumulation is
//! always in f32. Weights are prefetched ahead of the loads; on AVX-512 and NEON (32
//! registers) a tile of 4 weight rows × 4 rows of x (× 6 on AVX-512 for f32 and bf16 × bf16)
//! stays in registers, so a prompt chunk reads each weight row once.
//!
//! bf16 weights are read in pairs: a 32-bit lane holding `W[r, 2i]` (low half) and
//! `W[r, 2i+1]` (high half) is two f32 values after one shift and one mask, with no
//! widening shuffle. So the bf16 kernels take `x` in [`pair_layout`]: its even-indexed
//! values, then its odd-indexed ones, split once per product instead of once per row. Where
//! the CPU multiplies bf16 pairs itself (AVX-512 BF16, [`bf16_pairs`]) x is bf16 too, in its
//! own order, and one `vdpbf16ps` takes 16 pairs of each.
//!
//! Over 300 lines on purpose: the ISA choice, the shape checks every form relies on and the
//! scalar reference read as one contract; the AVX-512 and AVX2 forms are in `x86`, NEON's
//! in `arm`.

use amx::cpu_has_amx;

/// The environment variable that forces a lower instruction set than the CPU's best:
/// `amx`, `avx512`, `avxvnni`, `avx2`, `neon` or `scalar` (`amx`: the AVX-512 set with AMX's
/// tile products, [`amx()`]; `avx512`: AVX-512 without them; `avxvnni`: AVX2 with AVX-VNNI's
/// integer dot products, [`avx_vnni`]; `avx2`: AVX2's own instructions only).
pub const ISA_VAR: &str = "TINY_DECODER_ISA";

/// The instruction sets there are kernels for, weakest first (NEON, on aarch64 only, is
/// never compared with the x86 sets: a CPU has one or the others).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IsaKind {
    Scalar,
    Neon,
    Avx2,
    Avx512,
}

/// An instruction set the kernels run with, and the proof that this CPU has it: every way
/// to get one asks the CPU first ([`Isa::new`], [`Isa::detect`], [`Isa::current`]), so the
/// safe functions below may run its instructions. Safe code cannot make one otherwise:
///
/// ```compile_fail,E0603
/// use tiny_decoder::model::linear::simd::{Isa, IsaKind};
/// let isa = Isa(IsaKind::Avx512); // the field is private
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Isa(IsaKind);

/// Why [`ISA_VAR`] could not be followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IsaError {
    #[error("{ISA_VAR}={0:?} is not one of amx, avx512, avxvnni, avx2, neon, scalar")]
    Unknown(String),
    #[error("{ISA_VAR}={0}: this CPU does not support it")]
    Unsupported(String),
}

impl Isa {
    /// The portable loop, which every CPU runs.
    pub const SCALAR: Isa = Isa(IsaKind::Scalar);

    /// `kind`, if this CPU (and OS) runs its instructions.
    pub fn new(kind: IsaKind) -> Option<Isa> {
        cpu_has(kind).then_some(Isa(kind))
    }

    pub fn kind(self) -> IsaKind {
        self.0
    }

    /// Whether AVX2 (with FMA and F16C) may run: every x86 fast path asks here, so that
    /// [`ISA_VAR`] reaches its fallback too.
    pub fn has_avx2(self) -> bool {
        matches!(self.0, IsaKind::Avx2 | IsaKind::Avx512)
    }

    /// The best set this CPU supports.
    pub fn detect() -> Isa {
        *Isa::supported().last().unwrap_or(&Isa::SCALAR)
    }

    /// Every set this CPU supports, weakest first.
    pub fn supported() -> Vec<Isa> {
        [
            IsaKind::Scalar,
            IsaKind::Neon,
            IsaKind::Avx2,
            IsaKind::Avx512,
        ]
        .into_iter()
        .filter_map(Isa::new)
        .collect()
    }

    /// The set named `name` (`amx`, `avx512`, `avxvnni`, `avx2`, `neon` or `scalar`), if this
    /// CPU supports it (`amx` is the AVX-512 set, on a CPU and OS with AMX: [`amx()`];
    /// `avxvnni` is the AVX2 set, on a CPU with AVX-VNNI: [`avx_vnni`]).
    pub fn from_name(name: &str) -> Result<Isa, IsaError> {
        let kind = match name.trim().to_ascii_lowercase().as_str() {
            "amx" if !cpu_has_amx() => return Err(IsaError::Unsupported(name.into())),
            "avx512" | "amx" => IsaKind::Avx512,
            "avxvnni" if !cpu_has_avx_vnni() => return Err(IsaError::Unsupported(name.into())),
            "avx2" | "avxvnni" => IsaKind::Avx2,
            "neon" => IsaKind::Neon,
            "scalar" => IsaKind::Scalar,
            _ => return Err(IsaError::Unknown(name.into())),
        };
        Isa::new(kind).ok_or_else(|| IsaError::Unsupported(name.into()))
    }

    /// The set the kernels use, decided once per process: the one [`ISA_VAR`] names, else
    /// [`Isa::detect`]. A name this CPU lacks (or an unknown one) is said once on stderr,
    /// and the detected set is used.
    pub fn current() -> Isa {
        static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *ISA.get_or_init(|| match std::env::var(ISA_VAR) {
            Ok(name) if !name.trim().is_empty() => Isa::from_name(&name).unwrap_or_else(|e| {
                let best = Isa::detect();
                let name = format!("{:?}", best.kind()).to_ascii_lowercase();
                eprintln!("warning: {e}; using {name}");
                best
            }),
            _ => Isa::detect(),
        })
    }
}

/// Whether the 256-bit integer kernels (the block formats' packed tiles) use AVX-VNNI's
/// `vpdpbusd` (VEX-encoded: Intel since Alder Lake, AMD since Zen 5) in place of AVX2's
/// `maddubs` + `madd`: where the kernels run at the AVX2 level ([`Isa::current`]) on a CPU
/// with AVX-VNNI, unless [`ISA_VAR`] is `avx2`. (With AVX-512 VNNI the AVX-512 set's tiles
/// use its own encoding of the same instruction.)
pub fn avx_vnni() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let plain = std::env::var(ISA_VAR).is_ok_and(|v| v.trim().eq_ignore_ascii_case("avx2"));
        Isa::current().kind() == IsaKind::Avx2 && !plain && cpu_has_avx_vnni()
    })
}

/// Whether the AVX-512 kernels run on a CPU whose units are 512 bits wide, as far as one can
/// tell: no CPUID bit says so, and AVX-VNNI stands in for it (Zen 5 servers and desktops and
/// Intel since Sapphire Rapids have both; Zen 4, whose 512-bit operations run as two halves,
/// lacks AVX-VNNI). A stand-in only: Zen 5 laptop parts have AVX-VNNI and half-width units,
/// Skylake-SP to Ice Lake-SP full-width units and no AVX-VNNI; both untimed. Where it matters
/// is measured in `prefill::F32_GEMM_ROWS_AVX512`.
pub fn full_width_512() -> bool {
    Isa::current().kind() == IsaKind::Avx512 && cpu_has_avx_vnni()
}

/// Whether the block formats' packed products over 16 rows of x and more take AMX's tile
/// products (`tdpbssd`, Intel since Sapphire Rapids, all of which have AVX-512 VNNI too):
/// where the kernels run at the AVX-512 level on a CPU and OS with AMX
/// (`simd/amx.rs`), unless [`ISA_VAR`] is `avx512`.
pub fn amx() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let plain = std::env::var(ISA_VAR).is_ok_and(|v| v.trim().eq_ignore_ascii_case("avx512"));
        Isa::current().kind() == IsaKind::Avx512 && !plain && cpu_has_amx()
    })
}

fn cpu_has_avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    return cpu_has(IsaKind::Avx2) && is_x86_feature_detected!("avxvnni");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether this CPU, and the OS (which must save the wider registers), run `kind`.
fn cpu_has(kind: IsaKind) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // F16C (f16 scales of the block formats) came with or before AVX2 on every CPU.
        let avx2 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        match kind {
            IsaKind::Scalar => true,
            IsaKind::Neon => false,
            IsaKind::Avx2 => avx2,
            IsaKind::Avx512 => {
                avx2 && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
        }
    }
    // NEON is part of the aarch64 baseline; asked anyway, as the x86 sets are.
    #[cfg(target_arch = "aarch64")]
    {
        match kind {
            IsaKind::Scalar => true,
            IsaKind::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            IsaKind::Avx2 | IsaKind::Avx512 => false,
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        kind == IsaKind::Scalar
    }
}

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

/// [`rows_f32`] for bf16 x and bf16 `w`, both raw bits ([`rows_bf16_pairs_strided`]).
pub fn rows_bf16_pairs(isa: Isa, x: &[u16], k: usize, w: &[u16], y: &mut [f32]) {
    let r = check_shapes(x.len(), k, w.len(), y.len());
    // SAFETY: as in `rows_f32`.
    unsafe { rows_bf16_pairs_strided(isa, x, k, w, y.as_mut_ptr(), r) }
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
/// `x.len()` and `w.len()` are multiples of `k > 0`, and `y` is valid for writes at every
/// `m·ldy + r` above and nothing else touches those places meanwhile. (That this CPU runs
/// `isa` is not the caller's to prove: an [`Isa`] exists only for a set the CPU has.)
pub unsafe fn rows_f32_strided(isa: Isa, x: &[f32], k: usize, w: &[f32], y: *mut f32, ldy: usize) {
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's, and the CPU has AVX-512 (`Isa`).
        IsaKind::Avx512 => unsafe { x86::f32_avx512(x, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX2 and FMA.
        IsaKind::Avx2 => unsafe { x86::f32_avx2(x, k, w, y, ldy) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above, with NEON.
        IsaKind::Neon => unsafe { arm::f32_neon(x, k, w, y, ldy) },
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
    match isa.kind() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's, and the CPU has AVX-512 (`Isa`).
        IsaKind::Avx512 => unsafe { x86::bf16_avx512(xp, k, w, y, ldy) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX2 and FMA.
        IsaKind::Avx2 => unsafe { x86::bf16_avx2(xp, k, w, y, ldy) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above, with NEON.
        IsaKind::Neon => unsafe { arm::bf16_neon(xp, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(xp, k, w, y, ldy, dot_bf16) },
    }
}

/// Whether `isa` multiplies bf16 by bf16 in pairs ([`rows_bf16_pairs_strided`]): AVX-512
/// with BF16 (Zen 4 and 5, Sapphire Rapids), where bf16 x (a bf16 model's activations) meets
/// bf16 weights as both are stored.
pub fn bf16_pairs(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    return isa.kind() == IsaKind::Avx512 && x86::has_bf16_dot();
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// `x` rounded to bf16 (to nearest even) as raw bits, for [`rows_bf16_pairs_strided`]: as
/// transformers and llama.cpp multiply bf16 weights, by bf16 activations.
pub fn bf16_bits_of(isa: Isa, x: &[f32]) -> Vec<u16> {
    #[cfg(target_arch = "x86_64")]
    if bf16_pairs(isa) {
        // SAFETY: `bf16_pairs` asked the CPU for AVX-512 BF16.
        return unsafe { x86::to_bf16_bits(x) };
    }
    let _ = isa;
    x.iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}

/// [`rows_f32_strided`] for bf16 x and bf16 weights, both as raw bits in their natural
/// order, where [`bf16_pairs`]: one `vdpbf16ps` per 16 pairs of each (the products exact in
/// f32, summed in f32). Elsewhere the scalar loop, the tests' reference.
///
/// # Safety
/// As for [`rows_f32_strided`].
pub unsafe fn rows_bf16_pairs_strided(
    isa: Isa,
    x: &[u16],
    k: usize,
    w: &[u16],
    y: *mut f32,
    ldy: usize,
) {
    match bf16_pairs(isa) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller's contract is the kernel's, and the CPU has AVX-512 BF16.
        true => unsafe { x86::bf16_dot_avx512(x, k, w, y, ldy) },
        // SAFETY: as above.
        _ => unsafe { rows_scalar(x, k, w, y, ldy, dot_bf16_pairs) },
    }
}

/// Whether `isa` keeps a tile of several x rows in registers (the 32 registers of AVX-512
/// hold 4 weight rows × 6 x rows, or × 4 for bf16 widened, and NEON's 4 × 4), so that a
/// product of many rows reads `w` once per 64 rows. Elsewhere each row of x is a pass over
/// `w`, and candle's GEMM (or, on AVX2, `prefill`) is the better choice. (NEON's tile is sized by counting registers: untimed on
/// ARM hardware, where candle's GEMM might still win on long f32 prompts.)
pub fn tiles_rows(isa: Isa) -> bool {
    matches!(isa.kind(), IsaKind::Avx512 | IsaKind::Neon)
}

/// The portable path: one dot product per (row of x, row of w). It is the reference the
/// tests hold the others to; a model without AVX2 runs candle's matmul instead (see
/// `matvec::takes_rows`).
///
/// # Safety
/// As for [`rows_f32_strided`].
unsafe fn rows_scalar<X, W>(
    x: &[X],
    k: usize,
    w: &[W],
    y: *mut f32,
    ldy: usize,
    dot: fn(&[X], &[W], usize) -> f32,
) {
    for (m, xr) in x.chunks_exact(k).enumerate() {
        for (r, wr) in w.chunks_exact(k).enumerate() {
            // SAFETY: the caller vouches for every m·ldy + r.
            unsafe { *y.add(m * ldy + r) = dot(xr, wr, 0) };
        }
    }
}

/// `Σ x[j] · row[j]` for `j >= from`, with eight independent sums so the adds can overlap.
/// Plain `a * b + c`, not `mul_add`: without FMA enabled at compile time that is a call to
/// `fmaf` per element (0.8 GB/s), where this leaves the compiler free to vectorise.
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
            acc[j] += wc[j] * xc[j];
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
        acc[i % 8] += lo * even[i] + hi * odd[i];
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

/// [`dot_f32`] for bf16 x and a bf16 row, both as raw bits.
fn dot_bf16_pairs(x: &[u16], row: &[u16], from: usize) -> f32 {
    let mut acc = [0f32; 8];
    for (j, (&a, &b)) in x[from..].iter().zip(&row[from..]).enumerate() {
        acc[j % 8] += bf16_to_f32(a) * bf16_to_f32(b);
    }
    acc.iter().sum()
}

mod amx;
#[cfg(target_arch = "aarch64")]
mod arm;
#[cfg(target_arch = "x86_64")]
mod x86;
