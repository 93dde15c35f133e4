//! The per-phase progress bar (indicatif), hidden in quiet mode.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `len` units (e.g. "env steps", "batches") starting at `start`; hidden when
/// `quiet`.
pub fn bar(prefix: String, len: u64, start: u64, unit: &str, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len).with_position(start);
    let template = format!("{{prefix}} [{{bar:30}}] {{pos}}/{{len}} {unit} ({{per_sec}}, {{eta}}) {{msg}}");
    bar.set_style(
        ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()).progress_chars("=> "),
    );
    bar.set_prefix(prefix);
    bar
}
