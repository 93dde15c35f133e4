//! `loader_*` cases: how much of the wall time a fixed compute workload waits for its input
//! when fed by fx-data's loader, with and without double buffering (issue 3, "Measured,
//! not assumed": target ≤ 5 % stall when batch preparation is shorter than the compute).
//!
//! Input: windows of a synthetic feature store (`B` windows of `L` rows, 51 market features
//! normalised on the fly + 4 calendar + 1 target = 56 floats per row), assembled by
//! [`fx_data::BatchLoader`]'s prefetch workers into pinned pool buffers (CUDA) or plain
//! ones (CPU). Workload per batch: the whole batch buffer seen as `[B·L, 56]`, then
//! `tanh(x·W_in)` and `reps` × `tanh(h·W)` on its first `rows_used` rows (hidden 256 on CUDA, 64 on the CPU), with `reps`
//! calibrated so that one batch's compute takes about the target time.
//!
//! Modes (CUDA):
//! - `compute_only` is not a record of its own: every record carries the reference
//!   (`compute_ref_ms_per_batch`, `ref_stall_frac`) from the same workload on a resident
//!   device buffer;
//! - `sync`: the next host batch from the `BatchLoader` (prefetch workers), uploaded on the
//!   compute stream (candle's), then the compute: the GPU waits for every upload;
//! - `double_buffered`: [`fx_data::DoubleBufferedLoader`]: the upload of batch n+1 runs on
//!   a copy stream while the compute stream works on batch n.
//!
//! In both CUDA modes the device batch is copied device-to-device into a candle-owned
//! buffer (`CudaStorage::wrap_cuda_slice` needs an owned slice; the loader lends its slot
//! only until the next call); the copy is part of the timed compute, in the reference too.
//!
//! Modes (CPU, host clock): `sync` assembles each batch on the consumer thread; and
//! `double_buffered`, which on the CPU is the `BatchLoader` itself (what
//! `DoubleBufferedLoader` is without `cuda`): batches assembled ahead by the workers.
//!
//! Timing: compute per batch is an event pair on the compute stream around the workload
//! (CUDA) or the host clock (CPU); wall is the host clock over the timed batches with the
//! device synchronised before and after; `stall_frac = 1 − Σcompute / wall`.
//!
//! Scenarios: `loader_stall` (several workers; the compute target is at least 1.5× the
//! per-batch preparation time divided by the workers, so preparation is shorter than the
//! compute) and `loader_stall_prep_bound` (1 worker, the matmuls on an eighth of the rows,
//! compute ≈ a third of the single-thread preparation time: the loader is the limit and the stall is ≈ 1 − compute/prep whatever
//! the buffering).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use fx_data::synthetic::{feature_table, SyntheticConfig};
use fx_data::{assemble, BatchLayout, BatchLoader, FeatureStore, HostBufferPool, Normalizer, PrefetchConfig, Sampler};
use serde_json::json;

use super::timing::round;
use super::{Ctx, Record};

/// Epochs handed to the loaders (they are dropped long before the end).
const EPOCHS: u64 = 1_000;

/// The feed of a case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Upload (CUDA) or assembly (CPU) in line with the compute.
    Sync,
    /// The double-buffered loader (CPU: the prefetching `BatchLoader`).
    DoubleBuffered,
}

impl Mode {
    pub(crate) const ALL: [Mode; 2] = [Mode::Sync, Mode::DoubleBuffered];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::DoubleBuffered => "double_buffered",
        }
    }
}

/// Preparation faster than the compute (several workers), or the loader as the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    PrepFast,
    PrepBound,
}

impl Scenario {
    pub(crate) const ALL: [Scenario; 2] = [Scenario::PrepFast, Scenario::PrepBound];

    pub(crate) fn case(self) -> &'static str {
        match self {
            Scenario::PrepFast => "loader_stall",
            Scenario::PrepBound => "loader_stall_prep_bound",
        }
    }
}

/// Sizes per device.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) batch: usize,
    window: usize,
    hidden: usize,
    bars: usize,
    /// Workers of the `PrepFast` scenario.
    workers: usize,
    /// Compute per batch (ms) of the `PrepFast` scenario, at least.
    target_ms: f64,
}

pub(crate) fn sizes(cuda: bool, quick: bool) -> Sizes {
    match (cuda, quick) {
        // 512 × 64 rows × 56 floats = 7.3 MB per batch.
        (true, _) => Sizes { batch: 512, window: 64, hidden: 256, bars: 40_000, workers: 4, target_ms: 2.0 },
        (false, false) => Sizes { batch: 64, window: 32, hidden: 64, bars: 8_000, workers: 2, target_ms: 2.0 },
        (false, true) => Sizes { batch: 32, window: 16, hidden: 32, bars: 2_000, workers: 2, target_ms: 1.0 },
    }
}

/// The fixed workload.
struct Work {
    w_in: Tensor,
    w: Tensor,
    reps: usize,
    /// Rows of the batch the matmuls read (all, or a slice to shorten the compute).
    rows_used: usize,
}

impl Work {
    fn new(device: &Device, rows_used: usize, cols: usize, hidden: usize) -> Result<Self> {
        let w_in = (Tensor::randn(0f32, 1f32, (cols, hidden), &Device::Cpu)? / (cols as f64).sqrt())?;
        let w = (Tensor::randn(0f32, 1f32, (hidden, hidden), &Device::Cpu)? / (hidden as f64).sqrt())?;
        Ok(Work { w_in: w_in.to_device(device)?, w: w.to_device(device)?, reps: 1, rows_used })
    }

    /// Queues the workload on `x` (`[rows, cols]`); nothing is read back.
    fn run(&self, x: &Tensor) -> Result<()> {
        let mut h = x.narrow(0, 0, self.rows_used)?.matmul(&self.w_in)?.tanh()?;
        for _ in 0..self.reps {
            h = h.matmul(&self.w)?.tanh()?;
        }
        drop(h);
        Ok(())
    }

    /// Mean wall ms of one workload on `x` with `reps` repetitions (device synchronised).
    fn time_reps(&mut self, device: &Device, x: &Tensor, reps: usize) -> Result<f64> {
        self.reps = reps;
        self.run(x)?;
        device.synchronize()?;
        let n = 5;
        let t0 = Instant::now();
        for _ in 0..n {
            self.run(x)?;
        }
        device.synchronize()?;
        Ok(t0.elapsed().as_secs_f64() * 1e3 / n as f64)
    }

    /// Sets `reps` so that one workload takes about `target_ms` (linear in reps).
    fn calibrate(&mut self, device: &Device, x: &Tensor, target_ms: f64) -> Result<()> {
        let (r_a, r_b) = (1usize, 9usize);
        let t_a = self.time_reps(device, x, r_a)?;
        let t_b = self.time_reps(device, x, r_b)?;
        let per_rep = ((t_b - t_a) / (r_b - r_a) as f64).max(1e-4);
        let fixed = (t_a - per_rep * r_a as f64).max(0.0);
        self.reps = ((target_ms - fixed) / per_rep).round().clamp(0.0, 4000.0) as usize;
        Ok(())
    }
}

/// Per-batch compute marks: an event pair on the compute stream (CUDA), the host clock
/// (CPU), or nothing (warm-up).
enum Marks {
    Off,
    Host {
        started: Option<Instant>,
        total_ms: f64,
    },
    #[cfg(feature = "cuda")]
    Events {
        stream: Arc<cudarc::driver::CudaStream>,
        pairs: Vec<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
        next: usize,
    },
}

impl Marks {
    fn for_device(device: &Device, n: usize) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cd) = device {
            use cudarc::driver::sys::CUevent_flags;
            let stream = cd.cuda_stream();
            let ctx = stream.context();
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                pairs.push((
                    ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
                    ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
                ));
            }
            return Ok(Marks::Events { stream, pairs, next: 0 });
        }
        let _ = (device, n);
        Ok(Marks::Host { started: None, total_ms: 0.0 })
    }

    fn start(&mut self) -> Result<()> {
        match self {
            Marks::Off => {}
            Marks::Host { started, .. } => *started = Some(Instant::now()),
            #[cfg(feature = "cuda")]
            Marks::Events { stream, pairs, next } => pairs[*next].0.record(stream)?,
        }
        Ok(())
    }

    fn end(&mut self) -> Result<()> {
        match self {
            Marks::Off => {}
            Marks::Host { started, total_ms } => {
                let t = started.take().context("compute mark ended before it started")?;
                *total_ms += t.elapsed().as_secs_f64() * 1e3;
            }
            #[cfg(feature = "cuda")]
            Marks::Events { stream, pairs, next } => {
                pairs[*next].1.record(stream)?;
                *next += 1;
            }
        }
        Ok(())
    }

    /// Total compute ms over the marked batches (after the device is synchronised).
    fn total_ms(&self) -> Result<f64> {
        match self {
            Marks::Off => Ok(0.0),
            Marks::Host { total_ms, .. } => Ok(*total_ms),
            #[cfg(feature = "cuda")]
            Marks::Events { pairs, next, .. } => {
                let mut s = 0.0;
                for (a, b) in &pairs[..*next] {
                    s += f64::from(a.elapsed_ms(b)?);
                }
                Ok(s)
            }
        }
    }
}

/// Runs `warm` unmarked then `n` marked steps; returns (Σ compute ms, wall s).
fn drive(device: &Device, warm: usize, n: usize, mut step: impl FnMut(&mut Marks) -> Result<()>) -> Result<(f64, f64)> {
    let mut off = Marks::Off;
    for _ in 0..warm {
        step(&mut off)?;
    }
    let mut marks = Marks::for_device(device, n)?;
    device.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..n {
        step(&mut marks)?;
    }
    device.synchronize()?;
    let wall = t0.elapsed().as_secs_f64();
    Ok((marks.total_ms()?, wall))
}

/// The synthetic store, its normaliser and the window sampler of a size set.
struct Fixture {
    store: Arc<FeatureStore>,
    norm: Arc<Normalizer>,
    sampler: Sampler,
    layout: BatchLayout,
}

impl Fixture {
    fn new(s: &Sizes) -> Result<Self> {
        let table = feature_table(&SyntheticConfig { bars: s.bars, seed: 11, ..Default::default() })?;
        let store = Arc::new(FeatureStore::from_table(table)?);
        let rows = store.rows();
        let norm = Arc::new(Normalizer::fit(&store, 0..rows)?);
        #[allow(clippy::single_range_in_vec_init)] // one range: every row of the store
        let sampler = Sampler::windows(&[0..rows], s.window, s.batch, 5)?.drop_last(true);
        anyhow::ensure!(sampler.batches_per_epoch() > 0, "{rows} rows are too few for batches of {}", s.batch);
        let layout = BatchLayout { batch_size: s.batch, window: s.window, n_market: store.n_market() };
        Ok(Fixture { store, norm, sampler, layout })
    }

    /// Mean ms to assemble one batch on this thread.
    fn prep_ms(&self, n: usize) -> Result<f64> {
        let mut buf = vec![0f32; self.layout.buffer_len()];
        let idx: Vec<_> = self.sampler.stream(0..EPOCHS).take(n + 1).collect();
        assemble(&self.store, Some(&self.norm), &self.layout, &idx[0].starts, &mut buf)?;
        let t0 = Instant::now();
        for b in &idx[1..] {
            assemble(&self.store, Some(&self.norm), &self.layout, &b.starts, &mut buf)?;
        }
        Ok(t0.elapsed().as_secs_f64() * 1e3 / n as f64)
    }

    fn loader(&self, pool: HostBufferPool, cfg: &PrefetchConfig) -> Result<BatchLoader> {
        Ok(BatchLoader::new(self.store.clone(), Some(self.norm.clone()), &self.sampler, 0..EPOCHS, pool, cfg)?)
    }
}

/// A candle tensor `[rows, cols]` holding a copy of the first `rows·cols` floats of `src`
/// (device-to-device on candle's stream).
#[cfg(feature = "cuda")]
fn device_tensor(
    cd: &candle_core::CudaDevice,
    src: &cudarc::driver::CudaSlice<f32>,
    rows: usize,
    cols: usize,
) -> Result<Tensor> {
    let stream = cd.cuda_stream();
    let n = rows * cols;
    anyhow::ensure!(src.len() >= n, "device batch of {} floats, the workload reads {n}", src.len());
    // SAFETY: fully overwritten by the copy below, queued on the same stream.
    let mut dst = unsafe { stream.alloc::<f32>(n) }?;
    stream.memcpy_dtod(&src.slice(0..n), &mut dst)?;
    let st = candle_core::CudaStorage::wrap_cuda_slice(dst, cd.clone());
    Ok(Tensor::from_storage(candle_core::Storage::Cuda(st), (rows, cols), candle_core::op::BackpropOp::none(), false))
}

/// One `loader_*` case: calibration, the resident-buffer reference, then the fed loop.
pub(crate) fn loader_case(ctx: &mut Ctx, sc: Scenario, mode: Mode, rec: &mut Record) -> Result<()> {
    let device = ctx.device.clone();
    let s = sizes(device.is_cuda(), ctx.quick);
    let fx = Fixture::new(&s)?;
    let len = fx.layout.buffer_len();
    let (rows, cols) = (s.batch * s.window, len / (s.batch * s.window));
    let prep_ms = fx.prep_ms(if ctx.quick { 3 } else { 10 })?;
    // The prep-bound case reads an eighth of the rows so that its compute can be short.
    let (workers, target_ms, rows_used) = match sc {
        Scenario::PrepFast => (s.workers, s.target_ms.max(1.5 * prep_ms / s.workers as f64), rows),
        Scenario::PrepBound => (1, prep_ms / 3.0, (rows / 8).max(1)),
    };
    let cfg = PrefetchConfig { depth: 2, workers };
    let n = ctx.steps * 4;
    let warm = ctx.warmup * 2;

    // The workload and its reference on a resident input.
    let mut work = Work::new(&device, rows_used, cols, s.hidden)?;
    let host_x: Vec<f32> = (0..len).map(|i| ((i % 97) as f32 - 48.0) / 48.0).collect();
    let x_ref = Tensor::from_slice(&host_x, (rows, cols), &device)?;
    work.calibrate(&device, &x_ref, target_ms)?;
    #[cfg_attr(not(feature = "cuda"), allow(clippy::match_single_binding))]
    let (ref_ms, ref_wall) = match &device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cd) => {
            let resident = cd.cuda_stream().clone_htod(&host_x[..])?;
            drive(&device, warm, n, |m| {
                m.start()?;
                work.run(&device_tensor(cd, &resident, rows, cols)?)?;
                m.end()
            })?
        }
        _ => drive(&device, warm, n, |m| {
            // The CPU "upload": a tensor from the host slice, outside the compute marks.
            let x = Tensor::from_slice(&host_x, (rows, cols), &device)?;
            m.start()?;
            work.run(&x)?;
            m.end()
        })?,
    };

    let (compute_ms, wall) = match (&device, mode) {
        #[cfg(feature = "cuda")]
        (Device::Cuda(cd), Mode::Sync) => {
            let stream = cd.cuda_stream();
            let mut loader = fx.loader(HostBufferPool::pinned(stream.context().clone(), len), &cfg)?;
            // SAFETY: each batch's upload fully overwrites it before the compute reads it.
            let mut dev_buf = unsafe { stream.alloc::<f32>(len) }?;
            drive(&device, warm, n, |m| {
                let b = loader.next().context("the loader ended")??;
                let hb = b.buffer().buffer();
                match hb.pinned() {
                    Some(p) => stream.memcpy_htod(p, &mut dev_buf)?,
                    None => stream.memcpy_htod(hb.as_slice(), &mut dev_buf)?,
                }
                drop(b);
                m.start()?;
                work.run(&device_tensor(cd, &dev_buf, rows, cols)?)?;
                m.end()
            })?
        }
        #[cfg(feature = "cuda")]
        (Device::Cuda(cd), Mode::DoubleBuffered) => {
            let stream = cd.cuda_stream();
            let loader = fx.loader(HostBufferPool::pinned(stream.context().clone(), len), &cfg)?;
            let mut dbl = fx_data::DoubleBufferedLoader::new(loader, stream)?;
            drive(&device, warm, n, |m| {
                let b = dbl.next_batch().context("the loader ended")??;
                m.start()?;
                work.run(&device_tensor(cd, b.data, rows, cols)?)?;
                m.end()
            })?
        }
        (_, Mode::Sync) => {
            let mut idx = fx.sampler.stream(0..EPOCHS);
            let mut buf = vec![0f32; len];
            drive(&device, warm, n, |m| {
                let b = idx.next().context("the sampler ended")?;
                assemble(&fx.store, Some(&fx.norm), &fx.layout, &b.starts, &mut buf)?;
                let x = Tensor::from_slice(&buf, (rows, cols), &device)?;
                m.start()?;
                work.run(&x)?;
                m.end()
            })?
        }
        (_, Mode::DoubleBuffered) => {
            let mut loader = fx.loader(HostBufferPool::new(len), &cfg)?;
            drive(&device, warm, n, |m| {
                let b = loader.next().context("the loader ended")??;
                let x = Tensor::from_slice(&b.buffer()[..len], (rows, cols), &device)?;
                drop(b);
                m.start()?;
                work.run(&x)?;
                m.end()
            })?
        }
    };

    let stall = |compute_ms: f64, wall_s: f64| (1.0 - compute_ms / (wall_s * 1e3)).clamp(0.0, 1.0);
    let bytes = len * 4;
    let feed = match (device.is_cuda(), mode) {
        (true, Mode::Sync) => "BatchLoader (pinned) -> upload on the compute stream -> dtod copy + workload",
        (true, Mode::DoubleBuffered) => "DoubleBufferedLoader (copy stream, 2 slots) -> dtod copy + workload",
        (false, Mode::Sync) => "assemble on the consumer thread -> workload",
        (false, Mode::DoubleBuffered) => "BatchLoader prefetch workers (CPU DoubleBufferedLoader) -> workload",
    };
    let ins = |r: &mut Record, k: &str, v: serde_json::Value| {
        r.insert(k.into(), v);
    };
    ins(rec, "status", json!("ok"));
    ins(rec, "timing", json!(if device.is_cuda() { "cuda_events" } else { "host_clock" }));
    ins(rec, "feed", json!(feed));
    ins(rec, "window", json!(s.window));
    ins(rec, "workers", json!(workers));
    ins(rec, "depth", json!(cfg.depth));
    ins(rec, "bytes_per_batch", json!(bytes));
    ins(rec, "batches", json!(n));
    ins(rec, "prep_ms_per_batch", json!(round(prep_ms, 4)));
    ins(rec, "prep_ms_per_batch_effective", json!(round(prep_ms / workers as f64, 4)));
    ins(rec, "compute_target_ms", json!(round(target_ms, 4)));
    ins(rec, "matmul_reps", json!(work.reps));
    ins(
        rec,
        "workload",
        json!(format!(
            "dtod/upload [{rows},{cols}]; [{rows_used},{cols}]x[{cols},{h}] + {}x[{h},{h}] matmul+tanh, f32",
            work.reps,
            h = s.hidden
        )),
    );
    ins(rec, "compute_ref_ms_per_batch", json!(round(ref_ms / n as f64, 4)));
    ins(rec, "ref_wall_ms_per_batch", json!(round(ref_wall * 1e3 / n as f64, 4)));
    ins(rec, "ref_stall_frac", json!(round(stall(ref_ms, ref_wall), 4)));
    ins(rec, "compute_ms_per_batch", json!(round(compute_ms / n as f64, 4)));
    ins(rec, "wall_ms_per_batch", json!(round(wall * 1e3 / n as f64, 4)));
    ins(rec, "stall_frac", json!(round(stall(compute_ms, wall), 4)));
    ins(rec, "batches_per_s", json!(round(n as f64 / wall, 1)));
    ins(rec, "gb_per_s", json!(round(bytes as f64 * n as f64 / wall / 1e9, 3)));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::{run_cases, Plan};
    use super::*;
    use serde_json::Value;

    #[test]
    fn cpu_loader_records_have_a_stall_fraction() {
        let plan = Plan {
            train: Vec::new(),
            pop: Vec::new(),
            precisions: Vec::new(),
            latency: Vec::new(),
            infer_batch: 0,
            seq_infer: Vec::new(),
            env_e: None,
            env_series: 400,
            h2d: Vec::new(),
            loader: true,
            warmup: 1,
            steps: 2,
            lat_warm: 1,
            lat_n: 1,
            env_n: 1,
            quick: true,
        };
        let mut ctx = Ctx::new(Device::Cpu, &plan).unwrap();
        let recs = run_cases(&mut ctx, &plan);
        assert_eq!(recs.len(), 4, "{recs:#?}");
        let keys: Vec<(&str, &str)> =
            recs.iter().map(|r| (r["case"].as_str().unwrap(), r["mode"].as_str().unwrap())).collect();
        assert_eq!(
            keys,
            [
                ("loader_stall", "sync"),
                ("loader_stall", "double_buffered"),
                ("loader_stall_prep_bound", "sync"),
                ("loader_stall_prep_bound", "double_buffered")
            ]
        );
        for r in &recs {
            assert_eq!(r["status"], "ok", "{r:?}");
            assert_eq!(r["kind"], "loader");
            let f = |k: &str| r.get(k).and_then(Value::as_f64).unwrap_or_else(|| panic!("{k} missing in {r:?}"));
            let s = f("stall_frac");
            assert!((0.0..=1.0).contains(&s), "{r:?}");
            assert!(f("wall_ms_per_batch") > 0.0 && f("compute_ms_per_batch") > 0.0, "{r:?}");
            assert!(f("compute_ms_per_batch") <= f("wall_ms_per_batch") * 1.001 + 1e-3, "{r:?}");
            assert!(f("batches_per_s") > 0.0 && f("gb_per_s") > 0.0 && f("compute_ref_ms_per_batch") > 0.0);
            assert_eq!(f("batches"), 8.0);
        }
    }
}
