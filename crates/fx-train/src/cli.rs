//! Command-line flags. Every flag maps one to one onto a config field.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Train and evaluate trading models (DQN, PPO, TFT, MAMBA-2) on market features.
#[derive(Debug, Parser)]
#[command(name = "fx-train", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the hardware budget: device, memory, precision, batch sizes (and their sources).
    Hw(HwArgs),
    /// Read OHLCV bars (CSV) and write the feature file (safetensors, schema fx-features/1).
    Features(FeaturesArgs),
    /// Measure training throughput, peak memory and batch-1 latency (bench.py's output shape).
    Bench(crate::bench::BenchArgs),
}

#[derive(Debug, Args, Default)]
pub struct HwArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Device to plan for: auto, cpu, cuda or cuda:N (default: auto; env FX_DEVICE).
    #[arg(long)]
    pub device: Option<String>,
    /// Compute precision: f32, bf16 or f16 (default: from the hardware; env FX_PRECISION).
    #[arg(long)]
    pub precision: Option<fx_hw::Precision>,
    /// Batch size for every model (default: from the budget; env FX_BATCH_SIZE).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// On a GPU, measure bytes per sample with a small MLP training step (default: on with cuda).
    #[arg(long)]
    pub no_probe: bool,
}

#[derive(Debug, Args)]
pub struct FeaturesArgs {
    /// OHLCV CSV input (columns timestamp|date|time|datetime, open, high, low, close, volume).
    #[arg(long)]
    pub input: PathBuf,
    /// Feature file to write (safetensors); written to a temporary file, then renamed.
    #[arg(long)]
    pub output: PathBuf,
}
