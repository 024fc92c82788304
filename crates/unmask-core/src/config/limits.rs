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
