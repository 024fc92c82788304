//! Block quantization of weight rows, on the CPU: the codes and scales the GPU kernels
//! decode, and the reference dequantization the kernel tests compare against.
//!
//! Both formats cut each row into blocks of [`BLOCK`] consecutive weights along K; a block
//! stores one f16 scale `d` and one small signed integer `q` per weight, and a weight is
//! `q * d`. There is no offset (symmetric quantization), so a dot product with a block is
//! `d * Σ x q`.
//!
//! - `q8`: `q` in -127..=127, one byte each (two's complement), `d = amax / 127`.
//!   8.5 bits per weight.
//! - `q4`: `q` in -8..=7, stored as `q + 8` in a 4-bit nibble. The scale is signed so that
//!   the block's largest-magnitude weight maps to -8, and it is made just large enough that
//!   the weights of the other sign fit in +7 (the 16th code is used, nothing is clipped).
//!   4.5 bits per weight.
//!
//! The scale is rounded *away from zero* to f16, so no weight ever needs a code outside the
//! range: every weight is within `|d| / 2` of its dequantized value.
//!
//! Rows are padded with zero weights to a multiple of [`ROW_ALIGN`] (two blocks), so a
//! row's scales fill whole 32-bit words and any run of rows can be uploaded on its own.
//!
//! Byte layout of `rows` quantized rows of `cols` weights (`P = padded_cols(cols)`):
//! - codes, row-major: q8 has `P` bytes per row, byte `e` is weight `e`; q4 has `P / 2`
//!   bytes per row, weight `e` in byte `e / 2`, low nibble for even `e`. Read as
//!   little-endian u32 words, weight `e` of a row is byte `e % 4` (q8) or nibble `e % 8`
//!   (q4) of word `e / 4` (q8) or `e / 8` (q4).
//! - scales, row-major: `P / 32` little-endian f16 per row, scale `b` for weights
//!   `32 b .. 32 b + 31`.

use half::f16;
use thiserror::Error;

/// Weights per block (one scale each).
pub const BLOCK: usize = 32;

/// Quantized rows are padded to a multiple of this many weights.
pub const ROW_ALIGN: usize = 64;

/// A block quantization format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    Q8,
    Q4,
}

/// A weight that cannot be quantized.
#[derive(Debug, Error, PartialEq)]
pub enum QuantError {
    #[error("weight {index} is {value}: only finite weights can be quantized")]
    NotFinite { index: usize, value: f32 },
    #[error(
        "weight {index} is {value}: its block's scale does not fit in f16 (largest magnitude about {max})"
    )]
    ScaleOverflow { index: usize, value: f32, max: f32 },
}

impl QuantFormat {
    pub const ALL: [QuantFormat; 2] = [QuantFormat::Q8, QuantFormat::Q4];

    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8 => "q8",
            QuantFormat::Q4 => "q4",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// Smallest and largest code.
    pub fn code_range(self) -> (i32, i32) {
        match self {
            QuantFormat::Q8 => (-127, 127),
            QuantFormat::Q4 => (-8, 7),
        }
    }

    /// Largest weight magnitude any block can hold (its scale must be a finite f16).
    pub fn max_magnitude(self) -> f32 {
        let max_scale = f16::MAX.to_f32();
        match self {
            QuantFormat::Q8 => max_scale * 127.0,
            QuantFormat::Q4 => max_scale * 8.0,
        }
    }

    /// Bytes of codes per row.
    pub fn row_code_bytes(self, cols: usize) -> usize {
        match self {
            QuantFormat::Q8 => padded_cols(cols),
            QuantFormat::Q4 => padded_cols(cols) / 2,
        }
    }

    /// Bytes of codes and scales per row.
    pub fn row_bytes(self, cols: usize) -> usize {
        self.row_code_bytes(cols) + row_scale_bytes(cols)
    }

    /// Quantizes whole rows of `cols` weights from `src` (row-major, a multiple of `cols`
    /// values) into `codes` and `scales`, which must hold exactly that many rows (see
    /// `row_code_bytes` and `row_scale_bytes`).
    pub fn quantize_rows(
        self,
        src: &[f32],
        cols: usize,
        codes: &mut [u8],
        scales: &mut [u8],
    ) -> Result<(), QuantError> {
        let rows = src.len().checked_div(cols).unwrap_or(0);
        assert!(
            cols > 0 && src.len() == rows * cols,
            "quantize_rows: {} values are not whole rows of {cols}",
            src.len()
        );
        let code_row = self.row_code_bytes(cols);
        let scale_row = row_scale_bytes(cols);
        assert_eq!(codes.len(), rows * code_row, "codes buffer size");
        assert_eq!(scales.len(), rows * scale_row, "scales buffer size");
        let mut block = [0f32; BLOCK];
        for r in 0..rows {
            let row = &src[r * cols..(r + 1) * cols];
            let row_codes = &mut codes[r * code_row..(r + 1) * code_row];
            for b in 0..padded_cols(cols) / BLOCK {
                let start = (b * BLOCK).min(cols);
                let end = ((b + 1) * BLOCK).min(cols);
                block.fill(0.0);
                block[..end - start].copy_from_slice(&row[start..end]);
                let first = r * cols + start;
                let (scale, q) = self.quantize_block(&block, first)?;
                let s = 2 * (r * (scale_row / 2) + b);
                scales[s..s + 2].copy_from_slice(&scale.to_le_bytes());
                match self {
                    QuantFormat::Q8 => {
                        for (c, v) in row_codes[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(q) {
                            *c = v as u8;
                        }
                    }
                    QuantFormat::Q4 => {
                        let out = &mut row_codes[b * BLOCK / 2..(b + 1) * BLOCK / 2];
                        for (j, c) in out.iter_mut().enumerate() {
                            let lo = (q[2 * j] + 8) as u8;
                            let hi = (q[2 * j + 1] + 8) as u8;
                            *c = lo | (hi << 4);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The f16 scale and codes of one block; `first` is the index of its first weight, for
    /// error messages.
    fn quantize_block(
        self,
        block: &[f32; BLOCK],
        first: usize,
    ) -> Result<(f16, [i32; BLOCK]), QuantError> {
        if let Some(i) = block.iter().position(|v| !v.is_finite()) {
            return Err(QuantError::NotFinite {
                index: first + i,
                value: block[i],
            });
        }
        // The weight of largest magnitude (the first one on ties).
        let mut extreme = 0f32;
        for &v in block {
            if v.abs() > extreme.abs() {
                extreme = v;
            }
        }
        if extreme == 0.0 {
            return Ok((f16::ZERO, [0; BLOCK]));
        }
        let scale = match self {
            QuantFormat::Q8 => extreme.abs() / 127.0,
            QuantFormat::Q4 => {
                // `extreme` maps to -8; the other sign must reach at most +7.
                let other = block
                    .iter()
                    .filter(|v| v.is_sign_positive() != extreme.is_sign_positive())
                    .fold(0f32, |m, v| m.max(v.abs()));
                let magnitude = (extreme.abs() / 8.0).max(other / 7.0);
                if extreme > 0.0 { -magnitude } else { magnitude }
            }
        };
        let Some(d) = f16_away_from_zero(scale) else {
            let i = block.iter().position(|&v| v == extreme).unwrap_or(0);
            return Err(QuantError::ScaleOverflow {
                index: first + i,
                value: extreme,
                max: self.max_magnitude(),
            });
        };
        let (lo, hi) = self.code_range();
        let df = f64::from(d.to_f32());
        let mut q = [0i32; BLOCK];
        for (c, &v) in q.iter_mut().zip(block) {
            *c = ((f64::from(v) / df).round() as i32).clamp(lo, hi);
        }
        Ok((d, q))
    }

    /// Dequantizes `rows` rows of `cols` weights (the padding is dropped).
    pub fn dequantize_rows(
        self,
        codes: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
    ) -> Vec<f32> {
        let code_row = self.row_code_bytes(cols);
        let scale_row = row_scale_bytes(cols);
        assert!(codes.len() >= rows * code_row, "codes buffer size");
        assert!(scales.len() >= rows * scale_row, "scales buffer size");
        let mut out = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            let row_codes = &codes[r * code_row..(r + 1) * code_row];
            let row_scales = &scales[r * scale_row..(r + 1) * scale_row];
            for e in 0..cols {
                let b = e / BLOCK;
                let d = f16::from_le_bytes([row_scales[2 * b], row_scales[2 * b + 1]]).to_f32();
                out.push(self.code(row_codes, e) as f32 * d);
            }
        }
        out
    }

    /// The code of weight `e` of a row.
    pub fn code(self, row_codes: &[u8], e: usize) -> i32 {
        match self {
            QuantFormat::Q8 => i32::from(row_codes[e] as i8),
            QuantFormat::Q4 => i32::from((row_codes[e / 2] >> (4 * (e % 2))) & 15) - 8,
        }
    }
}

/// `cols` rounded up to a whole number of `ROW_ALIGN` weights (at least one).
pub fn padded_cols(cols: usize) -> usize {
    cols.max(1).div_ceil(ROW_ALIGN) * ROW_ALIGN
}

/// Blocks (scales) per row.
pub fn row_blocks(cols: usize) -> usize {
    padded_cols(cols) / BLOCK
}

/// Bytes of f16 scales per row; a multiple of 4.
pub fn row_scale_bytes(cols: usize) -> usize {
    2 * row_blocks(cols)
}

/// The f16 nearest to `x` whose magnitude is not below |x|; None past the f16 range.
fn f16_away_from_zero(x: f32) -> Option<f16> {
    let mut h = f16::from_f32(x);
    if h.to_f32().abs() < x.abs() {
        // Sign and magnitude are separate bits: the next magnitude up is the next encoding.
        h = f16::from_bits(h.to_bits() + 1);
    }
    h.is_finite().then_some(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantize(format: QuantFormat, src: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>) {
        let rows = src.len() / cols;
        let mut codes = vec![0u8; rows * format.row_code_bytes(cols)];
        let mut scales = vec![0u8; rows * row_scale_bytes(cols)];
        format
            .quantize_rows(src, cols, &mut codes, &mut scales)
            .unwrap();
        (codes, scales)
    }

    fn scale(scales: &[u8], i: usize) -> f32 {
        f16::from_le_bytes([scales[2 * i], scales[2 * i + 1]]).to_f32()
    }

    /// Deterministic weights in [-amp, amp).
    fn weights(seed: u64, n: usize, amp: f32) -> Vec<f32> {
        let mut rng = crate::rng::SplitMix64(seed);
        (0..n)
            .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32 * amp)
            .collect()
    }

    #[test]
    fn sizes_follow_the_padding() {
        assert_eq!(padded_cols(1), 64);
        assert_eq!(padded_cols(64), 64);
        assert_eq!(padded_cols(65), 128);
        assert_eq!(row_blocks(130), 6);
        assert_eq!(row_scale_bytes(4096), 256);
        assert_eq!(QuantFormat::Q8.row_code_bytes(4096), 4096);
        assert_eq!(QuantFormat::Q4.row_code_bytes(4096), 2048);
        // 8.5 and 4.5 bits per weight once K is a multiple of the row alignment.
        assert_eq!(QuantFormat::Q8.row_bytes(4096) * 8, 4096 * 17 / 2);
        assert_eq!(QuantFormat::Q4.row_bytes(4096) * 8, 4096 * 9 / 2);
        assert_eq!(QuantFormat::from_name("q4"), Some(QuantFormat::Q4));
        assert_eq!(QuantFormat::from_name("q5"), None);
    }

    #[test]
    fn q8_known_block() {
        // amax 12.7: scale 0.1 rounded up to f16, codes round(v / d).
        let mut src = vec![0f32; 64];
        src[0] = 12.7;
        src[1] = -6.35;
        src[2] = 0.1;
        src[3] = -0.04;
        src[33] = -1.0; // second block: amax 1 → scale 1/127
        let (codes, scales) = quantize(QuantFormat::Q8, &src, 64);
        let d = scale(&scales, 0);
        assert_eq!(f16::from_f32(d), f16_away_from_zero(0.1).unwrap());
        assert!((0.1..0.1 * (1.0 + 1.0 / 1024.0)).contains(&d), "{d}");
        assert_eq!(codes[0] as i8, 127);
        assert_eq!(codes[1] as i8, -63);
        assert_eq!(codes[2] as i8, 1);
        assert_eq!(codes[3] as i8, 0);
        assert!(codes[4..32].iter().all(|&c| c == 0));
        assert_eq!(codes[33] as i8, -127);
        assert!((scale(&scales, 1) - 1.0 / 127.0).abs() < 1e-5);
    }

    #[test]
    fn q4_known_block() {
        // Largest magnitude -4: scale +0.5, codes -8..; +3.5 fits +7 exactly.
        let mut src = vec![0f32; 7];
        src[..5].copy_from_slice(&[-4.0, 3.5, 1.0, -0.2, 0.3]);
        let (codes, scales) = quantize(QuantFormat::Q4, &src, 7);
        assert_eq!(codes.len(), 32);
        assert_eq!(scale(&scales, 0), 0.5);
        let q: Vec<i32> = (0..7).map(|e| QuantFormat::Q4.code(&codes, e)).collect();
        assert_eq!(q, [-8, 7, 2, 0, 1, 0, 0]);
        // Byte 0 holds weights 0 (low nibble) and 1 (high nibble), stored as q + 8.
        assert_eq!(codes[0], 0x0f << 4);
        // Padding weights are code 8 (value 0) in every nibble.
        assert!(codes[4..].iter().all(|&c| c == 0x88));
        assert_eq!(scale(&scales, 1), 0.0, "second (padding) block");

        // Largest magnitude positive: the scale is negative, +4 maps to -8.
        let (codes, scales) = quantize(QuantFormat::Q4, &[4.0, -1.0, 0.0, 0.0], 4);
        assert_eq!(scale(&scales, 0), -0.5);
        assert_eq!(QuantFormat::Q4.code(&codes, 0), -8);
        assert_eq!(QuantFormat::Q4.code(&codes, 1), 2);

        // The other sign is nearly as large: the scale grows so +3.9 still fits in +7.
        let (codes, scales) = quantize(QuantFormat::Q4, &[-4.0, 3.9], 2);
        let d = scale(&scales, 0);
        assert!(d >= 3.9 / 7.0, "{d}");
        assert_eq!(QuantFormat::Q4.code(&codes, 1), 7);
    }

    #[test]
    fn error_is_at_most_half_a_scale() {
        for format in QuantFormat::ALL {
            for (cols, amp) in [(7, 1.0), (33, 0.02), (64, 3.0), (130, 1e-3), (257, 50.0)] {
                let rows = 5;
                let mut src = weights(cols as u64, rows * cols, amp);
                // A block with one outlier and a block of tiny values.
                src[3] = amp * 20.0;
                for v in src[cols..cols + cols.min(32)].iter_mut() {
                    *v *= 1e-6;
                }
                let (codes, scales) = quantize(format, &src, cols);
                let back = format.dequantize_rows(&codes, &scales, rows, cols);
                let nb = row_blocks(cols);
                let mut worst = 0f64;
                for r in 0..rows {
                    for e in 0..cols {
                        let d = f64::from(scale(&scales, r * nb + e / BLOCK).abs());
                        let err =
                            (f64::from(src[r * cols + e]) - f64::from(back[r * cols + e])).abs();
                        assert!(
                            err <= d / 2.0 * (1.0 + 1e-9),
                            "{} cols {cols}: weight ({r}, {e}) = {} came back {} (scale {d})",
                            format.name(),
                            src[r * cols + e],
                            back[r * cols + e]
                        );
                        if d > 0.0 {
                            worst = worst.max(err / d);
                        }
                    }
                }
                assert!(
                    worst > 0.3,
                    "rounding should use most of the half-scale budget"
                );
            }
        }
    }

    #[test]
    fn zero_and_subnormal_blocks() {
        for format in QuantFormat::ALL {
            let (codes, scales) = quantize(format, &[0.0; 40], 40);
            assert!(scales.iter().all(|&b| b == 0));
            assert!(
                format
                    .dequantize_rows(&codes, &scales, 1, 40)
                    .iter()
                    .all(|&v| v == 0.0)
            );
            // Weights so small the scale is an f16 subnormal: still within half a scale.
            let src = [3e-8f32, -1e-7, 2e-9, 0.0];
            let (codes, scales) = quantize(format, &src, 4);
            let d = scale(&scales, 0).abs();
            assert!(d > 0.0);
            for (v, b) in src
                .iter()
                .zip(format.dequantize_rows(&codes, &scales, 1, 4))
            {
                assert!((v - b).abs() <= d / 2.0, "{v} -> {b} (scale {d})");
            }
        }
    }

    #[test]
    fn bad_weights_are_named() {
        let mut codes = vec![0u8; 64];
        let mut scales = vec![0u8; 4];
        let src = [1.0, f32::NAN, 0.0];
        let e = QuantFormat::Q8
            .quantize_rows(&src, 3, &mut codes, &mut scales)
            .unwrap_err();
        assert!(matches!(e, QuantError::NotFinite { index: 1, .. }), "{e}");
        let mut codes = vec![0u8; 32];
        let e = QuantFormat::Q4
            .quantize_rows(&[0.0, -1e6], 2, &mut codes, &mut scales)
            .unwrap_err();
        assert!(
            matches!(e, QuantError::ScaleOverflow { index: 1, .. }),
            "{e}"
        );
        // Just inside the range still works.
        let big = QuantFormat::Q4.max_magnitude() * 0.999;
        QuantFormat::Q4
            .quantize_rows(&[big, 0.0], 2, &mut codes, &mut scales)
            .unwrap();
    }
}
