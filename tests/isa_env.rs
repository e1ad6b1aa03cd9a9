//! `TINY_DECODER_ISA`, which forces the kernels onto a lower instruction set. It is read once
//! per process, so each case runs this test binary again with the variable set, in the
//! ignored `child_reports_its_isa`, and checks what that printed.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::process::Command;
use tiny_decoder::model::attention::decode;
use tiny_decoder::model::linear::simd::{self, Isa, IsaKind, ISA_VAR};
use tiny_decoder::model::linear::{quant, route, Blocks, Linear, Quantizer, Route, StoredBlocks};

/// The child's stdout and stderr, run with `TINY_DECODER_ISA=value`; panics if it failed.
fn child(value: &str) -> (String, String) {
    let exe = std::env::current_exe().expect("the test binary's path");
    let out = Command::new(exe)
        .args([
            "--exact",
            "child_reports_its_isa",
            "--ignored",
            "--nocapture",
        ])
        .env(ISA_VAR, value)
        .output()
        .expect("the test binary runs again");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{ISA_VAR}={value}: the child failed\n{stdout}\n{stderr}"
    );
    (stdout, stderr)
}

/// The detected set's name, as the warnings say it.
fn detected() -> String {
    format!("{:?}", Isa::detect().kind()).to_ascii_lowercase()
}

/// The warnings a child printed.
fn warnings(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("warning:"))
        .collect()
}

#[test]
fn scalar_routes_every_linear_to_candle() {
    let (out, err) = child("scalar");
    assert!(out.contains("isa=Scalar"), "{out}");
    assert!(
        out.contains("1 rows: Candle") && out.contains("4 rows: Candle"),
        "{out}"
    );
    assert!(out.contains("decode op: false"), "{out}");
    assert!(out.contains("blocks: 10 formats"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
}

#[test]
fn avx2_takes_rows_and_the_decode_op() {
    if Isa::new(IsaKind::Avx2).is_none() {
        return; // covered by the fallback test below
    }
    let (out, err) = child("avx2");
    assert!(
        out.contains("isa=Avx2") && out.contains("avx-vnni=false"),
        "{out}"
    );
    assert!(out.contains("packed products: avx2"), "{out}");
    assert!(
        out.contains("1 rows: Kernel") && out.contains("4 rows: Kernel"),
        "{out}"
    );
    assert!(out.contains("decode op: true"), "{out}");
    assert!(out.contains("blocks: 10 formats"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
}

/// `avxvnni`: the AVX2 set, with AVX-VNNI's dot products in the block formats' tiles (which
/// the child's `blocks` check runs).
#[test]
fn avxvnni_is_avx2_with_its_dot_products() {
    if Isa::from_name("avxvnni").is_err() {
        return; // covered by the fallback test below
    }
    let (out, err) = child("avxvnni");
    assert!(
        out.contains("isa=Avx2") && out.contains("avx-vnni=true"),
        "{out}"
    );
    assert!(out.contains("packed products: avx-vnni"), "{out}");
    assert!(out.contains("blocks: 10 formats"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
}

/// `amx`: the AVX-512 set with AMX's tile products in the 32-weight formats' tiles (which
/// the child's `blocks` check runs over 16 rows of x and more); `avx512` the same set
/// without them.
#[test]
fn amx_is_avx512_with_its_tile_products() {
    if Isa::from_name("amx").is_err() {
        return; // covered by the fallback test below
    }
    let (out, err) = child("amx");
    assert!(
        out.contains("isa=Avx512") && out.contains("amx=true"),
        "{out}"
    );
    assert!(out.contains("packed products: amx"), "{out}");
    assert!(out.contains("blocks: 10 formats"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
    let (out, err) = child("avx512");
    assert!(
        out.contains("isa=Avx512") && out.contains("amx=false"),
        "{out}"
    );
    assert!(out.contains("packed products: avx512-vnni"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
}

#[test]
fn neon_takes_rows_and_the_decode_op() {
    if Isa::new(IsaKind::Neon).is_none() {
        return; // covered by the fallback test below
    }
    let (out, err) = child("neon");
    assert!(out.contains("isa=Neon"), "{out}");
    assert!(
        out.contains("1 rows: Kernel") && out.contains("4 rows: Kernel"),
        "{out}"
    );
    assert!(out.contains("decode op: true"), "{out}");
    assert!(warnings(&err).is_empty(), "{err}");
}

#[test]
fn asking_for_more_than_the_cpu_has_warns_once_and_falls_back() {
    let best = format!("isa={:?}", Isa::detect().kind());
    for value in ["amx", "avx512", "avxvnni", "avx2", "neon"] {
        let (out, err) = child(value);
        let kind = Isa::from_name(value).map(|isa| isa.kind());
        match kind {
            Ok(kind) => {
                assert!(out.contains(&format!("isa={kind:?}")), "{out}");
                // AVX-VNNI's tiles only at the AVX2 level, and only where asked for by name.
                let vex = value == "avxvnni";
                assert!(out.contains(&format!("avx-vnni={vex}")), "{value}: {out}");
            }
            Err(e) => {
                assert!(out.contains(&best), "{value}: {out}");
                let want = format!("warning: {e}; using {}", detected());
                assert_eq!(warnings(&err), [want.as_str()], "{value}");
            }
        }
    }
}

#[test]
fn an_unknown_name_warns_once_and_falls_back() {
    let (out, err) = child("sse9");
    assert!(
        out.contains(&format!("isa={:?}", Isa::detect().kind())),
        "{out}"
    );
    let want = format!(
        "warning: {ISA_VAR}=\"sse9\" is not one of amx, avx512, avxvnni, avx2, neon, scalar; using {}",
        detected()
    );
    assert_eq!(warnings(&err), [want.as_str()]);
}

/// A GGUF's stored blocks, as the loader hands them to a projection.
struct Stored(QTensor);

impl Quantizer for Stored {
    fn blocks(&self, _: Option<&str>) -> candle_core::Result<Option<Blocks>> {
        Ok(Some(Blocks::Stored(StoredBlocks {
            dtype: self.0.dtype(),
            dims: self.0.shape().dims().to_vec(),
            bytes: self.0.data()?.into_owned(),
        })))
    }

    fn label(&self) -> GgmlDType {
        self.0.dtype()
    }
}

/// Every block format we run, at the forced set, for 1, 4 and 9 rows of x (one row, the
/// four-row kernel or a tile with a tail), on 13 weight rows (not a multiple of any tile):
/// within 3% of x times the dequantized weight (x is rounded to 8 bits; one row of x makes
/// only 13 products, a small sample: 25 runs of every format read 0.5-1.3%, and CI once
/// read 2.02% for Q2_K's; a wrong kernel reads tens of percent). Returns how many.
fn block_formats_match_their_dequantization() -> candle_core::Result<usize> {
    let dev = Device::Cpu;
    let formats = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];
    for format in formats {
        // 13 rows: a pair of groups and one, padded; 21 rows of x: AMX's 16 and the rest.
        let w = Tensor::randn(0f32, 1.0, (13, 768), &dev)?;
        let q = QTensor::quantize(&w, format)?;
        let dense = q.dequantize(&dev)?;
        let mut linear = Linear::new(w, None);
        assert!(linear.quantize(&Stored(q))?, "{format:?} kept dense");
        for rows in [1, 4, 9, 21] {
            let x = Tensor::randn(0f32, 1.0, (rows, 768), &dev)?;
            let want = x.matmul(&dense.t()?)?;
            let err = (linear.forward(&x)? - &want)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f32>()?;
            let norm = want.sqr()?.sum_all()?.to_scalar::<f32>()?;
            let rel = (err / norm).sqrt();
            assert!(rel < 0.03, "{format:?}, {rows} rows: relative error {rel}");
        }
    }
    Ok(formats.len())
}

/// In the child: where a Linear's product goes at the forced set, that it equals
/// candle_nn's (exactly, when it is candle's matmul), and whether decode takes its op.
#[test]
#[ignore = "run by the other tests of this file, with TINY_DECODER_ISA set"]
fn child_reports_its_isa() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let (n, k) = (24, 40);
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    let b = Tensor::randn(0f32, 1.0, n, &dev)?;
    let (ours, theirs) = (
        Linear::new(w.clone(), Some(b.clone())),
        candle_nn::Linear::new(w.clone(), Some(b)),
    );
    for rows in [1, 4] {
        let x = Tensor::randn(0f32, 1.0, (rows, k), &dev)?;
        let r = route(Isa::current(), &x, &w);
        let diff = (ours.forward(&x)? - theirs.forward(&x)?)?.abs()?;
        let max = diff.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let tol = if r == Route::Candle { 0.0 } else { 1e-4 };
        assert!(max <= tol, "{rows} rows, {r:?}: max diff {max}");
        println!("{rows} rows: {r:?}");
    }
    println!(
        "blocks: {} formats",
        block_formats_match_their_dequantization()?
    );
    let q = Tensor::zeros((1, 2, 1, 8), DType::F32, &dev)?;
    println!("decode op: {}", decode::takes(&q));
    // Asked again: decided once, said at most once.
    assert_eq!(Isa::current(), Isa::current());
    println!("isa={:?}", Isa::current().kind());
    println!("avx-vnni={}", simd::avx_vnni());
    println!("amx={}", simd::amx());
    println!("packed products: {}", quant::packed_products());
    Ok(())
}
