//! The crate's error type: every message is one line naming what is wrong and where.

use thiserror::Error;

/// Everything that can go wrong in `fx-quant`.
#[derive(Debug, Error)]
pub enum Error {
    /// A slice has the wrong length.
    #[error("{what}: expected {expected} values, got {got} in {context}")]
    Length {
        /// The argument.
        what: &'static str,
        /// The length the function needs.
        expected: usize,
        /// The length that was passed.
        got: usize,
        /// The function that checked it.
        context: &'static str,
    },
    /// A NaN or infinity where only finite values are allowed (observations, weights).
    #[error("{what}: non-finite value {value} at index {index} in {context}")]
    NonFinite {
        /// The argument that holds it.
        what: String,
        /// Flat index of the first bad value.
        index: usize,
        /// The value.
        value: f64,
        /// The function that checked it.
        context: &'static str,
    },
    /// A setting or network that cannot be quantised as asked (unknown layer name,
    /// percentile out of range, no calibration rows, layer dimensions that do not chain).
    #[error("invalid {what}: {message}")]
    Invalid {
        /// What was checked.
        what: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A quantised checkpoint that is not what it claims (format, metadata, a tensor's
    /// dtype, shape or values, the source checkpoint's hash).
    #[error("{path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong, naming the tensor or metadata key.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Reading the F32 network failed.
    #[error("{context}: {source}")]
    Model {
        /// What was being read.
        context: &'static str,
        /// The model crate's error.
        source: fx_models::Error,
    },
    /// A tensor operation failed while copying weights to the host.
    #[error("{context}: {source}")]
    Candle {
        /// What was being read.
        context: String,
        /// candle's error (one line: its message, not its backtrace).
        source: candle_core::Error,
    },
    /// The F32 CPU policy refused an observation (through the [`crate::Decide`] trait).
    #[error("{0}")]
    Kernels(#[from] fx_kernels::Error),
}

/// Shorthand for results in this crate.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn invalid(what: &'static str, message: impl Into<String>) -> Self {
        Error::Invalid { what, message: message.into() }
    }

    pub(crate) fn file(path: &std::path::Path, message: impl Into<String>) -> Self {
        Error::File { path: path.display().to_string(), message: message.into() }
    }

    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        Error::Io { path: path.display().to_string(), source }
    }
}

/// The index and value of the first non-finite element, if any.
pub(crate) fn first_non_finite(v: &[f32]) -> Option<(usize, f32)> {
    v.iter().position(|x| !x.is_finite()).map(|i| (i, v[i]))
}
