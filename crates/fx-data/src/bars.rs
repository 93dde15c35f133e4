//! OHLCV bars and their CSV reader (DATA.md "Input bars" and "Exact readings /
//! Input"). The reader is strict: the first row that breaks a rule stops the
//! run with `file:line: rule`, because silently repairing market data moves
//! every downstream feature.

use std::io::Read;
use std::path::Path;

use chrono::NaiveDate;

use crate::error::{one_line, Error};
use crate::features::WARMUP;

/// A series of OHLCV bars, one entry per bar in every column.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Bars {
    /// Unix seconds (UTC), strictly increasing.
    pub timestamp: Vec<i64>,
    /// Opening prices.
    pub open: Vec<f64>,
    /// Highest prices.
    pub high: Vec<f64>,
    /// Lowest prices.
    pub low: Vec<f64>,
    /// Closing prices.
    pub close: Vec<f64>,
    /// Traded volume.
    pub volume: Vec<f64>,
}

/// The required columns in their canonical order.
const COLUMNS: [&str; 6] = ["timestamp", "open", "high", "low", "close", "volume"];

/// Header names accepted for the timestamp column (after trim + lowercase).
const TIMESTAMP_ALIASES: [&str; 4] = ["timestamp", "date", "time", "datetime"];

impl Bars {
    /// Number of bars.
    pub fn len(&self) -> usize {
        self.timestamp.len()
    }

    /// True when there are no bars.
    pub fn is_empty(&self) -> bool {
        self.timestamp.is_empty()
    }

    /// Reads and validates a CSV file of bars. Refuses files of at most
    /// [`WARMUP`] bars, after every row has been checked.
    pub fn from_csv_path(path: &Path) -> Result<Bars, Error> {
        Self::from_csv_path_with_lines(path).map(|(b, _)| b)
    }

    /// [`Self::from_csv_path`], with each bar's line in the file (1-based; the header is
    /// line 1, blank lines count), for errors found after parsing.
    pub fn from_csv_path_with_lines(path: &Path) -> Result<(Bars, Vec<u64>), Error> {
        let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
        read_csv(std::io::BufReader::new(file), path)
    }

    /// Reads bars from any reader; `path` is only used in error messages.
    pub fn from_csv_reader<R: Read>(reader: R, path: &Path) -> Result<Bars, Error> {
        read_csv(reader, path).map(|(b, _)| b)
    }

    /// Checks every bar against the row rules (used for bars that did not come
    /// from a CSV file, e.g. the synthetic generator). `what` names the source;
    /// the reported line is the bar index + 2, as if it were a CSV with header.
    pub fn validate(&self, what: &Path) -> Result<(), Error> {
        let n = self.len();
        let lens = [self.open.len(), self.high.len(), self.low.len(), self.close.len(), self.volume.len()];
        if lens.iter().any(|&l| l != n) {
            return Err(Error::format(what, "bar columns have different lengths"));
        }
        for i in 0..n {
            let prev = if i == 0 { None } else { Some(self.timestamp[i - 1]) };
            let row = RowValues {
                ts: self.timestamp[i],
                open: self.open[i],
                high: self.high[i],
                low: self.low[i],
                close: self.close[i],
                volume: self.volume[i],
            };
            check_row(&row, prev, None).map_err(|rule| Error::Input {
                path: what.to_path_buf(),
                line: i as u64 + 2,
                rule,
            })?;
        }
        Ok(())
    }

    fn push(&mut self, r: &RowValues) {
        self.timestamp.push(r.ts);
        self.open.push(r.open);
        self.high.push(r.high);
        self.low.push(r.low);
        self.close.push(r.close);
        self.volume.push(r.volume);
    }
}

struct RowValues {
    ts: i64,
    open: f64,
    high: f64,
    low: f64,
    close: f64,
    volume: f64,
}

/// The value checks of DATA.md in their normative order (prices, low, high,
/// volume, increasing timestamp). `raw` holds the price cells as written so a
/// message quotes the user's text (`nan`, `-1.1`) rather than Rust's spelling.
fn check_row(r: &RowValues, prev_ts: Option<i64>, raw: Option<&[&str; 4]>) -> Result<(), String> {
    let prices = [r.open, r.high, r.low, r.close];
    for (k, &p) in prices.iter().enumerate() {
        if !(p.is_finite() && p > 0.0) {
            let shown = match raw {
                Some(raw) => one_line(raw[k]),
                None => format!("{p}"),
            };
            return Err(format!("prices must be finite and positive ({} = {shown})", COLUMNS[k + 1]));
        }
    }
    if r.low > r.open.min(r.close) {
        return Err("low must be <= min(open, close)".into());
    }
    if r.high < r.open.max(r.close) {
        return Err("high must be >= max(open, close)".into());
    }
    if !(r.volume.is_finite() && r.volume >= 0.0) {
        return Err("volume must be finite and non-negative".into());
    }
    if let Some(p) = prev_ts {
        if r.ts <= p {
            return Err("timestamps must be strictly increasing".into());
        }
    }
    Ok(())
}

/// Header names accepted for a long-format file's instrument column (after trim + lowercase).
const SYMBOL_ALIASES: [&str; 3] = ["symbol", "ticker", "instrument"];

/// Where a header puts the six bar columns and, in a long-format file, the symbol.
struct Header {
    line: u64,
    idx: [usize; 6],
    symbol: Option<usize>,
    n_fields: usize,
}

/// The first non-blank line as a bars header.
fn read_header<R: Read>(lines: &mut Lines<'_, R>, path: &Path) -> Result<Header, Error> {
    let err = |line: u64, rule: String| Error::Input { path: path.to_path_buf(), line, rule };
    let (line, header) = loop {
        match lines.next_record()? {
            None => return Err(err(1, "empty file (no header row)".into())),
            Some((_, rec)) if is_blank(&rec) => continue,
            Some(x) => break x,
        }
    };
    let mut index: [Option<usize>; 6] = [None; 6];
    let mut symbol = None;
    for (i, name) in header.iter().enumerate() {
        let name = name.trim().to_ascii_lowercase();
        if SYMBOL_ALIASES.contains(&name.as_str()) {
            if symbol.is_some() {
                return Err(err(line, "more than one symbol column (symbol, ticker, instrument)".into()));
            }
            symbol = Some(i);
            continue;
        }
        let col =
            if TIMESTAMP_ALIASES.contains(&name.as_str()) { Some(0) } else { COLUMNS.iter().position(|c| *c == name) };
        if let Some(col) = col {
            if index[col].is_some() {
                return Err(err(line, format!("column `{}` appears more than once", COLUMNS[col])));
            }
            index[col] = Some(i);
        }
    }
    let mut idx = [0usize; 6];
    for (k, slot) in index.iter().enumerate() {
        idx[k] = slot.ok_or_else(|| {
            let what = if k == 0 { "timestamp (or date, time, datetime)" } else { COLUMNS[k] };
            err(line, format!("missing required column `{what}`"))
        })?;
    }
    Ok(Header { line, idx, symbol, n_fields: header.len() })
}

/// One data row's values, checked against the row rules (`prev_ts`: the previous bar of the
/// same instrument).
fn parse_row(rec: &[String], h: &Header, line: u64, prev_ts: Option<i64>, path: &Path) -> Result<RowValues, Error> {
    let err = |rule: String| Error::Input { path: path.to_path_buf(), line, rule };
    if rec.len() < h.n_fields {
        return Err(err(format!("row has fewer fields than the header ({} < {})", rec.len(), h.n_fields)));
    }
    let cell = |k: usize| rec[h.idx[k]].trim();
    let ts_text = cell(0);
    let ts = parse_timestamp(ts_text)
        .ok_or_else(|| err(format!("timestamp is neither unix seconds nor ISO-8601 (`{}`)", one_line(ts_text))))?;
    let mut vals = [0.0f64; 5];
    for k in 1..6 {
        let text = cell(k);
        vals[k - 1] =
            text.parse::<f64>().map_err(|_| err(format!("`{}` is not a number (`{}`)", COLUMNS[k], one_line(text))))?;
    }
    let row = RowValues { ts, open: vals[0], high: vals[1], low: vals[2], close: vals[3], volume: vals[4] };
    let raw = [cell(1), cell(2), cell(3), cell(4)];
    check_row(&row, prev_ts, Some(&raw)).map_err(err)?;
    Ok(row)
}

fn read_rows<R: Read>(reader: R, path: &Path) -> Result<(Bars, Vec<u64>), Error> {
    // Lines are split here (not by the csv crate, whose line numbers skip
    // blank lines and miscount CRLF) so `file:line` is the editor's line.
    let mut lines = Lines::new(reader, path);
    let h = read_header(&mut lines, path)?;
    let mut bars = Bars::default();
    let mut bar_lines = Vec::new();
    let mut prev_ts = None;
    // A symbol column is fine while it names one instrument; a second one makes the file a
    // long-format panel, which one instrument's reader must not mix into one series.
    let mut first_symbol: Option<String> = None;
    while let Some((line, rec)) = lines.next_record()? {
        if is_blank(&rec) {
            continue;
        }
        if let Some(name) = h.symbol.and_then(|c| rec.get(c)).map(|s| s.trim()) {
            match &first_symbol {
                None => first_symbol = Some(name.to_string()),
                Some(f) if f != name => {
                    return Err(Error::Input {
                        path: path.to_path_buf(),
                        line,
                        rule: format!(
                            "a second instrument `{}` after `{}`: a long-format file of several instruments \
                             is a panel (`fx-train features --input` builds it), not one instrument's bars",
                            one_line(name),
                            one_line(f)
                        ),
                    });
                }
                Some(_) => {}
            }
        }
        let row = parse_row(&rec, &h, line, prev_ts, path)?;
        prev_ts = Some(row.ts);
        bars.push(&row);
        bar_lines.push(line);
    }
    Ok((bars, bar_lines))
}

/// Reads a long-format CSV (a `symbol` — or `ticker`, `instrument` — column beside the
/// bar columns, any number of instruments, rows in any order across instruments): each
/// instrument's bars, in the order of its rows, with each bar's line, instruments sorted by
/// name. The row rules hold per instrument (its timestamps strictly increase down the file);
/// the first row that breaks one stops with `file:line: rule`, naming the instrument. Each
/// instrument needs more than [`WARMUP`] bars.
pub fn read_long_csv(path: &Path) -> Result<Vec<(String, Bars, Vec<u64>)>, Error> {
    let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
    let mut lines = Lines::new(std::io::BufReader::new(file), path);
    let h = read_header(&mut lines, path)?;
    let Some(sym) = h.symbol else {
        return Err(Error::Input {
            path: path.to_path_buf(),
            line: h.line,
            rule: "no symbol column (symbol, ticker or instrument): not a long-format file".into(),
        });
    };
    let mut by: std::collections::BTreeMap<String, (Bars, Vec<u64>)> = std::collections::BTreeMap::new();
    while let Some((line, rec)) = lines.next_record()? {
        if is_blank(&rec) {
            continue;
        }
        let name = rec.get(sym).map(|s| s.trim()).unwrap_or_default();
        if name.is_empty() {
            return Err(Error::Input { path: path.to_path_buf(), line, rule: "the symbol is empty".into() });
        }
        let (bars, bar_lines) = by.entry(name.to_string()).or_default();
        let prev = bars.timestamp.last().copied();
        let row = parse_row(&rec, &h, line, prev, path).map_err(|e| match e {
            Error::Input { path, line, rule } => {
                Error::Input { path, line, rule: format!("{}: {rule}", one_line(name)) }
            }
            other => other,
        })?;
        bars.push(&row);
        bar_lines.push(line);
    }
    if by.is_empty() {
        return Err(Error::format(path, "holds a header and no bars"));
    }
    past_warmup(path, by)
}

/// A long file's instruments (each bar's line or row beside it) once every one has more
/// than [`WARMUP`] bars; the first that has not is an error naming it.
fn past_warmup(
    path: &Path,
    by: std::collections::BTreeMap<String, (Bars, Vec<u64>)>,
) -> Result<Vec<(String, Bars, Vec<u64>)>, Error> {
    if let Some((name, (bars, _))) = by.iter().find(|(_, (b, _))| b.len() <= WARMUP) {
        return Err(Error::format(
            path,
            format!(
                "instrument {} has {} bars; at least {} are needed (the warm-up)",
                one_line(name),
                bars.len(),
                WARMUP + 1
            ),
        ));
    }
    Ok(by.into_iter().map(|(n, (b, l))| (n, b, l)).collect())
}

/// Whether `path` is a long-format file of several instruments: its header names an
/// instrument column and its rows name at least two (a one-ticker export with a constant
/// symbol column is one instrument's bars). Reads up to the second symbol.
pub fn is_long_format(path: &Path) -> Result<bool, Error> {
    let file = crate::files::open_regular(path).map_err(|e| Error::io(path, e))?;
    let mut lines = Lines::new(std::io::BufReader::new(file), path);
    let Some(col) = read_header(&mut lines, path)?.symbol else { return Ok(false) };
    let mut first: Option<String> = None;
    while let Some((_, rec)) = lines.next_record()? {
        let Some(name) = rec.get(col).map(|s| s.trim()).filter(|s| !s.is_empty()) else { continue };
        match &first {
            None => first = Some(name.to_string()),
            Some(f) if f != name => return Ok(true),
            Some(_) => {}
        }
    }
    Ok(false)
}

fn is_blank(rec: &[String]) -> bool {
    rec.iter().all(|f| f.trim().is_empty())
}

/// [`read_rows`] and the warm-up check: the bars and each one's line.
fn read_csv<R: Read>(reader: R, path: &Path) -> Result<(Bars, Vec<u64>), Error> {
    let (bars, lines) = read_rows(reader, path)?;
    if bars.len() <= WARMUP {
        return Err(Error::TooFewBars { path: path.to_path_buf(), bars: bars.len(), warmup: WARMUP });
    }
    Ok((bars, lines))
}

/// Physical lines of the input, numbered from 1, split into CSV fields.
struct Lines<'p, R: Read> {
    reader: std::io::BufReader<R>,
    path: &'p Path,
    line: u64,
    buf: Vec<u8>,
}

impl<'p, R: Read> Lines<'p, R> {
    fn new(reader: R, path: &'p Path) -> Self {
        Lines { reader: std::io::BufReader::new(reader), path, line: 0, buf: Vec::new() }
    }

    /// The next line's number and fields; `None` at the end of the input.
    fn next_record(&mut self) -> Result<Option<(u64, Vec<String>)>, Error> {
        use std::io::BufRead;
        self.buf.clear();
        let n = self.reader.read_until(b'\n', &mut self.buf).map_err(|e| Error::io(self.path, e))?;
        if n == 0 {
            return Ok(None);
        }
        self.line += 1;
        let mut bytes = &self.buf[..];
        if let Some(b) = bytes.strip_suffix(b"\n") {
            bytes = b;
        }
        if let Some(b) = bytes.strip_suffix(b"\r") {
            bytes = b;
        }
        if self.line == 1 {
            // A UTF-8 byte-order mark (Excel exports) is not part of the data.
            bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
        }
        let text = std::str::from_utf8(bytes).map_err(|_| Error::Input {
            path: self.path.to_path_buf(),
            line: self.line,
            rule: "row is not valid UTF-8".into(),
        })?;
        let fields = split_fields(text).ok_or_else(|| Error::Input {
            path: self.path.to_path_buf(),
            line: self.line,
            rule: "unbalanced quotes".into(),
        })?;
        Ok(Some((self.line, fields)))
    }
}

/// Splits one CSV line on commas outside double quotes; a quoted field may
/// contain commas and doubled quotes (`""`). `None` when a quote is left open.
fn split_fields(line: &str) -> Option<Vec<String>> {
    let mut fields = Vec::new();
    let mut cur = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (false, ',') => fields.push(std::mem::take(&mut cur)),
            (false, '"') if cur.trim().is_empty() => {
                cur.clear();
                quoted = true;
            }
            (true, '"') => {
                if chars.peek() == Some(&'"') {
                    chars.next();
                    cur.push('"');
                } else {
                    quoted = false;
                }
            }
            (_, c) => cur.push(c),
        }
    }
    if quoted {
        return None;
    }
    fields.push(cur);
    Some(fields)
}

/// Parses a timestamp cell: an integer is Unix seconds; anything else is
/// ISO-8601 (`YYYY-MM-DD`, then optionally `T` or space and `HH:MM[:SS[.f]]`,
/// then optionally `Z` or `±HH[:MM]`). Naive times are UTC; fractional
/// seconds are floored. Returns `None` when the text is neither.
pub fn parse_timestamp(text: &str) -> Option<i64> {
    let t = text.trim();
    if t.is_empty() {
        return None;
    }
    let digits = t.strip_prefix(['-', '+']).unwrap_or(t);
    if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse::<i64>().ok();
    }
    parse_iso(t)
}

fn parse_iso(t: &str) -> Option<i64> {
    // ISO-8601 is ASCII; the byte slicing below needs it (a multi-byte character would put
    // a slice boundary inside it).
    if !t.is_ascii() {
        return None;
    }
    let b = t.as_bytes();
    // Date part: YYYY-MM-DD.
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let year: i32 = num(&t[0..4])?;
    let month: u32 = num(&t[5..7])?;
    let day: u32 = num(&t[8..10])?;
    let date = NaiveDate::from_ymd_opt(year, month, day)?;
    let days = date.signed_duration_since(NaiveDate::from_ymd_opt(1970, 1, 1)?).num_days();
    let mut secs = days * 86_400;
    let mut rest = &t[10..];
    if rest.is_empty() {
        return Some(secs);
    }
    let sep = rest.as_bytes()[0];
    if sep != b'T' && sep != b't' && sep != b' ' {
        return None;
    }
    rest = &rest[1..];
    // Time part: HH:MM[:SS[.fff]].
    let rb = rest.as_bytes();
    if rb.len() < 5 || rb[2] != b':' {
        return None;
    }
    let hh: i64 = num(&rest[0..2])?;
    let mm: i64 = num(&rest[3..5])?;
    rest = &rest[5..];
    let mut ss: i64 = 0;
    if rest.as_bytes().first() == Some(&b':') {
        if rest.len() < 3 {
            return None;
        }
        ss = num(&rest[1..3])?;
        rest = &rest[3..];
        if let Some(frac) = rest.strip_prefix(['.', ',']) {
            let n = frac.bytes().take_while(|c| c.is_ascii_digit()).count();
            if n == 0 {
                return None;
            }
            // Floored: the fraction is dropped (time is non-negative here).
            rest = &frac[n..];
        }
    }
    if hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    secs += hh * 3600 + mm * 60 + ss;
    // Offset part: Z, ±HH, ±HHMM, ±HH:MM.
    if rest.is_empty() || rest == "Z" || rest == "z" {
        return Some(secs);
    }
    let sign = match rest.as_bytes()[0] {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let off = &rest[1..];
    let (oh, om): (i64, i64) = match off.len() {
        2 => (num(off)?, 0),
        4 => (num(&off[0..2])?, num(&off[2..4])?),
        5 if off.as_bytes()[2] == b':' => (num(&off[0..2])?, num(&off[3..5])?),
        _ => return None,
    };
    if oh > 23 || om > 59 {
        return None;
    }
    Some(secs - sign * (oh * 3600 + om * 60))
}

fn num<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

mod parquet_file;
pub use parquet_file::{is_parquet, read_parquet};

#[cfg(test)]
mod fuzz_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fixture(name: &str) -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/fixtures")).join(name)
    }

    fn data_dir() -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared/data"))
    }

    fn parse(text: &str) -> Result<Bars, Error> {
        Bars::from_csv_reader(text.as_bytes(), Path::new("t.csv"))
    }

    /// A valid CSV body with `n` hourly bars; `header` is the header line.
    fn csv_text(header: &str, n: usize) -> String {
        let mut s = format!("{header}\n");
        for i in 0..n {
            let c = 100.0 + (i % 7) as f64;
            s += &format!("{},{},{},{},{},{}\n", 1_700_000_000 + 3600 * i as i64, c, c + 1.0, c - 1.0, c, 10 * i);
        }
        s
    }

    #[test]
    fn bad_fixtures_refused_with_expected_line_and_rule() {
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(fixture("features_bad.json")).unwrap()).unwrap();
        let cases = json["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 6);
        for case in cases {
            let file = case["file"].as_str().unwrap();
            let path = fixture(file);
            match Bars::from_csv_path(&path) {
                Err(Error::Input { line, rule, path: p }) => {
                    assert_eq!(line, case["line"].as_u64().unwrap(), "{file}");
                    assert_eq!(rule, case["rule"].as_str().unwrap(), "{file}");
                    assert_eq!(p, path);
                }
                other => panic!("{file}: expected an input error, got {other:?}"),
            }
            let msg = Bars::from_csv_path(&path).unwrap_err().to_string();
            assert!(msg.starts_with(&format!("{}:{}: ", path.display(), case["line"])), "{msg}");
        }
    }

    #[test]
    fn iso_fixture_equals_unix_fixture() {
        let a = Bars::from_csv_path(&fixture("features_small.csv")).unwrap();
        let b = Bars::from_csv_path(&fixture("features_small_iso.csv")).unwrap();
        assert_eq!(a.len(), 400);
        assert_eq!(a, b);
    }

    #[test]
    fn real_data_loads_including_splits() {
        for name in ["aapl_daily_2000_2013.csv", "ibm_daily_2000_2013.csv", "msft_daily_2000_2013.csv"] {
            let bars = Bars::from_csv_path(&data_dir().join(name)).unwrap();
            assert_eq!(bars.len(), 3270, "{name}");
            assert_eq!(bars.timestamp[0], 951868800, "{name}"); // 2000-03-01
        }
    }

    #[test]
    fn header_aliases_case_and_extra_columns() {
        for alias in ["Date", " DATETIME ", "time", "TimeStamp"] {
            let text = csv_text(&format!("extra,{alias},Open,HIGH,low,close,Volume"), 0)
                + &(0..101).map(|i| format!("x,{},2,3,1,2,5\n", 1000 + i)).collect::<String>();
            let bars = parse(&text).unwrap();
            assert_eq!(bars.len(), 101);
            assert_eq!(bars.high[0], 3.0);
        }
    }

    #[test]
    fn bom_crlf_quotes_and_blank_lines() {
        let mut text = String::from("\u{feff}\"Date\",open,high,low,close,volume\r\n\r\n");
        for i in 0..101 {
            text += &format!("\"2024-01-{:02}\",2,3,1,2,5\r\n", 1 + i % 28);
            if i == 27 {
                break;
            }
        }
        // 28 distinct days, then a non-increasing repeat of day 1 at line 31.
        text += "2024-01-01,2,3,1,2,5\r\n";
        let e = parse(&text).unwrap_err();
        match e {
            Error::Input { line, rule, .. } => {
                assert_eq!(line, 31);
                assert_eq!(rule, "timestamps must be strictly increasing");
            }
            other => panic!("{other}"),
        }
    }

    #[test]
    fn field_splitting() {
        assert_eq!(split_fields("a, b ,,c").unwrap(), ["a", " b ", "", "c"]);
        assert_eq!(split_fields(r#""x,y",1,"say ""hi""""#).unwrap(), ["x,y", "1", r#"say "hi""#]);
        assert!(split_fields(r#""open,1"#).is_none());
        let e = parse("timestamp,open,high,low,close,volume\n\n1,\"2,3,1,2,5\n").unwrap_err();
        assert!(matches!(&e, Error::Input { line: 3, rule, .. } if rule == "unbalanced quotes"), "{e}");
    }

    #[test]
    fn header_errors_at_line_one() {
        let e = parse("timestamp,open,high,low,close\n1,1,1,1,1\n").unwrap_err();
        assert!(matches!(&e, Error::Input { line: 1, rule, .. } if rule.contains("volume")), "{e}");
        let e = parse("date,timestamp,open,high,low,close,volume\n").unwrap_err();
        assert!(matches!(&e, Error::Input { line: 1, rule, .. } if rule.contains("more than once")), "{e}");
        let e = parse("").unwrap_err();
        assert!(matches!(&e, Error::Input { line: 1, .. }), "{e}");
    }

    #[test]
    fn row_errors_in_order() {
        let h = "timestamp,open,high,low,close,volume\n";
        let cases = [
            ("1,2,3,1\n", "fewer fields"),
            ("yesterday,2,3,1,2,5\n", "timestamp"),
            ("1,2,x,1,2,5\n", "`high` is not a number"),
            // Non-numeric volume wins over a bad price: numbers come first.
            ("1,-2,3,1,2,x\n", "`volume` is not a number"),
            ("1,2,3,1,inf,5\n", "prices must be finite and positive (close = inf)"),
            ("1,2,3,0,2,5\n", "prices must be finite and positive (low = 0)"),
            // low above body beats high below body.
            ("1,2,1,3,2,5\n", "low must be"),
            ("1,2,3,1,2,NaN\n", "volume must be"),
        ];
        for (row, want) in cases {
            // Header, blank line, a good row, blank line, the bad row at line 5.
            let text = format!("{h}\n0,2,3,1,2,5\n\n{row}");
            let e = parse(&text).unwrap_err();
            match &e {
                Error::Input { line, rule, .. } => {
                    assert_eq!(*line, 5, "{row}");
                    assert!(rule.contains(want), "{row}: {rule}");
                }
                _ => panic!("{row}: {e}"),
            }
        }
    }

    #[test]
    fn too_few_bars_after_row_checks() {
        let e = parse(&csv_text("timestamp,open,high,low,close,volume", 100)).unwrap_err();
        assert!(matches!(e, Error::TooFewBars { bars: 100, .. }), "{e}");
        assert_eq!(parse(&csv_text("timestamp,open,high,low,close,volume", 101)).unwrap().len(), 101);
    }

    #[test]
    fn timestamps() {
        assert_eq!(parse_timestamp("1704070800"), Some(1704070800));
        assert_eq!(parse_timestamp("-5"), Some(-5));
        assert_eq!(parse_timestamp("2024-01-01"), Some(1704067200));
        assert_eq!(parse_timestamp("2024-01-01 01:00"), Some(1704070800));
        assert_eq!(parse_timestamp("2024-01-01T01:00:00Z"), Some(1704070800));
        assert_eq!(parse_timestamp("2024-01-01T01:00:00.999"), Some(1704070800));
        assert_eq!(parse_timestamp("2024-01-01T03:00:00+02:00"), Some(1704070800));
        assert_eq!(parse_timestamp("1969-12-31 23:59:59"), Some(-1));
        for bad in ["", "2024-13-01", "2024-01-01X", "2024/01/01", "1.5", "2024-01-01 25:00", "abc"] {
            assert_eq!(parse_timestamp(bad), None, "{bad}");
        }
    }

    #[test]
    fn validate_in_memory_bars() {
        let mut b = parse(&csv_text("timestamp,open,high,low,close,volume", 101)).unwrap();
        b.validate(Path::new("mem")).unwrap();
        b.low[5] = 1e9;
        let e = b.validate(Path::new("mem")).unwrap_err();
        assert!(e.to_string().starts_with("mem:7: low must be"), "{e}");
    }
}
