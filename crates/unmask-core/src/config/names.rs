//! The tensors of a transformer block; each family names them (`family/`).

/// One tensor of a transformer block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    QBias,
    K,
    KBias,
    V,
    VBias,
    /// The attention output projection.
    O,
    FfnNorm,
    /// The SwiGLU gate (LLaDA's `ff_proj`).
    Gate,
    Up,
    /// The MLP output (LLaDA's block `ff_out`).
    Down,
}

impl LayerTensor {
    /// Every tensor of a block, in checkpoint order.
    pub const ALL: [LayerTensor; 12] = [
        LayerTensor::AttnNorm,
        LayerTensor::Q,
        LayerTensor::QBias,
        LayerTensor::K,
        LayerTensor::KBias,
        LayerTensor::V,
        LayerTensor::VBias,
        LayerTensor::O,
        LayerTensor::FfnNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
    ];

    pub fn is_bias(self) -> bool {
        matches!(
            self,
            LayerTensor::QBias | LayerTensor::KBias | LayerTensor::VBias
        )
    }
}
