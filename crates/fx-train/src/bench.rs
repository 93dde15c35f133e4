//! `fx-train bench`: training throughput, peak memory and batch-1 latency of the library's
//! DQN and PPO, in the shape of `../shared/reference/bench.py`'s output, so that one
//! device call can run both and `scripts/compare.py` prints the ratios.
//!
//! Cases (names and batches as bench.py's, so rows match by `case`):
//! - `dqn_train_b{8192,2048,230}` and `ppo_train_b2048` (CPU: DQN 1024/230, PPO 512), mode
//!   `eager_fp32` / `eager_bf16` (our F32 / BF16 precision policy) and, on CUDA,
//!   `graph_fp32` / `graph_bf16` (the same update captured as a CUDA graph, replayed with no
//!   host read; `graph_nodes` in the record): one step is the trainers' whole update (see
//!   [`train`]); `samples_per_s` = batch / median step time
//!   over `--steps` timed steps after 10 warm-up steps (2 with `--quick`);
//! - `dqn_pop{64,256}_train_b256` and `ppo_pop64_train_b512` (CPU: `dqn_pop8_train_b64`,
//!   `ppo_pop8_train_b64`), the same modes: N DQN runs trained as one
//!   [`fx_models::DqnPopulation`] (γ spread over members as bench.py's), N PPO learners'
//!   minibatch updates as one [`fx_models::PpoPopulation`] (entropy weight spread as
//!   bench.py's), `samples_per_s` = N × batch / median step time (see [`train`]);
//! - `dqn_infer_b1`, `ppo_infer_b1`: batch-1 greedy action latency, p50/p99/mean over
//!   2000 calls (`eager_fp32`; on CUDA also the one-launch `fused_fp32` and the host-to-host
//!   `fused_fp32_e2e`; on the CPU `cpu_fp32` and `int8`, see [`latency`]);
//! - `dqn_infer_b256`, `ppo_infer_b256` (kind `infer`): greedy-action throughput at batch
//!   256, `eager_fp32` (and on the CPU `cpu_fp32`, `int8`), see [`latency`];
//! - `env_step_E4096`, `dqn_collect_E4096` (CPU: E = 512), mode `eager`; on CUDA the
//!   collection also `fused` (fused Q forward + one experience kernel, see [`env_step`]);
//! - `h2d_*` (CUDA only): upload bandwidth from pinned and pageable host buffers;
//! - `loader_stall`, `loader_stall_prep_bound`, mode `sync` / `double_buffered`: the
//!   fraction of wall time a fixed workload waits for fx-data's loader (see [`loader`]).
//!
//! Timing on CUDA is device-side (an event pair on candle's stream around each step, no
//! host sync inside the loop: `timing: "cuda_events"`), on the CPU the host clock. Peak
//! memory on CUDA comes from the memory pool's high-water mark (see [`memory`]); on the
//! CPU it is null. A failing case is reported with `status: "error"` and the run goes on;
//! the exit code is 1 if any case failed.

mod data;
mod env_step;
mod latency;
mod loader;
mod seq_infer;
mod timing;
mod train;

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use clap::{Args, ValueEnum};
use fx_precision::Precision;
use serde_json::{json, Map, Value};

use crate::device_memory::MemProbe;
use env_step::EnvWhat;
use timing::StepTimer;

/// One JSON record (bench.py's per-case dict).
pub(crate) type Record = Map<String, Value>;

/// Which models to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchModel {
    /// DQN training and latency.
    Dqn,
    /// PPO training and latency.
    Ppo,
    /// TFT training (batch 256; CPU 8).
    Tft,
    /// MAMBA-2 training (batch 32, L 256; CPU 4).
    Mamba2,
    /// DQN populations: N members trained in one step (`dqn_pop{N}_train_b{B}`; bench.py's
    /// `--models pop`).
    Pop,
    /// The environment cases only.
    Env,
    /// Host-to-device bandwidth only (CUDA).
    H2d,
    /// The GPU feed: stall fraction with and without double buffering.
    Loader,
    /// Everything.
    All,
}

/// Which compute precisions the training cases run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchPrecision {
    /// F32 (`eager_fp32`).
    F32,
    /// BF16 compute, F32 master weights (`eager_bf16`).
    Bf16,
    /// Both.
    All,
}

/// Where to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BenchDevice {
    /// The CPU (smaller batches, like bench.py --cpu).
    Cpu,
    /// The first CUDA device (needs a build with the `cuda` feature).
    Cuda,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Models to benchmark, comma-separated (e.g. `tft,mamba2`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "all")]
    pub model: Vec<BenchModel>,
    /// Compute precision of the training cases.
    #[arg(long, value_enum, default_value_t = BenchPrecision::All)]
    pub precision: BenchPrecision,
    /// Print one JSON document {"meta": ..., "results": [...]} (bench.py's shape) instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Timed steps per training case (default 100; 5 with --quick).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Smoke test: 5 timed steps, 2 warm-up steps, 50 latency calls.
    #[arg(long)]
    pub quick: bool,
    /// Device (default: cuda when built with it and one is present, else cpu).
    #[arg(long, value_enum)]
    pub device: Option<BenchDevice>,
}

/// The two networks with training and latency cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Model {
    Dqn,
    Ppo,
    Tft,
    Mamba2,
}

impl Model {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Model::Dqn => "dqn",
            Model::Ppo => "ppo",
            Model::Tft => "tft",
            Model::Mamba2 => "mamba2",
        }
    }
}

/// What to run (sizes and counts), decided from the flags and the device.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) train: Vec<(Model, Vec<usize>)>,
    /// Population cases: (model, members, batch per member).
    pub(crate) pop: Vec<(Model, usize, usize)>,
    pub(crate) precisions: Vec<Precision>,
    pub(crate) latency: Vec<Model>,
    /// TFT / MAMBA-2 inference cases.
    pub(crate) seq_infer: Vec<seq_infer::SeqInfer>,
    /// Batch of the `*_infer_b{N}` throughput cases (0: none), for the models in `latency`.
    pub(crate) infer_batch: usize,
    pub(crate) env_e: Option<usize>,
    pub(crate) env_series: usize,
    /// Buffer sizes (f32 count) of the upload cases; empty off CUDA.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) h2d: Vec<usize>,
    /// The `loader_*` cases.
    pub(crate) loader: bool,
    pub(crate) warmup: usize,
    pub(crate) steps: usize,
    pub(crate) lat_warm: usize,
    pub(crate) lat_n: usize,
    pub(crate) env_n: usize,
    pub(crate) quick: bool,
}

impl Plan {
    fn from_args(args: &BenchArgs, cuda: bool) -> Self {
        let q = args.quick;
        let want = |x: BenchModel| args.model.iter().any(|&m| m == x || m == BenchModel::All);
        let (dqn_b, ppo_b) = if cuda { (vec![8192, 2048, 230], vec![2048]) } else { (vec![1024, 230], vec![512]) };
        let mut train = Vec::new();
        let mut latency = Vec::new();
        if want(BenchModel::Dqn) {
            train.push((Model::Dqn, dqn_b));
            latency.push(Model::Dqn);
        }
        if want(BenchModel::Ppo) {
            train.push((Model::Ppo, ppo_b));
            latency.push(Model::Ppo);
        }
        // bench.py's sizes: TFT 256 / MAMBA-2 32 on the GPU, 8 / 4 on the CPU.
        if want(BenchModel::Tft) {
            train.push((Model::Tft, vec![if cuda { 256 } else { 8 }]));
        }
        if want(BenchModel::Mamba2) {
            train.push((Model::Mamba2, vec![if cuda { 32 } else { 4 }]));
        }
        let precisions = match args.precision {
            BenchPrecision::F32 => vec![Precision::F32],
            BenchPrecision::Bf16 => vec![Precision::Bf16],
            BenchPrecision::All => vec![Precision::F32, Precision::Bf16],
        };
        // bench.py's POP_SIZES on the GPU, its CPU size (8 members of batch 64) on the CPU.
        let pop = match (want(BenchModel::Pop), cuda) {
            (false, _) => Vec::new(),
            (true, true) => vec![(Model::Dqn, 64, 256), (Model::Dqn, 256, 256), (Model::Ppo, 64, 512)],
            (true, false) => vec![(Model::Dqn, 8, 64), (Model::Ppo, 8, 64)],
        };
        Plan {
            train,
            pop,
            precisions,
            latency,
            seq_infer: seq_infer::SeqInfer::cases(want(BenchModel::Tft), want(BenchModel::Mamba2), cuda),
            infer_batch: 256,
            env_e: want(BenchModel::Env).then_some(if cuda { 4096 } else { 512 }),
            env_series: if cuda { 100_000 } else { 20_000 },
            // 64 MiB, and one DQN batch of 8192 transitions (s, a, r, s', done: 115 f32 each).
            h2d: if cuda && want(BenchModel::H2d) { vec![16 << 20, 8192 * 115] } else { Vec::new() },
            loader: want(BenchModel::Loader),
            warmup: if q { 2 } else { 10 },
            steps: args.steps.unwrap_or(if q { 5 } else { 100 }).max(1),
            lat_warm: if q { 10 } else { 200 },
            lat_n: if q { 50 } else { 2000 },
            env_n: if q { 10 } else { 200 },
            quick: q,
        }
    }
}

/// What every case needs: the device, the timer, the memory probe and the counts.
pub(crate) struct Ctx {
    pub(crate) device: Device,
    pub(crate) timer: StepTimer,
    pub(crate) mem: MemProbe,
    pub(crate) warmup: usize,
    pub(crate) steps: usize,
    pub(crate) lat_warm: usize,
    pub(crate) lat_n: usize,
    pub(crate) env_n: usize,
    pub(crate) env_series: usize,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) quick: bool,
}

impl Ctx {
    fn new(device: Device, plan: &Plan) -> Result<Self> {
        Ok(Ctx {
            timer: StepTimer::for_device(&device)?,
            mem: MemProbe::for_device(&device),
            device,
            warmup: plan.warmup,
            steps: plan.steps,
            lat_warm: plan.lat_warm,
            lat_n: plan.lat_n,
            env_n: plan.env_n,
            env_series: plan.env_series,
            quick: plan.quick,
        })
    }

    fn device_label(&self) -> &'static str {
        if self.device.is_cuda() {
            "cuda"
        } else {
            "cpu"
        }
    }
}

/// The case's identity fields, as bench.py writes them first.
fn base(ctx: &Ctx, case: String, kind: &str, model: &str, mode: &str, batch: usize) -> Record {
    let mut r = Record::new();
    r.insert("case".into(), json!(case));
    r.insert("kind".into(), json!(kind));
    r.insert("model".into(), json!(model));
    r.insert("mode".into(), json!(mode));
    r.insert("batch".into(), json!(batch));
    r.insert("device".into(), json!(ctx.device_label()));
    r
}

/// Runs one case; an error becomes `status: "error"` with the message (the run goes on).
fn guarded(
    ctx: &mut Ctx,
    t_start: Instant,
    mut rec: Record,
    f: impl FnOnce(&mut Ctx, &mut Record) -> Result<()>,
) -> Record {
    if let Err(e) = f(ctx, &mut rec) {
        rec.insert("status".into(), json!("error"));
        let msg: String = format!("{e:#}").chars().take(400).collect();
        rec.insert("error".into(), json!(msg));
    }
    if let Some(m) = ctx.mem.method() {
        rec.insert("mem_method".into(), json!(m));
    }
    rec.insert("t_elapsed_s".into(), json!(timing::round(t_start.elapsed().as_secs_f64(), 1)));
    eprintln!("bench: {}", summary_line(&rec));
    rec
}

/// Every case of `plan`, in bench.py's order.
pub(crate) fn run_cases(ctx: &mut Ctx, plan: &Plan) -> Vec<Record> {
    let t0 = Instant::now();
    let mut out = Vec::new();
    for (model, batches) in &plan.train {
        for &b in batches {
            for &p in &plan.precisions {
                // Captured-graph modes on CUDA, after the eager ones.
                for graph in [false, true] {
                    if graph && !ctx.device.is_cuda() {
                        continue;
                    }
                    let mode = train::mode_name(p, graph);
                    let rec = base(ctx, format!("{}_train_b{b}", model.name()), "train", model.name(), mode, b);
                    rec_timing(ctx, &mut out, t0, rec, |ctx, r| train::train_case(ctx, *model, b, p, graph, r));
                }
            }
        }
    }
    for &(model, n, b) in &plan.pop {
        for &p in &plan.precisions {
            for graph in [false, true] {
                if graph && !ctx.device.is_cuda() {
                    continue;
                }
                let mode = train::mode_name(p, graph);
                let name = model.name();
                let mut rec = base(ctx, format!("{name}_pop{n}_train_b{b}"), "train", name, mode, b);
                rec.insert("members".into(), json!(n));
                rec_timing(ctx, &mut out, t0, rec, |ctx, r| train::pop_case(ctx, model, n, b, p, graph, r));
            }
        }
    }
    for &model in &plan.latency {
        for mode in latency::LatencyMode::for_device(ctx.device.is_cuda()) {
            let rec = base(ctx, format!("{}_infer_b1", model.name()), "latency", model.name(), mode.name(), 1);
            out.push(guarded(ctx, t0, rec, |ctx, r| latency::latency_case(ctx, model, mode, r)));
        }
    }
    for &model in plan.latency.iter().filter(|_| plan.infer_batch > 0) {
        let b = plan.infer_batch;
        for mode in latency::LatencyMode::for_throughput(ctx.device.is_cuda()) {
            let rec = base(ctx, format!("{}_infer_b{b}", model.name()), "infer", model.name(), mode.name(), b);
            out.push(guarded(ctx, t0, rec, |ctx, r| latency::throughput_case(ctx, model, mode, b, r)));
        }
    }
    for &what in &plan.seq_infer {
        for &mode in what.modes(&ctx.device) {
            let rec = base(ctx, what.case(), what.kind(), what.model(), mode, what.batch());
            out.push(guarded(ctx, t0, rec, |ctx, r| seq_infer::seq_infer_case(ctx, what, mode, r)));
        }
    }
    if let Some(e) = plan.env_e {
        for what in [EnvWhat::Step, EnvWhat::DqnCollect] {
            for &mode in what.modes(ctx.device.is_cuda()) {
                // A view is its own (fx-only) case, so the best mode of bench.py's case
                // stays the plain series'.
                let (view, plain) = match mode.strip_suffix("_view") {
                    Some(m) => ("_view", m),
                    None => ("", mode),
                };
                let rec = base(ctx, format!("{}{view}_E{e}", what.case_prefix()), "env", "env", plain, e);
                out.push(guarded(ctx, t0, rec, |ctx, r| env_step::env_case(ctx, what, mode, e, r)));
            }
        }
    }
    #[cfg(feature = "cuda")]
    for &floats in &plan.h2d {
        for pinned in [true, false] {
            let mode = if pinned { "pinned" } else { "pageable" };
            let case = format!("h2d_{:.1}MiB", (floats * 4) as f64 / (1u64 << 20) as f64);
            let rec = base(ctx, case, "h2d", "h2d", mode, floats);
            out.push(guarded(ctx, t0, rec, |ctx, r| env_step::h2d_case(ctx, pinned, floats, r)));
        }
    }
    if plan.loader {
        let b = loader::sizes(ctx.device.is_cuda(), ctx.quick).batch;
        for sc in loader::Scenario::ALL {
            for mode in loader::Mode::ALL {
                let rec = base(ctx, sc.case().into(), "loader", "loader", mode.name(), b);
                out.push(guarded(ctx, t0, rec, |ctx, r| loader::loader_case(ctx, sc, mode, r)));
            }
        }
    }
    out
}

/// A training case with its timing method noted.
fn rec_timing(
    ctx: &mut Ctx,
    out: &mut Vec<Record>,
    t0: Instant,
    mut rec: Record,
    f: impl FnOnce(&mut Ctx, &mut Record) -> Result<()>,
) {
    rec.insert("timing".into(), json!(ctx.timer.method()));
    out.push(guarded(ctx, t0, rec, f));
}

/// Relative Frobenius error of a 512³ F32 matmul on the device against F64 on the CPU:
/// ~1e-7 with TF32 off, ~1e-3 with it on (bench.py's `fp32_matmul_rel_err`).
fn fp32_matmul_rel_err(device: &Device) -> Result<f64> {
    let n = 512;
    let a = Tensor::from_vec(data::normals(5, 40, n * n), (n, n), &Device::Cpu)?.to_dtype(DType::F64)?;
    let b = Tensor::from_vec(data::normals(5, 41, n * n), (n, n), &Device::Cpu)?.to_dtype(DType::F64)?;
    let want = a.matmul(&b)?;
    let da = a.to_dtype(DType::F32)?.to_device(device)?;
    let db = b.to_dtype(DType::F32)?.to_device(device)?;
    let got = da.matmul(&db)?.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let err = (got - &want)?.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?;
    let norm = want.sqr()?.sum_all()?.sqrt()?.to_scalar::<f64>()?;
    Ok(err / norm)
}

/// The device the flags ask for, and the GPU's name from the hardware budget.
fn pick_device(req: Option<BenchDevice>) -> Result<(Device, Option<String>)> {
    let want = match req {
        None => "auto",
        Some(BenchDevice::Cpu) => "cpu",
        Some(BenchDevice::Cuda) => "cuda",
    };
    let budget = fx_hw::HardwareBudget::detect_with(&fx_hw::Overrides::default().try_with_device(want)?);
    match budget.device.value {
        fx_hw::DeviceKind::Cuda(n) => {
            let name = budget.gpu.as_ref().map(|g| g.name.clone());
            Ok((crate::run_start::open_cuda(n)?, name))
        }
        fx_hw::DeviceKind::Cpu => {
            if req == Some(BenchDevice::Cuda) {
                let why = budget.cpu_fallback_reason.unwrap_or_else(|| "no CUDA device".into());
                bail!("--device cuda: no usable GPU ({why})");
            }
            Ok((Device::Cpu, None))
        }
    }
}

fn meta(ctx: &Ctx, plan: &Plan, gpu: Option<String>) -> Record {
    let mut m = Record::new();
    m.insert("kind".into(), json!("meta"));
    m.insert("fx_version".into(), json!(env!("CARGO_PKG_VERSION")));
    m.insert("device".into(), json!(ctx.device_label()));
    m.insert("gpu".into(), json!(gpu));
    m.insert("quick".into(), json!(plan.quick));
    // candle's F32 GEMMs on CUDA use full precision unless set_gemm_reduced_precision_f32(true)
    // (the CPU build's stub answers true, but CPU GEMMs have no TF32).
    let tf32 = ctx.device.is_cuda() && candle_core::cuda::gemm_reduced_precision_f32();
    m.insert("tf32_matmul".into(), json!(tf32));
    m.insert("tf32_cudnn".into(), json!(false));
    m.insert("warmup_steps".into(), json!(plan.warmup));
    m.insert("timed_steps".into(), json!(plan.steps));
    m.insert("latency_calls".into(), json!(plan.lat_n));
    let graphs: &[bool] = if ctx.device.is_cuda() { &[false, true] } else { &[false] };
    let modes: Vec<&str> =
        plan.precisions.iter().flat_map(|&p| graphs.iter().map(move |&g| train::mode_name(p, g))).collect();
    m.insert("precision_modes".into(), json!(modes));
    m.insert("timing".into(), json!(ctx.timer.method()));
    m.insert("mem_method".into(), json!(ctx.mem.method()));
    m.insert(
        "step".into(),
        json!(
            "eager_*: DqnTrainer::update / PpoTrainer::update_minibatch (TrainStep: one loss+grad-norm read per step); \
             graph_*: the same update captured once as a CUDA graph with the fused device-side guard/clip/optimiser \
             (+ DQN target update), replayed per step with no host read (update_queued)"
        ),
    );
    match fp32_matmul_rel_err(&ctx.device) {
        Ok(e) => m.insert("fp32_matmul_rel_err".into(), json!(e)),
        Err(e) => m.insert("fp32_matmul_rel_err_error".into(), json!(format!("{e:#}"))),
    };
    m
}

pub fn run(args: &BenchArgs) -> Result<()> {
    let t0 = Instant::now();
    // The RL networks are small: the thread count a training run would use for them
    // (`fx_hw::cpu_threads`, FX_THREADS overrides), set before any tensor work.
    let threads = fx_hw::cpu_threads(None, true)?;
    fx_hw::apply_cpu_threads(threads.value);
    let (device, gpu) = pick_device(args.device)?;
    let plan = Plan::from_args(args, device.is_cuda());
    let mut ctx = Ctx::new(device, &plan)?;
    let mut meta = meta(&ctx, &plan, gpu);
    meta.insert(
        "cpu_threads".into(),
        json!({ "value": threads.value, "source": threads.source.to_string(), "usable_cpus": fx_hw::usable_cpus() }),
    );
    eprintln!("bench: {}", serde_json::to_string(&meta)?);
    let results = run_cases(&mut ctx, &plan);
    let n_err = results.iter().filter(|r| r.get("status") != Some(&json!("ok"))).count();
    let total_s = timing::round(t0.elapsed().as_secs_f64(), 1);
    if args.json {
        let doc = json!({ "meta": meta, "results": results, "total_s": total_s });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", table(&results));
        println!("bench done in {total_s} s: {} ok, {n_err} errors", results.len() - n_err);
    }
    if n_err > 0 {
        bail!("{n_err} bench case(s) failed (see their `error` fields)");
    }
    Ok(())
}

fn fmt_num(v: Option<&Value>, nd: usize) -> String {
    match v {
        Some(Value::Number(n)) => match n.as_f64() {
            Some(x) if n.is_f64() && x.abs() >= 1e6 => format!("{x:.3e}"),
            Some(x) if n.is_f64() => format!("{x:.nd$}"),
            _ => n.to_string(),
        },
        Some(Value::String(s)) => s.clone(),
        _ => "-".into(),
    }
}

fn status_text(r: &Record) -> String {
    let s = r.get("status").and_then(Value::as_str).unwrap_or("?");
    match r.get("error").and_then(Value::as_str) {
        Some(e) => format!("{s}: {}", e.chars().take(60).collect::<String>()),
        None => s.to_string(),
    }
}

fn summary_line(r: &Record) -> String {
    let g = |k: &str| r.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
    let value = if let Some(v) = r.get("stall_frac") {
        format!(
            "stall {}, {} ms/batch wall, {} ms/batch compute",
            fmt_num(Some(v), 4),
            fmt_num(r.get("wall_ms_per_batch"), 3),
            fmt_num(r.get("compute_ms_per_batch"), 3)
        )
    } else if let Some(v) = r.get("samples_per_s") {
        format!("{} samples/s, {} ms/step", fmt_num(Some(v), 1), fmt_num(r.get("step_ms_median"), 3))
    } else if let Some(v) = r.get("p50_us") {
        format!("p50 {} us, p99 {} us", fmt_num(Some(v), 1), fmt_num(r.get("p99_us"), 1))
    } else if let Some(v) = r.get("env_steps_per_s") {
        format!("{} env-steps/s", fmt_num(Some(v), 1))
    } else if let Some(v) = r.get("gb_per_s") {
        format!("{} GB/s", fmt_num(Some(v), 2))
    } else {
        String::new()
    };
    format!("{} {} {} [{}]", g("case"), g("mode"), value, status_text(r))
}

/// bench.py's table layout.
fn table(rows: &[Record]) -> String {
    let hdr = [
        "case",
        "mode",
        "batch",
        "samples/s",
        "step ms",
        "p50 us",
        "p99 us",
        "env steps/s",
        "GB/s",
        "peak MiB",
        "stall",
        "status",
    ];
    let mut t: Vec<Vec<String>> = vec![hdr.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        t.push(vec![
            fmt_num(r.get("case"), 0),
            fmt_num(r.get("mode"), 0),
            fmt_num(r.get("batch"), 0),
            fmt_num(r.get("samples_per_s"), 1),
            fmt_num(r.get("step_ms_median"), 3),
            fmt_num(r.get("p50_us"), 1),
            fmt_num(r.get("p99_us"), 1),
            fmt_num(r.get("env_steps_per_s"), 1),
            fmt_num(r.get("gb_per_s"), 2),
            fmt_num(r.get("peak_mem_mib"), 1),
            fmt_num(r.get("stall_frac"), 4),
            status_text(r),
        ]);
    }
    let w: Vec<usize> = (0..hdr.len()).map(|i| t.iter().map(|row| row[i].chars().count()).max().unwrap_or(0)).collect();
    let mut out = String::from("\n");
    for (i, row) in t.iter().enumerate() {
        let cells: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(j, c)| if j < 2 || j == hdr.len() - 1 { format!("{c:<0$}", w[j]) } else { format!("{c:>0$}", w[j]) })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            out.push_str(&w.iter().map(|&n| "-".repeat(n)).collect::<Vec<_>>().join("  "));
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny CPU plan: every case kind, a few steps.
    fn tiny_plan() -> Plan {
        Plan {
            train: vec![(Model::Dqn, vec![32]), (Model::Ppo, vec![16])],
            pop: vec![(Model::Dqn, 3, 8), (Model::Ppo, 3, 8)],
            precisions: vec![Precision::F32, Precision::Bf16],
            latency: vec![Model::Dqn, Model::Ppo],
            seq_infer: Vec::new(),
            infer_batch: 16,
            env_e: Some(8),
            env_series: 400,
            h2d: Vec::new(),
            loader: false,
            warmup: 1,
            steps: 3,
            lat_warm: 1,
            lat_n: 5,
            env_n: 3,
            quick: true,
        }
    }

    /// The TFT and MAMBA-2 cases on the CPU (bench.py's default models, small batches, one
    /// timed step): training in both precisions with finite losses, inference with
    /// positive latencies (the TFT also in INT8, the MAMBA-2 step also on the CPU in F32 and
    /// INT8).
    #[test]
    fn sequence_model_cases_run() {
        let plan = Plan {
            train: vec![(Model::Tft, vec![2]), (Model::Mamba2, vec![1])],
            precisions: vec![Precision::F32],
            latency: Vec::new(),
            seq_infer: seq_infer::SeqInfer::cases(true, true, false),
            warmup: 0,
            steps: 1,
            lat_warm: 1,
            lat_n: 8,
            env_e: None,
            pop: Vec::new(),
            ..tiny_plan()
        };
        let mut ctx = Ctx::new(Device::Cpu, &plan).unwrap();
        let recs = run_cases(&mut ctx, &plan);
        let got: Vec<(&str, &str, &str)> = recs
            .iter()
            .map(|r| (r["case"].as_str().unwrap(), r["mode"].as_str().unwrap(), r["status"].as_str().unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                ("tft_train_b2", "eager_fp32", "ok"),
                ("mamba2_train_b1", "eager_fp32", "ok"),
                ("tft_infer_b1", "eager_fp32", "ok"),
                ("tft_infer_b1", "int8", "ok"),
                ("tft_infer_b8", "eager_fp32", "ok"),
                ("tft_infer_b8", "int8", "ok"),
                ("mamba2_step_b1", "eager_fp32", "ok"),
                ("mamba2_step_b1", "cpu_fp32", "ok"),
                ("mamba2_step_b1", "int8", "ok"),
            ],
            "{recs:#?}"
        );
        // The INT8 TFT's forecasts are near candle's F32 ones, with under a third of the bytes.
        for r in [&recs[3], &recs[5]] {
            assert!(num(r, "rel_err_vs_candle") < 0.05, "{r:?}");
            assert!(num(r, "param_bytes") * 3.0 < num(r, "param_bytes_f32"), "{r:?}");
        }
        // The CPU step's first prediction equals candle's step to F32 rounding; the INT8
        // step's is near it, with a quarter of the projections' bytes.
        assert!(num(&recs[7], "rel_err_vs_candle") < 1e-5, "{:?}", recs[7]);
        assert!(num(&recs[8], "rel_err_vs_candle") < 0.1, "{:?}", recs[8]);
        assert!(num(&recs[8], "projection_bytes") * 3.0 < num(&recs[7], "projection_bytes"), "{:?}", recs[8]);
        assert!(num(&recs[0], "loss_last").is_finite() && num(&recs[1], "tokens_per_s") > 0.0);
        assert_eq!(recs[1]["seq_len"], 256);
        for r in &recs[2..] {
            assert!(num(r, "p50_us") > 0.0 && num(r, "p50_us") <= num(r, "p99_us"), "{r:?}");
        }
        assert!(num(&recs[4], "samples_per_s") > 0.0 && num(&recs[5], "samples_per_s") > 0.0);
    }

    fn num(r: &Record, k: &str) -> f64 {
        r.get(k).and_then(Value::as_f64).unwrap_or_else(|| panic!("{k} missing or not a number in {r:?}"))
    }

    #[test]
    fn records_have_what_compare_py_reads() {
        let plan = tiny_plan();
        let mut ctx = Ctx::new(Device::Cpu, &plan).unwrap();
        let recs = run_cases(&mut ctx, &plan);
        // 2 models x 1 batch x 2 precisions, 2 populations x 2 precisions, 2 models x 4 latency
        // modes, 2 models x 4 throughput modes, 2 env
        assert_eq!(recs.len(), 26, "{recs:#?}");
        for r in &recs {
            assert_eq!(r.get("status"), Some(&json!("ok")), "{r:?}");
            for k in ["case", "kind", "model", "mode", "device"] {
                assert!(r.get(k).and_then(Value::as_str).is_some(), "{k} missing in {r:?}");
            }
            assert!(r.get("batch").and_then(Value::as_u64).is_some());
            // compare.py formats memory: present (null on the CPU)
            assert_eq!(r.get("peak_mem_mib"), Some(&Value::Null), "{r:?}");
            assert_eq!(r.get("peak_reserved_mib"), Some(&Value::Null), "{r:?}");
            assert!(r.get("mem_method").is_none(), "{r:?}");
        }
        let train: Vec<&Record> = recs.iter().filter(|r| r["kind"] == "train").collect();
        assert_eq!(train.len(), 8);
        let cases: Vec<(&str, &str)> =
            train.iter().map(|r| (r["case"].as_str().unwrap(), r["mode"].as_str().unwrap())).collect();
        assert_eq!(
            cases,
            [
                ("dqn_train_b32", "eager_fp32"),
                ("dqn_train_b32", "eager_bf16"),
                ("ppo_train_b16", "eager_fp32"),
                ("ppo_train_b16", "eager_bf16"),
                ("dqn_pop3_train_b8", "eager_fp32"),
                ("dqn_pop3_train_b8", "eager_bf16"),
                ("ppo_pop3_train_b8", "eager_fp32"),
                ("ppo_pop3_train_b8", "eager_bf16")
            ]
        );
        for r in &train {
            let sps = num(r, "samples_per_s");
            assert!(sps.is_finite() && sps > 0.0, "{r:?}");
            let wall = num(r, "samples_per_s_wall");
            assert!(wall.is_finite() && wall > 0.0, "{r:?}");
            let (p10, med, p90) = (num(r, "step_ms_p10"), num(r, "step_ms_median"), num(r, "step_ms_p90"));
            assert!(p10 <= med && med <= p90 && p10 >= 0.0, "{r:?}");
            // samples/s is batch (times members, for populations) over the (rounded) median step
            let members = r.get("members").and_then(Value::as_f64).unwrap_or(1.0);
            let want = members * num(r, "batch") / (med / 1e3);
            assert!((sps - want).abs() <= 1e-3 * want + 1.0, "{sps} vs {want}");
            assert_eq!(num(r, "steps_timed"), 3.0);
            assert!(num(r, "loss_last").is_finite());
            assert!(num(r, "params") > 1000.0);
            assert_eq!(r["timing"], "host_clock");
        }
        let latency: Vec<&Record> = recs.iter().filter(|r| r["kind"] == "latency").collect();
        let modes: Vec<&str> = latency.iter().map(|r| r["mode"].as_str().unwrap()).collect();
        assert_eq!(
            modes,
            ["eager_fp32", "cpu_fp32", "int8", "int8_guarded", "eager_fp32", "cpu_fp32", "int8", "int8_guarded"]
        );
        for r in latency.iter().filter(|r| r["mode"].as_str().is_some_and(|m| m.starts_with("int8"))) {
            assert!(r["isa"].as_str().is_some_and(|s| !s.is_empty()), "{r:?}");
        }
        let infer: Vec<&Record> = recs.iter().filter(|r| r["kind"] == "infer").collect();
        let cases: Vec<(&str, &str)> =
            infer.iter().map(|r| (r["case"].as_str().unwrap(), r["mode"].as_str().unwrap())).collect();
        assert_eq!(
            cases,
            [
                ("dqn_infer_b16", "eager_fp32"),
                ("dqn_infer_b16", "cpu_fp32"),
                ("dqn_infer_b16", "int8"),
                ("dqn_infer_b16", "int8_guarded"),
                ("ppo_infer_b16", "eager_fp32"),
                ("ppo_infer_b16", "cpu_fp32"),
                ("ppo_infer_b16", "int8"),
                ("ppo_infer_b16", "int8_guarded")
            ]
        );
        for r in recs.iter().filter(|r| r["mode"] == "int8_guarded") {
            let (share, margin) = (num(r, "checked_share"), num(r, "decision_margin"));
            assert!((0.0..=1.0).contains(&share) && margin.is_finite() && margin >= 0.0, "{r:?}");
        }
        for r in &infer {
            let (p50, sps) = (num(r, "p50_us"), num(r, "samples_per_s"));
            assert!(p50 > 0.0 && (sps - 16.0 / (p50 / 1e6)).abs() <= 1e-3 * sps + 1.0, "{r:?}");
        }
        for r in latency {
            let (p50, p99, mean) = (num(r, "p50_us"), num(r, "p99_us"), num(r, "mean_us"));
            assert!(p50 > 0.0 && p50 <= p99 && mean > 0.0, "{r:?}");
            assert_eq!(num(r, "n"), 5.0);
            if r["mode"] == "cpu_fp32" {
                assert_eq!(r["matches_eager"], true, "{r:?}");
            }
        }
        let env: Vec<&Record> = recs.iter().filter(|r| r["kind"] == "env").collect();
        assert_eq!(env[0]["case"], "env_step_E8");
        assert_eq!(env[1]["case"], "dqn_collect_E8");
        for r in env {
            let s = num(r, "env_steps_per_s");
            assert!(s.is_finite() && s > 0.0);
            assert!((s / num(r, "calls_per_s") - 8.0).abs() < 1e-3 * 8.0 + 1e-6, "{r:?}");
        }
        // the table prints every case
        let t = table(&recs);
        assert_eq!(t.lines().count(), 1 + 2 + recs.len());
    }

    #[test]
    fn a_failing_case_is_an_error_record_not_a_crash() {
        let plan = tiny_plan();
        let mut ctx = Ctx::new(Device::Cpu, &plan).unwrap();
        let rec = base(&ctx, "x".into(), "train", "dqn", "eager_fp32", 0);
        let r = guarded(&mut ctx, Instant::now(), rec, |ctx, r| {
            train::train_case(ctx, Model::Dqn, 0, Precision::F32, false, r)
        });
        assert_eq!(r["status"], "error");
        assert!(r["error"].as_str().unwrap().contains("DQN"), "{r:?}");
    }

    fn g_args() -> BenchArgs {
        BenchArgs {
            model: vec![BenchModel::All],
            precision: BenchPrecision::All,
            json: true,
            steps: None,
            quick: true,
            device: None,
        }
    }

    #[test]
    fn cpu_plan_uses_bench_py_cpu_sizes() {
        let args = BenchArgs {
            model: vec![BenchModel::All],
            precision: BenchPrecision::All,
            json: true,
            steps: None,
            quick: true,
            device: None,
        };
        let p = Plan::from_args(&args, false);
        assert_eq!(p.train[0], (Model::Dqn, vec![1024, 230]));
        assert_eq!(p.train[1], (Model::Ppo, vec![512]));
        assert_eq!(p.env_e, Some(512));
        assert_eq!((p.steps, p.warmup), (5, 2));
        assert_eq!(p.train[2..], [(Model::Tft, vec![8]), (Model::Mamba2, vec![4])]);
        let g = Plan::from_args(&BenchArgs { quick: false, steps: Some(7), ..args }, true);
        assert_eq!(g.train[0], (Model::Dqn, vec![8192, 2048, 230]));
        assert_eq!(g.train[1], (Model::Ppo, vec![2048]));
        assert_eq!(g.train[2..], [(Model::Tft, vec![256]), (Model::Mamba2, vec![32])]);
        assert_eq!((g.steps, g.warmup, g.lat_n), (7, 10, 2000));
        // A comma list picks several models.
        let s = Plan::from_args(
            &BenchArgs { model: vec![BenchModel::Tft, BenchModel::Mamba2], quick: false, steps: None, ..g_args() },
            true,
        );
        assert_eq!(s.train, [(Model::Tft, vec![256]), (Model::Mamba2, vec![32])]);
        assert_eq!(s.seq_infer.len(), 3);
        assert!(s.latency.is_empty() && s.env_e.is_none());
    }
}
