//! Test support for the "bad input never panics" fuzz tests of the file readers (CSV bars,
//! feature files, checkpoints, run configs): proptest strategies that damage a valid input
//! with 1–4 mutations, a guard that turns a panic or a hang of the reader into a test
//! failure, and the check that an error is one line naming the file.
//!
//! Test-only. fx-data compiles it under `cfg(test)`; fx-precision, fx-models and fx-train
//! include this same file with `#[path]` from their `fuzz_tests` modules, so every crate
//! mutates inputs the same way without a shared test crate.
//!
//! The default suite runs [`DEFAULT_CASES`] cases per reader; each reader also has an
//! `#[ignore]`d long run of [`long_cases`] cases (`FX_FUZZ_CASES`, default 10,000):
//! `cargo test --workspace -- --ignored fuzz`. `FX_FUZZ_STATS=1` prints what the cases
//! ended in (valid results, errors by shape) with `--nocapture`.

#![allow(dead_code)]

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// Cases per reader in the default test suite.
pub const DEFAULT_CASES: u32 = 256;

/// How long one call of a reader may take before it counts as a hang. Generous: debug
/// builds on a loaded two-core machine, and no valid input takes more than a second.
pub const HANG_LIMIT: Duration = Duration::from_secs(60);

/// Cases of the long (ignored) runs: `FX_FUZZ_CASES`, default 10,000.
pub fn long_cases() -> u32 {
    match std::env::var("FX_FUZZ_CASES") {
        Ok(v) => v.trim().parse().unwrap_or_else(|_| panic!("FX_FUZZ_CASES={v:?} is not a case count")),
        Err(_) => 10_000,
    }
}

/// What kind of file is being mutated: which mutations apply on top of the byte-level ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Line-oriented text (CSV, TOML): line and number mutations on the whole file.
    Text,
    /// safetensors: an 8-byte little-endian header length, a JSON header, then the data;
    /// number and text mutations inside the header keep the length prefix consistent.
    Safetensors,
}

/// Number spellings that readers get wrong: huge, tiny, non-finite, negative zero,
/// integer limits, out-of-range, empty.
pub const SPECIAL_NUMBERS: &[&str] = &[
    "1e309",
    "-1e309",
    "1e308",
    "-1.7976931348623157e308",
    "NaN",
    "nan",
    "-nan",
    "inf",
    "-inf",
    "+inf",
    "Infinity",
    "-0",
    "-0.0",
    "0",
    "0.0",
    "-1",
    "1",
    "1e-320",
    "5e-324",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "1000000000",
    "1e9",
    "9223372036854775807",
    "-9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "99999999999999999999999999999",
    "0x10",
    "1_000",
    "",
];

/// Short text fragments that break parsers: separators, quotes, line ends, a BOM,
/// multi-byte characters, NUL, brackets, and JSON/TOML escapes of line ends and NUL (which
/// put those characters into decoded strings: names, tags, metadata).
pub const FRAGMENTS: &[&str] = &[
    ",",
    "\"",
    "'",
    "\r",
    "\n",
    "\r\n",
    "\u{feff}",
    "é",
    "€",
    "\u{10348}",
    "\0",
    "\t",
    " ",
    "[",
    "]",
    "{",
    "}",
    "=",
    ":",
    "-",
    "+",
    ".",
    "e",
    "T",
    "Z",
    "#",
    "\\",
    "[[",
    "]]",
    "\\n",
    "\\r",
    "\\u000a",
    "\\u0000",
];

/// One damage done to an input. Positions are fractions of the input (`at / 2^64`), so
/// shrinking keeps them meaningful whatever the input's length.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Flips bit `bit` of one byte.
    FlipBit { at: u64, bit: u8 },
    /// Overwrites one byte.
    SetByte { at: u64, byte: u8 },
    /// Cuts the input at a point.
    Truncate { at: u64 },
    /// Appends bytes.
    Append(Vec<u8>),
    /// Inserts bytes at a point.
    Insert { at: u64, bytes: Vec<u8> },
    /// Removes up to `len` bytes from a point.
    Delete { at: u64, len: usize },
    /// Text: repeats a line right after itself.
    DuplicateLine { at: u64 },
    /// Text: swaps two lines.
    SwapLines { a: u64, b: u64 },
    /// Text: removes a line.
    DeleteLine { at: u64 },
    /// Replaces a number (a run of `[0-9.eE+-]` holding a digit) with another spelling; in
    /// a safetensors file, a number of the JSON header (shapes, offsets, metadata values).
    ReplaceNumber { at: u64, with: String },
    /// Inserts text at a char boundary; in a safetensors file, inside the JSON header.
    InsertText { at: u64, text: String },
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => proptest::sample::select(SPECIAL_NUMBERS).prop_map(str::to_string),
        1 => any::<f64>().prop_map(|x| x.to_string()),
        1 => any::<i64>().prop_map(|x| x.to_string()),
        1 => any::<u64>().prop_map(|x| x.to_string()),
    ]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        2 => proptest::sample::select(FRAGMENTS).prop_map(str::to_string),
        1 => ".{1,6}",
    ]
}

fn mutation(format: Format) -> BoxedStrategy<Mutation> {
    let bytes = prop_oneof![
        3 => (any::<u64>(), 0u8..8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        2 => (any::<u64>(), any::<u8>()).prop_map(|(at, byte)| Mutation::SetByte { at, byte }),
        2 => any::<u64>().prop_map(|at| Mutation::Truncate { at }),
        1 => proptest::collection::vec(any::<u8>(), 1..32).prop_map(Mutation::Append),
        1 => (any::<u64>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (any::<u64>(), 1usize..64).prop_map(|(at, len)| Mutation::Delete { at, len }),
    ];
    let numbers = (any::<u64>(), number()).prop_map(|(at, with)| Mutation::ReplaceNumber { at, with });
    let texts = (any::<u64>(), text()).prop_map(|(at, text)| Mutation::InsertText { at, text });
    match format {
        Format::Text => prop_oneof![
            4 => bytes,
            2 => any::<u64>().prop_map(|at| Mutation::DuplicateLine { at }),
            2 => (any::<u64>(), any::<u64>()).prop_map(|(a, b)| Mutation::SwapLines { a, b }),
            1 => any::<u64>().prop_map(|at| Mutation::DeleteLine { at }),
            4 => numbers,
            2 => texts,
        ]
        .boxed(),
        Format::Safetensors => prop_oneof![5 => bytes, 4 => numbers, 1 => texts].boxed(),
    }
}

/// 1–4 mutations for a `format` input.
pub fn mutations(format: Format) -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(format), 1..=4)
}

/// Position `at / 2^64` of the way into `len` items (0 for none): shrinks towards the start.
fn pos(at: u64, len: usize) -> usize {
    ((at as u128 * len as u128) >> 64) as usize
}

/// `input` with `mutations` applied in order.
pub fn apply(input: &[u8], mutations: &[Mutation], format: Format) -> Vec<u8> {
    let mut b = input.to_vec();
    for m in mutations {
        apply_one(&mut b, m, format);
    }
    b
}

fn apply_one(b: &mut Vec<u8>, m: &Mutation, format: Format) {
    match m {
        Mutation::FlipBit { at, bit } => {
            if !b.is_empty() {
                let i = pos(*at, b.len());
                b[i] ^= 1 << bit;
            }
        }
        Mutation::SetByte { at, byte } => {
            if !b.is_empty() {
                let i = pos(*at, b.len());
                b[i] = *byte;
            }
        }
        Mutation::Truncate { at } => {
            let i = pos(*at, b.len());
            b.truncate(i);
        }
        Mutation::Append(bytes) => b.extend_from_slice(bytes),
        Mutation::Insert { at, bytes } => {
            let i = pos(*at, b.len() + 1);
            b.splice(i..i, bytes.iter().copied());
        }
        Mutation::Delete { at, len } => {
            let i = pos(*at, b.len());
            let end = (i + len).min(b.len());
            b.drain(i..end);
        }
        Mutation::DuplicateLine { at } | Mutation::DeleteLine { at } => {
            let mut lines = split_lines(b);
            if !lines.is_empty() {
                let i = pos(*at, lines.len());
                if matches!(m, Mutation::DuplicateLine { .. }) {
                    let mut line = lines[i].clone();
                    if !line.ends_with(b"\n") {
                        // The last line has no terminator: the copy needs one.
                        lines[i].push(b'\n');
                        line.clear();
                        line.extend_from_slice(&lines[i][..lines[i].len() - 1]);
                    }
                    lines.insert(i + 1, line);
                } else {
                    lines.remove(i);
                }
                *b = lines.concat();
            }
        }
        Mutation::SwapLines { a, b: other } => {
            let mut lines = split_lines(b);
            if lines.len() > 1 {
                let (i, j) = (pos(*a, lines.len()), pos(*other, lines.len()));
                lines.swap(i, j);
                *b = lines.concat();
            }
        }
        Mutation::ReplaceNumber { at, with } => edit_text(b, format, |t| replace_number(t, *at, with)),
        Mutation::InsertText { at, text } => edit_text(b, format, |t| {
            let mut i = pos(*at, t.len() + 1);
            while !t.is_char_boundary(i) {
                i -= 1;
            }
            t.insert_str(i, text);
        }),
    }
}

fn split_lines(b: &[u8]) -> Vec<Vec<u8>> {
    b.split_inclusive(|&c| c == b'\n').map(<[u8]>::to_vec).collect()
}

/// Applies a text edit to the whole file (text) or to the JSON header (safetensors,
/// re-encoding its length). Inputs whose text is not UTF-8 (after byte damage) are
/// edited lossily: the edit still happens, on the replacement characters.
fn edit_text(b: &mut Vec<u8>, format: Format, edit: impl FnOnce(&mut String)) {
    match format {
        Format::Text => {
            let mut t = String::from_utf8_lossy(b).into_owned();
            edit(&mut t);
            *b = t.into_bytes();
        }
        Format::Safetensors => {
            if b.len() < 8 {
                return;
            }
            let n = u64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
            let n = n.min(b.len() - 8);
            let mut header = String::from_utf8_lossy(&b[8..8 + n]).into_owned();
            edit(&mut header);
            let mut out = (header.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(header.as_bytes());
            out.extend_from_slice(&b[8 + n..]);
            *b = out;
        }
    }
}

/// Replaces the number at proportional position `at` among the numbers of `t`.
fn replace_number(t: &mut String, at: u64, with: &str) {
    let spans = number_spans(t);
    if spans.is_empty() {
        return;
    }
    let (s, e) = spans[pos(at, spans.len())];
    t.replace_range(s..e, with);
}

/// Byte spans of the maximal runs of `[0-9.eE+-]` that hold a digit.
pub fn number_spans(t: &str) -> Vec<(usize, usize)> {
    let b = t.as_bytes();
    let is_num = |c: u8| c.is_ascii_digit() || matches!(c, b'.' | b'e' | b'E' | b'+' | b'-');
    let mut spans = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if is_num(b[i]) {
            let s = i;
            while i < b.len() && is_num(b[i]) {
                i += 1;
            }
            if b[s..i].iter().any(u8::is_ascii_digit) {
                spans.push((s, i));
            }
        } else {
            i += 1;
        }
    }
    spans
}

/// Calls `read` on its own thread and waits at most [`HANG_LIMIT`]: `Ok` with the reader's
/// outcome (its error as text), or `Err` saying it panicked (with the panic message) or hung.
pub fn guarded<E: Send + 'static>(
    read: impl FnOnce() -> Result<(), E> + Send + 'static,
) -> Result<Result<(), E>, String> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("fuzz-case".into())
        .spawn(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(read));
            let _ = tx.send(out);
        })
        .map_err(|e| format!("cannot start the case's thread: {e}"))?;
    match rx.recv_timeout(HANG_LIMIT) {
        Ok(Ok(outcome)) => Ok(outcome),
        Ok(Err(payload)) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "(non-string panic payload)".into());
            Err(format!("the reader panicked: {msg}"))
        }
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("the reader hung (no return within {HANG_LIMIT:?})")),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err("the reader's thread died without a result".into()),
    }
}

/// Checks one case: the reader returned (no panic, no hang), and an error is one
/// non-empty line that contains `must_name` (the file's path) when given. On failure the
/// damaged input is kept in the OS temp folder (see `keep`) and named in the message.
pub fn check(
    reader: &str,
    outcome: Result<Result<(), String>, String>,
    input: &[u8],
    must_name: Option<&Path>,
) -> Result<(), TestCaseError> {
    tally(&outcome);
    let problem = match &outcome {
        Ok(Ok(())) => return Ok(()),
        Err(e) => e.clone(),
        Ok(Err(msg)) if msg.trim().is_empty() => "the error message is empty".to_string(),
        Ok(Err(msg)) if msg.contains('\n') || msg.contains('\r') => format!("the error is not one line: {msg:?}"),
        Ok(Err(msg)) => match must_name {
            Some(p) if !msg.contains(&p.display().to_string()) => {
                format!("the error does not name the file {}: {msg:?}", p.display())
            }
            _ => return Ok(()),
        },
    };
    Err(TestCaseError::fail(format!("{reader}: {problem}; input kept at {}", keep(reader, input))))
}

thread_local! {
    /// Outcomes of this thread's cases: valid results, then errors by shape.
    static TALLY: std::cell::RefCell<(usize, std::collections::BTreeMap<String, usize>)> = Default::default();
}

/// Counts an outcome for `FX_FUZZ_STATS` (errors by shape: digits and paths folded).
fn tally(outcome: &Result<Result<(), String>, String>) {
    TALLY.with(|t| {
        let mut t = t.borrow_mut();
        match outcome {
            Ok(Ok(())) => t.0 += 1,
            Ok(Err(m)) | Err(m) => {
                let mut shape = String::new();
                for w in m.split(' ') {
                    let w = if w.contains('/') { "<path>" } else { w };
                    shape.push_str(&w.chars().filter(|c| !c.is_ascii_digit()).collect::<String>());
                    shape.push(' ');
                }
                *t.1.entry(shape.chars().take(100).collect()).or_default() += 1;
            }
        }
    });
}

/// Writes the failing input to `<temp>/fx-fuzz-failures/<reader>.last`. Shrinking
/// overwrites it with each smaller failing input, so it ends as the minimal one.
fn keep(reader: &str, input: &[u8]) -> String {
    if input.is_empty() {
        return "(the input is empty)".into();
    }
    let dir = std::env::temp_dir().join("fx-fuzz-failures");
    let name: String = reader.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let path = dir.join(format!("{name}.last"));
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input)) {
        Ok(()) => path.display().to_string(),
        Err(e) => format!("(not kept: {e})"),
    }
}

/// Runs `cases` cases of `test` over `strategy`; panics with the shrunk failing input.
/// Failures are not persisted (the regression tests beside each fuzz test keep them).
pub fn run<S: Strategy>(reader: &str, cases: u32, strategy: S, test: impl Fn(S::Value) -> Result<(), TestCaseError>) {
    let config = Config { cases, failure_persistence: None, max_shrink_iters: 2048, ..Config::default() };
    let mut runner = TestRunner::new(config);
    TALLY.with(|t| *t.borrow_mut() = Default::default());
    let result = runner.run(&strategy, test);
    if std::env::var_os("FX_FUZZ_STATS").is_some() {
        // What the cases ended in, to judge how deep the mutations reach.
        TALLY.with(|t| {
            let t = t.borrow();
            let mut errors: Vec<_> = t.1.iter().collect();
            errors.sort_by(|a, b| b.1.cmp(a.1));
            eprintln!("{reader}: {} valid results, {} errors", t.0, t.1.values().sum::<usize>());
            for (shape, n) in errors {
                eprintln!("{n:>8}  {shape}");
            }
        });
    }
    if let Err(e) = result {
        panic!("{reader}: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mutations_do_what_they_say() {
        let t = b"a,1\nb,2.5\nc,-3e4\n";
        let apply1 = |m: Mutation| String::from_utf8(apply(t, &[m], Format::Text)).unwrap();
        assert_eq!(apply1(Mutation::DuplicateLine { at: 0 }), "a,1\na,1\nb,2.5\nc,-3e4\n");
        assert_eq!(apply1(Mutation::DeleteLine { at: 0 }), "b,2.5\nc,-3e4\n");
        assert_eq!(apply1(Mutation::SwapLines { a: 0, b: u64::MAX }), "c,-3e4\nb,2.5\na,1\n");
        assert_eq!(apply1(Mutation::ReplaceNumber { at: u64::MAX, with: "NaN".into() }), "a,1\nb,2.5\nc,NaN\n");
        assert_eq!(apply1(Mutation::Truncate { at: 0 }), "");
        assert_eq!(number_spans("x1,2.5e-3,abc,-"), [(1, 2), (3, 9)]);
        let no_newline = apply(b"h\nlast", &[Mutation::DuplicateLine { at: u64::MAX }], Format::Text);
        assert_eq!(no_newline, b"h\nlast\nlast");
        // safetensors: a header edit re-encodes the length prefix and keeps the data.
        let mut st = 7u64.to_le_bytes().to_vec();
        st.extend_from_slice(b"{\"a\":1}DATA");
        let out = apply(&st, &[Mutation::ReplaceNumber { at: 0, with: "123".into() }], Format::Safetensors);
        assert_eq!(u64::from_le_bytes(out[..8].try_into().unwrap()), 9);
        assert_eq!(&out[8..], b"{\"a\":123}DATA");
    }

    #[test]
    fn the_guard_reports_panics_and_errors() {
        assert_eq!(guarded(|| Ok::<(), String>(())), Ok(Ok(())));
        assert_eq!(guarded(|| Err("x".to_string())), Ok(Err("x".to_string())));
        let e = guarded(|| -> Result<(), String> { panic!("boom") }).unwrap_err();
        assert!(e.contains("panicked: boom"), "{e}");
        assert!(check("t", Ok(Err("a\nb".into())), b"", None).is_err());
        assert!(check("t", Ok(Err("f.csv:3: bad".into())), b"", Some(Path::new("f.csv"))).is_ok());
        assert!(check("t", Ok(Err("bad".into())), b"", Some(Path::new("f.csv"))).is_err());
    }
}
