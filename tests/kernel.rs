//! The matrix-vector kernel behind `model::linear::Linear`: every instruction set against an
//! f64 reference, the candle op against candle's matmul on ragged shapes, the fallbacks, and
//! (ignored, run with `--release -- --ignored --nocapture`) a bandwidth and overhead probe.

mod common;

use candle_core::{DType, Device, Module, Tensor};
use common::values;
use tiny_decoder::model::linear::prefill::{self, Weights};
use tiny_decoder::model::linear::simd::{self, Isa, IsaError, IsaKind};
use tiny_decoder::model::linear::{matvec, route, Linear, Route};

/// Sets to test on this CPU: every one it supports, scalar included.
fn isas() -> Vec<Isa> {
    let isas = Isa::supported();
    assert_eq!(isas.first(), Some(&Isa::SCALAR));
    isas
}

/// Whether this CPU runs the instructions of `kind`, asked directly of the CPU.
fn cpu_has(kind: IsaKind) -> bool {
    #[cfg(target_arch = "x86_64")]
    let (avx2, avx512) = (
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl"),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (avx2, avx512) = (false, false);
    #[cfg(target_arch = "aarch64")]
    let neon = std::arch::is_aarch64_feature_detected!("neon");
    #[cfg(not(target_arch = "aarch64"))]
    let neon = false;
    match kind {
        IsaKind::Avx512 => avx512,
        IsaKind::Avx2 => avx2,
        IsaKind::Neon => neon,
        IsaKind::Scalar => true,
    }
}

const KINDS: [IsaKind; 4] = [
    IsaKind::Scalar,
    IsaKind::Neon,
    IsaKind::Avx2,
    IsaKind::Avx512,
];

#[test]
fn safe_code_cannot_make_an_isa_this_cpu_lacks() {
    // The safe `rows_f32(isa, ..)` runs `isa`'s instructions, so an `Isa` is made only for a
    // set the CPU has (its field is private: `Isa(IsaKind::Avx512)` does not compile, see
    // the compile_fail doctest on `Isa`).
    for kind in KINDS {
        let isa = Isa::new(kind);
        assert_eq!(isa.is_some(), cpu_has(kind), "Isa::new({kind:?})");
        assert!(isa.is_none_or(|isa| isa.kind() == kind));
    }
    let best = KINDS.into_iter().filter(|&k| cpu_has(k)).max();
    assert_eq!(Some(Isa::detect().kind()), best);
    assert!(Isa::current().kind() <= Isa::detect().kind());
}

#[test]
fn isa_names_are_checked_against_the_cpu() {
    for (name, kind) in [
        ("avx512", IsaKind::Avx512),
        ("AVX2", IsaKind::Avx2),
        ("neon", IsaKind::Neon),
    ] {
        match Isa::from_name(name) {
            Ok(isa) => assert!(cpu_has(kind) && isa.kind() == kind, "{name}"),
            Err(e) => {
                assert!(!cpu_has(kind), "{name}: {e}");
                assert_eq!(e, IsaError::Unsupported(name.into()));
            }
        }
    }
    assert_eq!(Isa::from_name("scalar"), Ok(Isa::SCALAR));
    let e = Isa::from_name("sse9").unwrap_err();
    assert_eq!(
        e.to_string(),
        "TINY_DECODER_ISA=\"sse9\" is not one of amx, avx512, avxvnni, avx2, neon, scalar"
    );
    // `avxvnni` is the AVX2 set, on a CPU with AVX-VNNI.
    match Isa::from_name("avxvnni") {
        Ok(isa) => assert_eq!(isa.kind(), IsaKind::Avx2),
        Err(e) => assert_eq!(e, IsaError::Unsupported("avxvnni".into())),
    }
    #[cfg(target_arch = "x86_64")]
    assert_eq!(
        Isa::from_name("avxvnni").is_ok(),
        cpu_has(IsaKind::Avx2) && std::arch::is_x86_feature_detected!("avxvnni")
    );
}

#[test]
fn linear_routes_by_instruction_set() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::zeros((8, 16), DType::F32, &dev)?;
    let (one, four) = (
        Tensor::zeros((1, 16), DType::F32, &dev)?,
        Tensor::zeros((4, 16), DType::F32, &dev)?,
    );
    // No explicit SIMD: candle's matmul, whatever the rows.
    assert_eq!(route(Isa::SCALAR, &one, &w), Route::Candle);
    assert_eq!(route(Isa::SCALAR, &four, &w), Route::Candle);
    if let Some(avx2) = Isa::new(IsaKind::Avx2) {
        // A tile of 2 rows, or gemm on widened blocks (prefill.rs), takes several rows.
        assert_eq!(route(avx2, &one, &w), Route::Kernel);
        assert_eq!(route(avx2, &four, &w), Route::Kernel);
    }
    // A tile of 4 weight rows × 4 or 6 x rows in registers takes several rows.
    for kind in [IsaKind::Avx512, IsaKind::Neon] {
        if let Some(isa) = Isa::new(kind) {
            assert_eq!(route(isa, &one, &w), Route::Kernel);
            assert_eq!(route(isa, &four, &w), Route::Kernel);
        }
    }
    Ok(())
}

const SHAPES: [(usize, usize); 12] = [
    (1, 1),
    (2, 2),
    (5, 31),
    (6, 33),
    (3, 7),
    (5, 16),
    (13, 17),
    (64, 576),
    (67, 577),
    (192, 100),
    (1536, 576),
    (577, 1539),
];

fn assert_close(got: &[f32], want: &[f64], rel: f64, what: &str) {
    let scale = want.iter().fold(1e-6f64, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs() / scale;
        assert!(
            err <= rel,
            "{what}: y[{i}] = {g}, want {w} (rel err {err:e})"
        );
    }
}

#[test]
fn row_kernels_match_f64_reference() {
    // One row (decode), a few (tile tails), and more than a 64-row block (prefill).
    for (rows, (n, k)) in [1, 2, 3, 4, 5, 6, 8, 9, 11, 70]
        .into_iter()
        .flat_map(|m| SHAPES.map(|s| (m, s)))
    {
        if rows > 1 && n * k > 100_000 {
            continue;
        }
        let (x, w) = (values(rows * k, 1), values(n * k, 2));
        let wb: Vec<u16> = w
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let widen = |b: u16| f32::from_bits((b as u32) << 16) as f64;
        let reference = |w: &dyn Fn(usize) -> f64| -> Vec<f64> {
            let dot = |m: usize, r: usize| -> f64 {
                (0..k).map(|i| x[m * k + i] as f64 * w(r * k + i)).sum()
            };
            (0..rows * n).map(|j| dot(j / n, j % n)).collect()
        };
        let want = reference(&|i| w[i] as f64);
        let want_b = reference(&|i| widen(wb[i]));
        // bf16 x too (a bf16 model's activations): x rounded, then the same sums.
        let xb: Vec<u16> = x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        let want_bb: Vec<f64> = (0..rows * n)
            .map(|j| {
                let (m, r) = (j / n, j % n);
                (0..k)
                    .map(|i| widen(xb[m * k + i]) * widen(wb[r * k + i]))
                    .sum()
            })
            .collect();
        let xp = simd::pair_layout(&x, k, |v| v);
        for isa in isas() {
            let what = format!("{isa:?} {rows}x{k} · ({n}x{k})ᵀ");
            let mut y = vec![f32::NAN; rows * n];
            simd::rows_f32(isa, &x, k, &w, &mut y);
            assert_close(&y, &want, 1e-5, &format!("f32 {what}"));
            let mut y = vec![f32::NAN; rows * n];
            simd::rows_bf16(isa, &xp, k, &wb, &mut y);
            assert_close(&y, &want_b, 1e-5, &format!("bf16 {what}"));
            let mut y = vec![f32::NAN; rows * n];
            simd::rows_bf16_pairs(isa, &xb, k, &wb, &mut y);
            let pairs = simd::bf16_pairs(isa);
            assert_close(&y, &want_bb, 1e-5, &format!("bf16 pairs ({pairs}) {what}"));
        }
    }
}

#[test]
fn matvec_matches_candle_matmul_f32() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (n, k) in SHAPES.iter().copied().chain([(49152, 64), (4096, 300)]) {
        let x = Tensor::from_vec(values(k, 3), (1, 1, k), &dev)?;
        let w = Tensor::from_vec(values(n * k, 4), (n, k), &dev)?;
        let want = x.reshape((1, k))?.matmul(&w.t()?)?.reshape((1, 1, n))?;
        let got = matvec(&x, &w)?;
        assert_eq!(got.dims(), &[1, 1, n]);
        let want = f64s(&want)?;
        assert_close(
            &got.flatten_all()?.to_vec1::<f32>()?,
            &want,
            1e-4,
            &format!("{n}x{k}"),
        );
    }
    Ok(())
}

#[test]
fn matvec_matches_candle_matmul_bf16() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (n, k) in SHAPES.iter().copied().chain([(3000, 576)]) {
        let x = Tensor::from_vec(values(k, 5), (1, k), &dev)?.to_dtype(DType::BF16)?;
        let w = Tensor::from_vec(values(n * k, 6), (n, k), &dev)?.to_dtype(DType::BF16)?;
        let got = matvec(&x, &w)?;
        assert_eq!(got.dtype(), DType::BF16);
        // The reference in f32 from the same bf16 values: only the final rounding differs.
        let want = x
            .to_dtype(DType::F32)?
            .matmul(&w.to_dtype(DType::F32)?.t()?)?;
        let want = f64s(&want)?;
        let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        assert_close(&got, &want, 1e-2, &format!("bf16 {n}x{k}"));
    }
    Ok(())
}

/// Prompt products, whichever kernel takes them on this CPU (a register tile, or on AVX2
/// `prefill`'s gemm blocks from 17 rows in f32 and 32 in bf16), and `prefill` itself on every
/// row count: against candle's f32 matmul on the same (widened) values. The shapes are
/// ragged: k not a multiple of 8 or 16 and wider than a bf16 block (512 columns), n not a
/// multiple of a tile (4 rows) or of a block (96 rows).
#[test]
fn prompt_products_match_candle_matmul() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for (n, k) in [(5, 31), (13, 17), (37, 45), (101, 577), (203, 1030)] {
        let w = Tensor::from_vec(values(n * k, 12), (n, k), &dev)?;
        for m in [1, 2, 3, 5, 16, 17, 18, 31, 32, 33, 64, 70] {
            let x = Tensor::from_vec(values(m * k, 13 + m as u64), (m, k), &dev)?;
            for (dtype, rel) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
                let (x, w) = (x.to_dtype(dtype)?, w.to_dtype(dtype)?);
                let (x32, w32) = (x.to_dtype(DType::F32)?, w.to_dtype(DType::F32)?);
                let want = f64s(&x32.matmul(&w32.t()?)?)?;
                let what = format!("{dtype:?} {m}x{k} · ({n}x{k})ᵀ");
                let got = matvec(&x, &w)?;
                assert_eq!((got.dims(), got.dtype()), (&[m, n][..], dtype), "{what}");
                let got = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                assert_close(&got, &want, rel, &format!("matvec {what}"));
                // prefill's gemm blocks directly, in f32 out (no final rounding to bf16).
                let x32 = x32.flatten_all()?.to_vec1::<f32>()?;
                let mut y = vec![f32::NAN; m * n];
                let wv = w.flatten_all()?;
                let bits: Vec<u16>;
                let w32v: Vec<f32>;
                let weights = match dtype {
                    DType::BF16 => {
                        bits = wv
                            .to_vec1::<half::bf16>()?
                            .iter()
                            .map(|b| b.to_bits())
                            .collect();
                        Weights::Bf16(&bits)
                    }
                    _ => {
                        w32v = wv.to_vec1::<f32>()?;
                        Weights::F32(&w32v)
                    }
                };
                prefill::product(&x32, k, weights, &mut y);
                assert_close(&y, &want, 1e-5, &format!("prefill {what}"));
            }
        }
    }
    Ok(())
}

#[test]
fn linear_equals_candle_nn_linear_on_every_path() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (n, k) = (37, 45);
    let w = Tensor::from_vec(values(n * k, 7), (n, k), &dev)?;
    let b = Tensor::from_vec(values(n, 8), n, &dev)?;
    let ours = Linear::new(w.clone(), Some(b.clone()));
    let theirs = candle_nn::Linear::new(w.clone(), Some(b));
    // (K,) alone is not in the list: candle_nn's Linear rejects it.
    for dims in [
        vec![1, k],
        vec![1, 1, k],
        vec![1, 1, 1, k],
        vec![2, 3, k],
        vec![4, k],
    ] {
        let x = Tensor::from_vec(values(dims.iter().product(), 9), dims.as_slice(), &dev)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (x, ours, theirs) = (
                x.to_dtype(dtype)?,
                Linear::new(
                    ours.weight().unwrap().to_dtype(dtype)?,
                    ours.bias().map(|b| b.to_dtype(dtype)).transpose()?,
                ),
                candle_nn::Linear::new(
                    theirs.weight().to_dtype(dtype)?,
                    theirs.bias().map(|b| b.to_dtype(dtype)).transpose()?,
                ),
            );
            let (got, want) = (ours.forward(&x)?, theirs.forward(&x)?);
            assert_eq!(got.dims(), want.dims(), "{dims:?} {dtype:?}");
            assert_eq!(got.dtype(), want.dtype());
            let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?.abs()?;
            let max = diff.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            let tol = if dtype == DType::F32 { 1e-4 } else { 5e-2 };
            assert!(max <= tol, "{dims:?} {dtype:?}: max diff {max}");
        }
    }
    Ok(())
}

#[test]
fn strided_weight_falls_back_to_candle() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let wt = Tensor::from_vec(values(20 * 30, 10), (30, 20), &dev)?;
    let w = wt.t()?; // (20, 30), not contiguous
    let x = Tensor::from_vec(values(30, 11), (1, 30), &dev)?;
    let want = x.matmul(&wt)?;
    let got = Linear::new(w, None).forward(&x)?;
    let diff = (got - want)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    assert!(diff < 1e-5);
    Ok(())
}

/// Weight bytes per second through the whole op, serial and on the pool, and the cost of a
/// tiny call (mostly the hand-off).
#[test]
#[ignore]
fn probe_bandwidth_and_overhead() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    // The ceiling in this minute: one thread summing 512 MB.
    let buf = vec![1u64; 64 << 20];
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let mut acc = [0u64; 8];
        for c in buf.chunks_exact(8) {
            for j in 0..8 {
                acc[j] = acc[j].wrapping_add(c[j]);
            }
        }
        std::hint::black_box(acc);
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "read bandwidth, 1 thread: {:.1} GB/s",
        (buf.len() * 8) as f64 / best / 1e9
    );
    for dtype in [DType::F32, DType::BF16] {
        // A SmolLM-135M layer's projections, 30 times, then the tied head: ~134M weights.
        let mut shapes = vec![(576, 576), (192, 576), (192, 576), (576, 576)];
        shapes.extend([(1536, 576), (1536, 576), (576, 1536)]);
        let mut mats = Vec::new();
        for _ in 0..30 {
            for &(n, k) in &shapes {
                mats.push(Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?);
            }
        }
        mats.push(Tensor::randn(0f32, 1.0, (49152, 576), &dev)?.to_dtype(dtype)?);
        let bytes: usize = mats
            .iter()
            .map(|m| m.elem_count() * dtype.size_in_bytes())
            .sum();
        let xs: Vec<Tensor> = [576, 1536]
            .iter()
            .map(|&k| Tensor::ones((1, k), dtype, &dev))
            .collect::<candle_core::Result<_>>()?;
        let x_for = |m: &Tensor| &xs[(m.dim(1).unwrap_or(576) != 576) as usize];
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = std::time::Instant::now();
            for m in &mats {
                matvec(x_for(m), m)?;
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{dtype:?}: {} matvecs, {:.0} MB in {:.2} ms = {:.1} GB/s",
            mats.len(),
            bytes as f64 / 1e6,
            best * 1e3,
            bytes as f64 / best / 1e9
        );
        let mut cands = [f64::MAX; 2];
        for (j, &(n, k)) in [(192usize, 576usize), (64, 64)].iter().enumerate() {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
            let x = Tensor::ones((1, k), dtype, &dev)?;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..1000 {
                    matvec(&x, &w)?;
                }
                cands[j] = cands[j].min(t.elapsed().as_secs_f64() / 1000.0 * 1e6);
            }
        }
        println!(
            "{dtype:?}: per call 192x576 {:.1} us (pool), 64x64 {:.1} us (serial)",
            cands[0], cands[1]
        );
    }
    Ok(())
}

/// Multiply-add throughput of several rows at once (prefill), through the op and through
/// candle's matmul.
#[test]
#[ignore]
fn probe_rows_throughput() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    // SmolLM-135M's shapes, then Qwen2.5-1.5B's MLP (the bulk of its prefill), or the
    // shapes of PROBE_SHAPES ("m,n,k;m,n,k"), in PROBE_DTYPE (F32 or BF16) alone if set.
    let mut shapes = vec![
        (32, 1536, 576),
        (64, 1536, 576),
        (256, 1536, 576),
        (64, 576, 1536),
        (4, 8960, 1536),
        (40, 8960, 1536),
        (512, 8960, 1536),
        (40, 1536, 8960),
    ];
    if let Ok(spec) = std::env::var("PROBE_SHAPES") {
        let dim = |d: &str| d.trim().parse::<usize>().expect("PROBE_SHAPES: m,n,k;...");
        shapes = spec
            .split(';')
            .map(|s| match s.split(',').map(dim).collect::<Vec<_>>()[..] {
                [m, n, k] => (m, n, k),
                _ => panic!("PROBE_SHAPES: {s} is not m,n,k"),
            })
            .collect();
    }
    for dtype in [DType::F32, DType::BF16] {
        if std::env::var("PROBE_DTYPE").is_ok_and(|d| d != format!("{dtype:?}")) {
            continue;
        }
        for &(m, n, k) in &shapes {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(dtype)?;
            let mut best = [f64::MAX; 2];
            for _ in 0..5 {
                let t = std::time::Instant::now();
                matvec(&x, &w)?;
                best[0] = best[0].min(t.elapsed().as_secs_f64());
                let t = std::time::Instant::now();
                x.matmul(&w.t()?)?;
                best[1] = best[1].min(t.elapsed().as_secs_f64());
            }
            let flop = 2.0 * (m * n * k) as f64;
            println!(
                "{dtype:?} {m}x{k} · ({n}x{k})ᵀ: ours {:.1} GFLOP/s, candle {:.1} GFLOP/s",
                flop / best[0] / 1e9,
                flop / best[1] / 1e9
            );
        }
    }
    Ok(())
}

/// A tensor's values as f64, for comparison against references.
fn f64s(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    let values = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(values.into_iter().map(f64::from).collect())
}

/// Decode's products with block-format weights, one x row through SmolLM2-135M's 30 layers
/// of projections (70-140 MB of blocks, well past the L3): the best of 15 "tokens" per format
/// in ms and the GB/s of blocks it implies. The minimum is what the kernel does when it has
/// the cores, so it can be compared across builds on a shared machine.
/// `cargo test --release --test kernel probe_block_decode -- --ignored --nocapture`
#[test]
#[ignore]
fn probe_block_decode() -> candle_core::Result<()> {
    use candle_core::quantized::GgmlDType;
    let dev = Device::Cpu;
    let shapes = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    for q in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let mut layers = Vec::new();
        for _ in 0..30 {
            for &(n, k) in &shapes {
                let mut l = Linear::new(Tensor::randn(0f32, 1.0, (n, k), &dev)?, None);
                l.quantize(&q)?;
                layers.push((l, Tensor::randn(0f32, 1.0, (1, k), &dev)?));
            }
        }
        let bytes: usize = layers.iter().map(|(l, _)| l.weight_bytes()).sum();
        let mut best = f64::MAX;
        for _ in 0..15 {
            let t = std::time::Instant::now();
            for (l, x) in &layers {
                l.forward(x)?;
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{q:?}: {:.2} ms per token, {:.1} GB/s of {} MB",
            best * 1e3,
            bytes as f64 / best / 1e9,
            bytes / 1_000_000
        );
    }
    Ok(())
}

/// The decode attention op alone, at SmolLM2-135M's shapes over a bf16 cache: MLA's absorbed
/// form (nine heads over one latent row of 128, values its first 64) against the original's
/// GQA (nine heads, three K/V heads of 64) and MQA; best of 30 × 10 calls per layer, and the
/// multiply-adds per second that implies. Then, as a model reads them, 30 layers' caches in
/// turn (SmolLM2's depth: the caches no longer fit the CPU's caches), at 6000 positions, and
/// MLA's first layer alone (its cache in the CPU's caches: what the arithmetic costs).
/// `cargo test --release --test kernel probe_decode_attention -- --ignored --nocapture`
#[test]
#[ignore]
fn probe_decode_attention() -> candle_core::Result<()> {
    use tiny_decoder::model::attention::sdpa;
    let dev = Device::Cpu;
    let time_layers = |name: &str, layers: &[(Tensor, Tensor, Tensor)], macs: usize| {
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t = std::time::Instant::now();
            for _ in 0..10 {
                for (q, k, v) in layers {
                    sdpa(q, k, v, 0.1, None)?;
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / (10 * layers.len()) as f64);
        }
        let gmacs = macs as f64 / best / 1e9;
        println!("{name}: {:.1} us per layer, {gmacs:.1} GMAC/s", best * 1e6);
        candle_core::Result::Ok(())
    };
    let time = |name: &str, q: &Tensor, k: &Tensor, v: &Tensor, macs: usize| {
        time_layers(name, &[(q.clone(), k.clone(), v.clone())], macs)
    };
    let bf16 = |shape: (usize, usize, usize, usize)| {
        Tensor::randn(0f32, 1.0, shape, &dev)?.to_dtype(DType::BF16)
    };
    let s = 6000;
    // MLA of latent rank r (and a RoPE key of 64), or GQA 9/3 for r = 0.
    let layers = |r: usize| {
        (0..30)
            .map(|_| match r {
                1.. => {
                    let rows = bf16((1, 1, s, r + 64))?;
                    let v = rows.narrow(3, 0, r)?;
                    Ok((Tensor::randn(0f32, 1.0, (1, 9, 1, r + 64), &dev)?, rows, v))
                }
                0 => Ok((
                    Tensor::randn(0f32, 1.0, (1, 9, 1, 64), &dev)?,
                    bf16((1, 3, s, 64))?,
                    bf16((1, 3, s, 64))?,
                )),
            })
            .collect::<candle_core::Result<Vec<_>>>()
    };
    for r in [64, 192] {
        let name = format!("mla:{r},rope=64 at 6000, 30 layers");
        let all = layers(r)?;
        time_layers(&name, &all, s * 9 * (2 * r + 64))?;
        let name = format!("mla:{r},rope=64 at 6000, one layer");
        time_layers(&name, &all[..1], s * 9 * (2 * r + 64))?;
    }
    time_layers("gqa 9/3 at 6000, 30 layers", &layers(0)?, s * 9 * 128)?;
    // A served batch: 8 sequences' new tokens in one op, each over its own short cache, as a
    // batched step of 8 streams early in their answers reads them.
    for s in [32, 100, 300] {
        let q = Tensor::randn(0f32, 1.0, (8, 9, 1, 64), &dev)?;
        let (k, v) = (bf16((8, 3, s, 64))?, bf16((8, 3, s, 64))?);
        time(
            &format!("gqa 9/3, 8 sequences at {s}"),
            &q,
            &k,
            &v,
            8 * s * 9 * 128,
        )?;
    }
    for s in [2000, 6000] {
        let q = Tensor::randn(0f32, 1.0, (1, 9, 1, 128), &dev)?;
        let rows = bf16((1, 1, s, 128))?;
        let v = rows.narrow(3, 0, 64)?;
        time(
            &format!("mla:64,rope=64 at {s}"),
            &q,
            &rows,
            &v,
            s * 9 * (128 + 64),
        )?;
        let q = Tensor::randn(0f32, 1.0, (1, 9, 1, 64), &dev)?;
        let (k, v) = (bf16((1, 3, s, 64))?, bf16((1, 3, s, 64))?);
        time(&format!("gqa 9/3 at {s}"), &q, &k, &v, s * 9 * 128)?;
        let (k, v) = (bf16((1, 1, s, 64))?, bf16((1, 1, s, 64))?);
        time(&format!("mqa at {s}"), &q, &k, &v, s * 9 * 128)?;
        // The GQA cache paged: the same blocks, shuffled (block i at 7i mod n).
        use tiny_decoder::kv_cache::{Pages, BLOCK};
        use tiny_decoder::model::attention::decode::DecodeAttention;
        let blocks = s.div_ceil(BLOCK) | 1;
        let table: Vec<u32> = (0..blocks).map(|i| (i * 7 % blocks) as u32).collect();
        let pages = Pages::new(&table, s);
        let (k, v) = (
            bf16((1, 3, blocks * BLOCK, 64))?,
            bf16((1, 3, blocks * BLOCK, 64))?,
        );
        let op = DecodeAttention {
            scale: 0.1,
            pages: Some(&pages),
        };
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t = std::time::Instant::now();
            for _ in 0..10 {
                q.apply_op3_no_bwd(&k, &v, &op)?;
            }
            best = best.min(t.elapsed().as_secs_f64() / 10.0);
        }
        let gmacs = (s * 9 * 128) as f64 / best / 1e9;
        println!(
            "gqa 9/3 paged at {s}: {:.1} us per layer, {gmacs:.1} GMAC/s",
            best * 1e6
        );
    }
    Ok(())
}

/// Prompt-sized products with block-format weights: our integer tile (`QWeight::product`)
/// against dequantize-into-`gemm` (`prefill::product`), per format, at SmolLM2-135M's MLP
/// shapes and 8 to 512 rows of x; the best of 7 in GMAC/s.
/// `cargo test --release --test kernel probe_blocks_prefill -- --ignored --nocapture`
#[test]
#[ignore]
fn probe_blocks_prefill() -> candle_core::Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    use tiny_decoder::model::linear::quant::{Format, QWeight};
    let dev = Device::Cpu;
    let formats = [
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q5_0, GgmlDType::Q5_0),
        (Format::Q2K, GgmlDType::Q2K),
        (Format::Q3K, GgmlDType::Q3K),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q5K, GgmlDType::Q5K),
        (Format::Q6K, GgmlDType::Q6K),
    ];
    for (format, ggml) in formats {
        for (n, k) in [(1536usize, 576usize), (576, 1536)] {
            if !k.is_multiple_of(format.block_weights()) {
                continue;
            }
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let bytes = QTensor::quantize(&w, ggml)?.data()?.into_owned();
            let q = QWeight::from_ggml(format, n, k, &bytes).expect("blocks of the shape");
            for m in [8, 32, 64, 128, 256, 512] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?
                    .to_vec2::<f32>()?
                    .concat();
                let mut y = vec![0f32; m * n];
                let mut best = [f64::MAX; 2];
                for _ in 0..7 {
                    let t = std::time::Instant::now();
                    q.product(&x, &mut y);
                    best[0] = best[0].min(t.elapsed().as_secs_f64());
                    let t = std::time::Instant::now();
                    prefill::product(&x, k, Weights::Blocks(&q), &mut y);
                    best[1] = best[1].min(t.elapsed().as_secs_f64());
                }
                let mac = (m * n * k) as f64 / 1e9;
                println!(
                    "{format:?} {n}x{k} m={m}: tile {:.1}, gemm {:.1} GMAC/s",
                    mac / best[0],
                    mac / best[1]
                );
            }
        }
    }
    Ok(())
}

/// The packed layout (8 rows interleaved, AVX2) against the row layout (Q5's: ggml's
/// blocks) and against
/// dequantize-into-`gemm`, per packed format, at SmolLM2-135M's MLP shapes, 1 to 512 rows of
/// x, on the pool; the best of 9 in GMAC/s, each product after the other layout's (its
/// weights from L3 or memory, as a model's are). PROBE_PACKED_ONLY=1 first takes the best of
/// 50 packed products in a row (weights in the near caches).
/// `cargo test --release --test kernel probe_packed -- --ignored --nocapture`
#[test]
#[ignore]
fn probe_packed() -> candle_core::Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    use tiny_decoder::model::linear::quant::{Format, QWeight};
    let dev = Device::Cpu;
    for (format, ggml) in [
        (Format::Q8_0, GgmlDType::Q8_0),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q4_1, GgmlDType::Q4_1),
        (Format::Q5_0, GgmlDType::Q5_0),
        (Format::Q5_1, GgmlDType::Q5_1),
        (Format::Q2K, GgmlDType::Q2K),
        (Format::Q3K, GgmlDType::Q3K),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q5K, GgmlDType::Q5K),
        (Format::Q6K, GgmlDType::Q6K),
    ] {
        // PROBE_FORMAT=Q5K (say) probes that format alone.
        if std::env::var("PROBE_FORMAT").is_ok_and(|f| f != format!("{format:?}")) {
            continue;
        }
        for (n, k) in [(1536usize, 576usize), (576, 1536), (1536, 1536)] {
            if !k.is_multiple_of(format.block_weights()) {
                continue;
            }
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let bytes = QTensor::quantize(&w, ggml)?.data()?.into_owned();
            let q = QWeight::from_ggml(format, n, k, &bytes).expect("blocks of the shape");
            let (rows, packed) = (q.clone().repacked(false), q.repacked(true));
            for m in [1, 2, 8, 64, 128, 512] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?
                    .to_vec2::<f32>()?
                    .concat();
                let mut y = vec![0f32; m * n];
                let mut best = [f64::MAX; 3];
                if std::env::var("PROBE_PACKED_ONLY").is_ok() {
                    for _ in 0..50 {
                        let t = std::time::Instant::now();
                        packed.product(&x, &mut y);
                        best[1] = best[1].min(t.elapsed().as_secs_f64());
                    }
                }
                for _ in 0..9 {
                    let t = std::time::Instant::now();
                    rows.product(&x, &mut y);
                    best[0] = best[0].min(t.elapsed().as_secs_f64());
                    let t = std::time::Instant::now();
                    packed.product(&x, &mut y);
                    best[1] = best[1].min(t.elapsed().as_secs_f64());
                    if m >= 64 {
                        let t = std::time::Instant::now();
                        prefill::product(&x, k, Weights::Blocks(&rows), &mut y);
                        best[2] = best[2].min(t.elapsed().as_secs_f64());
                    }
                }
                let mac = (m * n * k) as f64 / 1e9;
                println!(
                    "{format:?} {n}x{k} m={m}: rows {:.1}, packed {:.1}, gemm {:.1} GMAC/s",
                    mac / best[0],
                    mac / best[1],
                    mac / best[2]
                );
            }
        }
    }
    Ok(())
}

/// Decode's case: one row of x against weights far larger than the caches (4 matrices of
/// 8192 x 2048, 40-70 MB in all, taken in turn as a model's layers are), row layout against
/// packed, per K-quant and Q4_0/Q8_0; the best of 5 passes in GB/s of weight bytes read.
/// `cargo test --release --test kernel probe_packed_decode -- --ignored --nocapture`
#[test]
#[ignore]
fn probe_packed_decode() -> candle_core::Result<()> {
    use candle_core::quantized::{GgmlDType, QTensor};
    use tiny_decoder::model::linear::quant::{Format, QWeight};
    let dev = Device::Cpu;
    let (n, k) = (8192usize, 2048usize);
    for (format, ggml) in [
        (Format::Q2K, GgmlDType::Q2K),
        (Format::Q3K, GgmlDType::Q3K),
        (Format::Q4K, GgmlDType::Q4K),
        (Format::Q5K, GgmlDType::Q5K),
        (Format::Q6K, GgmlDType::Q6K),
        (Format::Q4_0, GgmlDType::Q4_0),
        (Format::Q8_0, GgmlDType::Q8_0),
    ] {
        // PROBE_FORMAT=Q6K (say) probes that format alone.
        if std::env::var("PROBE_FORMAT").is_ok_and(|f| f != format!("{format:?}")) {
            continue;
        }
        let mut layers = Vec::new();
        for _ in 0..4 {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let bytes = QTensor::quantize(&w, ggml)?.data()?.into_owned();
            let q = QWeight::from_ggml(format, n, k, &bytes).expect("blocks of the shape");
            layers.push((q.clone().repacked(false), q.repacked(true)));
        }
        let x = Tensor::randn(0f32, 1.0, (1, k), &dev)?
            .to_vec2::<f32>()?
            .concat();
        let mut y = vec![0f32; n];
        let bytes: usize = layers.iter().map(|(r, _)| r.bytes()).sum();
        let mut best = [f64::MAX; 2];
        for _ in 0..5 {
            for (which, b) in best.iter_mut().enumerate() {
                let t = std::time::Instant::now();
                for _ in 0..4 {
                    for (rows, packed) in &layers {
                        [rows, packed][which].product(&x, &mut y);
                    }
                }
                *b = b.min(t.elapsed().as_secs_f64() / 4.0);
            }
        }
        println!(
            "{format:?} {} MB: rows {:.1}, packed {:.1} GB/s",
            bytes / 1_000_000,
            bytes as f64 / best[0] / 1e9,
            bytes as f64 / best[1] / 1e9
        );
    }
    Ok(())
}
