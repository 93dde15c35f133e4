//! The crate's error type.

use thiserror::Error;

/// Everything that can go wrong in `fx-kernels`. Messages name the argument and the
/// function (or kernel) they concern, so a failure deep in a training loop can be traced.
#[derive(Debug, Error)]
pub enum Error {
    /// A length or shape does not match what the function needs.
    #[error("{what}: shape mismatch in {context}: expected {expected}, got {got}")]
    Shape {
        /// The argument whose shape is wrong.
        what: &'static str,
        /// The function or kernel that checked it.
        context: &'static str,
        /// The expected shape, in words.
        expected: String,
        /// The shape that was passed.
        got: String,
    },
    /// An index or action is outside its valid range.
    #[error("{what} = {value} out of range (must be < {bound}) in {context}")]
    OutOfRange {
        /// What the value is (e.g. `actions[3]`).
        what: String,
        /// The offending value.
        value: u64,
        /// The exclusive upper bound.
        bound: u64,
        /// The function or kernel that checked it.
        context: &'static str,
    },
    /// A NaN or infinite value where only finite values are allowed.
    #[error("{what}: non-finite value {value} at index {index} in {context}")]
    NonFinite {
        /// The argument that holds it.
        what: &'static str,
        /// Flat index of the first bad value.
        index: usize,
        /// The value itself.
        value: f64,
        /// The function that checked it.
        context: &'static str,
    },
    /// A configuration that cannot work (series too short, zero capacity, ...).
    #[error("invalid configuration in {context}: {message}")]
    Config {
        /// Where the configuration was checked.
        context: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A configuration beyond what a fused kernel supports (too wide, too deep, too many
    /// actions); the caller can fall back to the general (candle) path.
    #[error("unsupported by {context}: {message}")]
    Unsupported {
        /// The kernel or function whose limit was hit.
        context: &'static str,
        /// What exceeds which limit.
        message: String,
    },
    /// A tensor has the wrong dtype.
    #[error("{what}: expected dtype {expected:?}, got {got:?} in {context}")]
    DType {
        /// The argument.
        what: &'static str,
        /// The dtype the function needs.
        expected: candle_core::DType,
        /// The dtype that was passed.
        got: candle_core::DType,
        /// The function that checked it.
        context: &'static str,
    },
    /// A tensor lives on a device other than the one it must be on.
    #[error("{what}: tensor is on the wrong device in {context} (expected {expected})")]
    Device {
        /// The argument.
        what: &'static str,
        /// The device the env/buffer lives on, in words.
        expected: String,
        /// The function that checked it.
        context: &'static str,
    },
    /// Sampling or reading from an empty buffer.
    #[error("{what} is empty in {context}")]
    Empty {
        /// The buffer.
        what: &'static str,
        /// The function that was called.
        context: &'static str,
    },
    /// A storage (rollout) is full and cannot take another step.
    #[error("{what} is full ({capacity} steps) in {context}")]
    Full {
        /// The storage.
        what: &'static str,
        /// Its capacity.
        capacity: usize,
        /// The function that was called.
        context: &'static str,
    },
    /// An error from candle, with the operation it came from.
    #[error("candle error in {context}: {source}")]
    Candle {
        /// The operation in this crate that called candle.
        context: &'static str,
        /// The underlying candle error.
        #[source]
        source: candle_core::Error,
    },
    /// An error from the CUDA driver (cudarc), with the operation it came from.
    #[cfg(feature = "cuda")]
    #[error("CUDA driver error in {context}: {message}")]
    Cuda {
        /// The operation (kernel launch, copy, module load).
        context: &'static str,
        /// The driver's message.
        message: String,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Attach a context to candle results: `tensor_op().ctx("ReplayBuffer::push_batch")?`.
pub trait CandleContext<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> CandleContext<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Candle { context, source })
    }
}

impl Error {
    /// Shorthand for a [`Error::Shape`].
    pub fn shape(
        what: &'static str,
        context: &'static str,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::Shape { what, context, expected: expected.to_string(), got: got.to_string() }
    }
}

/// Lets callers mix candle calls and this crate's calls under `?`; the context says only
/// that the error came from outside this crate's own operations.
impl From<candle_core::Error> for Error {
    fn from(source: candle_core::Error) -> Self {
        Error::Candle { context: "a candle operation (caller side)", source }
    }
}
