//! The one piece of linear algebra candle lacks: the eigen-decomposition of a symmetric
//! matrix (cyclic Jacobi rotations, in f64). The conversions' matrices are small (at most
//! a few hundred rows: K/V heads × head_dim), where Jacobi is simple, exact to rounding and
//! fast enough.

/// Eigenvalues of the symmetric `n`×`n` matrix `a` (row-major) in descending order, and
/// its eigenvectors as the columns of an `n`×`n` row-major matrix, in the same order.
pub fn eigh(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(a.len(), n * n, "eigh: a is not n×n");
    let mut a = a.to_vec();
    let mut v: Vec<f64> = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    let total: f64 = a.iter().map(|x| x * x).sum();
    for _sweep in 0..100 {
        let off: f64 = (0..n * n)
            .filter(|i| i / n != i % n)
            .map(|i| a[i] * a[i])
            .sum();
        if off <= 1e-30 * total || off == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                // The rotation J (c, s) that zeroes a[p][q] in Jᵀ A J (Numerical Recipes §11.1).
                let theta = (a[q * n + q] - a[p * n + p]) / (2.0 * apq);
                let sign = if theta >= 0.0 { 1.0 } else { -1.0 };
                let t = sign / (theta.abs() + (theta * theta + 1.0).sqrt());
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                for k in 0..n {
                    let (kp, kq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * kp - s * kq;
                    a[k * n + q] = s * kp + c * kq;
                }
                for k in 0..n {
                    let (pk, qk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * pk - s * qk;
                    a[q * n + k] = s * pk + c * qk;
                    let (vp, vq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vp - s * vq;
                    v[k * n + q] = s * vp + c * vq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| a[j * n + j].total_cmp(&a[i * n + i]));
    let values = order.iter().map(|&i| a[i * n + i]).collect();
    let vectors = (0..n * n).map(|k| v[(k / n) * n + order[k % n]]).collect();
    (values, vectors)
}

/// The product of row-major `a` (n×k) and `b` (k×m).
pub fn matmul(a: &[f64], b: &[f64], n: usize, k: usize, m: usize) -> Vec<f64> {
    let mut out = vec![0.0; n * m];
    for i in 0..n {
        for l in 0..k {
            let x = a[i * k + l];
            if x != 0.0 {
                for j in 0..m {
                    out[i * m + j] += x * b[l * m + j];
                }
            }
        }
    }
    out
}

/// The symmetric square root of a symmetric positive semi-definite `n`×`n` matrix, and
/// its pseudo-inverse: directions whose eigenvalue is below 1e-12 of the largest (what
/// rounding leaves of a singular matrix) are dropped from the inverse rather than blown up.
pub fn sqrt_and_pinv_sqrt(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (vals, vecs) = eigh(a, n);
    let floor = vals.first().copied().unwrap_or(0.0).max(0.0) * 1e-12;
    let (mut root, mut inv) = (vec![0.0; n * n], vec![0.0; n * n]);
    for (k, &l) in vals.iter().enumerate() {
        if l <= floor || l <= 0.0 {
            continue;
        }
        let (r, s) = (l.sqrt(), 1.0 / l.sqrt());
        for i in 0..n {
            let vi = vecs[i * n + k];
            for j in 0..n {
                let vv = vi * vecs[j * n + k];
                root[i * n + j] += r * vv;
                inv[i * n + j] += s * vv;
            }
        }
    }
    (root, inv)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eigh_rebuilds_a_symmetric_matrix_in_descending_order() {
        let n = 5;
        // A symmetric matrix with distinct eigenvalues, from a fixed pattern.
        let a: Vec<f64> = (0..n * n)
            .map(|k| {
                let (i, j) = (k / n, k % n);
                ((i * j) as f64).sin() + (i + j) as f64 * 0.1 + if i == j { i as f64 } else { 0.0 }
            })
            .collect();
        let (vals, vecs) = eigh(&a, n);
        assert!(vals.windows(2).all(|w| w[0] >= w[1]), "{vals:?}");
        for i in 0..n {
            for j in 0..n {
                let rebuilt: f64 = (0..n)
                    .map(|k| vecs[i * n + k] * vals[k] * vecs[j * n + k])
                    .sum();
                assert!((rebuilt - a[i * n + j]).abs() < 1e-10, "({i},{j})");
                let dot: f64 = (0..n).map(|k| vecs[k * n + i] * vecs[k * n + j]).sum();
                assert!((dot - f64::from(u8::from(i == j))).abs() < 1e-10);
            }
        }
        assert_eq!(eigh(&[2.0, 0.0, 0.0, 3.0], 2).0, vec![3.0, 2.0]);
    }
}
