//! Matrix products as the model uses them.

/// `y = x · Wᵀ` for `x` `[m, k]` and an `nn.Linear` weight `w` `[n, k]`, both row-major and
/// contiguous; returns `y` `[m, n]`. Sums in f64 and rounds once.
pub fn matmul_xwt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert_eq!(
        x.len(),
        m * k,
        "matmul_xwt: x must hold m * k = {} values",
        m * k
    );
    assert_eq!(
        w.len(),
        n * k,
        "matmul_xwt: w must hold n * k = {} values",
        n * k
    );
    let mut y = vec![0f32; m * n];
    for row in 0..m {
        let xr = &x[row * k..(row + 1) * k];
        for col in 0..n {
            let wr = &w[col * k..(col + 1) * k];
            let sum: f64 = xr
                .iter()
                .zip(wr)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum();
            y[row * n + col] = sum as f32;
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_product_by_hand() {
        // x [2, 3], w [2, 3]: y[i][j] = x_i · w_j
        let x = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
        let w = [1.0, 0.0, -1.0, 2.0, 1.0, 0.5];
        assert_eq!(matmul_xwt(&x, &w, 2, 2, 3), vec![-2.0, 5.5, -3.0, -0.5]);
    }
}
