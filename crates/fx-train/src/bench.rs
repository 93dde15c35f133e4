//! `fx-train bench`: training throughput, peak memory and batch-1 latency.

use anyhow::Result;
use clap::Args;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Print JSON (bench.py's shape) instead of a table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(_args: &BenchArgs) -> Result<()> {
    anyhow::bail!("fx-train bench is not implemented yet")
}
