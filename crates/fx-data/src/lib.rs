//! fx-data is the data layer of fx: it reads users' OHLCV bars (strictly
//! validated CSV or Parquet, one instrument or many), computes the 51 market and 4 calendar features of
//! `spec/DATA.md` in f64, writes and memory-maps safetensors feature files,
//! generates a seeded synthetic market for the default run, normalises and
//! splits the rows chronologically, and feeds training through seeded
//! samplers and a background prefetcher so the GPU never waits for data.

#![warn(missing_docs)]

pub mod bars;
pub mod batch;
pub mod double_buffer;
pub mod error;
pub mod feature_file;
pub mod features;
pub mod files;
#[cfg(test)]
mod fuzz_support;
pub mod normalize;
pub mod panel;
pub mod panel_file;
pub mod pinned;
pub mod prefetch;
pub mod rng;
pub mod sampler;
pub mod split;
pub mod synthetic;

pub use bars::Bars;
pub use batch::{assemble, BatchLayout, BatchLoader, HostBatch};
#[cfg(feature = "cuda")]
pub use double_buffer::DeviceBatch;
pub use double_buffer::DoubleBufferedLoader;
pub use error::Error;
pub use feature_file::{build_feature_file, FeatureFileSummary, FeatureStore, FeatureTable};
pub use normalize::Normalizer;
pub use panel::Panel;
pub use panel_file::PanelFile;
pub use pinned::{HostBuffer, HostBufferPool, PooledBuffer};
pub use prefetch::{PrefetchConfig, Prefetcher, TryNext};
pub use rng::Rng;
pub use sampler::{BatchIndex, EpochStream, Sampler};
pub use split::{Fold, SplitConfig, Splits, WalkForwardConfig, Window};
pub use synthetic::{Interval, Regime, SyntheticConfig};
