//! `fx-train`: the command users run. It composes the fx crates and holds no logic that
//! another service could reuse: parsing flags, printing, and wiring crates together.

mod bench;
mod cli;
mod hw;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line with the whole cause chain: what failed and where.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: cli::Cli) -> anyhow::Result<()> {
    match cli.command {
        None => hw::run(&cli::HwArgs::default()),
        Some(cli::Command::Hw(args)) => hw::run(&args),
        Some(cli::Command::Features(args)) => features(&args),
        Some(cli::Command::Bench(args)) => bench::run(&args),
    }
}

fn features(args: &cli::FeaturesArgs) -> anyhow::Result<()> {
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
