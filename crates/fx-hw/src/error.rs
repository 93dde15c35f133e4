use thiserror::Error;

/// Errors of hardware detection, overrides and probes.
#[derive(Debug, Error)]
pub enum Error {
    /// An override (config or environment variable) could not be parsed.
    #[error("invalid {what} override from {source_name}: {value:?} ({expected})")]
    InvalidOverride { what: &'static str, source_name: String, value: String, expected: &'static str },
    /// The CUDA driver refused a call.
    #[error("CUDA driver error during {during}: {message}")]
    Driver { during: &'static str, message: String },
    /// A memory probe did not produce a usable measurement.
    #[error("memory probe failed: {0}")]
    Probe(String),
    /// A worker thread of [`crate::par_map`] panicked (a bug: its message).
    #[error("a worker thread panicked: {0}")]
    WorkerPanicked(String),
}
