//! The packed layout's kernel ([`super`]) on AVX2, and with AVX-512 VNNI ([`tile_vnni`], and
//! `avx512`'s 16-row tile): per group of 8 weight rows and block of 32 columns, the integer
//! sums of the 8 rows are one vector, for `RX` rows of x at once.
//!
//! Nibbles: each 32-byte load is 4 quant bytes of each of the 8 rows; its low nibbles
//! (weights `4v..4v + 4`) and high nibbles (`16 + 4v..`) go through `maddubs` against x's
//! matching 4 bytes, broadcast to every lane, and the block's 8 products add up in 16 bits
//! (at most 8 · 2 · 15 · 127 = 30,480), then pairs to 32 bits once per block; Q5's fifth
//! bits are put at bit 4 of each byte first (one shift and one mask per load, from their
//! rearranged word), and its sums go to 32 bits every second load. Q8_0: the
//! weights are signed, so `maddubs` takes |w| and sign(w)·x (llama.cpp's sign trick), and
//! its 16-bit pairs (up to 2 · 128 · 127) go to 32 bits after each load.
//! Then one FMA by the 8 rows' `d` times `dx`, and one by their minimum (Q4_0's `-8d`,
//! Q5_0's `-16d`, Q4_1's and Q5_1's `m`) times x's block sum `dx · Σq`.
//! (The K-quants' tiles are `q4k` and `q6k`'s, AVX2's on every x86 CPU.)

use super::super::{Format, QRows, QWeight, BLOCK};
use super::ROWS;
use std::arch::x86_64::*;

pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_0: u8 = 1;
pub(super) const Q4_1: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q5_1: u8 = 4;

/// Rows of x a tile takes at once.
const RX: usize = 4;

/// A tile: group `g` of 8 weight rows (a pair's tile: `g` and `g + 1`) against rows `i0..`
/// of x (as many as the tile takes), written to `y`. Called through a pointer, once per
/// group (or pair) and 4 rows of x: the call is nothing beside a tile's work, and each tile
/// is compiled for its own instruction set.
pub(super) type Tile = unsafe fn(w: &QWeight, g: usize, x: &QRows, i0: usize, y: *mut f32);

/// Groups `g0..g1` of 8 weight rows of `y (M, w.rows) = x · wᵀ`, every row of x: on
/// AVX-512 CPUs with VNNI the 32-weight formats' tiles are [`tile_vnni`]'s.
///
/// # Safety
/// AVX2, FMA and F16C; `w` is packed and its blocks match its shape (`QWeight::product`
/// checks it); `g0 <= g1 <=` its groups; `x` holds M rows of `w`'s width; `y` is valid for
/// writes at `i · w.rows + r` for i < M and `8 · g0 <= r < min(8 · g1, w.rows)`, which
/// nothing else touches meanwhile.
pub unsafe fn rows(w: &QWeight, groups: (usize, usize), x: &QRows, y: *mut f32) {
    let vnni = super::super::vnni();
    // SAFETY: the caller's; `tiles` chose for this CPU.
    unsafe { rows_with(&tiles(w.format, vnni, vnni), w, groups, x, y) }
}

/// A format's tiles: for `RX` rows of x and for one, of a group of 8 rows, and where the
/// CPU has them of two adjacent groups at once ([`super::avx512`]).
pub(super) struct Tiles {
    /// A group against `RX` rows of x.
    rx: Tile,
    /// A group against one row of x.
    one: Tile,
    /// Two adjacent groups against `RX` rows and against one: the 32-weight formats' where
    /// the CPU has AVX-512 VNNI, else none.
    pair: Option<(Tile, Tile)>,
}

/// [`rows`] with the tiles given (the tests run each set the CPU has).
///
/// # Safety
/// As [`rows`], and the CPU runs the tiles.
pub(super) unsafe fn rows_with(
    tiles: &Tiles,
    w: &QWeight,
    (g0, g1): (usize, usize),
    x: &QRows,
    y: *mut f32,
) {
    debug_assert!(w.packed && x.cols == w.cols);
    let m = x.quants.len() / w.cols;
    let mut g = g0;
    while g < g1 {
        let (rx, one, step) = match tiles.pair {
            Some((rx, one)) if g + 1 < g1 => (rx, one, 2),
            _ => (tiles.rx, tiles.one, 1),
        };
        let mut i = 0;
        while i + RX <= m {
            // SAFETY: the caller's; rows i..i + RX of x exist; groups g..g + step are the
            // caller's.
            unsafe { rx(w, g, x, i, y) };
            i += RX;
        }
        for i in i..m {
            // SAFETY: as above, for row i.
            unsafe { one(w, g, x, i, y) };
        }
        g += step;
    }
}

/// The tiles for `format`: with VNNI's for the 32-weight formats where `vnni`, and their
/// 16-row ones where `pairs` too.
pub(super) fn tiles(format: Format, vnni: bool, pairs: bool) -> Tiles {
    let (rx, one): (Tile, Tile) = match format {
        Format::Q4K => (super::q4k::x86::tile::<RX>, super::q4k::x86::tile::<1>),
        Format::Q6K => (super::q6k::x86::tile::<RX>, super::q6k::x86::tile::<1>),
        Format::Q8_0 => pick::<Q8_0>(vnni),
        Format::Q4_0 => pick::<Q4_0>(vnni),
        Format::Q4_1 => pick::<Q4_1>(vnni),
        Format::Q5_0 => pick::<Q5_0>(vnni),
        Format::Q5_1 => pick::<Q5_1>(vnni),
        _ => unreachable!("{format:?} is never packed"),
    };
    let pair = match format {
        _ if !(vnni && pairs) => None,
        Format::Q8_0 => Some(pair::<Q8_0>()),
        Format::Q4_0 => Some(pair::<Q4_0>()),
        Format::Q4_1 => Some(pair::<Q4_1>()),
        Format::Q5_0 => Some(pair::<Q5_0>()),
        Format::Q5_1 => Some(pair::<Q5_1>()),
        _ => None,
    };
    Tiles { rx, one, pair }
}

/// A 32-weight format's 16-row tiles.
fn pair<const F: u8>() -> (Tile, Tile) {
    (super::avx512::tile::<F, RX>, super::avx512::tile::<F, 1>)
}

/// A 32-weight format's tiles: VNNI's or AVX2's.
fn pick<const F: u8>(vnni: bool) -> (Tile, Tile) {
    match vnni {
        true => (tile_vnni::<F, RX>, tile_vnni::<F, 1>),
        false => (tile::<F, RX>, tile::<F, 1>),
    }
}

/// Group `g` against rows `i0..i0 + R` of x, written to `y`, with AVX2's instructions.
///
/// # Safety
/// As [`rows`], for group `g` and rows `i0..i0 + R` of x.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const F: u8, const R: usize>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe { tile_in::<F, R, false>(w, g, x, i0, y) }
}

/// [`tile`] on CPUs with AVX-512 VNNI (Zen 4 and 5, Ice Lake and later): each 4-byte
/// product and its sums fused into one `vpdpbusd` (unsigned quants times x's signed bytes,
/// summed by four into the 8 rows' 32-bit lanes), so the nibble formats need no 16-bit
/// stage (nor Q5's flush every second load) and Q8_0's sign trick ends in one instruction
/// instead of `maddubs` + `madd` + add. It takes a group alone (an odd one out of the pairs
/// `avx512`'s tile takes). VEX-encoded AVX-VNNI (Alder Lake) would run the same body; not
/// wired yet.
///
/// # Safety
/// As [`tile`], and the CPU has AVX-512F, VL and VNNI (`quant::vnni`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn tile_vnni<const F: u8, const R: usize>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    // SAFETY: the caller's.
    unsafe { tile_in::<F, R, true>(w, g, x, i0, y) }
}

/// The body of [`tile`] (`V` false) and [`tile_vnni`] (`V` true), inlined into each: on its
/// own it has no target features, and its intrinsics are compiled with the caller's.
///
/// # Safety
/// As [`tile`], and [`tile_vnni`]'s where `V`.
// The tile's loops index the accumulators and x's rows together.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
unsafe fn tile_in<const F: u8, const R: usize, const V: bool>(
    w: &QWeight,
    g: usize,
    x: &QRows,
    i0: usize,
    y: *mut f32,
) {
    let (nb, qb) = (w.cols / BLOCK, w.format.quant_bytes());
    let first = g * nb * ROWS;
    // SAFETY (every load below): group g's blocks hold nb · 8 scales (and minimums) from
    // `first` and nb · 8 · qb quant bytes from `first · qb`; x's rows i0..i0 + R hold nb
    // blocks each.
    let (quants, scales) = unsafe {
        (
            w.quants.as_ptr().add(first * qb),
            w.scales.as_ptr().add(first),
        )
    };
    // SAFETY (every intrinsic below): the caller's CPU runs AVX2, FMA and F16C, and
    // AVX-512 VNNI where V.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let (low, fifth) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x10));
        let mut acc = [_mm256_setzero_ps(); R];
        for c in 0..nb {
            let d = half8(scales.add(c * ROWS));
            let min = match F {
                Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
                // Q4_1 and Q5_1 keep a minimum per scale.
                Q4_1 | Q5_1 => half8(w.mins.as_ptr().add(first + c * ROWS)),
                _ => _mm256_setzero_ps(),
            };
            // Q5's fifth bits of the 8 rows, one lane each (`spread`): a word per scale.
            let highs = match F {
                Q5_0 | Q5_1 => {
                    _mm256_loadu_si256(w.highs.as_ptr().add(first + c * ROWS) as *const __m256i)
                }
                _ => _mm256_setzero_si256(),
            };
            let p = quants.add(c * ROWS * qb);
            let xs = x_rows::<R>(x, i0, c * BLOCK);
            let mut sums = [_mm256_setzero_si256(); R];
            if F == Q8_0 {
                // The block's 8 · 32 bytes; x's 4 bytes at 4v < 32.
                for v in 0..BLOCK / 4 {
                    let wv = _mm256_loadu_si256(p.add(32 * v) as *const __m256i);
                    let a = _mm256_sign_epi8(wv, wv);
                    for j in 0..R {
                        let s = _mm256_sign_epi8(bcast(xs[j].add(4 * v)), wv);
                        sums[j] = match V {
                            true => _mm256_dpbusd_epi32(sums[j], a, s),
                            false => {
                                let pairs = _mm256_maddubs_epi16(a, s);
                                _mm256_add_epi32(sums[j], _mm256_madd_epi16(pairs, ones))
                            }
                        };
                    }
                }
            } else {
                let mut s16 = [_mm256_setzero_si256(); R];
                // The block's 8 · 16 bytes; x's 4 bytes at 4v and 16 + 4v < 32.
                for v in 0..BLOCK / 8 {
                    let raw = _mm256_loadu_si256(p.add(32 * v) as *const __m256i);
                    let mut lo = _mm256_and_si256(raw, low);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    if matches!(F, Q5_0 | Q5_1) {
                        // Bits 8j + v and 8j + 4 + v to bit 4 of byte j.
                        let up = _mm256_sll_epi32(highs, _mm_cvtsi32_si128(4 - v as i32));
                        let down = _mm256_srl_epi32(highs, _mm_cvtsi32_si128(v as i32));
                        lo = _mm256_or_si256(lo, _mm256_and_si256(up, fifth));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(down, fifth));
                    }
                    for j in 0..R {
                        let (xl, xh) = (bcast(xs[j].add(4 * v)), bcast(xs[j].add(16 + 4 * v)));
                        if V {
                            sums[j] = _mm256_dpbusd_epi32(sums[j], lo, xl);
                            sums[j] = _mm256_dpbusd_epi32(sums[j], hi, xh);
                        } else {
                            let both = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, xl),
                                _mm256_maddubs_epi16(hi, xh),
                            );
                            s16[j] = _mm256_add_epi16(s16[j], both);
                        }
                    }
                    // AVX2, 5-bit quants: two loads' products at most in 16 bits
                    // (2 · 4 · 31 · 127).
                    if !V && matches!(F, Q5_0 | Q5_1) && v % 2 == 1 {
                        for j in 0..R {
                            let pairs = _mm256_madd_epi16(s16[j], ones);
                            sums[j] = _mm256_add_epi32(sums[j], pairs);
                            s16[j] = _mm256_setzero_si256();
                        }
                    }
                }
                if !V && !matches!(F, Q5_0 | Q5_1) {
                    for j in 0..R {
                        sums[j] = _mm256_madd_epi16(s16[j], ones);
                    }
                }
            }
            for j in 0..R {
                // Block (i0 + j) · nb + c of x exists.
                let xb = (i0 + j) * nb + c;
                let dx = _mm256_broadcast_ss(x.scales.get_unchecked(xb));
                let sum = _mm256_broadcast_ss(x.sums.get_unchecked(xb));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(d, dx), acc[j]);
                if F != Q8_0 {
                    acc[j] = _mm256_fmadd_ps(min, sum, acc[j]);
                }
            }
        }
        // The caller's.
        store(&acc, g, w.rows, i0, y);
    }
}

/// Writes a tile's sums: `acc[j]` to row `i0 + j` of `y` (`n` columns), columns `8g..` of
/// the group's real rows.
///
/// # Safety
/// AVX2; `y` is valid for writes at `(i0 + j) · n + r` for j < R and `8g <= r < min(8g + 8,
/// n)`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn store<const R: usize>(
    acc: &[__m256; R],
    g: usize,
    n: usize,
    i0: usize,
    y: *mut f32,
) {
    let r0 = g * ROWS;
    for (j, acc) in acc.iter().enumerate() {
        // SAFETY: row i0 + j of y, columns r0.. of this group (the caller's).
        let out = unsafe { y.add((i0 + j) * n + r0) };
        match r0 + ROWS <= n {
            // SAFETY: 8 columns of this group.
            true => unsafe { _mm256_storeu_ps(out, *acc) },
            false => {
                let mut lanes = [0f32; ROWS];
                // SAFETY: 8 floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
                for (k, &v) in lanes.iter().enumerate().take(n - r0) {
                    // SAFETY: column r0 + k < n, this group's.
                    unsafe { *out.add(k) = v };
                }
            }
        }
    }
}

/// Where rows `i0..i0 + R` of x are at column `at` (the tile reads them from there on).
pub(super) fn x_rows<const R: usize>(x: &QRows, i0: usize, at: usize) -> [*const u8; R] {
    // Addresses only (wrapping: nothing is read here); the tiles' loads stay within the rows
    // their callers vouch for.
    std::array::from_fn(|j| x.quants.as_ptr().wrapping_add((i0 + j) * x.cols + at) as *const u8)
}

/// 4 bytes at `p`, in every 32-bit lane. Functions, not closures: a closure is compiled
/// without its caller's target features, and its vectors would go through memory.
///
/// # Safety
/// AVX2; 4 bytes at `p`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn bcast(p: *const u8) -> __m256i {
    // SAFETY: the caller's.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// 8 f16 at `p` as f32.
///
/// # Safety
/// AVX2 and F16C; 8 f16 at `p`.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn half8(p: *const half::f16) -> __m256 {
    // SAFETY: the caller's.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
}
