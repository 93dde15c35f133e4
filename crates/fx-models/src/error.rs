//! The crate's error type.

/// Errors of fx-models: tensor failures, parameter files that do not match the spec,
/// bad configurations and inputs of the wrong shape.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A candle operation failed (shape mismatch inside a model, device error, I/O of a
    /// safetensors file, ...).
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    /// A parameter the model needs is absent from the loaded tensors.
    #[error("parameter `{name}` is missing from {source_desc}")]
    MissingParam { name: String, source_desc: String },
    /// A tensor in the loaded file is not a parameter of this model.
    #[error("`{name}` in {source_desc} is not a parameter of this model")]
    UnknownParam { name: String, source_desc: String },
    /// A parameter has the wrong shape.
    #[error(
        "parameter `{name}` has shape {got:?} in {source_desc}, the model expects {expected:?}"
    )]
    ParamShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
        source_desc: String,
    },
    /// A model input has the wrong shape.
    #[error("input `{name}` has shape {got:?}, expected {expected}")]
    InputShape {
        name: &'static str,
        expected: String,
        got: Vec<usize>,
    },
    /// A configuration value is unusable.
    #[error("invalid configuration: {0}")]
    Config(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;
