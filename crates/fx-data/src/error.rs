//! The crate's single error type. Every message names the file (and the line,
//! for CSV input) so a user can find what to fix without a debugger.

use std::path::PathBuf;

/// Everything that can go wrong in fx-data.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An operating-system error while reading or writing `path`.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A CSV input row (or the header) breaks a rule of DATA.md "Input".
    #[error("{}:{line}: {rule}", path.display())]
    Input {
        /// The input file.
        path: PathBuf,
        /// 1-based line number (the header is line 1).
        line: u64,
        /// The broken rule, e.g. `timestamps must be strictly increasing`.
        rule: String,
    },
    /// A row of a Parquet bar file breaks a rule of DATA.md "Input" (its rows have no lines).
    #[error("{}: row {row}: {rule}", path.display())]
    Row {
        /// The input file.
        path: PathBuf,
        /// 1-based row over the whole file (across its row groups).
        row: u64,
        /// The broken rule.
        rule: String,
    },
    /// The input has no more bars than the warm-up consumes.
    #[error("{}: {bars} bars; more than {warmup} are needed (the first {warmup} are the feature warm-up)", path.display())]
    TooFewBars {
        /// The input file.
        path: PathBuf,
        /// How many bars it holds.
        bars: usize,
        /// The warm-up length.
        warmup: usize,
    },
    /// A feature table holds a NaN or infinity (a file's, or one just computed from bars).
    #[error("{}: `{name}` holds a non-finite value ({value}) at row {row}, column {column}", path.display())]
    NonFinite {
        /// The feature file (or the bars' file name).
        path: PathBuf,
        /// The tensor (`market`, `known`, `logret_next`, `close`).
        name: String,
        /// Feature row of the first such value.
        row: usize,
        /// Its column.
        column: usize,
        /// The value.
        value: f64,
    },
    /// A feature file (or an in-memory feature table) is malformed.
    #[error("{}: {msg}", path.display())]
    Format {
        /// The feature file (or a label like `<in-memory table>`).
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A configuration or argument is invalid.
    #[error("invalid {what}: {msg}")]
    Config {
        /// Which setting.
        what: &'static str,
        /// Why it is invalid.
        msg: String,
    },
    /// A background prefetch worker failed or went away.
    #[error("prefetch worker: {0}")]
    Worker(String),
    /// A CUDA driver call failed.
    #[error("cuda ({what}): {msg}")]
    Cuda {
        /// Which operation.
        what: &'static str,
        /// The driver's message.
        msg: String,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    /// A format error; control characters of `msg` (which may quote the file's own text,
    /// or a parser's message that does) are escaped so the message stays one line.
    pub(crate) fn format(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        Error::Format { path: path.into(), msg: one_line(&msg.into()) }
    }

    pub(crate) fn config(what: &'static str, msg: impl Into<String>) -> Self {
        Error::Config { what, msg: msg.into() }
    }
}

/// `text` with its control characters (line ends, tabs, NUL, ...) escaped as `\n`, `\r`,
/// `\u{0}`: a message quoting a file's text stays one line.
pub fn one_line(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_string();
    }
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}
