//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in `fx-precision`. Messages name the operation and, for
/// files, the path and tensor concerned.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed; `context` names the fx-precision operation that ran it.
    #[error("{context}: {source}")]
    Candle {
        /// The fx-precision operation (e.g. "AdamW::step", "clip_grad_norm").
        context: String,
        /// The underlying candle error.
        #[source]
        source: candle_core::Error,
    },
    /// A file could not be read, written or renamed.
    #[error("{op} {path}: {source}", path = path.display())]
    Io {
        /// What was being done ("writing", "renaming", ...).
        op: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file could not be encoded or decoded.
    #[error("safetensors file {path}: {message}", path = path.display())]
    Safetensors {
        /// The file concerned.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A tensor expected in a checkpoint or state map is absent.
    #[error("{source_name}: missing tensor {name:?}")]
    MissingTensor {
        /// Where the tensors came from (a file path or "optimizer state").
        source_name: String,
        /// The missing tensor's name.
        name: String,
    },
    /// A tensor in a checkpoint or state map has the wrong shape.
    #[error("{source_name}: tensor {name:?} has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Where the tensors came from.
        source_name: String,
        /// The tensor's name.
        name: String,
        /// Shape found.
        got: Vec<usize>,
        /// Shape required.
        expected: Vec<usize>,
    },
    /// Tensors were left over that nothing asked for (a renamed or foreign parameter).
    #[error("{source_name}: unknown tensor(s) {names:?}")]
    UnknownTensors {
        /// Where the tensors came from.
        source_name: String,
        /// The unexpected names, sorted.
        names: Vec<String>,
    },
    /// Metadata (e.g. the GradScaler's JSON state) is missing or malformed.
    #[error("{what}: bad metadata: {message}")]
    Metadata {
        /// What was being restored.
        what: String,
        /// What went wrong.
        message: String,
    },
    /// A tensor to be saved holds a NaN or infinity (nothing was written).
    #[error("refusing to write {path}: tensor {name:?} holds a non-finite value at index {index}", path = path.display())]
    NonFinite {
        /// The file that was not written.
        path: PathBuf,
        /// The tensor's name.
        name: String,
        /// Flat index of the first bad value.
        index: usize,
    },
    /// A CUDA launch, graph capture or replay failed.
    #[error("{context}: {message}")]
    Cuda {
        /// The fx-precision operation.
        context: &'static str,
        /// What the driver or kernel wrapper said.
        message: String,
    },
    /// A configuration value is out of range.
    #[error("invalid {what}: {message}")]
    Config {
        /// The setting concerned.
        what: &'static str,
        /// Why it is invalid.
        message: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Attaches the name of the fx-precision operation to a candle error.
pub(crate) trait Context<T> {
    fn ctx(self, context: &str) -> Result<T>;
}

impl<T> Context<T> for candle_core::Result<T> {
    fn ctx(self, context: &str) -> Result<T> {
        self.map_err(|source| Error::Candle { context: context.to_string(), source })
    }
}
