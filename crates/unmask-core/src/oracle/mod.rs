//! Plain, readable CPU versions of every GPU kernel, accumulating in f64.
//! They are the reference the kernels are tested against, not a product backend.

pub mod attention;
pub mod basic;
pub mod matmul;
pub mod moe;
pub mod sampling;

pub use basic::*;
