//! `fx-train`: the command users run. It composes the fx crates and holds no logic that
//! another service could reuse: parsing flags, printing, and wiring crates together.

mod agent;
mod batch;
mod bench;
mod cli;
mod config;
mod dataset;
mod device_memory;
mod gpu_busy;
mod hw;
mod lifecycle;
mod plots;
mod population;
mod progress;
mod quantize;
mod report;
mod rl_run;
mod run_dir;
mod run_start;
mod seq_run;
mod study;
mod sweep;
mod tensorboard;
mod train_env;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // A file-size limit (`ulimit -f`) would otherwise kill the process with SIGXFSZ in the
    // middle of a checkpoint; ignored, the write fails with EFBIG and the run stops with a
    // one-line error naming the file, its earlier checkpoints intact.
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_IGN at start-up, before any thread.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
    }
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return flag_error(e),
    };
    match run(cli) {
        Ok(lifecycle::Outcome::Finished) => ExitCode::SUCCESS,
        Ok(lifecycle::Outcome::Interrupted) => ExitCode::from(lifecycle::EXIT_INTERRUPTED),
        // Only a sweep pauses its trials, and it goes on after each.
        Ok(lifecycle::Outcome::Paused) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// One line with the whole cause chain: what failed and where (the crates' errors are one
/// line each; anything multi-line from a library is folded here too). A cause whose text
/// its context already quotes (an error type that prints its source and also returns it)
/// is said once.
fn error_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if !parts.last().is_some_and(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    let text = parts.join(": ");
    let line: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    line.join(" ")
}

fn run(cli: cli::Cli) -> anyhow::Result<lifecycle::Outcome> {
    let done = |r: anyhow::Result<()>| r.map(|()| lifecycle::Outcome::Finished);
    match cli.command {
        // The embedded default: synthetic market -> features -> DQN -> backtest report.
        // Each invocation gets a fresh run folder under runs/.
        None => {
            let mut cfg = config::RunConfig::default();
            cfg.apply_env_overrides(&fx_hw::Overrides::from_env()?);
            cfg.out = fresh_run_folder(&cfg.out);
            set_cpu_threads(cfg.model, cfg.threads)?;
            lifecycle::run(
                cfg,
                lifecycle::TrainOptions {
                    resume: false,
                    restart: false,
                    quiet: false,
                    steps: None,
                    pause_at: None,
                    inner: false,
                },
            )
        }
        Some(cli::Command::Train(args)) => {
            let (model, threads) = args.check_flags()?;
            set_cpu_threads(model, threads)?;
            let cfg = args.to_config()?;
            let opts = lifecycle::TrainOptions {
                resume: args.resume,
                restart: args.restart,
                quiet: args.quiet,
                steps: args.steps,
                pause_at: None,
                inner: false,
            };
            // A resumed study is one by its saved config (the flags need not repeat it).
            let saved_study = args.resume
                && config::RunConfig::from_toml_file(&cfg.out.join("config.toml")).is_ok_and(|c| study::is_study(&c));
            if saved_study || (!args.resume && study::is_study(&cfg)) {
                study::run(cfg, opts)
            } else {
                lifecycle::run(cfg, opts)
            }
        }
        Some(cli::Command::Eval(args)) if args.int8 => done(quantize::eval_int8(&args.checkpoint)),
        Some(cli::Command::Eval(args)) => done(rl_run::eval(&args.checkpoint)),
        Some(cli::Command::Hw(args)) => done(hw::run(&args)),
        Some(cli::Command::Features(args)) => done(features(&args)),
        Some(cli::Command::Bench(args)) => done(bench::run(&args)),
        Some(cli::Command::Sweep(args)) => sweep::run(&args),
        Some(cli::Command::Quantize(args)) => {
            // SIGTERM / Ctrl-C stop it like a trainer: its file is written atomically, so a
            // stop leaves the finished file or none (exit 130 either way).
            lifecycle::install_signal_handler();
            quantize::run(&args).map(|()| {
                if lifecycle::interrupted() {
                    lifecycle::Outcome::Interrupted
                } else {
                    lifecycle::Outcome::Finished
                }
            })
        }
    }
}

/// A command line clap refuses, as one line (`--help` and `--version` print as usual): its
/// first line, then where the usage is.
fn flag_error(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit();
    }
    let text = e.render().to_string();
    // clap's first paragraph is the error (a list of missing arguments continues it on
    // indented lines); usage and tips follow after a blank line.
    let first: Vec<&str> =
        text.lines().map(str::trim).skip_while(|l| l.is_empty()).take_while(|l| !l.is_empty()).collect();
    let first = if first.is_empty() { "invalid command line".to_string() } else { first.join(" ") };
    eprintln!("{} (fx-train --help for usage)", first.trim_end_matches('.'));
    ExitCode::from(2)
}

/// Sizes candle's CPU pool for the run before any tensor work (see `fx_hw::cpu_threads`).
fn set_cpu_threads(model: config::ModelChoice, threads: Option<usize>) -> anyhow::Result<()> {
    let n = fx_hw::cpu_threads(threads, !model.is_sequence())?;
    fx_hw::apply_cpu_threads(n.value);
    fx_hw::cap_work_threads(&n);
    Ok(())
}

/// `base` if it holds no run yet, else `base-2`, `base-3`, ...
fn fresh_run_folder(base: &std::path::Path) -> std::path::PathBuf {
    let taken = |p: &std::path::Path| p.join("config.toml").exists();
    if !taken(base) {
        return base.to_path_buf();
    }
    (2..).map(|i| std::path::PathBuf::from(format!("{}-{i}", base.display()))).find(|p| !taken(p)).expect("unbounded")
}

fn features(args: &cli::FeaturesArgs) -> anyhow::Result<()> {
    // A folder of per-instrument bar files, or one long-format file (a symbol column naming
    // several instruments; CSV or Parquet), is a panel (fx_data::panel).
    let parquet = fx_data::bars::is_parquet(&args.input);
    let long = !args.input.is_dir() && !parquet && fx_data::bars::is_long_format(&args.input)?;
    let panel = if args.input.is_dir() || long {
        Some(if long {
            fx_data::Panel::from_long_csv(&args.input)?
        } else {
            fx_data::Panel::from_csv_dir(&args.input)?
        })
    } else if parquet {
        fx_data::Panel::load(&args.input)?
    } else {
        None
    };
    if let Some(p) = panel {
        p.write(&args.output)?;
        let masked = p.mask.iter().filter(|&&m| m == 0).count();
        println!(
            "wrote {}: panel of {} instruments x {} calendar rows x {} market features ({masked} masked cells), timestamps {}..{}",
            args.output.display(),
            p.instruments.len(),
            p.rows(),
            p.n_market(),
            p.timestamp.first().copied().unwrap_or_default(),
            p.timestamp.last().copied().unwrap_or_default()
        );
        return Ok(());
    }
    let s = fx_data::build_feature_file(&args.input, &args.output)?;
    println!(
        "wrote {}: {} rows x {} market + 4 calendar features from {} bars ({} warm-up bars dropped), timestamps {}..{}",
        s.output.display(),
        s.rows,
        s.n_market,
        s.bars,
        s.bars - s.rows,
        s.first_timestamp,
        s.last_timestamp
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::error_line;

    /// An error that prints its source in its own text and also returns it as its source,
    /// as some libraries' do.
    #[derive(Debug)]
    struct Quoting(std::io::Error);

    impl std::fmt::Display for Quoting {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "write failed: {}", self.0)
        }
    }

    impl std::error::Error for Quoting {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_repeated_cause_is_said_once_on_one_line() {
        let io = std::io::Error::from_raw_os_error(27);
        let cause = io.to_string();
        let e = anyhow::Error::new(Quoting(io)).context("writing /runs/a/checkpoint-0000000040.safetensors");
        let line = error_line(&e);
        assert_eq!(line.matches(&cause).count(), 1, "{line}");
        assert!(line.starts_with("writing /runs/a/checkpoint-0000000040.safetensors: write failed: "), "{line}");
        // Distinct causes all stay, in order, and a multi-line one is folded into the line.
        let e = anyhow::anyhow!("line one\n  line two").context("parsing x.toml").context("starting the run");
        assert_eq!(error_line(&e), "starting the run: parsing x.toml: line one line two");
    }
}
