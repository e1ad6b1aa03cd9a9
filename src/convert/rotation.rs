//! What MLA's unrotated part can keep of RoPE. A converted key's residual r (what the shared
//! RoPE head does not rebuild of the original key, [`super::mla`]) is cached without its
//! rotation, so the original score q·R(−ω·Δ)·r at distance Δ = t − s becomes q·A·r for one
//! fixed A per query head and frequency. A = 1 is exact only where a head attends to its own
//! position. The best fixed A in the mean over the positions a head attends to is the
//! rotation it expects there, A = Σ_Δ p(Δ)·R(−ω·Δ), p(Δ) the share of the head's attention
//! at distance Δ: a scaled rotation per frequency (near 1 where ω·Δ stays small, near 0 where
//! the rotation averages out), folded into the head's unrotated query.
//!
//! p is measured on the original over the calibration windows (from position 0): the
//! attention probabilities of each query head, summed along each distance.

use super::gqa::{Heads, Projections};
use super::heal::{mask, weights, Form, Geometry};
use crate::config::RopeConfig;
use crate::error::Result;
use crate::model::rope::Rope;
use candle_core::{DType, Tensor};

/// Windows taken through the attention at once.
const BATCH: usize = 4;

/// The expected rotation per query head and frequency, (cos, sin) of A = [[c, s], [−s, c]]
/// acting on a pair (a, b) as R(−ω·Δ) does: head h, pair p at `[h·D/2 + p]`.
pub struct Expected(pub Vec<(f64, f64)>);

impl Expected {
    /// Measures the original attention's distances over `windows` (N, T, C + 1) of one
    /// layer's input, with that layer's projections `w` (f64, augmented), `h` query heads.
    pub fn measure(
        windows: &Tensor,
        w: &Projections,
        heads: Heads,
        h: usize,
        rope: &RopeConfig,
    ) -> Result<Self> {
        let ((n, t, _), d) = (windows.dims3()?, heads.d);
        let dev = windows.device();
        let positions: Vec<u32> = (0..t as u32).collect();
        // The original layer as healing's attention runs it (a bias column of zeros where
        // the model has none adds nothing).
        let geo = Geometry {
            num_heads: h,
            head_dim: d,
            rotation: Rope::new(rope, DType::F32, dev)?.at_positions(&positions)?,
            bias: true,
            device: dev.clone(),
        };
        let original = Form::Gqa {
            q: w.q.clone(),
            k: w.k.clone(),
            v: w.v.clone(),
            o: w.o.clone(),
        }
        .to(DType::F32, dev)?;
        let mask = mask(t, dev)?;
        // The attention's share at each distance, per head, summed over windows and queries.
        let mut share = vec![0.0f64; h * t];
        for start in (0..n).step_by(BATCH) {
            let x = windows.narrow(0, start, BATCH.min(n - start))?;
            let (p, _) = weights(&original, &x, &geo, &mask)?;
            let p = p.sum(0)?.reshape((h, t, t))?.to_dtype(DType::F64)?;
            for (head, rows) in p.to_vec3::<f64>()?.iter().enumerate() {
                for (i, row) in rows.iter().enumerate() {
                    for (j, x) in row[..=i].iter().enumerate() {
                        share[head * t + i - j] += x;
                    }
                }
            }
        }
        let inv_freq = crate::model::rope::inv_freq(rope);
        let queries = (n * t) as f64;
        let mut out = Vec::with_capacity(h * d / 2);
        for head in 0..h {
            for &omega in &inv_freq[..d / 2] {
                let (c, s) = (0..t).fold((0.0, 0.0), |(c, s), delta| {
                    let (p, angle) = (share[head * t + delta] / queries, omega * delta as f64);
                    (c + p * angle.cos(), s + p * angle.sin())
                });
                out.push((c, s));
            }
        }
        Ok(Self(out))
    }

    /// `q` (H·D, C + 1) with each head's pairs taken through Aᵀ: q·A·r = (Aᵀ·q)·r.
    pub fn fold(&self, q: &Tensor, heads: Heads) -> Result<Tensor> {
        let d = heads.d;
        let mut rows = q.to_vec2::<f64>()?;
        for (i, &(c, s)) in self.0.iter().enumerate() {
            let (head, p) = (i / (d / 2), i % (d / 2));
            let (a, b) = heads.pair(p);
            let (ra, rb) = (&rows[head * d + a], &rows[head * d + b]);
            let new_a: Vec<f64> = ra.iter().zip(rb).map(|(x, y)| c * x - s * y).collect();
            let new_b: Vec<f64> = ra.iter().zip(rb).map(|(x, y)| s * x + c * y).collect();
            rows[head * d + a] = new_a;
            rows[head * d + b] = new_b;
        }
        let cols = q.dim(1)?;
        Ok(Tensor::from_vec(
            rows.concat(),
            (self.0.len() * 2, cols),
            q.device(),
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;
    use candle_core::Device;

    const D: usize = 8;
    const H: usize = 4;
    const C: usize = 16;

    fn rope() -> RopeConfig {
        RopeConfig {
            theta: 10.0,
            dim: D,
            scaling: RopeScaling::Default,
            interleaved: false,
        }
    }

    /// A layer of 4 query heads over 2 K/V heads, keys `key_scale` times random.
    fn layer(query_scale: f64, key_scale: f64) -> Projections {
        let cpu = &Device::Cpu;
        let proj = |rows: usize, scale: f64| {
            let w = Tensor::randn(0f64, 1.0, (rows, C), cpu).unwrap();
            let zero = Tensor::zeros((rows, 1), DType::F64, cpu).unwrap();
            Tensor::cat(&[&(w * scale).unwrap(), &zero], 1).unwrap()
        };
        Projections {
            q: proj(H * D, query_scale),
            k: proj(2 * D, key_scale),
            v: proj(2 * D, 1.0),
            o: Tensor::zeros((C, H * D), DType::F64, cpu).unwrap(),
        }
    }

    fn windows(n: usize, t: usize) -> Tensor {
        let cpu = &Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (n, t, C), cpu).unwrap();
        Tensor::cat(&[&x, &Tensor::ones((n, t, 1), DType::F32, cpu).unwrap()], 2).unwrap()
    }

    fn heads() -> Heads {
        Heads {
            d: D,
            interleaved: false,
        }
    }

    /// Keys of zero attend evenly: query t gives 1/(t + 1) to each distance up to t, so
    /// every head expects the mean of those rotations, which this test sums itself.
    #[test]
    fn even_attention_expects_the_mean_rotation() {
        let (n, t) = (3, 12);
        let got = Expected::measure(&windows(n, t), &layer(1.0, 0.0), heads(), H, &rope()).unwrap();
        let inv_freq = crate::model::rope::inv_freq(&rope());
        for (i, &(c, s)) in got.0.iter().enumerate() {
            let omega = inv_freq[i % (D / 2)];
            let (mut want_c, mut want_s) = (0.0, 0.0);
            for q in 0..t {
                for delta in 0..=q {
                    let angle = omega * delta as f64;
                    want_c += angle.cos() / ((q + 1) * t) as f64;
                    want_s += angle.sin() / ((q + 1) * t) as f64;
                }
            }
            assert!(
                (c - want_c).abs() < 1e-5,
                "head/pair {i}: cos {c} against {want_c}"
            );
            assert!(
                (s - want_s).abs() < 1e-5,
                "head/pair {i}: sin {s} against {want_s}"
            );
        }
    }

    /// Queries equal to their keys, keys of one length, scaled up: each position attends
    /// to itself (any other key's score is lower by Cauchy-Schwarz), where RoPE turns
    /// nothing, so A is the identity.
    #[test]
    fn attention_to_itself_expects_no_rotation() {
        let cpu = &Device::Cpu;
        // K/V head g reads input channels g·D..(g + 1)·D, each of unit length.
        let x = Tensor::randn(0f32, 1.0, (2, 10, 2, D), cpu).unwrap();
        let x = x.broadcast_div(&x.sqr().unwrap().sum_keepdim(3).unwrap().sqrt().unwrap());
        let x = x.unwrap().reshape((2, 10, C)).unwrap();
        let x = Tensor::cat(
            &[&x, &Tensor::ones((2, 10, 1), DType::F32, cpu).unwrap()],
            2,
        );
        let eye = Tensor::eye(C + 1, DType::F64, cpu).unwrap();
        let k = (eye.narrow(0, 0, 2 * D).unwrap() * 30.0).unwrap();
        let (k0, k1) = (k.narrow(0, 0, D).unwrap(), k.narrow(0, D, D).unwrap());
        let mut w = layer(1.0, 1.0);
        w.q = Tensor::cat(&[&k0, &k0, &k1, &k1], 0).unwrap();
        w.k = k;
        let got = Expected::measure(&x.unwrap(), &w, heads(), H, &rope()).unwrap();
        for (i, &(c, s)) in got.0.iter().enumerate() {
            assert!(c > 0.98 && s.abs() < 0.02, "head/pair {i}: ({c}, {s})");
        }
    }

    /// The folded query dotted with a key equals the query dotted with A·key.
    #[test]
    fn folding_moves_the_rotation_onto_the_query() {
        let cpu = &Device::Cpu;
        let turn = Expected(
            (0..H * D / 2)
                .map(|i| (0.1 * i as f64, 0.5 - 0.03 * i as f64))
                .collect(),
        );
        let q = Tensor::randn(0f64, 1.0, (H * D, C + 1), cpu).unwrap();
        let x = Tensor::randn(0f64, 1.0, (C + 1, 1), cpu).unwrap();
        let r = Tensor::randn(0f64, 1.0, (D, 1), cpu)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let folded = turn
            .fold(&q, heads())
            .unwrap()
            .matmul(&x)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let plain = q.matmul(&x).unwrap().to_vec2::<f64>().unwrap();
        for head in 0..H {
            // q·A·r with A = [[c, s], [−s, c]] on each pair (p, p + D/2).
            let (mut want, mut got) = (0.0, 0.0);
            for p in 0..D / 2 {
                let (c, s) = turn.0[head * D / 2 + p];
                let (a, b) = (p, p + D / 2);
                let (ra, rb) = (r[a][0], r[b][0]);
                let (turned_a, turned_b) = (c * ra + s * rb, -s * ra + c * rb);
                want += plain[head * D + a][0] * turned_a + plain[head * D + b][0] * turned_b;
                got += folded[head * D + a][0] * ra + folded[head * D + b][0] * rb;
            }
            assert!(
                (want - got).abs() < 1e-9 * want.abs().max(1.0),
                "head {head}: {got} against {want}"
            );
        }
    }
}
