//! The prompt's attention against candle's ops and against its own three passes.

use super::*;
use crate::model::attention::causal_mask;
use candle_core::Device;

/// Against candle's three ops: 2 groups of 3 heads' 5 queries over 9 keys, causal and
/// with a sliding window of 3; hidden positions exactly 0.
#[test]
fn masked_softmax_matches_candle_ops() -> Result<()> {
    let dev = Device::Cpu;
    let scores = Tensor::randn(0f32, 3.0, (1, 2, 3 * 5, 9), &dev)?;
    for window in [usize::MAX, 3] {
        let mask = causal_mask(5, 9, window, DType::F32, &dev)?;
        let got = masked(&scores, 0.125, &mask).expect("taken")?;
        let want = (scores.reshape((1, 2, 3, 5, 9))? * 0.125)?.broadcast_add(&mask)?;
        let want = candle_nn::ops::softmax_last_dim(&want)?.reshape((1, 2, 15, 9))?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6, "window {window}: {diff}");
        let hidden = mask.broadcast_as((1, 2, 3, 5, 9))?.reshape((1, 2, 15, 9))?;
        let (got, hidden) = (
            got.flatten_all()?.to_vec1::<f32>()?,
            hidden.flatten_all()?.to_vec1::<f32>()?,
        );
        assert!(got.iter().zip(&hidden).all(|(g, m)| *m == 0.0 || *g == 0.0));
    }
    Ok(())
}

/// The fused pass against the three it replaces: 2 batches of 2 groups of 2 heads' 150
/// queries (pieces of 128 rows across the heads' boundary), Dk 24 and Dv 20; the queries
/// after 0 or 40 cached positions, causal and with a sliding window of 37.
#[test]
fn fused_attention_matches_the_three_passes() -> Result<()> {
    let dev = Device::Cpu;
    let (t, dk, dv) = (150, 24, 20);
    for (cached, window) in [(0, usize::MAX), (40, usize::MAX), (40, 37)] {
        let s = cached + t;
        let q = Tensor::randn(0f32, 1.0, (2, 2, 2 * t, dk), &dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 2, s, dk), &dev)?;
        let v = Tensor::randn(0f32, 1.0, (2, 2, s, dv), &dev)?;
        let mask = causal_mask(t, s, window, DType::F32, &dev)?;
        let got = attention(&q, &k, &v, 0.2, &mask).expect("taken")?;
        let scores = products(&q, &k).expect("taken")?;
        let weights = masked(&scores, 0.2, &mask).expect("taken")?;
        let want = products(&weights, &v.transpose(2, 3)?).expect("taken")?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{cached} cached, window {window}: {diff}");
    }
    Ok(())
}

/// bf16 operands where the CPU multiplies bf16 pairs: the shapes above but Dk 25 (an odd
/// last row of the scores' pairs) or 64 (the keys transposed in registers, `decode::keys`)
/// and Dv 40 (a tile of 32 columns and a tail), odd key counts, against the three passes
/// over the same
/// values widened, with the weights' numerators rounded to bf16 as the pairs read them.
/// Within 4e-3: the scores' f32 sums run in another order, and a last bit of a score can
/// move its weight's rounding by one bf16 step (2⁻⁸ of it; the window's 37 keys make
/// weights of ~0.1: 1e-3).
#[test]
fn fused_attention_in_bf16_pairs_matches_the_three_passes() -> Result<()> {
    if !crate::model::linear::simd::bf16_pairs(Isa::current()) {
        eprintln!("SKIPPED: this CPU does not multiply bf16 pairs");
        return Ok(());
    }
    let dev = Device::Cpu;
    let (t, dv) = (150, 40);
    let bf16 = |t: Tensor| t.to_dtype(DType::BF16);
    let wide = |t: &Tensor| t.to_dtype(DType::F32);
    let shapes = [(0, usize::MAX), (41, usize::MAX), (41, 37)];
    for ((cached, window), dk) in shapes.into_iter().flat_map(|c| [(c, 25), (c, 64)]) {
        let s = cached + t;
        let q = bf16(Tensor::randn(0f32, 1.0, (2, 2, 2 * t, dk), &dev)?)?;
        let k = bf16(Tensor::randn(0f32, 1.0, (2, 2, s, dk), &dev)?)?;
        let v = bf16(Tensor::randn(0f32, 1.0, (2, 2, s, dv), &dev)?)?;
        let mask = causal_mask(t, s, window, DType::F32, &dev)?;
        let got = attention(&q, &k, &v, 0.2, &mask).expect("taken")?;
        let scores = products(&wide(&q)?, &wide(&k)?).expect("taken")?;
        // Their numerators rounded, divided by their sums after: exp(x − max) / Σ.
        let weights = masked(&scores, 0.2, &mask).expect("taken")?;
        let top = weights.max_keepdim(3)?; // the numerator of the largest is 1
        let numerators = wide(&bf16(weights.broadcast_div(&top)?)?)?;
        let sums = weights.broadcast_div(&top)?.sum_keepdim(3)?;
        let want = products(&numerators, &wide(&v)?.transpose(2, 3)?).expect("taken")?;
        let want = want.broadcast_div(&sums)?;
        let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff < 4e-3,
            "{cached} cached, window {window}, Dk {dk}: {diff}"
        );
    }
    Ok(())
}

/// Rows the mask hides every key from, alone in a piece of visible rows (query 5) and as a
/// whole piece (queries 106-149 of the second head: its rows 256-299), get zeros as in the
/// three passes.
#[test]
fn fused_attention_gives_hidden_rows_zeros() -> Result<()> {
    let dev = Device::Cpu;
    let (t, d) = (150, 16);
    let causal = causal_mask(t, t, usize::MAX, DType::F32, &dev)?;
    let mut values = causal.flatten_all()?.to_vec1::<f32>()?;
    for row in [5].into_iter().chain(106..t) {
        values[row * t..(row + 1) * t].fill(f32::NEG_INFINITY);
    }
    let mask = Tensor::from_vec(values, (t, t), &dev)?;
    let q = Tensor::randn(0f32, 1.0, (1, 1, 2 * t, d), &dev)?;
    let k = Tensor::randn(0f32, 1.0, (1, 1, t, d), &dev)?;
    let v = Tensor::randn(0f32, 1.0, (1, 1, t, d), &dev)?;
    let got = attention(&q, &k, &v, 0.25, &mask).expect("taken")?;
    let weights = masked(&products(&q, &k).expect("taken")?, 0.25, &mask).expect("taken")?;
    let want = products(&weights, &v.transpose(2, 3)?).expect("taken")?;
    let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-5, "{diff}");
    let got = got.squeeze(0)?.squeeze(0)?;
    for row in [5, 106, 149, t + 5, t + 106, 2 * t - 1] {
        let sum = got.get(row)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert_eq!(sum, 0.0, "row {row}");
    }
    Ok(())
}

/// Against candle's matmul: 2 batches of 3 groups, 300 rows (pieces of 128 and a tail),
/// b a strided view (a transpose), K = 40.
#[test]
fn products_match_candle_matmul() -> Result<()> {
    let dev = Device::Cpu;
    let a = Tensor::randn(0f32, 1.0, (2, 3, 300, 40), &dev)?;
    let b = Tensor::randn(0f32, 1.0, (2, 3, 40, 77), &dev)?.transpose(2, 3)?;
    let got = products(&a, &b).expect("taken")?;
    let want = a.matmul(&b.t()?)?;
    let diff = (&got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-4, "{diff}");
    Ok(())
}

/// A row whose mask is 0 over its shown columns and -inf elsewhere: the numerators and their
/// sum with only the hidden columns set equal those with the whole mask added, bit for bit
/// (rows hiding their start, their end, both or neither, and scores of ±0).
#[test]
fn numerators_of_a_plain_mask_equal_the_masks_bit_for_bit() -> Result<()> {
    let dev = Device::Cpu;
    let isa = Isa::current();
    let n = 100;
    for (a, b) in [(0, n), (0, 37), (13, n), (13, 87), (50, 51)] {
        let mut row = Tensor::randn(0f32, 4.0, n, &dev)?.to_vec1::<f32>()?;
        (row[a], row[b - 1]) = (-0.0, 0.0);
        let mask: Vec<f32> = (0..n)
            .map(|j| {
                if (a..b).contains(&j) {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let (mut plain, mut whole) = (row.clone(), row);
        let total = numerators_shown(isa, &mut plain, 0.3, (a, b));
        let want = numerators_row(isa, &mut whole, 0.3, &mask);
        assert_eq!(total.to_bits(), want.to_bits(), "shown {a}..{b}: the sums");
        let same = plain
            .iter()
            .zip(&whole)
            .all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "shown {a}..{b}: the numerators");
    }
    Ok(())
}
