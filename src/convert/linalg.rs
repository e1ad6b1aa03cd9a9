//! The linear algebra the conversions need beyond candle's products: the eigen-decomposition
//! of a symmetric matrix (nalgebra's, Householder tridiagonalisation and implicit QR: a
//! 384×384 one, the low-rank fit of a 3-K/V-head layer, takes milliseconds), on row-major
//! f64 slices as the fits build them.

use nalgebra::{DMatrix, SymmetricEigen};

/// Eigenvalues of the symmetric `n`×`n` matrix `a` (row-major) in descending order, and
/// its eigenvectors as the columns of an `n`×`n` row-major matrix, in the same order.
pub fn eigh(a: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    assert_eq!(a.len(), n * n, "eigh: a is not n×n");
    // Symmetrised, so rounding in how `a` was built cannot tilt the result.
    let m = DMatrix::from_fn(n, n, |i, j| 0.5 * (a[i * n + j] + a[j * n + i]));
    let eig = SymmetricEigen::new(m);
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| eig.eigenvalues[j].total_cmp(&eig.eigenvalues[i]));
    let values = order.iter().map(|&i| eig.eigenvalues[i]).collect();
    let vectors = (0..n * n)
        .map(|k| eig.eigenvectors[(k / n, order[k % n])])
        .collect();
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
