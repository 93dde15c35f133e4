//! placeholder
pub const WARMUP: usize = 100;
