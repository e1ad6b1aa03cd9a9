//! MHA ⇄ GQA ⇄ MQA on one layer's weights. Every conversion here is a linear map of the
//! original projections' rows (`W_k' = T_k·W_k`, likewise V and Q) and of W_o's columns
//! (`W_o' = W_o·T_o`); this file builds the T matrices:
//!
//! - a new K/V group that reads one original head copies it (GQA → MHA, X → X): exact;
//! - `mean` averages the original heads its query heads read (the GQA paper's start);
//! - `aware` fits the merge to a calibration text's activations. Keys: each RoPE pair
//!   (dims a, b of a head) is one complex number z that RoPE multiplies by e^{iωt}, so a
//!   complex mix of the heads' z at one frequency commutes with RoPE. The merged key is
//!   z' = Σ_g c_g·z_g and each query head of original head g absorbs the complex scalar
//!   that best rebuilds z_g from z', with c the top eigenvector of the heads' Hermitian key
//!   covariance weighted by their queries' energy at that frequency. Values: fitted so each
//!   query head's contribution W_o,q·v reproduces the original's over the calibration
//!   inputs, and the per-head maps folded into W_o.
//!
//! Biases ride along as an extra input column (the input's constant 1).
//!
//! Over 300 lines on purpose: the three maps share the T matrices and the derivation above;
//! apart, each would repeat them.

use super::linalg::{eigh, matmul, sqrt_and_pinv_sqrt};
use super::plan::Plan;
use super::spec::Method;
use crate::error::Result;
use candle_core::{DType, Device, Tensor};

/// One layer's attention projections in f64: q, k, v as (rows, C + 1) with the bias (or
/// zeros) as the last column; o as (C, H·D), its bias untouched by any conversion.
pub struct Projections {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
}

/// The shape of the heads: `d` dims each, RoPE pairs `(a, b)` by `Heads::pair`.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub d: usize,
    /// Pairs (2i, 2i+1) rather than (i, i + d/2).
    pub interleaved: bool,
}

impl Heads {
    pub(super) fn pair(&self, i: usize) -> (usize, usize) {
        match self.interleaved {
            true => (2 * i, 2 * i + 1),
            false => (i, i + self.d / 2),
        }
    }
}

/// A row-major matrix being assembled, then made a tensor.
struct Map {
    rows: usize,
    cols: usize,
    data: Vec<f64>,
}

impl Map {
    fn zeros(rows: usize, cols: usize) -> Self {
        let data = vec![0.0; rows * cols];
        Self { rows, cols, data }
    }

    fn identity(n: usize) -> Self {
        let mut m = Self::zeros(n, n);
        (0..n).for_each(|i| m.data[i * n + i] = 1.0);
        m
    }

    fn set(&mut self, r: usize, c: usize, x: f64) {
        self.data[r * self.cols + c] = x;
    }

    fn tensor(self) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.data,
            (self.rows, self.cols),
            &Device::Cpu,
        )?)
    }
}

fn to_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.flatten_all()?.to_vec1::<f64>()?)
}

/// The converted layer. `moment` is E[x̃ x̃ᵀ] of the attention's input with a constant 1
/// appended, (C + 1, C + 1); `aware` needs it for groups that merge heads.
pub fn convert(
    plan: &Plan,
    heads: Heads,
    w: &Projections,
    moment: Option<&Tensor>,
) -> Result<Projections> {
    let t = maps(plan, heads, w, moment)?;
    Ok(Projections {
        q: match &t.q {
            Some(t_q) => t_q.matmul(&w.q)?,
            None => w.q.clone(),
        },
        k: t.k.matmul(&w.k)?,
        v: t.v.matmul(&w.v)?,
        o: match &t.o {
            Some(t_o) => w.o.matmul(t_o)?,
            None => w.o.clone(),
        },
    })
}

/// The maps of [`convert`]: W_q' = T_q·W_q, W_k' = T_k·W_k, W_v' = T_v·W_v, W_o' = W_o·T_o,
/// with T_q and T_o `None` where they are the identity (every conversion but `aware`'s
/// merges). Each query head's block of T_q is a complex scalar per RoPE pair.
pub struct Maps {
    pub q: Option<Tensor>,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Option<Tensor>,
}

/// Builds the [`Maps`] of one layer (see [`convert`]).
pub fn maps(plan: &Plan, heads: Heads, w: &Projections, moment: Option<&Tensor>) -> Result<Maps> {
    let (h, g_from, g_to, d) = (
        plan.num_heads,
        plan.from_kv_heads,
        plan.to_kv_heads,
        heads.d,
    );
    let mut t_k = Map::zeros(g_to * d, g_from * d);
    let mut t_v = Map::zeros(g_to * d, g_from * d);
    let mut t_q = Map::identity(h * d);
    let mut t_o = Map::identity(h * d);
    let fit = match (plan.method, moment) {
        (Method::Aware, Some(m)) if !plan.is_exact() => Some(Fit::new(w, m)?),
        _ => None,
    };
    for j in 0..g_to {
        let sources = plan.sources(j);
        match (&fit, sources.len()) {
            (Some(fit), n) if n > 1 => {
                fit.keys(plan, heads, j, &mut t_k, &mut t_q);
                fit.values(plan, d, j, &mut t_v, &mut t_o);
            }
            // One source is a copy; several, their mean weighted by the queries reading each.
            _ => {
                let per = plan.queries(j).len() as f64;
                for q in plan.queries(j) {
                    let g = plan.source_head(q);
                    for i in 0..d {
                        t_k.data[(j * d + i) * t_k.cols + g * d + i] += 1.0 / per;
                        t_v.data[(j * d + i) * t_v.cols + g * d + i] += 1.0 / per;
                    }
                }
            }
        }
    }
    let merged = fit.is_some();
    Ok(Maps {
        q: merged.then(|| t_q.tensor()).transpose()?,
        k: t_k.tensor()?,
        v: t_v.tensor()?,
        o: merged.then(|| t_o.tensor()).transpose()?,
    })
}

/// What the aware fit reads of a layer: second moments of the original keys, values and
/// queries over the calibration inputs, and the output projection's Gram matrix.
struct Fit {
    /// E[k kᵀ] of the original keys, (G·D)², and likewise the values.
    keys: Vec<f64>,
    values: Vec<f64>,
    /// E[q_i²] per query row (H·D).
    query_energy: Vec<f64>,
    /// W_oᵀ W_o, (H·D)².
    gram_o: Vec<f64>,
    kv_rows: usize,
    q_rows: usize,
}

impl Fit {
    fn new(w: &Projections, moment: &Tensor) -> Result<Self> {
        let second = |p: &Tensor| -> Result<Tensor> { Ok(p.matmul(moment)?.matmul(&p.t()?)?) };
        let qm = w.q.matmul(moment)?;
        let query_energy = (qm * &w.q)?.sum(1)?;
        Ok(Self {
            keys: to_vec(&second(&w.k)?)?,
            values: to_vec(&second(&w.v)?)?,
            query_energy: to_vec(&query_energy)?,
            gram_o: to_vec(&w.o.t()?.matmul(&w.o)?)?,
            kv_rows: w.k.dim(0)?,
            q_rows: w.q.dim(0)?,
        })
    }

    /// Group `j`'s merged key, one complex weight per source head and RoPE frequency, and
    /// the matching complex scalar folded into each of its query heads.
    fn keys(&self, plan: &Plan, heads: Heads, j: usize, t_k: &mut Map, t_q: &mut Map) {
        let (d, sources) = (heads.d, plan.sources(j));
        let n = sources.len();
        let kc = |r: usize, c: usize| self.keys[r * self.kv_rows + c];
        for p in 0..d / 2 {
            let (a, b) = heads.pair(p);
            // The energy of the queries reading each source at this frequency.
            let mut energy = vec![0.0; n];
            for q in plan.queries(j) {
                let s = sources
                    .iter()
                    .position(|&g| g == plan.source_head(q))
                    .unwrap_or(0);
                energy[s] += self.query_energy[q * d + a] + self.query_energy[q * d + b];
            }
            let mean = energy.iter().sum::<f64>() / n as f64;
            energy
                .iter_mut()
                .for_each(|e| *e = e.max(1e-9 * mean).max(1e-300));
            // M = E[y yᴴ], y_s = √e_s·z_s, as the real symmetric [[Re, -Im], [Im, Re]].
            let mut m = vec![0.0; 4 * n * n];
            for (s, &g) in sources.iter().enumerate() {
                for (t, &u) in sources.iter().enumerate() {
                    let (ga, gb, ua, ub) = (g * d + a, g * d + b, u * d + a, u * d + b);
                    let w = (energy[s] * energy[t]).sqrt();
                    let re = w * (kc(ga, ua) + kc(gb, ub));
                    let im = w * (kc(gb, ua) - kc(ga, ub));
                    m[s * 2 * n + t] = re;
                    m[(n + s) * 2 * n + n + t] = re;
                    m[s * 2 * n + n + t] = -im;
                    m[(n + s) * 2 * n + t] = im;
                }
            }
            let (_, vecs) = eigh(&m, 2 * n);
            for (s, &g) in sources.iter().enumerate() {
                // v_s, the top eigenvector's entry: z' = Σ conj(v_s)·√e_s·z_s, and z_s ≈
                // (v_s / √e_s)·z', so a query w of source s becomes w·conj(v_s) / √e_s.
                let (x, y) = (vecs[s * 2 * n], vecs[(n + s) * 2 * n]);
                let root = energy[s].sqrt();
                let (re, im) = (x * root, -y * root);
                let (ja, jb) = (j * d + a, j * d + b);
                t_k.set(ja, g * d + a, re);
                t_k.set(ja, g * d + b, -im);
                t_k.set(jb, g * d + a, im);
                t_k.set(jb, g * d + b, re);
                let (re, im) = (x / root, -y / root);
                for q in plan.queries(j).filter(|&q| plan.source_head(q) == g) {
                    let (qa, qb) = (q * d + a, q * d + b);
                    t_q.set(qa, qa, re);
                    t_q.set(qa, qb, -im);
                    t_q.set(qb, qa, im);
                    t_q.set(qb, qb, re);
                }
            }
        }
    }

    /// Group `j`'s value head v' = R·[v_s]: the rank-D fit of every query head's output
    /// contribution W_o,q·v_{g(q)}, weighted by the values' covariance Σ = K²: the top-D
    /// eigenvectors W of K·G·K (G: the W_oᵀW_o blocks of the queries reading each source)
    /// give R = Wᵀ·K⁺ and each query head's new W_o,q = W_o,q·(K·W)_{block of its source}.
    fn values(&self, plan: &Plan, d: usize, j: usize, t_v: &mut Map, t_o: &mut Map) {
        let sources = plan.sources(j);
        let nd = sources.len() * d;
        let mut sigma = vec![0.0; nd * nd];
        let mut gram = vec![0.0; nd * nd];
        for (s, &g) in sources.iter().enumerate() {
            for (t, &u) in sources.iter().enumerate() {
                for r in 0..d {
                    for c in 0..d {
                        let x = self.values[(g * d + r) * self.kv_rows + u * d + c];
                        sigma[(s * d + r) * nd + t * d + c] = x;
                    }
                }
            }
            for q in plan.queries(j).filter(|&q| plan.source_head(q) == g) {
                for r in 0..d {
                    for c in 0..d {
                        let x = self.gram_o[(q * d + r) * self.q_rows + q * d + c];
                        gram[(s * d + r) * nd + s * d + c] += x;
                    }
                }
            }
        }
        let (root, inv_root) = sqrt_and_pinv_sqrt(&sigma, nd);
        let kgk = matmul(&matmul(&root, &gram, nd, nd, nd), &root, nd, nd, nd);
        let (_, vecs) = eigh(&kgk, nd);
        // W: the first d columns, (nd, d).
        let w: Vec<f64> = (0..nd * d).map(|k| vecs[(k / d) * nd + k % d]).collect();
        let wt: Vec<f64> = (0..d * nd).map(|k| w[(k % nd) * d + k / nd]).collect();
        let r = matmul(&wt, &inv_root, d, nd, nd); // (d, nd)
        let kw = matmul(&root, &w, nd, nd, d); // (nd, d)
        for (s, &g) in sources.iter().enumerate() {
            for row in 0..d {
                for c in 0..d {
                    t_v.set(j * d + row, g * d + c, r[row * nd + s * d + c]);
                }
            }
            for q in plan.queries(j).filter(|&q| plan.source_head(q) == g) {
                for row in 0..d {
                    for c in 0..d {
                        t_o.set(q * d + row, q * d + c, kw[(s * d + row) * d + c]);
                    }
                }
            }
        }
    }
}

/// `x` (rows, C) and its bias (rows) as (rows, C + 1) in f64.
pub fn augment(x: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let x = x.to_dtype(DType::F64)?;
    let col = match bias {
        Some(b) => b.to_dtype(DType::F64)?.unsqueeze(1)?,
        None => Tensor::zeros((x.dim(0)?, 1), DType::F64, x.device())?,
    };
    Ok(Tensor::cat(&[&x, &col], 1)?)
}
