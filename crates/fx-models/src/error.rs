//! The crate's error type.

use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong in `fx-models`. Messages name the tensor, file, argument
/// or function concerned so a failure deep inside a training run can be traced.
#[derive(Debug, Error)]
pub enum Error {
    /// A parameter file lacks a tensor the model needs.
    #[error("missing tensor `{name}` in {file} (model {model})")]
    MissingTensor {
        /// The parameter name (MODELS.md path).
        name: String,
        /// The file (or source) that was read.
        file: String,
        /// The model being loaded.
        model: &'static str,
    },
    /// A parameter file holds a tensor the model does not know.
    #[error("unknown tensor `{name}` in {file} (model {model} has no such parameter)")]
    UnknownTensor {
        /// The unexpected name.
        name: String,
        /// The file (or source) that was read.
        file: String,
        /// The model being loaded.
        model: &'static str,
    },
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` in {file} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// The tensor name.
        name: String,
        /// The file (or source) that was read.
        file: String,
        /// The shape the model needs.
        expected: Vec<usize>,
        /// The shape found.
        got: Vec<usize>,
    },
    /// A tensor has a dtype that cannot hold parameters or inputs.
    #[error("tensor `{name}` in {file} has dtype {got}, expected {expected}")]
    TensorDType {
        /// The tensor name.
        name: String,
        /// The file (or source) that was read.
        file: String,
        /// What was expected, in words.
        expected: &'static str,
        /// The dtype found, in words.
        got: String,
    },
    /// A batch or input argument has the wrong shape.
    #[error("{what}: shape mismatch in {context}: expected {expected}, got {got}")]
    Shape {
        /// The argument.
        what: &'static str,
        /// The function that checked it.
        context: &'static str,
        /// The expected shape, in words.
        expected: String,
        /// The shape passed.
        got: String,
    },
    /// A configuration that cannot work.
    #[error("invalid configuration in {context}: {message}")]
    Config {
        /// Where the configuration was checked.
        context: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A NaN or infinity reached a place where training cannot continue.
    #[error("non-finite {what} in {context}")]
    NonFinite {
        /// The quantity (loss, gradient norm, ...).
        what: &'static str,
        /// The function that noticed it.
        context: &'static str,
    },
    /// Reading or writing a file failed.
    #[error("I/O error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("safetensors error on {file}: {message}")]
    SafeTensors {
        /// The file.
        file: String,
        /// The underlying message.
        message: String,
    },
    /// A JSON state or config could not be (de)serialised.
    #[error("JSON error in {context}: {source}")]
    Json {
        /// What was being read or written.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// An error from candle, with the operation it came from.
    #[error("candle error in {context}: {source}")]
    Candle {
        /// The operation in this crate that called candle.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: Box<candle_core::Error>,
    },
    /// An error from the environment / storage kernels.
    #[error("fx-kernels error in {context}: {source}")]
    Kernels {
        /// The operation in this crate that called fx-kernels.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: Box<fx_kernels::Error>,
    },
    /// An error from the optimiser / precision layer.
    #[error("fx-precision error in {context}: {source}")]
    Precision {
        /// The operation in this crate that called fx-precision.
        context: &'static str,
        /// The underlying error.
        #[source]
        source: Box<fx_precision::Error>,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches a context to results of the crates below: `op().ctx("DuelingDqn::forward")?`.
pub(crate) trait Context<T> {
    fn ctx(self, context: &'static str) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, candle_core::Error> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Candle { context, source: Box::new(source) })
    }
}

impl<T> Context<T> for std::result::Result<T, fx_kernels::Error> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Kernels { context, source: Box::new(source) })
    }
}

impl<T> Context<T> for std::result::Result<T, fx_precision::Error> {
    fn ctx(self, context: &'static str) -> Result<T> {
        self.map_err(|source| Error::Precision { context, source: Box::new(source) })
    }
}

impl Error {
    /// Shorthand for an [`Error::Shape`].
    pub(crate) fn shape(
        what: &'static str,
        context: &'static str,
        expected: impl std::fmt::Display,
        got: impl std::fmt::Display,
    ) -> Self {
        Error::Shape { what, context, expected: expected.to_string(), got: got.to_string() }
    }

    /// Shorthand for an [`Error::Config`].
    pub(crate) fn config(context: &'static str, message: impl Into<String>) -> Self {
        Error::Config { context, message: message.into() }
    }
}
