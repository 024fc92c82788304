//! Defaults of the reference `ModelConfig` dataclass. Several are dangerous for LLaDA
//! (`rope = false`, `weight_tying = true`, `embedding_size = 50304`, `block_type =
//! "sequential"`, ...), but a hand-written config that leaves a key out means exactly these.

pub const D_MODEL: u64 = 768;
pub const N_HEADS: u64 = 12;
pub const N_LAYERS: u64 = 12;
pub const MLP_RATIO: u64 = 4;
pub const ACTIVATION_TYPE: &str = "swiglu";
pub const BLOCK_TYPE: &str = "sequential";
pub const ALIBI: bool = false;
pub const ROPE: bool = false;
pub const ROPE_FULL_PRECISION: bool = true;
pub const ATTENTION_LAYER_NORM: bool = false;
pub const INPUT_EMB_NORM: bool = false;
pub const LAYER_NORM_TYPE: &str = "default";
pub const LAYER_NORM_WITH_AFFINE: bool = true;
pub const RMS_NORM_EPS: f64 = 1e-5;
pub const MAX_SEQUENCE_LENGTH: u64 = 1024;
pub const ROPE_THETA: f64 = 10000.0;
pub const INCLUDE_QKV_BIAS: bool = false;
pub const INCLUDE_BIAS: bool = false;
pub const SCALE_LOGITS: bool = false;
pub const VOCAB_SIZE: u64 = 50257;
pub const EMBEDDING_SIZE: u64 = 50304;
pub const WEIGHT_TYING: bool = true;
pub const EOS_TOKEN_ID: u64 = 50256;
pub const PAD_TOKEN_ID: u64 = 50256;
pub const MASK_TOKEN_ID: u64 = 50256;
