//! How a weight matrix is stored: `WeightFormat`, its row layout and sizes.

use unmask_core::quant::{self, QuantFormat};

use crate::context::GpuContext;

/// How a weight matrix is stored and which kernel variant reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    /// f16 pairs in `u32` words, unpacked in the shader; works everywhere.
    F16Packed,
    /// `array<f16>` with `enable f16;`; needs `shader-f16`. Same bytes as `F16Packed`.
    F16Native,
    /// 8-bit blocks of 32 weights with an f16 scale (`unmask_core::quant`); works everywhere.
    Q8,
    /// 4-bit blocks of 32 weights with an f16 scale (`unmask_core::quant`); works everywhere.
    Q4,
}

impl WeightFormat {
    /// Every format, in the order reports list them.
    pub const ALL: [WeightFormat; 5] = [
        WeightFormat::F32,
        WeightFormat::F16Packed,
        WeightFormat::F16Native,
        WeightFormat::Q8,
        WeightFormat::Q4,
    ];

    /// Bytes per stored element of the float formats. Quantized formats store a byte (q8)
    /// or half a byte (q4) per weight plus a scale per block and report 1 here; sizes of
    /// quantized weights come from `Weight::size_bytes` or `WeightPlan`.
    pub fn element_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16Packed | WeightFormat::F16Native => 2,
            WeightFormat::Q8 | WeightFormat::Q4 => 1,
        }
    }

    /// The block quantization of a quantized format.
    pub fn quant(self) -> Option<QuantFormat> {
        match self {
            WeightFormat::Q8 => Some(QuantFormat::Q8),
            WeightFormat::Q4 => Some(QuantFormat::Q4),
            _ => None,
        }
    }

    /// The format actually usable on this device: native f16 falls back to packed.
    pub fn resolve(self, ctx: &GpuContext) -> Self {
        match self {
            WeightFormat::F16Native if !ctx.features.shader_f16 => WeightFormat::F16Packed,
            other => other,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16Packed => "f16-packed",
            WeightFormat::F16Native => "f16-native",
            WeightFormat::Q8 => "q8",
            WeightFormat::Q4 => "q4",
        }
    }

    /// Elements per row as stored: padded to 4 (vec4 loads) for float formats, to
    /// `unmask_core::quant::ROW_ALIGN` for quantized ones.
    pub fn row_stride(self, cols: usize) -> usize {
        match self.quant() {
            Some(_) => quant::padded_cols(cols),
            None => cols.div_ceil(4) * 4,
        }
    }

    /// Bytes of one stored row (codes and scales for quantized formats).
    pub fn row_bytes(self, cols: usize) -> u64 {
        match self.quant() {
            Some(q) => q.row_bytes(cols) as u64,
            None => (self.row_stride(cols) * self.element_bytes()) as u64,
        }
    }
}

impl From<QuantFormat> for WeightFormat {
    fn from(q: QuantFormat) -> Self {
        match q {
            QuantFormat::Q8 => WeightFormat::Q8,
            QuantFormat::Q4 => WeightFormat::Q4,
        }
    }
}
