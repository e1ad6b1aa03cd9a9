//! The packed layout's kernel ([`super`]) on AVX2, AVX-512 VNNI (`avx512`'s 16-row tile too)
//! and AVX-VNNI: per group of 8 weight rows and block of 32 columns, the integer sums of the
//! 8 rows are one vector, for `RX` rows of x at once (`RX_SUB16_VNNI` in the AVX-512 VNNI tile
//! of the K-quants with 16-weight sub-blocks).
//!
//! The 32-weight formats' tile of one group is `blocks`'. The K-quants' tiles are `q4k`'s (Q4_K
//! and Q5_K) and `q6k`'s (Q6_K, Q3_K, Q2_K). Each comes in three forms ([`MADD`], [`EVEX`],
//! [`VEX`]) from one body; with AVX-512 VNNI every format has a 16-row tile of two groups in
//! 512-bit registers too (`avx512.rs`, `q4k/avx512.rs`, `q6k/avx512.rs`).

use super::super::{Format, QRows, QWeight};
use super::ROWS;
use std::arch::x86_64::*;

/// A tile's three forms from one body: `tile` with AVX2's instructions, `tile_vnni` with
/// AVX-512 VNNI's (Zen 4 and 5, Ice Lake and later) and `tile_avx_vnni` with AVX-VNNI's
/// (Alder Lake and later, Zen 5), each `$body::<.., V>` ([`MADD`], [`EVEX`], [`VEX`])
/// inlined into it. The body is `#[inline(always)]` with no target features of its own, so
/// its intrinsics are compiled with each wrapper's; it says what its VNNI forms do.
macro_rules! three_forms {
    ($vis:vis $body:ident<$(const $g:ident: $t:ty),*>) => {
        /// The tile with AVX2's instructions (what it does: its body's doc).
        ///
        /// # Safety
        /// As `x86::rows` for its group (a pair's: both) and the rows of x from `i0` it
        /// takes; the CPU has AVX2, FMA and F16C.
        #[target_feature(enable = "avx2,fma,f16c")]
        $vis unsafe fn tile<$(const $g: $t),*>(
            w: &QWeight,
            g: usize,
            x: &QRows,
            i0: usize,
            y: *mut f32,
        ) {
            // SAFETY: the caller's.
            unsafe { $body::<$($g,)* { $crate::model::linear::quant::packed::x86::MADD }>(
                w, g, x, i0, y,
            ) }
        }

        /// [`tile`] with AVX-512 VNNI's `vpdpbusd`.
        ///
        /// # Safety
        /// As [`tile`], and the CPU has AVX-512F, VL and VNNI (`quant::vnni`).
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
        $vis unsafe fn tile_vnni<$(const $g: $t),*>(
            w: &QWeight,
            g: usize,
            x: &QRows,
            i0: usize,
            y: *mut f32,
        ) {
            // SAFETY: the caller's.
            unsafe { $body::<$($g,)* { $crate::model::linear::quant::packed::x86::EVEX }>(
                w, g, x, i0, y,
            ) }
        }

        /// [`tile`] with AVX-VNNI's `vpdpbusd`.
        ///
        /// # Safety
        /// As [`tile`], and the CPU has AVX-VNNI (`simd::avx_vnni`).
        #[target_feature(enable = "avx2,fma,f16c,avxvnni")]
        $vis unsafe fn tile_avx_vnni<$(const $g: $t),*>(
            w: &QWeight,
            g: usize,
            x: &QRows,
            i0: usize,
            y: *mut f32,
        ) {
            // SAFETY: the caller's.
            unsafe { $body::<$($g,)* { $crate::model::linear::quant::packed::x86::VEX }>(
                w, g, x, i0, y,
            ) }
        }
    };
}

/// How a 256-bit tile multiplies bytes (its body's `V`): AVX2's `maddubs` + `madd`, or one
/// `vpdpbusd` in AVX-512 VNNI's encoding (EVEX) or AVX-VNNI's (VEX).
pub(super) const MADD: u8 = 0;
pub(super) const EVEX: u8 = 1;
pub(super) const VEX: u8 = 2;

/// `acc + a · b` by `vpdpbusd` (unsigned bytes of a times signed bytes of b, summed by four
/// into each 32-bit lane) in the encoding `V` names.
///
/// # Safety
/// The CPU has AVX-512 VNNI and VL where `V` is [`EVEX`], AVX-VNNI where [`VEX`]. Inlined
/// into a tile of that form, it is one instruction.
#[inline(always)]
pub(super) unsafe fn dpbusd<const V: u8>(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    // SAFETY: the caller's.
    unsafe {
        match V {
            EVEX => _mm256_dpbusd_epi32(acc, a, b),
            VEX => _mm256_dpbusd_avx_epi32(acc, a, b),
            _ => unreachable!("AVX2's tiles multiply bytes by maddubs"),
        }
    }
}

/// The form [`rows`] takes on this CPU: [`EVEX`] with AVX-512 VNNI, [`VEX`] with AVX-VNNI
/// at the AVX2 level ([`crate::model::linear::simd::avx_vnni`]), else [`MADD`].
pub(super) fn form() -> u8 {
    match (super::super::vnni(), crate::model::linear::simd::avx_vnni()) {
        (true, _) => EVEX,
        (_, true) => VEX,
        _ => MADD,
    }
}

pub(super) const Q8_0: u8 = 0;
pub(super) const Q4_0: u8 = 1;
pub(super) const Q4_1: u8 = 2;
pub(super) const Q5_0: u8 = 3;
pub(super) const Q5_1: u8 = 4;

/// Rows of x a tile takes at once.
const RX: usize = 4;

/// Rows of x the AVX-512 VNNI tile of Q6_K, Q3_K and Q2_K (`q6k`'s) takes at once: its
/// weights' unpacking (Q6_K's three loads, six shifts and masks a chunk) serves twice the rows,
/// in the 32 vector registers AVX-512 gives the 256-bit code. Zen 4 (2 threads, alternating
/// runs, tok/s, 4 rows / 8): the 1.7B shape's Q6_K file prefills 512 tokens at 91-101 /
/// 102-110 (two A/Bs), SmolLM2's 825-1023 / 1050-1052; its Q2_K file at 98-99 / 107-108, its
/// Q3_K_M file at 103-111 / 111-123. Q4_K and Q5_K lost with 8 (the 1.7B shape's Q5_K_M file
/// at 64 tokens: 117-120 / 107-112), and AVX2's and AVX-VNNI's 16 registers keep 4.
const RX_SUB16_VNNI: usize = 8;

/// Rows of x the 16-row tiles take at once, where x has that many; [`RX`] of what is left go
/// through the same tile of 4 rows. The 32-weight formats' (`avx512`'s) weight loads and
/// nibble masks of a block then serve 8 rows, in 16 accumulators of the 32 registers.
/// SmolLM2-135M, Zen 5, 2 threads, alternating rounds, medians, tok/s, 4 rows / 8:
/// `bench --batch 8` decode, Q4_0 file 1138 / 1252 (5 rounds), Q8_0 879 / 1045 (4), Q5_0 1063
/// / 1199 (3); a 512-token Q4_0 prompt 1918 / 1981 (4). Q4_K's and Q5_K's tiles
/// (`q4k/avx512.rs`) keep 40 sums for 8 rows, some of them on the stack, and are as fast as
/// with 4 on prompts and faster on batches: the 1.7B shape's Q4_K_M file (Zen 5, 2
/// alternating rounds), 8 sequences decoded at 129-135 tok/s against 122-123 with 4, a
/// 512-token prompt 258-268 either way.
const RX_PAIR: usize = 8;

/// A tile: group `g` of 8 weight rows (a pair's tile: `g` and `g + 1`) against rows `i0..`
/// of x (as many as the tile takes), written to `y`. Called through a pointer, once per
/// group (or pair) and its rows of x: the call is nothing beside a tile's work, and each tile
/// is compiled for its own instruction set.
pub(super) type Tile = unsafe fn(w: &QWeight, g: usize, x: &QRows, i0: usize, y: *mut f32);

/// AMX's tiles of a pair of groups: as a [`Tile`], over as many whole tiles of 16 rows of x
/// from `i0` as there are; returns the rows it took.
pub(super) type AmxTiles =
    unsafe fn(w: &QWeight, g: usize, x: &QRows, i0: usize, y: *mut f32) -> usize;

/// Groups `g0..g1` of 8 weight rows of `y (M, w.rows) = x · wᵀ`, every row of x, by the
/// tiles of the best form this CPU runs ([`EVEX`] on AVX-512 CPUs with VNNI, with the 16-row
/// tiles; [`VEX`] with AVX-VNNI; else [`MADD`]).
///
/// # Safety
/// AVX2, FMA and F16C; `w` is packed and its blocks match its shape (`QWeight::product`
/// checks it); `g0 <= g1 <=` its groups; `x` holds M rows of `w`'s width; `y` is valid for
/// writes at `i · w.rows + r` for i < M and `8 · g0 <= r < min(8 · g1, w.rows)`, which
/// nothing else touches meanwhile.
pub unsafe fn rows(w: &QWeight, groups: (usize, usize), x: &QRows, y: *mut f32) {
    let dot = form();
    let amx = dot == EVEX && crate::model::linear::simd::amx();
    // SAFETY: the caller's; `tiles` chose for this CPU.
    unsafe { rows_with(&tiles(w.format, dot, dot == EVEX, amx), w, groups, x, y) }
}

/// A format's tiles: for `rows` rows of x and for one, of a group of 8 rows, and where the
/// CPU has them of two adjacent groups at once ([`super::avx512`]).
pub(super) struct Tiles {
    /// A group against `rows` rows of x.
    rx: Tile,
    /// Rows of x that `rx` takes: [`RX`], or [`RX_SUB16_VNNI`].
    rows: usize,
    /// A group against one row of x.
    one: Tile,
    /// A group against [`RX`] rows of x where `rows` is larger: 4 of the rows the `rows`-row
    /// tiles leave (Q6_K's, Q3_K's and Q2_K's 8-row tiles leave up to 7) go through it, not
    /// through `one` four times, which would read the weights four times.
    mid: Option<Tile>,
    /// Two adjacent groups against [`RX_PAIR`] rows, against `RX` and against one, where the
    /// CPU has AVX-512 VNNI (the 32-weight formats' and the K-quants'), else none.
    pair: Option<(Tile, Tile, Tile)>,
    /// Two adjacent groups against rows of x in whole tiles of [`super::amx::RX`] by AMX's
    /// tile products, where the CPU has them (the 32-weight formats'), else none; the rows
    /// it leaves take `pair`'s tiles.
    amx: Option<AmxTiles>,
    /// Whether one row of x (a decode step) takes `pair`'s tiles too, not the 8-row ones:
    /// where the CPU has AMX, whose cores (Intel's server cores) run the 512-bit tile faster
    /// there, as decode is bound by the arithmetic, not by the memory. A Sapphire Rapids-class
    /// Xeon VM, 2 threads, SmolLM2-135M's files, `bench` decode, tok/s, 8-row tiles / pairs
    /// (alternating runs): Q4_0 156 / 222-234, Q8_0 126-131 / 139-151, Q4_1 122-150 /
    /// 197-213, Q5_0 134-141 / 191-206, Q4_K_M 122-141 / 194-202, Q6_K 125-127 / 136-145. On
    /// Zen 5 the 8-row tiles read faster (`rows_with`), and stay.
    pairs_at_one: bool,
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
    let amx = tiles.amx.filter(|_| m >= super::amx::RX);
    // SAFETY: `tiles` has an AMX tile only where the CPU runs it (the caller's).
    let _config = amx.map(|_| unsafe { super::amx::Config::load() });
    // Pairs only for `RX` rows of x and more (but `pairs_at_one`): at one row (decode) the
    // 8-row tiles read the weights faster (Zen 5, 4 matrices of 8192 x 2048 taken in turn, `probe_packed_decode`:
    // Q4_0 36 against 57 GB/s, Q8_0 42 against 49; the 1.7B shape's Q4_0 file decoded at
    // 33 against 40 tok/s), the one stream a thread reads instead of two.
    let mut g = g0;
    while g < g1 {
        let (rx, one, step, rows, mid) = match tiles.pair {
            Some((rx, mid, one)) if g + 1 < g1 && m >= RX_PAIR => (rx, one, 2, RX_PAIR, Some(mid)),
            Some((_, rx, one)) if g + 1 < g1 && (m >= RX || tiles.pairs_at_one) => {
                (rx, one, 2, RX, None)
            }
            _ => (tiles.rx, tiles.one, 1, tiles.rows, tiles.mid),
        };
        let mut i = 0;
        if let Some(amx) = amx.filter(|_| step == 2) {
            // SAFETY: as below, for rows i.. of x; the tiles are configured.
            i += unsafe { amx(w, g, x, i, y) };
        }
        while i + rows <= m {
            // SAFETY: the caller's; rows i..i + rows of x exist; groups g..g + step are the
            // caller's.
            unsafe { rx(w, g, x, i, y) };
            i += rows;
        }
        if let Some(mid) = mid.filter(|_| i + RX <= m) {
            // SAFETY: as above, for rows i..i + RX.
            unsafe { mid(w, g, x, i, y) };
            i += RX;
        }
        for i in i..m {
            // SAFETY: as above, for row i.
            unsafe { one(w, g, x, i, y) };
        }
        g += step;
    }
}

/// The tiles for `format` in form `dot` ([`MADD`], [`EVEX`] or [`VEX`]), the 16-row ones
/// where `pairs` (with [`EVEX`] only), and where `amx` too AMX's (the 32-weight formats) and
/// the 16-row ones for one row of x ([`Tiles::pairs_at_one`]).
pub(super) fn tiles(format: Format, dot: u8, pairs: bool, amx: bool) -> Tiles {
    use super::q4k::x86 as q4k;
    use super::q6k::x86::{Q2, Q3, Q6};
    match format {
        Format::Q6K => return sub16::<Q6>(dot, pairs, amx),
        Format::Q3K => return sub16::<Q3>(dot, pairs, amx),
        Format::Q2K => return sub16::<Q2>(dot, pairs, amx),
        _ => {}
    }
    let (rx, one): (Tile, Tile) = match (format, dot) {
        (Format::Q4K, EVEX) => (q4k::tile_vnni::<RX, false>, q4k::tile_vnni::<1, false>),
        (Format::Q4K, VEX) => (
            q4k::tile_avx_vnni::<RX, false>,
            q4k::tile_avx_vnni::<1, false>,
        ),
        (Format::Q4K, _) => (q4k::tile::<RX, false>, q4k::tile::<1, false>),
        (Format::Q5K, EVEX) => (q4k::tile_vnni::<RX, true>, q4k::tile_vnni::<1, true>),
        (Format::Q5K, VEX) => (
            q4k::tile_avx_vnni::<RX, true>,
            q4k::tile_avx_vnni::<1, true>,
        ),
        (Format::Q5K, _) => (q4k::tile::<RX, true>, q4k::tile::<1, true>),
        (Format::Q2K | Format::Q3K | Format::Q6K, _) => unreachable!("taken by sub16 above"),
        (Format::Q8_0, _) => pick::<Q8_0>(dot),
        (Format::Q4_0, _) => pick::<Q4_0>(dot),
        (Format::Q4_1, _) => pick::<Q4_1>(dot),
        (Format::Q5_0, _) => pick::<Q5_0>(dot),
        (Format::Q5_1, _) => pick::<Q5_1>(dot),
    };
    let pair = match format {
        _ if !(dot == EVEX && pairs) => None,
        Format::Q4K => Some(q4k_pair::<false>()),
        Format::Q5K => Some(q4k_pair::<true>()),
        Format::Q8_0 => Some(pair::<Q8_0>()),
        Format::Q4_0 => Some(pair::<Q4_0>()),
        Format::Q4_1 => Some(pair::<Q4_1>()),
        Format::Q5_0 => Some(pair::<Q5_0>()),
        Format::Q5_1 => Some(pair::<Q5_1>()),
        _ => None,
    };
    use super::amx::tiles as amx_tiles;
    let amx_tiles = match format {
        _ if !(pair.is_some() && amx) => None,
        Format::Q8_0 => Some(amx_tiles::<Q8_0> as AmxTiles),
        Format::Q4_0 => Some(amx_tiles::<Q4_0> as AmxTiles),
        Format::Q4_1 => Some(amx_tiles::<Q4_1> as AmxTiles),
        Format::Q5_0 => Some(amx_tiles::<Q5_0> as AmxTiles),
        Format::Q5_1 => Some(amx_tiles::<Q5_1> as AmxTiles),
        _ => None,
    };
    Tiles {
        rx,
        rows: RX,
        one,
        mid: None,
        pairs_at_one: pair.is_some() && amx,
        pair,
        amx: amx_tiles,
    }
}

/// The tiles of a K-quant with 16-weight sub-blocks (`q6k`'s, `BITS` names which) in form
/// `dot`: of [`RX_SUB16_VNNI`] rows with AVX-512 VNNI, else of [`RX`]; with AVX-512 VNNI and
/// `pairs`, its 16-row tiles too (`q6k/avx512.rs`).
fn sub16<const BITS: u8>(dot: u8, pairs: bool, amx: bool) -> Tiles {
    use super::q6k::{avx512, x86 as q6k};
    let (rx, rows, one, mid): (Tile, usize, Tile, Option<Tile>) = match dot {
        EVEX => (
            q6k::tile_vnni::<RX_SUB16_VNNI, BITS>,
            RX_SUB16_VNNI,
            q6k::tile_vnni::<1, BITS>,
            Some(q6k::tile_vnni::<RX, BITS>),
        ),
        VEX => (
            q6k::tile_avx_vnni::<RX, BITS>,
            RX,
            q6k::tile_avx_vnni::<1, BITS>,
            None,
        ),
        _ => (q6k::tile::<RX, BITS>, RX, q6k::tile::<1, BITS>, None),
    };
    let pair = (dot == EVEX && pairs).then_some((
        avx512::tile::<RX_PAIR, BITS> as Tile,
        avx512::tile::<RX, BITS> as Tile,
        avx512::tile::<1, BITS> as Tile,
    ));
    Tiles {
        rx,
        rows,
        one,
        mid,
        pairs_at_one: pair.is_some() && amx,
        pair,
        amx: None,
    }
}

/// A 32-weight format's 16-row tiles.
fn pair<const F: u8>() -> (Tile, Tile, Tile) {
    (
        super::avx512::tile::<F, RX_PAIR>,
        super::avx512::tile::<F, RX>,
        super::avx512::tile::<F, 1>,
    )
}

/// Q4_K's 16-row tiles (Q5_K's with `FIFTH`).
fn q4k_pair<const FIFTH: bool>() -> (Tile, Tile, Tile) {
    use super::q4k::avx512::tile;
    (tile::<RX_PAIR, FIFTH>, tile::<RX, FIFTH>, tile::<1, FIFTH>)
}

/// A 32-weight format's tiles in form `dot`.
fn pick<const F: u8>(dot: u8) -> (Tile, Tile) {
    match dot {
        EVEX => (blocks::tile_vnni::<F, RX>, blocks::tile_vnni::<F, 1>),
        VEX => (
            blocks::tile_avx_vnni::<F, RX>,
            blocks::tile_avx_vnni::<F, 1>,
        ),
        _ => (blocks::tile::<F, RX>, blocks::tile::<F, 1>),
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

mod blocks;
