//! Bounds on a config's sizes, checked before anything is allocated from them: far above
//! any published model (LLaDA-8B's value in each comment) and far below what overflows a
//! size computation or asks the allocator for terabytes.

/// 32.
pub const MAX_LAYERS: usize = 1024;
/// 4096.
pub const MAX_D_MODEL: usize = 1 << 17;
/// 32.
pub const MAX_HEADS: usize = 1024;
/// 12288.
pub const MAX_MLP_HIDDEN: usize = 1 << 20;
/// 126464 (vocab_size and embedding_size).
pub const MAX_VOCAB: usize = 1 << 24;
/// 4096.
pub const MAX_SEQUENCE_LENGTH: usize = 1 << 20;
/// About 8.0e9.
pub const MAX_PARAMETERS: u64 = 1 << 40;
/// DiffusionGemma-26B-A4B: 128 experts per layer.
pub const MAX_EXPERTS: usize = 1 << 12;

/// `value` of `field` at most `max`, the runtime's bound on that size.
pub(crate) fn check_bound(
    field: &'static str,
    value: usize,
    max: usize,
) -> Result<(), crate::error::ConfigError> {
    if value > max {
        return Err(crate::error::ConfigError::Invalid {
            field,
            expected: format!("at most {max} (the runtime's bound on this size)"),
            found: value.to_string(),
        });
    }
    Ok(())
}
