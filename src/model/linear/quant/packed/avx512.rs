//! The packed kernel's 16-row tile for the 32-weight formats on AVX-512 with VNNI: two
//! adjacent groups of 8 rows side by side in a 64-byte register (group `g` in lanes 0-7,
//! `g + 1` in lanes 8-15), so that one `vpdpbusd` against x's 4 bytes, broadcast to all 16
//! lanes from memory, does the products of 16 weight rows where the 256-bit tile
//! (`x86::tile_vnni`) does 8. The layout is [`super`]'s unchanged: each load is two 32-byte
//! units of the two groups, joined. The two groups' 16 columns of y are adjacent, so a
//! tile's row of results is one store. Q8_0's weights go in as w + 128, unsigned, as in
//! `x86/blocks.rs`'s VNNI forms (the two give a row the same sums in the same order).
//!
//! Its block loop is `x86/blocks.rs`'s `tile_in` in 512-bit registers (the minimums, Q5's
//! fifth bits, the close per block read the same): the register types and the loads
//! differ in every line, and a width-generic body would need a trait over both.

use super::super::{QRows, QWeight, BLOCK};
use super::x86::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::ROWS;
use half::f16;
use std::arch::x86_64::*;

/// How far ahead of a block the tile asks for the two groups' quant bytes (`prefetcht0`).
/// At a few rows of x (a batched decode step) the weights stream from memory while the tile
/// computes, and with the hardware prefetcher alone the tile waited for them: a 16-row tile
/// over 8 rows of x ran at 150 GMAC/s on SmolLM2's 1536 x 576 Q4_0 weights read from memory,
/// 275 from the caches. SmolLM2-135M `bench --batch 8` decode (Zen 4, 2 threads, alternating
/// rounds, medians): Q4_0 716 -> 836 tok/s (4 rounds; 8 KB alike, 2 KB less), in a second run
/// 730 -> 804, and its Q4_K_M file (Q5_0 and Q8_0 here) 663 -> 729 (3 rounds); prompts
/// within noise. One row of x (decode) takes the 8-row tiles, which read at the memory's
/// pace already (`x86/blocks.rs`: no gain measured there).
/// The scales and Q5's fifth bits, streams of their own, as far ahead, and the K-quants'
/// 16-row tiles their superblocks likewise (Zen 5, `bench --batch 8`, alternating rounds,
/// medians): SmolLM2's Q4_0 file +3% (8 rounds), its Q4_K_M file +3-6% for the scales and
/// fifth bits and +6% more for the superblocks; the 1.7B shape's Q5_0 file 157 -> 174 tok/s,
/// its Q4_K_M 102 -> 125 -> 140 (3 rounds), `--batch 4` Q6_K 51 -> 63 (4); prompts alike.
/// The 8-row tiles (AVX2's, AVX-VNNI's) over several rows of x the same way, one stream
/// each ([`prefetch_one`]); on the Zen 5 host forced to them (`TINY_DECODER_ISA`), the 1.7B
/// shape's files, 8 sequences, 2 alternating rounds: AVX2 Q4_0 93-104 -> 126-140 tok/s,
/// Q5_0 80-83 -> 95-107, Q4_K_M 85-91 -> 122-126, Q6_K 66-70 -> 104; AVX-VNNI Q4_0 102-104
/// -> 145-147, Q4_K_M 102 -> 134-137; 256-token prompts +3-6%; one row unchanged.
pub(super) const PREFETCH: usize = 4096;

/// Groups `g` and `g + 1` against rows `i0..i0 + R` of x, written to `y`.
///
/// # Safety
/// As `x86::rows` for both groups (each exists), for rows `i0..i0 + R` of x; the CPU has
/// AVX-512F, BW, VL and VNNI (`quant::vnni`).
// The tile's loops index the accumulators and x's rows together.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn tile<const F: u8, const R: usize>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    let (nb, qb) = (w.cols / BLOCK, w.format.quant_bytes());
    // Scales (and minimums, Q5's fifth bits) of the two groups' block c at `first + 8c` and
    // `first + next + 8c`; their quants at those times qb.
    let (first, next) = (g * nb * ROWS, nb * ROWS);
    // SAFETY (every load below): both groups' blocks hold nb · 8 scales (minimums, fifth
    // bits) and nb · 8 · qb quant bytes from where they start; x's rows i0..i0 + R hold nb
    // blocks each; the stores are the caller's.
    unsafe {
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); R];
        for c in 0..nb {
            let at = first + c * ROWS;
            let d = halves16(w.scales.as_ptr().add(at), next);
            let min = match F {
                Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
                Q5_0 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
                Q4_1 | Q5_1 => halves16(w.mins.as_ptr().add(at), next),
                Q8_0 => _mm512_mul_ps(d, _mm512_set1_ps(-128.0)),
                _ => _mm512_setzero_ps(),
            };
            let highs = match F {
                Q5_0 | Q5_1 => join(w.highs.as_ptr().add(at) as *const u8, 4 * next),
                _ => zero,
            };
            let p = w.quants.as_ptr().add(at * qb);
            prefetch_pair(p, ROWS * qb, next * qb);
            // The scales (and Q5's fifth bits) as far ahead, in blocks, as the quants.
            let ahead = at + PREFETCH / qb;
            for at in [ahead, ahead + next] {
                prefetch_at(w.scales.as_ptr().wrapping_add(at));
                if matches!(F, Q5_0 | Q5_1) {
                    prefetch_at(w.highs.as_ptr().wrapping_add(at));
                }
            }
            let xs: [*const i8; R] =
                std::array::from_fn(|j| x.quants.as_ptr().add((i0 + j) * x.cols + c * BLOCK));
            let mut sums = [zero; R];
            if F == Q8_0 {
                for v in 0..BLOCK / 4 {
                    let wv = join(p.add(32 * v), next * qb);
                    let a = _mm512_xor_si512(wv, _mm512_set1_epi8(i8::MIN));
                    for j in 0..R {
                        sums[j] = _mm512_dpbusd_epi32(sums[j], a, bcast(xs[j].add(4 * v)));
                    }
                }
            } else {
                for v in 0..BLOCK / 8 {
                    let (lo, hi) = nibbles::<F>(join(p.add(32 * v), next * qb), highs, v);
                    for j in 0..R {
                        let (xl, xh) = (bcast(xs[j].add(4 * v)), bcast(xs[j].add(16 + 4 * v)));
                        sums[j] = _mm512_dpbusd_epi32(sums[j], lo, xl);
                        sums[j] = _mm512_dpbusd_epi32(sums[j], hi, xh);
                    }
                }
            }
            for j in 0..R {
                let xb = (i0 + j) * nb + c;
                let dx = _mm512_set1_ps(*x.scales.get_unchecked(xb));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[j]), _mm512_mul_ps(d, dx), acc[j]);
                let sum = _mm512_set1_ps(*x.sums.get_unchecked(xb));
                acc[j] = _mm512_fmadd_ps(min, sum, acc[j]);
            }
        }
        store(&acc, g, w.rows, i0, y);
    }
}

/// The weights of unit `v` of a nibble format's block in two groups (`raw`, as [`join`]
/// reads them): `lo` the low nibbles (weights `4v..4v + 4` of each row), `hi` the high ones
/// (`16 + 4v..`), with Q5's fifth bits from `highs` (the two groups' `highs` of the block,
/// joined; ignored for Q4_0 and Q4_1), unsigned 0..15 or 0..31.
///
/// # Safety
/// AVX-512F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
pub(super) unsafe fn nibbles<const F: u8>(
    raw: __m512i,
    highs: __m512i,
    v: usize,
) -> (__m512i, __m512i) {
    let (low, fifth) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x10));
    let mut lo = _mm512_and_si512(raw, low);
    let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), low);
    if matches!(F, Q5_0 | Q5_1) {
        // Bits 8j + v and 8j + 4 + v to bit 4 of byte j (`x86::tile_in`).
        let up = _mm512_sll_epi32(highs, _mm_cvtsi32_si128(4 - v as i32));
        let down = _mm512_srl_epi32(highs, _mm_cvtsi32_si128(v as i32));
        lo = _mm512_or_si512(lo, _mm512_and_si512(up, fifth));
        hi = _mm512_or_si512(hi, _mm512_and_si512(down, fifth));
    }
    (lo, hi)
}

/// Asks for the `bytes` at `p` and at `p + next`, [`PREFETCH`] bytes ahead (`prefetcht0`):
/// a 16-row tile's two streams of quants, a block or superblock ahead of where it reads.
/// Past the weight's end too (the last tiles): a prefetch never faults.
#[inline(always)]
pub(super) fn prefetch_pair(p: *const u8, bytes: usize, next: usize) {
    for line in (0..bytes).step_by(64) {
        let ahead = p.wrapping_add(PREFETCH + line);
        prefetch_at(ahead);
        prefetch_at(ahead.wrapping_add(next));
    }
}

/// Asks for the `bytes` at `p`, [`PREFETCH`] bytes ahead: an 8-row tile's one stream of
/// quants, where it takes several rows of x (`x86/blocks.rs`, `q6k/x86.rs`, `q4k/x86.rs`).
#[inline(always)]
pub(super) fn prefetch_one(p: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        prefetch_at(p.wrapping_add(PREFETCH + line));
    }
}

/// Asks for the cache line at `p` (`prefetcht0`).
#[inline(always)]
pub(super) fn prefetch_at<T>(p: *const T) {
    // SAFETY: a prefetch reads nothing and never faults, wherever it points.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
}

/// Writes a 16-row tile's sums: `acc[j]` to row `i0 + j` of `y` (`n` columns), columns `8g..`:
/// 16, or the real rows of a padded last group.
///
/// # Safety
/// AVX-512F; `y` is valid for writes at `(i0 + j) · n + r` for j < R and `8g <= r < min(8g +
/// 16, n)`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn store<const R: usize>(
    acc: &[__m512; R],
    g: usize,
    n: usize,
    i0: usize,
    y: *mut f32,
) {
    let r0 = g * ROWS;
    let mask: __mmask16 = match n - r0 {
        k if k >= 2 * ROWS => 0xFFFF,
        k => (1u16 << k) - 1,
    };
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: the caller's.
        unsafe { _mm512_mask_storeu_ps(y.add((i0 + j) * n + r0), mask, *acc) };
    }
}

/// The 8 f16 at `p` and the 8 at `p + next`, as 16 f32.
///
/// # Safety
/// AVX-512F; 8 f16 at each.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(super) unsafe fn halves16(p: *const f16, next: usize) -> __m512 {
    // SAFETY: the caller's.
    unsafe {
        let (a, b) = (
            _mm_loadu_si128(p as *const __m128i),
            _mm_loadu_si128(p.add(next) as *const __m128i),
        );
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
    }
}

/// 32 bytes at `p` and 32 at `p + next`, as one register.
///
/// # Safety
/// AVX-512F; 32 bytes at each.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
pub(super) unsafe fn join(p: *const u8, next: usize) -> __m512i {
    // SAFETY: the caller's.
    unsafe {
        let a = _mm256_loadu_si256(p as *const __m256i);
        let b = _mm256_loadu_si256(p.add(next) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
    }
}

/// 4 bytes at `p`, in every 32-bit lane.
///
/// # Safety
/// AVX-512F; 4 bytes at `p`.
#[target_feature(enable = "avx512f")]
#[inline]
pub(super) unsafe fn bcast(p: *const i8) -> __m512i {
    // SAFETY: the caller's.
    _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}
