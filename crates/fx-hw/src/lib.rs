//! Hardware detection and per-device budgets.
//!
//! `fx-hw` is the bottom layer of fx: it answers "what am I running on, and how much of
//! it may a training run use?". [`HardwareBudget::detect`] reads the GPU (through
//! cudarc's driver API when built with the `cuda` feature) and the host, never panics,
//! and falls back to the CPU with the reason recorded. From that it derives the compute
//! [`Precision`], batch sizes per model ([`CostModel`], [`batch_size`]), how many members of
//! a population fit ([`HardwareBudget::population_size`]) and aligned
//! dimensions ([`align`]). Every derived value carries its [`Source`], so a user can see
//! whether it was detected, estimated, measured by a probe, or overridden through the
//! config or the environment (`FX_DEVICE`, `FX_PRECISION`, `FX_BATCH_SIZE`, `FX_POPULATION`). [`cpu_threads`]
//! sizes candle's CPU thread pool by the work and by the CPUs the process may use; under
//! `cuda`, [`busy::BusyMeter`] reads the GPU's busy fraction for run profiles, and
//! `open_cuda` opens a device the way fx runs on it (a stream of its own; see its module).
//!
//! ```
//! let budget = fx_hw::HardwareBudget::detect_with(&fx_hw::Overrides::default().with_device("cpu"));
//! assert_eq!(budget.precision.value, fx_hw::Precision::F32);
//! assert!(budget.batch_size(fx_hw::ModelKind::Dqn).value >= 64);
//! ```

pub mod align;
mod budget;
#[cfg(feature = "cuda")]
pub mod busy;
#[cfg(feature = "cuda")]
mod cuda_device;
mod device;
mod error;
mod overrides;
mod precision;
#[cfg(feature = "cuda")]
mod probe;
mod seeds;
mod threads;

pub use budget::{batch_size, population_size, CostModel, ModelKind, BATCH_MAX, BATCH_MIN};
#[cfg(feature = "cuda")]
pub use cuda_device::{device_wide_lock, open_cuda, test_gpu};
pub use device::{DeviceKind, GpuInfo, HardwareBudget, HostInfo};
pub use error::Error;
pub use overrides::{DeviceRequest, Overrides, Source, Sourced};
pub use precision::Precision;
#[cfg(feature = "cuda")]
pub use probe::probe_bytes_per_sample;
pub use seeds::test_seed;
pub use threads::{apply_cpu_threads, cap_work_threads, cpu_threads, par_map, usable_cpus, work_threads};
